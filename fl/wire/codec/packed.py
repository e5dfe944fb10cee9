"""Value stages below 8 bits (q4, q2): symmetric codes packed several to a byte.

Metric grafting's bits action serves AdaQuantFL-style widths under 8 (`graft-bits` 4 or
2); q8 stays int8 in `encodings.py`. A b-bit stage keeps codes in [-(2^(b-1) - 1),
2^(b-1) - 1] (q4: -7..7, q2: -1..1), scale = max|x| / that bound, stores code + bound as
an unsigned b-bit field, 8 / b fields per uint8 byte (lowest bits first), and sends the
array's shape (int64) so the receiver can drop the padding. Bytes counted are the packed
bytes, the float32 scale and the shape: what really travels.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fl.wire.codec.core import CodecError, ValueStage, register_codec

FLOAT32 = np.dtype(np.float32)


class PackedQuantizer(ValueStage):
    """b-bit symmetric codes (b = 2 or 4), packed 8 / b to a byte, with scale and shape."""

    parts = ("scale", "shape")

    def __init__(self, bits: int) -> None:
        if bits not in (2, 4):
            raise ValueError("packed quantiser widths are 2 and 4 bits")
        self.bits, self.name = bits, f"q{bits}"
        self.bound = 2 ** (bits - 1) - 1
        self.per_byte = 8 // bits

    def encode(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """Codes rounded to nearest (error at most scale / 2); all zero when scale is 0."""
        scale = np.float32(np.abs(values).max(initial=0) / self.bound)
        codes = np.zeros(values.size, dtype=np.int64)
        if 0 < scale < np.inf:
            scaled = np.rint(values.reshape(-1) / np.float64(scale))
            codes = np.clip(scaled, -self.bound, self.bound).astype(np.int64)
        fields = np.zeros(-(-codes.size // self.per_byte) * self.per_byte, dtype=np.uint8)
        fields[: codes.size] = codes + self.bound
        packed = np.zeros(fields.size // self.per_byte, dtype=np.uint8)
        for j, lane in enumerate(fields.reshape(-1, self.per_byte).T):
            packed |= lane << np.uint8(self.bits * j)
        return {
            "": packed,
            "scale": np.array(scale, dtype=np.float32),
            "shape": np.array(values.shape, dtype=np.int64),
        }

    def decode(self, name: str, parts: Mapping[str, np.ndarray], dtype: np.dtype) -> np.ndarray:
        """codes x scale in the sent shape, once every part is well formed and in range."""
        packed, scale, shape = parts[""], parts["scale"], parts["shape"]
        label = f"{self.name} of {name}"
        if packed.dtype != np.uint8 or packed.ndim != 1:
            raise CodecError(f"{label}: codes are {packed.dtype} {packed.shape}, not 1-D uint8")
        if scale.dtype != FLOAT32 or scale.shape != ():
            raise CodecError(f"{label}: scale is {scale.dtype} {scale.shape}, not float32 ()")
        if not (np.isfinite(scale) and scale >= 0):
            raise CodecError(f"{label}: scale {scale} is not finite and non-negative")
        if shape.dtype != np.int64 or shape.ndim != 1 or shape.size > 8 or (shape < 0).any():
            raise CodecError(f"{label}: shape {shape} is not up to 8 non-negative int64 sizes")
        count = int(np.prod(shape.astype(object), initial=1))
        if packed.size != -(-count // self.per_byte):
            raise CodecError(f"{label}: {packed.size} bytes cannot hold {count} codes")
        mask = np.uint8(2**self.bits - 1)
        lanes = [(packed >> np.uint8(self.bits * j)) & mask for j in range(self.per_byte)]
        fields = np.stack(lanes, axis=1).reshape(-1)[:count].astype(np.int64)
        if (fields > 2 * self.bound).any():
            raise CodecError(f"{label}: a code lies outside [-{self.bound}, {self.bound}]")
        values = (fields - self.bound).astype(np.float32) * scale
        return values.reshape(tuple(int(s) for s in shape)).astype(dtype)


for _bits in (4, 2):
    register_codec(PackedQuantizer(_bits))

"""The built-in codecs (dense, masked, sparse, topk, grouped, lowrank), stages (q8, f16).

Every decoder treats its arrays as untrusted: dtype, shape, count, index range and
order, and scale finiteness are checked before any value reaches the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import torch
from flwr.app import ArrayRecord

from fl.wire.codec.core import (
    Codec,
    CodecError,
    Options,
    Payload,
    ValueStage,
    bitmap,
    encode,
    read,
    register_codec,
    require,
    unpack_bitmap,
)
from fl.wire.records import (
    Layout,
    array_record,
    arrays_to_vector,
    numpy_to_array,
    vector_to_arrays,
    wire_dtype,
)

FLOAT32 = np.dtype(np.float32)


def _float32(vector: torch.Tensor) -> np.ndarray:
    """`vector` as a contiguous float32 ndarray, the dtype values travel in."""
    return vector.detach().float().cpu().contiguous().numpy()


def _values(arrays: ArrayRecord, name: str, count: int, codec: str) -> torch.Tensor:
    """The `count` float32 values of untrusted 1-D array `name`."""
    raw = read(arrays, name)
    if raw.dtype != FLOAT32 or raw.ndim != 1:
        raise CodecError(f"{codec} {name} are {raw.dtype} of shape {raw.shape}, not float32 1-D")
    if raw.size != count:
        raise CodecError(f"{codec} payload has {raw.size} values for {count}")
    return torch.from_numpy(raw.copy())


def _base(options: Options, codec: str) -> torch.Tensor:
    """The receiver's base vector, which must match the layout."""
    base = require(options.base, f"{codec} payload needs the receiver's base vector")
    layout = require(options.layout, f"{codec} payload needs the receiver's layout")
    if base.numel() != layout.numel:
        raise CodecError(f"base has {base.numel()} scalars, the layout {layout.numel}")
    return base


def _layout_dtype(layout: Layout | None, name: str) -> np.dtype | None:
    """The float wire dtype of tensor `name` of `layout`; None for others and integers."""
    if layout is None or name not in layout.names:
        return None
    dtype = wire_dtype(layout.dtypes[layout.names.index(name)])
    return dtype if dtype.kind == "f" else None


class Dense(Codec):
    """Every scalar in its tensor's own array: Flower's usual ArrayRecord."""

    name = "dense"

    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        """One array per tensor, in its wire dtype."""
        return vector_to_arrays(vector, require(options.layout, "dense needs a layout"))

    def decode(self, arrays: ArrayRecord, options: Options) -> torch.Tensor:
        """The vector, once names, shapes and dtypes match the layout."""
        layout = require(options.layout, "dense needs a layout")
        try:
            return arrays_to_vector(arrays, layout)
        except (KeyError, ValueError, TypeError) as err:
            raise CodecError(f"dense payload does not fit the model: {err}") from err

    def value_dtype(self, name: str, options: Options) -> np.dtype | None:
        """Float tensors hold values; integer tensors (counters) stay raw."""
        return _layout_dtype(options.layout, name)


class Masked(Codec):
    """The scalars where a mask is True; the mask travels or is held.

    Without a layout the values travel as one array; with one (`encode_update` passes it
    under a value stage), as one array per tensor, `values.<i>`, so a stage scales each
    tensor on its own as it does dense ones: one scale for a whole model rounds a small
    layer's update to zero at 4 bits. The values' bytes are the same either way.
    """

    name = "masked"
    control = frozenset({"mask"})

    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        """The values, and with `ship_mask` the mask as a bitmap (d/8 bytes of control)."""
        mask = require(options.mask, "masked needs a mask")
        if mask.dtype != torch.bool or mask.shape != vector.shape:
            raise CodecError(f"mask is {mask.dtype} {tuple(mask.shape)}, not bool like vector")
        if options.layout is None:
            arrays = array_record({"values": numpy_to_array(_float32(vector[mask]))})
        else:
            if options.layout.numel != vector.numel():
                raise CodecError(
                    f"vector has {vector.numel()} scalars, the layout {options.layout.numel}"
                )
            sizes = list(options.layout.sizes)
            pieces = zip(vector.split(sizes), mask.split(sizes), strict=True)
            arrays = array_record(
                {f"values.{i}": numpy_to_array(_float32(v[m])) for i, (v, m) in enumerate(pieces)}
            )
        if options.ship_mask:
            arrays["mask"] = bitmap(mask)
        return arrays

    def decode(self, arrays: ArrayRecord, options: Options) -> torch.Tensor:
        """The base with the masked scalars replaced by the values sent."""
        base = _base(options, self.name)
        mask = unpack_bitmap(arrays["mask"], base.numel()) if "mask" in arrays else options.mask
        if mask is None:
            raise CodecError("masked payload carries no mask and the receiver has none")
        if mask.dtype != torch.bool or mask.shape != base.shape:
            raise CodecError(f"mask is {mask.dtype} {tuple(mask.shape)}, not bool like base")
        layout = require(options.layout, "masked payload needs the receiver's layout")
        per_tensor = "values" not in arrays
        names = [f"values.{i}" for i in range(len(layout.sizes))] if per_tensor else ["values"]
        if extra := sorted(set(arrays) - {*names, "mask"}):
            raise CodecError(f"masked payload has extra arrays {extra}")
        counts = mask.split(list(layout.sizes)) if per_tensor else [mask]
        values = [
            _values(arrays, n, int(m.sum()), self.name) for n, m in zip(names, counts, strict=True)
        ]
        out = base.clone()
        out[mask] = torch.cat(values)
        return out


def _check_indices(indices: np.ndarray, numel: int) -> None:
    """CodecError unless `indices` are strictly increasing positions in [0, numel)."""
    if indices.dtype.kind not in "iu" or indices.ndim != 1:
        raise CodecError(f"indices are {indices.dtype} of shape {indices.shape}, not 1-D integers")
    if indices.size and (indices.min() < 0 or indices.max() >= numel):
        raise CodecError(f"index {indices.min()}..{indices.max()} out of range [0, {numel})")
    steps = np.diff(indices.astype(np.int64))
    if (steps == 0).any():
        raise CodecError(f"index {indices[1:][steps == 0][0]} duplicated")
    if (steps < 0).any():
        raise CodecError("indices are not strictly increasing")


class Sparse(Codec):
    """Values at given positions, as int32 `indices` and float32 `values`."""

    name = "sparse"
    control = frozenset({"indices"})
    names = frozenset({"indices", "values"})

    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        """The values at `indices` (strictly increasing), and the indices."""
        indices = require(options.indices, f"{self.name} needs indices").cpu().numpy()
        _check_indices(indices, vector.numel())
        return array_record(
            {
                "indices": numpy_to_array(indices.astype(np.int32)),
                "values": numpy_to_array(
                    _float32(vector[torch.from_numpy(indices.astype(np.int64))])
                ),
            }
        )

    def decode(self, arrays: ArrayRecord, options: Options) -> torch.Tensor:
        """The base with the scalars at `indices` replaced by the values sent."""
        base = _base(options, self.name)
        indices = read(arrays, "indices")
        if indices.dtype != np.int32:
            raise CodecError(f"{self.name} indices are {indices.dtype}, not int32")
        _check_indices(indices, base.numel())
        out = base.clone()
        out[torch.from_numpy(indices.astype(np.int64))] = _values(
            arrays, "values", indices.size, self.name
        )
        return out


class TopK(Sparse):
    """The k scalars that moved most from the base, sent sparse."""

    name = "topk"

    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        """Sparse at the k largest |vector - base|, ties to the lower index."""
        base = require(options.base, "topk needs the base vector")
        if base.shape != vector.shape:
            raise CodecError(f"base is {tuple(base.shape)}, the vector {tuple(vector.shape)}")
        change = (vector - base).abs()
        order = torch.sort(change, descending=True, stable=True).indices
        top = order[: _count(options, vector.numel())].sort().values
        return super().encode(vector, replace(options, indices=top))


def _count(options: Options, numel: int) -> int:
    """k of a top-k encoding, given as `k` or as a `fraction` of the scalars (rounded up)."""
    fraction = options.fraction
    if fraction is None:
        k = require(options.k, "topk needs k or a fraction")
    elif options.k is None and 0 < fraction <= 1:
        k = math.ceil(fraction * numel)
    else:
        raise CodecError(f"topk needs k or a fraction in (0, 1], not k={options.k}, {fraction=}")
    if not 0 <= k <= numel:
        raise CodecError(f"topk k={k} is not in [0, {numel}]")
    return k


def _keys(groups: torch.Tensor, numel: int) -> torch.Tensor:
    """The group key of every scalar, checked: integers, one per scalar."""
    if groups.dtype.is_floating_point or groups.dtype == torch.bool or groups.shape != (numel,):
        raise CodecError(f"group keys are {groups.dtype} {tuple(groups.shape)}, not ({numel},) int")
    return groups


class Grouped(Codec):
    """One array `g{key}` per group of scalars sharing a key the receiver also holds."""

    name = "grouped"

    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        """The values of each group, smallest key first."""
        keys = _keys(require(options.groups, "grouped needs group keys"), vector.numel())
        return array_record(
            {
                f"g{key}": numpy_to_array(_float32(vector[keys == key]))
                for key in keys.unique().tolist()
            }
        )

    def decode(self, arrays: ArrayRecord, options: Options) -> torch.Tensor:
        """The vector, once the groups sent are exactly the receiver's."""
        layout = require(options.layout, "grouped needs a layout")
        groups = require(options.groups, "grouped payload needs the receiver's group keys")
        keys = _keys(groups, layout.numel)
        unique, counts = keys.unique(return_counts=True)
        expected = {f"g{k}": int(n) for k, n in zip(unique.tolist(), counts, strict=True)}
        missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
        if missing or extra:
            raise CodecError(f"grouped payload: missing arrays {missing}, extra {extra}")
        out = torch.empty(layout.numel)
        for name, count in expected.items():
            out[keys == int(name[1:])] = _values(arrays, name, count, self.name)
        return out


def _factored(shape: tuple[int, ...], dtype: torch.dtype, rank: int) -> bool:
    """Whether a tensor travels as rank-`rank` factors: 2-D float, and fewer scalars so."""
    return len(shape) == 2 and dtype.is_floating_point and rank * sum(shape) < math.prod(shape)


class LowRank(Codec):
    """Each 2-D float tensor as factors U (m x r) and V (r x n), the rest dense."""

    name = "lowrank"

    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        """Truncated-SVD factors `{name}:U`, `{name}:V` where they are smaller."""
        layout = require(options.layout, "lowrank needs a layout")
        rank = require(options.rank, "lowrank needs a rank")
        if rank < 1:
            raise CodecError(f"lowrank rank {rank} is not positive")
        arrays = vector_to_arrays(vector, layout)
        parts = torch.split(vector, list(layout.sizes))
        for name, shape, dtype, part in zip(
            layout.names, layout.shapes, layout.dtypes, parts, strict=True
        ):
            if _factored(shape, dtype, rank):
                u, s, vh = torch.linalg.svd(part.reshape(shape).double(), full_matrices=False)
                del arrays[name]
                arrays[f"{name}:U"] = numpy_to_array(_float32(u[:, :rank] * s[:rank]))
                arrays[f"{name}:V"] = numpy_to_array(_float32(vh[:rank]))
        return arrays

    def decode(self, arrays: ArrayRecord, options: Options) -> torch.Tensor:
        """The vector: U @ V for factored tensors, dense parts checked like `dense`."""
        layout = require(options.layout, "lowrank needs a layout")
        parts, used = [], set()
        for name, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes, strict=True):
            if name in arrays or not _factored(shape, dtype, 1):
                parts.append(_dense_part(read(arrays, name), name, shape, wire_dtype(dtype)))
                used.add(name)
            else:
                parts.append(
                    _product(read(arrays, f"{name}:U"), read(arrays, f"{name}:V"), name, shape)
                )
                used |= {f"{name}:U", f"{name}:V"}
        if extra := sorted(set(arrays) - used):
            raise CodecError(f"lowrank payload has extra arrays {extra}")
        return torch.cat(parts)

    def value_dtype(self, name: str, options: Options) -> np.dtype | None:
        """Factors and float tensors hold values."""
        stem, _, factor = name.rpartition(":")
        if factor in ("U", "V") and _layout_dtype(options.layout, stem) is not None:
            return FLOAT32
        return _layout_dtype(options.layout, name)


def _dense_part(
    value: np.ndarray, name: str, shape: tuple[int, ...], dtype: np.dtype
) -> torch.Tensor:
    """Flat float32 values of one dense tensor, checked against its shape and dtype."""
    if value.shape != shape or value.dtype != dtype:
        raise CodecError(f"{name} is {value.dtype} {value.shape}, expected {dtype} {shape}")
    return torch.from_numpy(value.astype(np.float32).reshape(-1))


def _product(u: np.ndarray, v: np.ndarray, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Flat U @ V of one factored tensor, checked against its shape."""
    if u.dtype != FLOAT32 or v.dtype != FLOAT32:
        raise CodecError(f"{name} factors are {u.dtype} and {v.dtype}, not float32")
    (m, n), rank = shape, u.shape[1] if u.ndim == 2 else 0
    if rank < 1 or u.shape != (m, rank) or v.shape != (rank, n):
        raise CodecError(f"{name} factors are {u.shape} and {v.shape}, not ({m}, r) and (r, {n})")
    return (torch.from_numpy(u.copy()) @ torch.from_numpy(v.copy())).reshape(-1)


class Q8(ValueStage):
    """int8 codes and a float32 scale per array: symmetric, scale = max|x| / 127."""

    name = "q8"
    parts = ("scale",)

    def encode(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """Codes rounded to nearest (error at most scale / 2); all zero when scale is 0."""
        scale = np.float32(np.abs(values).max(initial=0) / 127)
        codes = np.zeros(values.shape, dtype=np.int8)
        if 0 < scale < np.inf:
            codes = np.clip(np.rint(values / np.float64(scale)), -127, 127).astype(np.int8)
        return {"": codes, "scale": np.array(scale, dtype=np.float32)}

    def decode(self, name: str, parts: Mapping[str, np.ndarray], dtype: np.dtype) -> np.ndarray:
        """codes x scale, once codes are int8 and the scale a finite float32 >= 0."""
        codes, scale = parts[""], parts["scale"]
        if codes.dtype != np.int8:
            raise CodecError(f"q8 codes of {name} are {codes.dtype}, not int8")
        if scale.dtype != FLOAT32 or scale.shape != ():
            raise CodecError(f"q8 scale of {name} is {scale.dtype} {scale.shape}, not float32 ()")
        if not (np.isfinite(scale) and scale >= 0):
            raise CodecError(f"q8 scale of {name} is {scale}, not finite and non-negative")
        return (codes.astype(np.float32) * scale).astype(dtype)


class F16(ValueStage):
    """Values as float16: half the bytes of float32, about 3 significant digits."""

    name = "f16"

    def encode(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """The values rounded to float16."""
        return {"": values.astype(np.float16)}

    def decode(self, name: str, parts: Mapping[str, np.ndarray], dtype: np.dtype) -> np.ndarray:
        """The float16 values widened back to `dtype`."""
        if parts[""].dtype != np.float16:
            raise CodecError(f"f16 values of {name} are {parts[''].dtype}, not float16")
        return parts[""].astype(dtype)


for _codec in (Dense(), Masked(), Sparse(), TopK(), Grouped(), LowRank(), Q8(), F16()):
    register_codec(_codec)


def encode_dense(vector: torch.Tensor, layout: Layout) -> Payload:
    """Every scalar as a named tensor: Flower's usual ArrayRecord."""
    return encode(vector, "dense", layout=layout)


def encode_masked(vector: torch.Tensor, mask: torch.Tensor, *, ship_mask: bool) -> Payload:
    """Only the scalars where `mask` is True; with `ship_mask` the mask travels as a bitmap."""
    return encode(vector, "masked", mask=mask, ship_mask=ship_mask)


def encode_sparse(vector: torch.Tensor, indices: torch.Tensor) -> Payload:
    """The scalars at `indices` (strictly increasing); the receiver holds the rest."""
    return encode(vector, "sparse", indices=indices)


def encode_topk(
    vector: torch.Tensor, base: torch.Tensor, *, fraction: float | None = None, k: int | None = None
) -> Payload:
    """The k scalars (or a fraction, rounded up) that differ most from `base`, sent sparse."""
    return encode(vector, "topk", base=base, fraction=fraction, k=k)


def encode_grouped(vector: torch.Tensor, keys: torch.Tensor) -> Payload:
    """One array per group key (an integer per scalar the receiver also holds)."""
    return encode(vector, "grouped", groups=keys)


def encode_lowrank(vector: torch.Tensor, layout: Layout, rank: int) -> Payload:
    """2-D float tensors as rank-`rank` factors where smaller, the rest dense."""
    return encode(vector, "lowrank", layout=layout, rank=rank)

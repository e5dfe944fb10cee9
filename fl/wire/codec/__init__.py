"""Payload codecs with honest byte accounting, shared by every strategy.

An encoded payload is a pair of records in a message: `arrays` (an ArrayRecord) and
`codec` (a ConfigRecord: the chain's `name` and the bytes it puts on the link). A chain
is a registered codec, optionally followed by one value stage: "dense", "masked",
"sparse", "topk", "grouped", "lowrank", each alone or with "+q8" (int8 codes and a
float32 scale per array), "+q4" / "+q2" (codes packed 2 / 4 to a byte, `packed.py`) or
"+f16". `decode` reads any of them; strategies may
`register_codec` their own. Dense is Flower's usual one-Array-per-tensor record, so
stock Flower peers read it, and a payload without a `codec` record is read as dense.

Traffic is counted by the receiver from the arrays that arrived (`payload_traffic`):
the bytes of the values each array really holds (4 B per float32 scalar, 8 B per int64,
1 B per int8 code), never a size a sender declares. The `arrays` record's value arrays
(scales included) are payload; its positional metadata (a shipped mask bitmap, sparse
indices) and every other array record (`encode_control`, `with_control`) are control
state. Framing (.npy headers, protobuf) is not counted, so every engine reports the
same figures.
"""

from fl.wire.codec import packed as _packed  # noqa: F401  (registers q4, q2)
from fl.wire.codec.core import (
    ARRAYS,
    CODEC,
    Codec,
    CodecError,
    Options,
    Payload,
    Traffic,
    ValueStage,
    bitmap,
    codec_names,
    content_bytes,
    declared_traffic,
    decode,
    encode,
    encode_control,
    payload_traffic,
    read,
    register_codec,
    require,
    unpack_bitmap,
    with_control,
    with_control_bitmap,
)
from fl.wire.codec.encodings import (
    encode_dense,
    encode_grouped,
    encode_lowrank,
    encode_masked,
    encode_sparse,
    encode_topk,
)

__all__ = [
    "ARRAYS",
    "CODEC",
    "Codec",
    "CodecError",
    "Options",
    "Payload",
    "Traffic",
    "ValueStage",
    "bitmap",
    "codec_names",
    "content_bytes",
    "declared_traffic",
    "decode",
    "encode",
    "encode_control",
    "encode_dense",
    "encode_grouped",
    "encode_lowrank",
    "encode_masked",
    "encode_sparse",
    "encode_topk",
    "payload_traffic",
    "read",
    "register_codec",
    "require",
    "unpack_bitmap",
    "with_control",
    "with_control_bitmap",
]

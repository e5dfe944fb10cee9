"""Conversions between a model's state_dict, one flat vector and Flower's ArrayRecord.

Aggregation, masks and codecs all work on one flat float vector per model; `Layout`
remembers names, shapes and dtypes so the vector can become a state_dict again.

Flower's `Array` holds `np.save` bytes and reads them back with `np.load`, which
parses a Python-literal header per tensor: for small models that costs more than the
training step. We write the same `.npy` bytes from a cached header and read them with
`np.frombuffer`, so the wire format is unchanged and any Flower peer can read it.
"""

from __future__ import annotations

import io
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

__all__ = [
    "Layout",
    "array_record",
    "array_to_numpy",
    "arrays_to_vector",
    "dense_views",
    "items_of",
    "new_record",
    "npy_array",
    "numpy_to_array",
    "record_of",
    "required_record",
    "torch_state",
    "value_bytes",
    "vector_to_arrays",
    "wire_dtype",
]

NUMPY = "numpy.ndarray"  # Flower's SType for np.save payloads
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}
_NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex: nothing that needs parsing
AnyRecord = TypeVar("AnyRecord", ArrayRecord, ConfigRecord, MetricRecord)
_ALIGN = 16  # float32 scalars in 64 bytes: where torch's allocator starts every tensor


def record_of(content: RecordDict, key: str, kind: type[AnyRecord]) -> AnyRecord | None:
    """The record named `key` when it is a `kind`, else None.

    One dict lookup: Flower's `content.config_records` (and `array_records`,
    `metric_records`) rebuilds a type-checked view of every record on each access, which
    costs more than the rest of a small model's message path.
    """
    record = content.get(key)
    return record if isinstance(record, kind) else None


def items_of(record: ConfigRecord | MetricRecord) -> Mapping[str, Any]:
    """A record's items as a read-only view of its own dict: Flower's `TypedDict` reads
    (`[]`, `in`, `get`) are Python calls, ~0.5 µs each, which a cohort of a thousand
    members pays a dozen times a member on every round's configs."""
    return MappingProxyType(record.__dict__["_data"])


def required_record(content: RecordDict, key: str, kind: type[AnyRecord]) -> AnyRecord:
    """The record named `key`; KeyError naming what is missing unless it is a `kind`."""
    record = record_of(content, key, kind)
    if record is None:
        raise KeyError(f"message has no {kind.__name__} {key!r}")
    return record


@dataclass(frozen=True)
class Layout:
    """Names, shapes and dtypes of a state_dict, in order: the key to its flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> Layout:
        """Layout of a state_dict (or any name -> tensor mapping)."""
        return cls(
            tuple(state),
            tuple(tuple(t.shape) for t in state.values()),
            tuple(t.dtype for t in state.values()),
        )

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Number of scalars of each tensor."""
        return tuple(int(np.prod(s)) for s in self.shapes)

    @cached_property
    def numel(self) -> int:
        """Number of scalars in the whole model."""
        return sum(self.sizes)

    def flatten(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One float32 CPU vector holding every tensor of `state`, in layout order."""
        self.check(state)
        return torch.cat([state[n].detach().reshape(-1).float().cpu() for n in self.names])

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state_dict whose flat form is `vector` (views where dtypes allow)."""
        if vector.numel() != self.numel:
            raise ValueError(f"vector has {vector.numel()} scalars, layout expects {self.numel}")
        parts = torch.split(vector, list(self.sizes))
        return {
            name: part.reshape(shape).to(dtype)
            for name, part, shape, dtype in zip(
                self.names, parts, self.shapes, self.dtypes, strict=True
            )
        }

    def load_into(self, model: nn.Module, vector: torch.Tensor) -> None:
        """Copy `vector` into the model's parameters and buffers in place."""
        if vector.numel() != self.numel:
            raise ValueError(f"vector has {vector.numel()} scalars, layout expects {self.numel}")
        bound = _bound(model)
        with torch.no_grad():
            if bound is not None:
                bound.write(vector)
                return
            state = model.state_dict()
            for name, part in zip(self.names, torch.split(vector, list(self.sizes)), strict=True):
                state[name].copy_(part.view(state[name].shape))

    def read(self, model: nn.Module) -> torch.Tensor:
        """The model's parameters and buffers as one new float32 CPU vector (`flatten`)."""
        bound = _bound(model)
        if bound is None:
            return self.flatten(model.state_dict())
        return bound.read()

    def bind(self, model: nn.Module) -> None:
        """Keep the model's tensors as views of one float32 buffer, in layout order.

        Then `load_into` and `read` move the whole model in one operation instead of one
        per tensor, which for small models costs more than the copying. Each tensor starts
        64-byte aligned, as torch would allocate it, so kernels and results do not change.
        Models with other dtypes, several devices or shared tensors are left as they are.
        """
        state = model.state_dict(keep_vars=True)  # the Parameter and buffer objects
        self.check(state)
        tensors = tuple(state[name] for name in self.names)
        devices = {t.device for t in tensors}
        if set(self.dtypes) != {torch.float32} or len(devices) != 1:
            return
        if len({id(t) for t in tensors}) != len(tensors):
            return
        starts = [0]
        for size in self.sizes:
            starts.append(starts[-1] + -(-size // _ALIGN) * _ALIGN)
        storage = torch.zeros(starts[-1], dtype=torch.float32, device=devices.pop())
        with torch.no_grad():
            for tensor, start, size in zip(tensors, starts, self.sizes, strict=False):
                view = storage[start : start + size].view(tensor.shape)
                view.copy_(tensor)
                tensor.data = view
        index = None
        if starts[-1] != self.numel:
            spans = [torch.arange(a, a + n) for a, n in zip(starts, self.sizes, strict=False)]
            index = torch.cat(spans).to(storage.device)
        pointers = tuple(t.data_ptr() for t in tensors)
        _BINDINGS[model] = _Binding(storage, tensors, pointers, index, _slots(model, self.names))

    @cached_property
    def _name_set(self) -> frozenset[str]:
        return frozenset(self.names)

    @cached_property
    def wire(self) -> tuple[WireTensor, ...]:
        """How each tensor travels in a dense record: its slice of the vector and its
        `.npy` header, worked out once per layout instead of once per message."""
        out, start = [], 0
        for name, shape, size, dtype in zip(
            self.names, self.shapes, self.sizes, self.dtypes, strict=True
        ):
            wire = wire_dtype(dtype)
            dtype_name, header = _written(wire, shape)
            out.append(WireTensor(name, start, start + size, shape, wire, dtype_name, header))
            start += size
        return tuple(out)

    def check(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError naming the first key, shape or dtype that does not match."""
        missing = [n for n in self.names if n not in state]
        extra = [n for n in state if n not in self._name_set]
        if missing or extra:
            raise ValueError(f"keys differ from the model: missing {missing}, extra {extra}")
        for name, shape in zip(self.names, self.shapes, strict=True):
            if tuple(state[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(state[name].shape)}, expected {shape}")


@dataclass(frozen=True)
class WireTensor:
    """One tensor of a dense record: scalars `start:stop` of the flat vector, sent as
    a `.npy` payload of `dtype` (named `dtype_name`) and `shape` behind `header`."""

    name: str
    start: int
    stop: int
    shape: tuple[int, ...]
    dtype: np.dtype
    dtype_name: str
    header: bytes


@dataclass(frozen=True)
class _Binding:
    """A model whose parameters and buffers are views of `storage` (`Layout.bind`)."""

    storage: torch.Tensor
    tensors: tuple[torch.Tensor, ...]  # the model's own tensor objects, layout order
    pointers: tuple[int, ...]  # where each lives in `storage`
    index: torch.Tensor | None  # where the layout's scalars sit in `storage`, if padded
    slots: tuple[tuple[dict[str, Any], str, object], ...]  # (holder, key, what it held)

    def intact(self) -> bool:
        """Whether the model still holds these tensors and they still live in `storage`:
        `.to()` and `.data =` move a tensor; assigning a new submodule or parameter
        replaces one. A dict lookup and a pointer per tensor and module."""
        if any(holder.get(key) is not held for holder, key, held in self.slots):
            return False
        return all(t.data_ptr() == p for t, p in zip(self.tensors, self.pointers, strict=True))

    def write(self, vector: torch.Tensor) -> None:
        if self.index is None:
            self.storage.copy_(vector)
        else:
            self.storage.index_copy_(0, self.index, vector.to(self.storage))

    def read(self) -> torch.Tensor:
        if self.index is None:
            return self.storage.to("cpu", copy=True)
        return self.storage.index_select(0, self.index).cpu()


def _slots(
    model: nn.Module, names: tuple[str, ...]
) -> tuple[tuple[dict[str, Any], str, object], ...]:
    """Where the model holds each submodule and tensor of a state_dict's `names`."""
    slots: dict[tuple[int, str], tuple[dict[str, Any], str, object]] = {}
    for name in names:
        *path, leaf = name.split(".")
        module = model
        for key in path:
            child = module._modules[key]
            assert child is not None  # a state_dict name runs through real submodules
            slots[(id(module._modules), key)] = (module._modules, key, child)
            module = child
        holder = module._parameters if leaf in module._parameters else module._buffers
        slots[(id(holder), leaf)] = (holder, leaf, holder[leaf])
    return tuple(slots.values())


_BINDINGS: weakref.WeakKeyDictionary[nn.Module, _Binding] = weakref.WeakKeyDictionary()


def _bound(model: nn.Module) -> _Binding | None:
    """The model's binding while all its tensors still live in it, else None."""
    binding = _BINDINGS.get(model)
    return binding if binding is not None and binding.intact() else None


@lru_cache(maxsize=1024)
def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


AnyRecordDict = TypeVar("AnyRecordDict", ArrayRecord, ConfigRecord, MetricRecord, RecordDict)


# The scalar types a record's own value check accepts outright: a value of exactly one of
# these types (not a subclass) skips the call, whose outcome is known (Flower's checks
# rebuild `typing.get_args(...)` per value; a round's thousand instructions paid ~10 µs
# each). Lists, and every other kind, still go through the record's own check.
_PLAIN_VALUES: dict[type, frozenset[type]] = {
    ConfigRecord: frozenset({int, float, str, bytes, bool}),
    MetricRecord: frozenset({int, float}),  # MetricRecord refuses bool
}


def new_record(kind: type[AnyRecordDict], items: Mapping[str, Any]) -> AnyRecordDict:
    """A new Flower record of `kind` holding `items`, each passed through the record's
    own key and value checks, as `kind(items)` would.

    Flower's `TypedDict.__setitem__` builds two `typing.Callable[...]` aliases per item
    just to cast its checkers, three times the cost of the checks; a message carries a
    few dozen items, which made this ~5 % of a small model's round. Same checks, same
    record: `tests/test_records_codec.py` compares it with Flower's constructors.
    """
    record = kind()
    _fill(record, items)
    return record


def extended_record(base: AnyRecordDict, items: Mapping[str, Any]) -> AnyRecordDict:
    """A new record of `base`'s kind: `base`'s items (checked when it was made, not again)
    then `items`, each checked, as `new_record(kind, {**base, **items})` would make it.
    A round's instructions share most of their config; only each node's own keys are new."""
    record = type(base)()
    record.__dict__["_data"].update(base.__dict__["_data"])
    _fill(record, items)
    return record


def _fill(record: AnyRecordDict, items: Mapping[str, Any]) -> None:
    """`items` into `record`, each key and value checked as the record checks them."""
    fields = record.__dict__
    check_key, check_value = fields["_check_key_fn"], fields["_check_value_fn"]
    data, plain = fields["_data"], _PLAIN_VALUES.get(type(record), frozenset())
    for key, value in items.items():
        if type(key) is not str:
            check_key(key)
        if type(value) not in plain:
            check_value(value)
        data[key] = value


def array_record(arrays: Mapping[str, Array]) -> ArrayRecord:
    """An ArrayRecord holding these Arrays as they are.

    `ArrayRecord(dict_of_arrays)` rebuilds every Array (about 4x slower for small
    models); filling an empty record only type-checks them. Same content, same object id.
    """
    return new_record(ArrayRecord, arrays)


def numpy_to_array(value: np.ndarray) -> Array:
    """Flower Array holding exactly what `np.save` would write, without its overhead."""
    if not value.flags.c_contiguous:
        value = value.copy(order="C")
    name, header = _written(value.dtype, value.shape)
    return _npy_array(name, value.shape, header, value)


def _npy_array(dtype_name: str, shape: tuple[int, ...], header: bytes, value: np.ndarray) -> Array:
    """The Array `Array(dtype_name, shape, NUMPY, header + value's bytes)` builds.

    Flower's constructor sorts out which of its three signatures was meant and marks the
    object dirty once per field: 7 µs, half of encoding a small model. Our arguments are
    known to be the direct form's (a str, a tuple of ints, bytes), so the object is filled
    in as that form leaves it; `tests/test_records_codec.py` checks it is the same object.
    """
    data = b"".join((header, value.reshape(-1).view(np.uint8).data))  # one copy
    return npy_array(dtype_name, shape, data)


def npy_array(dtype_name: str, shape: tuple[int, ...], data: bytes) -> Array:
    """`Array(dtype_name, shape, NUMPY, data)` for `.npy` bytes we wrote, filled in as
    Flower's direct form leaves it (see `_npy_array`), without copying `data`."""
    array = object.__new__(Array)
    array.__dict__.update(_is_dirty=True, dtype=dtype_name, shape=shape, stype=NUMPY, data=data)
    return array


@lru_cache(maxsize=1024)
def _written(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[str, bytes]:
    """The dtype name and .npy header `numpy_to_array` writes for an array."""
    return str(dtype), _npy_header(str(np.lib.format.dtype_to_descr(dtype)), shape)


def wire_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype a tensor of `dtype` travels as (float32 for types NumPy lacks)."""
    return _NUMPY_DTYPES.get(dtype, np.dtype(np.float32))


@lru_cache(maxsize=1024)
def _declared(dtype_name: str, shape: tuple[int, ...]) -> tuple[np.dtype, bytes, int]:
    """The plain numeric dtype an Array declares, the header we would write for it and the
    bytes of its values; ValueError if absurd. Cached: arrays repeat a model's few shapes."""
    try:
        dtype = np.dtype(dtype_name)
    except (TypeError, ValueError) as err:
        raise ValueError(f"array declares dtype {dtype_name!r}, shape {shape!r}") from err
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or min(shape, default=0) < 0:
        raise ValueError(f"array declares dtype {dtype_name!r}, shape {shape!r}")
    _, header = _written(dtype, shape)
    return dtype, header, math.prod(shape) * dtype.itemsize


def _declared_shape(array: Array) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in array.shape)
    except (TypeError, ValueError) as err:
        raise ValueError(f"array declares dtype {array.dtype!r}, shape {array.shape!r}") from err


def _parse_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, data offset) of a .npy header another writer made."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read(stream)
    except Exception as err:  # untrusted bytes: any parse failure means a bad payload
        raise ValueError(f"array bytes are not a .npy payload: {err}") from err
    return tuple(shape), bool(fortran), np.dtype(dtype), stream.tell()


def array_to_numpy(array: Array) -> np.ndarray:
    """The ndarray of a Flower Array, read without copies.

    Untrusted input: raises ValueError unless the bytes are a .npy payload holding
    exactly the plain numeric dtype and shape the Array declares. Our own header (cached)
    is recognised without parsing; any other writer's is parsed by NumPy's reader.
    """
    dtype, shape, start, nbytes, fortran = _npy_layout(array)
    value = np.frombuffer(array.data, dtype=dtype, count=nbytes // dtype.itemsize, offset=start)
    return value.reshape(shape, order="F" if fortran else "C")


def torch_state(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """`arrays.to_torch_state_dict()` through `array_to_numpy` (same checks, our header
    recognised without parsing: ~10× faster for a small model), each tensor its own copy."""
    return {name: torch.from_numpy(array_to_numpy(a).copy()) for name, a in arrays.items()}


def value_bytes(array: Array) -> int:
    """Bytes of values a Flower Array holds: `array_to_numpy(array).nbytes`, same checks,
    same errors, without building the view (traffic is measured on every message)."""
    return _npy_layout(array)[3]


def _npy_layout(array: Array) -> tuple[np.dtype, tuple[int, ...], int, int, bool]:
    """(dtype, shape, data offset, value bytes, fortran order) of a checked .npy Array
    (`array_to_numpy`)."""
    if array.stype != NUMPY:
        raise ValueError(f"array is not a .npy payload (stype {array.stype!r})")
    if not isinstance(array.dtype, str):
        raise ValueError(f"array declares dtype {array.dtype!r}, shape {array.shape!r}")
    shape = _declared_shape(array)
    dtype, header, nbytes = _declared(array.dtype, shape)
    data = array.data
    fortran = False
    if data.startswith(header):
        start = len(header)
    else:
        found, fortran, found_dtype, start = _parse_header(data)
        if found != shape or found_dtype != dtype:
            raise ValueError(
                f"array bytes hold {found_dtype} {found}, the array declares {dtype} {shape}"
            )
    if len(data) - start != nbytes:
        raise ValueError(f"array holds {len(data) - start} bytes, {dtype} {shape} needs {nbytes}")
    return dtype, shape, start, nbytes, fortran


def arrays_to_vector(arrays: ArrayRecord, layout: Layout) -> torch.Tensor:
    """Flat float32 vector of a dense ArrayRecord, checked against `layout`."""
    out = np.empty(layout.numel, dtype=np.float32)
    for wire, value in zip(layout.wire, dense_views(arrays, layout), strict=True):
        out[wire.start : wire.stop] = value
    return torch.from_numpy(out)


def dense_views(arrays: ArrayRecord, layout: Layout) -> list[np.ndarray]:
    """Each tensor of a dense ArrayRecord as a flat view of its buffer (no copy unless
    written in Fortran order), in `layout` order, checked against it: names, shapes, dtypes."""
    if arrays.keys() != layout._name_set:
        missing = [n for n in layout.names if n not in arrays]
        extra = [n for n in arrays if n not in layout._name_set]
        raise ValueError(f"keys differ from the model: missing {missing}, extra {extra}")
    views = []
    for wire in layout.wire:
        value = array_to_numpy(arrays[wire.name])
        if value.shape != wire.shape:
            raise ValueError(f"{wire.name}: shape {value.shape}, expected {wire.shape}")
        if value.dtype != wire.dtype:
            raise ValueError(f"{wire.name}: dtype {value.dtype}, expected {wire.dtype}")
        views.append(value.reshape(-1))
    return views


def vector_to_arrays(vector: torch.Tensor, layout: Layout) -> ArrayRecord:
    """Dense ArrayRecord (one Array per tensor, Flower-compatible) of a flat vector."""
    flat = np.ascontiguousarray(vector.detach().cpu().numpy())
    return array_record(
        {
            wire.name: _npy_array(
                wire.dtype_name,
                wire.shape,
                wire.header,
                flat[wire.start : wire.stop].astype(wire.dtype, copy=False),
            )
            for wire in layout.wire
        }
    )

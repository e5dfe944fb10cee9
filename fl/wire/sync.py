"""One sync protocol for strategies whose clients keep a copy of server state.

APF's clients hold the model and the freezing mask, PAS's the synchronisation periods.
Rather than each strategy hand-writing "who replied last round", the server publishes a
*version* of its synced tensors at the start of every round and remembers which version
each client holds (confirmed by an accepted reply). A client gets the changes since its
version in whichever form is cheapest, or the whole tensor when that is cheaper:

- model values (payload): at the positions of a mask the client already holds, as
  `sparse` indices + values, as `masked` with a shipped bitmap, or `dense`;
- control state (masks, periods): nothing, flipped indices (bool), indices only when the
  strategy's `advance` rule rebuilds the values (one version behind), indices + values,
  bitmap + values, or dense.

A reply that is accepted confirms the version it answered. A client the server stopped
waiting for (a reply past the close, or none) keeps its confirmed version on the server,
unless the loop knows the message arrived (then the version sent is confirmed): the
client keeps two copies, the version it was last sent and that message's base, so it
holds what the server assumes either way (twice the synced state in its memory). A
client that holds nothing (first contact, a failed or rejected reply, a version the
server no longer keeps) starts from each tensor's `initial` value (known to everyone,
e.g. PAS's τ_0) or gets it dense. A client holding neither copy the server assumed
refuses the round (RuntimeError): the server then forgets it and resyncs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl.wire.codec import (
    CodecError,
    bitmap,
    decode,
    encode_dense,
    encode_masked,
    encode_sparse,
    unpack_bitmap,
)
from fl.wire.packing import pack, packed_bytes, unpack
from fl.wire.records import Layout, array_to_numpy, numpy_to_array

__all__ = ["SyncClient", "SyncServer", "Synced"]

SYNC, COPY, HELD = "sync", "sync-copy", "sync-held"
BASE_COPY = "sync-copy-base"  # the base of the message last received, kept beside it
NONE = -1  # the base of a client that holds only the initial values


@dataclass(frozen=True)
class Synced:
    """One tensor the server and its clients keep in step.

    `payload`: the model vector (travels in the `arrays` record through `fl.wire.codec`).
    `dtype`: the wire type of a control tensor (bool masks travel as bitmaps).
    `initial`: the value every client holds before its first message, from the numel.
    `within`: a bool tensor in the same set: changes of this one since version b lie
    where that one was True at b (APF: frozen scalars do not move), so they can travel
    as values at those positions with no position data.
    `needed`: a bool tensor in the same set: the client reads only positions where it is
    True now; the rest may stay stale on the client (APF's `lazy_frozen`).
    `advance`: the next version from the previous one and the changed indices, when the
    strategy's own rule determines it (PAS halves periods), so indices suffice.
    """

    name: str
    payload: bool = False
    dtype: torch.dtype = torch.float32
    initial: Callable[[int], torch.Tensor] | None = None
    within: str | None = None
    needed: str | None = None
    advance: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def _wire_dtype(spec: Synced) -> np.dtype:
    return np.dtype(np.float32) if spec.payload else _NP[spec.dtype]


_NP = {
    torch.bool: np.dtype(np.bool_),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.float32: np.dtype(np.float32),
}


def _to_wire(values: torch.Tensor, spec: Synced) -> Array:
    return numpy_to_array(values.numpy().astype(_wire_dtype(spec)))


def _from_wire(array: Array, spec: Synced, count: int) -> torch.Tensor:
    raw = array_to_numpy(array)
    if raw.dtype != _wire_dtype(spec) or raw.shape != (count,):
        raise CodecError(f"{spec.name}: got {raw.dtype} {raw.shape}, expected ({count},)")
    return torch.from_numpy(raw.astype(_NP_TORCH[spec.dtype]))


_NP_TORCH = {torch.bool: np.bool_, torch.int16: np.int64, torch.int32: np.int64}
_NP_TORCH[torch.float32] = np.float32


def _dense_part(spec: Synced, value: torch.Tensor) -> np.ndarray:
    """A whole control tensor as it travels: a bitmap for masks, else its wire dtype."""
    if spec.dtype == torch.bool:
        return np.packbits(value.numpy().astype(np.uint8))
    return value.numpy().astype(_wire_dtype(spec))


def _unpacked_bits(bits: np.ndarray, numel: int, name: str) -> torch.Tensor:
    if bits.size != -(-numel // 8):
        raise CodecError(f"{name}: a bitmap of {bits.size} bytes cannot hold {numel} flags")
    return torch.from_numpy(np.unpackbits(bits)[:numel].astype(bool))


def _exactly(values: np.ndarray, count: int, name: str) -> np.ndarray:
    if values.size != count:
        raise CodecError(f"{name}: {values.size} values for {count} positions")
    return values


def _as_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(values.copy()).to(dtype)


def _checked_indices(raw: np.ndarray, numel: int) -> torch.Tensor:
    index = torch.from_numpy(raw.astype(np.int64))
    if len(index) and (int(index.min()) < 0 or int(index.max()) >= numel):
        raise CodecError("sync index out of range")
    if len(index) > 1 and not bool((index[1:] > index[:-1]).all()):
        raise CodecError("sync indices must be strictly increasing")
    return index


class SyncServer:
    """The server's versions of the synced tensors and what each client holds."""

    def __init__(self, specs: Sequence[Synced], *, max_versions: int = 64) -> None:
        self.specs = {s.name: s for s in specs}
        self.max_versions = max_versions
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.seen: dict[int, int] = {}  # node -> version it holds
        self.current = self.previous = NONE
        self._cache: dict[int, tuple[dict[str, Any], int]] = {}

    # ----- bookkeeping ------------------------------------------------------------------
    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """The tensors every client should hold from `version` on (copies are kept)."""
        self.versions[version] = {n: tensors[n].detach().clone() for n in self.specs}
        self.previous, self.current = self.current, version
        self._cache = {}
        keep = {version, *self.seen.values()}
        for old in [v for v in self.versions if v not in keep]:
            del self.versions[old]
        while len(self.versions) > self.max_versions:  # oldest go; their holders resync
            oldest = min(self.versions)
            del self.versions[oldest]
            self.seen = {n: v for n, v in self.seen.items() if v != oldest}

    def confirm(self, node: int, version: int) -> None:
        """`node` replied, accepted, to the message of `version`: it holds that version."""
        self.seen[node] = version

    def forget(self, node: int) -> None:
        """Nothing is known of `node`'s copy (a failed or rejected reply). A node given up
        on (no reply by the close) is not forgotten: it still holds its confirmed version."""
        self.seen.pop(node, None)

    def base(self, node: int) -> int:
        """The version the next message to `node` is relative to (NONE: initial values)."""
        version = self.seen.get(node, NONE)
        return version if version in self.versions else NONE

    # ----- messages ---------------------------------------------------------------------
    def records(self, node: int, layout: Layout) -> tuple[dict[str, Any], int]:
        """(message records, base version) bringing `node` to the current version."""
        base = self.base(node)
        if base not in self._cache:
            self._cache[base] = (self._encode(base, layout), base)
        return self._cache[base]

    def _encode(self, base: int, layout: Layout) -> dict[str, Any]:
        now = self.versions[self.current]
        old = self.versions.get(base)
        arrays, how = ArrayRecord(), ConfigRecord({"base": base, "version": self.current})
        out: dict[str, Any] = {}
        for name, spec in self.specs.items():
            held = self._held(spec, old, now)
            if spec.payload:
                out.update(self._encode_payload(spec, now, old, held, layout, how))
            else:
                self._encode_control(spec, now[name], held, base, arrays, how)
        out[SYNC] = how
        if len(arrays):
            out[f"{SYNC}-control"] = arrays
        return out

    def _held(
        self, spec: Synced, old: dict[str, torch.Tensor] | None, now: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """What the client holds of `spec` at the base version (None: nothing usable)."""
        if old is not None:
            return old[spec.name]
        if spec.initial is not None:
            return spec.initial(now[spec.name].numel())
        return None

    def _encode_payload(
        self,
        spec: Synced,
        now: dict[str, torch.Tensor],
        old: dict[str, torch.Tensor] | None,
        held: torch.Tensor | None,
        layout: Layout,
        how: ConfigRecord,
    ) -> dict[str, Any]:
        vector = now[spec.name]
        dense = encode_dense(vector, layout)
        if held is None or old is None:
            how[spec.name] = "dense"
            return dense
        send = vector != held
        if spec.needed is not None:  # positions not needed now may stay stale
            send = now[spec.needed] & (send | ~old[spec.needed])
        options = [("dense", dense)]
        if spec.within is not None:
            for which, mask in (("old", old[spec.within]), ("new", now[spec.within])):
                if not bool((send & ~mask).any()):
                    options.append(
                        (f"within-{which}", encode_masked(vector, mask, ship_mask=False))
                    )
        options.append(("sparse", encode_sparse(vector, send.nonzero().flatten())))
        options.append(("bitmap", encode_masked(vector, send, ship_mask=True)))
        label, records = min(options, key=lambda o: _bytes(o[1]))
        how[spec.name] = label
        return records

    def _encode_control(
        self,
        spec: Synced,
        value: torch.Tensor,
        held: torch.Tensor | None,
        base: int,
        arrays: ArrayRecord,
        how: ConfigRecord,
    ) -> None:
        """The cheapest form of `value` given what the client holds, deflated where smaller."""
        options: list[tuple[str, dict[str, np.ndarray]]] = [
            ("dense", {"": _dense_part(spec, value)})
        ]
        if held is not None:
            changed = value != held
            index = changed.nonzero().flatten().numpy().astype(np.int32)
            if not len(index):
                options.append(("none", {}))
            elif spec.dtype == torch.bool:  # flips
                options.append(("indices", {"indices": index}))
            else:
                values = value[changed].numpy().astype(_wire_dtype(spec))
                if spec.advance is not None and base != NONE and base == self.previous:
                    options.append(("advance", {"indices": index}))
                options.append(("indices", {"indices": index, "values": values}))
                bits = np.packbits(changed.numpy().astype(np.uint8))
                options.append(("bitmap", {"bits": bits, "values": values}))
        packed = [
            (label, pack({f"{spec.name}.{k}" if k else spec.name: v for k, v in parts.items()}))
            for label, parts in options
        ]
        label, chosen = min(packed, key=lambda o: packed_bytes(o[1]))
        how[spec.name] = label
        for key, array in chosen.items():
            arrays[key] = array

    # ----- resume -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Versions and what each client holds: plain containers of tensors and ints."""
        return {
            "versions": self.versions,
            "seen": dict(self.seen),
            "current": self.current,
            "previous": self.previous,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.versions = dict(state["versions"])
        self.seen = dict(state["seen"])
        self.current, self.previous = int(state["current"]), int(state["previous"])
        self._cache = {}


def _bytes(records: Mapping[str, Any]) -> int:
    codec = records["codec"]
    return int(cast(int, codec["payload-bytes"])) + int(cast(int, codec["control-bytes"]))


class SyncClient:
    """A client's copy of the synced tensors, kept in its `Context.state`."""

    def __init__(self, specs: Sequence[Synced]) -> None:
        self.specs = {s.name: s for s in specs}

    def receive(
        self, content: RecordDict, state: RecordDict, layout: Layout
    ) -> dict[str, torch.Tensor]:
        """The current version of every synced tensor, from the message and the copy held.

        RuntimeError when the message is relative to a version this client does not hold.
        """
        how = content.config_records.get(SYNC)
        if how is None:
            raise CodecError("message has no 'sync' record")
        base, version = int(cast(int, how["base"])), int(cast(int, how["version"]))
        held = self._held(state, base, layout.numel)
        control = content.array_records.get(f"{SYNC}-control", ArrayRecord())
        out: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():  # control state first: payloads may use it
            if not spec.payload:
                out[name] = self._control(
                    spec, str(how[name]), control, held.get(name), layout.numel
                )
        for name, spec in self.specs.items():
            if spec.payload:
                out[name] = self._payload(spec, str(how[name]), content, held, out, layout)
        self._keep(state, base, version, out)
        return out

    def _keep(
        self, state: RecordDict, base: int, version: int, now: Mapping[str, torch.Tensor]
    ) -> None:
        """Hold `version` and the message's `base` (which the server still assumes until a
        reply to `version` is accepted); older copies go."""
        held = state.config_records.get(HELD)
        if base in (NONE, version):
            state.array_records.pop(BASE_COPY, None)
        elif held is not None and held["version"] == base:  # the copy held becomes the base
            state[BASE_COPY] = state.array_records[COPY]
        state[COPY] = ArrayRecord({n: self._store(self.specs[n], t) for n, t in now.items()})
        state[HELD] = ConfigRecord({"version": version, "base": base})

    def _held(self, state: RecordDict, base: int, numel: int) -> dict[str, torch.Tensor]:
        if base == NONE:
            return {n: s.initial(numel) for n, s in self.specs.items() if s.initial is not None}
        held = state.config_records.get(HELD)
        key = None
        if held is not None and held["version"] == base:
            key = COPY
        elif held is not None and held.get("base") == base:
            key = BASE_COPY
        copy = state.array_records.get(key) if key is not None else None
        if copy is None:
            raise RuntimeError(f"client does not hold version {base} of the synced state")
        return {n: self._load(self.specs[n], copy[n], numel) for n in self.specs}

    @staticmethod
    def _store(spec: Synced, value: torch.Tensor) -> Array:
        return bitmap(value) if spec.dtype == torch.bool else _to_wire(value, spec)

    @staticmethod
    def _load(spec: Synced, array: Array, numel: int) -> torch.Tensor:
        return (
            unpack_bitmap(array, numel)
            if spec.dtype == torch.bool
            else _from_wire(array, spec, numel)
        )

    def _control(
        self,
        spec: Synced,
        label: str,
        arrays: ArrayRecord,
        held: torch.Tensor | None,
        numel: int,
    ) -> torch.Tensor:
        name, wire = spec.name, _wire_dtype(spec)
        if label == "dense":
            if spec.dtype == torch.bool:
                bits = unpack(arrays, name, np.dtype(np.uint8), -(-numel // 8))
                return _unpacked_bits(bits, numel, name)
            dense = _exactly(unpack(arrays, name, wire, numel), numel, name)
            return torch.from_numpy(dense.astype(_NP_TORCH[spec.dtype]))
        if held is None:
            raise CodecError(f"{name}: a change was sent but nothing is held")
        out = held.clone()
        if label == "none":
            return out
        if label == "bitmap":
            bits = unpack(arrays, f"{name}.bits", np.dtype(np.uint8), -(-numel // 8))
            changed = _unpacked_bits(bits, numel, name)
            values = unpack(arrays, f"{name}.values", wire, numel)
            out[changed] = _as_tensor(_exactly(values, int(changed.sum()), name), out.dtype)
            return out
        index = _checked_indices(
            unpack(arrays, f"{name}.indices", np.dtype(np.int32), numel), numel
        )
        if label == "advance" and spec.advance is not None:
            return spec.advance(out, index)
        if label == "indices" and spec.dtype == torch.bool:
            out[index] = ~out[index]
            return out
        if label == "indices":
            values = unpack(arrays, f"{name}.values", wire, numel)
            out[index] = _as_tensor(_exactly(values, len(index), name), out.dtype)
            return out
        raise CodecError(f"{name}: unknown sync form {label!r}")

    def _payload(
        self,
        spec: Synced,
        label: str,
        content: RecordDict,
        held: dict[str, torch.Tensor],
        control: dict[str, torch.Tensor],
        layout: Layout,
    ) -> torch.Tensor:
        if label == "dense":
            return decode(content, layout)
        base = held.get(spec.name)
        if base is None:
            raise CodecError(f"{spec.name}: a change was sent but nothing is held")
        mask = None
        if label.startswith("within-") and spec.within is not None:
            mask = held[spec.within] if label == "within-old" else control[spec.within]
        return decode(content, layout, base=base, mask=mask)

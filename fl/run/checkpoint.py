"""Checkpoints a run can trust: atomic, two deep, safe to load, and tied to their config.

Each save renames the previous checkpoint to `checkpoint.prev.pt` and writes the new one
through a temporary file (write, fsync, rename), so a crash at any moment leaves at
least one whole checkpoint. Loading never executes code from the file: torch's
`weights_only` unpickler accepts tensors, numbers, strings and containers, plus the
state classes marked `@fl.common.checkpointable.checkpointable`; node states (Flower
`RecordDict`s) travel as Flower's own protobuf bytes. A truncated, empty or garbage
newest file falls back to the previous one.

With `checkpoint_history=true` every checkpoint is also kept as
`checkpoints/round-NNNNN.pt` (a hard link: no extra bytes until the next save replaces
the file), so `fork_from=<run_dir>@<round>` can start a new run from any kept round.
A fork copies that file into its own, new run directory and resumes from it there;
the source directory is only read.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611
from numpy._core.multiarray import _reconstruct  # numpy's own pickle hook for arrays

from fl.common.checkpointable import state_types
from fl.common.errors import RunError
from fl.common.files import NotRegularFile, make_dir, open_regular, write_atomic
from fl.common.moved import old_names
from fl.strategy.registry import available, get_strategy

__all__ = [
    "CHECKPOINT",
    "CheckpointError",
    "check_contents",
    "check_resumable",
    "fork_into",
    "history_path",
    "load_checkpoint",
    "restore_rng",
    "rng_state",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
HISTORY = "checkpoints"  # with checkpoint_history=true: one file per checkpointed round
# Keys a resume may change: how long to run, how to report, which engine runs it.
RESUMABLE_CHANGES = (
    "rounds",
    "time_budget_s",
    "target_accuracy",
    "resume",
    "overwrite",
    "progress",
    "output_dir",
    "checkpoint_every",
    "evaluate_every",  # what is measured, never what is trained (ASFL refuses > 1)
    "engine",
    "transport",  # how arrays travel, never what they hold
    "logger",
    "experiment_title",
    "fork_from",
    "checkpoint_history",
)
# What a fork must share with its source: the rest (rounds, local_steps, strategy
# parameters, seed, ...) may change, that being the point of a branch.
FORK_KEEPS = ("strategy.name", "num_clients", "task", "partition")
REQUIRED = ("config", "progress", "rows", "arrays", "strategy", "nodes", "rng")
_RECORDDICT = "__recorddict_proto__"
# numpy arrays inside strategy state (e.g. masks) are rebuilt by these, and only these.
_NUMPY_GLOBALS: list[Any] = [np.ndarray, np.dtype, _reconstruct]


class CheckpointError(RunError):
    """No checkpoint of this run can be used (missing, corrupt, or from another config)."""


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch global RNG states, as plain values and tensors."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what `rng_state` returned."""
    random.setstate(state["python"])
    numpy_state = dict(state["numpy"])
    inner = dict(numpy_state["state"])
    inner["key"] = inner["key"].numpy().astype(np.uint32)
    np.random.set_state({**numpy_state, "state": inner})
    torch.set_rng_state(state["torch"])


def _encode(value: Any) -> Any:
    """`value` with every RecordDict replaced by its protobuf bytes."""
    if isinstance(value, RecordDict):
        proto = recorddict_to_proto(value).SerializeToString()
        data = torch.frombuffer(bytearray(proto), dtype=torch.uint8) if proto else torch.empty(0)
        return {_RECORDDICT: data.to(torch.uint8)}
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_RECORDDICT}:
            proto = value[_RECORDDICT].numpy().tobytes()
            return recorddict_from_proto(ProtoRecordDict.FromString(proto))
        return {k: _decode(v) for k, v in value.items()}
    return value


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` atomically, keeping the previous file as the fallback."""
    encoded = _encode(payload)
    write_atomic(path, lambda f: torch.save(encoded, f), keep_previous=PREVIOUS)
    if payload.get("config", {}).get("checkpoint_history"):
        _keep(path, int(payload["progress"]["round"]))


def history_path(run_dir: Path, server_round: int) -> Path:
    """Where `checkpoint_history=true` keeps the checkpoint of `server_round`."""
    return run_dir / HISTORY / f"round-{server_round:05d}.pt"


def _keep(path: Path, server_round: int) -> None:
    """Link the checkpoint just written into the history (replacing an older copy)."""
    kept = history_path(path.parent, server_round)
    make_dir(kept.parent)
    tmp = kept.with_name(kept.name + ".tmp")
    for name in (tmp, kept):
        if name.is_symlink() or (name.exists() and not name.is_file()):
            raise NotRegularFile(f"{name} is not a regular file: nothing is written to it")
    tmp.unlink(missing_ok=True)
    os.link(path, tmp, follow_symlinks=False)
    os.replace(tmp, kept)


def _fork_source(spec: str) -> Path:
    """The checkpoint file `<run_dir>[@<round>]` names; CheckpointError saying what exists."""
    run_dir, at, wanted = spec.rpartition("@") if "@" in spec else (spec, "", "")
    source = Path(run_dir)
    if not at:
        return source / CHECKPOINT
    server_round = int(wanted)
    kept = history_path(source, server_round)
    if kept.exists():
        return kept
    latest = source / CHECKPOINT
    if latest.exists() and _round_of(latest) == server_round:
        return latest
    rounds = sorted(int(p.stem.split("-")[1]) for p in (source / HISTORY).glob("round-*.pt"))
    raise CheckpointError(
        f"fork_from: {source} has no checkpoint of round {server_round} (kept rounds: "
        f"{rounds or 'none'}); run the source with checkpoint_history=true to keep every "
        "checkpointed round"
    )


def fork_into(spec: str, out_dir: Path, config: Mapping[str, Any]) -> None:
    """Make `out_dir` (a new run directory) start where the checkpoint `spec` names left
    off: a copy of that checkpoint becomes the new run's own, which then resumes.

    The fork must keep FORK_KEEPS of its source's config; everything else may differ.
    """
    source, saved = _usable(_fork_source(spec), REQUIRED)
    _check_changes(saved["config"], config, FORK_KEEPS, kept=True, what="fork")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:  # the file that loaded (still a regular file), never over something already there
        with open_regular(source) as f, (out_dir / CHECKPOINT).open("xb") as copy:
            shutil.copyfileobj(f, copy)
    except FileExistsError:
        raise CheckpointError(f"fork_from: {out_dir / CHECKPOINT} already exists") from None


def _round_of(path: Path) -> int | None:
    """The round a checkpoint file holds; None if it does not load."""
    try:
        server_round = _read(path, REQUIRED)["progress"]["round"]
    except Exception:  # a broken file holds no round: never executed, only refused
        return None
    return server_round if isinstance(server_round, int) else None


def _read(path: Path, required: tuple[str, ...]) -> dict[str, Any]:
    """One checkpoint file, loaded without running code from it."""
    for name in available():  # their modules mark their state classes checkpointable
        get_strategy(name)
    classes = state_types()  # and their names before fl/ was split into floors
    with (
        open_regular(path) as f,
        torch.serialization.safe_globals([*_NUMPY_GLOBALS, *classes, *old_names(classes)]),
    ):
        payload = torch.load(f, weights_only=True)
    if not isinstance(payload, dict) or not set(required) <= payload.keys():
        raise ValueError(f"not a checkpoint of this framework (needs keys {list(required)})")
    return dict(_decode(payload))


def _reason(err: Exception) -> str:
    """One line saying why a checkpoint file could not be read."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        # torch's message is a page long; the line that names the refused global is enough
        detail = next((ln for ln in lines[1:] if "GLOBAL" in ln or "global" in ln), lines[-1])
        return (
            "refused to load (not allowlisted): "
            + detail.removeprefix("WeightsUnpickler error: ").split(". ")[0]
        )
    return lines[0] if lines else type(err).__name__


def load_checkpoint(path: Path, required: tuple[str, ...] = REQUIRED) -> dict[str, Any]:
    """The newest usable checkpoint at `path`, else the previous one; CheckpointError if none.

    Usable: it loads safely and is a dict with the `required` keys.
    """
    return _usable(path, required)[1]


def _usable(path: Path, required: tuple[str, ...]) -> tuple[Path, dict[str, Any]]:
    """`load_checkpoint`, also saying which file it loaded."""
    candidates = [p for p in (path, path.with_name(PREVIOUS)) if p.exists()]
    if not candidates:
        raise CheckpointError(
            f"no checkpoint at {path}; to resume, pass "
            "hydra.run.dir=<the interrupted run's directory> (or resume=latest)"
        )
    problems = []
    for candidate in candidates:
        try:
            payload = _read(candidate, required)
        except Exception as err:  # any unreadable file: fall back, never execute it
            reason = _reason(err)
            problems.append(f"{candidate.name}: {reason}")
            log.warning("checkpoint %s is unusable (%s)", candidate, reason)
            continue
        if candidate != path:
            log.warning("resuming from the previous checkpoint %s", candidate)
        return candidate, payload
    raise CheckpointError(f"no usable checkpoint in {path.parent}: " + "; ".join(problems))


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _show(values: Mapping[str, Any], key: str) -> str:
    return repr(values[key]) if key in values else "(absent)"


def check_resumable(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuse a resume whose config differs from the checkpoint's, except in RESUMABLE_CHANGES;
    a fork's first start (`fork_from` set, the checkpoint from another run directory) only
    in FORK_KEEPS."""
    if current.get("fork_from") and saved.get("output_dir") != current.get("output_dir"):
        _check_changes(saved, current, FORK_KEEPS, kept=True, what="fork")
    else:
        _check_changes(saved, current, RESUMABLE_CHANGES, kept=False, what="resume")


def _check_changes(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    keys: tuple[str, ...],
    *,
    kept: bool,
    what: str,
) -> None:
    """CheckpointError naming the keys that changed: those under `keys` (`kept`), or
    those outside them."""
    old, new = _flatten(saved), _flatten(current)

    def counts(key: str) -> bool:
        listed = any(key == k or key.startswith(k + ".") for k in keys)
        return listed if kept else key.split(".")[0] not in keys

    changed = sorted(
        (key for key in old.keys() | new.keys() if counts(key) and old.get(key) != new.get(key)),
        key=lambda k: (not k.endswith(".name"), k),  # a changed strategy/task name first
    )
    if not changed:
        return
    shown = ", ".join(f"{k}: {_show(old, k)} -> {_show(new, k)}" for k in changed[:6])
    more = f" (and {len(changed) - 6} more)" if len(changed) > 6 else ""
    if what == "fork":
        raise CheckpointError(
            f"cannot fork: the config differs from the source checkpoint's in {shown}{more}; "
            f"a fork keeps {', '.join(FORK_KEEPS)} (the rest may change)"
        )
    raise CheckpointError(
        f"cannot resume: the config differs from the checkpoint's in {shown}{more}; "
        "resume with the run's own settings (only rounds, time_budget_s, target_accuracy, "
        "engine and logger may change), or start a new run in another directory"
    )


def check_contents(saved: Mapping[str, Any], model: Mapping[str, torch.Tensor]) -> None:
    """A loaded checkpoint's contents as untrusted input: counters of the right type and
    range, a round that its metrics rows end at, and a model with the run's tensors, all
    finite. CheckpointError naming the first field that does not fit."""
    progress, rows, arrays = saved["progress"], saved["rows"], saved["arrays"]
    if not isinstance(progress, dict) or not isinstance(rows, list):
        raise CheckpointError("checkpoint: progress or metrics rows are not a record and a list")
    server_round = progress.get("round")
    last = rows[-1].get("round") if rows and isinstance(rows[-1], dict) else 0
    if not _count(server_round) or server_round != last:
        raise CheckpointError(
            f"checkpoint: round {server_round!r} is not the last of its metrics rows ({last!r})"
        )
    for key in ("virtual_time_s", "wall_time_s"):
        value = progress.get(key)
        if not isinstance(value, float | int) or not 0 <= value < math.inf:
            raise CheckpointError(f"checkpoint: {key}={value!r} is not a time >= 0")
    for key in ("cum_bytes_up", "cum_bytes_down", "cum_payload_bytes_up", "cum_payload_bytes_down"):
        if not _count(progress.get(key)):
            raise CheckpointError(f"checkpoint: {key}={progress.get(key)!r} is not a count >= 0")
    if not isinstance(arrays, dict) or list(arrays) != list(model):
        raise CheckpointError("checkpoint: its model's tensors are not this run's model's")
    for name, tensor in arrays.items():
        want = model[name]
        fits = isinstance(tensor, torch.Tensor) and tensor.shape == want.shape
        if not fits or tensor.dtype != want.dtype:
            shape = tuple(want.shape)
            raise CheckpointError(f"checkpoint: model tensor {name!r} is not {want.dtype} {shape}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"checkpoint: model tensor {name!r} is not finite")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

"""The client half of a strategy: the points where it may change local training.

The trainer in `clients/` owns the loop and calls these hooks; the defaults are plain
local SGD sending a dense model, i.e. FedAvg. `state` is the node's persistent
`Context.state`, so anything a strategy keeps there survives across rounds on every
engine. `time` is the virtual clock as the client sees it (its device, the round's
deadline, the samples trained so far), so time-aware rules (FedCA's early stop) are hooks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from fl.common.config import is_finite
from fl.wire.codec import CodecError, decode, encode_dense
from fl.wire.contract import unreadable
from fl.wire.records import Layout

__all__ = ["ClientHooks", "ClientTime", "Reply", "load_instruction"]

Reply = tuple[dict[str, ArrayRecord | ConfigRecord], dict[str, float | int]]


@dataclass
class ClientTime:
    """One round on the virtual clock, as the client sees it (virtual seconds from send).

    The server puts its device profile and deadline into the instruction; a message
    without them (a stock Flower server) gives an unbounded view. Under a speed trace it
    also gives the device's own speed over the round (`speed_trace`), so elapsed time
    follows the device's slowdowns inside the round, as a real client's wall clock does.
    """

    speed: float = math.inf  # training samples per second, at the round's start
    up_bytes_per_s: float = math.inf
    down_bytes_per_s: float = math.inf
    deadline_s: float = math.inf  # the server stops waiting this long after sending
    download_s: float = 0.0  # the instruction's download
    samples: int = 0  # trained so far this round (the trainer counts)
    # (seconds after sending, samples/s) from each change of speed on; empty: `speed` throughout
    speed_trace: tuple[tuple[float, float], ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], down_bytes: int) -> ClientTime:
        """The view the server's `device-*` and `deadline-s` keys describe."""
        if "device-speed" not in config:
            return cls()
        down = float(cast(float, config["device-down-bps"]))
        return cls(
            speed=float(cast(float, config["device-speed"])),
            up_bytes_per_s=float(cast(float, config["device-up-bps"])),
            down_bytes_per_s=down,
            deadline_s=float(cast(float, config["deadline-s"])),
            download_s=down_bytes / down,
            speed_trace=_speed_trace(config.get("device-speed-trace")),
        )

    @property
    def elapsed_s(self) -> float:
        """Download plus the compute of the samples trained so far (at the device's speed
        of each moment, under a speed trace)."""
        if not self.speed_trace:
            return self.download_s + self.samples / self.speed
        t, left = self.download_s, float(self.samples)
        starts = [start for start, _ in self.speed_trace[1:]] + [math.inf]
        for (_, speed), end in zip(self.speed_trace, starts, strict=True):
            if end <= t:
                continue
            if left <= (end - t) * speed:
                return t + left / speed
            left -= (end - t) * speed
            t = end
        return t  # unreachable: the last segment lasts forever

    def upload_s(self, nbytes: int) -> float:
        """Seconds `nbytes` take on this device's uplink (server link not counted)."""
        return nbytes / self.up_bytes_per_s

    def slack_s(self, reply_bytes: int) -> float:
        """Seconds left before the deadline once a reply of `reply_bytes` is uploaded."""
        return self.deadline_s - self.elapsed_s - self.upload_s(reply_bytes)


def _speed_trace(value: Any) -> tuple[tuple[float, float], ...]:
    """The `device-speed-trace` key (flat start, speed pairs), checked: a malformed one
    is refused with one clear line rather than read as some other clock."""
    if value is None:
        return ()
    numbers = list(value) if isinstance(value, list) else []
    pairs = tuple(zip(numbers[::2], numbers[1::2], strict=False))
    ok = (
        numbers
        and len(numbers) % 2 == 0
        and all(map(is_finite, numbers))
        and pairs[0][0] == 0
        and all(a[0] < b[0] for a, b in itertools.pairwise(pairs))
        and all(speed > 0 for _, speed in pairs)
    )
    if not ok:
        raise ValueError(
            "device-speed-trace must be pairs (seconds after sending, samples/s) starting at "
            "0, increasing, with positive speeds"
        )
    return tuple((float(a), float(b)) for a, b in pairs)


class ClientHooks:
    """Default client behaviour; a strategy overrides only what differs.

    `cohort_safe`: a cohort of clients with these hooks may train as one batched program
    (`clients.cohort`) and get the per-client path's numbers within its tolerance. It
    holds where training is plain local SGD: `lr` and `batch_size` depend only on the step
    and on what `begin` saw, `before_step` adds at most `proximal_pull`, `after_step` is
    the default, and no hook keeps a reference to the model's tensors from `begin` to
    `end` (a cohort loads the next client into the same model in between). `load`,
    `begin` and `end` may do anything; they run once per client as usual. The flag is not
    inherited: a subclass is cohort-safe only where its own body says so.
    """

    cohort_safe: ClassVar[bool] = True  # plain local SGD, FedAvg's client half

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "cohort_safe" not in cls.__dict__:
            cls.cohort_safe = False
        elif cls.cohort_safe and cls.after_step is not ClientHooks.after_step:
            raise TypeError(
                f"{cls.__name__} declares cohort_safe but overrides after_step: a cohort "
                "takes every step it planned and cannot stop one client or change its weights"
            )

    def __init__(self, params: Any) -> None:
        self.params = params
        self.time = ClientTime()  # set by the ClientApp for each round

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        """Put the global model the server sent into `model`."""
        layout.load_into(model, decode(content, layout))

    def begin(self, model: nn.Module, config: ConfigRecord, state: RecordDict) -> None:
        """Called once the global model is loaded, before the first local step."""

    def lr(self, step: int, base_lr: float) -> float:
        """Learning rate for local step `step` (0-based)."""
        return base_lr

    def batch_size(self, step: int, base: int) -> int:
        """Batch size for local step `step`."""
        return base

    def before_step(self, model: nn.Module) -> None:
        """Shape gradients after backward, before the optimizer step (e.g. FedProx)."""

    def proximal_pull(self) -> tuple[float, list[torch.Tensor]] | None:
        """(mu, anchor): the pull mu·(w − anchor) that `before_step` adds to every
        gradient (anchor in `model.parameters()` order), or None. The form of
        `before_step` a cohort applies to all its clients at once (FedProx)."""
        return None

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
        """Called after each optimizer step; return False to stop local training early."""
        return True

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        """Encode the reply payload and add strategy metrics."""
        return encode_dense(layout.read(model), layout), {}


def load_instruction(
    hooks: ClientHooks,
    strategy: str,
    model: nn.Module,
    content: RecordDict,
    config: ConfigRecord,
    state: RecordDict,
    layout: Layout,
) -> None:
    """`hooks.load`; a payload this half cannot read raises a CodecError that names the
    client's strategy and the likely mismatch of halves (`fl.wire.contract.unreadable`)."""
    try:
        hooks.load(model, content, state, layout)
    except CodecError as err:
        raise CodecError(unreadable(err, content, config, strategy)) from None

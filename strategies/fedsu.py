"""FedSU: speculative updating, with the FedSU-v1 and FedSU-v2 ablations.

Yu et al., "FedSU: Communication-efficient Federated Learning with Speculative
Updating", ICDCS 2025. Spec: shared/specs/algorithms_a.md §5.
A scalar whose global trajectory is a straight line (second differences oscillating
around zero: R < T_R) stops being synchronised: every party moves it by its last
synchronised round update (the slope) each round. Clients still train it and accumulate
their mis-prediction; when its no-check period ends (after 1, 2, 3, ... rounds) the
clients report their errors, and the scalar returns to regular sync when the
accumulated error exceeds T_S slopes (S = |ē| / |s| >= T_S).
Variants: `fedsu_v1` has no error feedback (a fixed speculation period, no checks);
`fedsu_v2` speculates at random (probability p per regular scalar and round) instead of
by linearity, with error feedback.

As metric grafting sees it (`fl.mechanisms`: `diagnosis`, `actions`, `laws`): diagnosis = the
second-order oscillation ratio R (`fl.mechanisms.diagnosis.LinearityTest`, the state of
grafting's `OscillationRatio`), action = speculation `fl.mechanisms.speculation.Speculation` (a
scalar leaves synchronisation and moves by its slope on every party), law = `below` T_R
to enter and `error_feedback` (checks after 1, 2, 3, ... rounds, S >= T_S) to leave. v1
leaves after a fixed period instead; v2 enters at random.

Wire protocol (ours; in the paper each client derives masks and slopes itself from the
synchronised model): the speculation state travels through the shared sync protocol
(`fl.wire.sync`): the anchor vector as payload (regular scalars' values; a speculated one's
value when it started) and, as control state, the speculated mask, slopes and start
ticks, as changes since the round the client last saw. The model a client trains from
is computed from them (`fl.mechanisms.speculation.Speculation.values`), so a client that skipped
rounds gets the same bits as the server. The clock is the count of aggregations, sent
as `fedsu-clock`. Replies carry the regular scalars' values and, for the scalars checked
this round, the client's mean error per round it took part in (one masked payload over
both disjoint sets, the mask known to both sides), plus a CRC-32 of the model trained
from: a reply from a diverged copy is rejected, so the node is resynced.

Choices where the paper is silent (spec §5.2-5.3): θ = 0.99; the slope stays fixed for
a whole phase; a scalar leaves speculation at its speculated value (`exit_correction`
adds ē); its R-EMAs restart from zero; errors are weighted like the model and, under
partial participation, each client's mean error per round is scaled by the phase length
(`fl.mechanisms.speculation.phase_error`); v1's period 43 and v2's probability 0.53 % are the
paper's values for its CNN.
Labelled variants (ours, issue 35; off by default, so the default stays the paper's reading):
`warmup_rounds` trusts R only once that many second differences were folded in since the
scalar's last reset (by default R counts from its second sample, when a single pair of
opposite second differences can already pass T_R); `error_reset` measures ē from the last
passed check instead of the phase's start, so each check judges the rounds since the last
one against the fixed slope instead of the whole phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from flwr.app import Message, RecordDict
from torch import nn

from fl.common.checkpointable import checkpointable
from fl.common.seeding import derive_seed
from fl.mechanisms.diagnosis import LinearityTest
from fl.mechanisms.laws import below
from fl.mechanisms.speculation import (
    ErrorFeedback,
    Speculation,
    checks_due,
    digest,
    error_feedback,
    phase_error,
)
from fl.strategy.client import ClientHooks, Reply
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.codec import decode, encode_masked
from fl.wire.records import Layout
from fl.wire.sync import SyncClient, Synced

VARIANTS = ("fedsu", "fedsu_v1", "fedsu_v2")
CLOCK, DIGEST = "fedsu-clock", "base-crc"


@dataclass
class FedSUParams:
    """Defaults from the paper (S-FedSU §VI-A) and the spec's proposals (θ)."""

    variant: str = "fedsu"  # fedsu | fedsu_v1 (no error feedback) | fedsu_v2 (random)
    linearity_threshold: float = 0.01  # T_R: predictable when R < T_R
    error_threshold: float = 1.0  # T_S: back to regular sync when S >= T_S
    ema: float = 0.99  # θ of the linearity EMAs (paper: "close to 1")
    fixed_period: int = 43  # v1: rounds a scalar is speculated, unchecked
    random_probability: float = 0.0053  # v2: chance a regular scalar is speculated per round
    exit_correction: bool = False  # add the known error ē to a scalar leaving speculation
    warmup_rounds: int = 0  # variant (ours): R is trusted only after this many samples
    error_reset: bool = False  # variant (ours): ē counts from the last passed check

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"strategy.variant must be one of {list(VARIANTS)}")
        if self.linearity_threshold <= 0 or self.error_threshold <= 0:
            raise ValueError("strategy.linearity_threshold and error_threshold must be > 0")
        if not 0 < self.ema < 1:
            raise ValueError("strategy.ema must be in (0, 1)")
        if self.fixed_period < 1:
            raise ValueError("strategy.fixed_period must be >= 1")
        if not 0 <= self.random_probability <= 1:
            raise ValueError("strategy.random_probability must be in [0, 1]")
        if self.warmup_rounds < 0:
            raise ValueError("strategy.warmup_rounds must be >= 0")

    @property
    def checked(self) -> bool:
        """Whether speculated scalars are checked by error feedback (not in v1)."""
        return self.variant != "fedsu_v1"


@checkpointable
@dataclass
class FedSUState:
    """The server's controller: the action's state (the shared speculation state), the
    diagnosis (the linearity metric) and the clock (aggregations so far)."""

    speculation: Speculation
    linearity: LinearityTest
    clock: int


def synced_state() -> tuple[Synced, ...]:
    """What every client holds: anchors (payload), regular mask, slopes, start ticks.

    Anchors change only where a scalar was regular at either end (`within`); the control
    tensors start as "nothing speculated", so a first contact gets only what differs."""
    return (
        Synced("anchor", payload=True, within="regular"),
        Synced("regular", dtype=torch.bool, initial=lambda n: torch.ones(n, dtype=torch.bool)),
        Synced("slope", initial=torch.zeros),
        Synced("since", dtype=torch.int32, initial=lambda n: torch.zeros(n, dtype=torch.int64)),
    )


def speculation_of(synced: dict[str, torch.Tensor]) -> Speculation:
    """The speculation state from the synced tensors."""
    return Speculation(synced["anchor"], ~synced["regular"], synced["slope"], synced["since"])


def reply_mask(spec: Speculation, tick: int, params: FedSUParams) -> torch.Tensor:
    """Positions a reply carries: regular scalars' values and checked scalars' errors."""
    due = checks_due(spec, tick) if params.checked else torch.zeros_like(spec.speculating)
    return ~spec.speculating | due


def control_step(
    state: FedSUState,
    vector: torch.Tensor,
    error: torch.Tensor,
    params: FedSUParams,
    generator: torch.Generator,
) -> tuple[torch.Tensor, dict[str, int]]:
    """One aggregation's worth of control, given the averaged regular scalars in `vector`
    and the phase errors ē of the checked scalars (`error`, 0 elsewhere).

    In order: the law's exits (error feedback on the phase just checked), the action's
    stop, the diagnosis of this round's update, the law's entries, the action's start.
    Returns the next global model and counts (entered, left, checked).
    """
    spec, tick = state.speculation, state.clock
    regular = ~spec.speculating
    previous = spec.values(tick)
    if params.checked:
        due, leave = error_feedback(spec, tick, error, params.error_threshold)
    else:
        due = torch.zeros_like(regular)
        leave = spec.speculating & (tick + 1 - spec.since >= params.fixed_period)
    nxt = torch.where(regular, vector, spec.values(tick + 1))
    if params.exit_correction:
        nxt = torch.where(leave, nxt + error, nxt)
    spec.stop(leave, nxt)
    state.linearity.reset(leave, spec.slope)
    update = nxt - previous
    rate = state.linearity.update(update, regular)
    if params.variant == "fedsu_v2":
        draw = torch.rand(regular.numel(), generator=generator)
        enter = regular & (draw < params.random_probability)
    else:
        trusted = state.linearity.samples >= params.warmup_rounds
        enter = regular & trusted & below(rate, params.linearity_threshold)
    spec.track(nxt)
    spec.start(enter, nxt, update, tick + 1)
    state.clock = tick + 1
    counts = {"entered": int(enter.sum()), "left": int(leave.sum()), "checked": int(due.sum())}
    return spec.values(state.clock), counts  # the clients' formula, bit for bit


class FedSUServer(ServerStrategy):
    """FedAvg over regular scalars; speculated ones move by their slopes; checks by
    error feedback after aggregation."""

    central_dp_safe = False  # clients compute speculated values the server never resends
    stale_replies_ok = False  # a reply's positions follow the round it answers

    params: FedSUParams
    state_attributes = ("control",)

    def __init__(self, params: FedSUParams, **kwargs: Any) -> None:
        self.control: FedSUState | None = None
        super().__init__(params, **kwargs)
        self.mask = torch.empty(0, dtype=torch.bool)  # what this round's replies carry
        self.errors: dict[int, torch.Tensor] = {}  # node -> its reported errors
        self.counts: dict[str, int] = {}

    def sync_specs(self) -> tuple[Synced, ...]:
        return synced_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The kernel's checks (kinds, finite values), then the control's own: one length
        for every per-scalar tensor, a clock >= 0 and start ticks within it."""
        super().load_state_dict(state)
        control = self.control
        if control is None:
            return
        spec, test = control.speculation, control.linearity
        parts = (spec.anchor, spec.speculating, spec.slope, spec.since, test.previous)
        if not isinstance(control.clock, int) or control.clock < 0:
            raise ValueError(f"strategy state: FedSU clock {control.clock!r} is not a count")
        if len({p.shape for p in parts}) != 1 or spec.anchor.dim() != 1:
            raise ValueError("strategy state: FedSU's per-scalar tensors differ in length")
        if spec.speculating.dtype != torch.bool or spec.since.dtype != torch.int64:
            raise ValueError("strategy state: FedSU's mask or start ticks have the wrong dtype")
        if bool(((spec.since < 0) | (spec.since > control.clock)).any()):
            raise ValueError("strategy state: FedSU start ticks lie outside 0…clock")

    def on_round_start(self, server_round: int) -> None:
        if self.control is None:
            numel = self.global_vector.numel()
            self.control = FedSUState(
                Speculation.fresh(self.global_vector),
                LinearityTest.fresh(numel, self.params.ema),
                0,
            )
        self.mask = reply_mask(self.control.speculation, self.control.clock, self.params)
        self.errors = {}
        self.counts = dict.fromkeys(("entered", "left", "checked"), 0)

    def synced(self) -> dict[str, torch.Tensor]:
        assert self.control is not None
        spec = self.control.speculation
        return {
            "anchor": spec.anchor,
            "regular": ~spec.speculating,
            "slope": spec.slope,
            "since": spec.since,
        }

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        assert self.control is not None
        return {CLOCK: self.control.clock}

    def decode_reply(self, reply: Message, base: torch.Tensor) -> torch.Tensor:
        """The model values of the regular scalars (speculated ones at `base`); the
        checked scalars' errors are kept aside. Rejects a reply trained from another model."""
        assert self.control is not None and self.layout is not None
        if reply.content.metric_records["metrics"].get(DIGEST) != digest(base):
            raise ValueError("the client trained from a model other than the one sent")
        values = decode(reply.content, self.layout, base=base, mask=self.mask)
        checked = self.mask & self.control.speculation.speculating
        errors = torch.where(checked, values, torch.zeros_like(values))
        if not bool(torch.isfinite(errors).all()):
            raise ValueError("speculation errors have NaN or Inf values")
        self.errors[reply.metadata.src_node_id] = errors
        return torch.where(checked, base, values)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        assert self.control is not None
        vector = super().aggregate(server_round, updates)
        spec = self.control.speculation
        weights = torch.tensor([float(u.num_examples) for u in updates])
        per_round = torch.stack([self.errors[u.node_id] for u in updates])
        error = phase_error(per_round, weights, spec, self.control.clock, self.params.error_reset)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, self.control.clock))
        nxt, self.counts = control_step(self.control, vector, error, self.params, generator)
        return nxt

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        if self.control is not None:
            speculating = self.control.speculation.speculating
            out["speculated_fraction"] = float(speculating.float().mean())
            out.update({f"speculation_{k}": v for k, v in self.counts.items()})
        return out


class FedSUHooks(ClientHooks):
    """Rebuilds the model from the speculation state; trains every scalar; accumulates
    the mis-prediction of speculated ones; replies regular values and checked errors."""

    params: FedSUParams
    cohort_safe = True  # load and end are its own; the steps between are plain SGD

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        synced = SyncClient(synced_state()).receive(content, state, layout)
        tick = int(cast(int, content.config_records["config"][CLOCK]))
        self.spec = speculation_of(synced)
        self.base = self.spec.values(tick)
        self.predicted = self.spec.values(tick + 1)
        self.mask = reply_mask(self.spec, tick, self.params)
        self.feedback = ErrorFeedback.load(state, self.spec, tick, self.params.error_reset)
        layout.load_into(model, self.base)

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        local = layout.read(model)
        speculating = self.spec.speculating
        if self.params.checked:
            self.feedback.add(speculating, local - self.predicted)
            self.feedback.save(state)
        reply = torch.where(speculating, self.feedback.mean(), local)
        return encode_masked(reply, self.mask, ship_mask=False), {DIGEST: digest(self.base)}


STRATEGY = register("fedsu", server=FedSUServer, client=FedSUHooks, params=FedSUParams)

"""APF: Adaptive Parameter Freezing, with the APF# and APF++ variants.

Chen et al., "Synchronize Only the Immature Parameters", IEEE TPDS 35(7), 2023.
A scalar whose updates keep cancelling out (low effective perturbation) is frozen: kept
at the same value on every client and left out of both upload and download, for a
period that grows by one check interval each time it is found stable again and is
halved when it is not (AIMD). Spec: shared/specs/algorithms_a.md §2.

As metric grafting sees it (`fl.mechanisms`: `diagnosis`, `actions`, `laws`): diagnosis = the
effective stepping rate `SteppingRate`, action = the freezing mask `FreezeMask`, law =
`below` T_s then `aimd` of the freezing lengths.

Wire protocol (ours; the paper lets each client derive the mask itself): the server
computes the mask once per check from the synchronised model, and model and mask travel
through the shared sync protocol (`fl.wire.sync`): a client gets the changes since the round
it last saw, which for a client that replied last round are exactly the values that
round trained (no positions: its mask says where) plus the mask's flips. Replies carry
the active scalars. The paper trains with full participation; with partial
participation, `lazy_frozen=true` (our proposal) sends only the scalars active now, so a
returning client may hold stale values of frozen scalars (they are not trained or sent).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Message, RecordDict
from torch import nn

from fl.common.checkpointable import checkpointable
from fl.common.seeding import derive_seed
from fl.mechanisms.actions import FreezeMask, freezing_synced
from fl.mechanisms.diagnosis import SteppingRate
from fl.mechanisms.laws import below
from fl.strategy.client import ClientHooks, Reply
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy
from fl.wire.codec import decode, encode_masked
from fl.wire.masking import Rollback
from fl.wire.records import Layout
from fl.wire.sync import SyncClient, Synced

VARIANTS = ("apf", "apf_sharp", "apf_plus")


@dataclass
class APFParams:
    """Defaults follow the paper (S-APF-J §VII-A) and the authors' code (check every round)."""

    variant: str = "apf"  # apf | apf_sharp (APF#) | apf_plus (APF++)
    check_interval: int = 1  # rounds between stability checks (F_c / F_s)
    ema_alpha: float = 0.99  # α of the perturbation EMAs
    threshold: float = 0.05  # T_s: stable when P < T_s
    tighten_above: float = 0.8  # halve T_s while more than this fraction is frozen
    sharp_probability: float = 0.5  # APF#: chance an active scalar is frozen one more interval
    plus_a1: float = 1 / 2000  # APF++: chance a1 * round (ResNet-18 value; LeNet-5: 1/4000)
    plus_a2: float = 1 / 20  # APF++: length uniform in [1, 1 + a2 * round] intervals
    plus_max_probability: float = 0.5  # cap from the ICDCS draft (our choice for APF++)
    lazy_frozen: bool = False  # partial participation: send only active scalars (ours)

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"strategy.variant must be one of {list(VARIANTS)}")
        if self.check_interval < 1:
            raise ValueError("strategy.check_interval must be >= 1")
        if not 0 < self.ema_alpha < 1:
            raise ValueError("strategy.ema_alpha must be in (0, 1)")
        if self.threshold <= 0:
            raise ValueError("strategy.threshold must be > 0")


@checkpointable
@dataclass
class FreezingState(FreezeMask):
    """Per-scalar controller state (S-APF-J Algorithm 1; `refresh_freezing_status`):
    the mask and its AIMD lengths, the stepping-rate diagnosis, the current T_s."""

    stepping: SteppingRate
    at_last_check: torch.Tensor  # global values at the previous check
    threshold: float  # current T_s

    @classmethod
    def fresh(cls, vector: torch.Tensor, params: APFParams) -> FreezingState:
        mask = FreezeMask.none_frozen(vector.numel())
        stepping = SteppingRate.fresh(vector.numel(), params.ema_alpha)
        return cls(
            **vars(mask),
            stepping=stepping,
            at_last_check=vector.clone(),
            threshold=params.threshold,
        )


def stability_check(
    state: FreezingState, vector: torch.Tensor, params: APFParams, generator: torch.Generator
) -> None:
    """One check: update the metric of active scalars, adjust periods AIMD, new mask.

    T_s is tightened on the AIMD mask alone, before APF#/APF++ add random freezing.
    """
    was_active = state.active
    rate = state.stepping.rate(vector - state.at_last_check, was_active)
    state.step(below(rate[was_active], state.threshold))
    state.at_last_check = vector.clone()
    if 1 - state.active.float().mean().item() > params.tighten_above:
        state.threshold /= 2
    if params.variant != "apf":
        _freeze_at_random(state, params, generator)


def _freeze_at_random(state: FreezingState, params: APFParams, generator: torch.Generator) -> None:
    """APF# / APF++: freeze some active scalars at random (only active ones, as the paper says).

    APF++ uses the check count as the paper's round K (equal with check_interval=1).
    """
    draw = torch.rand(state.active.numel(), generator=generator)
    if params.variant == "apf_sharp":
        chosen = state.active & (draw < params.sharp_probability)
        lengths = torch.ones(int(chosen.sum()), dtype=torch.int64)
    else:
        probability = min(params.plus_a1 * state.checks, params.plus_max_probability)
        chosen = state.active & (draw < probability)
        longest = int(1 + params.plus_a2 * state.checks)
        lengths = torch.randint(1, longest + 1, (int(chosen.sum()),), generator=generator)
    state.freeze(chosen, lengths)


def synced_state(params: APFParams) -> tuple[Synced, ...]:
    """Model and mask, kept in step on every client (`fl.wire.sync`); the mask starts all True."""
    return freezing_synced(params.lazy_frozen)


class APFServer(ServerStrategy):
    """FedAvg over active scalars, with the freezing controller run after aggregation."""

    central_dp_safe = False  # clients keep frozen scalars the server never resends
    stale_replies_ok = False  # a reply holds the scalars active in the round it answers

    params: APFParams
    state_attributes = ("freezing",)

    def __init__(self, params: APFParams, **kwargs: Any) -> None:
        self.freezing: FreezingState | None = None
        super().__init__(params, **kwargs)

    def sync_specs(self) -> tuple[Synced, ...]:
        return synced_state(self.params)

    def on_round_start(self, server_round: int) -> None:
        if self.freezing is None:
            self.freezing = FreezingState.fresh(self.global_vector, self.params)

    def synced(self) -> dict[str, torch.Tensor]:
        assert self.freezing is not None
        return {"model": self.global_vector, "mask": self.freezing.active}

    def decode_reply(self, reply: Message, base: torch.Tensor) -> torch.Tensor:
        assert self.freezing is not None and self.layout is not None
        return decode(reply.content, self.layout, base=base, mask=self.freezing.active)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        assert self.freezing is not None
        vector = super().aggregate(server_round, updates)
        frozen = ~self.freezing.active
        vector[frozen] = self.global_vector[frozen]  # exact, not a float round trip
        if server_round % self.params.check_interval == 0:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, server_round))
            stability_check(self.freezing, vector, self.params, generator)
        return vector

    @property
    def trained_mask(self) -> torch.Tensor:
        """Deprecated (gone with the sync protocol, restored as an alias): the mask of
        scalars the round last sent trains, i.e. the mask published at its start."""
        warnings.warn(
            "APFServer.trained_mask is deprecated: the mask a round trains is the one the "
            "sync protocol published for it, strategy.sync.versions[strategy.sync.current]"
            "['mask']; the next round's is strategy.freezing.active (docs/API.md)",
            DeprecationWarning,
            stacklevel=2,
        )
        if self.sync is None or self.sync.current not in self.sync.versions:
            return torch.empty(0, dtype=torch.bool)  # before the first round
        return self.sync.versions[self.sync.current]["mask"]

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        if self.freezing is not None:
            frozen = ~self.freezing.active
            periods = self.freezing.length[frozen].float()
            out["frozen_fraction"] = float(frozen.float().mean())
            out["stability_threshold"] = self.freezing.threshold
            out["mean_freezing_period"] = float(periods.mean()) if len(periods) else 0.0
        return out


class APFHooks(ClientHooks):
    """Rebuilds model and mask from the sync protocol, rolls frozen scalars back each step."""

    params: APFParams

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        synced = SyncClient(synced_state(self.params)).receive(content, state, layout)
        vector, self.mask = synced["model"], synced["mask"]
        layout.load_into(model, vector)
        self.rollback = Rollback(model, layout, self.mask, vector)

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
        self.rollback()
        return True

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        vector = layout.read(model)
        return encode_masked(vector, self.mask, ship_mask=False), {}


STRATEGY = register("apf", server=APFServer, client=APFHooks, params=APFParams)

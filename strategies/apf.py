"""APF: Adaptive Parameter Freezing, with the APF# and APF++ variants.

Chen et al., "Synchronize Only the Immature Parameters", IEEE TPDS 35(7), 2023.
A scalar whose updates keep cancelling out (low effective perturbation) is frozen: kept
at the same value on every client and left out of both upload and download, for a
period that grows by one check interval each time it is found stable again and is
halved when it is not (AIMD). Spec: shared/specs/algorithms_a.md §2.

Wire protocol (ours; the paper lets each client derive the mask itself): the server
computes the mask once per check from the synchronised model. A client that replied
last round gets only the values that round trained (its own copy covers the rest)
plus the new mask when it changed; any other client (late joiner, returning after a
gap or a failure) gets the dense model and the mask. Replies carry the active scalars.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from torch import nn

from fl.codec import (
    bitmap,
    decode,
    encode_masked,
    unpack_bitmap,
    with_control_bitmap,
)
from fl.diagnosis import PerturbationEMA
from fl.hooks import ClientHooks, Reply
from fl.masking import Rollback
from fl.records import Layout, array_to_numpy, numpy_to_array
from fl.registry import register
from fl.seeding import derive_seed
from fl.state import checkpointable
from fl.strategy import ClientUpdate, ServerStrategy

VARIANTS = ("apf", "apf_sharp", "apf_plus")
MASK, STATE, SYNCED = "apf-mask", "apf", "apf-synced"


@dataclass
class APFParams:
    """Defaults follow the paper (S-APF-J §VII-A) and the authors' code (check every round)."""

    variant: str = "apf"  # apf | apf_sharp (APF#) | apf_plus (APF++)
    check_interval: int = 1  # rounds between stability checks (F_c / F_s)
    ema_alpha: float = 0.99  # α of the perturbation EMAs
    threshold: float = 0.05  # T_s: stable when P < T_s
    tighten_above: float = 0.8  # halve T_s while more than this fraction is frozen
    sharp_probability: float = 0.5  # APF#: chance an active scalar is frozen one more interval
    plus_a1: float = 1 / 2000  # APF++: freezing probability a1 * round, capped below
    plus_a2: float = 1 / 20  # APF++: length uniform in [1, 1 + a2 * round] intervals
    plus_max_probability: float = 0.5  # cap from the ICDCS draft (our choice for APF++)

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
class FreezingState:
    """Per-scalar controller state (S-APF-J Algorithm 1; `refresh_freezing_status`)."""

    ema: PerturbationEMA
    length: torch.Tensor  # L: freezing period, in check intervals
    until: torch.Tensor  # U: check index at which the scalar is active again
    active: torch.Tensor  # M: True where the scalar trains and travels
    at_last_check: torch.Tensor  # global values at the previous check
    checks: int  # c
    threshold: float  # current T_s

    @classmethod
    def fresh(cls, vector: torch.Tensor, params: APFParams) -> FreezingState:
        n = vector.numel()
        return cls(
            PerturbationEMA.zeros(n, params.ema_alpha),
            torch.zeros(n, dtype=torch.int64),
            torch.zeros(n, dtype=torch.int64),
            torch.ones(n, dtype=torch.bool),
            vector.clone(),
            0,
            params.threshold,
        )


def stability_check(
    state: FreezingState, vector: torch.Tensor, params: APFParams, generator: torch.Generator
) -> None:
    """One check: update the metric of active scalars, adjust periods AIMD, new mask.

    T_s is tightened on the AIMD mask alone, before APF#/APF++ add random freezing.
    """
    was_active = state.active
    stable = state.ema.update(vector - state.at_last_check, was_active) < state.threshold
    length = state.length[was_active]
    length = torch.where(stable, length + 1, length // 2)
    state.length[was_active] = length
    state.until[was_active] = state.checks + length + 1
    state.checks += 1
    state.active = state.until == state.checks
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
    state.until[chosen] = state.checks + lengths
    state.active = state.until == state.checks


class APFServer(ServerStrategy):
    """FedAvg over active scalars, with the freezing controller run after aggregation."""

    central_dp_safe = False  # clients keep frozen scalars the server never resends

    params: APFParams
    state_attributes = ("freezing", "trained_mask", "replied")

    def __init__(self, params: APFParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.freezing: FreezingState | None = None
        self.trained_mask = torch.empty(0, dtype=torch.bool)  # mask of the last round
        self.replied: dict[int, int] = {}  # node -> last round it replied in

    def on_round_start(self, server_round: int) -> None:
        """Encode this round's two payloads once: the masked pull and the full resync."""
        if self.freezing is None:
            self.freezing = FreezingState.fresh(self.global_vector, self.params)
            self.trained_mask = self.freezing.active.clone()
        mask = self.freezing.active
        pull = encode_masked(self.global_vector, self.trained_mask, ship_mask=False)
        if not torch.equal(mask, self.trained_mask):
            pull = with_control_bitmap(pull, MASK, mask)
        self._pull = pull
        self._resync = with_control_bitmap(self._dense_payload, MASK, mask)

    def train_payload(self, server_round: int, node_id: int) -> dict[str, Any]:
        """Only last round's trained values to a node that replied then; else everything."""
        in_sync = self.replied.get(node_id) == server_round - 1
        return self._pull if in_sync else self._resync

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        in_sync = self.replied.get(node_id) == server_round - 1
        return {"apf-base-round": server_round - 1 if in_sync else -1}

    def decode_reply(self, reply: Message) -> torch.Tensor:
        assert self.freezing is not None and self.layout is not None
        return decode(
            reply.content, self.layout, base=self.global_vector, mask=self.freezing.active
        )

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        assert self.freezing is not None
        vector = super().aggregate(server_round, updates)
        frozen = ~self.freezing.active
        vector[frozen] = self.global_vector[frozen]  # exact, not a float round trip
        for update in updates:
            self.replied[update.node_id] = server_round
        self.trained_mask = self.freezing.active.clone()
        if server_round % self.params.check_interval == 0:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, server_round))
            stability_check(self.freezing, vector, self.params, generator)
        return vector

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
    """Rebuilds the global model from a masked pull, rolls frozen scalars back each step."""

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        config = content.config_records["config"]
        base_round = cast(int, config["apf-base-round"])
        if base_round >= 0:
            kept = state.array_records.get(STATE)
            synced = state.config_records.get(SYNCED)
            if kept is None or synced is None or synced["round"] != base_round:
                raise RuntimeError(f"APF client is not in sync with round {base_round}")
            base = torch.from_numpy(array_to_numpy(kept["global"]).copy())
            mask = unpack_bitmap(kept["mask"], layout.numel)
            vector = decode(content, layout, base=base, mask=mask)
        else:
            vector = decode(content, layout)
            mask = torch.ones(layout.numel, dtype=torch.bool)
        if MASK in content.array_records:
            mask = unpack_bitmap(content.array_records[MASK]["bits"], layout.numel)
        layout.load_into(model, vector)
        self.mask = mask
        self.rollback = Rollback(model, layout, mask, vector)
        state[STATE] = ArrayRecord({"global": numpy_to_array(vector.numpy()), "mask": bitmap(mask)})
        state[SYNCED] = ConfigRecord({"round": cast(int, config["server-round"])})

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
        self.rollback()
        return True

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        vector = layout.flatten(model.state_dict())
        return encode_masked(vector, self.mask, ship_mask=False), {}


STRATEGY = register("apf", server=APFServer, client=APFHooks, params=APFParams)

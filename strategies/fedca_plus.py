"""FedCA+: FedCA with FedSU-style speculation of eagerly stable layers. OUR PROPOSAL.

The FedCA+ paper (Lyu et al., "Enabling Client-Autonomous Training Optimizations for
Efficient Federated Learning", TPDS 2026, "speculative sparsification") was NOT FOUND:
only its title is known (spec algorithms_a.md §6.8). This design is ours and is not
paper-faithful.

FedCA (strategies/fedca.py) lets clients stop early and send settled layers eagerly;
FedSU (strategies/fedsu.py, shared mechanics in fl/mechanisms/speculation.py) stops synchronising
scalars whose global trajectory is a straight line, moving them by their last round
update on every party, with error feedback sending them back to regular sync. FedCA+
combines the two: a layer is *eagerly stable* when at least half of a round's tuned
replies sent it eagerly and kept the eager version (no re-send). FedSU's linearity test
may put a scalar into speculation only while its layer is eagerly stable; once
speculated, a scalar follows FedSU's rules (checks after 1, 2, 3, ... rounds, back to
regular sync when S >= T_S), whatever its layer does later. Speculated scalars are
neither downloaded nor uploaded (except as errors when checked), so replies and eager
parts shrink; everything else is FedCA's (early stop, eager layers, re-sends, T_R).

Wire protocol: FedSU's (speculation state through `fl.wire.sync`, the clock as
`fedsu-clock`, a CRC of the model trained from), with FedCA's `eager_layers` reply codec
restricted to the positions FedSU's reply mask names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import RecordDict
from torch import nn

from fl.common.checkpointable import checkpointable
from fl.mechanisms.diagnosis import LinearityTest
from fl.mechanisms.speculation import Speculation, digest
from fl.strategy.client import Reply
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate
from fl.wire.records import Layout
from strategies.fedca import FedCAHooks, FedCAParams, FedCAServer, int_list
from strategies.fedsu import DIGEST, FedSUHooks, FedSUParams, FedSUServer, FedSUState


@dataclass
class FedCAPlusParams(FedCAParams, FedSUParams):
    """FedCA's parameters (variant v1/v2/v3) and FedSU's speculation thresholds; a layer
    is eagerly stable when at least `stable_share` of the tuned replies keep it eager."""

    stable_share: float = 0.5

    def validate(self) -> None:
        FedCAParams.validate(self)  # FedSU's own check would refuse FedCA's variant names
        if self.linearity_threshold <= 0 or self.error_threshold <= 0:
            raise ValueError("strategy.linearity_threshold and error_threshold must be > 0")
        if not 0 < self.ema < 1:
            raise ValueError("strategy.ema must be in (0, 1)")
        if not 0 < self.stable_share <= 1:
            raise ValueError("strategy.stable_share must be in (0, 1]")


@checkpointable
@dataclass
class EagerLinearity(LinearityTest):
    """FedSU's linearity test that passes only scalars of eagerly stable layers."""

    eligible: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))

    def update(self, update: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        rate = super().update(update, where)
        return torch.where(self.eligible, rate, torch.ones_like(rate))


def eagerly_stable(replies: list[dict[str, Any]], layers: int, share: float) -> list[bool]:
    """Per layer: whether at least `share` of the replies sent it eagerly and kept it."""
    kept = [0] * layers
    for metrics in replies:
        sent = int_list(metrics.get("fedca-eager-steps"))
        resent = int_list(metrics.get("fedca-resent"))
        if len(sent) == layers and len(resent) == layers:
            for layer in range(layers):
                kept[layer] += int(sent[layer] > 0 and not resent[layer])
    return [bool(replies) and k >= share * len(replies) for k in kept]


class FedCAPlusServer(FedCAServer, FedSUServer):
    """FedCA's round time and eager parts over FedSU's speculation, gated by layer."""

    params: FedCAPlusParams
    state_attributes = (*FedSUServer.state_attributes, *FedCAServer.state_attributes)

    def on_round_start(self, server_round: int) -> None:
        if self.control is None:
            numel = self.global_vector.numel()
            test = LinearityTest.fresh(numel, self.params.ema)
            linearity = EagerLinearity(
                test.ema,
                test.previous,
                test.seen,
                test.samples,
                torch.zeros(numel, dtype=torch.bool),
            )
            self.control = FedSUState(Speculation.fresh(self.global_vector), linearity, 0)
        super().on_round_start(server_round)

    def carried(self) -> torch.Tensor | None:
        return self.mask

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        assert self.control is not None and self.layout is not None
        tuned = [u.metrics for u in updates if not u.metrics.get("fedca-anchor")]
        if tuned:  # anchor rounds say nothing of eager layers: the last verdict stands
            stable = eagerly_stable(tuned, len(self.layout.sizes), self.params.stable_share)
            per_scalar = torch.repeat_interleave(
                torch.tensor(stable), torch.tensor(self.layout.sizes)
            )
            assert isinstance(self.control.linearity, EagerLinearity)
            self.control.linearity.eligible = per_scalar
        return super().aggregate(server_round, updates)

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        if self.control is not None and isinstance(self.control.linearity, EagerLinearity):
            out["eligible_fraction"] = float(self.control.linearity.eligible.float().mean())
        return out


class FedCAPlusHooks(FedCAHooks, FedSUHooks):
    """FedSU's client (speculated model, error feedback) training with FedCA's hooks."""

    params: FedCAPlusParams

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        final = layout.read(model)
        self.feedback.add(self.spec.speculating, final - self.predicted)
        self.feedback.save(state)
        if self.anchor:  # no eager layers: FedSU's reply, profiled as FedCA's anchor
            self._save_profile(state)
            self.snapshots = {}
        records, metrics = self.eager_reply(
            final, self.mask, (self.spec.speculating, self.feedback.mean())
        )
        metrics["fedca-anchor"] = int(self.anchor)
        return records, {**metrics, DIGEST: digest(self.base)}


STRATEGY = register(
    "fedca_plus", server=FedCAPlusServer, client=FedCAPlusHooks, params=FedCAPlusParams
)

"""FedCA: client autonomy inside a round — early stop and eager layers — with its ablations.

Lyu et al., "FedCA: Efficient Federated Learning with Client Autonomy", ICPP 2024.
Spec: shared/specs/algorithms_a.md §6.

A client measures how much each local iteration adds to the round's update with the
statistical-progress metric P_i (eq. 1), profiled every `profile_every` rounds in an
*anchor round* (all K iterations, no optimisation, a sample of at most 100 scalars per
layer recorded after every iteration). In the rounds between, it

- stops early once the net utility of one more iteration, benefit from the anchor curve
  minus a time cost that jumps at the server's round time T_R, turns negative (eq. 2-4);
- sends a layer eagerly at the first iteration at which its anchor curve passes T_e,
  keeps training it, and at the end re-sends it if the update drifted (cosine < T_r,
  eq. 5-6); otherwise the server keeps the eager version.

The server gives each round a T_R (FedBalancer-style: the time maximising the number of
selected clients expected to finish by it over itself, from the clients' recent speeds:
each one's samples over the compute span the server observed in the last round it
landed in; a client not yet observed counts at the median of those observed, and before
any observation at the speed its device announces) and averages replies as FedAvg does;
which replies land (the earliest 90 % in the paper) is the loop's `first_k_fraction`.

Time is virtual: a client's elapsed time is `ClientTime.elapsed_s` (its download and the
samples trained so far at its device's speed of each moment: under a speed trace the
device's own trace, so a client sees its slowdowns inside the round, as on a real
device's wall clock), never the wall clock of this machine, so runs are deterministic;
the clock charges the samples the client reports, so a client that stops earlier
finishes earlier on it too; eager layers leave on the clock through `reply_parts` while
compute goes on. Until issue 35 the elapsed time came from the speed announced at the
round's start and T_R from every device's true speed at the start; recorded FedCA
numbers before it used that. Variants (spec §6.9): v1 early stop only, v2 early stop +
eager layers without re-send, v3 full FedCA.

Wire protocol (ours): replies use the `eager_layers` codec (each tensor once, the version
the server keeps, plus the superseded eager copy of every re-sent layer, so traffic is
FedAvg's plus the re-sends, as in the paper) and report in their metrics when each eager
layer left (`fedca-eager-samples`), the iteration each left at and the stop iteration.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from torch import nn

from fl.common.seeding import derive_seed
from fl.strategy.client import ClientHooks, Reply
from fl.strategy.registry import register
from fl.strategy.server import ClientUpdate, ServerStrategy, UploadParts
from fl.wire.codec import Codec, CodecError, Options, encode, read, register_codec, require
from fl.wire.records import Layout, array_record, array_to_numpy, numpy_to_array

VARIANTS = ("v1", "v2", "v3")
PROFILE = "fedca-profile"  # the client's anchor curves in its Context.state
EARLY = "early/"  # prefix of a superseded eager copy in a reply


@dataclass
class FedCAParams:
    """Defaults from the paper (S-FedCA §5.1); K and the batch size are the run's."""

    variant: str = "v3"  # v1: early stop; v2: + eager layers, no re-send; v3: full FedCA
    local_steps: int = 125  # K, iterations of a full round (conf: the run's local_steps)
    batch_size: int = 50  # for the server's T_R estimate (conf: the run's batch_size)
    profile_every: int = 10  # rounds between anchor rounds
    beta: float = 0.01  # β: cost weight while within T_R
    eager_threshold: float = 0.95  # T_e: a layer is eager once its anchor P passes this
    resend_threshold: float = 0.6  # T_r: re-send when cos(G_F, G_eager) falls below this
    sample_fraction: float = 0.5  # profiled scalars per layer: min(fraction, cap)
    sample_cap: int = 100

    @property
    def eager(self) -> bool:
        return self.variant != "v1"

    @property
    def resend(self) -> bool:
        return self.variant == "v3"

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"strategy.variant must be one of {list(VARIANTS)}")
        if self.local_steps < 1:
            raise ValueError(
                "strategy.local_steps must be >= 1: it is the run's local_steps, "
                "so run FedCA with local_steps > 0"
            )
        if self.batch_size < 1 or self.profile_every < 1 or self.sample_cap < 1:
            raise ValueError("strategy.batch_size, profile_every and sample_cap must be >= 1")
        if self.beta < 0:
            raise ValueError("strategy.beta must be >= 0")
        for name in ("eager_threshold", "resend_threshold", "sample_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"strategy.{name} must be in (0, 1]")


# ----- the metric and the utility (pure functions) --------------------------------------
def progress_curve(updates: torch.Tensor) -> torch.Tensor:
    """P_i (eq. 1) for every row G_i of `updates` against the last row G_K:
    cos(G_i, G_K) · min(|G_i|, |G_K|) / max(|G_i|, |G_K|), 0 where a norm is 0."""
    updates = updates.double()
    final = updates[-1]
    norms, final_norm = torch.linalg.vector_norm(updates, dim=1), torch.linalg.vector_norm(final)
    product = norms * final_norm
    cosine = torch.where(product > 0, updates @ final / product.clamp_min(1e-300), 0.0)
    high = torch.maximum(norms, final_norm)
    ratio = torch.where(high > 0, torch.minimum(norms, final_norm) / high.clamp_min(1e-300), 0.0)
    return cosine * ratio


def net_utility(
    curve: torch.Tensor, tau: int, elapsed_s: float, round_s: float, beta: float
) -> float:
    """n = b - c of running iteration `tau` (1-based) of a round of K = len(curve) - 1
    (eq. 2-4): b = max(P_τ - P_{τ-1}, (1 - P_τ) / (K - τ)), c = f · t / T_R with f = β
    while t <= T_R, else 1."""
    k = len(curve) - 1
    gain = float(curve[tau] - curve[tau - 1])
    remaining = (1.0 - float(curve[tau])) / (k - tau) if tau < k else 0.0
    weight = beta if elapsed_s <= round_s else 1.0
    return max(gain, remaining) - weight * elapsed_s / round_s


def round_time(expected_s: Sequence[float]) -> float:
    """T_R: the expected finishing time t that maximises (clients done by t) / t."""
    ordered = sorted(expected_s)
    return max(((k + 1) / t, t) for k, t in enumerate(ordered))[1] if ordered else math.inf


def eager_steps(layer_curves: torch.Tensor, threshold: float) -> list[int]:
    """The first iteration τ < K at which each layer's anchor curve passes T_e (0: none)."""
    passed = layer_curves[:, 1:-1] > threshold
    first = passed.int().argmax(dim=1) + 1
    return [int(s) if hit else 0 for s, hit in zip(first, passed.any(dim=1), strict=True)]


def layer_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two layer updates (1 when both are zero: nothing drifted)."""
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a.double() @ b.double()) / (na * nb)


# ----- the reply codec ------------------------------------------------------------------
class EagerLayers(Codec):
    """Per tensor, the float32 values at the carried positions (`mask`, known to both
    sides; all when absent): the version the server keeps. For each tensor in `indices`
    (layers sent eagerly and re-sent) also `early/NAME`, the superseded eager copy taken
    from `base`: it crossed the link, so it is counted, but its values are not used.
    Decoding fills positions not carried from the receiver's `base`."""

    name = "eager_layers"

    def encode(self, vector: torch.Tensor, options: Options) -> ArrayRecord:
        layout = require(options.layout, "eager_layers needs a layout")
        carried = _carried(options.mask, layout)
        resent = set() if options.indices is None else set(options.indices.tolist())
        arrays = {}
        for layer, (name, values, where) in enumerate(_split(vector, carried, layout)):
            arrays[name] = numpy_to_array(values[where].float().numpy())
            if layer in resent:
                copy = require(options.base, "re-sends need the eager copy")
                early = torch.split(copy, list(layout.sizes))[layer]
                arrays[EARLY + name] = numpy_to_array(early[where].float().numpy())
        return array_record(arrays)

    def decode(self, arrays: ArrayRecord, options: Options) -> torch.Tensor:
        layout = require(options.layout, "eager_layers needs a layout")
        carried = _carried(options.mask, layout)
        base = options.base if options.mask is not None else torch.zeros(layout.numel)
        out = require(base, "eager_layers with a mask needs the receiver's base").clone()
        expected = set(layout.names)
        parts = zip(_split(out, carried, layout), layout.names, strict=True)
        for (_, values, where), name in parts:
            values[where] = _floats(arrays, name, int(where.sum()))
            if EARLY + name in arrays:
                _floats(arrays, EARLY + name, int(where.sum()))
                expected.add(EARLY + name)
        extra = sorted(set(arrays) - expected)
        if extra:
            raise CodecError(f"eager_layers payload has unknown arrays {extra}")
        return out


def _carried(mask: torch.Tensor | None, layout: Layout) -> torch.Tensor:
    if mask is None:
        return torch.ones(layout.numel, dtype=torch.bool)
    if mask.dtype != torch.bool or mask.shape != (layout.numel,):
        raise CodecError(f"mask is {mask.dtype} {tuple(mask.shape)}, not ({layout.numel},) bool")
    return mask


def _split(
    vector: torch.Tensor, carried: torch.Tensor, layout: Layout
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, values, carried) per tensor; the values are views into `vector`."""
    return list(
        zip(
            layout.names,
            torch.split(vector, list(layout.sizes)),
            torch.split(carried, list(layout.sizes)),
            strict=True,
        )
    )


def _floats(arrays: ArrayRecord, name: str, count: int) -> torch.Tensor:
    """The `count` float32 values of untrusted 1-D array `name`."""
    raw = read(arrays, name)
    if raw.dtype != np.float32 or raw.shape != (count,):
        raise CodecError(f"eager_layers {name} is {raw.dtype} {raw.shape}, not ({count},) float32")
    return torch.from_numpy(raw.copy())


register_codec(EagerLayers())


# ----- server half ----------------------------------------------------------------------
class FedCAServer(ServerStrategy):
    """FedAvg plus a round time T_R per round, and eager layers credited on the clock."""

    dpsgd_safe = False  # clients stop early: DP-SGD's plan assumes the run's step count
    min_local_steps = 1  # a client may stop after its first iteration (utility < 0)

    params: FedCAParams
    state_attributes = ("observed_speed",)

    def __init__(self, params: FedCAParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.round_s = math.inf
        self.observed_speed: dict[int, float] = {}  # node -> samples/s in its last landed round

    def select(self, server_round: int, candidates: Sequence[int]) -> list[int]:
        chosen = super().select(server_round, candidates)
        self.round_s = round_time([self.expected_s(node) for node in chosen])
        return chosen

    def recent_speed(self, node: int) -> float | None:
        """`node`'s speed as last observed; unobserved, the median of those observed (None:
        nothing observed yet)."""
        if node in self.observed_speed:
            return self.observed_speed[node]
        known = sorted(self.observed_speed.values())
        return known[len(known) // 2] if known else None

    def expected_s(self, node: int) -> float:
        """A full round of `node` (dense float32 model both ways, K iterations) at its
        recent speed (before any observation: the speed its device announces); inf where
        the loop tells nothing of time."""
        view = self.extra_config(node)
        if "device-speed" not in view or self.layout is None:
            return math.inf
        nbytes = 4 * self.layout.numel
        samples = self.params.local_steps * self.params.batch_size
        speed = self.recent_speed(node) or view["device-speed"]
        return nbytes / view["device-down-bps"] + samples / speed + nbytes / view["device-up-bps"]

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> torch.Tensor:
        """FedAvg; first each landed reply's speed: its samples (within what it was asked
        for) over the compute span the loop observed (none on real arrivals)."""
        asked = self.params.local_steps * self.params.batch_size
        for u in updates:
            info = self.reply_info.get(u.node_id)
            samples = u.metrics.get("samples")
            if info is None or info.compute_s is None or not info.compute_s > 0:
                continue
            if isinstance(samples, int) and not isinstance(samples, bool) and samples > 0:
                self.observed_speed[u.node_id] = min(samples, asked) / info.compute_s
        return super().aggregate(server_round, updates)

    def train_config(self, server_round: int, node_id: int) -> dict[str, Any]:
        return {**super().train_config(server_round, node_id), "fedca-round-s": self.round_s}

    def carried(self) -> torch.Tensor | None:
        """Positions this round's replies carry (None: every scalar)."""
        return None

    def reply_parts(self, reply: Message, up_bytes: int) -> UploadParts:
        """Eager layers leave when the reply says they did (each part the bytes of its
        carried values, in that order); the rest, re-sends included, when training ends."""
        whole = ((1.0, up_bytes),)
        if not reply.has_content() or self.layout is None:
            return whole
        metrics = reply.content.metric_records.get("metrics")
        left = metrics.get("fedca-eager-samples") if metrics is not None else None
        samples = metrics.get("samples") if metrics is not None else None
        carried = _carried(self.carried(), self.layout)
        sizes = [4 * int(c.sum()) for c in torch.split(carried, list(self.layout.sizes))]
        if not (isinstance(left, list) and len(left) == len(sizes) and isinstance(samples, int)):
            return whole
        parts = sorted(
            (min(s / samples, 1.0), size)
            for s, size in zip(left, sizes, strict=True)
            if isinstance(s, int) and s > 0 and samples > 0
        )
        early = sum(size for _, size in parts)
        return (*parts, (1.0, up_bytes - early)) if early <= up_bytes else whole

    def diagnostics(self) -> dict[str, Any]:
        out = super().diagnostics()
        tuned = [u.metrics for u in self.stats.updates if not u.metrics.get("fedca-anchor")]
        steps = [int(m.get("steps", 0)) for m in tuned]
        eager = [s for m in tuned for s in int_list(m.get("fedca-eager-steps")) if s > 0]
        out.update(
            round_deadline_s=self.round_s,
            anchors=len(self.stats.updates) - len(tuned),
            stop_steps=steps,
            mean_stop_step=sum(steps) / len(steps) if steps else None,
            eager_steps=eager,
            eager_layers=len(eager),
            resent_layers=sum(sum(int_list(m.get("fedca-resent"))) for m in tuned),
        )
        return out


def int_list(value: Any) -> list[int]:
    """The ints of a reply's per-layer metric (nothing if it is not a list)."""
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


# ----- client half ----------------------------------------------------------------------
@dataclass
class Profile:
    """Anchor curves: P_i of the whole model (K+1,) and of each layer (L, K+1)."""

    round: int
    model: torch.Tensor
    layers: torch.Tensor

    def save(self, state: RecordDict) -> None:
        state[PROFILE] = ArrayRecord(
            {
                "round": numpy_to_array(np.array([self.round], dtype=np.int64)),
                "model": numpy_to_array(self.model.numpy()),
                "layers": numpy_to_array(self.layers.numpy()),
            }
        )

    @classmethod
    def load(cls, state: RecordDict) -> Profile | None:
        record = state.array_records.get(PROFILE)
        if record is None:
            return None
        parts = {name: torch.from_numpy(array_to_numpy(a).copy()) for name, a in record.items()}
        return cls(int(parts["round"][0]), parts["model"], parts["layers"])


def sample_indices(layout: Layout, server_round: int, params: FedCAParams) -> list[torch.Tensor]:
    """Per layer, min(fraction of it, cap) random scalars (flat positions), drawn anew at
    every anchor round."""
    out, offset = [], 0
    for layer, size in enumerate(list(layout.sizes)):
        count = max(1, min(math.ceil(params.sample_fraction * size), params.sample_cap))
        generator = torch.Generator().manual_seed(derive_seed(server_round, layer, 0xFCA))
        out.append(offset + torch.randperm(size, generator=generator)[:count])
        offset += size
    return out


class FedCAHooks(ClientHooks):
    """Anchor rounds record the curves; other rounds stop early and send layers eagerly."""

    params: FedCAParams

    def load(
        self, model: nn.Module, content: RecordDict, state: RecordDict, layout: Layout
    ) -> None:
        super().load(model, content, state, layout)
        self.layout = layout
        self.start = layout.read(model)

    def begin(self, model: nn.Module, config: ConfigRecord, state: RecordDict) -> None:
        server_round = int(cast(int, config["server-round"]))
        self.round_s = float(cast(float, config.get("fedca-round-s", math.inf)))
        self.profile = Profile.load(state)
        self.anchor = (
            self.profile is None
            or server_round - self.profile.round >= self.params.profile_every
            or len(self.profile.model) != self.params.local_steps + 1
        )
        self.server_round, self.steps = server_round, 0
        self.eager_at: list[int] = [0] * len(list(self.layout.sizes))
        self.snapshots: dict[int, torch.Tensor] = {}  # layer -> its values when sent
        self.left_samples: dict[int, int] = {}
        if self.anchor:
            self.samples = sample_indices(self.layout, server_round, self.params)
            self.recorded = [torch.zeros(sum(len(s) for s in self.samples))]
        elif self.params.eager:
            assert self.profile is not None
            self.eager_at = eager_steps(self.profile.layers, self.params.eager_threshold)

    def after_step(self, step: int, model: nn.Module, loss: torch.Tensor) -> bool:
        self.steps = step
        if self.anchor:
            update = self.layout.read(model) - self.start
            self.recorded.append(torch.cat([update[s] for s in self.samples]))
            return True
        due = [layer for layer, at in enumerate(self.eager_at) if at == step]
        if due:
            current = torch.split(self.layout.read(model), list(self.layout.sizes))
            for layer in due:
                self.snapshots[layer] = current[layer].clone()
                self.left_samples[layer] = self.time.samples
        assert self.profile is not None
        if step >= len(self.profile.model) - 1:
            return True  # the round's last iteration: the trainer stops anyway
        utility = net_utility(
            self.profile.model, step + 1, self.time.elapsed_s, self.round_s, self.params.beta
        )
        return utility >= 0

    def end(self, model: nn.Module, state: RecordDict, layout: Layout) -> Reply:
        final = layout.read(model)
        if self.anchor:
            self._save_profile(state)
            return encode(final, "dense", layout=layout), {"fedca-anchor": 1}
        return self.eager_reply(final)

    def eager_reply(
        self,
        final: torch.Tensor,
        carried: torch.Tensor | None = None,
        other: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Reply:
        """Encode the trained model `final` at the `carried` positions (all: None) with
        each eagerly sent layer at its eager version, unless it drifted (cos < T_r under
        v3): then the final version goes, after the eager copy. `other`: (where, values)
        positions that carry something else (FedCA+'s speculation errors)."""
        layout = self.layout
        kept = final.clone() if other is None else torch.where(other[0], other[1], final)
        early = kept.clone()
        fixed = torch.zeros_like(final, dtype=torch.bool) if other is None else other[0]
        sizes = len(list(layout.sizes))
        steps, left, resent = [0] * sizes, [0] * sizes, [0] * sizes
        offsets = np.cumsum([0, *layout.sizes]).tolist()
        for layer, snapshot in self.snapshots.items():
            if self.eager_at[layer] >= self.steps:
                continue  # training stopped as the layer left: it goes with the rest
            lo, hi = offsets[layer], offsets[layer + 1]
            steps[layer], left[layer] = self.eager_at[layer], self.left_samples[layer]
            early[lo:hi] = torch.where(fixed[lo:hi], kept[lo:hi], snapshot)
            drift = layer_cosine(final[lo:hi] - self.start[lo:hi], snapshot - self.start[lo:hi])
            if self.params.resend and drift < self.params.resend_threshold:
                resent[layer] = 1
            else:
                kept[lo:hi] = early[lo:hi]
        indices = torch.tensor([i for i, r in enumerate(resent) if r], dtype=torch.int64)
        records = encode(
            kept, "eager_layers", layout=layout, base=early, mask=carried, indices=indices
        )
        metrics: dict[str, Any] = {  # per-layer lists: a MetricRecord holds them
            "fedca-anchor": 0,
            "fedca-eager-steps": steps,
            "fedca-eager-samples": left,
            "fedca-resent": resent,
        }
        return records, cast(dict[str, float | int], metrics)

    def _save_profile(self, state: RecordDict) -> None:
        """Curves of the whole model (all samples) and of each layer from this anchor."""
        updates = torch.stack(self.recorded)
        bounds = np.cumsum([0, *(len(s) for s in self.samples)]).tolist()
        layers = torch.stack(
            [progress_curve(updates[:, lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        )
        Profile(self.server_round, progress_curve(updates), layers).save(state)


STRATEGY = register("fedca", server=FedCAServer, client=FedCAHooks, params=FedCAParams)

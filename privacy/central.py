"""Flower's server-side central-DP wrappers (fixed or adaptive clipping) around our strategies.

`flwr.serverapp.strategy.DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping` wrap a
message-API Strategy: they clip each reply's update against the global model, delegate
aggregation, and add Gaussian noise of std σ·C/n to the aggregate (n: clients sampled).
Our strategies may reply with compressed payloads, so `CentralDP` hands the wrapper each
reply decoded to dense arrays and puts the original records back afterwards (the round
loop counts bytes from them). Everything else the round loop uses (selection,
diagnostics, resume) is delegated to the inner strategy.

Invariants the wrapper checks, because the noise is only as good as them:
- Sensitivity. σ·C/n assumes that one client moves the aggregate by at most C/n. Our
  aggregation is example-weighted (a large client's weight can be several times 1/n)
  and averages over the replies that arrived (fewer than n when some fail), so under
  central DP every reply weighs the same and the inner strategy's mean over its m
  accepted replies is scaled by m/n: DP-FedAvg's fixed denominator (McMahan et al.,
  ICLR 2018), the aggregate moving by Σ clip(Δ_i) / n.
- Every client receives the whole noised model. A strategy whose clients keep their own
  copy of scalars the server does not resend (APF's frozen scalars) would leave those
  copies without the server's noise, so clients and server would train different
  models: such a strategy declares `central_dp_safe = False` on its server half and is
  refused (config validation names it before round 1); any other strategy that sends a
  node less than the dense model stops the run.

Not offered: the client-side wrappers (they need Flower's clipping mods on a
ClientApp whose mods are fixed at import), and SecAgg+, which in flwr 1.42 only works
with the legacy NumPyClient + workflow stack (docs/PRIVACY.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)
from omegaconf import DictConfig

from fl.common.errors import RunError
from fl.run.console import flower_logs_once
from fl.strategy.server import ServerStrategy
from fl.wire.codec import encode_dense
from fl.wire.records import vector_to_arrays

__all__ = ["MODES", "CentralDP", "FixedDenominator", "wrap_central_dp"]

MODES = ("none", "fixed", "adaptive")


class FixedDenominator:
    """The inner strategy as Flower's wrapper sees it: each accepted reply moves the model by Δ/n.

    The inner strategy aggregates the clipped replies (equally weighted by `CentralDP`)
    to their mean over the m it accepts; that move is scaled by m/n, before the noise.
    """

    def __init__(self, inner: ServerStrategy, sampled: int) -> None:
        self.inner = inner
        self.sampled = sampled

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "sampled"):  # not yet set (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The inner aggregate, its move from the global model scaled by accepted / sampled."""
        before = self.inner.global_vector.clone()
        accepted_before = self.inner.stats.accepted  # of the round's earlier exchanges
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        accepted = self.inner.stats.accepted - accepted_before
        if arrays is None or accepted >= self.sampled:
            return arrays, metrics
        layout = self.inner.layout
        assert layout is not None
        after = layout.flatten(arrays.to_torch_state_dict())
        moved = before + (accepted / self.sampled) * (after - before)
        return vector_to_arrays(moved, layout), metrics


class CentralDP:
    """A Flower DP wrapper driven by our round loop; duck-types `ServerStrategy`."""

    def __init__(self, inner: ServerStrategy, wrapper: Any) -> None:
        if not getattr(inner, "central_dp_safe", True):
            raise RunError(
                f"central DP cannot wrap {type(inner).__name__}: its clients keep model "
                "copies that the server's noise would not reach"
            )
        self.inner = inner
        self.wrapper = wrapper

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "wrapper"):  # not yet set (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapper remembers the global model, then the inner strategy selects.

        Every node must get the whole (noised) model: a partial payload leaves the rest of
        the node's own copy without the noise, so it stops the run.
        """
        messages = list(self.wrapper.configure_train(server_round, arrays, config, grid))
        for message in messages:
            codec = message.content.config_records.get("codec")
            name = "dense" if codec is None else codec.get("name")
            if name != "dense":
                raise RunError(
                    f"central DP: {type(self.inner).__name__} sent node "
                    f"{message.metadata.dst_node_id} a {name!r} payload in round {server_round}; "
                    "a node that keeps its own copy of unsent scalars misses the server's noise"
                )
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip (on dense arrays), aggregate with equal weights through the inner one, add noise."""
        replies = list(replies)
        originals = []
        key = self.inner.weighted_by_key
        for reply in replies:
            if not reply.has_content():
                continue
            try:
                node = reply.metadata.src_node_id
                vector = self.inner.decode_reply(reply, self.inner.base_of(node))
            except Exception:  # malformed: the inner strategy rejects it with the reason
                continue
            originals.append((reply, dict(reply.content)))
            for name in list(reply.content.array_records):
                del reply.content[name]
            reply.content.update(encode_dense(vector, self.inner.layout))  # type: ignore[arg-type]
            metrics = reply.content.metric_records.get("metrics", MetricRecord())
            count = metrics.get(key)
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                # equal weights (an invalid count is left for the inner strategy to reject)
                reply.content["metrics"] = MetricRecord({**metrics, key: 1})
        try:
            result = self.wrapper.aggregate_train(server_round, replies)
        finally:
            for reply, records in originals:
                reply.content.clear()
                reply.content.update(records)
        return cast(tuple[ArrayRecord | None, MetricRecord | None], result)

    def diagnostics(self) -> dict[str, Any]:
        """The inner strategy's diagnostics and the wrapper's current clipping norm."""
        return {**self.inner.diagnostics(), "dp_clipping_norm": float(self.wrapper.clipping_norm)}

    def state_dict(self) -> dict[str, Any]:
        """Inner state plus the (adaptive) clipping norm."""
        return {"inner": self.inner.state_dict(), "clipping_norm": self.wrapper.clipping_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s output."""
        self.inner.load_state_dict(state["inner"])
        self.wrapper.clipping_norm = state["clipping_norm"]


def wrap_central_dp(strategy: ServerStrategy, cfg: DictConfig) -> ServerStrategy:
    """`strategy` inside the configured Flower DP wrapper (`privacy.server_dp`), if any."""
    options = cfg.privacy.get("server_dp")
    if options is None or options.mode == "none":
        return strategy
    flower_logs_once()  # the wrappers log every round through Flower's logger
    sampled = int(cfg.clients_per_round)
    inner = cast(Any, FixedDenominator(strategy, sampled))
    if options.mode == "fixed":
        wrapper: Any = DifferentialPrivacyServerSideFixedClipping(
            inner, float(options.noise_multiplier), float(options.clipping_norm), sampled
        )
    else:
        wrapper = DifferentialPrivacyServerSideAdaptiveClipping(
            inner,
            float(options.noise_multiplier),
            sampled,
            initial_clipping_norm=float(options.clipping_norm),
            target_clipped_quantile=float(options.target_clipped_quantile),
            clip_norm_lr=float(options.clip_norm_lr),
        )
    return cast(ServerStrategy, CentralDP(strategy, wrapper))

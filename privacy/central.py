"""Flower's server-side central-DP wrappers (fixed or adaptive clipping) around our strategies.

`flwr.serverapp.strategy.DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping` wrap a
message-API Strategy: they clip each reply's update against the global model, delegate
aggregation, and add Gaussian noise to the aggregate. Our strategies may reply with
compressed payloads, so `CentralDP` hands the wrapper each reply decoded to dense
arrays and puts the original records back afterwards (the round loop counts bytes
from them). Everything else the round loop uses (selection, diagnostics, resume) is
delegated to the inner strategy.

Not offered: the client-side wrappers (they need Flower's clipping mods on a
ClientApp whose mods are fixed at import), and SecAgg+, which in flwr 1.42 only works
with the legacy NumPyClient + workflow stack (docs/PRIVACY.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)
from omegaconf import DictConfig

from fl.codec import encode_dense
from fl.console import flower_logs_once
from fl.strategy import ServerStrategy

__all__ = ["MODES", "CentralDP", "wrap_central_dp"]

MODES = ("none", "fixed", "adaptive")


class CentralDP:
    """A Flower DP wrapper driven by our round loop; duck-types `ServerStrategy`."""

    def __init__(self, inner: ServerStrategy, wrapper: Any) -> None:
        self.inner = inner
        self.wrapper = wrapper

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "wrapper"):  # not yet set (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def reachable(self) -> Callable[[int, list[int]], list[int]]:
        """The inner strategy's filter of reachable nodes (set by the round loop)."""
        return self.inner.reachable

    @reachable.setter
    def reachable(self, value: Callable[[int, list[int]], list[int]]) -> None:
        self.inner.reachable = value

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapper remembers the global model, then the inner strategy selects."""
        return self.wrapper.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip (on dense arrays), aggregate through the inner strategy, add noise."""
        replies = list(replies)
        originals = []
        for reply in replies:
            if not reply.has_content():
                continue
            try:
                vector = self.inner.decode_reply(reply)
            except Exception:  # malformed: the inner strategy rejects it with the reason
                continue
            originals.append((reply, dict(reply.content)))
            for name in list(reply.content.array_records):
                del reply.content[name]
            reply.content.update(encode_dense(vector, self.inner.layout))  # type: ignore[arg-type]
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
    if options.mode == "fixed":
        wrapper: Any = DifferentialPrivacyServerSideFixedClipping(
            strategy, float(options.noise_multiplier), float(options.clipping_norm), sampled
        )
    else:
        wrapper = DifferentialPrivacyServerSideAdaptiveClipping(
            strategy,
            float(options.noise_multiplier),
            sampled,
            initial_clipping_norm=float(options.clipping_norm),
            target_clipped_quantile=float(options.target_clipped_quantile),
            clip_norm_lr=float(options.clip_norm_lr),
        )
    return cast(ServerStrategy, CentralDP(strategy, wrapper))

"""The server's view of client privacy: ε per round and per client, and ledger charges.

`server/loop.py` asks it once before the first round (`start`: with a ledger, the run
becomes a DPBalance-scheduled pipeline and needs a grant), before each round
(`admit`: the round's ε spend, projected with Opacus's accountant for exactly the
clients selected, is charged to the ledger in one transaction, or the run stops), and
after each round (`observe`: max and mean of the ε the clients reported).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from fl.strategy import ClientUpdate
from fl.task import Task
from privacy.dpsgd import BUDGET_KEY, DPSGD

__all__ = ["RoundPrivacy"]

log = logging.getLogger(__name__)


class RoundPrivacy:
    """Per-run privacy bookkeeping on the server; every method is a no-op without DP-SGD."""

    def __init__(self, cfg: DictConfig, task: Task, out_dir: Path) -> None:
        self.dp = DPSGD.from_config(cfg)
        self.sizes = [len(p) for p in task.partitions]
        ledger = cfg.privacy.get("ledger") if self.dp else None
        self.ledger_cfg = ledger if ledger is not None and ledger.get("path") else None
        self.pipeline = ""
        if self.ledger_cfg is not None:
            self.pipeline = str(self.ledger_cfg.pipeline or out_dir.resolve().name)
        self.epsilon: dict[int, float] = {}  # partition -> latest ε it reported
        self.participations: dict[int, int] = {}  # partition -> rounds charged
        self.grant: dict[int, float] = {}  # partition -> ε granted on its block
        self.stopped: str | None = None
        self.resume = bool(cfg.resume)

    # ----- ledger -------------------------------------------------------------------------
    def _block(self, partition: int) -> str:
        assert self.ledger_cfg is not None
        return f"{self.ledger_cfg.block_prefix}/client-{partition}"

    def _open(self) -> Any:
        from privacy.ledger import Ledger

        assert self.ledger_cfg is not None
        return Ledger(Path(str(self.ledger_cfg.path)))

    def start(self) -> str | None:
        """Before round 1: get (or find) this pipeline's grant; a reason to stop, or None."""
        if self.ledger_cfg is None:
            return None
        from privacy.dpbalance import Pipeline, make_scheduler

        c = self.ledger_cfg
        blocks = {self._block(p): float(c.block_budget) for p in range(len(self.sizes))}
        with self._open() as ledger:
            ledger.add_blocks(blocks)
            record = ledger.pipeline(self.pipeline)
            if record is not None and record.status != "waiting" and not self.resume:
                # a fresh run under an old id would restart its clients' accountants at 0
                # while the ledger already holds charges for its rounds: refuse
                self.stopped = (
                    f"privacy budget: pipeline {self.pipeline!r} already exists in the ledger "
                    f"({record.status}); set a new privacy.ledger.pipeline, or resume=true"
                )
                return self.stopped
            if record is None:
                demand = dict.fromkeys(blocks, float(c.demand_epsilon))
                ledger.submit(Pipeline(self.pipeline, str(c.analyst), demand, time.time()))
                record = ledger.pipeline(self.pipeline)
            if record is not None and record.status == "waiting":
                kappa_max = None if c.kappa_max is None else float(c.kappa_max)
                scheduler = make_scheduler(
                    str(c.scheduler), beta=float(c.beta), kappa_max=kappa_max
                )
                ledger.schedule(scheduler)
                record = ledger.pipeline(self.pipeline)
        assert record is not None
        if record.status != "granted":
            why = (
                f"not granted by the {c.scheduler} scheduler (too little budget left for its "
                "demand)"
                if record.status == "waiting"
                else record.note or "no grant left"
            )
            self.stopped = (
                f"privacy budget: pipeline {self.pipeline!r} is {record.status}: {why}; "
                "no round was run"
            )
            return self.stopped
        self.grant = {p: record.granted[self._block(p)] for p in range(len(self.sizes))}
        log.info(
            "pipeline %r granted κ=%.3f: ε %.4g per client block",
            self.pipeline,
            record.kappa or 0.0,
            min(self.grant.values()),
        )
        return None

    def _target(self) -> float | None:
        if self.ledger_cfg is None or not self.ledger_cfg.noise_from_grant or not self.grant:
            return None
        return min(self.grant.values())

    def train_config(self) -> dict[str, Any]:
        """Keys every train instruction carries: the ε budget that sizes the clients' noise."""
        target = self._target()
        return {} if target is None else {BUDGET_KEY: target}

    def admit(self, server_round: int, partitions: list[int]) -> str | None:
        """Charge the round's projected ε to the ledger; a reason to stop instead, or None."""
        if self.ledger_cfg is None or self.dp is None:
            return None
        from privacy.ledger import BudgetExceeded

        spend = {}
        for p in partitions:
            plan = self.dp.plan(self.sizes[p], self._target())
            done = self.participations.get(p, 0)
            after = self.dp.projected_epsilon(plan, done + 1)
            spend[self._block(p)] = max(after - self.dp.projected_epsilon(plan, done), 0.0)
        try:
            with self._open() as ledger:
                ledger.charge(self.pipeline, server_round, spend)
        except BudgetExceeded as err:
            self.stopped = (
                f"privacy budget: {err}; stopped before round {server_round}, "
                f"the model of round {server_round - 1} is kept"
            )
            with self._open() as ledger:
                ledger.set_status(self.pipeline, "stopped", self.stopped)
            return self.stopped
        for p in partitions:
            self.participations[p] = self.participations.get(p, 0) + 1
        return None

    def finish(self) -> None:
        """Mark the pipeline finished in the ledger (unless it stopped)."""
        if self.ledger_cfg is not None and self.stopped is None and self.grant:
            with self._open() as ledger:
                ledger.set_status(self.pipeline, "finished")

    # ----- metrics ------------------------------------------------------------------------
    def observe(self, updates: list[ClientUpdate], partitions: dict[int, int]) -> dict[str, Any]:
        """Max and mean ε over this round's accepted replies (fields of the metrics row).

        The partition comes from the server's own node map, never from the reply.
        """
        if self.dp is None:
            return {}
        values = []
        for update in updates:
            epsilon = update.metrics.get("epsilon")
            if isinstance(epsilon, int | float) and update.node_id in partitions:
                self.epsilon[partitions[update.node_id]] = float(epsilon)
                values.append(float(epsilon))
        return {
            "epsilon_max": max(values) if values else None,
            "epsilon_mean": sum(values) / len(values) if values else None,
        }

    def summary(self) -> dict[str, Any]:
        """Final ε per client (partition id), the largest, and why the run stopped early."""
        if self.dp is None:
            return {}
        out: dict[str, Any] = {
            "epsilon_per_client": {str(p): e for p, e in sorted(self.epsilon.items())},
            "epsilon_max": max(self.epsilon.values(), default=0.0),
            "delta": self.dp.delta,
            "stopped": self.stopped,
        }
        if self.ledger_cfg is not None:
            out["ledger"] = {
                "path": str(self.ledger_cfg.path),
                "pipeline": self.pipeline,
                "granted_epsilon": min(self.grant.values(), default=0.0),
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs (the checkpoint keeps it)."""
        return {
            "epsilon": dict(self.epsilon),
            "participations": dict(self.participations),
            "stopped": self.stopped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s output."""
        self.epsilon = dict(state.get("epsilon", {}))
        self.participations = dict(state.get("participations", {}))
        self.stopped = state.get("stopped")

"""The server's view of client privacy: (ε, δ) per round and per client, and ledger charges.

`server/loop.py` asks it once before the first round (`start`: with a ledger, the run
claims its pipeline under a lease and needs a DPBalance grant), before each round
(`admit`: the round's spend, projected with Opacus's accountant for exactly the clients
selected, is charged to the ledger in one transaction that also renews the lease, or the
run stops), after each round (`observe`: max and mean ε of the clients that replied, and
another heartbeat) and at the end (`finish`: the unspent grant goes back to the blocks).
A run that dies stops heartbeating; its lease lapses and the ledger takes the grant back.

ε is the server's: Opacus's accountant over the σ, sampling rate and steps the server
configured, for every round a client was asked to train (as the ledger charges). The ε a
client reports is untrusted; it is only compared with the server's, and a mismatch logged.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from fl.common.files import require_regular
from fl.strategy.server import ClientUpdate
from fl.world.task import Task
from privacy.dpsgd import BUDGET_KEY, DPSGD

__all__ = ["RoundPrivacy"]

log = logging.getLogger(__name__)


class RoundPrivacy:
    """Per-run privacy bookkeeping on the server; every method is a no-op without DP-SGD."""

    def __init__(self, cfg: DictConfig, task: Task, out_dir: Path) -> None:
        self.dp = DPSGD.from_config(cfg)
        self.sizes = task.sizes  # examples per partition (an array: one int64 a client)
        ledger = cfg.privacy.get("ledger") if self.dp else None
        self.ledger_cfg = ledger if ledger is not None and ledger.get("path") else None
        self.pipeline = self.holder = ""
        self.lease_s = 0.0
        if self.ledger_cfg is not None:
            from privacy.ledger import new_holder

            # run directories repeat (HH-MM-SS; 0, 1, ... in a multirun): a fresh id per run,
            # which the checkpoint keeps so that a resume claims the same pipeline
            fresh = f"{out_dir.resolve().name}-{uuid.uuid4().hex[:12]}"
            self.pipeline = str(self.ledger_cfg.pipeline or fresh)
            self.holder = new_holder()
            self.lease_s = float(self.ledger_cfg.lease_s)
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
        from privacy.ledger import Ledger, LedgerError

        assert self.ledger_cfg is not None
        path = Path(str(self.ledger_cfg.path))
        try:
            require_regular(path)  # a FIFO or a directory there is refused, not opened
            return Ledger(path)
        except (OSError, sqlite3.Error) as err:  # a folder it cannot make, a file not a ledger
            raise LedgerError(
                f"privacy.ledger.path={path}: cannot open a ledger there: {err}"
            ) from None

    def start(self) -> str | None:
        """Before round 1: claim this pipeline and get (or find) its grant; a reason to stop."""
        if self.ledger_cfg is None or self.dp is None:
            return None
        from privacy.dpbalance import Pipeline, make_scheduler
        from privacy.ledger import LedgerError

        c = self.ledger_cfg
        blocks = {self._block(p): float(c.block_budget) for p in range(len(self.sizes))}
        pipeline = Pipeline(
            self.pipeline,
            str(c.analyst),
            dict.fromkeys(blocks, float(c.demand_epsilon)),
            time.time(),
        )
        kappa_max = None if c.kappa_max is None else float(c.kappa_max)
        scheduler = make_scheduler(str(c.scheduler), beta=float(c.beta), kappa_max=kappa_max)
        try:
            with self._open() as ledger:
                ledger.add_blocks(blocks, delta=float(c.block_delta))
                record = ledger.claim(
                    pipeline, self.holder, self.lease_s, delta=self.dp.delta, resume=self.resume
                )
                if record.status == "waiting":  # a run does not wait: granted now, or cancelled
                    ledger.schedule(scheduler, cancel_if_waiting=self.pipeline)
                    record = ledger.pipeline(self.pipeline)
        except LedgerError as err:
            self.stopped = f"privacy budget: {err}"
            return self.stopped
        assert record is not None
        if record.status != "granted":
            self.stopped = (
                f"privacy budget: pipeline {self.pipeline!r} is {record.status}: "
                f"{record.note or 'no grant left'}"
            )
            return self.stopped
        self.stopped = None  # a resume re-granted after a lost lease runs on
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
        """Charge the round's projected (ε, δ) and renew the lease; a reason to stop, or None."""
        if self.dp is None:
            return None
        if self.ledger_cfg is None:  # nothing to charge; the count still gives the server's ε
            self._took_part(partitions)
            return None
        if self.stopped is not None:  # the lease was lost after the last round
            return self.stopped
        from privacy.ledger import BudgetExceeded, LedgerError

        spend, delta = {}, {}
        for p in partitions:
            plan = self.dp.plan(int(self.sizes[p]), self._target())
            done = self.participations.get(p, 0)
            after = self.dp.projected_epsilon(plan, done + 1)
            spend[self._block(p)] = max(after - self.dp.projected_epsilon(plan, done), 0.0)
            # the accountant's ε holds at one δ for all of a client's rounds: δ is spent once
            delta[self._block(p)] = self.dp.delta if done == 0 else 0.0
        try:
            with self._open() as ledger:
                ledger.charge(
                    self.pipeline,
                    server_round,
                    spend,
                    delta=delta,
                    holder=self.holder,
                    lease_s=self.lease_s,
                )
        except LedgerError as err:
            self.stopped = (
                f"privacy budget: {err}; stopped before round {server_round}, "
                f"the model of round {server_round - 1} is kept"
            )
            if isinstance(err, BudgetExceeded):
                self._end("stopped", self.stopped)
            return self.stopped
        self._took_part(partitions)
        return None

    def _took_part(self, partitions: list[int]) -> None:
        for p in partitions:
            self.participations[p] = self.participations.get(p, 0) + 1

    def server_epsilon(self, partition: int) -> float:
        """ε of a client after the rounds it was asked to train, with σ, q, steps as configured."""
        assert self.dp is not None
        plan = self.dp.plan(int(self.sizes[partition]), self._target())
        return self.dp.projected_epsilon(plan, self.participations.get(partition, 0))

    def _heartbeat(self) -> None:
        """Renew the lease after a round's training; a lost lease stops the run before the next."""
        if self.ledger_cfg is None or not self.grant or self.stopped is not None:
            return
        from privacy.ledger import LedgerError

        try:
            with self._open() as ledger:
                ledger.heartbeat(self.pipeline, self.holder, self.lease_s)
        except LedgerError as err:
            self.stopped = f"privacy budget: {err}; no further round is run"
            log.warning("%s", self.stopped)

    def finish(self) -> None:
        """Mark the pipeline finished (unless it stopped): its unspent grant goes back."""
        if self.ledger_cfg is not None and self.stopped is None and self.grant:
            self._end("finished", None)

    def _end(self, status: str, note: str | None) -> None:
        from privacy.ledger import LedgerError

        try:
            with self._open() as ledger:
                ledger.set_status(self.pipeline, status, note, holder=self.holder)
        except LedgerError as err:  # the lease was lost: the ledger has ended it already
            log.warning("privacy budget: %s", err)

    # ----- metrics ------------------------------------------------------------------------
    def observe(self, updates: list[ClientUpdate], partitions: Mapping[int, int]) -> dict[str, Any]:
        """Max and mean server ε over this round's accepted replies (fields of the metrics row).

        The partition comes from the server's own node map, never from the reply.
        """
        if self.dp is None:
            return {}
        self._heartbeat()
        values = []
        for update in updates:
            if update.node_id not in partitions:
                continue
            partition = partitions[update.node_id]
            epsilon = self.server_epsilon(partition)
            _cross_check(partition, update.metrics.get("epsilon"), epsilon)
            self.epsilon[partition] = epsilon
            values.append(epsilon)
        return {
            "epsilon_max": max(values) if values else None,
            "epsilon_mean": sum(values) / len(values) if values else None,
        }

    def summary(self) -> dict[str, Any]:
        """Final ε per client asked to train (partition id), the largest, why the run stopped."""
        if self.dp is None:
            return {}
        epsilon = {p: self.server_epsilon(p) for p in self.participations}
        out: dict[str, Any] = {
            "epsilon_per_client": {str(p): e for p, e in sorted(epsilon.items())},
            "epsilon_max": max(epsilon.values(), default=0.0),
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
            "pipeline": self.pipeline,
            "epsilon": dict(self.epsilon),
            "participations": dict(self.participations),
            "stopped": self.stopped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s output: a resume claims the checkpoint's pipeline."""
        self.pipeline = state.get("pipeline") or self.pipeline
        self.epsilon = dict(state.get("epsilon", {}))
        self.participations = dict(state.get("participations", {}))
        self.stopped = state.get("stopped")


def _cross_check(partition: int, reported: Any, epsilon: float) -> None:
    """Log a client's own ε when it differs from the server's (which is kept).

    Above the server's: the client trained with other settings than configured. Below: it
    may have taken fewer steps (stopped early, missed a round), or misreports.
    """
    if not isinstance(reported, int | float) or isinstance(reported, bool):
        log.info("partition %d reports no ε; the server's accountant says %.4g", partition, epsilon)
    elif not math.isclose(reported, epsilon, rel_tol=1e-6, abs_tol=1e-9):
        level = logging.WARNING if reported > epsilon else logging.INFO
        log.log(
            level,
            "partition %d reports ε=%.4g, the server's accountant says %.4g (kept)",
            partition,
            reported,
            epsilon,
        )

"""Every paper preset (`conf/experiment/NAME.yaml`) has a quick variant, `NAME_quick`, run here.

Issue 18: "a preset's quick variant for CI checks the mechanics only; the full variant is run
and its figures recorded". A quick variant loads its preset and shrinks only its size
(clients, rounds, local steps, time budget) and its seeds to one, keeping every arm of the
sweep. The tests: every preset has one; it differs from its preset in nothing but the keys
it sets; and its sweep runs every arm to the end, each with its metrics, the config of its
arm and one mechanic the preset is about.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, fl_run_cmd, python_run
from omegaconf import DictConfig, OmegaConf

from fl.run.compare import find_runs, load_run

CONF = REPO / "conf"
EXPERIMENTS = CONF / "experiment"
QUICK = "_quick"
NOT_PAPER_PRESETS = {"smoke"}  # a plain few-second sanity run, not a paper's experiment
# Every quick sweep runs in the default suite: about 110 s on the worker that takes this file,
# about 0.7 s of CPU an arm whatever its size (Hydra's compose of each job, the run's own
# start and end; quick variants draw no plots). Longest: robust (18 arms) 13 s,
# apf_vs_fedavg 11 s, grafting 10 s (pytest -n 2, quiet 2-core VM, 2026-12-03 19:20 UTC).


def paper_presets() -> list[str]:
    """Names of the presets in conf/experiment/ (a new file there is picked up here)."""
    names = (p.stem for p in EXPERIMENTS.glob("*.yaml"))
    return sorted(n for n in names if not n.endswith(QUICK) and n not in NOT_PAPER_PRESETS)


PRESETS = paper_presets()
# Presets that tune their arms first (a `tuning:` block): `python -m fl.run.tune` runs them,
# and tests/test_sweeps.py runs their quick variants through it.
TUNED = [n for n in PRESETS if "tuning" in OmegaConf.load(EXPERIMENTS / f"{n}.yaml")]


# ----- composing a preset -----------------------------------------------------------------
@functools.lru_cache
def _compose(experiment: str) -> DictConfig:
    """The config `fl-run experiment=NAME` runs, with Hydra's node (sweep and mode) kept."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(
            config_name="config", overrides=[f"experiment={experiment}"], return_hydra_config=True
        )


def _container(node: DictConfig) -> dict[str, Any]:
    """A config as plain dicts, interpolations left as written (`${local_steps}`)."""
    return OmegaConf.to_container(node, resolve=False)  # type: ignore[return-value]


def _flat(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf; lists are leaves; interpolations stay unresolved."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


def _preset_keys(cfg: DictConfig) -> dict[str, Any]:
    """A composed preset's leaves that make it what it is: the job's config, plus Hydra's
    mode, sweep directory and sweep parameters (not its per-invocation bookkeeping)."""
    values = _container(cfg)
    hydra = values.pop("hydra")
    kept = {k: hydra[k] for k in ("mode", "sweep")} | {
        "sweeper": {"params": hydra["sweeper"]["params"]}
    }
    return dict(_flat(values)) | dict(_flat({"hydra": kept}))


def _sweep_values(key: str, value: Any) -> list[str]:
    """The values one sweep parameter takes (Hydra's own parser: `a,b`, `range(..)`, ...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (override,) = OverridesParser.create().parse_overrides([f"{key}={value}"])
    if not override.is_sweep_override():
        return [str(value)]
    return [str(v) for v in override.sweep_string_iterator()]


def _arm_count(cfg: DictConfig) -> int:
    """Runs a composed preset makes: the product of its sweep's values, or one."""
    from hydra.types import RunMode

    if cfg.hydra.mode != RunMode.MULTIRUN:
        return 1
    params = cfg.hydra.sweeper.params or {}
    return functools.reduce(lambda n, kv: n * len(_sweep_values(*kv)), params.items(), 1)


# ----- what an arm's overrides must have set ------------------------------------------------
def _is_global(path: Path) -> bool:
    """Whether a config file's keys are global (`# @package _global_`), not its group's."""
    return "@package _global_" in path.read_text().split("\n", 1)[0]


def _option_leaves(group: str, option: str) -> dict[str, Any]:
    """The dotted keys a config-group option sets, and to what: its defaults first (its
    parent option, `override /G: X`), then its own keys; interpolations are left out."""
    path = CONF / group / f"{option}.yaml"
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    leaves: dict[str, Any] = {}
    for entry in node.pop("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            leaves |= _option_leaves(group, entry)
        for key, value in entry.items() if isinstance(entry, dict) else ():
            # `override /loop@_global_.loop: X` (a strategy's own loop) is group `loop`
            group_of = key.removeprefix("override ").lstrip("/").partition("@")[0]
            leaves |= _option_leaves(group_of, value)
    prefix = "" if _is_global(path) else f"{group.replace('/', '.')}."
    leaves |= dict(_flat(node, prefix))
    return {k: v for k, v in leaves.items() if not (isinstance(v, str) and "${" in v)}


def _expected(overrides: list[str]) -> dict[str, Any]:
    """What a run's command-line overrides (its arm of the sweep) put into its config."""
    groups: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    for item in overrides:
        key, value = item.split("=", 1)
        key = key.lstrip("+~")
        if key == "experiment" or key.startswith("hydra."):
            continue
        if (CONF / key).is_dir():
            groups |= _option_leaves(key, value)
        else:
            keys[key] = yaml.safe_load(value)
    return groups | keys  # a key given on its own wins over the option file's


# ----- one run of a sweep -----------------------------------------------------------------
@dataclass
class Arm:
    """One run of a quick sweep: its overrides, resolved config, metrics rows and summary."""

    overrides: list[str]
    config: DictConfig
    rows: list[dict[str, Any]]
    summary: dict[str, Any]

    def get(self, key: str) -> Any:
        """A dotted key of the resolved config."""
        return OmegaConf.select(self.config, key)

    @property
    def label(self) -> str:
        """The arm's own overrides, for messages."""
        return " ".join(o for o in self.overrides if not o.startswith(("experiment=", "seed=")))

    @property
    def strategy(self) -> str:
        """The strategy option this arm runs (`strategy=apf_sharp`, whose name is `apf`)."""
        chosen = [o.split("=", 1)[1] for o in self.overrides if o.startswith("strategy=")]
        return chosen[0] if chosen else str(self.get("strategy.name"))

    def column(self, key: str) -> list[Any]:
        """One metric over the rounds (None where a round did not report it)."""
        return [row.get(key) for row in self.rows]


def _arms(out: Path) -> list[Arm]:
    """Every run under `out` (a sweep directory, or `out/run` for a single run), found and
    read as `fl.run.compare` reads them for the comparison table."""
    arms = []
    for run_dir in find_runs(out) or find_runs(out / "run"):
        run = load_run(run_dir)
        config = OmegaConf.load(run_dir / "config.yaml")
        arms.append(Arm(run.overrides, config, run.rows, run.summary))
    return arms


def _check_rows(arm: Arm) -> None:
    """Rounds 1..n, finite accuracy, and n as the run's rounds or time budget asks."""
    rounds, budget = arm.get("rounds"), arm.get("time_budget_s")
    n = len(arm.rows)
    assert arm.column("round") == list(range(1, n + 1)), arm.label
    assert all(math.isfinite(a) and 0 <= a <= 1 for a in arm.column("accuracy")), arm.label
    assert all(math.isfinite(x) for x in arm.column("loss")), arm.label
    assert arm.summary["rounds"] == n, arm.label
    if budget is None:
        assert n == rounds, arm.label
    else:  # stopped by the equal-virtual-time rule, after more than one round
        times = arm.column("virtual_time_s")
        assert 2 <= n < rounds, f"{arm.label}: {n} rounds in a budget of {budget} s"
        assert times[-2] < budget <= times[-1], arm.label


def _check_config(arm: Arm) -> None:
    """The run's resolved config holds what its arm of the sweep set (strategy first)."""
    for key, value in _expected(arm.overrides).items():
        assert arm.get(key) == value, f"{arm.label}: {key} is {arm.get(key)!r}, not {value!r}"


# ----- one mechanic per preset ----------------------------------------------------------------
def _by_strategy(arms: list[Arm]) -> dict[str, Arm]:
    """The arms by the strategy option they run (one arm each)."""
    named = {arm.strategy: arm for arm in arms}
    assert len(named) == len(arms), "two arms run the same strategy"
    return named


def _apf_freezes(arms: list[Arm]) -> None:
    """APF, APF# and APF++ report a frozen fraction and upload less than FedAvg."""
    named = _by_strategy(arms)
    fedavg = named.pop("fedavg").summary["total_payload_bytes_up"]
    for name, arm in named.items():
        assert all(0 <= f <= 1 for f in arm.column("frozen_fraction")), name
        assert arm.summary["total_payload_bytes_up"] < fedavg, name


def _sync_tuned(arms: list[Arm]) -> None:
    """PAS shortens the periods of some scalars once its warm-up and first window are over
    (every scalar has one); GIFT keeps τ_0 through its warm-up, which outlasts the quick
    budget."""
    named = _by_strategy(arms)
    fedavg, gift, pas = named["fedavg"], named["gift"], named["pas"]
    steps = fedavg.get("local_steps")
    warmup = max(pas.get("strategy.warmup"), pas.get("strategy.window"))
    dense = fedavg.rows[0]  # float32 scalars of the model, from FedAvg's upload
    scalars = dense["payload_bytes_up"] // (4 * dense["replies"])
    assert {sum(h.values()) for h in pas.column("period_histogram")} == {scalars}
    assert set(pas.column("local_steps")) == {steps}  # a round lasts the longest period
    periods = pas.column("mean_period")
    assert set(periods[:warmup]) == {steps} and periods[-1] < steps, periods
    assert len(gift.rows) <= gift.get("strategy.warmup")
    assert set(gift.column("local_steps")) == {steps}


def _fedsu_speculates(arms: list[Arm]) -> None:
    """FedSU speculates and checks; v1 never checks (no error feedback); v2 speculates at
    random from round 1, before FedSU has any oscillation to go by."""
    named = _by_strategy(arms)
    fedsu, v1, v2 = named["fedsu"], named["fedsu_v1"], named["fedsu_v2"]
    assert sum(fedsu.column("speculation_checked")) > 0
    assert sum(v1.column("speculation_entered")) > 0
    assert set(v1.column("speculation_checked")) == {0}
    assert fedsu.rows[0]["speculation_entered"] == 0 < v2.rows[0]["speculation_entered"]
    assert all(0 <= f <= 1 for f in named["apf"].column("frozen_fraction"))


def _fedsu_speculates_slowly(arms: list[Arm]) -> None:
    """At the headroom preset's lr, FedSU still speculates and checks; APF freezes."""
    named = _by_strategy(arms)
    assert {arm.get("lr") for arm in arms} == {0.001}
    assert sum(named["fedsu"].column("speculation_checked")) > 0
    assert all(0 <= f <= 1 for f in named["apf"].column("frozen_fraction"))
    assert "speculation_checked" not in named["fedavg"].rows[0]


def _fedca_stops(arms: list[Arm]) -> None:
    """FedCA's round 1 profiles (every reply an anchor); later rounds report one stop step
    per reply, within 1..K."""
    for arm in arms:
        if arm.get("strategy.name") not in ("fedca", "fedca_plus"):
            continue
        k = arm.get("strategy.local_steps")
        assert arm.rows[0]["anchors"] == arm.rows[0]["replies"], arm.label
        for row in arm.rows[1:]:
            assert len(row["stop_steps"]) == row["replies"] - row["anchors"], arm.label
            assert all(1 <= s <= k for s in row["stop_steps"]), arm.label


def _semi_async_quota(arms: list[Arm]) -> None:
    """A round closes at its quota: all in flight (sync), FedBuff's buffer, or the K that
    SAFA fixes and ASFL's agent (or random policy) picks each round (SAFA's undrafted
    replies land beside the K it merges)."""
    for arm in arms:
        replies = arm.column("replies")
        if arm.strategy == "fedavg":
            assert set(replies) == {arm.get("clients_per_round")}, arm.label
        elif arm.strategy == "fedbuff":
            assert set(replies) == {arm.get("loop.buffer_k")}, arm.label
        else:
            merged = [r - u for r, u in zip(replies, arm.column("undrafted"), strict=True)]
            assert merged == arm.column("quota_k"), arm.label
            assert all(lag in arm.get("strategy.lags") for lag in arm.column("lag_tolerance"))


def _r2sp_schedule(arms: list[Arm]) -> None:
    """A round is one group's replies; R2SP and FL-R2SP start groups r·T/G apart (the
    unscheduled FL-R2SP control arm whenever idle)."""
    for arm in arms:
        groups = arm.get("loop.groups")
        assert set(arm.column("replies")) == {arm.get("num_clients") // groups}, arm.label
        if arm.strategy != "fedavg" and arm.get("strategy.schedule"):
            r = arm.get("strategy.relaxation")
            for row in arm.rows:
                assert row["gap_s"] == pytest.approx(r * row["period_s"] / groups), arm.label


def _lbbsp_batches(arms: list[Arm]) -> None:
    """Batches are moved between clients, never added: every round of every arm sums to
    BSP's global batch, sum of min(B_0, |D_i|); BSP (predictor none) keeps every B_i at B_0
    or below, a predictor gives a faster client more once throughputs are measured."""
    b0 = arms[0].get("strategy.batch_size")
    total = arms[0].rows[0]["batch_total"]
    assert total <= b0 * arms[0].get("clients_per_round")
    for arm in arms:
        assert set(arm.column("batch_total")) == {total}, arm.label
        if arm.get("strategy.predictor") == "none":
            assert set(arm.column("batch_max")) == {b0}, arm.label
        else:
            assert arm.rows[0]["batch_max"] == b0 < arm.rows[-1]["batch_max"], arm.label


def _lrd2d_decays(arms: list[Arm]) -> None:
    """A client's last local step runs at lr · a · γ^(K-1); γ < 1 from round 2 (once clients'
    agreement is known) exactly when the in-round axis is on."""
    for arm in arms:
        lr, k = arm.get("lr"), arm.get("local_steps")
        inround = arm.get("strategy.axes") in ("inround", "both")
        for row in arm.rows:
            a, gamma = row["lr_round_factor"], row["lr_step_decay"]
            assert row["client_last_lr"] == pytest.approx(lr * a * gamma ** (k - 1), rel=1e-6)
            assert (gamma < 1) == (inround and row["round"] > 1), arm.label


def _grafts_report(arms: list[Arm]) -> None:
    """Each graft (and SDMA, MDMA) reports every round the diagnoses it is configured with
    and the setting of each action it drives; a graft shares its original's action."""
    settings = {"period": "local_steps", "bits": "upload_bits", "freeze": "frozen_fraction"}
    named = _by_strategy(arms)
    for arm in arms:
        if arm.get("strategy.name") != "graft":
            continue
        diagnoses = {f"diagnosis_{d}" for d in arm.get("strategy.diagnosis").split("+")}
        actions = {settings[a] for a in arm.get("strategy.action").split("+")}
        for row in arm.rows:
            assert {k for k in row if k.startswith("diagnosis_")} == diagnoses, arm.label
            assert actions <= row.keys(), arm.label
    for original in ("adacomm", "adaquantfl"):
        graft, source = named[f"graft_{original}"], named[original]
        assert graft.get("strategy.action") == source.get("strategy.action")
        assert graft.get("strategy.diagnosis") != source.get("strategy.diagnosis")


def _partial_participation(arms: list[Arm]) -> None:
    """clients_per_round of num_clients are asked and answer every round."""
    for arm in arms:
        asked = arm.get("clients_per_round")
        assert asked < arm.get("num_clients"), arm.label
        assert set(arm.column("clients")) == set(arm.column("replies")) == {asked}, arm.label


def _lrd2d_partial(arms: list[Arm]) -> None:
    """2D-LRD's schedule (as in lrd2d) with a part of the clients each round."""
    _lrd2d_decays(arms)
    _partial_participation(arms)


def _robust_caps_inflation(arms: list[Arm]) -> None:
    """Attackers claiming 10^12 examples are capped at their partition's size, so under
    every rule the run is the honest run; no example counts are capped in the others."""
    honest = {a.get("aggregation.name"): a for a in arms if a.get("faults.attack") == "none"}
    for arm in arms:
        attack = arm.get("faults.attack")
        attackers = round(arm.get("faults.attack_rate") * arm.get("num_clients"))
        clipped = {attackers} if attack == "inflate_examples" else {0}
        assert set(arm.column("examples_clipped")) == clipped, arm.label
        if attack == "inflate_examples":
            same = honest[arm.get("aggregation.name")]
            assert arm.column("accuracy") == same.column("accuracy"), arm.label


def _ledger_charges(arms: list[Arm]) -> None:
    """Every round charged the ledger; the pipeline's charges are each client's ε."""
    from privacy.ledger import Ledger

    (arm,) = arms
    summary = arm.summary
    with Ledger(Path(summary["ledger"]["path"])) as ledger:
        record = ledger.pipeline(summary["ledger"]["pipeline"])
        assert record.status == "finished"
        for client, epsilon in summary["epsilon_per_client"].items():
            block = f"{arm.get('task.dataset')}/client-{client}"
            assert record.spent[block] == pytest.approx(epsilon, rel=1e-9)
    assert 0 < summary["epsilon_max"] <= summary["ledger"]["granted_epsilon"]


def _earliest_reports(arms: list[Arm]) -> int:
    """Every round of every arm aggregates the earliest ceil(f·n) replies of the n asked
    (loop.first_k_fraction f: PAS 40 %, FedSU 70 %, FedCA 90 %); returns that count."""
    fraction = arms[0].get("loop.first_k_fraction")
    k = math.ceil(fraction * arms[0].get("clients_per_round"))
    for arm in arms:
        assert arm.get("loop.first_k_fraction") == fraction, arm.label
        assert set(arm.column("replies")) == {k}, arm.label
    return k


def _pas_earliest(arms: list[Arm]) -> None:
    """The earliest 40 % close each round; PAS gives every scalar a period and shortens
    some once its first fixed window has passed (τ_0 before it)."""
    _earliest_reports(arms)
    pas = _by_strategy(arms)["pas"]
    steps, window = pas.get("local_steps"), pas.get("strategy.window")
    dense = pas.rows[0]  # float32 scalars of the model, from the first round's full upload
    scalars = dense["payload_bytes_up"] // (4 * dense["replies"])
    assert {sum(h.values()) for h in pas.column("period_histogram")} == {scalars}
    periods = pas.column("mean_period")
    assert set(periods[:window]) == {steps} and periods[-1] < steps, periods


def _gift_earliest(arms: list[Arm]) -> None:
    """The earliest 40 % close each round; GIFT keeps τ_0 through its warm-up r_0."""
    _earliest_reports(arms)
    gift = _by_strategy(arms)["gift"]
    assert len(gift.rows) <= gift.get("strategy.warmup")
    assert set(gift.column("local_steps")) == {gift.get("local_steps")}


def _fedsu_earliest(arms: list[Arm]) -> None:
    """The earliest 70 % close each round, and FedSU's arms behave as in `fedsu`."""
    _earliest_reports(arms)
    _fedsu_speculates(arms)


def _fedca_earliest(arms: list[Arm]) -> None:
    """The first 90 % close each round, and FedCA profiles and stops as in `fedca`."""
    _earliest_reports(arms)
    _fedca_stops(arms)


MECHANICS: dict[str, Callable[[list[Arm]], None]] = {
    "apf_vs_fedavg": _apf_freezes,
    "sync_tuning": _sync_tuned,
    "sync_tuning_headroom": _sync_tuned,
    "fedsu": _fedsu_speculates,
    "fedsu_headroom": _fedsu_speculates_slowly,
    "fedca": _fedca_stops,
    "asfl": _semi_async_quota,
    "r2sp": _r2sp_schedule,
    "lbbsp": _lbbsp_batches,
    "lbbsp_uncapped": _lbbsp_batches,
    "lrd2d": _lrd2d_decays,
    "lrd2d_headroom": _lrd2d_partial,
    "grafting": _grafts_report,
    "partial_sync": _partial_participation,
    "robust": _robust_caps_inflation,
    "dpbalance": _ledger_charges,
}
# Issue 35's presets: each system as its paper ran it on CIFAR-10 (`NAME_paper`, whose quick
# variant runs the same model on generated images: CI has no CIFAR-10) and scaled to 2 cores
# on shapes (`NAME_room`); both variants check the mechanic of the system's own preset.
PAPER_MECHANICS: dict[str, Callable[[list[Arm]], None]] = {
    "apf": _apf_freezes,
    "pas": _pas_earliest,
    "gift": _gift_earliest,
    "fedsu": _fedsu_earliest,
    "fedca": _fedca_earliest,
    "lrd2d": _lrd2d_decays,
    "asfl": _semi_async_quota,
    "r2sp": _r2sp_schedule,
    "lbbsp": _lbbsp_batches,
    "grafting": _grafts_report,
    "dpbalance": _ledger_charges,
}
MECHANICS |= {f"{s}_{k}": check for s, check in PAPER_MECHANICS.items() for k in ("paper", "room")}
MECHANICS["fedca_room_compute"] = _fedca_earliest  # fedca_room at the spec's link speed
# Their quick sweeps take 10-25 s each on 2 busy cores: the default suite runs these few
# (about 20 s), the others are marked slow (`pytest -m slow tests/test_presets.py`).
PAPER_QUICK_DEFAULT = {"apf_paper", "dpbalance_room"}


def _sweep_cases(names: list[str]) -> list[Any]:
    """The presets whose quick sweeps run, the paper/room ones beyond the default few slow."""
    paper = {n for n in MECHANICS if n.endswith(("_paper", "_room")) or "_room_" in n}
    return [
        pytest.param(n, marks=pytest.mark.slow) if n in paper - PAPER_QUICK_DEFAULT else n
        for n in names
    ]


# ----- the tests ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", PRESETS)
def test_quick_variant_is_the_preset_shrunk(name):
    path = EXPERIMENTS / f"{name}{QUICK}.yaml"
    assert path.exists(), f"preset {name} has no quick variant {path.relative_to(REPO)}"
    assert name in MECHANICS or name in TUNED, f"add the mechanic {name}{QUICK} checks to MECHANICS"
    own = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert own.pop("defaults") == [name], "a quick variant loads its preset, then overrides"
    sets = dict(_flat(own))
    full, quick = _preset_keys(_compose(name)), _preset_keys(_compose(f"{name}{QUICK}"))
    differ = {k for k in full.keys() | quick.keys() if full.get(k) != quick.get(k)}
    assert differ <= sets.keys(), f"changed without being set: {sorted(differ - sets.keys())}"
    # every arm kept: only the seeds may be swept differently, and to one seed
    swept = {k.removeprefix("hydra.sweeper.params.") for k in sets if ".sweeper." in k}
    assert swept <= {"seed"}, f"a quick variant keeps every arm: {swept - {'seed'}} changed"
    if "seed" in swept:
        assert len(_sweep_values("seed", sets["hydra.sweeper.params.seed"])) == 1


@pytest.mark.parametrize("name", _sweep_cases([n for n in PRESETS if n not in TUNED]))
def test_quick_variant_runs_every_arm(name, tmp_path):
    assert name in MECHANICS, f"add the mechanic {name}{QUICK} checks to MECHANICS"
    cfg = _compose(f"{name}{QUICK}")
    overrides = [f"hydra.sweep.dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = python_run(fl_run_cmd(f"experiment={name}{QUICK}", *overrides), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    arms = _arms(tmp_path)
    assert len(arms) == _arm_count(cfg)
    for arm in arms:
        _check_rows(arm)
        _check_config(arm)
    configs = {yaml.safe_dump({**_container(a.config), "output_dir": None}) for a in arms}
    assert len(configs) == len(arms), "two arms of the sweep ran the same config"
    if len(arms) > 1:  # a sweep ends with its comparison table, one row per arm
        table = (tmp_path / "comparison.md").read_text()
        assert len(re.findall(r"^\| (?!run \|)[^-|]", table, flags=re.M)) == len(arms)
    assert not list(tmp_path.rglob("*.png")), "plots=false: a quick variant draws nothing"
    MECHANICS[name](arms)

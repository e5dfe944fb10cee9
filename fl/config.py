"""The run configuration: composed by Hydra, validated before round 1, shipped to apps.

Every process of a run (the ServerApp, each ClientApp, on any engine) reads the same
resolved configuration from Flower's `run_config`: either the whole config as JSON
under `fl-config` (what `fl-run` sends), or Hydra overrides under `overrides`
(what `flwr run -c "overrides='strategy=fedprox rounds=5'"` sends), composed here
from the `conf/` tree.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import types
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Union, cast, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "compose",
    "from_run_config",
    "plain",
    "preflight",
    "run_config_key",
    "to_run_config",
    "validate",
]

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
RUN_CONFIG_KEY = "fl-config"

DATASETS = ("digits", "shapes", "synthetic", "mnist", "cifar10")
MODELS = ("logreg", "mlp", "cnn", "lenet5", "resnet18")
SCHEMES = ("iid", "dirichlet", "shards", "natural")
ENGINES = ("local", "flower-sim", "deployment")
LOGGERS = ("jsonl", "wandb")
DEVICES = ("auto", "cpu", "cuda")
PRIVACY = ("none", "dpsgd", "central")
TRANSPORTS = ("inline", "grpc", "rdma")  # conf/transport/NAME.yaml (fl/transport)
MAX_SEED = 2**32 - 1  # scikit-learn's and NumPy's legacy seeds are 32-bit
FORK_FROM = re.compile(r"[^@]+(@[1-9][0-9]*)?")  # <run_dir>[@<round>]
OUTPUT_DIR_RULE = (
    "fl-run sets it to the Hydra run directory, so use hydra.run.dir=DIR instead "
    "(only engine=deployment takes an output_dir: an absolute path on the SuperLink's machine)"
)


class ConfigError(ValueError):
    """An invalid configuration key or value, named in the message."""


def plain(node: Any) -> dict[str, Any]:
    """A config node as a plain dict with interpolations resolved."""
    if not isinstance(node, DictConfig):
        return dict(node)
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))


_FAULTS: dict[str, dict[str, Any]] = {}  # run config -> its faults group, as a plain dict


def run_faults(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's `faults` group (rates and attacks) as a plain dict, read once per process:
    the fault and attack mods consult it on every message, and reading an OmegaConf node
    costs more than the rest of either mod."""
    key = run_config_key(run_config)
    if key not in _FAULTS:
        _FAULTS[key] = plain(from_run_config(run_config).get("faults") or {})
    return _FAULTS[key]


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config of `conf/config.yaml` with Hydra command-line style overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides or [])


def to_run_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, str]:
    """Flower run_config carrying the resolved config (Hydra's own keys dropped)."""
    values = plain(cfg)
    values.pop("hydra", None)
    return {RUN_CONFIG_KEY: json.dumps(values, sort_keys=True)}


@lru_cache(maxsize=8)
def _parse(text: str) -> DictConfig:
    return OmegaConf.create(json.loads(text))


@lru_cache(maxsize=8)
def _compose_cached(overrides: str) -> DictConfig:
    cfg = compose(overrides.split())
    values = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=False))
    values.pop("hydra", None)
    return OmegaConf.create(values)


def run_config_key(run_config: Mapping[str, Any]) -> str:
    """A string that identifies a run's config (for per-process caches)."""
    if RUN_CONFIG_KEY in run_config:
        return RUN_CONFIG_KEY + ":" + str(run_config[RUN_CONFIG_KEY])
    return "overrides:" + str(run_config.get("overrides", ""))


def from_run_config(run_config: Mapping[str, Any]) -> DictConfig:
    """The run's config, from either form of run_config (cached per process)."""
    if RUN_CONFIG_KEY in run_config:
        return _parse(str(run_config[RUN_CONFIG_KEY]))
    return _compose_cached(str(run_config.get("overrides", "")))


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"invalid config: {key}={value!r}: {rule}")


def _integer(cfg: DictConfig, key: str, low: int, high: int | None = None) -> None:
    value = OmegaConf.select(cfg, key)
    top = math.inf if high is None else high
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= top
    rule = f">= {low}" if high is None else f"in [{low}, {high}]"
    _require(ok, key, value, f"must be an integer {rule}")


def _one_of(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    value = OmegaConf.select(cfg, key)
    _require(value in choices, key, value, f"must be one of {list(choices)}")


def _is_finite(value: Any) -> bool:
    """A real int or float, not a bool, neither inf nor nan."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(
    cfg: DictConfig,
    key: str,
    low: float,
    high: float = math.inf,
    *,
    strict: bool = False,
    null: bool = False,
) -> None:
    """`key` must be a finite number in [low, high] (above `low` if strict), or null if allowed."""
    value = OmegaConf.select(cfg, key)
    if null and value is None:
        return
    ok = _is_finite(value) and (value > low if strict else value >= low) and value <= high
    bound = f"> {low}" if strict else f">= {low}"
    rule = bound if high == math.inf else f"in {'(' if strict else '['}{low}, {high}]"
    _require(ok, key, value, f"must be {'null or ' if null else ''}a finite number {rule}")


@lru_cache(maxsize=1)
def _known_keys() -> tuple[str, ...]:
    """Top-level keys of conf/config.yaml and its config groups: all a run may set."""
    base = OmegaConf.load(CONF_DIR / "config.yaml")
    groups = [str(next(iter(d))).split()[-1] for d in base.defaults if isinstance(d, DictConfig)]
    return tuple(sorted({str(k) for k in base if k != "defaults"} | set(groups)))


def _validate_keys(cfg: DictConfig) -> None:
    """Refuse top-level keys added with `+` that nothing reads (a typo), suggesting the closest."""
    known = _known_keys()
    unknown = [str(k) for k in cfg if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(known)}"
        raise ConfigError(
            f"invalid config: unknown key {unknown[0]!r} (not in conf/config.yaml); {hint}"
        )


def _validate_run(cfg: DictConfig) -> None:
    """The top-level numbers of conf/config.yaml."""
    for key in ("num_clients", "clients_per_round", "rounds", "batch_size"):
        _integer(cfg, key, 1)
    _integer(cfg, "local_steps", 0)
    _integer(cfg, "local_epochs", 0 if cfg.local_steps > 0 else 1)
    _integer(cfg, "checkpoint_every", 1)
    _integer(cfg, "torch_threads", 0)
    _integer(cfg, "seed", 0, MAX_SEED)
    _require(
        cfg.clients_per_round <= cfg.num_clients,
        "clients_per_round",
        cfg.clients_per_round,
        f"must be <= num_clients ({cfg.num_clients})",
    )
    _number(cfg, "lr", 0, strict=True)
    _number(cfg, "round_timeout_s", 0, strict=True, null=True)
    _number(cfg, "momentum", 0)
    _number(cfg, "weight_decay", 0)
    bound = cfg.max_update_norm
    _require(
        isinstance(bound, int | float) and not isinstance(bound, bool) and bound > 0,
        "max_update_norm",
        bound,
        "must be a number > 0 (.inf for no bound)",
    )
    _number(cfg, "target_accuracy", 0, 1, strict=True, null=True)
    fork = cfg.get("fork_from")
    _require(
        fork is None or (isinstance(fork, str) and bool(FORK_FROM.fullmatch(fork))),
        "fork_from",
        fork,
        "must be null, <run_dir> or <run_dir>@<round> (round a positive integer)",
    )
    for key in ("checkpoint_history", "plots"):
        _require(isinstance(cfg.get(key, False), bool), key, cfg.get(key), "must be true or false")
    _number(cfg, "time_budget_s", 0, strict=True, null=True)
    output_dir = cfg.get("output_dir")
    _require(
        output_dir is None or (isinstance(output_dir, str) and Path(output_dir).is_absolute()),
        "output_dir",
        output_dir,
        OUTPUT_DIR_RULE,
    )


def _validate_faults_and_system(cfg: DictConfig) -> None:
    """Injected fault rates and the device/network profile of the virtual clock."""
    rates = [cfg.faults[kind] for kind in ("crash", "dropout", "hang")]
    _require(
        all(_is_finite(r) and 0 <= r <= 1 for r in rates) and sum(rates) <= 1,
        "faults",
        rates,
        "crash, dropout and hang rates must be in [0, 1] and sum to at most 1",
    )
    _number(cfg, "faults.hang_s", 0)
    for key in ("speed", "up_mbps", "down_mbps"):
        _number(cfg, f"system.{key}", 0, strict=True)
    for key in ("speed_spread", "bandwidth_spread"):
        _number(cfg, f"system.{key}", 1)
    _number(cfg, "system.availability", 0, 1, strict=True)
    _number(cfg, "system.server_bandwidth_mbps", 0, strict=True, null=True)
    _number(cfg, "system.aggregation_s_per_update", 0)


def _validate_loop(cfg: DictConfig) -> None:
    """The loop kind and its options, and whether the strategy takes replies that land late."""
    from fl.loops import ARRIVAL_ORDERS, LATE_POLICIES, LOOP_KINDS
    from fl.registry import get_strategy

    _one_of(cfg, "loop.kind", LOOP_KINDS)
    _one_of(cfg, "loop.late", LATE_POLICIES)
    if OmegaConf.select(cfg, "loop.arrival") is not None:
        _one_of(cfg, "loop.arrival", ARRIVAL_ORDERS)
    _number(cfg, "loop.deadline_s", 0, strict=True, null=True)
    _number(cfg, "loop.first_k_fraction", 0, 1, strict=True, null=True)
    _number(cfg, "loop.staleness_exponent", 0)
    _integer(cfg, "loop.groups", 1, cfg.num_clients)
    if cfg.loop.buffer_k is not None:
        _integer(cfg, "loop.buffer_k", 1, cfg.clients_per_round)
    kind, late = cfg.loop.kind, cfg.loop.late
    stale = kind != "sync" or late == "carry"
    server = get_strategy(str(cfg.strategy.name)).server
    _require(
        not stale or getattr(server, "stale_replies_ok", True),
        "loop",
        f"{kind} (late={late})",
        f"strategy={cfg.strategy.name} aggregates only replies to the current round's state; "
        "use loop=sync with loop.late=drop",
    )
    central = OmegaConf.select(cfg, "privacy.server_dp.mode", default="none") != "none"
    _require(
        not stale or not central,
        "loop",
        f"{kind} (late={late})",
        "central DP clips each update against the current model: replies must not land late",
    )


def _validate_robustness(cfg: DictConfig) -> None:
    """Aggregation rule, norm policy, example cap and injected attacks (fl/robust.py,
    fl/attacks.py); a rule that cannot tolerate its num_malicious with clients_per_round
    replies is refused here, not in round 1."""
    from fl.attacks import ATTACKS, attack_kinds
    from fl.robust import AGGREGATIONS, NORM_POLICIES, min_replies

    _one_of(cfg, "aggregation.name", AGGREGATIONS)
    _one_of(cfg, "update_norm_policy", NORM_POLICIES)
    if cfg.get("max_examples_per_client") is not None:
        _integer(cfg, "max_examples_per_client", 1)
    name = cfg.aggregation.name
    if name == "trimmed_mean":
        _number(cfg, "aggregation.trim_beta", 0, 0.5)
        beta = cfg.aggregation.trim_beta
        _require(beta < 0.5, "aggregation.trim_beta", beta, "must be < 0.5")
    if name in ("krum", "multikrum", "bulyan"):
        _integer(cfg, "aggregation.num_malicious", 0)
        need = min_replies(name, cfg.aggregation.num_malicious)
        _require(
            cfg.clients_per_round >= need,
            "clients_per_round",
            cfg.clients_per_round,
            f"aggregation={name} with num_malicious={cfg.aggregation.num_malicious} needs "
            f">= {need} replies per round ({'4f+3' if name == 'bulyan' else '2f+3'})",
        )
    if name == "multikrum" and OmegaConf.select(cfg, "aggregation.num_selected") is not None:
        _integer(cfg, "aggregation.num_selected", 1, cfg.clients_per_round)
    kinds = attack_kinds(OmegaConf.select(cfg, "faults.attack"))
    bad = [k for k in kinds if k not in ATTACKS]
    _require(not bad, "faults.attack", cfg.faults.get("attack"), f"kinds are {list(ATTACKS)}")
    if kinds:
        _number(cfg, "faults.attack_rate", 0, 1)
        _number(cfg, "faults.attack_scale", 0)
        _integer(cfg, "faults.attack_examples", 1)


def _validate_task(cfg: DictConfig) -> None:
    """Dataset, model, its hidden widths and the partition scheme with its parameters."""
    _one_of(cfg, "task.dataset", DATASETS)
    _one_of(cfg, "task.model", MODELS)
    hidden = OmegaConf.select(cfg, "task.hidden")
    _require(
        hidden is None
        or (
            isinstance(hidden, ListConfig | list)
            and all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in hidden)
        ),
        "task.hidden",
        hidden,
        "must be a list of layer widths, integers >= 1, e.g. [64] or [128,64]",
    )
    _one_of(cfg, "partition.scheme", SCHEMES)
    scheme = cfg.partition.scheme
    if OmegaConf.select(cfg, "partition.min_size") is not None:
        _integer(cfg, "partition.min_size", 1)  # every client gets an example
    if scheme == "dirichlet":
        _number(cfg, "partition.alpha", 0, strict=True)
    if scheme == "shards":
        _integer(cfg, "partition.classes_per_client", 1)
    if scheme == "natural":
        _require(
            cfg.task.dataset == "synthetic", "partition.scheme", scheme, "needs task=synthetic"
        )


def _validate_privacy(cfg: DictConfig) -> None:
    """privacy=none | dpsgd | central; with DP-SGD the model must be one Opacus can train."""
    _one_of(cfg, "privacy.name", PRIVACY)
    name = cfg.privacy.name
    ledger_path = OmegaConf.select(cfg, "privacy.ledger.path")
    if OmegaConf.select(cfg, "privacy.ledger.required", default=False):
        _require(
            bool(ledger_path),
            "privacy.ledger.path",
            ledger_path,
            "this preset charges epsilon to a ledger (privacy.ledger.required); give a file path",
        )
    if name == "dpsgd":
        _number(cfg, "privacy.noise_multiplier", 0)
        _number(cfg, "privacy.max_grad_norm", 0, strict=True)
        _number(cfg, "privacy.delta", 0, 1, strict=True)
        _number(cfg, "privacy.target_epsilon", 0, strict=True, null=True)
        _one_of(cfg, "privacy.accountant", ("rdp", "prv", "gdp"))
        _one_of(cfg, "privacy.sampling", ("poisson", "shuffle"))
        if ledger_path:
            _one_of(cfg, "privacy.ledger.scheduler", ("dpbalance", "dpf", "dpk", "fcfs"))
            _number(cfg, "privacy.ledger.demand_epsilon", 0, strict=True)
            _number(cfg, "privacy.ledger.block_budget", 0, strict=True)
            _number(cfg, "privacy.ledger.beta", 0)
            _number(cfg, "privacy.ledger.kappa_max", 1, null=True)
            _number(cfg, "privacy.ledger.lease_s", 0, strict=True)
            _number(cfg, "privacy.ledger.block_delta", 0, 1, strict=True)
            _require(
                cfg.privacy.delta <= cfg.privacy.ledger.block_delta,
                "privacy.delta",
                cfg.privacy.delta,
                "must not exceed privacy.ledger.block_delta (the δ budget of a client's block)",
            )
        layer = _dp_incompatible_layer(cfg)
        _require(layer is None, "task.model", cfg.task.model, f"Opacus cannot train {layer}")
    if name in ("dpsgd", "central"):
        _one_of(cfg, "privacy.server_dp.mode", ("none", "fixed", "adaptive"))
        if cfg.privacy.server_dp.mode != "none":
            _number(cfg, "privacy.server_dp.noise_multiplier", 0)
            _number(cfg, "privacy.server_dp.clipping_norm", 0, strict=True)
            _number(cfg, "privacy.server_dp.target_clipped_quantile", 0, 1)
            _number(cfg, "privacy.server_dp.clip_norm_lr", 0)


def _dp_incompatible_layer(cfg: DictConfig) -> str | None:
    """The first layer of the run's model that Opacus rejects (e.g. BatchNorm), or None."""
    from opacus.validators import ModuleValidator

    from fl.models import build_model

    image = cfg.task.model in ("cnn", "lenet5", "resnet18")  # layer types ignore input size
    hidden = tuple(cfg.task.get("hidden") or (64,))
    model = build_model(cfg.task.model, (3, 32, 32) if image else (64,), 10, hidden=hidden)
    for name, module in model.named_modules():
        check = ModuleValidator.VALIDATORS.get(type(module))
        errors = check(module) if check is not None else []
        if errors:
            return f"layer {name!r} ({type(module).__name__}): {str(errors[0]).split('. ')[0]}"
    return None


def _has_type(value: Any, hint: Any) -> bool:
    """Whether a config value fits a params field's annotation (floats finite, no bool as int)."""
    if isinstance(hint, types.UnionType) or get_origin(hint) is Union:
        return any(_has_type(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return _is_finite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    return True  # richer annotations are left to the params' own `validate`


def _type_name(hint: Any) -> str:
    """A params field's annotation as a message says it ("a finite number")."""
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    if isinstance(hint, types.UnionType) or get_origin(hint) is Union:
        return " or ".join(_type_name(arg) for arg in get_args(hint))
    return names.get(hint, "null" if hint is type(None) else str(hint))


def _validate_strategy(cfg: DictConfig) -> None:
    """Each `strategy.KEY` must have its params field's type, then pass the params' `validate`."""
    from fl.registry import get_strategy

    values = plain(cfg.strategy)
    try:
        spec = get_strategy(str(values.get("name")))
    except ValueError as err:
        raise ConfigError(f"invalid config: strategy.name: {err}") from err
    hints = get_type_hints(spec.params)
    for key, value in values.items():
        if key in hints:
            hint = hints[key]
            _require(
                _has_type(value, hint), f"strategy.{key}", value, f"must be {_type_name(hint)}"
            )
    try:
        params = spec.make_params(values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid config: strategy: {err}") from err
    check_run = getattr(params, "validate_run", None)  # the params against the run's keys
    if check_run is not None:
        try:
            check_run(cfg)
        except ValueError as err:
            raise ConfigError(f"invalid config: {err}") from err


def _validate_privacy_with_strategy(cfg: DictConfig) -> None:
    """Privacy modes that a strategy (its server half declares so) or an aggregation cannot use.

    Central DP's noise must reach every client's model and assumes each client moves the
    mean by at most C/n; DP-SGD's plan and accountant follow the run's step count.
    """
    from fl.registry import get_strategy

    name, privacy = cfg.strategy.name, cfg.privacy.name
    server = get_strategy(str(name)).server
    central = OmegaConf.select(cfg, "privacy.server_dp.mode", default="none") != "none"
    pair = f"invalid config: privacy={privacy} with strategy={name}"
    if central and not getattr(server, "central_dp_safe", True):
        raise ConfigError(
            f"{pair}: its clients keep model copies that central DP's noise would not reach"
        )
    if privacy == "dpsgd" and not getattr(server, "dpsgd_safe", True):
        raise ConfigError(
            f"{pair}: it sets local steps per round, which DP-SGD's plan and accountant ignore"
        )
    aggregation = OmegaConf.select(cfg, "aggregation.name", default="mean")
    _require(
        not central or aggregation == "mean",
        "aggregation",
        aggregation,
        f"privacy={privacy} (central DP) needs aggregation=mean: its noise assumes the mean",
    )


def _validate_transport(cfg: DictConfig) -> None:
    """The side channel (conf/transport/*.yaml, fl/transport): its name, TLS mode, addresses
    and limits, and for rdma that NIXL imports here, before any round."""
    _one_of(cfg, "transport.name", TRANSPORTS)
    if cfg.transport.name == "inline":
        return
    tls = cfg.transport.get("tls")
    _require(
        tls == "auto" or isinstance(tls, bool), "transport.tls", tls, "must be auto, true or false"
    )
    listen, advertise = cfg.transport.get("listen"), cfg.transport.get("advertise")
    _require(_is_address(listen), "transport.listen", listen, "must be HOST:PORT (port 0-65535)")
    _require(
        advertise is None or _is_address(advertise),
        "transport.advertise",
        advertise,
        "must be null or HOST:PORT",
    )
    _integer(cfg, "transport.min_bytes", 0)
    _integer(cfg, "transport.chunk_bytes", 1)
    _integer(cfg, "transport.max_upload_bytes", 1)
    _number(cfg, "transport.timeout_s", 0, strict=True)
    _number(cfg, "transport.ttl_s", 0, strict=True)
    if cfg.transport.name == "rdma":
        from fl.transport.nixl_link import nixl_available

        missing = nixl_available()
        _require(
            missing is None,
            "transport.name",
            "rdma",
            f"needs NIXL (pip install -e '.[rdma]'), which does not import here: {missing}",
        )


def _is_address(value: Any) -> bool:
    """HOST:PORT with a non-empty host and a port in 0-65535 (IPv6 hosts in brackets)."""
    if not isinstance(value, str) or ":" not in value:
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and int(port) <= 65535


def validate(cfg: DictConfig) -> None:
    """Check every option before the run starts; raise ConfigError naming the bad key.

    Also run by the ServerApp on the final config, where `output_dir` is fl-run's absolute
    run directory: here any absolute path passes; `preflight` refuses a user's own.
    """
    _validate_keys(cfg)
    _validate_run(cfg)
    _one_of(cfg, "device", DEVICES)
    _validate_faults_and_system(cfg)
    _validate_robustness(cfg)
    _validate_task(cfg)
    _one_of(cfg, "engine.name", ENGINES)
    if cfg.engine.name == "local":
        _integer(cfg, "engine.workers", 1)
    if cfg.engine.name == "deployment":
        _number(cfg, "engine.node_wait_s", 0)
        from fl.tls import is_allowlist

        allowed = OmegaConf.select(cfg, "engine.allowed_nodes")
        listed = OmegaConf.to_container(allowed) if isinstance(allowed, ListConfig) else allowed
        _require(
            allowed is None or is_allowlist(listed),
            "engine.allowed_nodes",
            listed,
            "must be null or a non-empty list of node ids and SHA256:… key fingerprints",
        )
    if cfg.engine.name == "flower-sim":
        _number(cfg, "engine.num_cpus_per_client", 0)
        _number(cfg, "engine.num_gpus_per_client", 0)
    _one_of(cfg, "logger.name", LOGGERS)
    _validate_privacy(cfg)
    _validate_strategy(cfg)
    _validate_loop(cfg)
    _validate_privacy_with_strategy(cfg)
    _validate_transport(cfg)


def preflight(cfg: DictConfig) -> None:
    """fl-run's checks of the user's config before it sets `output_dir` and starts the engine.

    Refuses a user-given `output_dir` (fl-run sets it; only engine=deployment takes one, an
    absolute path on the SuperLink's machine). Unless the clients run elsewhere
    (deployment), builds the task as the ServerApp will: the device exists, the dataset's
    files are there and the partition gives every client its examples. The task is
    cached, so the ServerApp in this process (local, flower-sim) does not load it again.
    """
    explicit = cfg.get("output_dir")
    deployment = cfg.engine.name == "deployment"
    _require(explicit is None or deployment, "output_dir", explicit, OUTPUT_DIR_RULE)
    if not deployment:
        from fl.task import get_task

        get_task(cfg)

"""The Flower ClientApp: local training with the run's strategy hooks, and evaluation.

Runs unchanged on every engine; the strategy is looked up by name in the registry,
and per-client memory lives in the node's `Context.state`. Its data partition is the
node config's `partition-id`; with a run config that carries none of ours (a stock Flower
ServerApp, as in Flower's templates) the run is our defaults split into the node config's
`num-partitions`. An instruction for another strategy, or another contract version, gets
an error reply naming both (`fl.wire.contract`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from omegaconf import DictConfig

from clients.cohort import Member, cohort_unfit
from clients.cohort import train_cohort as train_cohort_of
from clients.optimizers import OptimizerState
from clients.trainer import LocalResult, TrainSettings, train_locally
from fl.common.config import RUN_CONFIG_KEY, from_run_config, plain, run_config_key
from fl.common.run_slot import RunSlot
from fl.common.seeding import derive_seed, derive_seeds, is_seed_word, pin_torch_threads
from fl.net.transport import bulk_mod
from fl.net.transport.offer import OFFER
from fl.run.apps import CohortClientApp, CohortReplies
from fl.run.engines.carriers import (
    is_envelope,
    keep_member_states,
    member_context,
    member_states,
    open_envelope,
    seal_replies,
    wants_one_reply,
)
from fl.run.faults import fault_mod, injects_faults
from fl.strategy.client import ClientHooks, ClientTime, load_instruction
from fl.strategy.registry import StrategySpec, get_strategy
from fl.wire.codec import CodecError, decode, encode_dense, payload_traffic
from fl.wire.cohort_reply import pack_cohort
from fl.wire.contract import NONCE_KEY, echo, mismatch_reply, unreadable
from fl.wire.records import items_of, new_record, required_record
from fl.world.task import Task, get_task
from privacy.dpsgd import DPSGD

__all__ = [
    "Round",
    "Trainer",
    "app",
    "carry_cohort",
    "finish_round",
    "prepare_round",
    "train_cohort",
    "train_in_process",
    "train_message",
]

# bulk_mod: arrays beside Flower's messages when the server offers it (fl.net.transport);
# outermost, so that faults act on the arrays as the ClientApp made them.
app = CohortClientApp(
    mods=[bulk_mod, fault_mod]
)  # fault_mod: the configured faults (none by default)

# Train-config keys a strategy may set per node and round (GIFT's local steps, LB-BSP's
# batch size, 2D-LRD's learning rate); absent keys keep the run's values.
PER_ROUND_KEYS = {
    "local-steps": "local_steps",
    "local-epochs": "local_epochs",
    "batch-size": "batch_size",
    "lr": "lr",
}


@dataclass(frozen=True)
class _Setup:
    """What every train call of a run needs, resolved once per process."""

    seed: int
    task: Task
    spec: StrategySpec
    params: Any
    settings: TrainSettings
    dp: DPSGD | None  # DP-SGD settings when privacy=dpsgd
    num_clients: int


_SETUP: RunSlot[_Setup] = RunSlot()  # the run's: every message of it reads it


def _make_setup(cfg: DictConfig) -> _Setup:
    pin_torch_threads(cfg.torch_threads)
    strategy = plain(cfg.strategy)
    spec = get_strategy(str(strategy["name"]))
    settings = TrainSettings(
        local_steps=cfg.local_steps,
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        optimizer=str(cfg.optimizer),
        betas=(float(cfg.betas[0]), float(cfg.betas[1])),
        eps=float(cfg.eps),
    )
    params = spec.make_params(strategy)
    dp = DPSGD.from_config(cfg)
    return _Setup(cfg.seed, get_task(cfg), spec, params, settings, dp, int(cfg.num_clients))


def _node_int(context: Context, key: str, low: int) -> int:
    """An integer of the node config, or a ValueError saying how to set it."""
    value = context.node_config.get(key)
    try:
        number = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = -1
    if isinstance(value, bool) or number < low:
        raise ValueError(
            f"node config {key}={value!r}: this ClientApp needs integers partition-id >= 0 "
            "and num-partitions >= 1 (flower-supernode --node-config "
            "'partition-id=0 num-partitions=10'; Flower's simulation sets both)"
        )
    return number


def _run_config(context: Context) -> dict[str, Any]:
    """The run config, or our defaults split into the node config's `num-partitions`
    when it carries none of ours (a stock Flower ServerApp)."""
    if RUN_CONFIG_KEY in context.run_config or "overrides" in context.run_config:
        return dict(context.run_config)
    n = _node_int(context, "num-partitions", 1)
    return {"overrides": f"num_clients={n} clients_per_round={n}"}


def _setup_of(context: Context) -> _Setup:
    run_config = _run_config(context)
    return _SETUP.get(run_config_key(run_config), lambda: _make_setup(from_run_config(run_config)))


def _partition(context: Context, clients: int) -> int:
    """The node's partition, within the run's `clients`."""
    partition = _node_int(context, "partition-id", 0)
    if partition >= clients:
        raise ValueError(f"node config partition-id={partition}: the run has {clients} clients")
    return partition


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Tell the server which data partition this node holds (it checks the range itself)."""
    record = ConfigRecord({"partition-id": _node_int(context, "partition-id", 0)})
    return Message(RecordDict({"info": record}), reply_to=msg)


@dataclass(frozen=True)
class Round:
    """One train instruction, prepared: the model loaded and the hooks begun, the settings
    for this node and round, its data. What a trainer (local, or a cluster's ranks) runs."""

    setup: _Setup
    config: ConfigRecord
    model: torch.nn.Module
    hooks: ClientHooks
    settings: TrainSettings
    partition: int
    data: tuple[torch.Tensor, torch.Tensor]
    memory: OptimizerState | None = None  # the optimizer's state from this node's past rounds
    # the global model as a flat vector, where it was left out of `model`: a cohort member
    # whose hooks load, begin and end as ClientHooks does (its weights never need the model)
    start: torch.Tensor | None = None


# A trainer runs a prepared round in place; its second value gives the reply's own metrics
# (called after the hooks have encoded the reply).
Trainer = Callable[[Round, Context], tuple[LocalResult, Callable[[], dict[str, Any]]]]


def train_message(msg: Message, context: Context, trainer: Trainer) -> Message:
    """One round of training by `trainer`; the strategy's hooks shape it and encode the reply."""
    prepared = prepare_round(msg, context)
    if isinstance(prepared, Message):
        return prepared
    result, own_metrics = trainer(prepared, context)
    return finish_round(msg, context, prepared, result, own_metrics)


def prepare_round(
    msg: Message,
    context: Context,
    broadcast: dict[tuple[Any, ...], Any] | None = None,
    seed: int | None = None,
    setup: _Setup | None = None,
) -> Round | Message:
    """The instruction loaded into this thread's model and the hooks begun (or the refusal
    of an instruction meant for another strategy or contract). `broadcast`: a cohort's
    memo of the payloads it has measured and decoded (`_once`); `seed`: this round's seed,
    where the cohort derived it with its other members' (`_cohort_seeds`); `setup`: the
    run's, where the cohort found it once for all its members (`_cohort_refusal`)."""
    setup = setup or _setup_of(context)
    config = required_record(msg.content, "config", ConfigRecord)
    values = items_of(config)  # read at dict speed below
    refusal = mismatch_reply(msg, values, setup.spec.name)
    if refusal is not None:
        return refusal
    partition = _partition(context, setup.num_clients)
    hooks = setup.spec.client(setup.params)
    model, layout = setup.task.model(), setup.task.layout
    content = msg.content
    if broadcast is None:
        received = payload_traffic(content).total
    else:
        received = _once(broadcast, "measure", content, lambda: payload_traffic(content).total)
    hooks.time = ClientTime.from_config(values, received)
    start = None
    if broadcast is not None and _plain(hooks):
        try:
            start = _once(broadcast, "decode", content, lambda: decode(content, layout))
        except CodecError as err:  # named as load_instruction names it
            raise CodecError(unreadable(err, content, config, setup.spec.name)) from None
    else:
        load_instruction(hooks, setup.spec.name, model, content, config, context.state, layout)
        hooks.begin(model, config, context.state)
    server_round = cast(int, values["server-round"])
    per_round = {field: values[key] for key, field in PER_ROUND_KEYS.items() if key in values}
    if seed is None:
        seed = derive_seed(setup.seed, server_round, partition)
    settings = replace(setup.settings, seed=seed, **per_round)
    data = setup.task.client_data(partition)
    memory = OptimizerState.load(context.state, settings.optimizer, _parameters(model))
    return Round(setup, config, model, hooks, settings, partition, data, memory=memory, start=start)


# a thread's reusable model -> its parameter count (weak: a finished run's models go)
_PARAMETERS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def _parameters(model: torch.nn.Module) -> int:
    """Scalars in `model`'s parameters, counted once per model instance: the task's model
    is reused for every client of its thread (`Task.model`), its shapes never change."""
    count = _PARAMETERS.get(model)
    if count is None:
        count = _PARAMETERS[model] = sum(p.numel() for p in model.parameters())
    return count


def _plain(hooks: ClientHooks) -> bool:
    """Whether `hooks` load, begin and end as ClientHooks does: the decoded global model
    is where a cohort member starts, and its trained row is what its reply encodes."""
    kind = type(hooks)
    return (kind.load, kind.begin, kind.end) == (
        ClientHooks.load,
        ClientHooks.begin,
        ClientHooks.end,
    )


def _once(
    memo: dict[tuple[Any, ...], Any], what: str, content: RecordDict, make: Callable[[], Any]
) -> Any:
    """`make()` of a payload, once per cohort: the server sends every node the same records
    for the same model, so a cohort measures and decodes the broadcast once, not once a
    client. Keyed by the identity of every record but the node's own `config` (what
    `payload_traffic` and `decode` read), which the cohort's messages keep alive and
    unchanged while it prepares them."""
    key = (what, *((name, id(record)) for name, record in content.items() if name != "config"))
    if key not in memo:
        memo[key] = make()
    return memo[key]


def finish_round(
    msg: Message,
    context: Context,
    prepared: Round,
    result: LocalResult,
    own_metrics: Callable[[], dict[str, Any]],
    trained: torch.Tensor | None = None,
) -> Message:
    """The reply: the hooks encode the trained model (or, for `_plain` hooks, the `trained`
    row as `ClientHooks.end` would); the metrics the server checks."""
    hooks, layout = prepared.hooks, prepared.setup.task.layout
    if trained is not None:
        records, extra = encode_dense(trained, layout), {}
    else:
        records, extra = hooks.end(prepared.model, context.state, layout)
    if prepared.memory is not None:
        prepared.memory.save(context.state)
    metrics = new_record(
        MetricRecord,
        {**round_metrics(prepared, result), **extra, **own_metrics(), **echo(prepared.config)},
    )
    return Message(new_record(RecordDict, {**records, "metrics": metrics}), reply_to=msg)


def round_metrics(prepared: Round, result: LocalResult) -> dict[str, Any]:
    """What every training reply reports of its round (the server checks each; the clock
    charges by `samples`), alone or as a cohort reply's columns."""
    return {
        "num-examples": len(prepared.data[1]),
        "train-loss": float(result.mean_loss),
        "steps": result.steps,
        "samples": result.samples,
        "partition-id": prepared.partition,
    }


def train_in_process(
    prepared: Round, context: Context
) -> tuple[LocalResult, Callable[[], dict[str, Any]]]:
    """Local SGD in this process, with DP-SGD when the run asks for it."""
    dp, (x, y) = prepared.setup.dp, prepared.data
    private = dp.session(len(y), prepared.config, prepared.settings.seed) if dp else None
    result = train_locally(
        prepared.model, x, y, prepared.hooks, prepared.settings, private, prepared.memory
    )
    return result, lambda: private.account(context.state, result.steps) if private else {}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training; the strategy's hooks shape it and encode the reply.
    An envelope (`engine=flower-sim` with `engine.cohort=auto`) is trained as a cohort."""
    if is_envelope(msg):
        return carry_cohort(msg, context)
    return train_message(msg, context, train_in_process)


def carry_cohort(envelope: Message, context: Context) -> Message:
    """Train the members an envelope carries (`fl.run.engines.carriers`): as one cohort
    where `train_cohort` can, the rest one by one as their own nodes would, each with the
    state this carrier keeps for it; one reply holding theirs."""
    members = open_envelope(envelope)
    states = member_states(context)
    pairs = [(member.message, member_context(context, member, states)) for member in members]
    outcome = train_cohort(pairs, wants_one_reply(envelope))
    answered = set(outcome.in_batch)  # in the one cohort reply, where there is one
    replies: list[Message | None] = []
    for j, ((msg, member), reply) in enumerate(zip(pairs, outcome.replies, strict=True)):
        if j in answered:
            replies.append(None)
            continue
        if reply is None:
            try:
                reply = train_message(msg, member, train_in_process)
            except Exception as err:  # this member fails alone, as it would on its node
                reply = err
        if isinstance(reply, BaseException):
            reply = Message(
                Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(reply).__name__}: {reply}"),
                reply_to=msg,
            )
        replies.append(reply)
    keep_member_states(context, states)
    return seal_replies(envelope, replies, outcome.path, outcome.batch)


def _cohort_refusal(pairs: Sequence[tuple[Message, Context]]) -> str | None:
    """Why these train messages cannot train as one cohort at all, or None."""
    keys = {run_config_key(_run_config(context)) for _, context in pairs}
    if len(keys) != 1:
        return "the messages belong to several runs"
    context = pairs[0][1]
    setup = _setup_of(context)
    hooks = setup.spec.client
    if not hooks.cohort_safe:
        return f"strategy {setup.spec.name}: its client half ({hooks.__name__}) is not cohort-safe"
    if setup.dp is not None:
        return "privacy=dpsgd clips per sample, client by client"
    if injects_faults(context.run_config):
        return "faults or attacks are injected message by message"
    return cohort_unfit(setup.task.model())


def _no_metrics() -> dict[str, Any]:
    return {}


@app.cohort()
def train_cohort(pairs: Sequence[tuple[Message, Context]], batched: bool = False) -> CohortReplies:
    """Train the pull's train messages as one cohort (`clients.cohort`) where the strategy's
    client half is cohort-safe and the run allows it; the rest go the per-client path.

    `batched` (the engine's choice, where the server takes cohort replies): the members
    whose hooks are `_plain` answer together in one reply (`fl.wire.cohort_reply`, their
    stacked rows and metric columns) instead of one Message each.

    Each client is prepared as alone (its hooks' `load` and `begin` on this thread's
    model, its own seed, data and per-round settings), its starting weights are read, the
    cohort trains, and each client's trained weights go back into the model for its
    hooks' `end`: the same replies, within `clients.cohort.STEP_TOLERANCE` per step.
    Messages that bring their arrays on the side channel take the per-client path.
    """
    replies: list[Message | BaseException | None] = [None] * len(pairs)
    refusal = _cohort_refusal(pairs)
    if refusal is not None:
        return CohortReplies(replies, f"per client: {refusal}")
    chosen = [
        i
        for i, (msg, _) in enumerate(pairs)
        if not (msg.has_content() and OFFER in msg.content)  # through bulk_mod instead
    ]
    if len(chosen) < 2:
        return CohortReplies(replies, "per client: fewer than 2 messages to batch")
    setup = _setup_of(pairs[0][1])
    layout = setup.task.layout
    members: list[tuple[int, Round, Member]] = []
    broadcast: dict[tuple[Any, ...], Any] = {}
    seeds = _cohort_seeds([pairs[i] for i in chosen], setup)
    for i, seed in zip(chosen, seeds, strict=True):
        msg, context = pairs[i]
        try:
            prepared = prepare_round(msg, context, broadcast, seed, setup)
        except Exception as err:  # this client fails alone, as it would per client
            replies[i] = err
            continue
        if isinstance(prepared, Message):
            replies[i] = prepared
            continue
        start = prepared.start if prepared.start is not None else layout.read(prepared.model)
        x, y = prepared.data
        member = Member(start, x, y, prepared.hooks, prepared.settings, prepared.memory)
        members.append((i, prepared, member))
    # a failure here is ours, not a client's: it stops the run rather than turning every
    # client of the round into an error reply
    cohort = [member for *_, member in members]
    trained, results = train_cohort_of(setup.task.model(), layout, cohort, setup.task.device)
    together: list[int] = []  # positions in `members` answered by the one cohort reply
    if batched and all(wire.dtype == np.float32 for wire in layout.wire):
        together = [k for k, (_, prepared, _) in enumerate(members) if prepared.start is not None]
    batch = _batch_reply(pairs, members, together, trained, results) if together else None
    answered = set(together)
    outcomes = zip(members, trained, results, strict=True)
    for k, ((i, prepared, _), row, result) in enumerate(outcomes):
        if k in answered:
            continue
        msg, context = pairs[i]
        try:
            if prepared.start is not None:  # `_plain` hooks: the row is the reply
                replies[i] = finish_round(msg, context, prepared, result, _no_metrics, row)
                continue
            layout.load_into(prepared.model, row)
            replies[i] = finish_round(msg, context, prepared, result, _no_metrics)
        except Exception as err:
            replies[i] = err
    name = setup.spec.name
    path = f"cohort: {len(members)} clients of {name} in one batch"
    if batch is None:
        return CohortReplies(replies, path)
    in_batch = [members[k][0] for k in together]
    return CohortReplies(replies, f"{path}, {len(in_batch)} in one reply", batch, in_batch)


def _cohort_seeds(pairs: Sequence[tuple[Message, Context]], setup: _Setup) -> list[int | None]:
    """Each message's round seed (`prepare_round`'s `derive_seed(run seed, round,
    partition)`), derived for the cohort at once; None where a key is not a 32-bit word
    (or the message names no round): `prepare_round` then derives or refuses it alone."""
    if not is_seed_word(setup.seed):
        return [None] * len(pairs)
    keys: list[tuple[int, int] | None] = []
    for msg, context in pairs:
        try:
            server_round = required_record(msg.content, "config", ConfigRecord)["server-round"]
            partition = _partition(context, setup.num_clients)
        except Exception:  # refused by prepare_round, for this client alone
            keys.append(None)
            continue
        fits = is_seed_word(server_round) and is_seed_word(partition)
        keys.append((server_round, partition) if fits else None)
    rows = [key for key in keys if key is not None]
    derived = iter(derive_seeds(setup.seed, *map(list, zip(*rows, strict=True))) if rows else [])
    return [None if key is None else next(derived) for key in keys]


def _batch_reply(
    pairs: Sequence[tuple[Message, Context]],
    members: list[tuple[int, Round, Member]],
    together: list[int],
    trained: torch.Tensor,
    results: list[LocalResult],
) -> RecordDict:
    """The one reply of the `together` members (`_plain` hooks): their trained rows as one
    stacked array and `finish_round`'s metrics as columns (`fl.wire.cohort_reply`); each
    member's optimizer state saved to its own Context as `finish_round` saves it."""
    columns: dict[str, list[Any]] = {}
    nonces: list[int] = []
    ids: list[int] = []
    for k in together:
        i, prepared, _ = members[k]
        msg, context = pairs[i]
        if prepared.memory is not None:
            prepared.memory.save(context.state)
        for key, value in round_metrics(prepared, results[k]).items():
            columns.setdefault(key, []).append(value)
        nonces.extend(echo(prepared.config).values())
        ids.append(msg.metadata.dst_node_id)
    if nonces and len(nonces) == len(ids):
        columns[NONCE_KEY] = nonces
    index = torch.tensor(together, dtype=torch.long)
    rows = trained if len(together) == len(trained) else trained.index_select(0, index)
    return pack_cohort(rows, ids, columns)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy and loss of the received model on this client's training data."""
    setup = _setup_of(context)
    task = setup.task
    model, layout = task.model(), task.layout
    layout.load_into(model, decode(msg.content, layout))
    x, y = task.client_data(_partition(context, setup.num_clients))
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(F.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    metrics = MetricRecord({"num-examples": len(y), "loss": loss, "accuracy": accuracy})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)

"""The ClientApp: node i is client i (``partition-id`` from the node config) and runs that
client's tasks on its own copy of the federation.

A node builds the run's federation once per process (``runner.build``: the data, the partition
and the initial banks are deterministic, as every rank of the distributed executor relies on)
and keeps only its own client's state authoritative: the client's bank rows (parameters,
buffers, extra state, kept optimizer state) live in the node's Flower ``Context.state`` between
rounds and are loaded into the rows before each task, so a process serving several nodes (Ray's
actors in simulation) never mixes their states.

A training message carries the round, the client and the download; the node runs the
algorithm's local plan (``run_train_task``, as every executor does), answers the statistics its
upload asks for from its own rows (``answer_statistics``), and replies with the upload and its
training metrics (a client whose update is not finite replies ``finite = 0`` and no upload, and
keeps its previous state).  An evaluation message carries the evaluation download and which state to evaluate;
the node adds the algorithm's evaluation plan and the run's fine-tuning and evaluates.

The client-side hooks (``plan``, ``upload``, ``evaluation``'s plan) run on the node's own
algorithm instance, whose server state is its initial one: they may depend on the settings,
the client and what the client received, never on server state (a deployment has no other).
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Mapping, Optional

import torch

from ..config import RunConfig, check, config_from, with_defaults
from ..engine.client import EvalTask, TrainTask, message_finite, run_eval_task, run_train_task
from ..engine.cohort_stats import answer_statistics
from ..engine.intra_op import one_intra_op_thread
from ..engine.rounds import evaluation_task, prepare_kept_state
from . import records

STATE = "pfl.client-state"
CONFIG = "pfl.config"
TRAIN_METRICS = "pfl.train"
EVAL_METRICS = "pfl.eval"
QUERY_METRICS = "pfl.node"

# One federation per process and run configuration: (fed, algorithm, initial rows by cohort).
_FEDERATIONS: dict[str, tuple] = {}


def config_key(config: RunConfig) -> str:
    """A run configuration as one JSON string (how it travels in Flower's run config)."""
    return json.dumps(config.as_dict(), sort_keys=True)


def config_from_key(text: str) -> RunConfig:
    """The RunConfig of :func:`config_key` (checked; one written by an earlier version reads
    as ``with_defaults`` reads its config.json)."""
    return check(config_from(with_defaults(json.loads(text))))


def flower_federation(config: RunConfig) -> tuple:
    """(federation, algorithm, initial rows) of ``config`` for a Flower app, built once per process.  Client
    tasks run in the calling thread (the sequential executor): the node is the unit of
    parallelism."""
    key = config_key(config)
    if key not in _FEDERATIONS:
        from ..runner import build

        fed, algorithm, _ = build(replace(config, executor="sequential", workers=None))
        # A client seen first by this process starts from these, whatever ran here before.
        initial = {c.name: {"params": c.params.data.clone(), "buffers": c.buffers.data.clone(),
                            "int_buffers": c.int_buffers.data.clone(),
                            "extra": {n: b.data.clone() for n, b in c.extra.items()}} for c in fed.cohorts}
        _FEDERATIONS[key] = (fed, algorithm, initial)
    return _FEDERATIONS[key]


def client_rows(fed, client: int) -> dict[str, torch.Tensor]:
    """Every bank row of ``client``, by name (what its node keeps between rounds): its rows of
    ``Cohort.client_tensors``."""
    cohort = fed.cohort_of(client)
    row = cohort.row(client)
    return {name: tensor[row] for name, tensor in cohort.client_tensors().items()}


def load_client_rows(fed, client: int, record) -> None:
    """Write a node's kept rows (:func:`client_rows`, as an ArrayRecord) into the federation."""
    cohort = fed.cohort_of(client)
    cohort.ensure_client_tensors(record)
    targets = client_rows(fed, client)
    values = records.state_tensors(record, {n: t.dtype for n, t in targets.items()}, cohort.params.data.device)
    missing = sorted(set(targets) - set(values))
    if missing:
        raise ValueError(f"client {client}'s kept state lacks {missing}")
    for name, value in values.items():
        targets[name].copy_(value)


def _partition(context, fed) -> int:
    node = context.node_config
    if "partition-id" not in node:
        raise ValueError("the node config has no partition-id: start each SuperNode with "
                         "--node-config 'partition-id=<i> num-partitions=<clients>'")
    client = int(node["partition-id"])
    if not 0 <= client < fed.num_clients:
        raise ValueError(f"partition-id {client} is outside this run's {fed.num_clients} clients")
    return client


def _restore(context, fed, initial, client: int) -> None:
    """Load the client's kept rows from its node's context; its initial rows on first contact."""
    if STATE in context.state:
        load_client_rows(fed, client, context.state[STATE])
        return
    cohort = fed.cohort_of(client)
    row, start = cohort.row(client), initial[cohort.name]
    for bank, name in ((cohort.params, "params"), (cohort.buffers, "buffers"), (cohort.int_buffers, "int_buffers")):
        bank.row(row).copy_(start[name][row])
    for name, bank in cohort.extra.items():
        bank.row(row).copy_(start["extra"][name][row])
    for state, vectors in cohort.optimizer_state.items():
        for bank in vectors.values():
            bank.row(row).zero_()
        cohort.optimizer_steps[state][row] = 0


def _task_config(message, client: int) -> dict:
    config = message.content[CONFIG]
    if int(config["client"]) != client:
        raise ValueError(f"a message for client {config['client']} reached the node of client {client}")
    return config


class Faults:
    """Failure drills: ``"raise:3@1,hang:5@2,nan:7@1"`` makes client 3 raise in round 1 (Flower's
    rounds, from 1), client 5 sleep past the round's timeout in round 2 and client 7's update
    non-finite in round 1; for testing a deployment's failure handling (run config key
    ``pfl-faults``)."""

    KINDS = ("raise", "hang", "nan")

    def __init__(self, text: str = "", hang_s: float = 30.0):
        self.hang_s = hang_s
        self.faults: dict[tuple[int, int], str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            try:
                kind, rest = item.split(":")
                client, round_ = rest.split("@")
                if kind not in self.KINDS:
                    raise ValueError
                self.faults[(int(client), int(round_))] = kind
            except ValueError:
                raise ValueError(f"pfl-faults: {item!r} is not KIND:CLIENT@ROUND with KIND one of "
                                 f"{', '.join(self.KINDS)}") from None

    def before(self, client: int, round_: int) -> Optional[str]:
        kind = self.faults.get((client, round_))
        if kind == "raise":
            raise RuntimeError(f"failure drill: client {client} raises in round {round_}")
        if kind == "hang":
            time.sleep(self.hang_s)
        return kind


def train(session, message, context, faults: Optional[Faults] = None):
    """Run the training task a message asks for; the reply's content (a RecordDict)."""
    from flwr.common import MetricRecord, RecordDict

    fed, algorithm, initial = session
    client = _partition(context, fed)
    config = _task_config(message, client)
    round_ = int(config["round"])
    kind = faults.before(client, round_ + 1) if faults is not None else None
    download = records.decode(message.content, "down", fed.device)
    task = TrainTask(client, round_, download, tuple(algorithm.plan(client)))
    _restore(context, fed, initial, client)
    prepare_kept_state(fed, [task])
    with one_intra_op_thread():
        result = run_train_task(fed, algorithm, task)
        if kind == "nan" and result.upload is not None:
            first = next(iter(result.upload.tensors))
            poisoned = dict(result.upload.tensors, **{first: torch.full_like(result.upload.dense(first), float("nan"))})
            result.upload = replace(result.upload, tensors=poisoned)
            # finish_train_task checked the upload before it was poisoned: check it again, as it did
            result.local = replace(result.local, finite=message_finite(result.upload))
        answer_statistics(fed, [result])  # from this client's stored rows, before anything is sent
    finite = result.finite  # parameters, loss and upload (finish_train_task)
    content = RecordDict({TRAIN_METRICS: MetricRecord({"loss": result.local.loss, "samples": result.local.samples,
                                                       "steps": result.local.steps, "finite": int(finite)})})
    if finite and result.upload is not None:
        for name, record in records.encode(result.upload, "up").items():
            content[name] = record
    if finite:  # a non-finite client keeps the state it had (run_train_task left its rows alone)
        context.state[STATE] = records.state_record(client_rows(fed, client))
    return content


def evaluate(session, message, context):
    """Run the evaluation task a message asks for; the reply's content (a RecordDict)."""
    from flwr.common import MetricRecord, RecordDict

    fed, algorithm, initial = session
    client = _partition(context, fed)
    config = _task_config(message, client)
    _restore(context, fed, initial, client)
    fed.round = int(config["round"])  # the fine-tuning's random stream is the evaluated round's
    local = evaluation_task(fed, algorithm, client, str(config["split"]))
    evaluation = replace(local.evaluation, download=records.decode(message.content, "down", fed.device),
                         params=str(config["params"]))
    with one_intra_op_thread():
        result = run_eval_task(fed, EvalTask(client, fed.round, local.split, evaluation))
    return RecordDict({EVAL_METRICS: MetricRecord({"accuracy": result.accuracy, "loss": result.loss,
                                                   "samples": result.samples})})


def make_client_app(config: Optional[RunConfig] = None, faults: str = "", hang_s: Optional[float] = None):
    """A Flower ``ClientApp`` running ``config``'s clients (None: the run config's ``pfl-config``,
    as ``flwr run`` gives it; ``faults``: :class:`Faults`, else the run config's ``pfl-faults``;
    ``hang_s``: how long a hanging drill sleeps, else the run config's ``pfl-hang-s``, 30)."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.common import MetricRecord, RecordDict

    app = ClientApp()

    def setup(context: Context) -> tuple:
        run_config = config if config is not None else config_from_key(str(context.run_config.get("pfl-config", "")
                                                                           or "{}"))
        return flower_federation(run_config)

    def drills(context: Context) -> Faults:
        text = faults or str(context.run_config.get("pfl-faults", ""))
        return Faults(text, hang_s=hang_s if hang_s is not None else float(context.run_config.get("pfl-hang-s", 30.0)))

    @app.train()
    def _train(message: Message, context: Context) -> Message:
        return Message(train(setup(context), message, context, drills(context)), reply_to=message)

    @app.evaluate()
    def _evaluate(message: Message, context: Context) -> Message:
        return Message(evaluate(setup(context), message, context), reply_to=message)

    @app.query()
    def _query(message: Message, context: Context) -> Message:
        client = _partition(context, setup(context)[0])
        return Message(RecordDict({QUERY_METRICS: MetricRecord({"partition-id": client})}), reply_to=message)

    return app


def metrics(content, name: str) -> Mapping[str, float]:
    """The MetricRecord ``name`` of a reply's content, as a dict."""
    return dict(content[name])

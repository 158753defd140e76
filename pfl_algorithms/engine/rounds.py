"""The round loop: the one place where the server's hooks, the client tasks, the executor and
the ledger meet.

One round (``run_round``)::

    server                                   engine                         clients (executor)
    ──────                                   ──────                         ──────────────────
    sample_clients(round)  ─────────────────► clients
    configure(round, clients) ─ downloads ──► count down bits ─ TrainTask ─► load rows, apply download,
                                                                              run plan(client) phases,
                                                                              upload(view) ─► store rows
    aggregate(round, uploads) ◄─ Uploads ─── count up bits ◄─ TrainResult ─┘  (only if finite)
    evaluation(client) ── Evaluation ───────► EvalTask per client ─────────► scratch copy, fine-tune?,
                                                                              evaluate ─► metrics

A client whose update is not finite sends nothing and keeps the state it had before the round.

A round is two public steps around wherever its tasks run: :func:`start_round` (sampling,
downloads and their bits, the clients' training tasks) and :func:`finish_round` (the results
in: upload bits, ``aggregate``, ``fed.round`` advanced, the record and, on evaluation rounds,
the evaluation).  ``run_round`` runs the tasks between them on the federation's executor
(sequential, threaded, batched or distributed); Flower's strategy (``flower.strategy``) sends
them to its nodes and drives the same two steps, so there is one round loop.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Union

import torch
from torch import nn

from .client import (EvalResult, EvalTask, Evaluation, TrainResult, TrainTask, phase_optimizer, run_eval_task,
                     run_train_task)
from .federation import EngineSettings, Federation, Server
from .messages import Message
from .plan import state_names
from .uploads import Uploads


@dataclass
class RoundRecord:
    """What one round did: the metrics line of ``metrics.jsonl``."""

    round: int
    clients: list[int]
    train_loss: dict[int, float]
    skipped: list[int]
    bits_up: float
    bits_down: float
    wall_s: float
    eval: Optional[dict] = None
    algorithm: dict = field(default_factory=dict)  # the algorithm's own numbers (``round_metrics``)
    failed: dict = field(default_factory=dict)  # client -> why it gave no result (Flower's nodes)

    def as_dict(self) -> dict:
        return {"round": self.round, "clients": self.clients, "train_loss": self.train_loss,
                "skipped_non_finite": self.skipped, "bits_up": self.bits_up, "bits_down": self.bits_down,
                "wall_s": self.wall_s, **({"eval": self.eval} if self.eval is not None else {}),
                **({"algorithm": self.algorithm} if self.algorithm else {}),
                **({"failed": self.failed} if self.failed else {})}


def attach(fed: Federation, algorithm) -> None:
    """Give ``algorithm`` its server view of ``fed`` and let it create its server state."""
    algorithm.server = Server(fed)
    algorithm.setup(algorithm.server)


@dataclass
class RoundStart:
    """A started round (:func:`start_round`): its clients' training tasks, in ascending client
    order, and what :func:`finish_round` measures the round against."""

    round: int
    clients: list[int]
    tasks: list[TrainTask]
    started: float  # time.perf_counter() at the start
    bits_up: float  # the ledger's totals at the start
    bits_down: float


def downloads_by_client(sent: Union[None, Message, Mapping[int, Message]],
                        clients: list[int]) -> dict[int, Optional[Message]]:
    """What ``configure`` returned (None, one Message for every client, or a Message per
    client), as a download per client of ``clients``.

    Raises:
        ValueError: a mapping lacks some client of ``clients``.
    """
    if sent is None or isinstance(sent, Message):
        return {c: sent for c in clients}
    missing = sorted(set(clients) - set(sent))
    if missing:
        raise ValueError(f"configure returned no download for clients {missing}")
    return {c: sent[c] for c in clients}


def start_round(fed: Federation, algorithm, round_: int) -> RoundStart:
    """The first step of round ``round_``: sample its clients, ``configure`` their downloads,
    count each download in the ledger and give each client its training task (the download and
    the algorithm's local plan).  Wherever the tasks run, :func:`finish_round` ends the round."""
    start = time.perf_counter()
    clients = fed.sample_clients(round_).tolist()
    up0, down0 = fed.comm.total("up"), fed.comm.total("down")
    downloads = downloads_by_client(algorithm.configure(round_, torch.tensor(clients)), clients)
    tasks = [TrainTask(c, round_, downloads[c], tuple(algorithm.plan(c))) for c in clients]
    for task in tasks:
        if task.download is not None:
            fed.comm.record("down", task.client, task.download, fed.cohort_of(task.client).name)
    return RoundStart(round_, clients, tasks, start, up0, down0)


def prepare_kept_state(fed: Federation, tasks: list[TrainTask]) -> None:
    """With ``optimizer_state='keep'``, create the kept optimizer state every phase of ``tasks``
    needs (zeros, step 0) where its client's cohort lacks it."""
    if fed.settings.optimizer_state != "keep":
        return
    for task in tasks:
        cohort = fed.cohort_of(task.client)
        for phase, name in zip(task.plan, state_names(task.plan)):
            cohort.ensure_optimizer_state(name, phase_optimizer(phase, fed.settings).state_names())


def train_on_executor(fed: Federation, algorithm, tasks: list[TrainTask]) -> list[TrainResult]:
    """The training tasks of a round run by ``fed``'s executor, in task order, the statistics
    their uploads ask for answered (by the executor, per sender)."""
    prepare_kept_state(fed, tasks)
    return fed.executor.run_train(fed, algorithm, tasks, lambda task: run_train_task(fed, algorithm, task))


def evaluates_after(fed: Federation, round_: int) -> bool:
    """Whether round ``round_`` ends with an evaluation (every ``eval_every`` rounds, and the last)."""
    return (round_ + 1) % fed.settings.eval_every == 0 or round_ + 1 == fed.settings.rounds


def finish_round(fed: Federation, algorithm, start: RoundStart, results: list[TrainResult], *,
                 failed: Optional[Mapping[int, str]] = None, evaluate: bool = True) -> RoundRecord:
    """The last step of the round ``start`` began: take in the ``results`` of its training tasks
    (in ascending client order; a client with no result is in ``failed``, with why), count
    the finite uploads in the ledger, ``aggregate`` them (the non-finite and failed clients as
    the failures), advance ``fed.round`` and give the round's record; on an evaluation round
    and with ``evaluate``, :func:`evaluate_all` on ``fed``'s executor fills its ``eval``
    (without: the caller evaluates :func:`evaluation_tasks` itself, as Flower's strategy does)."""
    failed = dict(failed or {})
    sent = [r for r in results if r.finite and r.upload is not None]
    for result in sent:
        fed.comm.record("up", result.client, result.upload, fed.cohort_of(result.client).name)
    skipped = [r.client for r in results if not r.finite]
    algorithm.aggregate(start.round, Uploads([r.client for r in sent], [r.upload for r in sent],
                                             sorted([*skipped, *failed])))
    fed.round = start.round + 1
    record = RoundRecord(round=start.round, clients=start.clients,
                         train_loss={r.client: r.local.loss for r in results}, skipped=skipped,
                         bits_up=fed.comm.total("up") - start.bits_up,
                         bits_down=fed.comm.total("down") - start.bits_down,
                         wall_s=time.perf_counter() - start.started,
                         algorithm=dict(algorithm.round_metrics(start.round)), failed=failed)
    if evaluate and evaluates_after(fed, start.round):
        record.eval = evaluate_all(fed, algorithm)
    return record


def run_round(fed: Federation, algorithm, round_: int) -> RoundRecord:
    """One round of ``algorithm`` on ``fed`` (the loop of the module docstring): start it, train
    its tasks on ``fed``'s executor, finish it."""
    start = start_round(fed, algorithm, round_)
    return finish_round(fed, algorithm, start, train_on_executor(fed, algorithm, start.tasks))


def as_evaluation(value) -> Evaluation:
    """What ``evaluation(client)`` returned (None, a Message or an Evaluation) as an Evaluation.

    Raises:
        TypeError: it is none of those.
    """
    if value is None:
        return Evaluation()
    if isinstance(value, Message):
        return Evaluation(download=value)
    if isinstance(value, Evaluation):
        return value
    raise TypeError(f"evaluation() must return None, a Message or an Evaluation, got {type(value).__name__}")


def evaluation_task(fed: Federation, algorithm, client: int, split: str) -> EvalTask:
    """``client``'s evaluation task on ``split`` after round ``fed.round - 1``: the algorithm's
    evaluation, then the run's fine-tuning (``finetune_epochs``) if any, then the evaluation's
    ``final`` phases, as one plan."""
    evaluation = as_evaluation(algorithm.evaluation(client))
    # after the algorithm's own adaptation (Per-FedAvg's step), if any, before its final phases
    finetune = (algorithm.finetune_phase(client, fed.settings.finetune_epochs),) if fed.settings.finetune_epochs else ()
    if finetune or evaluation.final:
        evaluation = replace(evaluation, plan=(*evaluation.plan, *finetune, *evaluation.final), final=())
    return EvalTask(client, fed.round, split, evaluation)


def evaluated_clients(fed: Federation) -> list[int]:
    """The clients an evaluation scores, in order: every client, or those with the run's
    ``eval_role`` (fda's target, whose accuracy FedDAF's tables report)."""
    role = fed.settings.eval_role
    return list(range(fed.num_clients)) if role is None else list(fed.roles[role])


def evaluation_tasks(fed: Federation, algorithm, split: str = "test") -> list[EvalTask]:
    """The :func:`evaluation_task` of every client :func:`evaluated_clients` names, in client order."""
    return [evaluation_task(fed, algorithm, c, split) for c in evaluated_clients(fed)]


def evaluation_summary(results: list[EvalResult], split: str = "test") -> dict:
    """The ``eval`` of a round's record from its evaluation ``results`` (a client that could not
    be evaluated has NaN accuracy and loss): per client, the mean accuracy over the clients
    evaluated, and ``diverged``: the clients whose model diverged (samples to evaluate, but a
    non-finite loss).  A diverged client's accuracy is NaN (never the argmax of NaN logits)
    and it counts as 0 in the mean, so that an unstable method is not scored on the clients
    that survived it alone; with no client scored (all diverged) there is no mean (NaN)."""
    diverged = sorted(r.client for r in results if r.samples > 0 and not math.isfinite(r.loss))
    acc = {r.client: math.nan if r.client in diverged else r.accuracy for r in results}
    loss = {r.client: r.loss for r in results}
    valid = [a for a in acc.values() if a == a]
    mean = sum(valid) / (len(valid) + len(diverged)) if valid else float("nan")
    return {"split": split, "accuracy": acc, "loss": loss, "mean_accuracy": mean, "diverged": diverged}


def evaluate_all(fed: Federation, algorithm, split: str = "test") -> dict:
    """Personalized accuracy: every client's evaluation model on its own split, fine-tuned first
    when the run asks (``finetune_epochs``); means over clients."""
    results = fed.executor.run_eval(fed, evaluation_tasks(fed, algorithm, split), lambda task: run_eval_task(fed, task))
    return evaluation_summary(results, split)


def _prepared(algorithm, model: nn.Module) -> nn.Module:
    prepared = algorithm.prepare_model(model)
    if not isinstance(prepared, nn.Module):
        raise TypeError(f"{type(algorithm).__name__}.prepare_model must return an nn.Module, got "
                        f"{type(prepared).__name__}")
    return prepared


def federation_for(algorithm, models, inputs, labels, clients, settings: EngineSettings, *,
                   keep_head_local: bool = False, architectures=None, device="cpu", augment=None,
                   roles=None) -> Federation:
    """A federation shaped by ``algorithm``'s declarations (groups, local groups, extra client
    state), with the algorithm attached (its ``setup`` has run).  Each model is first
    replaced by ``algorithm.prepare_model(model)``."""
    if isinstance(models, nn.Module):
        models = _prepared(algorithm, models)
    else:
        models = {name: _prepared(algorithm, model) for name, model in models.items()}
    fed = Federation(models, inputs, labels, clients, settings, architectures=architectures,
                     group_rules=algorithm.group_rules(), local_groups=algorithm.local_groups(
                         keep_head_local=keep_head_local), client_state=algorithm.client_state(),
                     device=device, augment=augment, roles=roles)
    attach(fed, algorithm)
    return fed

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
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Union

import torch
from torch import nn

from .client import EvalTask, Evaluation, TrainTask, phase_optimizer, run_eval_task, run_train_task
from .cohort_stats import resolve_class_means
from .federation import EngineSettings, Federation, Server
from .messages import Message
from .plan import Phase, state_names
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

    def as_dict(self) -> dict:
        return {"round": self.round, "clients": self.clients, "train_loss": self.train_loss,
                "skipped_non_finite": self.skipped, "bits_up": self.bits_up, "bits_down": self.bits_down,
                "wall_s": self.wall_s, **({"eval": self.eval} if self.eval is not None else {}),
                **({"algorithm": self.algorithm} if self.algorithm else {})}


def attach(fed: Federation, algorithm) -> None:
    """Give ``algorithm`` its server view of ``fed`` and let it create its server state."""
    algorithm.server = Server(fed)
    algorithm.setup(algorithm.server)


def _downloads(sent: Union[None, Message, Mapping[int, Message]], clients: list[int]) -> dict[int, Optional[Message]]:
    if sent is None or isinstance(sent, Message):
        return {c: sent for c in clients}
    missing = sorted(set(clients) - set(sent))
    if missing:
        raise ValueError(f"configure returned no download for clients {missing}")
    return {c: sent[c] for c in clients}


def prepare_kept_state(fed: Federation, tasks: list[TrainTask]) -> None:
    """With ``optimizer_state='keep'``, create the kept optimizer state every phase of ``tasks``
    needs (zeros, step 0) where its client's cohort lacks it."""
    if fed.settings.optimizer_state != "keep":
        return
    for task in tasks:
        cohort = fed.cohort_of(task.client)
        for phase, name in zip(task.plan, state_names(task.plan)):
            cohort.ensure_optimizer_state(name, phase_optimizer(phase, fed.settings).state_names())


def run_round(fed: Federation, algorithm, round_: int) -> RoundRecord:
    """One round of ``algorithm`` on ``fed`` (the loop of the module docstring)."""
    start = time.perf_counter()
    clients = fed.sample_clients(round_).tolist()
    up0, down0 = fed.comm.total("up"), fed.comm.total("down")
    downloads = _downloads(algorithm.configure(round_, torch.tensor(clients)), clients)
    tasks = [TrainTask(c, round_, downloads[c], tuple(algorithm.plan(c))) for c in clients]
    prepare_kept_state(fed, tasks)
    for task in tasks:
        if task.download is not None:
            fed.comm.record("down", task.client, task.download, fed.cohort_of(task.client).name)
    results = fed.executor.run_train(fed, algorithm, tasks, lambda task: run_train_task(fed, algorithm, task))
    resolve_class_means(fed, results)  # the uploads' class-mean requests, per cohort at once
    sent = [r for r in results if r.finite and r.upload is not None]
    for result in sent:
        fed.comm.record("up", result.client, result.upload, fed.cohort_of(result.client).name)
    skipped = [r.client for r in results if not r.finite]
    algorithm.aggregate(round_, Uploads([r.client for r in sent], [r.upload for r in sent], skipped))
    fed.round = round_ + 1
    record = RoundRecord(round=round_, clients=clients, train_loss={r.client: r.local.loss for r in results},
                         skipped=skipped, bits_up=fed.comm.total("up") - up0,
                         bits_down=fed.comm.total("down") - down0, wall_s=time.perf_counter() - start,
                         algorithm=dict(algorithm.round_metrics(round_)))
    if (round_ + 1) % fed.settings.eval_every == 0 or round_ + 1 == fed.settings.rounds:
        record.eval = evaluate_all(fed, algorithm)
    return record


def _evaluation(value) -> Evaluation:
    if value is None:
        return Evaluation()
    if isinstance(value, Message):
        return Evaluation(download=value)
    if isinstance(value, Evaluation):
        return value
    raise TypeError(f"evaluation() must return None, a Message or an Evaluation, got {type(value).__name__}")


def finetune_phase(algorithm, client: int, epochs: int) -> Phase:
    """Local fine-tuning before evaluation, for every algorithm (pFedMB's tables fine-tune every
    method): ``epochs`` epochs of the run's optimizer, from fresh state, on the groups the
    client trains in its local plan (every group if a phase trains every group)."""
    groups: Optional[set] = set()
    for phase in algorithm.plan(client):
        if phase.groups is None:
            groups = None
            break
        groups.update(phase.groups)
    return Phase(epochs=epochs, groups=None if groups is None else tuple(sorted(groups)), state="finetune")


def _evaluation_task(fed: Federation, algorithm, client: int, split: str) -> EvalTask:
    evaluation = _evaluation(algorithm.evaluation(client))
    if fed.settings.finetune_epochs:  # after the algorithm's own adaptation (Per-FedAvg's step), if any
        evaluation = replace(evaluation, plan=(*evaluation.plan,
                                               finetune_phase(algorithm, client, fed.settings.finetune_epochs)))
    return EvalTask(client, fed.round, split, evaluation)


def evaluate_all(fed: Federation, algorithm, split: str = "test") -> dict:
    """Personalized accuracy: every client's evaluation model on its own split, fine-tuned first
    when the run asks (``finetune_epochs``); means over clients."""
    tasks = [_evaluation_task(fed, algorithm, c, split) for c in range(fed.num_clients)]
    results = fed.executor.run(tasks, lambda task: run_eval_task(fed, task))
    acc = {r.client: r.accuracy for r in results}
    loss = {r.client: r.loss for r in results}
    valid = [a for a in acc.values() if a == a]
    return {"split": split, "accuracy": acc, "loss": loss,
            "mean_accuracy": sum(valid) / len(valid) if valid else float("nan")}


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

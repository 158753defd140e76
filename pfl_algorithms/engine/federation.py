"""A federation in memory: the data on the device, the client banks, and the round loop.

Every random draw of a round comes from a generator seeded by (seed, round, purpose,
client), never from global state, so a round depends only on the banks at its start: a run
resumed from a checkpoint reproduces an uninterrupted one bit for bit on CPU.

A round: sample clients; the algorithm sends them what they receive (``begin_round``);
each trains locally (the algorithm adds its loss and gradient terms); a client whose update
is not finite is logged and keeps its previous state; the algorithm combines the uploads
(``end_round``); every ``eval_every`` rounds each client is evaluated on its own test split.
"""
from __future__ import annotations

import copy
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

from .bank import ClientBank
from .comm import CommLedger
from .local import LocalSchedule, evaluate, train_locally
from .optim import make_optimizer
from .working import WorkingModel

_STREAMS = {"sample": 1, "train": 2, "eval": 3, "algorithm": 4}


@dataclass(frozen=True)
class EngineSettings:
    """The settings of the round loop (the algorithm has its own)."""

    rounds: int = 10
    sample: Union[float, int] = 1.0  # a fraction of the clients (float) or a count (int)
    schedule: LocalSchedule = field(default_factory=LocalSchedule)
    optimizer: str = "sgd"
    optimizer_settings: dict = field(default_factory=lambda: {"lr": 0.01})
    eval_every: int = 1
    seed: int = 0
    # "reset": every round starts from fresh optimizer state (a new torch.optim per client and
    # round, as FedAvg-style code does); "keep": each client's state persists in its bank rows.
    optimizer_state: str = "reset"
    # Clients trained (and evaluated) at once on CPU, each in its own thread on one core with
    # its own copy of the template module (None: one per core).  Small models use cores far
    # better this way than by splitting each client's small ops over threads.  Every client
    # runs single-threaded, with workers=1 too, so its result does not depend on how many run
    # beside it: any worker count gives bitwise the same run.
    workers: Optional[int] = None

    def __post_init__(self):
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ValueError(f"workers must be None or an integer >= 1, got {self.workers!r}")
        if self.optimizer_state not in ("reset", "keep"):
            raise ValueError(f"optimizer_state must be 'reset' or 'keep', got {self.optimizer_state!r}")
        if isinstance(self.sample, bool) or not isinstance(self.sample, (int, float)):
            raise ValueError(f"sample must be a fraction in (0, 1] or a client count >= 1, got {self.sample!r}")
        if isinstance(self.sample, float) and not 0.0 < self.sample <= 1.0:
            raise ValueError(f"sample as a fraction must be in (0, 1], got {self.sample}")
        if isinstance(self.sample, int) and self.sample < 1:
            raise ValueError(f"sample as a count must be >= 1, got {self.sample}")


@dataclass
class ClientData:
    """A client's share of the pooled dataset: index tensors on the device and its label map."""

    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    label_map: Optional[torch.Tensor] = None


class Federation:
    """K clients sharing one template model; their state lives in banks.

    Attributes:
        work: the template module bound to flat vectors (one client trains at a time).
        params / buffers / int_buffers: banks [K, P] of parameters and BatchNorm statistics.
        optimizer_state: name -> bank [K, P] (momentum, Adam moments), plus ``optimizer_steps`` [K].
        local_names: parameters that never leave a client (e.g. the head in permuted scenarios).
        comm: the ledger of bits sent up and down.
        augment: None, or ``augment(batch, generator) -> batch`` applied to every training
            batch on the device (``data.augment.make_augmentation``), drawing from the
            client's training generator.
    """

    def __init__(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, clients: list[ClientData],
                 settings: EngineSettings, *, local_names: tuple[str, ...] = (), device="cpu", augment=None):
        if not clients:
            raise ValueError("a federation needs at least one client")
        self.settings = settings
        self.augment = augment
        self.device = torch.device(device)
        self.inputs = inputs.to(self.device)
        self.labels = labels.to(self.device)
        self.clients = [ClientData(*(t.to(self.device) if t is not None else None
                                     for t in (c.train, c.val, c.test, c.label_map))) for c in clients]
        model = model.to(self.device)
        unknown = [n for n in local_names if n not in dict(model.named_parameters())]
        if unknown:
            raise ValueError(f"local_names has parameters the model does not have: {unknown}")
        self.local_names = tuple(local_names)
        local = set(local_names)
        # Shared parameters first, local ones last: each is one contiguous span of a bank row.
        self._order = lambda name: name in local
        self._main_work = WorkingModel(model, order=self._order)
        self._local = threading.local()
        self._works_lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self.layout = self._main_work.layout
        k = len(self.clients)
        self.params = ClientBank(self.layout, k, device=self.device, fill=self.work.params)
        self.buffers = ClientBank(self.work.buffer_layout, k, device=self.device, fill=self.work.buffers)
        self.int_buffers = ClientBank(self.work.int_buffer_layout, k, device=self.device, fill=self.work.int_buffers)
        self.optimizer = make_optimizer(settings.optimizer, **settings.optimizer_settings)
        self.optimizer_state = {name: ClientBank(self.layout, k, device=self.device)
                                for name in self.optimizer.state_names()}
        self.optimizer_steps = torch.zeros(k, dtype=torch.int64)
        self.shared_names = tuple(n for n in self.layout.names() if n not in local)
        self.shared = self.layout.span(self.shared_names)
        self.comm = CommLedger()
        self.round = 0

    @property
    def work(self) -> WorkingModel:
        """The working model of the calling thread (worker threads each have their own copy)."""
        work = getattr(self._local, "work", None)
        if work is None:
            if threading.current_thread() is threading.main_thread():
                work = self._main_work
            else:
                with self._works_lock:
                    work = WorkingModel(copy.deepcopy(self._main_work.module), order=self._order)
            self._local.work = work
        return work

    @property
    def workers(self) -> int:
        """How many clients train at once (1 on CUDA, where one client fills the device)."""
        if self.device.type != "cpu":
            return 1
        return self.settings.workers or (os.cpu_count() or 1)

    def for_each_client(self, clients: list[int], task) -> list:
        """``task(client)`` (its training or evaluation) for every client, ``workers`` at a time;
        results in order.

        On CPU every call runs in a pool thread whose torch uses one intra-op thread, even
        with one worker or one client: a client computed on the main thread would use
        torch's default thread count, and reductions split over a different number of
        threads round differently (1 worker differed from 2 by 6e-8).  On CUDA the clients
        run one after another on the calling thread."""
        if self.device.type != "cpu":
            return [task(c) for c in clients]
        if self._pool is None:
            # Kept for the federation's lifetime, so each thread keeps its working model.
            self._pool = ThreadPoolExecutor(max_workers=self.workers, initializer=torch.set_num_threads,
                                            initargs=(1,), thread_name_prefix="pfl-client")
        return list(self._pool.map(task, clients))

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def train_sizes(self) -> torch.Tensor:
        """Each client's number of training samples, [K] float64."""
        return torch.tensor([c.train.numel() for c in self.clients], dtype=torch.float64)

    def generator(self, purpose: str, round_: int, client: int = -1) -> torch.Generator:
        """A generator for one purpose of one round (and client), independent of all others."""
        seed = hash((self.settings.seed, _STREAMS[purpose], round_, client)) & 0x7FFF_FFFF_FFFF_FFFF
        return torch.Generator().manual_seed(seed)

    def sample_clients(self, round_: int) -> torch.Tensor:
        """The clients of round ``round_`` (sorted), drawn without replacement."""
        k = self.num_clients
        sample = self.settings.sample
        count = sample if isinstance(sample, int) else max(1, round(sample * k))
        if count > k:
            raise ValueError(f"sample asks for {count} clients per round but there are {k}")
        if count == k:
            return torch.arange(k)
        return torch.randperm(k, generator=self.generator("sample", round_))[:count].sort().values

    # ------------------------------------------------------------------ client state

    def load_client(self, client: int) -> None:
        """Load a client's parameters and buffers into the working model."""
        self.work.load(self.params.row(client), self.buffers.row(client), self.int_buffers.row(client))

    def store_client(self, client: int) -> None:
        self.work.store(self.params.row(client), self.buffers.row(client), self.int_buffers.row(client))

    def client_optimizer_state(self, client: int) -> dict:
        state = {name: bank.row(client) for name, bank in self.optimizer_state.items()}
        state["steps"] = self.optimizer_steps[client]  # a 0-d view: the step updates it in place
        return state

    def train_client(self, client: int, round_: int, *, loss_terms=(), grad_terms=(), ranges=None,
                     schedule: Optional[LocalSchedule] = None):
        """Local training of ``client`` from its bank rows; the rows are updated only if it stays finite."""
        self.load_client(client)
        data = self.clients[client]
        state = self.client_optimizer_state(client)
        saved = {name: t.clone() for name, t in state.items()}
        if self.settings.optimizer_state == "reset":
            for t in state.values():
                t.zero_()
        result = train_locally(self.work, self.optimizer, state, self.inputs, self.labels, data.train,
                               schedule or self.settings.schedule, generator=self.generator("train", round_, client),
                               label_map=data.label_map, loss_terms=loss_terms, grad_terms=grad_terms,
                               ranges=ranges, augment=self.augment)
        if result.finite:
            self.store_client(client)
        else:
            for name, t in state.items():
                t.copy_(saved[name])
        return result

    @torch.no_grad()
    def evaluate_client(self, client: int, split: str = "test", params: Optional[torch.Tensor] = None,
                        buffers: Optional[torch.Tensor] = None):
        """(accuracy, loss, samples) of a client's model on a split; ``params`` / ``buffers``
        replace its parameters / BatchNorm statistics for this evaluation only."""
        self.load_client(client)
        if params is not None:
            self.work.params.copy_(params)
        if buffers is not None:
            self.work.buffers.copy_(buffers)
        data = self.clients[client]
        return evaluate(self.work.module, self.inputs, self.labels, getattr(data, split), label_map=data.label_map)

    def state_dict(self) -> dict:
        """Everything a resumed run needs (banks, optimizer state, round, ledger)."""
        return {"round": self.round, "params": self.params.data, "buffers": self.buffers.data,
                "int_buffers": self.int_buffers.data, "optimizer_steps": self.optimizer_steps,
                "optimizer_state": {n: b.data for n, b in self.optimizer_state.items()},
                "comm": self.comm.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.round = int(state["round"])
        self.params.load_state_dict({"data": state["params"]})
        self.buffers.load_state_dict({"data": state["buffers"]})
        self.int_buffers.load_state_dict({"data": state["int_buffers"]})
        self.optimizer_steps.copy_(state["optimizer_steps"])
        for name, bank in self.optimizer_state.items():
            bank.load_state_dict({"data": state["optimizer_state"][name]})
        self.comm.load_state_dict(state["comm"])


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

    def as_dict(self) -> dict:
        return {"round": self.round, "clients": self.clients, "train_loss": self.train_loss,
                "skipped_non_finite": self.skipped, "bits_up": self.bits_up, "bits_down": self.bits_down,
                "wall_s": self.wall_s, **({"eval": self.eval} if self.eval is not None else {})}


def run_round(fed: Federation, algorithm, round_: int) -> RoundRecord:
    """One round of ``algorithm`` on ``fed`` (the loop of the module docstring)."""
    start = time.perf_counter()
    clients = fed.sample_clients(round_)
    up0, down0 = fed.comm.total("up"), fed.comm.total("down")
    algorithm.begin_round(fed, clients, round_)
    losses, finite = {}, []
    results = fed.for_each_client(clients.tolist(), lambda client: algorithm.train_client(fed, client, round_))
    for client, result in zip(clients.tolist(), results):
        finite.append(result.finite)
        losses[client] = result.loss
    ok = torch.tensor(finite, dtype=torch.bool)
    algorithm.end_round(fed, clients, ok, round_)
    fed.round = round_ + 1
    record = RoundRecord(round=round_, clients=clients.tolist(), train_loss=losses,
                         skipped=clients[~ok].tolist(), bits_up=fed.comm.total("up") - up0,
                         bits_down=fed.comm.total("down") - down0, wall_s=time.perf_counter() - start)
    if (round_ + 1) % fed.settings.eval_every == 0 or round_ + 1 == fed.settings.rounds:
        record.eval = evaluate_all(fed, algorithm)
    return record


def evaluate_all(fed: Federation, algorithm, split: str = "test") -> dict:
    """Personalized accuracy: every client's model on its own split; means over clients.
    Clients are evaluated like they train (``Federation.for_each_client``: ``workers`` at a
    time, each on one thread), so the numbers do not depend on the worker count either."""
    acc, loss = {}, {}
    results = fed.for_each_client(list(range(fed.num_clients)),
                                  lambda client: algorithm.evaluate_client(fed, client, split))
    for client, (a, l, _) in enumerate(results):
        acc[client], loss[client] = a, l
    valid = [a for a in acc.values() if a == a]
    return {"split": split, "accuracy": acc, "loss": loss,
            "mean_accuracy": sum(valid) / len(valid) if valid else float("nan")}

"""A federation in memory: the data on the device, the clients' cohorts and banks, the ledger.

Every random draw of a round comes from a generator seeded by (seed, stream, round, client)
(``engine.seeds``), never from global state, so a round depends only on the banks at its
start: a run resumed from a checkpoint reproduces an uninterrupted one bit for bit.

Clients are grouped into cohorts, one per architecture (``engine.cohort``); a federation of
one model has one cohort.  A group that clients may send must have the same shapes in every
cohort that has it, since the server combines it across them.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..data.partition import ClientSplit
from ..models.base import head_parameter_names
from .cohort import Cohort, StateSpec
from .comm import CommLedger
from .conv_gemm import check_choice as check_conv_choice
from .executor_factory import make_executor
from .groups import BUFFERS, GroupRule, declare_groups
from .local import LocalSchedule, conv_layout
from .optim import OptimizerSettings
from .seeds import stream_generator
from .step_graphs import StepGraphs


@dataclass(frozen=True)
class EngineSettings:
    """The settings of the round loop (the algorithm has its own).

    ``sample``: the fraction of clients drawn each round, in (0, 1]; ``clients_per_round``:
    a count instead (None: use ``sample``).  ``optimizer_state``: 'reset' (every round starts
    from fresh optimizer state, as FedAvg-style code does) or 'keep' (each client's state
    persists in its bank rows).  ``executor``: where client tasks run ('threaded', the CPU
    default, or 'sequential'); ``workers``: tasks at once for 'threaded' (None: one per core).
    ``eval_role``: evaluate only the clients with this role (None: every client).
    ``finetune_epochs``: before evaluation, each client fine-tunes a scratch copy of its
    evaluation model for that many epochs (``Algorithm.finetune_phase``; 0: none).
    ``chunk_clients``: clients per chunk of the ``batched`` executor (None: from free memory).
    ``threaded_hooks``: the ``batched`` executor sends plans with begin hooks or loss terms to
    threads (``--executor auto`` on a CPU, where that is faster for them).
    ``autocast``: 'bf16' runs the training forward under bfloat16 autocast (None: float32).
    ``cuda_graphs``: on CUDA, plain training steps replay as CUDA graphs (``step_graphs``);
    no effect elsewhere.
    ``batched_conv``: how the ``batched`` executor's vmapped forwards run per-client
    convolutions: 'grouped' (vmap's grouped convolutions) or 'gemm' (im2col and one batched
    GEMM, ``engine.conv_gemm``).
    ``optimizer``: the clients' optimizer and its settings (a phase may override them:
    ``Phase.settings_for``).
    """

    rounds: int = 10
    sample: float = 1.0
    clients_per_round: Optional[int] = None
    schedule: LocalSchedule = field(default_factory=LocalSchedule)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    eval_every: int = 1
    eval_role: Optional[str] = None
    seed: int = 0
    optimizer_state: str = "reset"
    executor: str = "threaded"
    workers: Optional[int] = None
    finetune_epochs: int = 0
    chunk_clients: Optional[int] = None
    autocast: Optional[str] = None
    threaded_hooks: bool = False
    cuda_graphs: bool = True
    batched_conv: str = "grouped"

    def __post_init__(self):
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        if not isinstance(self.optimizer, OptimizerSettings):
            raise ValueError(f"optimizer must be an OptimizerSettings, got {self.optimizer!r}")
        if self.optimizer_state not in ("reset", "keep"):
            raise ValueError(f"optimizer_state must be 'reset' or 'keep', got {self.optimizer_state!r}")
        if isinstance(self.sample, bool) or not isinstance(self.sample, (int, float)) or not 0 < self.sample <= 1:
            raise ValueError(f"sample must be a fraction in (0, 1], got {self.sample!r}")
        count = self.clients_per_round
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"clients_per_round must be None or an integer >= 1, got {count!r}")
        if self.autocast not in (None, "bf16"):
            raise ValueError(f"autocast must be None or 'bf16', got {self.autocast!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        check_conv_choice(self.batched_conv)
        epochs = self.finetune_epochs
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"finetune_epochs must be an integer >= 0, got {epochs!r}")


class Server:
    """What an algorithm's server side sees of the federation (its ``server`` attribute)."""

    def __init__(self, fed: "Federation"):
        self._fed = fed

    @property
    def num_clients(self) -> int:
        return self._fed.num_clients

    @property
    def round(self) -> int:
        """Rounds completed so far."""
        return self._fed.round

    @property
    def shared(self) -> tuple[str, ...]:
        """The groups clients may send (over every cohort, in layout order)."""
        return self._fed.shared_groups

    def train_sizes(self) -> torch.Tensor:
        """Each client's number of training samples, [K] float64."""
        return self._fed.train_sizes()

    @property
    def lr(self) -> float:
        """The run's client learning rate η (Fed-CMA's server averages move by λ·η, its Eq. 7)."""
        return float(self._fed.settings.optimizer.lr)

    def class_counts(self) -> torch.Tensor:
        """Each client's training samples per class, [K, C] float64, in the labels the clients'
        classifiers see (after their label maps): what a server knows of its clients' label
        distributions (Fed-CMA's p_i^k, FedGen's label weights)."""
        return self._fed.class_counts()

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one input example (e.g. (C, H, W))."""
        return tuple(self._fed.inputs.shape[1:])

    def generator(self, round_: int = -1) -> torch.Generator:
        """The algorithm's own random stream on the server for ``round_`` (-1: once per run), seeded
        by the run's seed (``engine.seeds``): a resumed run draws the same values (SimFed's
        criteria input, FedFomo's ε-greedy choice of the models each client downloads)."""
        return self._fed.generator("server", round_)

    def clients_with_role(self, role: str) -> torch.Tensor:
        """The clients of ``role`` in the scenario ([n] int64, ascending): the fda scenario's
        ``source`` and ``target``.  ValueError, naming the roles there are, if none has it."""
        if role not in self._fed.roles:
            there = ", ".join(sorted(self._fed.roles)) or "none: every client plays the same part"
            raise ValueError(f"no client has the role {role!r} in this scenario (roles: {there})")
        return torch.tensor(self._fed.roles[role], dtype=torch.int64)

    def segments(self, group: str) -> tuple:
        """The parameter tensors of ``group`` in its flat vector (``ClientView.segments``): of the
        first cohort holding it (a shared group has the same shapes in every cohort)."""
        cohort = next((c for c in self._fed.cohorts if group in c.groups.members), None)
        if cohort is None:
            raise KeyError(f"{group!r} is no parameter group of any client")
        return cohort.segments(group)

    def initial_model(self, groups: Optional[Sequence[str]] = None) -> dict[str, torch.Tensor]:
        """Copies of the initial values of ``groups`` (None: every shared group) and of the shared
        groups' floating buffers (``buffers``, if any): the first cohort holding each, first client."""
        model = {}
        for group in (self.shared if groups is None else groups):
            cohort = next(c for c in self._fed.cohorts if group in c.groups.members)
            model[group] = cohort.params.row(0)[cohort.span(group)].clone()
        first = self._fed.cohorts[0]
        buffers = first.buffers.row(0)[first.shared_buffer_span()]
        if buffers.numel():
            model[BUFFERS] = buffers.clone()
        return model

    def fresh_model(self, index: int) -> dict[str, torch.Tensor]:
        """Another initialization of the model, as :meth:`initial_model` gives it (shared groups
        and their buffers): a copy of the first cohort's model with every submodule that has a
        ``reset_parameters()`` (torch's layers, ``pfl_kernels.nn``'s) drawn again, from the run's
        seed and ``index`` (a resumed run draws the same).  IFCA's k cluster models."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be an integer >= 0, got {index!r}")
        cohort = self._fed.cohorts[0]
        work = cohort.work.copy()
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=self._fed.generator("server", -2, index)))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for module in work.module.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset) and not _required_arguments(reset):
                    reset()
        model = {group: work.params[cohort.span(group)].clone() for group in self.shared if group in cohort.groups.members}
        buffers = work.buffers[cohort.shared_buffer_span()]
        if buffers.numel():
            model[BUFFERS] = buffers.clone()
        return model


def _required_arguments(function) -> bool:
    """Whether ``function`` needs arguments (a layer whose ``reset_parameters`` does is kept as
    the copy has it; torch's layers and ``pfl_kernels.nn``'s need none)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return True
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in signature.parameters.values())


class Federation:
    """K clients, in cohorts by architecture, sharing the data on one device.

    Attributes:
        cohorts: one per architecture.  clients: each client's data split (on the device).
        comm: the ledger of bits sent up and down.  round: rounds completed.
        executor: where client tasks run.
        augment: None, or ``augment(batch, generator) -> batch`` applied to every training
            batch on the device, drawing from the task's generator.
    """

    def __init__(self, models: Union[nn.Module, Mapping[str, nn.Module]], inputs: torch.Tensor,
                 labels: torch.Tensor, clients: Sequence[ClientSplit], settings: EngineSettings, *,
                 architectures: Optional[Sequence[str]] = None, group_rules: Sequence[GroupRule] = (),
                 local_groups: Sequence[str] = (), client_state: Optional[Mapping[str, StateSpec]] = None,
                 device="cpu", augment=None, roles: Optional[Mapping[str, Sequence[int]]] = None):
        if not clients:
            raise ValueError("a federation needs at least one client")
        self.roles = {}
        for role, members in dict(roles or {}).items():
            ids = sorted(int(k) for k in members)
            if not ids or ids[0] < 0 or ids[-1] >= len(clients) or len(set(ids)) != len(ids):
                raise ValueError(f"role {role!r} must name distinct clients in [0, {len(clients)}), got {list(members)}")
            self.roles[role] = tuple(ids)
        if settings.eval_role is not None and settings.eval_role not in self.roles:
            raise ValueError(f"eval_role={settings.eval_role!r} names no role of this federation's clients "
                             f"(roles: {', '.join(sorted(self.roles)) or 'none'})")
        models = {"model": models} if isinstance(models, nn.Module) else dict(models)
        if architectures is None:
            if len(models) != 1:
                raise ValueError(f"several models {sorted(models)} need architectures (one name per client)")
            architectures = [next(iter(models))] * len(clients)
        if len(architectures) != len(clients):
            raise ValueError(f"architectures has {len(architectures)} entries for {len(clients)} clients")
        unknown = sorted(set(architectures) - set(models))
        if unknown:
            raise ValueError(f"architectures names models that were not given: {unknown}; given: {sorted(models)}")
        self.settings = settings
        self.augment = augment
        self.device = torch.device(device)
        self.step_graphs = StepGraphs(self.device, capture=settings.cuda_graphs)
        # Stored as the batches are trained (channels-last images on a CPU, the same values):
        # a batch gathered from it is already in that layout (0.06 ms for 64 CIFAR images
        # instead of 0.15 ms for a gather and a conversion).
        self.inputs = conv_layout(inputs.to(self.device))
        self.labels = labels.to(self.device)
        self.clients = [c.to(self.device) for c in clients]
        self.architectures = list(architectures)
        self.cohorts: list[Cohort] = []
        self._cohort_of: list[Cohort] = [None] * len(clients)
        for name in dict.fromkeys(architectures):  # in order of first client
            model = models[name]
            groups = declare_groups(model, group_rules, head=head_parameter_names(model), local=local_groups)
            members = [k for k, a in enumerate(architectures) if a == name]
            cohort = Cohort(name, model, members, groups, device=self.device, extra=client_state or {})
            self.cohorts.append(cohort)
            for k in members:
                self._cohort_of[k] = cohort
        self.shared_groups = tuple(dict.fromkeys(g for c in self.cohorts for g in c.groups.shared))
        self._check_shared_shapes()
        self._class_counts: Optional[torch.Tensor] = None
        self.comm = CommLedger()
        self.executor = make_executor(settings.executor, workers=settings.workers, device=str(self.device),
                                      chunk=settings.chunk_clients, threaded_hooks=settings.threaded_hooks)
        self.round = 0

    def _check_shared_shapes(self) -> None:
        for group in self.shared_groups:
            having = [c for c in self.cohorts if group in c.groups.members]
            for other in having[1:]:
                if other.group_shapes(group) != having[0].group_shapes(group):
                    raise ValueError(f"shared group {group!r} has shapes {having[0].group_shapes(group)} in "
                                     f"architecture {having[0].name!r} but {other.group_shapes(group)} in "
                                     f"{other.name!r}; a group the server combines must match (keep it local)")
        sizes = {c.name: c.shared_buffer_span().stop - c.shared_buffer_span().start for c in self.cohorts}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the shared groups' buffers differ between architectures ({sizes} values); "
                             "keep the groups that hold BatchNorm layers local")

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def cohort_of(self, client: int) -> Cohort:
        """The cohort of ``client``."""
        return self._cohort_of[client]

    def train_sizes(self) -> torch.Tensor:
        """Each client's number of training samples, [K] float64."""
        return torch.tensor([c.train.numel() for c in self.clients], dtype=torch.float64)

    def class_counts(self) -> torch.Tensor:
        """Each client's training samples per class, [K, C] float64 (C: the classifiers' width;
        labels after each client's label map, a sample mapped to -1 not counted)."""
        if self._class_counts is None:
            rows = []
            for client in self.clients:
                labels = self.labels[client.train]
                if client.label_map is not None:
                    labels = client.label_map[labels]
                rows.append(labels[labels >= 0].cpu())
            width = max([int(getattr(c.module, "num_classes", 0)) for c in self.cohorts]
                        + [int(r.max()) + 1 for r in rows if r.numel()] + [1])
            self._class_counts = torch.stack([torch.bincount(r, minlength=width).to(torch.float64) for r in rows])
        return self._class_counts.clone()

    def generator(self, stream: str, round_: int, client: int = -1) -> torch.Generator:
        """The generator of one stream ('sample', 'train', 'finetune') of a round and client."""
        return stream_generator(self.settings.seed, stream, round_, client)

    def sample_clients(self, round_: int) -> torch.Tensor:
        """The clients of round ``round_`` (sorted), drawn without replacement: ``clients_per_round``
        of them, or ``sample`` · K rounded half up (as the splits round), at least one."""
        k = self.num_clients
        count = self.settings.clients_per_round
        if count is None:
            # Half up, not Python's round to even (0.5 of 5 clients was 2, of 3 was 2).
            count = max(1, math.floor(self.settings.sample * k + 0.5))
        if count > k:
            raise ValueError(f"clients_per_round asks for {count} clients per round but there are {k}")
        if count == k:
            return torch.arange(k)
        return torch.randperm(k, generator=self.generator("sample", round_))[:count].sort().values

    def state_dict(self) -> dict:
        """Everything a resumed run needs of the federation (banks, kept optimizer state, ledger)."""
        return {"round": self.round, "comm": self.comm.state_dict(),
                "cohorts": {c.name: c.state_dict() for c in self.cohorts}}

    def load_state_dict(self, state: dict) -> None:
        if set(state["cohorts"]) != {c.name for c in self.cohorts}:
            raise ValueError(f"the checkpoint holds architectures {sorted(state['cohorts'])}, the run "
                             f"{sorted(c.name for c in self.cohorts)}")
        self.round = int(state["round"])
        self.comm.load_state_dict(state["comm"])
        for cohort in self.cohorts:
            cohort.load_state_dict(state["cohorts"][cohort.name])

    def close(self) -> None:
        """Release the executor's workers."""
        self.executor.close()

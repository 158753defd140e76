"""The public contract between the engine and the algorithms: the ``Algorithm`` base class and
every type a method file may use.

An algorithm module imports from here (and from sibling algorithm modules, ``torch`` and
``pfl_kernels``), never from ``pfl_algorithms.engine``: the engine's internals can then change,
and new executors can run every algorithm, without touching a method's file
(``tests/algorithms/algorithms/test_contract.py`` enforces it).

A method is a small class whose hooks say only what its paper says.

The engine owns state, messages, accounting, executors and checkpoints.  An algorithm says:

declarations
  ``Settings``        its hyperparameters: a frozen dataclass whose field types declare what
                      each admits (``mu: NonNegativeFloat = 0.01``); each is a --set key
  ``prepare_model``   the model it trains, from the run's (e.g. factorized layers)
  ``capabilities``    what it needs and allows (:class:`Capabilities`)
  ``group_rules``     parameter groups beyond the model's ``body`` and ``head``
  ``local_groups``    the groups that never leave a client
  ``client_state``    per-client state kept across rounds in banks (pFedMe's personal model, ...)
  ``check_config``    conflicts between its settings and the run's
server side
  ``setup(server)``   create server state (``server.initial_model()`` is the initial model)
  ``configure``       what the sampled clients receive: a Message for all, or one per client
  ``aggregate``       combine the round's :class:`Uploads` into new server state
  ``evaluation``      which model a client is evaluated with (a Message or an Evaluation)
  ``finetune_phase``  the run's fine-tuning before evaluation (what keeps its parameters valid)
  ``round_metrics``   its own numbers for the round's metrics line (FedDAF's α)
  ``state_dict``      server state for checkpoints
client side (run by an executor, wherever the client is)
  ``plan(client)``    the phases of local training
  ``upload(view)``    what the client sends back (None: nothing); a :class:`Statistic` request in
                      its extras is answered after training by the executor, for each sender
                      alone (Fed-CMA's :class:`ClassMeans`; a Statistic subclass computes its
                      kind from :class:`Senders`)

Client state, on the :class:`ClientView` every client hook gets (a loss term: ``batch.view``),
so that no hook reads what another left behind: ``view.state(name)`` across rounds (declared by
``client_state``, checkpointed); within a round's task, ``view.cached(name, compute)`` (computed
once, by whichever hook asks first) and ``view.report(name, value)`` (sent with the upload).
Fed-CMA's loss term and upload both take its fixed batch as ``view.cached("fixed_batch",
lambda: self._fixed_batch(view))``, drawn once a round; FedDAF's ``begin`` hook reports the α
and θ it finds, and its upload hook never reads them.

A gradient term or after-step hook that is tensor work on the view's parameters and gradients
alone can say so with ``capturable_hook(hook, key)``: its phase's steps may then replay as CUDA
graphs (Factorized-FL's and SimFed's L1 terms, pFedMB's projection of α).

Optimizers for server-side state (a generator, a hypernetwork): ``SGD`` and ``Adam`` (``AdamW``:
``Adam(decoupled=True)``), ``make_optimizer`` by name, torch.optim's rules over tensors whose
state is a plain dict of tensors (checkpointable as it is): the engine's own client optimizers.
``OptimizerSettings`` is an optimizer by name with its settings, checked (``build()`` gives it):
the run's client optimizer (``Server.lr`` is its lr), which a ``Phase`` overrides
(``Phase.settings_for``).

Model converters a ``prepare_model`` may apply: ``pfl_kernels.nn`` (``factorize``, ``multibranch``,
``fedpara``: FedPara's low-rank Hadamard layers, ``FEDPARA_LAYERS``), the last re-exported here.

Subclasses with a ``name`` register themselves in :data:`ALGORITHMS`; adding a method is one
file in ``pfl_algorithms/algorithms/``.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Mapping, Optional, Sequence, Union

import torch
from pfl_kernels.nn.fedpara import FEDPARA_LAYERS, fedpara

from .engine.client import ClientView, Evaluation
from .engine.cohort import StateSpec
from .engine.cohort_stats import Senders
from .engine.groups import BUFFERS, GroupRule
from .engine.messages import Message, Sparse, Statistic
from .engine.optim import SGD, Adam, OptimizerSettings, make_optimizer
from .engine.plan import Batch, Phase, capturable_hook, finetune_phase
from .engine.uploads import Uploads
from .models.base import head_parameter_names
from .option_types import (Fraction, NonNegativeFloat, NonNegativeInt, OneOf, PositiveFloat, PositiveInt, Range,
                           check_options, field_hints)
from .statistics import ClassMeans

__all__ = ["ALGORITHMS", "Adam", "Algorithm", "BUFFERS", "Batch", "Capabilities", "ClassMeans", "ClientView", "Evaluation", "Fraction",
           "FEDPARA_LAYERS", "GroupRule", "Message", "NoSettings", "NonNegativeFloat", "NonNegativeInt", "OneOf", "OptimizerSettings", "Phase",
           "PositiveFloat", "PositiveInt", "Range", "SGD", "Senders", "Sparse", "StateSpec", "Statistic", "Uploads",
           "algorithm_class", "capturable_hook", "fedpara", "head_parameter_names", "make_optimizer"]

ALGORITHMS: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """An algorithm without hyperparameters."""


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an algorithm needs and allows.

    Attributes:
        needs_validation: it reads the clients' validation splits (the run refuses split
            fractions without one).
        mixed_architectures: it can run clients of different architectures (it shares no
            group whose shapes differ between them).
        batchable: its client tasks can run stacked in one vmapped forward/backward (no
            custom gradient that steps clients one by one).
        roles: the client roles it needs from the scenario (FedDAF: ``source`` and
            ``target``, which the ``fda`` scenario gives); ``server.clients_with_role``.
        head: ``"shared"``: it shares the classifier head, so a run that keeps the head local
            (``--keep-head-local true``, or a scenario that keeps it local by default) is
            refused; ``"local"``: it keeps the head local by definition, so
            ``--keep-head-local false`` is refused; None: the run's setting decides.
        bounded_embeddings: its analysis assumes embeddings in [0, 1] (Fed-CMA's Assumption
            2): on one architecture, a model with an ``embedding_activation`` option takes
            'sigmoid' unless the run names one (``config.check`` makes it explicit, so
            config.json records it), as a mixed federation's models do by default.
    """

    needs_validation: bool = False
    mixed_architectures: bool = False
    batchable: bool = True
    roles: tuple[str, ...] = ()
    head: Optional[str] = None
    bounded_embeddings: bool = False

    def __post_init__(self):
        if self.head not in (None, "shared", "local"):
            raise ValueError(f"Capabilities.head must be None, 'shared' or 'local', got {self.head!r}")


def make_settings(cls, name: str, values: dict):
    """``cls(**values)``, with unknown names reported together with the valid ones and every
    value checked against its field's declared type and range (``option_types``: a field
    ``mu: NonNegativeFloat = 0.01`` admits finite numbers >= 0), a ValueError naming it."""
    hints = field_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"{name} has no setting {', '.join(map(repr, unknown))}; "
                         f"valid: {', '.join(sorted(hints)) or 'none'}")
    return cls(**check_options(name, values, hints))


class Algorithm:
    """Base class: every hook does the neutral thing, so a subclass states only its own rule.

    The defaults are the Local baseline: nothing is sent, each client trains every group
    with the run's optimizer and is evaluated with its own model.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Settings: ClassVar[type] = NoSettings
    capabilities: ClassVar[Capabilities] = Capabilities()
    # Local fine-tuning epochs before evaluation when the run gives no --finetune-epochs
    # (the engine runs it for every algorithm: ``plan.finetune_phase``).
    finetune_epochs: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name:
            old = ALGORITHMS.get(name)
            # The same class defined again (a notebook cell run twice, importlib.reload) replaces
            # itself; another class under a taken name is refused.
            if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"two algorithms are named {name!r}: {old.__module__}.{old.__qualname__} and "
                                 f"{cls.__module__}.{cls.__qualname__}")
            ALGORITHMS[name] = cls

    def __init__(self, **settings):
        self.settings = make_settings(self.Settings, self.name, settings)
        self.server = None  # set by the engine before setup()

    # ------------------------------------------------------------------ declarations

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model this algorithm trains, made from the run's freshly initialized ``model``
        (each cohort's template, once, before banks and groups exist): e.g. converted with
        ``pfl_kernels.nn.factorize``.  Runs under the run's seeded RNG, so it may draw."""
        return model

    def group_rules(self) -> Sequence[GroupRule]:
        """Parameter groups beyond the model's ``body`` and ``head`` (claimed first)."""
        return ()

    def local_groups(self, *, keep_head_local: bool) -> set[str]:
        """Groups that never leave a client: the head where the scenario asks for it."""
        return {"head"} if keep_head_local else set()

    def client_state(self) -> Mapping[str, StateSpec]:
        """Per-client state kept across rounds, by name (in banks, checkpointed; a client hook
        reads and writes it as ``view.state(name)``)."""
        return {}

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError for settings of the run that conflict with this algorithm."""

    @classmethod
    def split_step_budget(cls, budget: int) -> tuple[int, dict]:
        """(the run's ``local_steps``, algorithm settings) under which a round of this algorithm
        takes ``budget`` optimizer steps per client: how a comparison (``pfl demo``, ``pfl
        reproduce``'s CPU scale) gives every method the same budget.  The default runs the
        schedule once; a plan of several phases splits the budget over them (pFedMB, FedRep).
        Raises ValueError where the budget cannot be split."""
        return budget, {}

    @classmethod
    def optimizer_steps(cls, local_steps: int, settings: Mapping[str, object]) -> Optional[int]:
        """Optimizer steps per client and round at the run's ``local_steps`` and these algorithm
        ``settings`` (None where a phase counts epochs); the inverse of ``split_step_budget``."""
        return local_steps

    # ------------------------------------------------------------------ server side

    def setup(self, server) -> None:
        """Create server state once the federation exists."""

    def configure(self, round_: int, clients: torch.Tensor) -> Union[None, Message, Mapping[int, Message]]:
        """What the sampled ``clients`` receive: None, one Message for all, or one per client."""
        return None

    def aggregate(self, round_: int, uploads: Uploads) -> None:
        """Combine the round's uploads (clients whose update was not finite sent none)."""

    def evaluation(self, client: int) -> Union[None, Message, Evaluation]:
        """The model ``client`` is evaluated with: None, its own; a Message applied to a copy of
        its state; or an :class:`Evaluation` (with fine-tuning, or another state)."""
        return None

    def finetune_phase(self, client: int, epochs: int) -> Phase:
        """The run's fine-tuning before each evaluation (``--finetune-epochs``; pFedMB's tables
        fine-tune every method): ``epochs`` epochs of the run's optimizer, from fresh state, on
        the groups ``client`` trains in its plan, each parameter at the run's lr: the same
        protocol for every method.  A method adds what keeps its parameters valid (pFedMB
        projects α back onto the simplex after each step)."""
        return finetune_phase(self, client, epochs)

    def round_metrics(self, round_: int) -> Mapping[str, float]:
        """Numbers of this algorithm worth a line of ``metrics.jsonl`` after ``round_``'s
        aggregation (FedDAF's mixing weight α), under the key ``algorithm``; JSON values."""
        return {}

    def state_dict(self) -> dict:
        """Server state for checkpoints (tensors, numbers, strings, lists and dicts of them)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    # ------------------------------------------------------------------ client side

    def plan(self, client: int) -> Sequence[Phase]:
        """The phases of ``client``'s local training this round (default: one phase over every
        group with the run's optimizer and schedule)."""
        return (Phase(),)

    def upload(self, view: ClientView) -> Optional[Message]:
        """What the client sends after training (None: nothing)."""
        return None


def algorithm_class(name: str) -> type:
    """The registered algorithm ``name`` (ValueError listing the valid ones otherwise)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]

"""Local plans: what a client does with its data in a round, as a list of phases.

A :class:`Phase` names the parameter groups it trains, how long (epochs or steps), its
optimizer and learning rate with an optimizer state of its own (FedRep's head phase and body
phase never mix their momentum or Adam's bias correction), its extra loss terms and its
closed-form gradient terms.  The engine runs the phases in order on the client's bank rows.

Hooks an algorithm can give a phase:

* ``loss_terms``: ``term(batch) -> scalar`` added to the cross-entropy of each batch; a
  :class:`Batch` shows the inputs, labels, logits and the body's embeddings (Fed-CMA).
* ``grad_terms``: ``term(view) -> scalar or None`` adds a closed-form gradient to
  ``view.grads`` in place (FedProx's μ(w − w_global) is one op) and returns the loss it
  stands for, which is reported with the training loss.
* ``gradient`` (the escape hatch for MAML-style and inner-loop updates):
  ``gradient(view, batches) -> loss`` gets ``batches_per_step`` batches, leaves the
  step's gradient in ``view.grads`` (it may move ``view.params`` meanwhile, as long as it
  puts them back), and the engine's optimizer then takes the step.  Per-FedAvg and pFedMe
  are written this way.
* ``begin``: ``begin(view) -> None`` runs once on the client before the phase's first step
  (it may read the client's splits with ``view.evaluate`` and change ``view.params``):
  FedFomo's first-order combination of the downloaded models.
* ``after_step``: ``after_step(view) -> None`` runs after each optimizer step (it may change
  ``view.params`` in place): pFedMB's projection of α back onto the simplex.
* ``lr_scales``: learning rates per group or per parameter tensor, as multipliers of the
  phase's lr: a mapping ``name -> scale`` whose names are groups (every tensor of the group)
  or parameters (one tensor, as ``ClientView.segments`` names them; a parameter's own entry
  wins over its group's), or ``lr_scales(view) -> mapping``, called once per client after
  ``begin``, for rates that depend on the client's state (pFedMB's lr / ‖α_l‖² per layer).
  The optimizer applies them as its own per-parameter rate (``engine.optim``'s ``lr_scale``),
  so they hold under SGD, momentum and Adam alike, where scaling gradients would not.

A gradient term or after-step hook wrapped by :func:`capturable_hook` may run inside a step
replayed as a CUDA graph (``engine.step_graphs``); a phase with any other hook inside its steps
keeps its steps uncaptured.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional, Union

from torch import Tensor, nn

from .optim import OPTIMIZERS, OptimizerSettings

# What a phase's optimizer_settings may name (lr and the optimizer have fields of their own).
PHASE_SETTINGS = tuple(f.name for f in fields(OptimizerSettings) if f.name not in ("name", "lr"))


@dataclass
class Batch:
    """One training batch as a loss term sees it.

    Attributes:
        inputs, labels: the batch (labels as the client sees them, after its label map;
            inputs after augmentation).
        logits: the model's output.
        embeddings: the body's output (models with ``body`` and ``head``), else None.
        module: the client's working model; on the batched executor, a
            :class:`~pfl_algorithms.engine.batched.ClientModule` running the template on the
            client's rows (call it, its submodules or its methods, as a term calls a model).
        view: the client's :class:`~pfl_algorithms.engine.client.ClientView` (what it
            received, its state, ``cached`` values); None where a test builds a batch alone.
    """

    inputs: Tensor
    labels: Tensor
    logits: Tensor
    embeddings: Optional[Tensor]
    module: nn.Module
    view: Any = None


LossTerm = Callable[[Batch], Tensor]
GradTerm = Callable[[Any], Optional[Tensor]]
CustomGradient = Callable[[Any, list], Tensor]
Begin = Callable[[Any], None]
AfterStep = Callable[[Any], None]
LrScales = Union[Mapping[str, float], Callable[[Any], Mapping[str, float]]]


class CapturableHook:
    """A gradient term or after-step hook that a captured step may replay (:func:`capturable_hook`)."""

    def __init__(self, hook: Callable, key):
        self.hook, self.key = hook, key

    def __call__(self, view):
        return self.hook(view)


def capturable_hook(hook: Callable, key) -> CapturableHook:
    """``hook`` (a gradient term or an after-step hook), declared safe to capture in a CUDA graph:
    it works only on the view's parameters and gradients (``group``, ``grad``, ``parameter``,
    ``parameter_grad``) with tensor operations, reads nothing back to the host (no ``.item()``,
    no ``if`` on a tensor's value), and reads no other state (not ``view.step``, not the
    download): a replay re-runs its kernels on the same tensors, not its Python.  ``key`` (hashable)
    names what it computes: hooks with equal keys must do the same to the same view (the L1 term
    of one λ), so one captured step serves every client and round."""
    return CapturableHook(hook, key)


def run_grad_terms(terms, view):
    """Run gradient ``terms`` on ``view`` in order (each adds to its gradient in place); the sum
    of the losses they report (0.0 when none reports one)."""
    total = 0.0
    for term in terms:
        value = term(view)
        if value is not None:
            total = total + value
    return total


def _positive_or_none(name: str, value, *, allow_zero: bool) -> None:
    if value is None:
        return
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Phase {name} must be an int >= {low} or None, got {value!r}")


@dataclass(frozen=True)
class Phase:
    """One phase of a client's local plan.

    Attributes:
        groups: the parameter groups trained (None: every group); the others stay fixed.
        epochs / steps: how long (at most one of them; both None: the run's schedule).
        batch_size: None: the run's.
        optimizer: 'sgd' | 'adam' | 'adamw', None: the run's.  lr: None: the run's.
        lr_scale: multiplies that lr (pFedMB's shared α: the run's lr / L).
        lr_scales: multipliers of that lr per group or parameter tensor (module docstring).
        optimizer_settings: other settings of the optimizer (``OptimizerSettings``' momentum,
            weight_decay, betas, ...), replacing the run's where given; with another optimizer
            than the run's, the run's settings are not used.  ``settings_for`` merges them.
        state: the name of this phase's optimizer state (None: the phase's position in its
            plan, so phases never share state unless they name the same one).
        loss_terms, grad_terms, gradient, batches_per_step, begin, after_step, lr_scales: module
            docstring.
    """

    groups: Optional[tuple[str, ...]] = None
    epochs: Optional[int] = None
    steps: Optional[int] = None
    batch_size: Optional[int] = None
    optimizer: Optional[str] = None
    lr: Optional[float] = None
    lr_scale: float = 1.0
    optimizer_settings: Mapping[str, Any] = field(default_factory=dict)
    state: Optional[str] = None
    loss_terms: tuple[LossTerm, ...] = ()
    grad_terms: tuple[GradTerm, ...] = ()
    gradient: Optional[CustomGradient] = None
    batches_per_step: int = 1
    begin: Optional[Begin] = None
    after_step: Optional[AfterStep] = None
    lr_scales: Optional[LrScales] = None

    def __post_init__(self):
        if isinstance(self.groups, str):
            object.__setattr__(self, "groups", (self.groups,))
        if self.groups is not None:
            object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "loss_terms", tuple(self.loss_terms))
        object.__setattr__(self, "grad_terms", tuple(self.grad_terms))
        _positive_or_none("epochs", self.epochs, allow_zero=True)
        _positive_or_none("steps", self.steps, allow_zero=True)
        _positive_or_none("batch_size", self.batch_size, allow_zero=False)
        _positive_or_none("batches_per_step", self.batches_per_step, allow_zero=False)
        if self.epochs is not None and self.steps is not None:
            raise ValueError(f"Phase takes epochs or steps, not both (epochs={self.epochs}, steps={self.steps})")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Phase optimizer must be one of {', '.join(OPTIMIZERS)} or None, got {self.optimizer!r}")
        unknown = sorted(set(self.optimizer_settings) - set(PHASE_SETTINGS))
        if unknown:
            raise ValueError(f"Phase optimizer_settings has no setting {unknown}; valid: {', '.join(PHASE_SETTINGS)} "
                             "(the lr and the optimizer are Phase fields)")
        object.__setattr__(self, "optimizer_settings", dict(self.optimizer_settings))
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and self.lr >= 0):
            raise ValueError(f"Phase lr must be a number >= 0 or None, got {self.lr!r}")
        if not (isinstance(self.lr_scale, (int, float)) and self.lr_scale > 0):
            raise ValueError(f"Phase lr_scale must be a number > 0, got {self.lr_scale!r}")
        if isinstance(self.lr_scales, Mapping):
            object.__setattr__(self, "lr_scales", dict(self.lr_scales))
            check_lr_scales(self.lr_scales)
        elif self.lr_scales is not None and not callable(self.lr_scales):
            raise ValueError(f"Phase lr_scales must be a mapping, a function of the client's view or None, "
                             f"got {self.lr_scales!r}")
        if self.batches_per_step != 1 and self.gradient is None:
            raise ValueError("batches_per_step needs a custom gradient (one batch per step otherwise)")

    def settings_for(self, run: OptimizerSettings) -> OptimizerSettings:
        """This phase's optimizer settings, given the run's: its ``optimizer`` (another than the
        run's keeps only the run's lr, the rest at their defaults), then its ``lr`` in place of
        that lr, its ``optimizer_settings`` in place of those they name, and the lr times
        ``lr_scale`` (its ``lr_scales`` apply per element, in the step: ``engine.optim``)."""
        name = run.name if self.optimizer is None else self.optimizer
        values = run.settings() if name == run.name else {"lr": run.lr}
        if self.lr is not None:
            values["lr"] = self.lr
        values.update(self.optimizer_settings)
        values["lr"] = values["lr"] * self.lr_scale
        return OptimizerSettings(name, **values)


def check_lr_scales(scales: Mapping[str, float]) -> None:
    """ValueError unless every scale of a phase's ``lr_scales`` is a number > 0 named by a string
    (a NaN passes: computed from a diverged client's state, it makes that client non-finite, and
    the engine drops it as it drops any diverged client)."""
    for name, scale in scales.items():
        if not isinstance(name, str) or isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"Phase lr_scales maps group or parameter names to numbers > 0, got {name!r}: {scale!r}")


def state_names(plan) -> list[str]:
    """The optimizer-state name of each phase of ``plan`` (its own, or ``phase<i>``)."""
    return [phase.state if phase.state is not None else f"phase{i}" for i, phase in enumerate(plan)]


def finetune_phase(algorithm, client: int, epochs: int) -> Phase:
    """Local fine-tuning before evaluation, for every algorithm (pFedMB's tables fine-tune every
    method): ``epochs`` epochs of the run's optimizer, from fresh state, on the groups the
    client trains in its local plan (every group if a phase trains every group), each parameter
    at the run's lr.  The default of ``Algorithm.finetune_phase`` (pFedMB adds its projection)."""
    groups: Optional[set] = set()
    for phase in algorithm.plan(client):
        if phase.groups is None:
            groups = None
            break
        groups.update(phase.groups)
    return Phase(epochs=epochs, groups=None if groups is None else tuple(sorted(groups)), state="finetune")

"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020): FedAvg of a MAML objective.

Each local step draws batches D, D' (and D'' for the Hessian-free variant) and moves w by

    w ← w − β (I − α ∇²f(w; D'')) ∇f(w − α ∇f(w; D); D')        (Eq. 8; HF)
    w ← w − β ∇f(w − α ∇f(w; D); D')                             (first order, FO)

with α the inner step (``alpha``, plain gradient descent) and the outer step taken by the
run's optimizer at its learning rate β (as every method's local step is; plain SGD, as in the
paper, with ``--momentum 0``).
The Hessian-vector product is exact (double backward through the model) or, with
``hvp='finite-difference'``, the paper's estimate (∇f(w + δg; D'') − ∇f(w − δg; D''))/(2δ).
A client is evaluated after one step of SGD at lr α from the global model on its own data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from ..api import Capabilities, Evaluation, Message, OneOf, Phase, PositiveFloat
from .fedavg import FedAvg

PLAIN_SGD = {"momentum": 0.0}


@dataclass(frozen=True)
class PerFedAvgSettings:
    alpha: PositiveFloat = 0.01  # the inner (adaptation) step
    variant: Annotated[str, OneOf(("fo", "hf"))] = "fo"  # first order or Hessian-free
    hvp: Annotated[str, OneOf(("exact", "finite-difference"))] = "exact"  # for 'hf'
    delta: PositiveFloat = 1e-3  # the finite difference's step


def finite_difference_hvp(view, inputs, labels, vector, delta: float) -> torch.Tensor:
    """(∇f(w + δv) − ∇f(w − δv)) / (2δ) on one batch: the paper's Hessian-vector estimate."""
    start = view.params.clone()
    with torch.no_grad():
        view.params.add_(vector, alpha=delta)
    view.forward_backward(inputs, labels)
    plus = view.grads.clone()
    with torch.no_grad():
        view.params.copy_(start).add_(vector, alpha=-delta)
    view.forward_backward(inputs, labels)
    with torch.no_grad():
        view.params.copy_(start)
    return (plus - view.grads) / (2 * delta)


def maml_gradient(settings: PerFedAvgSettings):
    """The custom gradient of one Per-FedAvg step (module docstring) for the engine's SGD step."""
    alpha = settings.alpha

    def gradient(view, batches):
        (x, y), (x2, y2), *rest = batches
        start = view.params.clone()
        view.forward_backward(x, y)
        with torch.no_grad():
            view.params.sub_(view.grads, alpha=alpha)
        loss = view.forward_backward(x2, y2)
        with torch.no_grad():
            view.params.copy_(start)
        if settings.variant == "hf":
            (x3, y3), g = rest[0], view.grads.clone()
            if settings.hvp == "exact":
                hv = view.hvp(x3, y3, g)
            else:
                hv = finite_difference_hvp(view, x3, y3, g, settings.delta)
            view.grads.copy_(g - alpha * hv)
        return loss

    return gradient


class PerFedAvg(FedAvg):
    """FedAvg of the MAML objective; personalized by one local step before evaluation."""

    name = "per-fedavg"
    description = "FedAvg of a MAML objective (first-order or Hessian-free); one local step to personalize"
    Settings = PerFedAvgSettings
    capabilities = Capabilities(batchable=False)

    def plan(self, client):
        steps = 3 if self.settings.variant == "hf" else 2
        return (Phase(gradient=maml_gradient(self.settings), batches_per_step=steps),)

    def evaluation(self, client):
        adapt = Phase(steps=1, optimizer="sgd", lr=self.settings.alpha, optimizer_settings=PLAIN_SGD)
        return Evaluation(Message(self.global_model), plan=(adapt,))

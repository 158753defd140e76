"""FedProx (Li et al., 2020): FedAvg whose local objective adds (μ/2)‖w − w_global‖² over what
the client received; its gradient μ(w − w_global) is added to the flat gradient in one op."""
from __future__ import annotations

from dataclasses import dataclass

from ..api import NonNegativeFloat, Phase
from .fedavg import FedAvg


@dataclass(frozen=True)
class FedProxSettings:
    mu: NonNegativeFloat = 0.01  # weight of the proximal term


def proximal_term(mu: float, anchor=None):
    """The gradient term of (μ/2)‖w − a‖², a the anchor: ``anchor(view) -> {group: tensor}``,
    by default the groups the client received (FedProx's global model; FedAMP's cloud model)."""
    def proximal(view):
        targets = anchor(view) if anchor is not None else {g: view.download.dense(g) for g in view.received()}
        total = 0.0
        for group, target in targets.items():
            diff = view.group(group) - target
            view.grad(group).add_(diff, alpha=mu)
            total = total + diff.square().sum()
        return 0.5 * mu * total

    return proximal


class FedProx(FedAvg):
    """FedAvg with a proximal term to the global model in the local objective."""

    name = "fedprox"
    description = "FedAvg with a proximal term (mu/2)||w - w_global||^2 in the local objective"
    Settings = FedProxSettings

    def plan(self, client):
        return (Phase(grad_terms=(proximal_term(self.settings.mu),)),)

"""FedProx (Li et al., 2020): FedAvg whose local objective adds (μ/2)‖w − w_global‖² on the
shared parameters.  Its gradient μ(w − w_global) is added to the flat gradient in one op."""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.federation import Federation
from ..option_types import NonNegativeFloat
from .fedavg import FedAvg


@dataclass(frozen=True)
class FedProxSettings:
    mu: NonNegativeFloat = 0.01  # weight of the proximal term


class FedProx(FedAvg):
    """FedAvg with a proximal term to the global model in the local objective."""

    name = "fedprox"
    description = "FedAvg with a proximal term (mu/2)||w - w_global||^2 in the local objective"
    Settings = FedProxSettings

    def local_terms(self, fed: Federation, client: int) -> dict:
        anchor, span, mu = self.global_params, fed.shared, self.settings.mu

        def proximal(params, grads):
            diff = params[span] - anchor
            grads[span].add_(diff, alpha=mu)
            return 0.5 * mu * diff.square().sum()

        return {"grad_terms": [proximal]}

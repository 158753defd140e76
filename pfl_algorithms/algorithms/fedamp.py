"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei and Zhang, AAAI 2021, "Personalized Cross-Silo
Federated Learning on Non-IID Data", Algorithm 1 with the attention function
A(‖w_i − w_j‖²) = 1 − exp(−‖w_i − w_j‖²/σ)).

Each client keeps its personalized model w_i.  The server keeps the last one each client
uploaded and, for every sampled client, builds its personalized cloud model by one step of
attentive message passing (Eq. 6–7):

    ξ_ij = α_k · A'(‖w_i − w_j‖²) = α_k · exp(−‖w_i − w_j‖²/σ) / σ      (j ≠ i)
    ξ_ii = 1 − Σ_{j≠i} ξ_ij
    u_i  = Σ_j ξ_ij · w_j = (1 − Σ_{j≠i} ξ_ij)·w_i + Σ_{j≠i} ξ_ij·w_j

with the squared distances from ``pairwise_sqdist`` and every sampled client's u_i from one
``weighted_average`` over the bank of stored models.  The client receives u_i (one model
down) and trains its own w_i on

    F_i(w) + (λ / 2α_k) · ‖w − u_i‖²                                   (Eq. 8)

from its current w_i (its gradient (λ/α_k)(w − u_i) is one op), then uploads w_i.

Choices the paper leaves open, stated: the sum runs over the clients that have uploaded at
least once (before that a client's stored model is only the initialization, which says nothing
about its data), so in the first round u_i = w_i; when Σ_{j≠i} ξ_ij would exceed 1 (α_k too
large for the distances), the off-diagonal weights are scaled to sum to 1, so u_i stays a
convex combination.  The model is the shared parameter groups (not BatchNorm statistics,
which stay with the client); a local head stays local.  Defaults are the widely used PFLlib
implementation's: α_k = 1, σ = 1, λ = 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pfl_kernels.ops import pairwise_sqdist, weighted_average

from ..api import BUFFERS, Algorithm, Capabilities, Message, NonNegativeFloat, Phase, PositiveFloat
from .fedprox import proximal_term


@dataclass(frozen=True)
class FedAMPSettings:
    alpha_k: PositiveFloat = 1.0  # α_k, the step size of the attentive message passing
    sigma: PositiveFloat = 1.0  # σ of A(x) = 1 − exp(−x/σ)
    lamda: NonNegativeFloat = 1.0  # λ: the proximal weight is λ/α_k


def attention_weights(sqdist: torch.Tensor, rows: torch.Tensor, available: torch.Tensor, alpha_k: float,
                      sigma: float) -> torch.Tensor:
    """[M, K] ξ for the M clients ``rows`` (their indices among K) from their squared distances
    [M, K] to every stored model: α_k·exp(−d/σ)/σ to each other available client, scaled to sum
    to 1 where it exceeds 1, and the rest 1 − Σ on the client itself."""
    m = torch.arange(len(rows))
    xi = alpha_k * torch.exp(-sqdist.double() / sigma) / sigma
    xi = torch.where(available[None, :], xi, torch.zeros_like(xi))
    xi[m, rows] = 0.0
    off = xi.sum(1, keepdim=True)
    xi = torch.where(off > 1, xi / off, xi)
    xi[m, rows] = 1.0 - xi.sum(1)
    return xi


def cloud_model(view) -> dict:
    """The cloud model u_i the client received, by group (the anchor of its proximal term)."""
    return view.download.extras["cloud"]


class FedAMP(Algorithm):
    """Each client is pulled towards its own attention-weighted mix of similar clients' models."""

    name = "fedamp"
    description = "personalized cloud models by attentive message passing (xi ~ exp(-||wi-wj||^2/sigma)), proximal to them"
    Settings = FedAMPSettings
    capabilities = Capabilities()

    def setup(self, server) -> None:
        initial = server.initial_model()
        self.groups = [g for g in initial if g != BUFFERS]
        self.sizes = [initial[g].numel() for g in self.groups]
        flat = torch.cat([initial[g] for g in self.groups])
        self.models = flat[None].repeat(server.num_clients, 1)  # [K, P]: each client's last upload
        self.uploaded = torch.zeros(server.num_clients, dtype=torch.bool)

    def cloud_models(self, clients: torch.Tensor) -> torch.Tensor:
        """[M, P]: u_i of each of ``clients`` (Eq. 6–7), one ``weighted_average``."""
        available = self.uploaded.clone()
        available[clients] = True  # a client's own stored model is always its w_i
        sqdist = pairwise_sqdist(self.models[clients], self.models)
        xi = attention_weights(sqdist, clients, available, self.settings.alpha_k, self.settings.sigma)
        return weighted_average(xi.to(self.models.dtype), self.models)

    def configure(self, round_, clients):
        clouds = self.cloud_models(clients)
        return {int(c): Message(extras={"cloud": dict(zip(self.groups, u.split(self.sizes)))})
                for c, u in zip(clients, clouds)}

    def plan(self, client):
        return (Phase(grad_terms=(proximal_term(self.settings.lamda / self.settings.alpha_k, cloud_model),)),)

    def upload(self, view):
        return view.message(self.groups)

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        self.models[uploads.clients] = uploads.concat(self.groups).to(self.models.dtype)
        self.uploaded[uploads.clients] = True

    def state_dict(self) -> dict:
        return {"models": self.models, "uploaded": self.uploaded}

    def load_state_dict(self, state: dict) -> None:
        self.models = state["models"].clone()
        self.uploaded = state["uploaded"].clone()

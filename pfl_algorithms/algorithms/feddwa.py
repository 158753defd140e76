"""FedDWA (Liu, Wu, Chen, Hu, Zhou and Wu, IJCAI 2023, "FedDWA: Personalized Federated Learning
with Dynamic Weight Adjustment"; released code Sherrylife/FedDWA).

Each client i trains its model w_i from the personalized model the server last made for it,
then trains on from w_i once more to get its guidance model ŵ_i (the paper's "one-step ahead
adaptation"; in the released code ``train_one_step``: one more pass of the same local
training, ``next_round`` = 1), keeps w_i as its model and uploads both.  The server wants each
personalized model w̄_i = Σ_j p_ij·w_j, a mix of the round's models, close to ŵ_i; the weights
it uses, as the released code computes them (``cal_optimal_weight``), are

    p_ij = ‖ŵ_i − w_j‖⁻² / Σ_k ‖ŵ_i − w_k‖⁻²

of which it keeps each client's ``top_k`` largest (5, the released code's default) and
renormalizes them to sum to 1.  Only the paper's abstract (arXiv 2305.06124) was available to
us: it states the objective (personalized models as close as possible to guidance models
obtained by one-step-ahead local adaptation, computed by the server from the uploaded models),
which this closed form solves; the formula itself is checked against the released code only.
The squared distances of every guidance model to every model
come from one ``pairwise_sqdist`` (in float64, centred on the models' mean, since ŵ_i and w_i
are near-duplicates), every w̄_i from one ``weighted_average``.  A model equal to a guidance
model (distance 0) takes all of its weight, the limit of the rule.  The weights run over the
clients that uploaded this round, as in the released code.  Client i receives w̄_i when it is
next sampled and is evaluated with it (the released code evaluates the personalized model);
before its first upload a client has only its own model.  Only parameters travel: the
released code mixes ``named_parameters``, so each client keeps its BatchNorm statistics (they
also keep the guidance pass's updates, which the released code undoes).

In the ``fda`` scenario FedDWA runs as the PFL method it is: every client, sources and target
alike, gets a personalized model; the target is the client whose accuracy the run's summary
reports, and it trains (both passes) with ``target_lr`` / ``target_batch_size`` /
``target_epochs`` where given.  The roles are not needed, so FedDWA runs in every scenario.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from pfl_kernels.ops import pairwise_sqdist, weighted_average

from ..api import BUFFERS, Algorithm, Capabilities, Evaluation, Message, Phase, PositiveInt, StateSpec
from .target_only import TargetTraining, target_phase, the_target


@dataclass(frozen=True)
class FedDWASettings(TargetTraining):
    top_k: PositiveInt = 5  # K: the largest weights each client keeps


def dwa_weights(guidance: torch.Tensor, models: torch.Tensor, top_k: int) -> torch.Tensor:
    """[M, M] FedDWA weights p_ij ∝ ‖ŵ_i − w_j‖⁻², the ``top_k`` largest of each row kept and
    renormalized to sum to 1 (float64); a zero distance takes its row's whole weight (shared
    equally among zero distances).

    Args:
        guidance: [M, P] the guidance models ŵ_i; models: [M, P] the models w_j.
    """
    center = models.double().mean(0)
    sqdist = pairwise_sqdist(guidance.double() - center, models.double() - center)
    zero = sqdist == 0
    inverse = torch.where(zero, torch.zeros_like(sqdist), 1.0 / sqdist.clamp_min(torch.finfo(sqdist.dtype).tiny))
    inverse = torch.where(zero.any(1, keepdim=True), zero.double(), inverse)
    k = min(top_k, inverse.shape[1])
    kept = torch.zeros_like(inverse).scatter_(1, inverse.topk(k, dim=1).indices, 1.0)
    inverse = inverse * kept
    return inverse / inverse.sum(1, keepdim=True)


def keep_trained(view) -> None:
    """Before the guidance pass: keep w_i (the client's model) aside."""
    view.state("trained").copy_(view.params)


class FedDWA(Algorithm):
    """Personalized models mixed by the inverse squared distance to each client's guidance model."""

    name = "feddwa"
    description = "personalized mixes p_ij ~ ||guidance_i - w_j||^-2 (top-K) of the clients' models"
    Settings = FedDWASettings
    capabilities = Capabilities()

    def client_state(self):
        return {"trained": StateSpec()}  # w_i while the guidance pass runs

    def setup(self, server) -> None:
        self.target: Optional[int] = the_target(server, self.name, required=False)
        if self.target is None and self.settings.given():
            raise ValueError(f"{self.name}: {', '.join(self.settings.given())} need a target client "
                             f"(the fda scenario)")
        initial = server.initial_model()
        self.groups = [g for g in initial if g != BUFFERS]
        self.sizes = [initial[g].numel() for g in self.groups]
        flat = torch.cat([initial[g] for g in self.groups])
        self.personal = flat[None].repeat(server.num_clients, 1)  # [K, P]: each client's w̄_i
        self.personalized = torch.zeros(server.num_clients, dtype=torch.bool)

    def _personal_message(self, client: int) -> Message:
        return Message(dict(zip(self.groups, self.personal[client].split(self.sizes))))

    def configure(self, round_, clients):
        return {int(c): self._personal_message(int(c)) if self.personalized[c] else None for c in clients}

    def plan(self, client):
        """Local training, then the guidance pass: the same training again from w_i."""
        local = target_phase(self.settings) if client == self.target else Phase()
        return (local, replace(local, begin=keep_trained))

    def upload(self, view):
        """w_i with ŵ_i as an extra; the client's model goes back to w_i (the guidance pass is a
        look-ahead, as in the released code)."""
        guidance = {g: view.group(g).clone() for g in self.groups}
        with torch.no_grad():
            view.params.copy_(view.state("trained"))
        return Message({g: view.group(g).clone() for g in self.groups}, {"guidance": guidance}, view.num_examples)

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        models = uploads.concat(self.groups)
        guidance = torch.cat([torch.stack([m[g] for m in uploads.extras("guidance")]) for g in self.groups], dim=1)
        weights = dwa_weights(guidance, models, self.settings.top_k)
        self.personal[uploads.clients] = weighted_average(weights.to(models.dtype), models).to(self.personal.dtype)
        self.personalized[uploads.clients] = True

    def evaluation(self, client):
        return Evaluation(self._personal_message(client)) if self.personalized[client] else None

    def state_dict(self) -> dict:
        return {"personal": self.personal, "personalized": self.personalized}

    def load_state_dict(self, state: dict) -> None:
        self.personal = state["personal"].clone()
        self.personalized = state["personalized"].clone()

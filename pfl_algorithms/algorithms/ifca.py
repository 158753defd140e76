"""IFCA (Ghosh, Chung, Yin and Ramchandran, NeurIPS 2020, "An Efficient Framework for Clustered
Federated Learning", Algorithm 1 with model averaging).

The server keeps k cluster models θ_1 … θ_k, drawn from k different random initializations
(the first is the run's initial model, the others ``server.fresh_model``).  Each round every
sampled client downloads all k models (k models counted down), estimates its cluster identity

    ĵ = argmin_j F_i(θ_j)          (F_i: the mean loss on the client's training data)

(ties to the lowest j), trains θ_ĵ locally, and uploads the trained model with ĵ.  The server
averages within each cluster,

    θ_j ← Σ_{i∈S_j} θ̃_i / |S_j|   (S_j: this round's senders that chose j)

unweighted as in the paper's Algorithm 1 (``weighting='examples'`` weights by n_i as FedAvg
does); a cluster that nobody chose keeps its model.  All k averages are one
``weighted_average`` over the round's uploads.

A client is evaluated as IFCA infers at test time: with the cluster model of lowest loss on its
training data, picked from the current k models (then fine-tuned where the run asks for it).
The models carry the shared groups and their BatchNorm statistics; a local head stays with
its client.  Default k = 2, the paper's setting for its CIFAR-10 experiment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from pfl_kernels.ops import weighted_average

from ..api import BUFFERS, Algorithm, Capabilities, Evaluation, Message, OneOf, Phase, PositiveInt, StateSpec


@dataclass(frozen=True)
class IFCASettings:
    clusters: PositiveInt = 2  # k, the number of cluster models
    weighting: Annotated[str, OneOf(("uniform", "examples"))] = "uniform"  # the paper's mean, or FedAvg's n_i


def lowest_loss(losses: torch.Tensor) -> int:
    """ĵ = argmin_j losses[j], the lowest index among ties; a NaN loss (a diverged model, or no
    training data) is never chosen unless every loss is NaN (then 0)."""
    finite = torch.where(torch.isnan(losses), torch.full_like(losses, float("inf")), losses)
    return int(torch.argmin(finite))  # argmin returns the first of equal minima


def cluster_weights(chosen: torch.Tensor, sizes: torch.Tensor, clusters: int, weighting: str) -> torch.Tensor:
    """[k, M]: each sender's weight in its cluster's average (1/|S_j|, or n_i/Σ n), 0 elsewhere."""
    weights = torch.zeros(clusters, len(chosen), dtype=torch.float64)
    weights[chosen, torch.arange(len(chosen))] = sizes if weighting == "examples" else 1.0
    total = weights.sum(1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(1e-300), weights)


def choose_cluster(view) -> None:
    """The client's cluster estimate: load each downloaded model, score it on the training
    data, keep the best one loaded and record its index in the state ``cluster``."""
    models = view.download.extras["models"]
    groups = [g for g in models if g != BUFFERS]
    losses = []
    with torch.no_grad():
        for j in range(int(models[groups[0]].shape[0])):
            load_model(view, models, j)
            losses.append(view.evaluate("train")[1])
        best = lowest_loss(torch.tensor(losses, dtype=torch.float64))
        load_model(view, models, best)
    view.state("cluster").fill_(best)


def load_model(view, models: dict, j: int) -> None:
    """Write model ``j`` of a download's stacked ``models`` ({group or ``buffers``: [m, ...]})
    into the client's working model: IFCA's cluster models, FedFomo's downloaded models."""
    for group, bank in models.items():
        target = view.shared_buffers() if group == BUFFERS else view.group(group)
        target.copy_(bank[j])


class IFCA(Algorithm):
    """k cluster models; each client trains the one with its lowest training loss."""

    name = "ifca"
    description = "k cluster models; each client trains the one of lowest loss on its data, averaged per cluster"
    Settings = IFCASettings
    capabilities = Capabilities()

    def client_state(self):
        return {"cluster": StateSpec(shape=(1,), dtype=torch.int64)}

    def setup(self, server) -> None:
        initial = server.initial_model()
        draws = [initial] + [server.fresh_model(j) for j in range(1, self.settings.clusters)]
        self.groups = [g for g in initial if g != BUFFERS]
        self.models = {name: torch.stack([d[name] for d in draws]) for name in initial}  # [k, P] per name

    def all_models(self) -> Message:
        """All k cluster models, as a download's extras (the engine counts k models)."""
        return Message(extras={"models": {name: bank.clone() for name, bank in self.models.items()}})

    def configure(self, round_, clients):
        return self.all_models()

    def plan(self, client):
        return (Phase(begin=choose_cluster),)

    def upload(self, view):
        return view.message(self.groups, extras={"cluster": view.state("cluster").clone()})

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        chosen = torch.cat(uploads.extras("cluster")).long()
        weights = cluster_weights(chosen, uploads.num_examples, self.settings.clusters, self.settings.weighting)
        received = weights.sum(1) > 0
        for name, bank in self.models.items():
            average = weighted_average(weights, uploads.stack(name).to(bank.dtype))
            bank[received] = average[received]

    def evaluation(self, client):
        """The cluster model of lowest training loss, chosen on the client (IFCA's inference)."""
        return Evaluation(download=self.all_models(), plan=(Phase(epochs=0, begin=choose_cluster),))

    def state_dict(self) -> dict:
        return {"models": self.models}

    def load_state_dict(self, state: dict) -> None:
        self.models = {name: t.clone() for name, t in state["models"].items()}

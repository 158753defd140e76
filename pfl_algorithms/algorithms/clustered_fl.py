"""Clustered Federated Learning (Sattler, Müller and Samek, IEEE TNNLS 2020, "Clustered Federated
Learning: Model-Agnostic Distributed Multi-Task Optimization under Privacy Constraints").

The server keeps a partition of the clients into clusters (all clients in one at the start) and
one model θ_c per cluster.  Each round a client downloads its cluster's model, trains, and
uploads; its update is Δθ_i = θ_i − θ_c.  Each cluster c is then checked:

    ‖Σ_{i∈c} (n_i/n_c) Δθ_i‖ < ε1     the cluster is near a stationary point of its joint objective
    max_{i∈c} ‖Δθ_i‖ > ε2             but some client is still far from a stationary point of its own

and, when both hold (and, as in the released code, the cluster has more than two clients and
the warm-up rounds are over), it is bipartitioned by the cosine similarities α_ij of its
clients' updates (``pairwise_cosine`` on the [K, P] update bank), with the paper's optimal
bipartition

    c1, c2 = argmin_{c1 ∪ c2 = c} max_{i∈c1, j∈c2} α_ij

(its "optimal bipartition" algorithm merges clients in order of decreasing similarity until two
groups remain: single linkage, which attains that minimum).  ``linkage='complete'`` is the
released code's ``AgglomerativeClustering(linkage='complete')`` on −α instead.  Both halves
start from θ_c.  Each cluster's new model is FedAvg of its members' updates,
θ_c ← θ_c + Σ_{i∈c} (n_i/n_c) Δθ_i (the released code takes the unweighted mean; the paper
weights by data size).  The paper's extra check of the split (the cross-cluster gap γ_max
against each client's gradient noise) needs per-client noise estimates it does not give a
protocol for; the released code omits it, and so does this file.

A cluster is split only when all its members sent an update this round (always, with every
client participating, as in both papers' tables).  Updates and similarities are over the
shared parameters (not the BatchNorm statistics, which are averaged within a cluster like the
parameters).  Clients are evaluated with their cluster's model.

Defaults, from the released code (``clustered_federated_learning.ipynb``): ε1 = 0.4, ε2 = 1.6,
no split before round 20 and none of a cluster of two or fewer clients.  ε1 and ε2 compare
norms of updates, so they depend on the learning rate and the local steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from pfl_kernels.ops import pairwise_cosine, weighted_average

from ..api import BUFFERS, Algorithm, Evaluation, Message, NonNegativeFloat, NonNegativeInt, OneOf, PositiveInt


@dataclass(frozen=True)
class ClusteredFLSettings:
    eps1: NonNegativeFloat = 0.4  # split only when the cluster's mean update norm is below
    eps2: NonNegativeFloat = 1.6  # ... and its largest client update norm is above
    warmup_rounds: NonNegativeInt = 20  # no split before this round (the code's c_round > 20)
    min_split_size: PositiveInt = 3  # clusters smaller than this are never split (the code's len > 2)
    linkage: Annotated[str, OneOf(("single", "complete"))] = "single"  # the paper's optimum, or the code's


def bipartition(similarity: torch.Tensor, linkage: str = "single") -> torch.Tensor:
    """Two groups of the n ≥ 2 rows of a [n, n] similarity matrix, by agglomerative clustering:
    repeatedly merge the two groups whose linkage similarity is highest (single: their most
    similar pair; complete: their least similar pair; ties to the lowest indices) until two
    remain.  Returns a [n] bool mask, True for the group that does not hold row 0."""
    n = similarity.shape[0]
    groups = [[i] for i in range(n)]
    reduce = torch.amax if linkage == "single" else torch.amin
    while len(groups) > 2:
        best, pair = None, None
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                value = float(reduce(similarity[groups[a]][:, groups[b]]))
                if best is None or value > best:
                    best, pair = value, (a, b)
        a, b = pair
        groups[a] = groups[a] + groups.pop(b)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[groups[1] if 0 in groups[0] else groups[0]] = True
    return mask


def split_decisions(updates: torch.Tensor, weights: torch.Tensor, cluster: torch.Tensor, settings,
                    eligible: torch.Tensor) -> torch.Tensor:
    """Which clusters to split: [C] bool from the senders' updates [M, P], their FedAvg weights
    within their cluster [C, M], the sender's cluster [M], and the clusters allowed to split [C]."""
    mean_norm = torch.linalg.vector_norm(weighted_average(weights, updates).double(), dim=1)
    norms = torch.linalg.vector_norm(updates.double(), dim=1)
    max_norm = torch.zeros(len(weights), dtype=torch.float64).scatter_reduce(0, cluster, norms, "amax")
    return eligible & (mean_norm < settings.eps1) & (max_norm > settings.eps2)


class ClusteredFL(Algorithm):
    """FedAvg within clusters that split in two when their clients' updates disagree."""

    name = "clustered-fl"
    description = "FedAvg within clusters; a cluster splits by the cosine of its updates when it stalls (eps1/eps2)"
    Settings = ClusteredFLSettings

    def setup(self, server) -> None:
        initial = server.initial_model()
        self.groups = [g for g in initial if g != BUFFERS]
        self.models = {name: t[None].clone() for name, t in initial.items()}  # [C, P] per name
        self.cluster_of = torch.zeros(server.num_clients, dtype=torch.int64)

    def model_of(self, cluster: int) -> Message:
        return Message({name: bank[cluster] for name, bank in self.models.items()})

    def configure(self, round_, clients):
        return {int(c): self.model_of(int(self.cluster_of[c])) for c in clients}

    def upload(self, view):
        return view.message(view.received())

    def cluster_weights(self, cluster: torch.Tensor, sizes: torch.Tensor, count: int) -> torch.Tensor:
        """[count, M]: n_i / n_c for each sender i in cluster c, 0 elsewhere."""
        weights = torch.zeros(count, len(cluster), dtype=torch.float64)
        weights[cluster, torch.arange(len(cluster))] = sizes
        total = weights.sum(1, keepdim=True)
        return torch.where(total > 0, weights / total.clamp_min(1e-300), weights)

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        senders, sizes = uploads.clients, uploads.num_examples
        cluster = self.cluster_of[senders]
        deltas = {name: uploads.stack(name).to(bank.dtype) - bank[cluster] for name, bank in self.models.items()}
        updates = torch.cat([deltas[g] for g in self.groups], dim=1)  # [M, P]
        count = len(next(iter(self.models.values())))
        members = torch.bincount(self.cluster_of, minlength=count)
        sent = torch.bincount(cluster, minlength=count)
        eligible = (sent == members) & (members >= self.settings.min_split_size) & (round_ >= self.settings.warmup_rounds)
        split = split_decisions(updates, self.cluster_weights(cluster, sizes, count), cluster, self.settings, eligible)
        if split.any():
            similarity = pairwise_cosine(updates)
            for c in torch.nonzero(split).flatten().tolist():
                rows = torch.nonzero(cluster == c).flatten()
                second = bipartition(similarity[rows][:, rows], self.settings.linkage)
                new = len(next(iter(self.models.values())))
                self.cluster_of[senders[rows[second]]] = new
                cluster[rows[second]] = new
                self.models = {name: torch.cat([bank, bank[c][None]]) for name, bank in self.models.items()}
            count = len(next(iter(self.models.values())))
        weights = self.cluster_weights(cluster, sizes, count)
        received = weights.sum(1) > 0
        for name, bank in self.models.items():
            step = weighted_average(weights, deltas[name])
            bank[received] += step[received]

    def evaluation(self, client):
        """The client's cluster model, with its local groups."""
        return Evaluation(self.model_of(int(self.cluster_of[client])))

    def state_dict(self) -> dict:
        return {"models": self.models, "cluster_of": self.cluster_of}

    def load_state_dict(self, state: dict) -> None:
        self.models = {name: t.clone() for name, t in state["models"].items()}
        self.cluster_of = state["cluster_of"].clone()

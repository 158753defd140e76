"""FedFomo (Zhang, Sapra, Fidler, Yeung and Alvarez, ICLR 2021, "Personalized Federated Learning
with First Order Model Optimization", Section 3 and Algorithm 1).

The server keeps every client's most recent upload θ_n and an affinity matrix P (K × K, zeros).
Each round client k downloads M of those models, picked ε-greedily from P's row k (each pick
is, with probability ε_t = max(0, ε − t·ε_decay), a random other client, else the unpicked
client of highest affinity, ties broken at random).  Before local training it scores each
downloaded model on its own validation split against its current model θ_k,

    w_n = (L_k(θ_k) − L_k(θ_n)) / ‖θ_n − θ_k‖                     (first-order weight)
    w_n ← max(w_n, 0) / Σ_m max(w_m, 0)                           (only models that help)
    θ_k ← θ_k + Σ_n w_n (θ_n − θ_k)                                (the federated update)

(no move when no downloaded model does better), trains, and uploads its model together with
its raw weights w_n / |Σ_m w_m|, which the server adds to P[k, n] (the released code's
``client_weights`` update; the negative ones lower a model's chance to be picked again).
The first round has nothing to download: every client trains from the common initialization.

Defaults: ε = 0.3 and ε_decay = 0.05 per round as the released code (``cfg.CLIENT_WEIGHT``);
the distance is the L2 norm as the paper writes it (``norm='l1'`` is the released code's
default); M = 11, the count that reproduces Factorized-FL's Table 1 cost column: FedAvg's
20.39 is one model down and one up per client-round, FedFomo's 122.33 = 6.0 × 20.39 is M
models down and one up, so (M + 1)/2 = 6.  The released code's own default is 8.
Downloads carry the shared groups and their BatchNorm statistics (both are combined by the
update, as the released code combines whole state_dicts); a local head stays with its client.
The models are sent as a download's extras, so the engine counts M models per receiver.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from pfl_kernels.ops import weighted_average

from ..api import (BUFFERS, Algorithm, Capabilities, Fraction, Message, NonNegativeFloat, OneOf, Phase, PositiveInt,
                   StateSpec)
from .ifca import load_model


@dataclass(frozen=True)
class FedFomoSettings:
    n_download: PositiveInt = 11  # M, models each client downloads (Factorized-FL's cost column)
    epsilon: Fraction = 0.3  # ε-greedy exploration at round 0
    epsilon_decay: NonNegativeFloat = 0.05  # ε falls by this much each round
    norm: Annotated[str, OneOf(("l2", "l1"))] = "l2"  # ‖θ_n − θ_k‖: the paper's L2 or the code's L1


def first_order_weights(base_loss: float, losses: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """The raw weights (L(θ_k) − L(θ_n)) / ‖θ_n − θ_k‖, 0 where a model equals θ_k."""
    gain = base_loss - losses
    return torch.where(distances > 0, gain / distances.clamp_min(torch.finfo(distances.dtype).tiny),
                       torch.zeros_like(gain))


def fomo_update(settings: FedFomoSettings):
    """The client's step before training: score the downloaded models, move towards the better ones."""

    def begin(view):
        raw = view.state("fomo_weights")
        raw.zero_()
        models = view.download.extras.get("models", {}) if view.download is not None else {}
        groups = [g for g in models if g != BUFFERS]
        m = int(models[groups[0]].shape[0]) if groups else 0
        if m == 0:
            return
        _, base_loss, samples = view.evaluate("val")
        if samples == 0:  # no validation data: no evidence for any model
            return
        own = torch.cat([view.group(g) for g in groups]).clone()
        theirs = torch.cat([models[g] for g in groups], dim=1)  # [m, P]
        own_buffers = view.shared_buffers().clone()
        losses = []
        with torch.no_grad():
            for n in range(m):
                load_model(view, models, n)
                losses.append(view.evaluate("val")[1])
            differences = theirs - own
            order = 2 if settings.norm == "l2" else 1
            distances = torch.linalg.vector_norm(differences.double(), ord=order, dim=1)
            w = first_order_weights(base_loss, torch.tensor(losses, dtype=torch.float64), distances)
            raw[:m] = w / w.sum().abs().clamp_min(1e-9)
            positive = w.clamp_min(0)
            coef = positive / positive.sum() if positive.sum() > 0 else positive
            new = own + weighted_average(coef[None], differences)[0]
            new_buffers = own_buffers
            if BUFFERS in models:
                new_buffers = own_buffers + weighted_average(coef[None], models[BUFFERS] - own_buffers)[0]
            start = 0
            for g in groups:
                size = view.group(g).numel()
                view.group(g).copy_(new[start:start + size])
                start += size
            view.shared_buffers().copy_(new_buffers)

    return begin


class FedFomo(Algorithm):
    """Each client combines the downloaded models that lower its validation loss."""

    name = "fedfomo"
    description = "each client downloads M models and moves towards those that lower its validation loss"
    Settings = FedFomoSettings
    capabilities = Capabilities(needs_validation=True)

    def client_state(self):
        return {"fomo_weights": StateSpec(shape=(self.settings.n_download,), dtype=torch.float64)}

    def setup(self, server) -> None:
        initial = server.initial_model()
        k = server.num_clients
        self.groups = [g for g in initial if g != BUFFERS]
        self.models = {name: t[None].repeat(k, 1) for name, t in initial.items()}
        self.uploaded = torch.zeros(k, dtype=torch.bool)
        self.affinity = torch.zeros(k, k, dtype=torch.float64)
        self._sent: dict[int, torch.Tensor] = {}

    def choose(self, round_: int, client: int, generator: torch.Generator) -> torch.Tensor:
        """The ε-greedy picks of ``client``: up to M other clients that have uploaded."""
        candidates = torch.nonzero(self.uploaded).flatten()
        candidates = candidates[candidates != client]
        ties = torch.rand(len(candidates), generator=generator, dtype=torch.float64)
        shuffled = candidates[torch.randperm(len(candidates), generator=generator)].tolist()
        # by affinity, highest first; among equal affinities in the random order of ``ties``
        by_ties = candidates[torch.argsort(ties, descending=True)]
        top = by_ties[torch.argsort(self.affinity[client, by_ties], descending=True, stable=True)].tolist()
        count = min(self.settings.n_download, len(candidates))
        epsilon = max(0.0, self.settings.epsilon - round_ * self.settings.epsilon_decay)
        explore = (torch.rand(count, generator=generator, dtype=torch.float64) < epsilon).tolist()
        picked: list[int] = []
        for random_pick in explore:
            source = shuffled if random_pick else top
            while source[0] in picked:
                source.pop(0)
            picked.append(source.pop(0))
        return torch.tensor(picked, dtype=torch.int64)

    def configure(self, round_, clients):
        generator = self.server.generator(round_)
        self._sent = {int(c): self.choose(round_, int(c), generator) for c in clients}
        return {c: Message(extras={"models": {name: bank[ids] for name, bank in self.models.items()}})
                for c, ids in self._sent.items()}

    def plan(self, client):
        return (Phase(begin=fomo_update(self.settings)),)

    def upload(self, view):
        m = 0 if view.download is None else int(view.download.extras["models"][self.groups[0]].shape[0])
        return view.message(self.groups, extras={"weights": view.state("fomo_weights")[:m].float()})

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        clients = uploads.clients
        for name, bank in self.models.items():
            bank[clients] = uploads.stack(name).to(bank.dtype)
        self.uploaded[clients] = True
        ids = [self._sent[int(c)] for c in clients]
        rows = torch.repeat_interleave(clients, torch.tensor([len(i) for i in ids], dtype=torch.int64))
        self.affinity.index_put_((rows, torch.cat(ids)), torch.cat(uploads.extras("weights")).double(),
                                 accumulate=True)

    def state_dict(self) -> dict:
        return {"models": self.models, "uploaded": self.uploaded, "affinity": self.affinity}

    def load_state_dict(self, state: dict) -> None:
        self.models = {name: t.clone() for name, t in state["models"].items()}
        self.uploaded = state["uploaded"].clone()
        self.affinity = state["affinity"].clone()

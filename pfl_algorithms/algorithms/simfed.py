"""SimFed (Agnostic Personalized Federated Learning with Kernel Factorization, ICLR 2022
submission): similarity matching on a shared Gaussian input, kernel factorization, and
personalized knowledge reflection.

Kernel factorization (Eq. 5–6): every Conv2d / Linear becomes W = π(u × v ⊕ μ) with
``pfl_kernels.nn.factorize(layout='simfed')``: u ∈ R^(I·F), v ∈ R^(O·F), μ ∈ R^(I·F × O·F)
for a convolution (Eq. 6), u over inputs, v over outputs for a linear (Eq. 5).  By default
u, v are Xavier-uniform and μ zeros (``init='paper'``, also called 'xavier'; the released code of the same
authors' Factorized-FL); ``init='svd'`` keeps ``factorize``'s split of the dense
initialization instead (u v the best rank-1 part, μ the rest).  The factors of the body form
the groups ``u``, ``v`` and ``mu``; the classifier's stay in ``head`` (local where the
scenario keeps it so, as the paper does in its permuted and multi-domain settings).

Local objective (Eq. 7): cross-entropy + λ1 ‖μ‖₁ over every layer's μ; the L1 term's
(sub)gradient λ1·sign(μ) is added in closed form after each backward.

Similarity (Eq. 1–3): the server draws one criteria input x_N ~ N(0, 1) of the data's input
shape, once per federation, from the run's seed (``server.generator()``), and sends it with
each download (Algorithm 1's RunClient(ζ, ξ, φ, x_N); counted with the download).  After
training, each client uploads its shared groups and z_N,k = E_k(x_N), its encoder's output
(the model without its head, in eval mode).  The server keeps each client's latest upload.

Personalized knowledge reflection (Eq. 8), at the start of every round after the first, for
each sampled client k and separately for ζ (u), ξ (v) and φ (μ):

    θ_k ← θ_k + Σ_j [exp(α σ_j) / Σ_l exp(α σ_l)] (θ_j − θ_k),   over j with σ_j ≥ τ,

σ_j = cos(z_N,k, z_N,j) (self included, σ_k = 1).  Since the weights sum to 1 this is the
similarity-weighted average Σ_j w_kj θ_j, w = ``similarity_weights(σ, tau=τ, scale=α)``, and
it runs as one ``weighted_average`` of the [K, K] weights with the bank of stored uploads
per group.  The other shared parameters (biases and BatchNorm of the body, the head where it
is shared, BatchNorm statistics) are reflected with the same weights.  Each client receives
its own reflected model.  Clients are evaluated with their own (personalized) models.

Defaults (the paper, Section 5.1): α = 30, τ = 0.9, λ1 = 1e-4.  Its run settings are SGD with
lr 5e-2, weight decay 1e-4, batch 128, ResNet-9 on 32×32 inputs, 20 clients, 100 rounds
(``--lr 0.05 --weight-decay 1e-4 --batch-size 128``).

Communication: μ is uploaded as a ``Sparse`` payload (entries with |μ| ≥ ``mu_threshold``
travel; with the default 0 exactly the nonzeros, which loses nothing); the downloads carry
dense reflected groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from pfl_kernels.nn import FactorizedConv2d, FactorizedLinear, factorize, factorized_layers
from pfl_kernels.ops import pairwise_cosine, similarity_weights, weighted_average

from ..api import Algorithm, GroupRule, Message, NonNegativeFloat, OneOf, Phase, Range, capturable_hook

FACTORS = ("u", "v", "mu")
CRITERIA = "criteria"
EMBEDDING = "embedding"


@dataclass(frozen=True)
class SimFedSettings:
    alpha: NonNegativeFloat = 30.0  # α, the softmax scale of the similarities (Eq. 8)
    tau: Annotated[float, Range(ge=-1.0, le=1.0)] = 0.9  # τ, the similarity threshold (Eq. 3)
    lambda1: NonNegativeFloat = 1e-4  # λ1, the L1 weight on μ (Eq. 7)
    init: Annotated[str, OneOf(("paper", "xavier", "svd"))] = "paper"  # 'xavier' is 'paper' by its old name
    mu_threshold: NonNegativeFloat = 0.0  # μ entries below this do not travel (0: the nonzeros)


def l1_term(lam: float):
    """The gradient term of λ1 Σ ‖μ‖₁ over the model's factorized layers (each μ once, the
    head's too): λ1·sign(μ) added to each μ's gradient; tensor work on the view's μ alone, so a
    captured step may replay it."""
    def l1(view):
        names = {id(p): n for n, p in view.module.named_parameters()}
        mus = dict.fromkeys(names[id(layer.mu)] for layer in factorized_layers(view.module) if layer.mu is not None)
        with torch.no_grad():
            total = 0.0
            for name in mus:
                mu = view.parameter(name)
                view.parameter_grad(name).add_(mu.sign(), alpha=lam)
                total = total + mu.abs().sum()
            return lam * total

    return capturable_hook(l1, key=("simfed-l1", lam))


def reflection_weights(embeddings: torch.Tensor, seen: torch.Tensor, clients: torch.Tensor, *, alpha: float,
                       tau: float) -> torch.Tensor:
    """The [M, K] weights of Eq. 8 for the M ``clients``: row k holds softmax(α σ_kj) over the
    clients j with σ_kj = cos(z_N,k, z_N,j) ≥ τ (itself included, σ_kk = 1), among the clients
    whose embedding the server has (``seen``); a client not seen yet keeps its own model."""
    weights = torch.zeros(len(clients), len(seen), dtype=embeddings.dtype)
    known = seen[clients]
    weights[~known, clients[~known]] = 1.0
    if known.any():
        candidates, rows = seen.nonzero().squeeze(1), clients[known]
        sim = pairwise_cosine(embeddings[rows], embeddings[candidates])
        own = torch.searchsorted(candidates, rows)  # each row's own column among the candidates
        weights[known.nonzero(), candidates] = similarity_weights(sim, tau=tau, scale=alpha, self_index=own)
    return weights


class SimFed(Algorithm):
    """Similarity matching on a criteria input + factorized kernels + personalized reflection."""

    name = "simfed"
    description = ("factorized kernels; clients matched by their encoders' cosine on one Gaussian input; "
                   "each reflects its matches' u, v, mu (softmax(alpha*sim) weighted)")
    Settings = SimFedSettings

    def prepare_model(self, model):
        factorize(model, layout="simfed")
        if self.settings.init in ("paper", "xavier"):
            for layer in factorized_layers(model):
                layer.reset_parameters()
        return model

    def group_rules(self):
        layers = (FactorizedConv2d, FactorizedLinear)
        return tuple(GroupRule(g, modules=layers, attributes=(g,), outside_head=True) for g in FACTORS)

    def setup(self, server):
        k = server.num_clients
        self.criteria = torch.randn((1, *server.input_shape), generator=server.generator())
        self.bank = {g: t.expand(k, -1).clone() for g, t in server.initial_model().items()}
        self.embeddings = torch.zeros(k, 0)  # [K, d] (CPU) once the first embeddings arrive
        self.seen = torch.zeros(k, dtype=torch.bool)

    def configure(self, round_, clients):
        """θ_k for every sampled client k: Eq. 8 as one weighted_average per group over the bank
        of stored uploads (the first round: the initial model, Algorithm 1's broadcast)."""
        s = self.settings
        weights = reflection_weights(self.embeddings, self.seen, clients, alpha=s.alpha, tau=s.tau)
        models = {g: weighted_average(weights.to(bank), bank) for g, bank in self.bank.items()}
        return {c: Message({g: m[i] for g, m in models.items()}, {CRITERIA: self.criteria})
                for i, c in enumerate(clients.tolist())}

    def plan(self, client):
        lam = self.settings.lambda1
        return (Phase(grad_terms=(l1_term(lam),) if lam else ()),)

    def upload(self, view):
        z = view.embed(view.download.extras[CRITERIA].to(view.params)).reshape(-1)
        return view.message(view.received(), extras={EMBEDDING: z}, sparse={"mu": self.settings.mu_threshold})

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        senders = uploads.clients
        for g, bank in self.bank.items():
            bank[senders] = uploads.stack(g).to(bank.dtype)
        z = torch.stack(uploads.extras(EMBEDDING)).to("cpu", torch.float32)  # [M, d]: the cosines run on CPU
        if self.embeddings.shape[1] != z.shape[1]:
            self.embeddings = torch.zeros(len(self.seen), z.shape[1])
        self.embeddings[senders] = z
        self.seen[senders] = True

    def round_metrics(self, round_):
        """How much reflection the next round has to work with: ``matched``, the mean number of
        other clients each client's Eq. 8 keeps (σ ≥ τ), and ``zero_embeddings``, the clients
        whose z_N is all zero (a ReLU encoder silent on x_N: its σ with every client is 0, so it
        only ever keeps itself).  None before any embedding arrived."""
        seen = self.seen.nonzero().squeeze(1)
        if not len(seen):
            return {"matched": None, "zero_embeddings": None}
        z = self.embeddings[seen]
        kept = pairwise_cosine(z, z) >= self.settings.tau
        kept.fill_diagonal_(False)
        return {"matched": float(kept.sum(1).double().mean()), "zero_embeddings": int((z == 0).all(1).sum())}

    def state_dict(self):
        return {"bank": self.bank, "embeddings": self.embeddings, "seen": self.seen}

    def load_state_dict(self, state):
        self.bank = {g: t.clone() for g, t in state["bank"].items()}
        self.embeddings = state["embeddings"].clone()
        self.seen = state["seen"].clone()

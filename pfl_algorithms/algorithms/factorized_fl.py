"""Factorized-FL (Jeong and Hwang, NeurIPS 2022): each weight is W = u vᵀ ⊕ μ (Eq. 2), u the
basis shared across clients, v the client-specific coefficients, μ a sparse bias.

Local objective (Eq. 6): cross-entropy + λ‖μ‖₁ with a real gradient (the released code's L1
term is computed on detached tensors and never reaches it); its subgradient λ·sign(μ) is
added to the μ group's gradient in one op (:func:`l1_term`).  Training runs through
``pfl_kernels.nn`` factorized layers (``prepare_model``: layout ``spatial``, u over the F·F
kernel positions and v over (out, in) pairs, or ``view``, the released code's reshape;
u, v Xavier-uniform and μ zeros as in the released code; the classifier stays a dense Linear).

Matching (Eq. 4–5), over the round's uploads as one bank, no per-client loop: σ = cosine of
the penultimate layer's v (``v_last``: the last factorized layer below the classifier, the
conv 256→256 of ResNet-9, 65,536 entries) between every pair of senders; client k keeps the
senders with σ ≥ τ, at least ``min_keep`` of the most similar, itself always with σ_kk = 1,
and weighs them by softmax(ε·σ).  Each sender gets its own aggregate Σ_j w_kj θ_j of the
aggregated groups, all computed from the round's uploads (a snapshot: no aggregate sees
another one), and receives it at its next round.

* ``factorized-fl-alpha`` (α): aggregates u only; v, μ (and BatchNorm) stay local; the
  client sends u and ``v_last`` (for matching), and receives its u.
* ``factorized-fl-beta`` (β): aggregates u, v, μ, BatchNorm and the head where it is shared;
  μ travels as ``Sparse(μ, threshold)``: only |μ| ≥ threshold (5e-4) is sent and counted.

Evaluation (both variants): the model scored has the entries |μ| < threshold at zero, as in the
released code (shared/papers/README.md: "at evaluation and for the communication count"), so
the "highly sparse" μ of §4.1 is the μ evaluated; the client's own μ keeps them.

Defaults (shared/papers/README.md, the released settings): the label-permuted ones of
Table 1's top half (τ = 0, ε = 1, at least 10 kept); for the multi-domain scenario pass
``tau=0.95 scale=20 min_keep=4``.  λ = 5e-4 for both the L1 weight and the threshold: the
released code has one ``lambda_l1`` (5e-4, main.py) that weighs the L1 term (client.py) and
prunes |μ| < λ in eval mode (modules/layers.py's ``prune``).

Communication, Table 1: ``pfl_algorithms.reproduce.costs.table1`` dry-runs our accounting on the
paper's ResNet-9 (20 clients, 50 rounds).  The paper's "Gb" is gigabytes (10⁹ bytes) of
float32, both directions: FedAvg 20.594 GB (paper 20.39, +1.0%); α, counted as the paper
describes it (u and v_last up, u down), 0.263 GB against 0.32 (the released code sends its
BatchNorm and head as well, which gives 0.320); β's 18.25 GB implies μ sent at 78.9%
density (21% of μ below the threshold).  Details in ``pfl_algorithms/reproduce/costs.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from torch import nn

from pfl_kernels.nn import FactorizedConv2d, FactorizedLinear, factorize, factorized_layers
from pfl_kernels.ops import pairwise_cosine, similarity_weights, weighted_average

from ..api import (BUFFERS, Algorithm, Evaluation, GroupRule, Message, NonNegativeFloat, NonNegativeInt, OneOf, Phase,
                   PositiveFloat, PositiveInt, Range, Sparse, capturable_hook)

FACTORIZED = (FactorizedConv2d, FactorizedLinear)
MATCH = "v_last"  # the penultimate layer's v, its own group so that α can send it alone


@dataclass(frozen=True)
class FactorizedFLSettings:
    tau: Annotated[float, Range(ge=-1, le=1)] = 0.0  # τ, similarity threshold (label-permuted; 0.95 multi-domain)
    scale: PositiveFloat = 1.0  # ε, softmax scale of the similarities (label-permuted; 20 multi-domain)
    min_keep: NonNegativeInt = 10  # at least this many kept, self included (released minimum_aggr)
    l1: NonNegativeFloat = 5e-4  # λ_sparsity, weight of ‖μ‖₁ (Eq. 6)
    threshold: NonNegativeFloat = 5e-4  # |μ| below it is not sent (nor counted), and is 0 in the model evaluated
    rank: PositiveInt = 1
    layout: Annotated[str, OneOf(("spatial", "view"))] = "spatial"  # "view": the released code's reshape
    # paper: u, v Xavier-uniform and μ zeros (the released code); svd: factorize's split of the
    # dense init (u vᵀ its best rank-r part, μ the rest), which computes the dense model's function
    init: Annotated[str, OneOf(("paper", "svd"))] = "paper"


def l1_term(lam: float):
    """The gradient term of λ‖μ‖₁ over the μ group: λ·sign(μ) (0 at μ = 0); tensor work on the
    view's μ alone, so a captured step may replay it."""
    def l1(view):
        mu = view.group("mu")
        view.grad("mu").add_(torch.sign(mu), alpha=lam)
        return lam * mu.abs().sum()

    return capturable_hook(l1, key=("factorized-fl-l1", lam))


def zero_small_mu(threshold: float):
    """A ``begin`` hook that sets the μ entries with |μ| < ``threshold`` to zero (the released
    code's evaluated model; 0: none)."""
    def zero(view):
        with torch.no_grad():
            mu = view.group("mu")
            mu.masked_fill_(mu.abs() < threshold, 0.0)

    return zero


def matching_weights(v: torch.Tensor, *, tau: float, scale: float, min_keep: int) -> torch.Tensor:
    """[M, M] aggregation weights of Eq. 4–5 from the senders' penultimate v [M, P]: row k
    holds client k's softmax(ε·σ) over its kept senders (σ_kk = 1)."""
    return similarity_weights(pairwise_cosine(v), tau=tau, scale=scale, min_keep=min_keep)


class FactorizedFL(Algorithm):
    """Factorized layers, v-matched personalized aggregation; ``aggregated`` names the variant's groups."""

    Settings = FactorizedFLSettings
    aggregated: tuple[str, ...] = ()  # the groups averaged (besides v_last for β)

    # ------------------------------------------------------------------ declarations

    def prepare_model(self, model: nn.Module) -> nn.Module:
        head = ["head"] if isinstance(getattr(model, "head", None), nn.Module) else []
        factorize(model, rank=self.settings.rank, layout=self.settings.layout, exclude=head)
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, FACTORIZED)]
        if not layers:
            raise ValueError(f"{self.name}: the model has no Conv2d/Linear layer outside its head to factorize")
        if self.settings.init == "paper":  # the released code's initialisation: u, v Xavier-uniform, μ zeros
            for _, layer in layers:
                layer.reset_parameters()
        layers[-1][1].factorized_fl_match = True  # its v is the MATCH group (group_rules reads the model)
        return model

    def group_rules(self):
        match = lambda name, owner, attribute: getattr(owner, "factorized_fl_match", False)
        return (GroupRule(MATCH, modules=FACTORIZED, attributes=("v",), select=match),
                *(GroupRule(a, modules=FACTORIZED, attributes=(a,), outside_head=True) for a in ("u", "v", "mu")))

    # ------------------------------------------------------------------ server side

    def setup(self, server) -> None:
        self.personal: dict[str, torch.Tensor] = {}  # group -> [K, P_g], each client's latest aggregate
        self.ready = torch.zeros(server.num_clients, dtype=torch.bool)

    def configure(self, round_, clients):
        return {int(c): self._download(int(c)) if self.ready[c] else None for c in clients}

    def _download(self, client: int) -> Message:
        tensors = {g: rows[client] for g, rows in self.personal.items()}
        if "mu" in tensors:
            tensors["mu"] = Sparse(tensors["mu"], self.settings.threshold)
        return Message(tensors)

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        weights = matching_weights(uploads.stack(MATCH), tau=self.settings.tau, scale=self.settings.scale,
                                   min_keep=self.settings.min_keep)
        for group in uploads.names():
            if group not in self.aggregated:  # α: v_last came for matching only
                continue
            rows = uploads.stack(group)
            mixed = weighted_average(weights.to(rows.dtype), rows.reshape(len(rows), -1))
            if group not in self.personal:
                self.personal[group] = mixed.new_zeros(self.server.num_clients, mixed.shape[1])
            self.personal[group][uploads.clients.to(mixed.device)] = mixed
        self.ready[uploads.clients] = True

    def evaluation(self, client):
        """The client's own model, with its μ entries below the threshold zeroed last (module
        docstring)."""
        if self.settings.threshold == 0:
            return None
        return Evaluation(final=(Phase(epochs=0, groups=("mu",), begin=zero_small_mu(self.settings.threshold)),))

    def state_dict(self) -> dict:
        return {"personal": self.personal, "ready": self.ready}

    def load_state_dict(self, state: dict) -> None:
        self.personal = {g: t.clone() for g, t in state["personal"].items()}
        self.ready = state["ready"].clone()

    # ------------------------------------------------------------------ client side

    def plan(self, client):
        return (Phase(grad_terms=(l1_term(self.settings.l1),) if self.settings.l1 > 0 else ()),)

    def upload(self, view):
        sent = [g for g in view.groups if g == MATCH or (g in self.aggregated and g in view.shared_groups)]
        return view.message(sent, sparse={"mu": self.settings.threshold})


class FactorizedFLAlpha(FactorizedFL):
    """α: only the bases u are aggregated; the penultimate v is sent for matching."""

    name = "factorized-fl-alpha"
    description = "rank-1 factorized layers; v-matched personalized averaging of u only (v, mu local)"
    aggregated = ("u",)

    def local_groups(self, *, keep_head_local):
        # Everything but u stays: v_last travels up for matching only, never aggregated.
        return {"v", "mu", MATCH, "body", "head"}


class FactorizedFLBeta(FactorizedFL):
    """β: u, v, μ (sparse), BatchNorm and a shared head are aggregated."""

    name = "factorized-fl-beta"
    description = "rank-1 factorized layers; v-matched personalized averaging of u, v, sparse mu and the rest"
    aggregated = ("u", "v", MATCH, "mu", "body", "head", BUFFERS)

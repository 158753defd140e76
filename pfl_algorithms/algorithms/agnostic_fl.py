"""Agnostic Federated Learning (Mohri, Sivek and Suresh, ICML 2019): the model is trained for the
worst mixture of the clients' distributions,

    min_w max_{λ ∈ Λ} L(w, λ) = Σ_k λ_k L_k(w),   Λ the simplex over the K clients   (Eq. 3)

by stochastic mirror/gradient descent–ascent (Stochastic-AFL, Sec. 5): each round

    w_{t+1} = w_t + Σ_k λ_k (w_k − w_t) / Σ_k λ_k        (the λ-weighted update, for n_k/n)
    λ_{t+1} = Proj_Λ(λ_t + γ_λ · ∇_λ L(w_t, λ_t)),  ∇_λ L = (L_k(w_t))_k

w_k is client k's model after the run's local training from w_t; L_k(w_t) is the loss of the
received model on k's training split, which each client uploads (one 32-bit number).  The
λ-weighted update uses λ_t, renormalized over the round's senders (sampled clients); the
ascent step moves only the senders' coordinates (the others' losses are unknown this round)
before the Euclidean projection onto the simplex (``pfl_kernels.ops.project_simplex_``).
If every sender has λ_k = 0 the model stays where it is.

The paper's output is the average of the iterates w̄_T = (1/(T+1)) Σ_{t≤T} w_t (Theorem 2;
``output='average'``, the default, as the fair_flearn reference evaluates it); ``'last'``
evaluates w_T instead.  λ starts uniform (1/K).  γ_λ: the paper sets it from the bound's
constants only; 0.01 is the public reference implementation's value (fair_flearn, its
``learning_rate_lambda``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from pfl_kernels.ops import project_simplex_

from ..api import Evaluation, Message, NonNegativeFloat, OneOf
from .fedavg import FedAvg


@dataclass(frozen=True)
class AgnosticFLSettings:
    lambda_lr: NonNegativeFloat = 0.01  # γ_λ, the ascent step on the mixture weights
    output: Annotated[str, OneOf(("average", "last"))] = "average"  # the model clients are evaluated with


def ascend_lambda(lam: torch.Tensor, clients: torch.Tensor, losses: torch.Tensor, lr: float) -> torch.Tensor:
    """Proj_Λ(λ + γ_λ·g), g the senders' losses at their coordinates (0 elsewhere): a new [K] tensor."""
    step = lam.clone()
    step[clients] += lr * losses.to(lam.dtype)
    return project_simplex_(step)


class AgnosticFL(FedAvg):
    """Minimax over the mixture weights λ: λ-weighted averaging, projected ascent on λ."""

    name = "agnostic-fl"
    description = "minimax over client mixture weights: lambda-weighted updates, projected ascent on lambda"
    Settings = AgnosticFLSettings

    def setup(self, server) -> None:
        super().setup(server)
        k = server.num_clients
        self.lambdas = torch.full((k,), 1.0 / k, dtype=torch.float64)
        self.average = {name: t.clone() for name, t in self.global_model.items()}
        self.iterates = 1  # w_0 is in the average

    def upload(self, view):
        _, loss, _ = view.evaluate("train", received=True)
        return view.message(view.received(), extras={"loss": loss})

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        lam = self.lambdas[uploads.clients]
        if lam.sum() > 0:
            self.global_model = uploads.weighted_mean(weights=lam / lam.sum())
        losses = torch.tensor(uploads.extras("loss"), dtype=torch.float64)
        self.lambdas = ascend_lambda(self.lambdas, uploads.clients, losses, self.settings.lambda_lr)
        t = self.iterates
        self.average = {name: (t * self.average[name] + self.global_model[name]) / (t + 1) for name in self.average}
        self.iterates = t + 1

    def evaluation(self, client):
        model = self.average if self.settings.output == "average" else self.global_model
        return Evaluation(Message(model))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "lambdas": self.lambdas, "average": self.average, "iterates": self.iterates}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.lambdas = state["lambdas"].clone()
        self.average = {name: t.clone() for name, t in state["average"].items()}
        self.iterates = int(state["iterates"])

"""pFedMe (Dinh, Tran and Nguyen, NeurIPS 2020): personalized models by Moreau envelopes.

Each client keeps a personal model θ (an extra bank).  At each local step, on one batch D,
it solves the inner problem (Eq. 7) approximately with ``inner_steps`` steps of gradient
descent at lr ``personal_lr``, starting from θ (from the received model at a round's first
step),

    θ ← argmin_θ f(θ; D) + (λ/2)‖θ − w‖²,

then moves its local model w ← w − η λ (w − θ), η the run's learning rate.  That step is
plain SGD whatever the run's momentum: it is a proximal step, not a loss gradient, and at the
paper's λ = 15 momentum makes it diverge (η λ = 0.75 per step, amplified about tenfold by a
momentum of 0.9: NaN within 3 rounds on 6 digits clients).
The server averages the local models weighted by data size and mixes them into the global
model with β: w ← (1 − β) w + β Σ_i (n_i / n) w_i (Algorithm 1).  Clients are evaluated
with their personal models θ (the paper's personalized accuracy).

The inner gradient descent converges only when personal_lr · (L + λ) < 2, L the largest
eigenvalue of the batch loss's Hessian: along that direction each inner step multiplies θ's
distance to the inner solution by |1 − personal_lr (L + λ)|.  Since L ≥ 0 near a minimum,
personal_lr · λ < 2 is necessary whatever the model (checked with the settings).  The
released MNIST values (0.1, λ = 15) need L < 5.  The digits CNN with BatchNorm (``--set
norm=batch``) has L ≈ 16 on a batch of 32 at initialization (float64 power iteration), so
from the first step θ's error grows 2.1-fold per inner step: NaN updates at ``--lr 0.005``,
finite noise that leaves w in place at ``--lr 0.05`` (6.7% and 30.6% after 10 rounds of 10
steps on 10 clients; 12.2% and 91.7% at personal_lr 0.05).  The w step is SGD at η on the
Moreau envelope, whose gradient λ(w − θ) ≈ ∇f for λ = 15: at the paper's η = 0.005 pFedMe
learns as slowly as plain SGD at 0.005 does (FedAvg, momentum 0: 19.4% in the same runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import Capabilities, Evaluation, Phase, PositiveFloat, PositiveInt, StateSpec
from .fedavg import FedAvg


@dataclass(frozen=True)
class PFedMeSettings:
    # The released code's MNIST command: lamda 15, personal_learning_rate 0.1, K 5, beta 1.
    lam: PositiveFloat = 15.0  # λ, the weight of the Moreau envelope's proximal term
    personal_lr: PositiveFloat = 0.1  # the inner problem's step
    inner_steps: PositiveInt = 5  # K, steps of the inner problem per local step
    beta: PositiveFloat = 1.0  # the server's mixing weight

    def __post_init__(self):
        if self.personal_lr * self.lam >= 2:
            raise ValueError(f"pfedme: personal_lr * lam = {self.personal_lr} * {self.lam} >= 2: the inner gradient "
                             "descent cannot converge along any direction of non-negative curvature L (each step "
                             "multiplies theta's error there by |1 - personal_lr (L + lam)| >= 1); lower personal_lr "
                             "or lam")


def moreau_gradient(settings: PFedMeSettings):
    """One pFedMe local step: solve for θ, leave λ(w − θ) as the gradient of w."""
    lam, lr = settings.lam, settings.personal_lr

    def gradient(view, batches):
        (x, y), = batches
        theta, w = view.state("personal"), view.params.clone()
        with torch.no_grad():
            view.params.copy_(w if view.step == 0 else theta)
        for _ in range(settings.inner_steps):
            loss = view.forward_backward(x, y)
            with torch.no_grad():
                view.grads.add_(view.params - w, alpha=lam)
                view.params.sub_(view.grads, alpha=lr)
        with torch.no_grad():
            theta.copy_(view.params)
            view.params.copy_(w)
            torch.mul(w - theta, lam, out=view.grads)
        return loss

    return gradient


class PFedMe(FedAvg):
    """Moreau-envelope personalization with a β-mixing server."""

    name = "pfedme"
    description = "personal models from a Moreau-envelope inner problem; the server mixes with beta"
    Settings = PFedMeSettings
    capabilities = Capabilities(batchable=False)

    def client_state(self):
        return {"personal": StateSpec(init="params")}

    def plan(self, client):
        return (Phase(gradient=moreau_gradient(self.settings), optimizer="sgd", optimizer_settings={"momentum": 0.0}),)

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        beta = self.settings.beta
        average = uploads.weighted_mean()
        self.global_model = {name: (1 - beta) * self.global_model[name] + beta * average[name] for name in average}

    def evaluation(self, client):
        return Evaluation(params="personal")

"""FedGP (Jiang, Zhang and Koyejo, ICLR 2024, "Principled Federated Domain Adaptation: Gradient
Projection and Auto-Weighting", the Federated Gradient Projection aggregation rule).

Roles come from the ``fda`` scenario: M sources and one target.  Every round all sampled
clients, the target included, start from the global model w and train locally (the target
with ``target_lr`` / ``target_batch_size`` / ``target_epochs`` where given, else the run's
settings); each uploads its model.  The server turns the uploads into updates from the same
starting point, g_T = w_T − w for the target and g_i = w_i − w for source i, and moves w by
the target's update and the source updates that do not conflict with it, per parameter
tensor, by the rule of the README facts (issue 17 names it) and of the released code
(jackyzyb/AutoFedGP, ``ServerFedGP.update_fedgp``), the default ``projection='cosine'``:

    w ← w + (1 − β)·g_T + β·Σ_i p_i·[cos_i > 0]·cos_i·g_i

with cos_i the cosine of g_T and g_i over that tensor (``pairwise_cosine``), β = 0.5 and p_i
source i's share of the sources' training samples this round.  ``projection='paper'`` is the
projection of the paper's Figure 1 written out, Proj₊(g_T | g_i) = max(⟨g_T, g_i⟩, 0)/‖g_i‖²·g_i
= [cos_i > 0]·cos_i·(‖g_T‖/‖g_i‖)·g_i, which keeps the target's step size (with a scarce target,
a small one).  Each tensor's new value is one ``weighted_average`` of the stacked updates.

The released server differs in two ways, both offered and both off by default (the issue names
the README facts' rule): ``step_scaling=True`` multiplies source i's term by the ratio of the
target's to the source's local step budget, (η_T·τ_T)/(η·τ_i), with τ the local steps each
took this round (each upload carries its count) and η_T the target's learning rate; the
released code's factor ``target_lr_ratio·(n_T/b_T)/(n_i/b_S)`` is this with one epoch each.
``fedavg_rounds=2`` averages every upload, target included (FedAvg, weighted by training
samples), in the first two rounds, as ``ServerFedGP.update`` does before ``update_fedgp``.

Choices the paper leaves open, stated: the BatchNorm statistics of the new global model are
the target's (the model serves the target's data; statistics are not gradients; the released
code runs them through the same rule); a round in which the target sent nothing leaves w
unchanged (no target direction to project on).

Every client is evaluated with the global model, which is the target's model; the run's
summary reports the target's accuracy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import torch
from torch import nn

from pfl_kernels.ops import pairwise_cosine, weighted_average

from ..api import BUFFERS, Capabilities, Fraction, NonNegativeInt, OneOf, Phase, head_parameter_names
from .fedavg import FedAvg
from .target_only import TargetTraining, target_phase, the_target


@dataclass(frozen=True)
class FedGPSettings(TargetTraining):
    beta: Fraction = 0.5  # β: the weight of the sources' projections against the target's own update
    projection: Annotated[str, OneOf(("cosine", "paper"))] = "cosine"  # cos_i·g_i (README facts), or Proj₊(g_T | g_i)
    step_scaling: bool = False  # released code: source i's term × (η_T·τ_T)/(η·τ_i), τ the local steps
    fedavg_rounds: NonNegativeInt = 0  # released code: 2 (FedAvg of every upload in the first rounds)


def projection_coefficients(g_target: torch.Tensor, g_sources: torch.Tensor, shares: torch.Tensor, beta: float,
                            projection: str = "cosine") -> torch.Tensor:
    """[1 + M] weights c of the stacked updates [g_T; g_1 … g_M] of one tensor, so that the
    FedGP step is Σ_k c_k·row_k: c_0 = 1 − β, c_i = β·p_i·[cos_i > 0]·cos_i·(‖g_T‖/‖g_i‖)
    (``projection='paper'``) or β·p_i·[cos_i > 0]·cos_i (``'cosine'``).  A zero update has
    cosine 0 and gets no weight.

    Args:
        g_target: [D]; g_sources: [M, D] of its dtype; shares: [M] p_i; beta: in [0, 1].
    """
    cosine = pairwise_cosine(g_target[None], g_sources)[0].double()
    scale = cosine
    if projection == "paper":
        norms = torch.linalg.vector_norm(g_sources.double(), dim=1)
        scale = cosine * torch.linalg.vector_norm(g_target.double()) / norms.clamp_min(torch.finfo(norms.dtype).tiny)
    sources = torch.where(cosine > 0, beta * shares.double() * scale, torch.zeros_like(scale))
    return torch.cat([torch.tensor([1.0 - beta], dtype=torch.float64), sources])


class FedGP(FedAvg):
    """The target's update plus β-weighted projections of it on the agreeing source updates."""

    name = "fedgp"
    description = "fda: the global step is (1-beta) g_T + beta sum_i p_i [cos_i>0] cos_i g_i, per tensor"
    Settings = FedGPSettings
    capabilities = Capabilities(roles=("source", "target"))

    def prepare_model(self, model: nn.Module) -> nn.Module:
        # The size of each parameter tensor, by group, in layout order (the model's order
        # within a group): FedGP projects tensor by tensor.
        head = set(head_parameter_names(model))
        self.tensor_sizes: dict[str, list[int]] = {}
        for name, parameter in model.named_parameters():
            self.tensor_sizes.setdefault("head" if name in head else "body", []).append(parameter.numel())
        return model

    def setup(self, server) -> None:
        super().setup(server)
        self.target = the_target(server, self.name)
        self.groups = [g for g in self.global_model if g != BUFFERS]
        for group in self.groups:
            if sum(self.tensor_sizes.get(group, ())) != self.global_model[group].numel():
                raise ValueError(f"{self.name}: group {group!r} does not hold the model's "
                                 f"{group} tensors; it projects tensor by tensor")
        # The share of (source, tensor) pairs with cos > 0 in the last round; None where it was not
        # measured (no target upload, or no source): the server state holds no NaN unless it diverged.
        self.positive: Optional[float] = None
        self.lr = server.lr

    def plan(self, client):
        return (target_phase(self.settings) if client == self.target else Phase(),)

    def upload(self, view):
        """The model; with ``step_scaling``, also the local steps taken (τ_i)."""
        if not self.settings.step_scaling:
            return super().upload(view)
        return view.message(view.received(), extras={"steps": view.step})

    def step_factors(self, uploads, t: int, sources: torch.Tensor) -> torch.Tensor:
        """[M] the released code's factor of each source's term, (η_T·τ_T)/(η·τ_i) (float64)."""
        steps = torch.tensor([float(s) for s in uploads.extras("steps")], dtype=torch.float64)
        target_lr = self.lr if self.settings.target_lr is None else self.settings.target_lr
        return (target_lr * steps[t]) / (self.lr * steps[sources]).clamp_min(torch.finfo(torch.float64).tiny)

    def aggregate(self, round_, uploads):
        self.positive = None
        if round_ < self.settings.fedavg_rounds:
            return super().aggregate(round_, uploads)
        senders = uploads.clients.tolist()
        if self.target not in senders:
            return
        t = senders.index(self.target)
        sources = torch.tensor([i for i, c in enumerate(senders) if c != self.target], dtype=torch.int64)
        sizes = uploads.num_examples[sources]
        shares = sizes / sizes.sum() if len(sources) else sizes
        if self.settings.step_scaling:
            shares = shares * self.step_factors(uploads, t, sources)
        positive, pairs = 0, 0
        for group in self.groups:
            old = self.global_model[group]
            updates = uploads.stack(group).to(old.dtype) - old  # [senders, P_g]
            new = []
            for g in updates.split(self.tensor_sizes[group], dim=1):
                g_target, g_sources = g[t], g[sources]
                weights = projection_coefficients(g_target, g_sources, shares, self.settings.beta,
                                                  self.settings.projection)
                positive += int((weights[1:] > 0).sum())
                pairs += len(sources)
                new.append(weighted_average(weights[None].to(g.dtype), torch.cat([g_target[None], g_sources]))[0])
            self.global_model[group] = old + torch.cat(new)
        if BUFFERS in self.global_model:
            self.global_model[BUFFERS] = uploads.messages[t].dense(BUFFERS).to(self.global_model[BUFFERS].dtype)
        self.positive = positive / pairs if pairs else None

    def round_metrics(self, round_):
        return {"positive_cosines": self.positive}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "positive": self.positive}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        positive = state["positive"]  # NaN: a checkpoint from before None meant "not measured"
        self.positive = None if positive is None or positive != positive else float(positive)

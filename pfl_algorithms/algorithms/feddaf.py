"""FedDAF (Federated Domain Adaptation using model Functional distance; Algorithms 1–3 of the
paper in ``shared/papers/feddaf-model-functional-distance.txt``).

Roles come from the scenario (``fda``: K ``source`` clients and one ``target``;
``server.clients_with_role``).  Each round the server broadcasts the global source model w_S
to the sources and to the target.

* Each source trains from w_S with the run's optimizer and uploads its model; the server
  averages them into the next w_S (Eq. 3): the paper's simple average, or with
  ``source_weighting='distance'`` the released code's softmax(−‖w_i − w_T‖) over the sources,
  the distances taken on the parameters (as the mixing of Eq. 2 is, and FedAMP's and FedDWA's
  distances are), w_T the target's model of the same round; the sources' BatchNorm
  statistics are averaged with the same weights.
* The target, before training (Algorithms 2–3), computes on its own training data the mean
  gradient field of w_S and of its previous model w_T: the mean over its mini-batches (in
  order, ``target_batch_size``) of the loss gradient, then their angle
  θ = arccos(cos(ḡ_S, ḡ_T)) (``pairwise_cosine`` of the two flat gradients), the Gompertz
  weight

      α = 1 − exp(−exp(−k·(θ − 1)))                                   (k = 5 by default)

  and the adapted model α·w_S + (1 − α)·w_T on the parameters (Eq. 2; its BatchNorm
  statistics stay its own).  It then trains ``target_epochs`` epoch(s) at ``target_lr`` with
  batch ``target_batch_size`` and the proximal term (μ/2)‖w − w_S‖², and uploads its model
  with α and θ (the server reports both per round: ``round_metrics``).

The target's model lives in its bank row, which the engine checkpoints, so it is the previous
model of the next round.  Defaults are the README facts: k = 5, target lr 1e-3, batch 16, one
epoch, μ = 1e-3; the sources use the run's settings (the paper: SGD lr 0.01, batch 64, one
epoch).  A target without training data takes w_S (α = 1) and reports no θ.  Every client is evaluated with
its own model; the run's summary reports the target's final and best accuracy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Optional

import torch

from pfl_kernels.ops import pairwise_cosine, weighted_average

from ..api import BUFFERS, Algorithm, Capabilities, Message, NonNegativeFloat, OneOf, Phase, PositiveFloat, PositiveInt
from .fedprox import proximal_term
from .target_only import target_phase, the_target


@dataclass(frozen=True)
class FedDAFSettings:
    k: PositiveFloat = 5.0  # steepness of the Gompertz weight
    mu: NonNegativeFloat = 1e-3  # proximal weight of the target's training, towards w_S
    target_lr: PositiveFloat = 1e-3
    target_batch_size: PositiveInt = 16
    target_epochs: PositiveInt = 1
    source_weighting: Annotated[str, OneOf(("mean", "distance"))] = "mean"  # the paper's, or the released code's


def gompertz_weight(theta: float, k: float) -> float:
    """α = 1 − exp(−exp(−k·(θ − 1))): near 1 for small angles, near 0 beyond θ ≈ 1 + 1/k."""
    return 1.0 - math.exp(-math.exp(-k * (theta - 1.0)))


def gradient_angle(g_source: torch.Tensor, g_target: torch.Tensor) -> float:
    """θ = arccos of the cosine of two flat gradients, in radians (``pairwise_cosine``)."""
    cosine = pairwise_cosine(g_source[None], g_target[None])[0, 0]
    return float(torch.arccos(cosine.double().clamp(-1.0, 1.0)))


def source_weights(uploads_from_sources: torch.Tensor, target_model, weighting: str) -> torch.Tensor:
    """[1, M] weights of the M sources' flat models: 1/M, or softmax(−‖w_i − w_T‖)."""
    m = len(uploads_from_sources)
    if weighting == "mean" or target_model is None:
        return torch.full((1, m), 1.0 / m, dtype=torch.float64)
    distances = torch.linalg.vector_norm((uploads_from_sources - target_model).double(), dim=1)
    return torch.softmax(-distances, dim=0)[None]


class FedDAF(Algorithm):
    """The target mixes the average source model into its own by a Gompertz weight of the angle
    between their mean gradients on target data."""

    name = "feddaf"
    description = "target mixes the global source model in by a Gompertz weight of their mean-gradient angle"
    Settings = FedDAFSettings
    capabilities = Capabilities(roles=("source", "target"))

    def setup(self, server) -> None:
        self.target = the_target(server, self.name)
        initial = server.initial_model()
        self.groups = [g for g in initial if g != BUFFERS]
        self.global_model = initial
        # The target's latest (α, θ), [2] float64; None until it has sent them (the server state
        # holds no NaN unless it diverged).
        self.last: Optional[torch.Tensor] = None

    def source_model(self) -> dict:
        return {name: t.clone() for name, t in self.global_model.items()}

    def configure(self, round_, clients):
        # The target receives w_S without loading it (apply=False): it keeps w_T to mix with.
        to_sources, to_target = Message(self.source_model()), Message(self.source_model(), apply=False)
        return {int(c): to_target if int(c) == self.target else to_sources for c in clients}

    def plan(self, client):
        if client != self.target:
            return (Phase(),)
        return (target_phase(self.settings, begin=self.adapt,
                             grad_terms=(proximal_term(self.settings.mu, self._source_parameters),)),)

    def _source_parameters(self, view) -> dict:
        return {g: view.download.dense(g) for g in self.groups}

    def adapt(self, view) -> None:
        """Eq. 2: w ← α·w_S + (1 − α)·w_T, α the Gompertz weight of the mean gradients' angle;
        (α, θ) go up with the target's upload."""
        source = self._source_parameters(view)
        g_target = view.mean_gradient("train", self.settings.target_batch_size)
        g_source = view.mean_gradient("train", self.settings.target_batch_size, at=source)
        if torch.isnan(g_target).all():  # no training data: nothing to weigh against, no angle
            alpha, measured = 1.0, []
        else:
            theta = gradient_angle(g_source, g_target)
            alpha, measured = gompertz_weight(theta, self.settings.k), [theta]
        with torch.no_grad():
            for g, t in source.items():
                view.group(g).copy_(alpha * t + (1.0 - alpha) * view.group(g))
        # (α, θ), or (α,) without an angle: an upload holding NaN would be dropped as diverged.
        view.report("fda", torch.tensor([alpha, *measured], dtype=torch.float64))

    def upload(self, view):
        return view.message(self.groups)

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        senders = uploads.clients.tolist()
        target_row = senders.index(self.target) if self.target in senders else None
        flat = uploads.concat(self.groups)  # [M, P]: every sender's model
        target_model = None
        if target_row is not None:
            self.last = uploads.messages[target_row].extras["fda"].clone()
            target_model = flat[target_row]
        rows = [i for i, c in enumerate(senders) if c != self.target]
        if not rows:
            return
        index = torch.tensor(rows)
        weights = source_weights(flat[index], target_model, self.settings.source_weighting)
        for name, value in self.global_model.items():
            stacked = uploads.stack(name)[index].to(value.dtype)
            self.global_model[name] = weighted_average(weights.to(value.dtype), stacked)[0]

    def round_metrics(self, round_):
        last = [] if self.last is None else self.last.tolist()
        alpha, theta = (last + [None, None])[:2]  # None: not sent yet, or no angle (no training data)
        return {"target_alpha": alpha, "target_theta": theta}

    def state_dict(self) -> dict:
        return {"global_model": self.global_model, "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.global_model = {name: t.clone() for name, t in state["global_model"].items()}
        last = state["last"]  # a checkpoint from before None and (α,) wrote NaN for "not sent", "no angle"
        if last is not None:
            last = last[~torch.isnan(last)].clone()
        self.last = None if last is None or last.numel() == 0 else last

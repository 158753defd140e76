"""Fed-CMA (Regatti et al., "Conditional Moment Alignment for Improved Generalization in
Federated Learning"): clients keep private feature extractors u_i, of any architecture, and
share only their classifier v_i and their class-conditional mean embeddings.

Client i's local loss is Eq. 5:

    Φ_i = L_i(u_i, v_i) + (λ1/2)·p_i·‖v_i − v̄‖² + (λ2/2)·Σ_k (p_i^k / b_i^k)·Σ_{x ∈ B_i^k} ‖g_i(u_i, x) − e^k‖²

with p_i = n_i / N its share of all samples, p_i^k = n_i^k / Σ_j n_j^k its share of class k's,
and B_i^k a minibatch of b_i^k samples of class k chosen once, at the start, and used in every
round.  The client keeps its own v_i (the penalty pulls it towards v̄; it is never replaced).
After training it sends v_i and e_i^k = (1/b_i^k)·Σ_{x ∈ B_i^k} g_i(u_i, x) with the counts b_i^k
(a :class:`ClassMeans` statistic: the executor answers it with ``pfl.class_means`` from the
client's stored model, the same bits wherever the client runs).  No extractor weight leaves the client.

The server's global classifier v̄ and class means e^k follow the moving averages of Eq. 7,
η the run's client learning rate:

    v̄ ← (1 − λ1η)·v̄ + λ1η·Σ_i p_i v_i,      e^k ← (1 − λ2η)·e^k + λ2η·Σ_i p_i^k e_i^k,

with 0 < λη ≤ 1 (checked before training).  Choices the paper leaves open (it states Algorithm
1 for full participation and one local step per round, and has no released code):

* v̄ and e^k start from the first round's averages (Algorithm 1's server begins by collecting
  the workers' values); until then a client trains on its own loss L_i alone, and a class no
  sender has held yet has no e^k and no alignment term.
* With partial participation the sums run over the round's senders, with p_i (and, per class,
  p_i^k over the senders that hold class k) renormalized to sum to 1, so that an average never
  shrinks towards 0 because some clients were not sampled.
* The means a client sends are computed in eval mode (BatchNorm's running statistics), as its
  model predicts; the alignment term trains in train mode like the cross-entropy.

Evaluation is personalized: each client's own extractor and classifier.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..api import Algorithm, Capabilities, ClassMeans, Message, Phase, PositiveFloat, PositiveInt
from .fedprox import proximal_term


@dataclass(frozen=True)
class FedCMASettings:
    lam1: PositiveFloat = 1.0  # λ1: weight of the classifier consensus (λ1/2)·p_i·‖v_i − v̄‖²
    lam2: PositiveFloat = 1.0  # λ2: weight of the class-conditional alignment term
    per_class_batch: PositiveInt = 16  # b: samples per class in the fixed batch B_i^k (all, if fewer)


def client_shares(counts: Tensor) -> tuple[Tensor, Tensor]:
    """(p, p_k) from each client's training samples per class ``counts`` [K, C]:
    p_i = n_i / N [K] and p_i^k = n_i^k / Σ_j n_j^k [K, C] (0 for a class nobody holds)."""
    counts = counts.to(torch.float64)
    p = counts.sum(1) / counts.sum()
    per_class = counts.sum(0, keepdim=True)
    p_k = torch.where(per_class > 0, counts / per_class.clamp_min(1), torch.zeros_like(counts))
    return p, p_k


def per_class_batch(labels: Tensor, size: int, generator: torch.Generator) -> Tensor:
    """Positions in ``labels`` of the fixed per-class batch: for each class present (ascending),
    ``size`` of its samples drawn without replacement (all of them when it has fewer), each
    class's positions ascending."""
    labels = labels.cpu()
    order = torch.randperm(labels.numel(), generator=generator)
    picked = [order[labels[order] == k][:size].sort().values for k in labels.unique(sorted=True)]
    return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64)


def alignment_loss(embeddings: Tensor, labels: Tensor, means: Tensor, has_mean: Tensor, p_k: Tensor,
                   counts: Tensor, lam2: float) -> Tensor:
    """Eq. 5's last term, (λ2/2)·Σ_k (p_i^k / b_i^k)·Σ_{x ∈ B_i^k} ‖g(x) − e^k‖², over the batch's
    ``embeddings`` [N, d] with ``labels`` [N]; ``means`` [C, d] the global e^k, ``has_mean`` [C]
    which classes have one (the others add nothing), ``p_k`` [C] and ``counts`` [C] (b_i^k)."""
    weight = torch.where(has_mean[labels], p_k[labels] / counts[labels].clamp_min(1), 0.0).to(embeddings.dtype)
    return 0.5 * lam2 * (weight * (embeddings - means[labels].to(embeddings.dtype)).square().sum(1)).sum()


def moving_average(old: Tensor, new: Tensor, rate: float) -> Tensor:
    """Eq. 7: (1 − rate)·old + rate·new, rate = λη."""
    return old * (1 - rate) + new * rate


def class_mean_average(means: Tensor, counts: Tensor, p_k: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ_i p̃_i^k e_i^k [C, d], which classes any sender holds [C]) from the senders' ``means``
    [M, C, d], ``counts`` [M, C] (b_i^k) and shares ``p_k`` [M, C]; p̃_i^k are the p_i^k of the
    senders holding class k, renormalized to sum to 1 (module docstring)."""
    weights = torch.where(counts > 0, p_k, torch.zeros_like(p_k))
    total = weights.sum(0)
    held = total > 0
    weights = weights / torch.where(held, total, torch.ones_like(total))
    average = torch.einsum("mk,mkd->kd", weights, means.to(torch.float64))
    return average.to(means.dtype), held


class FedCMA(Algorithm):
    """Shares classifiers and class-conditional mean embeddings; every extractor stays local."""

    name = "fedcma"
    description = "private extractors of any architecture; classifiers and class-mean embeddings aligned (Eq. 5-7)"
    Settings = FedCMASettings
    # Bounded embeddings: the paper's analysis assumes them (Assumption 2; config.check applies it).
    capabilities = Capabilities(mixed_architectures=True, head="shared", bounded_embeddings=True)

    def prepare_model(self, model):
        if not (callable(getattr(model, "embed", None)) or isinstance(getattr(model, "body", None), torch.nn.Module)):
            raise ValueError(f"fedcma aligns embeddings: the model must have embed(x) or a body module (a registry "
                             f"model), got {type(model).__name__}")
        return model

    def local_groups(self, *, keep_head_local: bool) -> set[str]:
        return {"body"}  # the feature extractor never leaves a client

    def setup(self, server) -> None:
        for name in ("lam1", "lam2"):  # Eq. 7's rates λη in (0, 1], η the run's learning rate
            lam = getattr(self.settings, name)
            if not 0 < lam * server.lr <= 1:
                raise ValueError(f"fedcma: {name}·lr = {lam}·{server.lr} = {lam * server.lr:g} must be in (0, 1] "
                                 f"(Eq. 7's moving average); lower {name} or the learning rate")
        self.p, self.p_k = client_shares(server.class_counts())
        self.v_bar: Optional[Tensor] = None  # set by the first aggregation (module docstring)
        self.means: Optional[Tensor] = None
        self.has_mean = torch.zeros(self.p_k.shape[1], dtype=torch.bool)

    def configure(self, round_, clients):
        messages = {}
        for client in clients.tolist():
            extras = {"p": float(self.p[client]), "p_k": self.p_k[client]}
            if self.v_bar is not None:
                extras.update(v_bar=self.v_bar, means=self.means, has_mean=self.has_mean)
            messages[client] = Message({}, extras)
        return messages

    def plan(self, client):
        return (Phase(loss_terms=(self.align,), grad_terms=(self.consensus,)),)

    def align(self, batch):
        """Eq. 5's alignment term on the fixed batch (nothing before the first means)."""
        view, received = batch.view, batch.view.download.extras
        if "means" not in received:
            return batch.logits.new_zeros(())
        x, y = view.cached("fixed_batch", lambda: self._fixed_batch(view))
        return alignment_loss(_embed(batch.module, x), y, received["means"], received["has_mean"], received["p_k"],
                              torch.bincount(y, minlength=received["p_k"].numel()), self.settings.lam2)

    def consensus(self, view):
        """The gradient of (λ1/2)·p_i·‖v_i − v̄‖² (nothing before the first v̄)."""
        received = view.download.extras
        if "v_bar" not in received:
            return None
        return proximal_term(self.settings.lam1 * received["p"], lambda _: {"head": received["v_bar"]})(view)

    def _fixed_batch(self, view) -> tuple[Tensor, Tensor]:
        """The client's B_i = ∪_k B_i^k as (inputs, labels): drawn from its run-long stream, so the
        same in every round and after a resume (once per task: ``view.cached``)."""
        indices = view.indices("train")
        chosen = per_class_batch(view.labels_of(indices), self.settings.per_class_batch, view.generator(-1))
        return view.examples(indices[chosen.to(indices.device)])

    def upload(self, view):
        """v_i and the class means of the fixed batch with their counts b_i^k."""
        x, y = view.cached("fixed_batch", lambda: self._fixed_batch(view))
        means = ClassMeans(x, y, view.download.extras["p_k"].numel())  # (means, counts), computed per cohort
        return Message({"head": view.group("head").clone()}, {"class_means": means}, view.num_examples)

    def aggregate(self, round_, uploads):
        if not uploads:
            return
        senders = uploads.clients
        p = self.p[senders]
        v_avg = uploads.weighted_mean(["head"], p / p.sum())["head"]
        pairs = uploads.extras("class_means")
        means, held = class_mean_average(torch.stack([m for m, _ in pairs]), torch.stack([c for _, c in pairs]),
                                         self.p_k[senders])
        lr = self.server.lr
        if self.v_bar is None:
            self.v_bar = v_avg
            self.means = torch.zeros_like(means)
        else:
            self.v_bar = moving_average(self.v_bar, v_avg, self.settings.lam1 * lr)
        fresh = held & ~self.has_mean  # a class's first mean is taken as it is, then averaged
        updated = moving_average(self.means, means, self.settings.lam2 * lr)
        self.means = torch.where(fresh[:, None], means, torch.where(held[:, None], updated, self.means))
        self.has_mean = self.has_mean | held

    def state_dict(self) -> dict:
        return {"v_bar": self.v_bar, "means": self.means, "has_mean": self.has_mean}

    def load_state_dict(self, state: dict) -> None:
        self.v_bar, self.means = state["v_bar"], state["means"]
        self.has_mean = state["has_mean"].clone()


def _embed(module, inputs: Tensor) -> Tensor:
    """g_i(u_i, x) with gradient: the model's ``embed`` (the registry's models), else its ``body``."""
    embed = getattr(module, "embed", None)
    return embed(inputs) if callable(embed) else module.body(inputs)

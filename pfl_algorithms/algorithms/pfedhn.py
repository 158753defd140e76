"""pFedHN and pFedHN-PC (Shamsian, Navon, Fetaya and Chechik, ICML 2021, "Personalized
Federated Learning using Hypernetworks", Algorithm 1; Fed-CMA's CIFAR-10 Table 3 baselines).

The server holds a hypernetwork h(·; φ) and one learned embedding v_i per client.  Client i
receives the weights it generates, θ_i = h(v_i; φ), trains them locally into θ̃_i and sends
them back; the server forms Δθ_i = θ_i − θ̃_i and steps φ and v_i along

    ∇_φ L_i ≈ (∇_φ θ_i)ᵀ Δθ_i,    ∇_{v_i} L_i ≈ (∇_{v_i} θ_i)ᵀ Δθ_i        (Algorithm 1)

computed as one vector-Jacobian product, ``torch.autograd.grad(θ_i, [φ, v], grad_outputs=Δθ_i)``
(``server_gradients``), then takes a step of its own optimizer.  What follows the public code
(github.com/AvivSham/pFedHN), file by file:

* ``experiments/pfedhn/models.py`` ``CNNHyper``: v_i is a row of an ``nn.Embedding`` (K rows
  of ``embed_dim``, N(0, 1)); an MLP Linear(embed_dim, hidden) followed by ``n_hidden`` times
  (ReLU, Linear(hidden, hidden)), no activation after the last; then one linear output layer
  per target tensor.  Here there is one output Linear(hidden, P_g) per shared parameter group g
  (sizes from ``server.initial_model()``), whose rows are those of the code's per-tensor
  layers side by side: nn.Linear draws its weight and bias from U(−1/√fan_in, 1/√fan_in) and
  every output layer has fan_in = hidden, so the stacked layer has the same distribution as
  the code's separate ones (and each output is still its own rows' affine map of the features).
  Defaults: hidden 100, n_hidden 3 (``trainer.py``'s ``--hyper-hid``, ``--n-hidden``) and
  embed_dim int(1 + K/4) (its ``--embed-dim -1``).  Drawn from ``server.generator(-1)``.
* ``experiments/pfedhn/trainer.py`` ``train``: the server's optimizer is SGD (lr 1e-2, momentum
  0.9, weight decay 1e-3 on every hypernetwork parameter, the embeddings included, with an
  optional embedding lr ``--embed-lr``), and the gradient is clipped to norm 50 before each step
  (``clip_grad_norm_(hnet.parameters(), 50)``); ``experiments/pfedhn_pc/trainer.py`` uses lr 5e-2.
  Each local step clips the gradient of the generated weights to norm 50 (``client_clip``).
  The client's local training is the run's optimizer and schedule; the code's, the paper-scale
  settings, are SGD lr 5e-3, momentum 0.9, weight decay 5e-5, 50 inner steps of batch 64:
  ``--lr 0.005 --momentum 0.9 --weight-decay 5e-5 --local-steps 50 --batch-size 64``.  (The code
  draws each inner batch as a fresh shuffle, ``next(iter(loader))``; the run's schedule walks
  through shuffled epochs.)
* Evaluation (``evaluate`` in both trainers): each client's generated model, no fine-tuning.
* pFedHN-PC (``experiments/pfedhn_pc/``): the hypernetwork generates the body only
  (``CNNHyperPC``, up to the 84-d features) and every client keeps its own classifier
  (``LocalLayer``: Linear(84, classes)), trained with the body at every local step by an SGD
  of the same settings and evaluated on the generated body.  The head is a local group here:
  it is never sent nor overwritten.  (The code keeps each local head's momentum across the
  client's turns; here the run's ``optimizer_state`` decides, for the whole model.)

A round of this engine samples several clients, where the code samples one client per step.
Every sampled client gets θ_i from the same φ (the round's), and each gradient is taken at
that φ, so that Δθ_i and ∇θ_i belong together.  By default (``server_update='mean'``) the
server then takes one optimizer step (clipped) on the mean of the M gradients of φ, each
embedding v_i with its own gradient; ``server_update='sequential'`` takes one step per upload
instead, in ascending client order.  With ``--clients-per-round 1`` either is exactly the
code's loop.  Models whose shared groups carry BatchNorm statistics are
refused: the hypernetwork generates parameters, not statistics (``pfedhn-cnn`` has none).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Mapping, Optional

import torch
from torch.nn import functional as F

from ..api import (BUFFERS, SGD, Algorithm, Capabilities, Message, NonNegativeFloat, NonNegativeInt, OneOf, Phase,
                   PositiveFloat, PositiveInt, capturable_hook)
from .fedper import FedPer

EMBEDDINGS = "embeddings"


@dataclass(frozen=True)
class PFedHNSettings:
    embed_dim: Optional[PositiveInt] = None  # width of each v_i; None: int(1 + K/4), the code's default
    hidden: PositiveInt = 100  # the hypernetwork's hidden width
    n_hidden: NonNegativeInt = 3  # (ReLU, Linear(hidden, hidden)) blocks after the first layer
    server_lr: PositiveFloat = 1e-2  # the server SGD's lr for φ
    embed_lr: Optional[PositiveFloat] = None  # its lr for the embeddings v; None: server_lr
    server_momentum: NonNegativeFloat = 0.9
    server_weight_decay: NonNegativeFloat = 1e-3
    server_clip: NonNegativeFloat = 50.0  # max norm of each step's gradient of (φ, v); 0: no clipping
    client_clip: NonNegativeFloat = 50.0  # max norm of each local step's gradient of the generated weights; 0: none
    # How a round of M uploads steps the server (the same at M = 1, the code's loop): 'mean' takes
    # one step on the mean of the M gradients of φ (each embedding v_i with its own gradient);
    # 'sequential' one step per upload, every gradient taken at the φ that generated the round.
    server_update: Annotated[str, OneOf(("mean", "sequential"))] = "mean"


@dataclass(frozen=True)
class PFedHNPCSettings(PFedHNSettings):
    server_lr: PositiveFloat = 5e-2  # experiments/pfedhn_pc/trainer.py's --lr


def linear_init(rows: int, fan_in: int, generator: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(weight [rows, fan_in], bias [rows]) drawn as nn.Linear's reset_parameters draws them:
    U(−1/√fan_in, 1/√fan_in) (kaiming_uniform with a = √5 gives that bound for the weight)."""
    bound = 1.0 / math.sqrt(fan_in)
    weight = (torch.rand(rows, fan_in, generator=generator, dtype=dtype) * 2 - 1) * bound
    bias = (torch.rand(rows, generator=generator, dtype=dtype) * 2 - 1) * bound
    return weight, bias


def init_hypernetwork(sizes: Mapping[str, int], num_clients: int, embed_dim: int, hidden: int, n_hidden: int,
                      generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The hypernetwork's parameters, by name: ``embeddings`` [K, embed_dim] ~ N(0, 1); the MLP's
    ``mlp.<j>.weight/bias`` (j = 0 … n_hidden); ``out.<group>.weight`` [P_g, hidden] and
    ``out.<group>.bias`` [P_g] for each generated group, in the order of ``sizes``."""
    params = {EMBEDDINGS: torch.randn(num_clients, embed_dim, generator=generator, dtype=dtype)}
    fan_in = embed_dim
    for j in range(n_hidden + 1):
        params[f"mlp.{j}.weight"], params[f"mlp.{j}.bias"] = linear_init(hidden, fan_in, generator, dtype)
        fan_in = hidden
    for group, size in sizes.items():
        params[f"out.{group}.weight"], params[f"out.{group}.bias"] = linear_init(size, hidden, generator, dtype)
    return params


def generate(params: Mapping[str, torch.Tensor], client: int, groups) -> dict[str, torch.Tensor]:
    """θ_client = h(v_client; φ): each of ``groups`` as a flat vector [P_g] (with autograd where
    ``params`` require gradients)."""
    features = params[EMBEDDINGS][client]
    j = 0
    while f"mlp.{j}.weight" in params:
        if j:
            features = F.relu(features)
        features = F.linear(features, params[f"mlp.{j}.weight"], params[f"mlp.{j}.bias"])
        j += 1
    return {g: F.linear(features, params[f"out.{g}.weight"], params[f"out.{g}.bias"]) for g in groups}


def server_gradients(params: Mapping[str, torch.Tensor], client: int,
                     trained: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradient of every hypernetwork parameter (φ and the embedding table) for one upload:
    with Δθ = θ_client − ``trained`` held fixed, the gradient of ⟨θ_client(φ, v), Δθ⟩, i.e.
    (∇θ_client)ᵀ Δθ (Algorithm 1; the code's ``autograd.grad(weights, hnet.parameters(),
    grad_outputs=delta_theta)``).  Rows of the embedding table other than the client's get 0."""
    leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
    with torch.enable_grad():
        theta = generate(leaves, client, list(trained))
        deltas = [theta[g].detach() - trained[g].to(theta[g].dtype) for g in trained]
        grads = torch.autograd.grad([theta[g] for g in trained], list(leaves.values()), grad_outputs=deltas)
    return dict(zip(leaves, grads))


def clip_term(groups, max_norm: float):
    """A gradient term that scales the gradient of ``groups`` to norm ≤ ``max_norm`` (the code's
    ``clip_grad_norm_(net.parameters(), 50)`` before each inner step), as torch computes it:
    the coefficient max_norm / (norm + 1e-6), clamped to 1, in the gradients' dtype and on their
    device, multiplied in whether or not it clips (by 1 it changes nothing), so no value is read
    back to the host and the step can be captured as a CUDA graph.  Adds no loss."""
    def clip(view):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(view.grad(g)) for g in groups]))
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in groups:
            view.grad(g).mul_(coefficient)
        return None

    return capturable_hook(clip, key=("pfedhn-clip", tuple(groups), float(max_norm)))


class PFedHN(Algorithm):
    """A server hypernetwork generates each client's model from its learned embedding."""

    name = "pfedhn"
    description = "a server hypernetwork maps each client's learned embedding to its model; trained by the clients' updates"
    Settings = PFedHNSettings

    def setup(self, server) -> None:
        initial = server.initial_model()
        if BUFFERS in initial:
            raise ValueError(f"{self.name} generates the shared groups' parameters, not their BatchNorm statistics; "
                             f"this model's shared groups carry some: use a model without BatchNorm (pfedhn-cnn, "
                             f"lenet5, mlp)")
        self.groups = list(initial)
        if not self.groups:
            raise ValueError(f"{self.name} has no shared parameter group to generate")
        s = self.settings
        embed_dim = s.embed_dim if s.embed_dim is not None else int(1 + server.num_clients / 4)
        dtype = initial[self.groups[0]].dtype
        sizes = {g: initial[g].numel() for g in self.groups}
        self._build(init_hypernetwork(sizes, server.num_clients, embed_dim, s.hidden, s.n_hidden,
                                      server.generator(-1), dtype))

    def _build(self, params: Mapping[str, torch.Tensor]) -> None:
        """Make ``params`` the hypernetwork (leaf tensors) with a fresh server SGD per tensor."""
        self.params = {name: t.clone().requires_grad_(True) for name, t in params.items()}
        s = self.settings
        embed_lr = s.embed_lr if s.embed_lr is not None else s.server_lr
        self.optimizers = {name: SGD(lr=embed_lr if name == EMBEDDINGS else s.server_lr, momentum=s.server_momentum,
                                     weight_decay=s.server_weight_decay) for name in self.params}
        self.optimizer_state = {n: {"momentum_buffer": torch.zeros_like(p), "steps": 0} for n, p in self.params.items()}

    @torch.no_grad()
    def generated(self, client: int) -> Message:
        """θ_client, the model the hypernetwork generates for ``client``, as a message."""
        return Message(generate(self.params, client, self.groups))

    def configure(self, round_, clients):
        return {int(c): self.generated(int(c)) for c in clients}

    def plan(self, client):
        if self.settings.client_clip == 0:
            return (Phase(),)
        return (Phase(grad_terms=(clip_term(self.groups, self.settings.client_clip),)),)

    def upload(self, view):
        return view.message(self.groups)

    def aggregate(self, round_, uploads):
        # Every gradient first, at the φ that generated the round's θ_i; then one step each, or one
        # step on their mean (an embedding row has only its client's gradient, kept whole).  With
        # M > 1 the sequential steps all use gradients taken at the round's φ, which the code's
        # one-client loop never does; at the demo's 20 clients per round they diverge.
        grads = [server_gradients(self.params, client, {g: m.dense(g) for g in self.groups})
                 for client, m in zip(uploads.clients.tolist(), uploads.messages)]
        if grads and self.settings.server_update == "mean":
            grads = [{name: (sum(g[name] for g in grads) if name == EMBEDDINGS
                             else sum(g[name] for g in grads) / len(grads)) for name in grads[0]}]
        params = list(self.params.values())
        for step in grads:
            for name, p in self.params.items():
                p.grad = step[name]
            if self.settings.server_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, self.settings.server_clip)
            for name, p in self.params.items():
                self.optimizers[name].step(p, p.grad, self.optimizer_state[name])
        for p in params:
            p.grad = None

    def evaluation(self, client):
        """The generated model, without fine-tuning (the code's ``evaluate``)."""
        return self.generated(client)

    def state_dict(self) -> dict:
        momentum = {name: state["momentum_buffer"].clone() for name, state in self.optimizer_state.items()
                    if self.settings.server_momentum and state["steps"]}
        return {"params": {name: p.detach().clone() for name, p in self.params.items()}, "momentum": momentum}

    def load_state_dict(self, state: dict) -> None:
        self._build(state["params"])
        for name, buffer in state["momentum"].items():  # saved once its tensor has stepped
            self.optimizer_state[name].update(momentum_buffer=buffer.clone(), steps=1)


class PFedHNPC(PFedHN):
    """pFedHN with a personal classifier: the hypernetwork generates the body, each client keeps its head."""

    name = "pfedhn-pc"
    description = "pFedHN generating the body only; each client trains and keeps its own classifier head"
    Settings = PFedHNPCSettings
    # The head stays on its client whatever the scenario, as FedPer's does.
    local_groups = FedPer.local_groups
    capabilities = Capabilities(head="local")

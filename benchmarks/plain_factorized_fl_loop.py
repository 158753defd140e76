"""Factorized-FL β the way its released code runs a round: the baseline of
``bench_factorized_fl_round.py``.

A faithful plain-PyTorch port of the released loop: each client keeps its own model object;
a round ``copy.deepcopy``s the client's model, loads its personalized state, trains it with
layers that rebuild their weight eagerly at every forward (W = (u vᵀ + μ) reshaped straight
into [O, I, kh, kw], the code's ``view`` layout; Linear: W = (u vᵀ + μ)ᵀ), a shuffled
``DataLoader`` and ``torch.optim.SGD``; then the server, for each client, computes the cosine
of the penultimate layer's v with every client's in a Python loop, keeps those with σ ≥ τ
(at least ``min_keep``, itself with σ = 1), weighs them by softmax(ε·σ) and averages the
state dicts key by key.  One fix over the released server: it aggregates from a snapshot
of the round's uploads (the released code writes each aggregate in place, so later clients
average already-updated models; /shared/papers/README.md).

The L1 term is left out on both sides: the released code computes it on detached tensors,
so it never changes a weight.  μ is aggregated densely (threshold 0 on our side).
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

CLIENTS, SAMPLES, BATCH, LR = 20, 250, 64, 0.01
TAU, SCALE, MIN_KEEP = 0.0, 1.0, 10  # the released label-permuted settings (our defaults)


class EagerFactorizedConv2d(nn.Module):
    """The released code's factorized conv: the weight rebuilt eagerly from u, v, μ."""

    def __init__(self, layer):
        super().__init__()
        self.u, self.v, self.mu = (nn.Parameter(p.detach().clone()) for p in (layer.u, layer.v, layer.mu))
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().clone())
        self.shape, self.stride, self.padding = layer.weight_shape, layer.stride, layer.padding

    def forward(self, x):
        weight = (self.u @ self.v + self.mu).view(self.shape)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding)


class EagerFactorizedLinear(nn.Module):
    """The released code's factorized linear layer: u over inputs, v over outputs."""

    def __init__(self, layer):
        super().__init__()
        self.u, self.v, self.mu = (nn.Parameter(p.detach().clone()) for p in (layer.u, layer.v, layer.mu))
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().clone())

    def forward(self, x):
        return F.linear(x, (self.u @ self.v + self.mu).t(), self.bias)


def eager_copy(model: nn.Module) -> nn.Module:
    """A copy of a model made by ``factorized-fl-beta`` (layout ``view``) with the released
    code's eager layers in place of the fused ones, and its ReLU + MaxPool2d(2) in place of
    the engine's fused pool: the same parameters, names and values."""
    from pfl_kernels.nn import FactorizedConv2d, FactorizedLinear, unfuse_relu_max_pool

    model = copy.deepcopy(model)
    unfuse_relu_max_pool(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, (FactorizedConv2d, FactorizedLinear)):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            eager = EagerFactorizedConv2d if isinstance(module, FactorizedConv2d) else EagerFactorizedLinear
            setattr(parent, child, eager(module))
    return model


def matching_weights(vs: list[torch.Tensor], k: int) -> dict[int, float]:
    """Client k's aggregation weights over the clients, as the released server computes them:
    cosines in a loop, σ_kk = 1, σ ≥ τ kept (at least ``MIN_KEEP`` of the most similar),
    softmax(ε·σ) over the kept."""
    sims = [1.0 if j == k else float(F.cosine_similarity(vs[k], vs[j], dim=0)) for j in range(len(vs))]
    order = sorted(range(len(vs)), key=lambda j: (-sims[j], j))
    kept = [j for j in order if sims[j] >= TAU or j == k]
    for j in order:
        if len(kept) >= MIN_KEEP:
            break
        if j not in kept:
            kept.append(j)
    exps = {j: math.exp(SCALE * sims[j]) for j in kept}
    total = sum(exps.values())
    return {j: e / total for j, e in exps.items()}


def make_round(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, match_key: str, *,
               batch: int = BATCH, shuffle: bool = True):
    """A function running one Factorized-FL β round over the client shards; returns the
    clients' personalized state dicts.  ``model``: the initial model (eager layers);
    ``match_key``: the state-dict key of the penultimate layer's v."""
    datasets = [TensorDataset(inputs[k * SAMPLES:(k + 1) * SAMPLES], labels[k * SAMPLES:(k + 1) * SAMPLES])
                for k in range(CLIENTS)]
    clients = [copy.deepcopy(model) for _ in range(CLIENTS)]
    personal: list = [None] * CLIENTS

    def one_round():
        states = []
        for k, data in enumerate(datasets):
            local = copy.deepcopy(clients[k])
            if personal[k] is not None:
                local.load_state_dict(personal[k])
            optimizer = torch.optim.SGD(local.parameters(), lr=LR)
            for x, y in DataLoader(data, batch_size=batch, shuffle=shuffle):
                optimizer.zero_grad()
                F.cross_entropy(local(x), y).backward()
                optimizer.step()
            clients[k] = local
            states.append({key: value.detach().clone() for key, value in local.state_dict().items()})
        vs = [state[match_key].flatten() for state in states]
        for k in range(CLIENTS):  # from the snapshot ``states``, never from an updated aggregate
            weights = matching_weights(vs, k)
            personal[k] = {key: sum(w * states[j][key] for j, w in weights.items()) for key in states[k]}
        return personal

    return one_round

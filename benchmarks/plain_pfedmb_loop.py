"""pFedMB the way plain PyTorch research code writes a round: the baseline of
``bench_pfedmb_round.py``.

pFedMB has no public code (/shared/papers/README.md), so this is the paper's Algorithm 1
written the usual way: each client keeps its own model object (its α are personal); a round
``copy.deepcopy``s the client's model, loads the global branches, and trains it in two phases
with a shuffled ``DataLoader`` and ``torch.optim.SGD``, each phase with an optimizer of its own:

1. E epochs on α (the softmax logits ``alpha_param``) with the branches frozen, at η_α;
2. E epochs on the branches (and biases) with α frozen, at η_W.

Every layer combines its branches eagerly at each forward, W = Σ_b α_b W_b by a Python loop
over the branches, then ``F.conv2d`` / ``F.linear``.  The server then, for each state-dict
key and each branch, averages the clients' copies in a Python loop over clients weighted by
n_i·α_{i,b} (Eq. 5; ``weighting='uniform'``: by n_i, Eq. 6); a branch nobody weights gets the
plain average over the clients (the rule of ``pfl_kernels.ops.branch_aggregate``).  The frozen
parameters of a phase get ``requires_grad=False``, as in our engine, so neither side computes
gradients it does not use.
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

CLIENTS, SAMPLES, BATCH, EPOCHS = 15, 250, 64, 1
BRANCHES, ALPHA_LR, WEIGHT_LR = 5, 0.01, 0.05
ALPHA = "alpha_param"
BRANCHED = ("branch_weight", "branch_bias")


def _combine(branches: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Σ_b α_b branches[b], one branch at a time."""
    out = alpha[0] * branches[0]
    for b in range(1, len(branches)):
        out = out + alpha[b] * branches[b]
    return out


class _EagerMultiBranch(nn.Module):
    """The parameters of a multi-branch layer (same names and values) and its eager combination."""

    def __init__(self, layer):
        super().__init__()
        self.branch_weight = nn.Parameter(layer.branch_weight.detach().clone())
        self.branch_bias = None if layer.branch_bias is None else nn.Parameter(layer.branch_bias.detach().clone())
        self.alpha_param = nn.Parameter(layer.alpha_param.detach().clone())

    def combined(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        alpha = torch.softmax(self.alpha_param, dim=0)
        bias = None if self.branch_bias is None else _combine(self.branch_bias, alpha)
        return _combine(self.branch_weight, alpha), bias


class EagerMultiBranchConv2d(_EagerMultiBranch):
    def __init__(self, layer):
        super().__init__(layer)
        self.stride, self.padding, self.dilation, self.groups = layer.stride, layer.padding, layer.dilation, layer.groups

    def forward(self, x):
        weight, bias = self.combined()
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class EagerMultiBranchLinear(_EagerMultiBranch):
    def forward(self, x):
        return F.linear(x, *self.combined())


def eager_copy(model: nn.Module) -> nn.Module:
    """A copy of a model prepared by ``pfedmb`` (softmax α) with eager layers in place of the
    fused ones, and ReLU + MaxPool2d(2) in place of the engine's fused pool: the same
    parameters, names and values."""
    from pfl_kernels.nn import MultiBranchConv2d, MultiBranchLinear, unfuse_relu_max_pool

    model = copy.deepcopy(model)
    unfuse_relu_max_pool(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, (MultiBranchConv2d, MultiBranchLinear)):
            if module.simplex != "softmax":
                raise ValueError("the plain loop keeps α on the simplex by softmax only")
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            eager = EagerMultiBranchConv2d if isinstance(module, MultiBranchConv2d) else EagerMultiBranchLinear
            setattr(parent, child, eager(module))
    return model


def aggregate(states: Sequence[dict], alphas: Sequence[dict], sizes: Sequence[int],
              weighting: str = "alpha") -> dict:
    """The server: the new global state (every key but α) from the clients' state dicts.

    ``alphas[i][layer]``: client i's α [B] of each layer (by module name).  Branched keys: Eq. 5
    per branch (Eq. 6 with ``weighting='uniform'``), a branch nobody weights the plain average;
    other keys: weighted by n_i.
    """
    total = sum(sizes)
    out = {}
    for key in states[0]:
        layer, _, attribute = key.rpartition(".")
        if attribute == ALPHA:
            continue
        if attribute not in BRANCHED:
            out[key] = sum(state[key] * (n / total) for state, n in zip(states, sizes))
            continue
        branches = []
        for b in range(len(states[0][key])):
            weights = [n * (float(alpha[layer][b]) if weighting == "alpha" else 1.0) for alpha, n in zip(alphas, sizes)]
            norm = sum(weights)
            if norm > 0:
                branches.append(sum(state[key][b] * (w / norm) for state, w in zip(states, weights) if w != 0))
            else:
                branches.append(sum(state[key][b] for state in states) / len(states))
        out[key] = torch.stack(branches)
    return out


def _train(model: nn.Module, trained: list, frozen: list, data, *, lr: float, batch: int, epochs: int,
           shuffle: bool) -> None:
    for p in frozen:
        p.requires_grad_(False)
    optimizer = torch.optim.SGD(trained, lr=lr)
    for _ in range(epochs):
        for x, y in DataLoader(data, batch_size=batch, shuffle=shuffle):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    for p in frozen:
        p.requires_grad_(True)


def make_round(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *,
               sizes: Optional[Sequence[int]] = None, batch: int = BATCH, epochs: int = EPOCHS,
               alpha_lr: float = ALPHA_LR, weight_lr: float = WEIGHT_LR, weighting: str = "alpha",
               shuffle: bool = True):
    """A function running one pFedMB round over the clients' contiguous shards of ``sizes``
    samples (default ``CLIENTS`` x ``SAMPLES``); it returns (the global state, each client's
    state dict after its local training).  ``model``: the initial model (eager layers)."""
    sizes = [SAMPLES] * CLIENTS if sizes is None else list(sizes)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    datasets = [TensorDataset(inputs[s:s + n], labels[s:s + n]) for s, n in zip(starts, sizes)]
    clients = [copy.deepcopy(model) for _ in sizes]
    shared = {key: value.detach().clone() for key, value in model.state_dict().items()
              if not key.endswith("." + ALPHA)}

    def one_round():
        states, alphas = [], []
        for k, data in enumerate(datasets):
            local = copy.deepcopy(clients[k])
            local.load_state_dict(shared, strict=False)
            alpha = [p for name, p in local.named_parameters() if name.endswith("." + ALPHA)]
            weights = [p for name, p in local.named_parameters() if not name.endswith("." + ALPHA)]
            _train(local, alpha, weights, data, lr=alpha_lr, batch=batch, epochs=epochs, shuffle=shuffle)
            _train(local, weights, alpha, data, lr=weight_lr, batch=batch, epochs=epochs, shuffle=shuffle)
            clients[k] = local
            states.append({key: value.detach().clone() for key, value in local.state_dict().items()})
            alphas.append({name: torch.softmax(module.alpha_param.detach(), dim=0)
                           for name, module in local.named_modules() if isinstance(module, _EagerMultiBranch)})
        shared.clear()
        shared.update(aggregate(states, alphas, sizes, weighting))
        return shared, states

    return one_round

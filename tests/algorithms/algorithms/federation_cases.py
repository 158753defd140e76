"""Tiny federations for the algorithm tests: a body/head MLP on separable Gaussian blobs."""
from __future__ import annotations

import torch
from torch import nn

from pfl_algorithms.data.partition import ClientSplit
from pfl_algorithms.engine.federation import EngineSettings
from pfl_algorithms.engine.optim import OptimizerSettings
from pfl_algorithms.engine.local import LocalSchedule
from pfl_algorithms.engine.rounds import federation_for


class TinyNet(nn.Module):
    def __init__(self, features=4, hidden=6, classes=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


class BatchNormNet(nn.Module):
    """body: Linear(4, 6) (30) + BatchNorm1d(6) (12 params, 12 floating buffers); head: Linear(6, 3) (21)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x))


class DeepBatchNormNet(nn.Module):
    """Another architecture with the same 6-d embedding: body Linear(4, 8) + BatchNorm1d(8) + Tanh
    + Linear(8, 6) + ReLU; head Linear(6, 3)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x))


def blobs(n=120, features=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    centers = 3 * torch.randn(classes, features, generator=g, dtype=torch.float64)
    return centers[labels] + torch.randn(n, features, generator=g, dtype=torch.float64), labels


def client_splits(sizes, label_maps=None):
    """Contiguous shares of the blobs: 70% train, the rest test."""
    data, start = [], 0
    for k, size in enumerate(sizes):
        idx = torch.arange(start, start + size)
        start += size
        cut = int(0.7 * size)
        data.append(ClientSplit(train=idx[:cut], val=idx[cut:cut], test=idx[cut:],
                                label_map=None if label_maps is None else label_maps[k]))
    return data


def make_federation(algorithm, *, clients=3, sizes=(30, 40, 50), rounds=3, sample=1.0, clients_per_round=None,
                    steps=None, epochs=1, lr=0.1, keep_head_local=False, label_maps=None, seed=0, batch_size=16,
                    workers=1, executor="threaded", optimizer="sgd", optimizer_settings=None, optimizer_state="reset",
                    models=None, architectures=None, dtype=torch.float64, finetune_epochs=0, roles=None):
    if roles is None and algorithm.capabilities.roles:  # FedDAF: the last client is the target
        roles = {"source": list(range(clients - 1)), "target": [clients - 1]}
    inputs, labels = blobs(sum(sizes[:clients]), seed=seed)
    inputs = inputs.to(dtype)
    torch.manual_seed(seed)
    models = TinyNet().to(dtype) if models is None else models
    settings = EngineSettings(rounds=rounds, sample=sample, clients_per_round=clients_per_round, seed=seed,
                              optimizer=OptimizerSettings(optimizer, **(optimizer_settings or {"lr": lr})),
                              workers=workers, executor=executor, optimizer_state=optimizer_state,
                              finetune_epochs=finetune_epochs,
                              schedule=LocalSchedule(batch_size=batch_size, epochs=epochs, steps=steps))
    return federation_for(algorithm, models, inputs, labels, client_splits(sizes[:clients], label_maps), settings,
                          keep_head_local=keep_head_local, architectures=architectures, roles=roles)

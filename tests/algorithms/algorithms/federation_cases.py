"""Tiny federations for the algorithm tests: a body/head MLP on separable Gaussian blobs."""
from __future__ import annotations

import torch
from torch import nn

from pfl_algorithms.engine.federation import ClientData, EngineSettings, Federation
from pfl_algorithms.engine.local import LocalSchedule


class TinyNet(nn.Module):
    def __init__(self, features=4, hidden=6, classes=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


def blobs(n=120, features=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    centers = 3 * torch.randn(classes, features, generator=g, dtype=torch.float64)
    return centers[labels] + torch.randn(n, features, generator=g, dtype=torch.float64), labels


def make_federation(algorithm, *, clients=3, sizes=(30, 40, 50), rounds=3, sample=1.0, steps=None, epochs=1,
                    lr=0.1, keep_head_local=False, label_maps=None, seed=0, batch_size=16, workers=1):
    inputs, labels = blobs(sum(sizes), seed=seed)
    data, start = [], 0
    for k, size in enumerate(sizes[:clients]):
        idx = torch.arange(start, start + size)
        start += size
        cut = int(0.7 * size)
        data.append(ClientData(train=idx[:cut], val=idx[cut:cut], test=idx[cut:],
                               label_map=None if label_maps is None else label_maps[k]))
    torch.manual_seed(seed)
    model = TinyNet().double()
    settings = EngineSettings(rounds=rounds, sample=sample, seed=seed, optimizer_settings={"lr": lr}, workers=workers,
                              schedule=LocalSchedule(batch_size=batch_size, epochs=epochs, steps=steps))
    fed = Federation(model, inputs, labels, data, settings,
                     local_names=algorithm.local_parameter_names(model, keep_head_local=keep_head_local))
    algorithm.setup(fed)
    return fed

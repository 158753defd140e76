"""FedAvg the way research code writes it: the baseline of ``bench_fedavg_round.py``.

For each client: ``copy.deepcopy`` of the global model, a shuffled ``DataLoader`` over a
``TensorDataset``, ``torch.optim.SGD``; then the global ``state_dict`` is the size-weighted
average of the clients' state dicts.  The common small job: 20 clients x 250 CIFAR-shaped
samples, LeNet-5 (as in ``pfl_algorithms.models``, written out here so the script needs only
torch), batch 64, 1 local epoch, SGD lr 0.01, all clients every round.

    python benchmarks/plain_fedavg_loop.py [--rounds 10]    # the whole script, timed from outside
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

CLIENTS, SAMPLES, BATCH, LR = 20, 250, 64, 0.01


class LeNet5(nn.Module):
    """pFedMB's LeNet-5 for 3x32x32 inputs."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Flatten(), nn.Linear(400, 120), nn.ReLU(),
                                      nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes))

    def forward(self, x):
        return self.features(x)


def job(seed: int = 0):
    """The data (random CIFAR-shaped tensors, random labels), split in equal client shards."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(CLIENTS * SAMPLES, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (CLIENTS * SAMPLES,), generator=gen)
    return inputs, labels


def make_round(global_model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
    """A function running one FedAvg round over the client shards, in place on ``global_model``."""
    datasets = [TensorDataset(inputs[k * SAMPLES:(k + 1) * SAMPLES], labels[k * SAMPLES:(k + 1) * SAMPLES])
                for k in range(CLIENTS)]

    def one_round():
        states, sizes = [], []
        for data in datasets:
            local = copy.deepcopy(global_model)
            optimizer = torch.optim.SGD(local.parameters(), lr=LR)
            for x, y in DataLoader(data, batch_size=BATCH, shuffle=True):
                optimizer.zero_grad()
                F.cross_entropy(local(x), y).backward()
                optimizer.step()
            states.append(local.state_dict())
            sizes.append(len(data))
        total = sum(sizes)
        averaged = {name: sum(s[name] * (n / total) for s, n in zip(states, sizes)) for name in states[0]}
        global_model.load_state_dict(averaged)

    return one_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    one_round = make_round(LeNet5(), *job())
    for _ in range(args.rounds):
        one_round()


if __name__ == "__main__":
    main()

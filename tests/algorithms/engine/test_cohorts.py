"""Federations of several architectures: one cohort each, sharing only what matches."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pfl_algorithms.algorithms.fedavg import FedAvg
from pfl_algorithms.engine.rounds import run_round

from ..algorithms.federation_cases import make_federation


class Narrow(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x))


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x))


class HeadAveraging(FedAvg):
    """FedAvg of the head only: every body stays with its client."""

    def local_groups(self, *, keep_head_local):
        return {"body"}


def two_architectures(algo, **kwargs):
    torch.manual_seed(0)
    models = {"narrow": Narrow().double(), "deep": Deep().double()}
    return make_federation(algo, clients=4, sizes=(30, 40, 50, 36), models=models,
                           architectures=["narrow", "deep", "narrow", "deep"], **kwargs)


def test_two_architectures_train_fedavg_on_the_shared_head():
    algo = HeadAveraging()
    fed = two_architectures(algo, epochs=2, rounds=6)
    assert [c.name for c in fed.cohorts] == ["narrow", "deep"]
    assert [c.clients for c in fed.cohorts] == [(0, 2), (1, 3)]
    assert set(algo.global_model) == {"head"}
    for round_ in range(6):
        record = run_round(fed, algo, round_)
    heads = torch.stack([fed.cohort_of(k).params.row(fed.cohort_of(k).row(k))[fed.cohort_of(k).span("head")]
                         for k in range(4)])
    n = fed.train_sizes()
    torch.testing.assert_close(algo.global_model["head"], (n / n.sum()) @ heads, rtol=1e-12, atol=1e-12)
    # the bodies trained apart: each cohort's rows differ and keep their own shapes
    narrow, deep = fed.cohorts
    assert narrow.params.data.shape == (2, 30 + 21) and deep.params.data.shape == (2, 40 + 54 + 21)
    assert not torch.equal(narrow.params.data[0], narrow.params.data[1])
    assert record.eval["mean_accuracy"] > 0.6  # it learns the blobs
    # only the head travelled: 21 values of 64 bits to and from each client per round
    assert fed.comm.total("up") == fed.comm.total("down") == 6 * 4 * 21 * 64


def test_a_shared_group_whose_shapes_differ_names_both_architectures():
    with pytest.raises(ValueError, match=r"'body'.*'narrow'.*'deep'"):
        two_architectures(FedAvg())

"""ClientView.evaluate: the loss of the client's current model, or of the model it received,
on one of its splits, without changing anything the client stores."""
from __future__ import annotations

import torch
from torch.func import functional_call
from torch.nn import functional as F

from pfl_algorithms.algorithms.fedavg import FedAvg
from pfl_algorithms.engine.rounds import run_round
from tests.algorithms.algorithms.federation_cases import make_federation


class Probe(FedAvg):
    """FedAvg whose clients also report view.evaluate before and after training (unregistered)."""

    def upload(self, view):
        return view.message(view.received(), extras={"received": view.evaluate("train", received=True)[1],
                                                     "current": view.evaluate("train")[1]})


def cross_entropy(fed, client, flat):
    cohort = fed.cohorts[0]
    idx = fed.clients[client].train
    logits = functional_call(cohort.module, cohort.layout.views(flat), (fed.inputs[idx],))
    return float(F.cross_entropy(logits, fed.labels[idx]))


def test_evaluate_reports_the_received_and_the_trained_model_and_changes_nothing():
    probe, plain = Probe(), FedAvg()
    fed, reference = make_federation(probe), make_federation(plain)
    received = torch.cat([probe.global_model["body"], probe.global_model["head"]])
    seen = {}
    original = probe.aggregate
    probe.aggregate = lambda round_, uploads: (seen.update(zip(uploads.clients.tolist(), uploads.messages)),
                                               original(round_, uploads))
    run_round(fed, probe, 0)
    run_round(reference, plain, 0)
    for k in range(3):
        row = fed.cohorts[0].params.row(k)
        assert torch.equal(row, reference.cohorts[0].params.row(k))  # training as FedAvg's, bit for bit
        assert abs(seen[k].extras["received"] - cross_entropy(fed, k, received)) < 1e-12
        assert abs(seen[k].extras["current"] - cross_entropy(fed, k, row)) < 1e-12
        assert seen[k].extras["current"] < seen[k].extras["received"]

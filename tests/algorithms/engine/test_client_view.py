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


class Sharing(FedAvg):
    """Hooks that share a task's values without reading each other's leftovers: a begin hook
    reports a number with the upload, and the begin hook, a loss term and the upload all ask
    for one cached value, computed once per task (unregistered)."""

    def __init__(self):
        super().__init__()
        self.computed = []

    def _value(self, view):
        def compute():
            self.computed.append((view.round, view.client))
            return torch.tensor(float(view.client))
        return view.cached("value", compute)

    def plan(self, client):
        from pfl_algorithms.api import Phase

        def begin(view):
            view.report("began", self._value(view) + 100)

        def term(batch):
            return batch.logits.new_zeros(()) * self._value(batch.view)

        return (Phase(begin=begin, loss_terms=(term,)),)

    def upload(self, view):
        return view.message(view.received(), extras={"value": self._value(view)})


def test_cached_values_are_computed_once_per_task_and_reports_travel_with_the_upload_on_every_executor():
    for executor in ("sequential", "threaded", "batched"):
        algo = Sharing()
        fed = make_federation(algo, executor=executor, workers=2)
        seen = {}
        original = algo.aggregate
        algo.aggregate = lambda round_, uploads: (seen.update(zip(uploads.clients.tolist(), uploads.messages)),
                                                  original(round_, uploads))
        record = run_round(fed, algo, 0)
        assert sorted(algo.computed) == [(0, 0), (0, 1), (0, 2)], executor
        for client, message in seen.items():
            assert float(message.extras["value"]) == client and float(message.extras["began"]) == client + 100
        plain = FedAvg()
        # per upload, two float32 scalars more than FedAvg's, counted as the upload is
        assert record.bits_up == run_round(make_federation(plain, executor=executor), plain, 0).bits_up + 3 * 64


class SparseHead(FedAvg):
    """FedAvg whose clients send their head as a Sparse payload (``view.message(sparse=...)``)."""

    def upload(self, view):
        return view.message(view.received(), extras={"n": 1}, sparse={"head": 0.05, "absent": 1.0})


def test_message_sends_the_groups_it_is_told_as_sparse_payloads():
    from pfl_algorithms.engine.messages import Sparse

    algo = SparseHead()
    fed = make_federation(algo)
    seen = {}
    original = algo.aggregate
    algo.aggregate = lambda round_, uploads: (seen.update(zip(uploads.clients.tolist(), uploads.messages)),
                                              original(round_, uploads))
    run_round(fed, algo, 0)
    cohort = fed.cohorts[0]
    for k, message in seen.items():
        head = cohort.params.row(k)[cohort.span("head")]
        assert isinstance(message.tensors["head"], Sparse) and message.tensors["head"].threshold == 0.05
        assert torch.equal(message.dense("head"), torch.where(head.abs() >= 0.05, head, torch.zeros_like(head)))
        assert not isinstance(message.tensors["body"], Sparse)
        assert torch.equal(message.tensors["body"], cohort.params.row(k)[cohort.span("body")])
        assert "absent" not in message.tensors and message.extras == {"n": 1}
        assert message.num_examples == len(fed.clients[k].train)

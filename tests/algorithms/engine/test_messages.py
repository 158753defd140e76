"""The counting rule of messages and the ledger, against hand counts."""
from __future__ import annotations

import pytest
import torch

from pfl_algorithms.algorithms.fedavg import FedAvg
from pfl_algorithms.engine.comm import CommLedger
from pfl_algorithms.engine.messages import Message, Sparse, payload_bits
from pfl_algorithms.engine.rounds import run_round

from ..algorithms.federation_cases import BatchNormNet, make_federation


@pytest.mark.parametrize("keep_head_local", [False, True])
def test_fedavg_round_costs_its_dense_payloads(keep_head_local):
    algo = FedAvg()
    fed = make_federation(algo, models=BatchNormNet(), keep_head_local=keep_head_local, steps=1,
                          dtype=torch.float32)
    run_round(fed, algo, 0)
    params = 30 + 12 + (0 if keep_head_local else 21)
    buffers = 12  # running mean and variance; num_batches_tracked (int64) never travels
    per_client = (params + buffers) * 32
    assert fed.comm.total("down") == fed.comm.total("up") == 3 * per_client
    groups = fed.comm.gigabits()["by_group"]
    assert groups["down:body"] == pytest.approx(3 * 42 * 32 / 1e9)
    assert groups["down:buffers"] == pytest.approx(3 * 12 * 32 / 1e9)
    assert ("down:head" in groups) is not keep_head_local


def test_a_sparse_payload_costs_its_kept_values():
    t = torch.tensor([0.0, 1e-4, -2e-3, 0.5, 0.0, -7.0, 4e-4, 5e-4])
    assert Sparse(t).bits() == 6 * 32  # nonzeros
    assert Sparse(t, threshold=5e-4).bits() == 4 * 32  # |x| >= 5e-4: -2e-3, 0.5, -7, 5e-4
    assert Sparse(t.double(), threshold=5e-4, index_bits=16).bits() == 4 * (64 + 16)
    assert torch.equal(Sparse(t, threshold=5e-4).dense(), torch.tensor([0, 0, -2e-3, 0.5, 0, -7.0, 0, 5e-4]))


def test_a_message_of_several_groups_and_extras():
    message = Message({"u": torch.zeros(10), "v": torch.zeros(7, dtype=torch.float64),
                       "mu": Sparse(torch.tensor([0.0, 1.0, 2.0, 0.0])), "buffers": torch.zeros(3, dtype=torch.bfloat16)},
                      extras={"means": torch.zeros(2, 3), "weights": [0.5, 0.25], "loss": 1.0, "ids": torch.arange(4)},
                      num_examples=123)
    want = 10 * 32 + 7 * 64 + 2 * 32 + 3 * 16 + (6 * 32 + 2 * 32 + 32 + 4 * 64)
    assert message.bits() == want
    ledger = CommLedger()
    ledger.record("up", 2, message)
    ledger.record("down", 2, Message({"u": torch.zeros(10)}))
    assert ledger.total("up") == want and ledger.total("down") == 320
    assert ledger.by_client[("up", 2)] == want
    assert ledger.by_group[("up", "extras")] == 6 * 32 + 2 * 32 + 32 + 4 * 64
    assert ledger.by_group[("up", "mu")] == 64


class ReadsTheDownload(FedAvg):
    """FedAvg whose download is received but not loaded (``apply=False``); the plan's begin hook
    records the model the client starts from and what it received."""

    def configure(self, round_, clients):
        return Message({g: t + 1.0 for g, t in self.initial.items()}, apply=False)

    def setup(self, server):
        self.initial, self.seen = server.initial_model(["body", "head"]), {}

    def plan(self, client):
        from pfl_algorithms.api import Phase

        def begin(view):
            self.seen[client] = ({g: view.group(g).clone() for g in ("body", "head")},
                                 {g: view.download.dense(g) for g in ("body", "head")})
        return (Phase(begin=begin),)


def test_a_download_with_apply_false_is_received_and_counted_but_not_loaded():
    algo = ReadsTheDownload()
    fed = make_federation(algo, steps=1)
    own = {k: {g: fed.cohorts[0].params.row(k)[fed.cohorts[0].span(g)].clone() for g in ("body", "head")}
           for k in range(fed.num_clients)}
    run_round(fed, algo, 0)
    for k, (model, received) in algo.seen.items():
        for g in ("body", "head"):
            assert torch.equal(model[g], own[k][g])  # the client started from its own model
            assert torch.equal(received[g], algo.initial[g] + 1.0)  # and read what it received
    bits = sum(t.numel() for t in algo.initial.values()) * 64
    assert fed.comm.total("down") == fed.num_clients * bits  # received, so counted
    with pytest.raises(TypeError, match="apply must be True or False, got 1"):
        Message(apply=1)


def test_what_cannot_be_counted_is_refused():
    with pytest.raises(TypeError, match="str"):
        Message(extras={"note": "hello"})
    with pytest.raises(TypeError, match="tensor or Sparse"):
        Message({"u": [1.0, 2.0]})
    with pytest.raises(TypeError):
        payload_bits(object())
    with pytest.raises(ValueError, match="threshold"):
        Sparse(torch.zeros(2), threshold=-1.0)


def test_uploads_concat_puts_each_senders_tensors_side_by_side():
    from pfl_algorithms.engine.uploads import Uploads

    a = Message({"body": torch.arange(4.0).reshape(2, 2), "head": torch.tensor([9.0])}, num_examples=3)
    b = Message({"body": torch.arange(4.0, 8.0).reshape(2, 2), "head": torch.tensor([7.0])}, num_examples=5)
    uploads = Uploads([2, 5], [a, b])
    assert uploads.concat(["head", "body"]).tolist() == [[9.0, 0.0, 1.0, 2.0, 3.0], [7.0, 4.0, 5.0, 6.0, 7.0]]
    with pytest.raises(KeyError, match="sent no 'tail'"):
        uploads.concat(["tail"])

"""Each baseline's defining rule on a tiny hand-checkable case, and a few rounds end to end."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms import ALGORITHMS, make_algorithm
from pfl_algorithms.algorithms.fedavg import FedAvg
from pfl_algorithms.algorithms.fedavg_ft import FedAvgFT
from pfl_algorithms.algorithms.fedper import FedPer
from pfl_algorithms.algorithms.fedprox import FedProx
from pfl_algorithms.algorithms.local import Local
from pfl_algorithms.engine.local import client_batches
from pfl_algorithms.engine.rounds import evaluate_all, run_round

from .federation_cases import make_federation


def row(fed, client):
    """Client ``client``'s flat parameters (one cohort)."""
    return fed.cohorts[0].params.row(client)


def with_global(fed, algo, params):
    """``params`` with the shared groups replaced by the algorithm's global model."""
    params = params.clone()
    cohort = fed.cohorts[0]
    for group, value in algo.global_model.items():
        if group in cohort.groups.members:
            params[cohort.span(group)] = value
    return params


def batches_of(fed, client, round_, schedule=None, stream="train"):
    data = fed.clients[client]
    return list(client_batches(data.train, schedule or fed.settings.schedule, fed.generator(stream, round_, client)))


def sgd_steps(fed, client, start, batches, lr=0.1, prox=None):
    """Plain autograd SGD steps from ``start`` on a copy of the model; ``prox`` = (mu, anchor)."""
    module = copy.deepcopy(fed.cohorts[0].module)
    params = start.clone()
    names = [n for n, _ in module.named_parameters()]
    for batch in batches:
        leaves = {n: v.clone().requires_grad_(True) for n, v in fed.cohorts[0].layout.views(params).items()}
        x, y = fed.inputs[batch], fed.labels[batch]
        if fed.clients[client].label_map is not None:
            y = fed.clients[client].label_map[y]
        loss = F.cross_entropy(torch.func.functional_call(module, leaves, (x,)), y)
        flat = torch.cat([leaves[n].reshape(-1) for n in names])
        if prox is not None:
            mu, anchor = prox
            loss = loss + mu / 2 * (flat - anchor).square().sum()
        grads = torch.autograd.grad(loss, [leaves[n] for n in names])
        params = (flat - lr * torch.cat([g.reshape(-1) for g in grads])).detach()
    return params


def test_fedavg_global_is_the_size_weighted_mean_of_one_step_updates():
    algo = FedAvg()
    fed = make_federation(algo, steps=1)
    start = row(fed, 0).clone()
    updates = [sgd_steps(fed, k, start, batches_of(fed, k, 0)) for k in range(3)]
    run_round(fed, algo, 0)
    n = fed.train_sizes()
    want = sum(n[k] / n.sum() * updates[k] for k in range(3))
    torch.testing.assert_close(with_global(fed, algo, start), want, rtol=1e-12, atol=1e-12)
    # every client sent and received all shared parameters once, 64 bits each (a float64 model)
    assert fed.comm.total("up") == fed.comm.total("down") == 3 * 64 * start.numel()


def test_local_clients_never_communicate_and_train_independently():
    algo = Local()
    fed = make_federation(algo, steps=1)
    start = row(fed, 0).clone()
    updates = [sgd_steps(fed, k, start, batches_of(fed, k, 0)) for k in range(3)]
    run_round(fed, algo, 0)
    for k in range(3):
        torch.testing.assert_close(row(fed, k), updates[k], rtol=1e-12, atol=1e-12)
    assert fed.comm.total("up") == fed.comm.total("down") == 0


@pytest.mark.parametrize("steps", [1, 3])
def test_fedprox_steps_are_those_of_the_proximal_objective(steps):
    """Each client's local steps equal autograd SGD on CE + (mu/2)||w - w_global||^2."""
    mu = 0.7
    algo = FedProx(mu=mu)
    fed = make_federation(algo, steps=steps)
    start = row(fed, 1).clone()
    want = sgd_steps(fed, 1, start, batches_of(fed, 1, 0), prox=(mu, start))
    run_round(fed, algo, 0)
    torch.testing.assert_close(row(fed, 1), want, rtol=1e-12, atol=1e-12)
    if steps == 1:  # at the first step w = w_global: the same step as FedAvg's
        torch.testing.assert_close(want, sgd_steps(fed, 1, start, batches_of(fed, 1, 0)), rtol=0, atol=0)


def test_fedper_clients_start_each_round_from_their_own_head_and_the_global_body():
    algo = FedPer()
    fed = make_federation(algo, steps=1)
    cohort = fed.cohorts[0]
    head, body = cohort.span("head"), cohort.span("body")
    assert set(cohort.groups.local) == {"head"}
    run_round(fed, algo, 0)
    assert set(algo.global_model) == {"body"}  # the head is never sent
    assert fed.comm.total("down") == 3 * 64 * (body.stop - body.start)
    starts = []
    for k in range(3):
        start = row(fed, k).clone()
        start[body] = algo.global_model["body"]
        starts.append(start)
    assert not torch.equal(starts[0][head], starts[1][head])
    want = [sgd_steps(fed, k, starts[k], batches_of(fed, k, 1)) for k in range(3)]
    run_round(fed, algo, 1)
    for k in range(3):
        torch.testing.assert_close(row(fed, k), want[k], rtol=1e-12, atol=1e-12)


def test_finetune_epochs_finetunes_for_evaluation_only():
    base, ft0, ft = FedAvg(), FedAvg(), FedAvg()
    feds = [make_federation(a, finetune_epochs=e) for a, e in ((base, 0), (ft0, 0), (ft, 2))]
    for fed, a in zip(feds, (base, ft0, ft)):
        run_round(fed, a, 0)
    fed = feds[2]
    before = fed.cohorts[0].params.data.clone()
    evals = [evaluate_all(f, a) for f, a in zip(feds, (base, ft0, ft))]
    assert evals[1] == evals[0]  # no fine-tuning: the global model
    torch.testing.assert_close(fed.cohorts[0].params.data, before, rtol=0, atol=0)  # nothing stored
    # The fine-tuned model is the global model after 2 epochs of the run's SGD on the client's
    # training split, drawn from the round's fine-tuning stream.
    schedule = replace(fed.settings.schedule, epochs=2, steps=None)
    for client in range(3):
        start = with_global(fed, ft, before[client])
        tuned = sgd_steps(fed, client, start, batches_of(fed, client, fed.round, schedule, "finetune"))
        module = copy.deepcopy(fed.cohorts[0].module).eval()
        torch.nn.utils.vector_to_parameters(tuned, module.parameters())
        test = fed.clients[client].test
        with torch.no_grad():
            logits = module(fed.inputs[test])
        want_loss = float(F.cross_entropy(logits, fed.labels[test], reduction="sum").double() / test.numel())
        assert evals[2]["loss"][client] == pytest.approx(want_loss, rel=1e-10)
        assert evals[2]["loss"][client] != evals[0]["loss"][client]  # fine-tuning changed the model


def test_fedavg_ft_is_fedavg_finetuning_one_epoch_by_default():
    from pfl_algorithms.config import RunConfig
    assert issubclass(FedAvgFT, FedAvg) and "evaluation" not in vars(FedAvgFT)
    assert RunConfig(algorithm="fedavg-ft").finetune() == 1 and RunConfig(algorithm="fedavg").finetune() == 0
    assert RunConfig(algorithm="fedavg-ft", finetune_epochs=0).finetune() == 0
    assert RunConfig(algorithm="pfedme", finetune_epochs=3).finetune() == 3


def test_non_finite_update_is_not_aggregated():
    algo = FedAvg()
    fed = make_federation(algo, steps=1)
    fed.inputs[fed.clients[1].train] = float("nan")
    before = row(fed, 1).clone()
    record = run_round(fed, algo, 0)
    assert record.skipped == [1]
    torch.testing.assert_close(row(fed, 1), before, rtol=0, atol=0)  # its state from before the round
    assert all(torch.isfinite(v).all() for v in algo.global_model.values())
    assert fed.comm.by_client[("up", 1)] == 0 and fed.comm.by_client[("up", 0)] > 0


class LoudFedAvg(FedAvg):
    """FedAvg whose upload also carries an extra: non-finite for client 1 (``bad``: a float
    number, a tensor nested in a list, or a tensor of the upload itself)."""

    def __init__(self, bad):
        super().__init__()
        self.bad = bad

    def upload(self, view):
        message = super().upload(view)
        if view.client != 1:
            return replace(message, extras={"loss": 0.5, "parts": [torch.ones(2)]})
        if self.bad == "number":
            return replace(message, extras={"loss": float("inf"), "parts": [torch.ones(2)]})
        if self.bad == "tensor":
            return replace(message, extras={"loss": 0.5, "parts": [torch.tensor([1.0, float("nan")])]})
        first = next(iter(message.tensors))
        return replace(message, tensors={**message.tensors, first: message.dense(first) * 1e308 * 10})


@pytest.mark.parametrize("executor", ["sequential", "threaded", "batched"])
@pytest.mark.parametrize("bad", ["number", "tensor", "payload"])
def test_a_non_finite_upload_skips_its_client_as_flower_does(bad, executor):
    """Finite parameters, non-finite upload: the client is skipped (its rows kept, nothing of it
    aggregated), as Flower's server refuses a reply holding a non-finite value; before, the native
    executors aggregated it."""
    algo = LoudFedAvg(bad)
    fed = make_federation(algo, steps=1, executor=executor, workers=2 if executor == "threaded" else 1)
    before = row(fed, 1).clone()
    record = run_round(fed, algo, 0)
    assert record.skipped == [1]
    torch.testing.assert_close(row(fed, 1), before, rtol=0, atol=0)
    assert all(torch.isfinite(v).all() for v in algo.global_model.values())
    clean = FedAvg()
    fed = make_federation(clean, steps=1, executor=executor, workers=2 if executor == "threaded" else 1)
    fed.inputs[fed.clients[1].train] = float("nan")  # the same round with client 1 non-finite in training
    run_round(fed, clean, 0)
    for name, value in algo.global_model.items():
        torch.testing.assert_close(value, clean.global_model[name], rtol=0, atol=0)


@pytest.mark.parametrize("executor", ["sequential", "batched"])
def test_a_skipped_upload_keeps_the_clients_optimizer_state_too(executor):
    """With kept optimizer state (momentum), the client whose upload is not finite keeps its
    momentum rows and step count as they were; the batched executor stores each client's rows
    only where its check holds, selected on the device, and reads every check at once."""
    class LoudFromRound1(LoudFedAvg):
        def upload(self, view):
            return FedAvg.upload(self, view) if view.round == 0 else super().upload(view)

    algo = LoudFromRound1("payload")
    fed = make_federation(algo, steps=2, executor=executor, optimizer_state="keep",
                          optimizer_settings={"lr": 0.1, "momentum": 0.9})
    run_round(fed, algo, 0)  # every client finite: momentum and step counts exist
    cohort = fed.cohorts[0]
    (name, state), = cohort.optimizer_state.items()
    before = {vector: bank.row(1).clone() for vector, bank in state.items()}
    steps = cohort.optimizer_steps[name].clone()
    assert int(steps[1]) == 2 and any(v.abs().sum() > 0 for v in before.values())
    params = [row(fed, k).clone() for k in range(3)]
    record = run_round(fed, algo, 1)
    assert record.skipped == [1]
    for vector, bank in state.items():
        assert torch.equal(bank.row(1), before[vector])
    assert cohort.optimizer_steps[name].tolist() == [4, 2, 4]
    assert torch.equal(row(fed, 1), params[1]) and not torch.equal(row(fed, 0), params[0])


def test_resolving_later_results_reads_each_check_once_and_stores_only_the_finite():
    from pfl_algorithms.engine.client import PendingTrainResult, TrainResult, resolve_train_results
    from pfl_algorithms.engine.local import LocalResult

    local = LocalResult(loss=0.5, samples=3, steps=1, finite=True)
    rows = [torch.zeros(2) for _ in range(4)]
    value = torch.tensor([1.0, 2.0])
    pending = [PendingTrainResult(TrainResult(k, local, upload=object()), finite, [(rows[k], value)])
               for k, finite in enumerate([torch.tensor(True), torch.tensor(False), True, False])]
    results = resolve_train_results(pending)
    assert [r.finite for r in results] == [True, False, True, False]
    assert [r.upload is not None for r in results] == [True, False, True, False]
    assert [r.tolist() for r in rows] == [[1.0, 2.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]


def test_stores_across_devices_wait_for_the_check():
    """A row or a value on another device than the upload's check (the host's step counts
    beside a GPU's check) is not selected on the device but left for after the check's read;
    the rest is selected where the check is."""
    from types import SimpleNamespace

    from pfl_algorithms.engine import client as client_mod

    algo = FedAvg()
    fed = make_federation(algo, optimizer_state="keep", optimizer_settings={"lr": 0.1, "momentum": 0.9})
    run_round(fed, algo, 0)  # the kept state's banks exist from here
    cohort = fed.cohorts[0]
    view = SimpleNamespace(_cohort=cohort, client=1, _work=cohort.work, _extra={})
    (name, state), = cohort.optimizer_state.items()
    ones = {vector: torch.ones_like(bank.row(1)) for vector, bank in state.items()}
    steps = torch.tensor(7, device="meta")  # a value on another device than the check
    later = client_mod.store_client_rows(fed, view, {name: {**ones, "steps": steps}}, where=torch.tensor(True))
    assert later == [(later[0][0], steps)] and later[0][0].data_ptr() == cohort.optimizer_steps[name][1].data_ptr()
    for vector, bank in state.items():  # selected on the check's device: stored (the check holds)
        assert torch.equal(bank.row(1), ones[vector])
    later = client_mod.store_client_rows(fed, view, {name: {**ones, "steps": torch.tensor(9)}},
                                         where=torch.tensor(True, device="meta"))
    assert len(later) == 3 + len(state) + 1  # every row is on another device than this check


def test_message_finite_looks_at_every_floating_value():
    from pfl_algorithms.engine.client import message_finite
    from pfl_algorithms.engine.messages import Message

    ok = Message(tensors={"w": torch.ones(3, dtype=torch.bfloat16)},
                 extras={"n": 3, "x": 1.5, "deep": {"a": [(torch.zeros(2), 2.0)], "i": torch.tensor([7])},
})
    assert message_finite(ok) and message_finite(Message())
    assert not message_finite(replace(ok, tensors={"w": torch.tensor([1.0, float("-inf")])}))
    assert not message_finite(replace(ok, extras={"deep": {"a": [(torch.zeros(2), float("nan"))]}}))
    assert not message_finite(replace(ok, extras={"deep": {"a": [(torch.tensor([float("nan")]), 2.0)]}}))
    assert message_finite(replace(ok, extras={"big": torch.tensor([3e38]), "ints": torch.tensor([2 ** 62])}))
    # the largest values of two tensors, which overflow any sum in their own dtype, are finite
    top = torch.full((5,), torch.finfo(torch.float64).max, dtype=torch.float64)
    assert message_finite(Message(tensors={"a": top, "b": torch.full((3,), 3.4e38)}))
    assert not message_finite(Message(tensors={"a": top, "b": torch.tensor([float("inf")])}))
    assert not message_finite(Message(tensors={"a": torch.tensor([float("inf")]), "b": torch.tensor([-float("inf")])}))


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_few_rounds_learn_the_blobs(name):
    algo = make_algorithm(name)
    fed = make_federation(algo, rounds=8, epochs=2, clients_per_round=2)
    record = None
    for r in range(8):
        record = run_round(fed, algo, r)
    assert record.eval is not None and record.eval["mean_accuracy"] > 0.6
    assert len(record.clients) == 2


def test_unknown_settings_and_names_raise():
    with pytest.raises(ValueError, match="valid: mu"):
        make_algorithm("fedprox", tau=0.5)
    with pytest.raises(ValueError, match="fedavg"):
        make_algorithm("fedsgd")

"""Each baseline's defining rule on a tiny hand-checkable case, and a few rounds end to end."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms import ALGORITHMS, FedAvg, FedAvgFT, FedPer, FedProx, Local, make_algorithm
from pfl_algorithms.engine.federation import run_round
from pfl_algorithms.engine.local import client_batches

from .federation_cases import make_federation


def one_step_update(fed, client, start_params, round_=0, lr=0.1):
    """w - lr * grad of the client's first batch, by plain autograd on a copy of the model."""
    fed.work.params.copy_(start_params)
    module = copy.deepcopy(fed.work.module)
    data = fed.clients[client]
    batch = next(client_batches(data.train, fed.settings.schedule, fed.generator("train", round_, client)))
    loss = F.cross_entropy(module(fed.inputs[batch]), fed.labels[batch])
    grads = torch.autograd.grad(loss, list(module.parameters()))
    return torch.cat([(p - lr * g).reshape(-1) for p, g in zip(module.parameters(), grads)]).detach()


def test_fedavg_global_is_the_size_weighted_mean_of_one_step_updates():
    algo = FedAvg()
    fed = make_federation(algo, steps=1)
    start = fed.params.row(0).clone()
    updates = [one_step_update(fed, k, start) for k in range(3)]
    run_round(fed, algo, 0)
    n = fed.train_sizes()
    want = sum(n[k] / n.sum() * updates[k] for k in range(3))
    torch.testing.assert_close(algo.global_params, want, rtol=1e-12, atol=1e-12)
    # every client sent and received all shared parameters once
    assert fed.comm.total("up") == fed.comm.total("down") == 3 * 32 * start.numel()


def test_local_clients_never_communicate_and_train_independently():
    algo = Local()
    fed = make_federation(algo, steps=1)
    start = fed.params.row(0).clone()
    updates = [one_step_update(fed, k, start) for k in range(3)]
    run_round(fed, algo, 0)
    for k in range(3):
        torch.testing.assert_close(fed.params.row(k), updates[k], rtol=1e-12, atol=1e-12)
    assert fed.comm.total("up") == fed.comm.total("down") == 0


def test_fedprox_pull_starts_at_zero_and_then_acts():
    """At the first local step w = w_global, so the proximal gradient is zero; later it is not."""
    results = {}
    for steps in (1, 2):
        prox, plain = FedProx(mu=0.7), FedAvg()
        fed_prox, fed_plain = make_federation(prox, steps=steps), make_federation(plain, steps=steps)
        run_round(fed_prox, prox, 0)
        run_round(fed_plain, plain, 0)
        results[steps] = (prox.global_params, plain.global_params)
    torch.testing.assert_close(*results[1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(*results[2])


def test_fedprox_term_matches_autograd_of_the_proximal_loss():
    mu = 0.5
    algo = FedProx(mu=mu)
    fed = make_federation(algo, steps=1)
    terms = algo.local_terms(fed, 0)["grad_terms"]
    params = algo.global_params.clone() + 0.3
    full = fed.params.row(0).clone()
    full[fed.shared] = params
    grads = torch.zeros_like(full)
    value = terms[0](full, grads)
    want = torch.zeros_like(full)
    want[fed.shared] = mu * (params - algo.global_params)
    torch.testing.assert_close(grads, want)
    torch.testing.assert_close(value, 0.5 * mu * (0.3 ** 2) * params.numel() * torch.ones((), dtype=value.dtype))


def test_fedper_keeps_each_head_and_averages_the_body():
    algo = FedPer()
    fed = make_federation(algo, rounds=2)
    heads = [n for n in fed.layout.names() if n.startswith("head.")]
    assert set(fed.local_names) == set(heads)
    for r in range(2):
        run_round(fed, algo, r)
    head_span = fed.layout.span(heads)
    rows = fed.params.data[:, head_span]
    assert not torch.allclose(rows[0], rows[1])  # heads personal
    assert algo.global_params.numel() == fed.layout.numel - rows.shape[1]  # the head is never sent


def test_fedavg_ft_finetunes_for_evaluation_only():
    base, ft0, ft = FedAvg(), FedAvgFT(finetune_epochs=0), FedAvgFT(finetune_epochs=2)
    feds = [make_federation(a) for a in (base, ft0, ft)]
    for fed, a in zip(feds, (base, ft0, ft)):
        run_round(fed, a, 0)
    before = feds[2].params.data.clone()
    acc_base = base.evaluate_client(feds[0], 0)
    assert ft0.evaluate_client(feds[1], 0) == acc_base  # no fine-tuning: the global model
    ft.evaluate_client(feds[2], 0)
    torch.testing.assert_close(feds[2].params.data, before, rtol=0, atol=0)


def test_non_finite_update_is_not_aggregated():
    algo = FedAvg()
    fed = make_federation(algo, steps=1)
    fed.inputs[fed.clients[1].train] = float("nan")
    before = fed.params.row(1).clone()
    record = run_round(fed, algo, 0)
    assert record.skipped == [1]
    # client 1 keeps the state it had when the round began (the global model it received)
    torch.testing.assert_close(fed.params.row(1), before, rtol=0, atol=0)
    assert torch.isfinite(algo.global_params).all()
    assert fed.comm.by_client[("up", 1)] == 0 and fed.comm.by_client[("up", 0)] > 0


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_few_rounds_learn_the_blobs(name):
    algo = make_algorithm(name)
    fed = make_federation(algo, rounds=8, epochs=2, sample=2)
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


def test_concurrent_clients_give_the_same_result_for_any_worker_count():
    """Each worker trains its client on one thread, one worker too: 1, 2 or 3 workers give
    bitwise the same round."""
    results = {}
    for workers in (1, 2, 3):
        algo = FedAvg()
        fed = make_federation(algo, rounds=2, workers=workers)
        for r in range(2):
            run_round(fed, algo, r)
        results[workers] = (algo.global_params.clone(), fed.params.data.clone())
    for workers in (2, 3):
        assert torch.equal(results[1][0], results[workers][0]) and torch.equal(results[1][1], results[workers][1])

"""Factorized-FL α and β: the matching weights and personalized aggregates on hand-computable v
vectors, what each variant sends, the L1 gradient, μ's sparse count, Table 1's cost column
from a dry run of the accounting, and a few rounds on digits (stopped, then resumed by a fresh
process, bitwise)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pfl_algorithms.algorithms import make_algorithm
from pfl_algorithms.algorithms.factorized_fl import l1_term, matching_weights
from pfl_algorithms.api import Message, Uploads
from pfl_algorithms.engine.checkpoint import read_checkpoint
from pfl_algorithms.engine.rounds import run_round
from pfl_kernels.nn import FactorizedLinear
from tests.algorithms.test_kill_resume import assert_resume_bitwise, metric_lines

from .federation_cases import make_federation

# Four clients' penultimate v: cosines with v0 are 1, 1/√2, 0, -1.
V = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)


def softmax_row(sims, scale):
    e = [math.exp(scale * s) for s in sims]
    return [x / sum(e) for x in e]


def test_matching_weights_keep_tau_then_min_keep_with_self_one():
    w = matching_weights(V, tau=0.5, scale=2.0, min_keep=0)
    r = 1 / math.sqrt(2)
    # Client 0 keeps itself (1) and client 1 (1/√2 >= 0.5); client 1 keeps 0 and 2 (1/√2 each).
    assert w[0].tolist() == pytest.approx([*softmax_row([1, r], 2), 0, 0], abs=1e-12)
    assert w[1].tolist() == pytest.approx(softmax_row([r, 1, r], 2) + [0], abs=1e-12)
    assert w[3].tolist() == pytest.approx([0, 0, 0, 1], abs=1e-12)  # nobody reaches τ: itself alone
    # min_keep 3: client 0 adds the next most similar (client 2, σ = 0) below τ.
    w = matching_weights(V, tau=0.5, scale=2.0, min_keep=3)
    assert w[0].tolist() == pytest.approx([*softmax_row([1, r, 0], 2), 0], abs=1e-12)
    assert w[3].tolist() == pytest.approx([0, softmax_row([1, 0, -r], 2)[2], softmax_row([1, 0, -r], 2)[1],
                                           softmax_row([1, 0, -r], 2)[0]], abs=1e-12)


def _uploads(clients, groups):
    messages = [Message({g: rows[i] for g, rows in groups.items()}, num_examples=10) for i in range(len(clients))]
    return Uploads(clients, messages)


@pytest.mark.parametrize("variant", ["alpha", "beta"])
def test_each_client_gets_its_own_aggregate_from_the_snapshot(variant):
    alg = make_algorithm(f"factorized-fl-{variant}", tau=0.5, scale=2.0, min_keep=0)
    alg.server = SimpleNamespace(num_clients=6)
    alg.setup(alg.server)
    u = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dtype=torch.float64)
    mu = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    clients = [0, 2, 3, 5]  # senders; the bank rows are client ids
    alg.aggregate(0, _uploads(clients, {"u": u, "v_last": V, "mu": mu}))
    r = 1 / math.sqrt(2)
    w0, w1 = softmax_row([1, r], 2), softmax_row([r, 1, r], 2)
    assert alg.personal["u"][0].tolist() == pytest.approx((w0[0] * u[0] + w0[1] * u[1]).tolist(), abs=1e-12)
    assert alg.personal["u"][2].tolist() == pytest.approx((w1[0] * u[0] + w1[1] * u[1] + w1[2] * u[2]).tolist(),
                                                          abs=1e-12)
    assert alg.personal["u"][5].tolist() == u[3].tolist()  # alone: its own u, not one already aggregated
    assert alg.ready.tolist() == [True, False, True, True, False, True]
    assert alg.personal["u"][[1, 4]].abs().sum() == 0
    if variant == "alpha":
        assert set(alg.personal) == {"u"}  # v_last only matches; μ was not even expected
    else:
        assert set(alg.personal) == {"u", "v_last", "mu"}
        assert alg.personal["v_last"][0].tolist() == pytest.approx((w0[0] * V[0] + w0[1] * V[1]).tolist(), abs=1e-12)
        assert alg.personal["mu"][2].tolist() == pytest.approx(
            (w1[0] * mu[0] + w1[1] * mu[1] + w1[2] * mu[2]).tolist(), abs=1e-12)
    sent = alg.configure(1, torch.tensor([0, 1]))
    assert sent[1] is None and sent[0].tensors["u"].tolist() == alg.personal["u"][0].tolist()


class TwoLayer(nn.Module):
    """Body of two Linear layers (so v and the penultimate v_last differ) + a head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x))


def _bits(*sizes):
    return 64 * sum(sizes)  # float64 federation


def test_alpha_sends_u_and_v_last_beta_everything_but_the_local_head():
    # Factorized: body.0 u [4,1] v [1,5] mu [4,5] bias 5; body.2 u [5,1] v [1,6] mu [5,6] bias 6.
    u, v, v_last, mu, body, head = 4 + 5, 5, 6, 20 + 30, 5 + 6, 6 * 3 + 3
    for variant, up, down in (("alpha", _bits(u, v_last), _bits(u)), ("beta", None, None)):
        alg = make_algorithm(f"factorized-fl-{variant}", min_keep=2)
        fed = make_federation(alg, models=TwoLayer().double(), keep_head_local=True, rounds=2)
        members = fed.cohorts[0].groups.members
        assert members["v_last"] == ("body.2.v",) and members["v"] == ("body.0.v",)
        assert members["mu"] == ("body.0.mu", "body.2.mu") and members["u"] == ("body.0.u", "body.2.u")
        first, second = run_round(fed, alg, 0), run_round(fed, alg, 1)
        assert first.bits_down == 0  # every client starts from the same model
        if variant == "alpha":
            assert first.bits_up == second.bits_up == 3 * up and second.bits_down == 3 * down
            assert set(alg.personal) == {"u"}
        else:
            mu_kept = [int((fed.cohorts[0].params.row(k)[fed.cohorts[0].span("mu")].abs() >= 5e-4).sum())
                       for k in range(3)]
            assert second.bits_up == 3 * _bits(u, v, v_last, body) + _bits(sum(mu_kept))  # μ: kept entries only
            assert set(alg.personal) == {"u", "v", "v_last", "mu", "body"}  # the head never leaves


def test_l1_term_is_the_gradient_of_lambda_times_the_l1_norm():
    layer = FactorizedLinear(3, 2).double()
    with torch.no_grad():
        layer.mu.copy_(torch.tensor([[0.5, -0.2], [0.0, 3.0], [-1e-3, 0.0]], dtype=torch.float64))
    lam = 0.25
    (lam * layer.sparsity_loss()).backward()
    mu = layer.mu.detach().reshape(-1).clone()
    grad = torch.zeros_like(mu)
    view = SimpleNamespace(group=lambda g: mu, grad=lambda g: grad)
    loss = l1_term(lam)(view)
    assert grad.tolist() == layer.mu.grad.reshape(-1).tolist() == [0.25, -0.25, 0, 0.25, -0.25, 0]
    assert float(loss) == pytest.approx(lam * 3.701, rel=1e-12)


def test_beta_counts_mu_by_its_entries_above_the_threshold():
    alg = make_algorithm("factorized-fl-beta", threshold=0.02)
    fed = make_federation(alg, rounds=1)
    cohort = fed.cohorts[0]
    seen = {}
    original = alg.aggregate
    alg.aggregate = lambda round_, uploads: (seen.update(zip(uploads.clients.tolist(), uploads.messages)),
                                             original(round_, uploads))
    run_round(fed, alg, 0)
    assert seen
    for k, message in seen.items():
        mu = cohort.params.row(k)[cohort.span("mu")]  # what client k trained and sent
        kept = mu.abs() >= 0.02
        assert 0 < int(kept.sum()) < mu.numel()  # the threshold drops some entries and keeps others
        assert message.tensors["mu"].bits() == int(kept.sum()) * 64
        assert torch.equal(message.dense("mu"), torch.where(kept, mu, torch.zeros_like(mu)))


@pytest.mark.parametrize("variant", ["alpha", "beta"])
@pytest.mark.parametrize("finetune_epochs", [0, 1])
def test_the_model_evaluated_has_mu_below_the_threshold_at_zero(monkeypatch, variant, finetune_epochs):
    """The released code zeroes |μ| < λ at evaluation (shared/papers/README.md), after any
    fine-tuning; the client's own μ keeps those entries."""
    import pfl_algorithms.engine.client as engine_client
    from pfl_algorithms.engine.rounds import evaluate_all

    alg = make_algorithm(f"factorized-fl-{variant}", threshold=0.02, min_keep=2)
    fed = make_federation(alg, rounds=1, finetune_epochs=finetune_epochs)
    run_round(fed, alg, 0)
    cohort = fed.cohorts[0]
    stored = torch.stack([cohort.params.row(k).clone() for k in range(3)])
    scored = []
    original = engine_client.evaluate
    monkeypatch.setattr(engine_client, "evaluate", lambda module, *args, **kwargs: (
        scored.append(torch.cat([m.mu.detach().reshape(-1).clone() for m in module.modules() if hasattr(m, "mu")])),
        original(module, *args, **kwargs))[1])
    evaluate_all(fed, alg)
    assert len(scored) == 3 and all(torch.equal(cohort.params.row(k), stored[k]) for k in range(3))  # nothing stored
    for k, mu in enumerate(scored):
        assert bool(((mu == 0) | (mu.abs() >= 0.02)).all())
        own = stored[k][cohort.span("mu")]
        small = (own != 0) & (own.abs() < 0.02)
        assert int(small.sum()) > 0
        if not finetune_epochs:  # the client's own model, its small entries zeroed
            assert torch.equal(mu, torch.where(small, torch.zeros_like(own), own))
    monkeypatch.setattr(engine_client, "evaluate", original)
    no_threshold = make_algorithm(f"factorized-fl-{variant}", threshold=0.0, min_keep=2)
    assert no_threshold.evaluation(0) is None


def test_table1_cost_column_from_a_dry_run():
    """The dense figures of Factorized-FL's Table 1 (GB, both directions; pfl_algorithms/reproduce/costs.py)."""
    from pfl_algorithms.reproduce.costs import table1

    costs = table1()
    assert costs["fedavg"] == pytest.approx(20.594256, rel=1e-9)  # 2,574,282 floats × 4 B × 2000 messages
    assert costs["fedavg"] == pytest.approx(20.39, rel=0.02)  # the paper's figure, within 2%
    assert costs["factorized-fl-alpha"] == pytest.approx((1000 * (88 + 65536) + 980 * 88) * 4 / 1e9, rel=1e-12)
    assert costs["factorized-fl-beta"] == pytest.approx((1980 * 279074) * 4 / 1e9, rel=1e-12)  # μ = 0 untrained


ROUNDS = 6
ARGS = ["--dataset", "digits", "--clients", "5", "--rounds", str(ROUNDS), "--scenario", "permuted-iid", "--lr", "0.05",
        "--batch-size", "32", "--quiet", "--set", "min_keep=3"]


@pytest.mark.parametrize("variant", ["alpha", "beta"])
def test_a_few_rounds_on_digits_lower_the_loss(tmp_path, variant):
    from pfl_algorithms.config import RunConfig, check
    from pfl_algorithms.runner import run

    pytest.importorskip("sklearn")
    config = check(RunConfig(algorithm=f"factorized-fl-{variant}", dataset="digits", scenario="permuted-iid",
                             clients=5, rounds=4, batch_size=32, lr=0.05, local_epochs=2, algorithm_settings={"min_keep": 3}))
    run(config, tmp_path, progress=False)
    lines = metric_lines(tmp_path)
    loss = [sum(m["train_loss"].values()) / 5 for m in lines]
    assert len(lines) == 4 and loss[-1] < loss[0] and all(math.isfinite(x) for x in loss)
    assert lines[-1]["eval"]["mean_accuracy"] > 0.2  # chance is 0.1 (0.46 α, 0.29 β at this seed)
    state = read_checkpoint(tmp_path / "checkpoint.pt")
    assert all(torch.isfinite(t).all() for t in state["algorithm"]["personal"].values())


@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
@pytest.mark.parametrize("variant", ["alpha", "beta"])
@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_stop_then_resume_in_a_fresh_process_is_bitwise(tmp_path, variant):
    pytest.importorskip("sklearn")
    assert_resume_bitwise(tmp_path, [f"factorized-fl-{variant}", *ARGS], ROUNDS)


@pytest.mark.parametrize("name", ["factorized-fl-alpha", "factorized-fl-beta", "simfed"])
def test_init_svd_computes_the_dense_models_function_and_paper_starts_mu_at_zero(name):
    """``init='svd'``: the factorized model equals the dense model it was made from (u vᵀ the best
    rank-1 part, μ the rest); ``init='paper'`` (the default): u, v Xavier-uniform, μ = 0."""
    import copy

    from pfl_algorithms.models import build_model
    from pfl_kernels.nn import factorized_layers

    torch.manual_seed(0)
    dense = build_model("digits-cnn", input_shape=(1, 8, 8), num_classes=10).double().eval()
    x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    svd = make_algorithm(name, init="svd").prepare_model(copy.deepcopy(dense))
    torch.testing.assert_close(svd(x), dense(x), rtol=1e-9, atol=1e-9)
    paper = make_algorithm(name).prepare_model(copy.deepcopy(dense))
    assert all(float(layer.mu.detach().abs().sum()) == 0.0 for layer in factorized_layers(paper))
    assert not torch.allclose(paper(x), dense(x))

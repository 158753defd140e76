"""Fed-CMA and FedAvg on the classifier (Fed-CMA's Table 2): Eq. 5's value and gradient against
autograd on a float64 reference, Eq. 7's moving averages, p_i and p_i^k on a known split, the
fixed per-class batch, and runs of a federation of three architectures (both executors, stopped
and resumed by a fresh process bitwise, nothing of an extractor ever sent)."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pfl_algorithms.algorithms.fedcma import (FedCMA, alignment_loss, class_mean_average, client_shares,
                                              moving_average, per_class_batch)
from pfl_algorithms.api import Message, Uploads
from pfl_algorithms.config import RunConfig, check
from pfl_algorithms.engine.rounds import run_round
from pfl_algorithms.models.base import BodyHeadModel
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from .federation_cases import make_federation

pytestmark = pytest.mark.heavy(seconds=25)  # scheduled first under xdist (tests/conftest.py)

TOL = dict(rtol=1e-12, atol=1e-12)


def sigmoid_net():
    """body: Linear(4, 5) + sigmoid (embeddings in [0, 1]); head: Linear(5, 3); float64."""
    torch.manual_seed(0)
    return BodyHeadModel(nn.Sequential(nn.Linear(4, 5), nn.Sigmoid()), 5, 3).double()


# ---------------------------------------------------------------- shares, batch, Eq. 7 by hand

def test_client_shares_on_a_known_split():
    counts = torch.tensor([[6, 0, 2], [2, 0, 0], [0, 0, 8]], dtype=torch.float64)
    p, p_k = client_shares(counts)
    torch.testing.assert_close(p, torch.tensor([8, 2, 8], dtype=torch.float64) / 18, **TOL)
    torch.testing.assert_close(p_k, torch.tensor([[0.75, 0, 0.2], [0.25, 0, 0], [0, 0, 0.8]], dtype=torch.float64),
                               **TOL)


def test_per_class_batch_takes_b_of_each_class_or_all_and_depends_only_on_the_generator():
    labels = torch.tensor([2, 0, 2, 2, 1, 2, 0, 2, 2])
    chosen = per_class_batch(labels, 3, torch.Generator().manual_seed(1))
    assert labels[chosen].tolist() == [0, 0, 1, 2, 2, 2]  # class 0 and 1 have fewer than 3: all of them
    assert set(chosen[3:].tolist()) < {0, 2, 3, 5, 7, 8} and chosen[3:].tolist() == sorted(chosen[3:].tolist())
    assert torch.equal(chosen, per_class_batch(labels, 3, torch.Generator().manual_seed(1)))
    others = {tuple(per_class_batch(labels, 3, torch.Generator().manual_seed(s))[3:].tolist()) for s in range(8)}
    assert len(others) > 1  # a random choice, not the first ones
    assert per_class_batch(labels[:0], 3, torch.Generator()).numel() == 0


def test_eq7_moving_averages_and_per_class_weights_by_hand():
    means = torch.tensor([[[1.0, 2.0], [9.0, 9.0]], [[3.0, 6.0], [5.0, 1.0]]], dtype=torch.float64)  # [M=2, C=2, d=2]
    counts = torch.tensor([[4, 0], [2, 3]])
    p_k = torch.tensor([[0.2, 0.5], [0.6, 0.5]], dtype=torch.float64)
    average, held = class_mean_average(means, counts, p_k)
    # class 0: both senders, weights 0.2 and 0.6 renormalized; class 1: only the second holds it
    torch.testing.assert_close(average, torch.tensor([[0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6], [5.0, 1.0]],
                                                     dtype=torch.float64), **TOL)
    assert held.tolist() == [True, True]
    torch.testing.assert_close(moving_average(torch.tensor([1.0, 4.0]), torch.tensor([3.0, 0.0]), 0.25),
                               torch.tensor([1.5, 3.0]))


def test_aggregate_follows_eq7_after_the_first_round_sets_v_bar_and_the_means():
    algo = FedCMA(lam1=2.0, lam2=4.0)
    fed = make_federation(algo, models=sigmoid_net(), lr=0.1)
    p, p_k = client_shares(algo.server.class_counts())
    heads = [torch.randn(18, dtype=torch.float64) for _ in range(3)]
    means = [torch.rand(3, 5, dtype=torch.float64) for _ in range(3)]
    counts = [torch.tensor([2, 0, 1]), torch.tensor([1, 1, 0]), torch.tensor([0, 3, 0])]

    def uploads(senders):
        return Uploads(senders, [Message({"head": heads[i]}, {"class_means": (means[i], counts[i])}, 1)
                                 for i in senders])

    algo.aggregate(0, uploads([0, 1, 2]))
    torch.testing.assert_close(algo.v_bar, sum(p[i] * heads[i] for i in range(3)), **TOL)
    first, _ = class_mean_average(torch.stack(means), torch.stack(counts), p_k)
    assert algo.has_mean.tolist() == [True, True, True]
    torch.testing.assert_close(algo.means, first, **TOL)
    v_bar, e = algo.v_bar.clone(), algo.means.clone()
    heads = [h + 1 for h in heads]
    algo.aggregate(1, uploads([0, 2]))  # partial participation: p renormalized over the senders
    v_avg = (p[0] * heads[0] + p[2] * heads[2]) / (p[0] + p[2])
    torch.testing.assert_close(algo.v_bar, (1 - 0.2) * v_bar + 0.2 * v_avg, **TOL)
    second, held = class_mean_average(torch.stack([means[0], means[2]]), torch.stack([counts[0], counts[2]]),
                                      p_k[[0, 2]])
    assert held.tolist() == [True, True, True]
    torch.testing.assert_close(algo.means, (1 - 0.4) * e + 0.4 * second, **TOL)


def test_lambda_times_lr_outside_0_1_is_refused_before_training():
    with pytest.raises(ValueError, match=r"lam2·lr = 30.0·0.05 = 1.5 must be in \(0, 1\]"):
        make_federation(FedCMA(lam2=30.0), models=sigmoid_net(), lr=0.05)
    with pytest.raises(ValueError, match="lam1"):
        make_federation(FedCMA(lam1=20.0), models=sigmoid_net(), lr=0.1)
    with pytest.raises(ValueError, match="lam1 must be"):
        FedCMA(lam1=0.0)
    with pytest.raises(ValueError, match="keeps it local"):
        check(RunConfig(algorithm="fedcma", dataset="digits", scenario="permuted-iid"))


# ---------------------------------------------------------------- Eq. 5 against autograd

def test_eq5_value_and_gradient_match_autograd_on_a_float64_reference():
    """One full-batch SGD step of round 1 (after round 0 set v̄ and e): the step is −η·∇Φ_i with
    Φ_i Eq. 5 written out by hand, and the reported loss is Φ_i."""
    lr, lam1, lam2, b = 0.1, 1.5, 3.0, 4
    algo = FedCMA(lam1=lam1, lam2=lam2, per_class_batch=b)
    fed = make_federation(algo, models=sigmoid_net(), lr=lr, batch_size=100, steps=1)
    run_round(fed, algo, 0)
    cohort = fed.cohort_of(0)
    client = 1
    before = cohort.params.row(cohort.row(client)).clone()
    v_bar, e, p, p_k = algo.v_bar.clone(), algo.means.clone(), algo.p[client], algo.p_k[client]
    record = run_round(fed, algo, 1)
    after = cohort.params.row(cohort.row(client))

    module = copy.deepcopy(cohort.module)
    flat = before.clone().requires_grad_(True)
    views = cohort.layout.views(flat)
    train = fed.clients[client].train
    x, y = fed.inputs[train], fed.labels[train]
    chosen = per_class_batch(y, b, fed.generator("client", -1, client))
    xb, yb = x[chosen], y[chosen]
    logits = torch.func.functional_call(module, views, (x,))
    embeddings = torch.func.functional_call(module.body, {k[5:]: v for k, v in views.items() if k.startswith("body.")},
                                            (xb,))
    v = flat[cohort.span("head")]
    phi = F.cross_entropy(logits, y) + lam1 / 2 * p * (v - v_bar).square().sum()
    for k in range(3):
        members = yb == k
        if members.any():
            phi = phi + lam2 / 2 * p_k[k] / members.sum() * (embeddings[members] - e[k]).square().sum()
    (grad,) = torch.autograd.grad(phi, flat)
    torch.testing.assert_close(after, before - lr * grad, **TOL)
    assert math.isclose(record.train_loss[client], float(phi.detach()), rel_tol=1e-12)
    # the alignment term as the module writes it
    value = alignment_loss(embeddings, yb, e, torch.ones(3, dtype=torch.bool), p_k,
                           torch.bincount(yb, minlength=3), lam2)
    assert float(value.detach()) > 1e-3  # the term is really there
    rest = (phi - F.cross_entropy(logits, y) - lam1 / 2 * p * (v - v_bar).square().sum()).detach()
    assert math.isclose(float(value.detach()), float(rest), rel_tol=1e-10)


def test_the_fixed_batch_is_the_same_every_round():
    seen = []

    class Recording(FedCMA):
        def _fixed_batch(self, view):
            x, y = super()._fixed_batch(view)
            seen.append((view.round, view.client, x.clone(), y.clone()))
            return x, y

    algo = Recording(per_class_batch=3)
    fed = make_federation(algo, models=sigmoid_net())
    for round_ in range(3):
        run_round(fed, algo, round_)
    by_client = {}
    for round_, client, x, y in seen:
        by_client.setdefault(client, []).append((x, y))
    for client, batches in by_client.items():
        assert len(batches) == 3  # once a round: the loss term and the upload share it (view.cached)
        assert all(torch.equal(x, batches[0][0]) and torch.equal(y, batches[0][1]) for x, y in batches)
        assert all(int((batches[0][1] == k).sum()) <= 3 for k in range(3))


# ---------------------------------------------------------------- federations of three architectures

ARCHITECTURES = '["digits-cnn(embedding_dim=32)", "mlp(hidden=(64, 32))", "fedgen-cnn"]'
MIXED = ["--dataset", "digits", "--scenario", "dirichlet", "--clients", "6", "--quiet",
         "--set", f"architectures={ARCHITECTURES}"]


def pfl_run(*args):
    return subprocess.run([sys.executable, "-m", "pfl_algorithms", "run", *args], capture_output=True, text=True)


@pytest.mark.parametrize("algorithm", ["fedcma", "fedavg-classifier"])
@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_three_architectures_stop_and_resume_is_bitwise_and_only_the_classifier_travels(tmp_path, algorithm):
    pytest.importorskip("sklearn")
    rounds = 5
    reference, state = assert_resume_bitwise(tmp_path, [algorithm, *MIXED, "--rounds", str(rounds)], rounds,
                                                  stop_after=2)
    mean = [sum(m["train_loss"].values()) / len(m["train_loss"]) for m in reference]
    assert all(math.isfinite(v) for v in mean) and mean[-1] < mean[0]
    cohorts = state["federation"]["cohorts"]
    assert len(cohorts) == 3
    for cohort in cohorts.values():
        assert torch.isfinite(cohort["params"]).all()
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    sent = {key for key, bits in summary["comm_gb"]["by_group"].items() if bits > 0}
    # no body (extractor) tensor ever leaves a client: up, the head (and Fed-CMA's means as extras)
    assert sent == ({"up:head", "up:extras", "down:extras"} if algorithm == "fedcma" else {"up:head", "down:head"})
    by_cohort = summary["comm_gb"]["by_cohort"]
    assert {key.split(":", 1)[1] for key in by_cohort} == set(cohorts)
    assert math.isclose(sum(v for k, v in by_cohort.items() if k.startswith("up:")), summary["comm_gb"]["up"],
                        rel_tol=1e-12)


@pytest.mark.parametrize("algorithm", ["fedcma", "fedavg-classifier", "local"])
def test_three_architectures_give_the_same_numbers_under_both_executors(tmp_path, algorithm):
    pytest.importorskip("sklearn")
    from pfl_algorithms.cli import _parser, config_from_args
    from pfl_algorithms.runner import run

    runs = {}
    for executor in ("threaded", "sequential"):
        # In this process: a `pfl run` process would add its start (about 5 s on 2 cores) to
        # each run; the command line itself is checked by the other tests here.
        out = tmp_path / executor
        args = _parser().parse_args(["run", algorithm, *MIXED, "--rounds", "2", "--executor", executor,
                                     *(["--workers", "2"] if executor == "threaded" else [])])
        run(config_from_args(args), out, progress=False)
        runs[executor] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(runs["threaded"], runs["sequential"]):
        a.pop("wall_s"), b.pop("wall_s")
        assert a == b


def test_an_algorithm_sharing_the_body_refuses_a_mixed_federation_naming_it_and_the_cohorts(tmp_path):
    done = pfl_run("fedavg", *MIXED, "--rounds", "1", "--out", str(tmp_path / "x"))
    assert done.returncode != 0
    line = done.stderr.strip().splitlines()[-1]
    assert "'fedavg' trains one architecture" in line
    assert "'digits-cnn(embedding_dim=32)': clients 0, 3" in line and "'fedgen-cnn': clients 2, 5" in line
    assert "fedavg-classifier, fedcma" in line and "Traceback" not in done.stderr


def test_one_architecture_gets_bounded_embeddings_unless_the_run_names_an_activation():
    """Assumption 2 (embeddings in [0, 1]): on one architecture the model's embedding takes a
    sigmoid, recorded in the config; a named activation is kept; a mixed federation's options
    are left to the per-architecture default."""
    from pfl_algorithms.config import RunConfig, check

    config = check(RunConfig(algorithm="fedcma", dataset="digits", scenario="dirichlet"))
    assert config.model_options["embedding_activation"] == "sigmoid"
    config = check(RunConfig(algorithm="fedcma", dataset="digits", scenario="dirichlet",
                             model_options={"embedding_activation": "relu"}))
    assert config.model_options["embedding_activation"] == "relu"
    assert "embedding_activation" not in check(RunConfig(algorithm="fedavg", dataset="digits")).model_options
    mixed = check(RunConfig(algorithm="fedcma", dataset="digits", scenario="dirichlet",
                            scenario_options={"architectures": ["digits-cnn", "mlp"]}))
    assert "embedding_activation" not in mixed.model_options

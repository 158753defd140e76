"""FedDAF's baselines: FedGP's per-tensor projection (positive cosines only, β), FedDWA's weights
and guidance pass, target-only's silence; then a few rounds of each on digits ``fda`` (the
target's loss goes down, the state stays finite, a stopped run resumed with --resume is bitwise)."""
from __future__ import annotations

import math

import pytest
import torch

from pfl_algorithms.algorithms.feddwa import FedDWA, dwa_weights, keep_trained
from pfl_algorithms.algorithms.fedgp import FedGP, projection_coefficients
from pfl_algorithms.algorithms.target_only import TargetOnly
from pfl_algorithms.api import Message
from pfl_algorithms.engine.local import client_batches
from pfl_algorithms.engine.rounds import run_round
from pfl_algorithms.engine.uploads import Uploads
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from .federation_cases import BatchNormNet, make_federation
from .test_baselines import batches_of, row, sgd_steps

TOL = dict(rtol=1e-12, atol=1e-12)
TARGET = 2  # make_federation's target for algorithms that need roles: the last of 3 clients


def rows(fed):
    return torch.stack([row(fed, k) for k in range(fed.num_clients)])


# ---------------------------------------------------------------- FedGP


def test_projection_keeps_positive_cosines_only_and_weighs_by_beta():
    g_target = torch.tensor([1.0, 0.0], dtype=torch.float64)
    g_sources = torch.tensor([[2.0, 2.0], [-1.0, 1.0], [0.0, 0.0], [0.0, -3.0]], dtype=torch.float64)
    shares = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)
    # Proj₊(g_T | g_1) = <g_T, g_1>/‖g_1‖² g_1 = 2/8 g_1; the others conflict (cos < 0), are zero,
    # or are orthogonal: no weight.
    paper = projection_coefficients(g_target, g_sources, shares, 0.3, "paper")
    torch.testing.assert_close(paper, torch.tensor([0.7, 0.3 * 0.4 * 0.25, 0.0, 0.0, 0.0], dtype=torch.float64), **TOL)
    cosine = projection_coefficients(g_target, g_sources, shares, 0.3)  # the default: the README facts' rule
    torch.testing.assert_close(cosine, torch.tensor([0.7, 0.3 * 0.4 / math.sqrt(2), 0.0, 0.0, 0.0],
                                                    dtype=torch.float64), **TOL)
    assert projection_coefficients(g_target, g_sources, shares, 0.0).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def fedgp_step(old, updates, target, sources, shares, beta, projection="paper"):
    """The FedGP step on one tensor, written out: old + (1 − β)g_T + β Σ p_i max(<g_T, g_i>, 0)/‖g_i‖² g_i
    (``'paper'``), or with max(cos_i, 0)·g_i (``'cosine'``, the README facts' rule)."""
    g_t = updates[target]
    step = (1 - beta) * g_t
    for p, i in zip(shares, sources):
        g_i = updates[i]
        if projection == "paper":
            step = step + beta * p * max(float(g_t @ g_i), 0.0) / float(g_i @ g_i) * g_i
        else:
            step = step + beta * p * max(float(g_t @ g_i) / float(g_t.norm() * g_i.norm()), 0.0) * g_i
    return old + step


@pytest.mark.parametrize("projection", ["cosine", "paper"])
def test_a_round_moves_the_global_model_by_the_projection_per_tensor(projection):
    beta = 0.4
    algo = FedGP(beta=beta, projection=projection)
    fed = make_federation(algo, steps=2)
    old = row(fed, 0).clone()
    run_round(fed, algo, 0)
    updates = rows(fed) - old  # every client started from the global model
    n = fed.train_sizes()[:2]
    shares = (n / n.sum()).tolist()
    want = old.clone()
    for entry in fed.cohorts[0].layout.entries:  # tensor by tensor
        part = slice(entry.offset, entry.stop)
        want[part] = fedgp_step(old[part], updates[:, part], TARGET, [0, 1], shares, beta, projection)
    got = torch.cat([algo.global_model["body"], algo.global_model["head"]])
    torch.testing.assert_close(got, want, **TOL)
    # Projecting whole groups at once is another rule, which this round tells apart.
    span = fed.cohorts[0].span("body")
    by_group = fedgp_step(old[span], updates[:, span], TARGET, [0, 1], shares, beta, projection)
    assert not torch.allclose(by_group, want[span], rtol=1e-6, atol=1e-9)
    assert 0 <= algo.round_metrics(0)["positive_cosines"] <= 1


def test_batchnorm_statistics_are_the_targets_and_a_round_without_the_target_changes_nothing():
    algo = FedGP()
    fed = make_federation(algo, steps=1, models=BatchNormNet().double())
    run_round(fed, algo, 0)
    cohort = fed.cohorts[0]
    torch.testing.assert_close(algo.global_model["buffers"], cohort.buffers.row(cohort.row(TARGET)), rtol=0, atol=0)
    before = {g: t.clone() for g, t in algo.global_model.items()}
    sources_only = Uploads([0, 1], [Message({g: t + 1.0 for g, t in before.items()}, num_examples=5)] * 2)
    algo.aggregate(1, sources_only)
    for g, t in before.items():
        assert torch.equal(algo.global_model[g], t)
    assert algo.round_metrics(1)["positive_cosines"] is None


def test_fedgp_trains_the_target_with_its_own_settings():
    algo = FedGP(target_lr=0.03)
    fed = make_federation(algo, steps=1)
    start = row(fed, TARGET).clone()
    want = sgd_steps(fed, TARGET, start, batches_of(fed, TARGET, 0), lr=0.03)
    run_round(fed, algo, 0)
    torch.testing.assert_close(row(fed, TARGET), want, **TOL)


@pytest.mark.parametrize("executor", ["threaded", "batched"])
def test_released_step_scaling_weighs_each_source_by_the_targets_step_budget(executor):
    """τ from each upload's step count (one epoch of batches of 16: ⌈n_i/16⌉ steps), η_T = 0.03
    against the run's 0.1: source i's share × (0.03·τ_T)/(0.1·τ_i)."""
    beta = 0.5
    algo = FedGP(beta=beta, step_scaling=True, target_lr=0.03)
    fed = make_federation(algo, executor=executor, sizes=(30, 50, 70))
    old = row(fed, 0).clone()
    run_round(fed, algo, 0)
    updates = rows(fed) - old
    n = fed.train_sizes()[:2]
    steps = [math.ceil(int(size) / 16) for size in fed.train_sizes()]
    assert len(set(steps)) == 3
    shares = [float(n[i] / n.sum()) * (0.03 * steps[TARGET]) / (0.1 * steps[i]) for i in range(2)]
    want = old.clone()
    for entry in fed.cohorts[0].layout.entries:
        part = slice(entry.offset, entry.stop)
        want[part] = fedgp_step(old[part], updates[:, part], TARGET, [0, 1], shares, beta, "cosine")
    torch.testing.assert_close(torch.cat([algo.global_model["body"], algo.global_model["head"]]), want, **TOL)


def test_released_fedavg_rounds_average_every_upload_first():
    algo = FedGP(fedavg_rounds=1)
    fed = make_federation(algo, steps=2)
    run_round(fed, algo, 0)  # FedAvg of the three uploads, target included
    n = fed.train_sizes().double()
    torch.testing.assert_close(torch.cat([algo.global_model["body"], algo.global_model["head"]]),
                               (n / n.sum()) @ rows(fed), **TOL)
    assert algo.round_metrics(0)["positive_cosines"] is None
    start = torch.cat([algo.global_model["body"], algo.global_model["head"]]).clone()
    run_round(fed, algo, 1)  # then FedGP
    updates = rows(fed) - start
    shares = (n[:2] / n[:2].sum()).tolist()
    want = start.clone()
    for entry in fed.cohorts[0].layout.entries:
        part = slice(entry.offset, entry.stop)
        want[part] = fedgp_step(start[part], updates[:, part], TARGET, [0, 1], shares, 0.5, "cosine")
    torch.testing.assert_close(torch.cat([algo.global_model["body"], algo.global_model["head"]]), want, **TOL)


# ---------------------------------------------------------------- FedDWA


def test_dwa_weights_by_hand():
    models = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    guidance = torch.tensor([[0.5, 0.0], [1.0, 1.0], [0.0, 3.0]], dtype=torch.float64)
    # squared distances: row 0 (0.25, 0.25, 4.25); row 1 (2, 1, 2); row 2 (9, 10, 1)
    inverse = torch.tensor([[4.0, 4.0, 1 / 4.25], [0.5, 1.0, 0.5], [1 / 9, 0.1, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(dwa_weights(guidance, models, 3), inverse / inverse.sum(1, keepdim=True), **TOL)
    top2 = torch.tensor([[0.5, 0.5, 0.0], [0.5 / 1.5, 1 / 1.5, 0.0], [1 / 9 / (1 + 1 / 9), 0.0, 1 / (1 + 1 / 9)]],
                        dtype=torch.float64)
    # row 1 ties at 0.5: topk keeps one of them; either way the row is the two largest, renormalized
    got = dwa_weights(guidance, models, 2)
    torch.testing.assert_close(got[[0, 2]], top2[[0, 2]], **TOL)
    assert got[1, 1] == pytest.approx(2 / 3) and sorted(got[1].tolist()) == pytest.approx([0.0, 1 / 3, 2 / 3])
    torch.testing.assert_close(got.sum(1), torch.ones(3, dtype=torch.float64), **TOL)
    # a model equal to a guidance model takes that row's whole weight
    guidance[1] = models[2]
    assert dwa_weights(guidance, models, 3)[1].tolist() == [0.0, 0.0, 1.0]


def test_a_feddwa_round_personalizes_by_the_guidance_pass():
    algo = FedDWA(top_k=2)
    fed = make_federation(algo, steps=1)
    assert algo.target is None  # no roles: every client alike
    assert algo.configure(0, torch.arange(3)) == {0: None, 1: None, 2: None}  # nothing personalized yet
    start = row(fed, 0).clone()
    trained, guidance = [], []
    for k in range(3):  # the two phases draw their batches one after the other from the task's generator
        generator = fed.generator("train", 0, k)
        first = list(client_batches(fed.clients[k].train, fed.settings.schedule, generator))
        second = list(client_batches(fed.clients[k].train, fed.settings.schedule, generator))
        trained.append(sgd_steps(fed, k, start, first))
        guidance.append(sgd_steps(fed, k, trained[-1], second))
    seen = []
    aggregate = algo.aggregate
    algo.aggregate = lambda round_, uploads: (seen.append(uploads), aggregate(round_, uploads))
    run_round(fed, algo, 0)
    (uploads,) = seen
    assert "buffers" not in uploads.messages[0].tensors  # only parameters travel
    models, guides = torch.stack(trained), torch.stack(guidance)
    for k in range(3):
        torch.testing.assert_close(row(fed, k), models[k], **TOL)  # the client keeps w_i
        message = uploads.messages[k]
        torch.testing.assert_close(torch.cat([message.tensors["body"], message.tensors["head"]]), models[k], **TOL)
        torch.testing.assert_close(torch.cat([message.extras["guidance"]["body"], message.extras["guidance"]["head"]]),
                                   guides[k], **TOL)
    sqdist = torch.cdist(guides, models).square()
    weights = 1 / sqdist
    weights = weights * (weights >= weights.topk(2, dim=1).values[:, -1:])
    weights = weights / weights.sum(1, keepdim=True)
    torch.testing.assert_close(algo.personal, weights @ models, rtol=1e-9, atol=1e-12)
    sent = algo.configure(1, torch.tensor([2]))[2]
    torch.testing.assert_close(torch.cat([sent.tensors["body"], sent.tensors["head"]]), algo.personal[2], **TOL)
    assert algo.evaluation(2).download is not None


def test_feddwa_in_fda_trains_the_target_with_its_settings_and_refuses_them_without_a_target():
    algo = FedDWA(target_lr=0.02, target_batch_size=4)
    make_federation(algo, roles={"source": [0, 1], "target": [2]})
    local, look_ahead = algo.plan(2)
    assert (local.lr, local.batch_size, look_ahead.lr, look_ahead.batch_size) == (0.02, 4, 0.02, 4)
    assert look_ahead.begin is keep_trained and algo.plan(0)[0].lr is None
    with pytest.raises(ValueError, match="target_lr, target_batch_size need a target client"):
        make_federation(FedDWA(target_lr=0.02, target_batch_size=4))


@pytest.mark.parametrize("name", ["fedavg", "fedavg-ft", "fedper"])
def test_fedavg_trains_the_target_with_its_settings_and_refuses_them_without_a_target(name):
    """FedDAF's paper trains every method's target alike (§5.2.4): FedAvg's target took the run's
    local steps while the other methods' took one epoch at the target's lr and batch."""
    from pfl_algorithms.algorithms import ALGORITHMS

    algo = ALGORITHMS[name](target_lr=0.02, target_batch_size=4, target_epochs=1)
    make_federation(algo, roles={"source": [0, 1], "target": [2]})
    (target,), (source,) = algo.plan(2), algo.plan(0)
    assert (target.lr, target.batch_size, target.epochs) == (0.02, 4, 1)
    assert (source.lr, source.batch_size, source.epochs) == (None, None, None)
    with pytest.raises(ValueError, match="target_lr, target_batch_size, target_epochs need a target client"):
        make_federation(ALGORITHMS[name](target_lr=0.02, target_batch_size=4, target_epochs=1))
    plain = ALGORITHMS[name]()  # without the settings, the target trains as any client
    make_federation(plain, roles={"source": [0, 1], "target": [2]})
    assert plain.plan(2) == plain.plan(0)


# ---------------------------------------------------------------- target-only


def test_target_only_sends_nothing_and_only_the_target_trains():
    algo = TargetOnly(target_lr=0.05)
    fed = make_federation(algo, steps=2)
    before = rows(fed).clone()
    want = sgd_steps(fed, TARGET, before[TARGET], batches_of(fed, TARGET, 0), lr=0.05)
    record = run_round(fed, algo, 0)
    assert fed.comm.total("up") == fed.comm.total("down") == 0
    assert torch.equal(rows(fed)[:TARGET], before[:TARGET])  # the sources did not move
    torch.testing.assert_close(row(fed, TARGET), want, **TOL)
    assert math.isnan(record.train_loss[0]) and math.isnan(record.train_loss[1])  # no batch at all
    assert math.isfinite(record.train_loss[TARGET])


def test_settings_and_roles_are_checked():
    for cls, bad, key in ((FedGP, {"beta": 1.5}, "beta"), (FedGP, {"projection": "code"}, "projection"),
                          (FedDWA, {"top_k": 0}, "top_k"), (TargetOnly, {"target_lr": 0.0}, "target_lr"),
                          (TargetOnly, {"target_batch_size": 0}, "target_batch_size")):
        with pytest.raises(ValueError, match=key):
            cls(**bad)
    from pfl_algorithms.config import RunConfig, check
    for name in ("fedgp", "target-only"):
        with pytest.raises(ValueError, match="needs clients with the roles source, target.*--scenario fda"):
            check(RunConfig(algorithm=name, scenario="dirichlet"))
    check(RunConfig(algorithm="feddwa", scenario="dirichlet"))
    with pytest.raises(ValueError, match="exactly one target"):
        make_federation(FedGP(), roles={"source": [0], "target": [1, 2]})


# ---------------------------------------------------------------- digits fda, end to end

ROUNDS = 4


def assert_finite(state, path="state"):
    if isinstance(state, torch.Tensor):
        assert not state.is_floating_point() or torch.isfinite(state).all(), path
    elif isinstance(state, dict):
        for key, value in state.items():
            assert_finite(value, f"{path}.{key}")


@pytest.mark.parametrize("algorithm", ["fedgp", "feddwa", "target-only"])
@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_digits_fda_target_loss_goes_down_and_stop_and_resume_is_bitwise(tmp_path, algorithm):
    pytest.importorskip("sklearn")
    args = [algorithm, "--dataset", "digits", "--scenario", "fda", "--clients", "5", "--rounds", str(ROUNDS),
            "--quiet", "--set", "noise=0.6", "--set", "target_fraction=0.5"]
    reference, state = assert_resume_bitwise(tmp_path, args, ROUNDS, stop_after=2)
    target = "4"
    losses = [m["train_loss"][target] for m in reference]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert_finite(state["federation"])
    assert_finite(state["algorithm"])
    if algorithm == "target-only":
        assert all(m["bits_up"] == m["bits_down"] == 0 for m in reference)
        assert all(m["train_loss"][k] is None for m in reference for k in "0123")  # NaN, written as null

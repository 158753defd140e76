"""FedDAF: the Gompertz weight, the mean gradient field, the mixing step (BatchNorm statistics
left alone), the source averaging, the roles; then a few rounds on digits ``fda`` (the target's
loss goes down, the state stays finite, a stopped run resumed with --resume is bitwise)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pfl_algorithms.algorithms.feddaf import FedDAF, gompertz_weight, gradient_angle, source_weights
from pfl_algorithms.api import BUFFERS, Message
from pfl_algorithms.engine.client import ClientView
from pfl_algorithms.engine.rounds import run_round
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from .federation_cases import BatchNormNet, make_federation

TOL = dict(rtol=1e-12, atol=1e-12)
ROLES = {"source": [0, 1], "target": [2]}


class SoftmaxRegression(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Identity()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.body(x))


def test_gompertz_weight_at_known_angles():
    for theta, k, want in ((0.0, 5.0, 1 - math.exp(-math.exp(5.0))), (1.0, 5.0, 1 - math.exp(-1.0)),
                           (math.pi / 2, 5.0, 1 - math.exp(-math.exp(-5 * (math.pi / 2 - 1)))),
                           (math.pi, 5.0, 1 - math.exp(-math.exp(-5 * (math.pi - 1)))), (1.0, 1.0, 1 - math.exp(-1.0))):
        assert gompertz_weight(theta, k) == pytest.approx(want, rel=1e-12)
    assert gompertz_weight(0.0, 5.0) > 0.999 and gompertz_weight(math.pi, 5.0) < 1e-4
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])
    assert gradient_angle(a, b) == pytest.approx(math.pi / 4, abs=1e-6)
    assert gradient_angle(a, -a) == pytest.approx(math.pi, abs=1e-6)


def test_mean_gradient_field_of_a_softmax_regression_in_closed_form():
    """For logits = xWᵀ + b the batch gradient is ((softmax − onehot)ᵀ x, Σ(softmax − onehot)) / n;
    the field's mean is over the target's mini-batches in order (the last one shorter)."""
    torch.manual_seed(0)
    algo = FedDAF()
    fed = make_federation(algo, clients=3, roles=ROLES, models=SoftmaxRegression().double())
    cohort, client = fed.cohorts[0], 2
    work = cohort.work
    work.load(cohort.params.row(cohort.row(client)), cohort.buffers.row(cohort.row(client)))
    view = ClientView(fed, cohort, client, 0, None, {})
    got = view.mean_gradient("train", batch_size=8)
    W, b = [p.detach() for p in cohort.module.parameters()]
    train = fed.clients[client].train
    grads = []
    for start in range(0, train.numel(), 8):
        idx = train[start:start + 8]
        x, y = fed.inputs[idx], fed.labels[idx]
        err = (torch.softmax(x @ W.T + b, 1) - F.one_hot(y, 3).double()) / len(idx)
        grads.append(torch.cat([(err.T @ x).flatten(), err.sum(0)]))
    torch.testing.assert_close(got, torch.stack(grads).mean(0), **TOL)
    assert not work.grads.any()  # left as it was


def test_adapt_mixes_parameters_by_the_gompertz_weight_and_keeps_batchnorm_statistics():
    algo = FedDAF(k=3.0)
    fed = make_federation(algo, clients=3, roles=ROLES, models=BatchNormNet().double())
    cohort, target = fed.cohorts[0], 2
    row = cohort.row(target)
    cohort.buffers.row(row).uniform_(0.5, 1.5)  # the target's own BatchNorm statistics
    work = cohort.work
    work.load(cohort.params.row(row), cohort.buffers.row(row), cohort.int_buffers.row(row))
    own_params, own_buffers = work.params.clone(), work.buffers.clone()
    source = {g: t + 0.3 * torch.randn_like(t) for g, t in algo.source_model().items()}
    source["buffers"] = torch.full_like(source["buffers"], 7.0)
    view = ClientView(fed, cohort, target, 0, Message(source, apply=False), {})
    g_target = view.mean_gradient("train", 16)
    work.params[cohort.span("body")] = source["body"]
    work.params[cohort.span("head")] = source["head"]
    g_source = view.mean_gradient("train", 16)
    work.params.copy_(own_params)
    algo.adapt(view)
    theta = gradient_angle(g_source, g_target)
    alpha = gompertz_weight(theta, 3.0)
    assert view._values.reported["fda"].tolist() == pytest.approx([alpha, theta])  # sent with the upload
    for g in ("body", "head"):
        torch.testing.assert_close(view.group(g), alpha * source[g] + (1 - alpha) * own_params[cohort.span(g)], **TOL)
    assert torch.equal(work.buffers, own_buffers)


def test_a_target_without_training_data_takes_the_source_model_and_is_not_dropped():
    """Its upload carried θ = NaN, so the engine dropped it as diverged (skipped_non_finite) and
    the round reported no α, where the docstring says it takes w_S with α = 1."""
    import dataclasses

    algo = FedDAF()
    fed = make_federation(algo, clients=3, roles=ROLES)
    fed.clients[2] = dataclasses.replace(fed.clients[2], train=fed.clients[2].train[:0])
    record = run_round(fed, algo, 0)
    assert record.as_dict()["skipped_non_finite"] == []
    assert record.algorithm == {"target_alpha": 1.0, "target_theta": None}
    flat = torch.cat([algo.global_model["body"], algo.global_model["head"]])
    source = torch.stack([fed.cohorts[0].params.row(k) for k in range(2)]).mean(0)
    torch.testing.assert_close(flat, source, **TOL)
    reloaded = FedDAF()
    make_federation(reloaded, clients=3, roles=ROLES)
    reloaded.load_state_dict(algo.state_dict())
    assert reloaded.round_metrics(1) == record.algorithm
    old = {**algo.state_dict(), "last": torch.tensor([1.0, math.nan], dtype=torch.float64)}  # before (α,)
    reloaded.load_state_dict(old)
    assert reloaded.round_metrics(1) == record.algorithm


def test_sources_average_and_the_target_is_not_in_it():
    algo = FedDAF()
    fed = make_federation(algo, clients=3, roles=ROLES)
    record = run_round(fed, algo, 0)
    rows = torch.stack([fed.cohorts[0].params.row(k) for k in range(3)])
    flat = torch.cat([algo.global_model["body"], algo.global_model["head"]])
    torch.testing.assert_close(flat, rows[:2].mean(0), **TOL)
    assert record.algorithm["target_alpha"] == pytest.approx(gompertz_weight(0.0, 5.0))  # round 0: w_T = w_S
    w = source_weights(rows[:2], rows[2], "distance")
    d = (rows[:2] - rows[2]).norm(dim=1)
    torch.testing.assert_close(w[0], torch.softmax(-d, 0), **TOL)
    with pytest.raises(ValueError, match="role 'target'"):
        make_federation(FedDAF(), clients=3, roles={"source": [0, 1, 2]})
    from pfl_algorithms.config import RunConfig, check
    with pytest.raises(ValueError, match="needs clients with the roles source, target.*--scenario fda"):
        check(RunConfig(algorithm="feddaf", scenario="dirichlet"))


def test_distance_weighting_measures_parameters_and_averages_statistics_with_the_same_weights():
    """source_weighting='distance': softmax(−‖w_i − w_T‖) over the parameters only; the sources'
    BatchNorm statistics are averaged with those weights."""
    algo = FedDAF(source_weighting="distance")
    fed = make_federation(algo, clients=3, roles=ROLES, models=BatchNormNet().double())
    uploads = {}
    aggregate = algo.aggregate
    algo.aggregate = lambda round_, u: (uploads.setdefault("u", u), aggregate(round_, u))
    run_round(fed, algo, 0)
    u = uploads["u"]
    rows = u.concat(algo.groups)
    weights = torch.softmax(-(rows[:2] - rows[2]).norm(dim=1), 0)
    params = torch.cat([algo.global_model[g] for g in algo.groups])
    torch.testing.assert_close(params, weights @ rows[:2], **TOL)
    torch.testing.assert_close(algo.global_model[BUFFERS], weights @ u.stack(BUFFERS)[:2], **TOL)
    assert not torch.allclose(weights, torch.full((2,), 0.5, dtype=torch.float64))  # not the plain mean


def test_settings_are_checked():
    for bad, key in (({"k": 0.0}, "k"), ({"source_weighting": "softmax"}, "source_weighting"),
                     ({"target_batch_size": 0}, "target_batch_size")):
        with pytest.raises(ValueError, match=key):
            FedDAF(**bad)


ROUNDS = 4


@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_digits_fda_target_loss_goes_down_and_stop_and_resume_is_bitwise(tmp_path):
    pytest.importorskip("sklearn")
    args = ["feddaf", "--dataset", "digits", "--scenario", "fda", "--clients", "5", "--rounds", str(ROUNDS),
            "--quiet", "--set", "noise=0.6", "--set", "target_fraction=0.5"]
    reference, state = assert_resume_bitwise(tmp_path, args, ROUNDS, stop_after=2)
    target = "4"
    losses = [m["train_loss"][target] for m in reference]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert all(0.0 <= m["algorithm"]["target_alpha"] <= 1.0 for m in reference)
    for tensor in state["algorithm"]["global_model"].values():
        assert torch.isfinite(tensor).all()

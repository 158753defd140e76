"""pFedPara and Agnostic-FL: each rule on a tiny hand-computable case, then a few rounds on
digits through the CLI with stop / --resume."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from pfl_algorithms.algorithms.agnostic_fl import AgnosticFL, ascend_lambda
from pfl_algorithms.algorithms.pfedpara import PFedPara
from pfl_algorithms.engine.rounds import run_round
from pfl_algorithms.models import build_model
from pfl_kernels.nn import FedParaConv2d, FedParaLinear, fedpara, fedpara_rank
from tests.algorithms.engine.test_client_view import cross_entropy
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from .federation_cases import make_federation

TOL = dict(rtol=1e-12, atol=1e-12)
f64 = dict(dtype=torch.float64)


# ---------------------------------------------------------------------------------- pFedPara


def test_linear_weight_is_w1_hadamard_w2_plus_one():
    torch.manual_seed(0)
    layer = FedParaLinear(7, 5, rank=3, **f64)
    for p in layer.parameters():
        nn.init.normal_(p)  # O(1) factors: W2 + 1 is far from 1
    w1 = torch.zeros(5, 7, **f64)
    w2 = torch.zeros(5, 7, **f64)
    for r in range(3):  # Σ_r x_r y_rᵀ, one rank-1 term at a time
        w1 += torch.outer(layer.x1[:, r], layer.y1[:, r]).detach()
        w2 += torch.outer(layer.x2[:, r], layer.y2[:, r]).detach()
    want = w1 * (w2 + 1)
    torch.testing.assert_close(layer.full_weight().detach(), want, **TOL)
    x = torch.randn(4, 7, **f64)
    torch.testing.assert_close(layer(x).detach(), x @ want.T + layer.bias.detach(), **TOL)


def test_conv_weight_is_the_tensor_form_hadamard_product():
    torch.manual_seed(1)
    layer = FedParaConv2d(3, 5, (3, 2), rank=2, stride=2, padding=1, **f64)
    for p in layer.parameters():
        nn.init.normal_(p)
    t1, x1, y1, t2, x2, y2 = (getattr(layer, n).detach() for n in ("t1", "x1", "y1", "t2", "x2", "y2"))
    w1 = torch.zeros(5, 3, 3, 2, **f64)
    w2 = torch.zeros(5, 3, 3, 2, **f64)
    for a in range(2):  # T ×₁ X ×₂ Y: Σ_ab T[a, b] x_a y_bᵀ
        for b in range(2):
            w1 += torch.outer(x1[:, a], y1[:, b])[:, :, None, None] * t1[a, b]
            w2 += torch.outer(x2[:, a], y2[:, b])[:, :, None, None] * t2[a, b]
    want = w1 * (w2 + 1)
    torch.testing.assert_close(layer.full_weight().detach(), want, **TOL)
    x = torch.randn(2, 3, 7, 5, **f64)
    torch.testing.assert_close(layer(x).detach(), F.conv2d(x, want, layer.bias.detach(), 2, 1), **TOL)
    # contiguous, so the convolution's output is too: einsum's channels-last weight made it
    # channels-last, which GroupNorm's rule under vmap refuses (the batched executor's)
    assert layer.full_weight().is_contiguous() and layer(x).is_contiguous()


def test_pfedpara_on_a_groupnorm_cnn_runs_batched_as_sequential(tmp_path):
    """The digits CNN with its default GroupNorm on the batched executor (it stopped with "NYI:
    querying is_contiguous inside of vmap"): the sequential run's losses, up to GroupNorm's
    reassociation under vmap."""
    pytest.importorskip("sklearn")
    import json

    from pfl_algorithms.cli import main

    losses = {}
    for executor in ("sequential", "batched"):
        out = tmp_path / executor
        assert main(["run", "pfedpara", "--dataset", "digits", "--model", "digits-cnn", "--clients", "3",
                     "--rounds", "2", "--samples-per-client", "60", "--executor", executor, "--quiet",
                     "--out", str(out)]) == 0
        losses[executor] = [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    for batched, sequential in zip(losses["batched"], losses["sequential"]):
        for client, loss in sequential.items():
            assert batched[client] == pytest.approx(loss, rel=1e-3)


@pytest.mark.parametrize("make", [lambda: FedParaLinear(5, 3, rank=2, **f64),
                                  lambda: FedParaConv2d(2, 3, 3, rank=2, padding=1, **f64)], ids=["linear", "conv"])
def test_layer_gradients_pass_gradcheck(make):
    torch.manual_seed(2)
    layer = make()
    names = [n for n, _ in layer.named_parameters()]
    x = torch.randn(2, 5, **f64) if isinstance(layer, FedParaLinear) else torch.randn(1, 2, 4, 5, **f64)
    x.requires_grad_(True)

    def f(x, *params):
        return functional_call(layer, dict(zip(names, params)), (x,))

    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    assert torch.autograd.gradcheck(f, (x, *params))


def test_rank_follows_the_papers_ratio():
    # Linear 784→200, γ = 0.5: r_min = min(⌈√200⌉, ⌈√784⌉) = 15, r_max = ⌊156800 / 1968⌋ = 79: ⌈47⌉.
    assert fedpara_rank(200, 784, 1, 0.5) == 47
    # Conv 64→128 3x3: r_min = 8; 9R² + 192R ≤ 36864 holds for R = 54 (36612), not 55 (37785).
    assert [fedpara_rank(128, 64, 9, g) for g in (0.0, 0.5, 1.0)] == [8, 31, 54]
    assert fedpara_rank(3, 2, 1, 0.5) == 1  # r_max = 0: never below 1


def test_converter_replaces_every_layer_and_keeps_biases():
    torch.manual_seed(3)
    model = build_model("digits-cnn", input_shape=(1, 8, 8), num_classes=10)
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("bias")}
    fedpara(model, 0.5)
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d, FedParaLinear, FedParaConv2d))]
    assert len(layers) == 4 and all(isinstance(m, (FedParaLinear, FedParaConv2d)) for m in layers)
    for name, value in biases.items():
        assert torch.equal(dict(model.named_parameters())[name], value)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match="groups=1"):
        fedpara(nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)))


def test_he_init_draws_each_factor_with_the_authors_fan():
    # The authors' layouts: Linear X (in×R), Y (out×R); conv T (R×R×kh×kw), X (R×out), Y (R×in),
    # each kaiming_normal_(mode='fan_out', nonlinearity='relu'): std √(2 / dim 0 · receptive field).
    torch.manual_seed(0)
    model = fedpara(nn.Sequential(nn.Conv2d(48, 96, 3), nn.Flatten(), nn.Linear(300, 400)), 0.5, init="he")
    conv, linear = model[0], model[2]
    r, k = conv.rank, 9
    for tensor, fan in ((conv.t1, r * k), (conv.x1, r), (conv.y2, r), (linear.x1, 400), (linear.y2, 300)):
        assert tensor.std().item() == pytest.approx(math.sqrt(2 / fan), rel=0.1)
    variance = fedpara(nn.Sequential(nn.Linear(300, 400)), 0.5)[0]  # ours: W1 with nn.Linear's variance
    w1 = variance.x1 @ variance.y1.T
    assert w1.var().item() == pytest.approx(1 / 900, rel=0.15)
    with pytest.raises(ValueError, match="init must be one of"):
        fedpara(nn.Sequential(nn.Linear(3, 4)), 0.5, init="xavier")
    assert PFedPara(init="he").settings.init == "he"
    with pytest.raises(ValueError, match="init"):
        PFedPara(init="kaiming")


@pytest.mark.parametrize("keep_head_local", [False, True])
def test_only_w1_and_the_shared_groups_travel(keep_head_local):
    algo = PFedPara()
    fed = make_federation(algo, keep_head_local=keep_head_local)
    cohort = fed.cohorts[0]
    members = cohort.groups.members
    assert members["w1"] == ("body.0.x1", "body.0.y1")
    assert members["w2"] == ("body.0.x2", "body.0.y2", "head.x2", "head.y2")
    assert members["head"] == ("head.x1", "head.y1", "head.bias")
    sent = {"w1", "body"} | (set() if keep_head_local else {"head"})
    assert set(algo.global_model) == sent
    w2_before = torch.stack([cohort.params.row(k)[cohort.span("w2")] for k in range(3)])
    record = run_round(fed, algo, 0)
    size = sum(cohort.span(g).stop - cohort.span(g).start for g in sent)
    assert record.bits_up == record.bits_down == 3 * size * 64
    # The server's W1 is FedAvg of the clients' W1; every W2 stayed and trained at its client.
    w1 = torch.stack([cohort.params.row(k)[cohort.span("w1")] for k in range(3)])
    n = fed.train_sizes()
    torch.testing.assert_close(algo.global_model["w1"], (n / n.sum()) @ w1, **TOL)
    w2_after = torch.stack([cohort.params.row(k)[cohort.span("w2")] for k in range(3)])
    assert not torch.equal(w2_after, w2_before) and not torch.equal(w2_after[0], w2_after[1])


def test_communication_on_resnet9_against_fedavg():
    """No training: what one pFedPara message holds on the paper's ResNet-9, as a share of FedAvg's."""
    def shared_share(ratio):
        model = build_model("resnet9", input_shape=(3, 32, 32), num_classes=10)
        total = sum(p.numel() for p in model.parameters())
        fedpara(model, ratio)
        local = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[1] in ("x2", "y2", "t2"))
        return (sum(p.numel() for p in model.parameters()) - local) / total

    assert shared_share(0.5) == pytest.approx(0.1868, abs=1e-4)  # our default: 18.7 % of FedAvg
    # Factorized-FL's Table 1: pFedPara 7.4 against FedAvg's 20.39 (36.3 %): γ = 0.8 is within 2 %.
    assert shared_share(0.8) == pytest.approx(7.4 / 20.39, rel=0.02)


# ------------------------------------------------------------------------------- Agnostic-FL


def test_lambda_step_inside_the_simplex():
    lam = torch.full((3,), 1 / 3, **f64)
    # λ + g = (1/3 + .3, 1/3 + .6, 1/3 + .9), sum 2.8: every coordinate moves down by 0.6.
    got = ascend_lambda(lam, torch.tensor([0, 1, 2]), torch.tensor([0.3, 0.6, 0.9], **f64), 1.0)
    torch.testing.assert_close(got, torch.tensor([1 / 3 - 0.3, 1 / 3, 1 / 3 + 0.3], **f64), **TOL)
    assert torch.equal(lam, torch.full((3,), 1 / 3, **f64))  # a new tensor


def test_lambda_step_onto_the_boundary():
    lam = torch.tensor([0.2, 0.3, 0.5], **f64)
    # λ + g = (0.2, 0.7, 1.1): τ = (0.7 + 1.1 − 1)/2 = 0.4 keeps two coordinates, 0.2 − 0.4 < 0 is cut.
    got = ascend_lambda(lam, torch.tensor([0, 1, 2]), torch.tensor([0.0, 0.4, 0.6], **f64), 1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.3, 0.7], **f64), **TOL)
    # Only the senders' coordinates move: clients 2 and 0 sent losses 2 and 0 → (0.2, 0.3, 2.5) → e_2.
    got = ascend_lambda(lam, torch.tensor([2, 0]), torch.tensor([2.0, 0.0], **f64), 1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 1.0], **f64), **TOL)


def test_afl_round_weights_updates_by_lambda_and_ascends_on_the_received_losses():
    gamma = 0.5
    algo = AgnosticFL(lambda_lr=gamma)
    fed = make_federation(algo, sizes=(30, 40, 50))
    cohort = fed.cohorts[0]
    rows = lambda: torch.stack([cohort.params.row(k) for k in range(3)])  # noqa: E731
    w0 = {g: t.clone() for g, t in algo.global_model.items()}
    lam = torch.full((3,), 1 / 3, **f64)
    for round_ in range(2):
        received = torch.cat([algo.global_model["body"], algo.global_model["head"]])
        losses = torch.tensor([cross_entropy(fed, k, received) for k in range(3)], **f64)
        run_round(fed, algo, round_)
        w = rows()
        want = (lam / lam.sum()) @ w  # λ_t, not n_k/n (30, 40, 50)
        torch.testing.assert_close(torch.cat([algo.global_model["body"], algo.global_model["head"]]), want, **TOL)
        if round_ == 0:  # L_k(w_0): the initial model on each client's training split
            want_lam = lam + gamma * losses
            want_lam -= (want_lam.sum() - 1) / 3  # all three stay positive here
            assert (want_lam > 0).all()
            torch.testing.assert_close(algo.lambdas, want_lam, **TOL)
            first = {g: t.clone() for g, t in algo.global_model.items()}
        lam = algo.lambdas.clone()
    assert algo.lambdas.sum().item() == pytest.approx(1.0, abs=1e-12)
    for g in w0:  # the paper's output: the average of w_0, w_1, w_2
        torch.testing.assert_close(algo.average[g], (w0[g] + first[g] + algo.global_model[g]) / 3, **TOL)


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match="lambda_lr"):
        AgnosticFL(lambda_lr=-0.1)
    with pytest.raises(ValueError, match="output"):
        AgnosticFL(output="best")
    with pytest.raises(ValueError, match="ratio"):
        PFedPara(ratio=1.5)


# ------------------------------------------------------------------------------------ digits

ROUNDS = 4
CASES = {"pfedpara": ["--scenario", "iid"], "agnostic-fl": ["--scenario", "dirichlet"]}


@pytest.mark.parametrize("algorithm", sorted(CASES))
@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_digits_loss_goes_down_and_stop_and_resume_is_bitwise(tmp_path, algorithm):
    pytest.importorskip("sklearn")
    args = [algorithm, "--dataset", "digits", "--clients", "3", "--rounds", str(ROUNDS), "--quiet", *CASES[algorithm]]
    reference, state = assert_resume_bitwise(tmp_path, args, ROUNDS, stop_after=2)
    mean = [sum(m["train_loss"].values()) / len(m["train_loss"]) for m in reference]
    assert len(reference) == ROUNDS and all(math.isfinite(v) for v in mean) and mean[-1] < mean[0]
    for value in state["algorithm"].values():
        tensors = value.values() if isinstance(value, dict) else [value]
        assert all(torch.isfinite(t).all() for t in tensors if isinstance(t, torch.Tensor))

"""MultiBranchConv2d / MultiBranchLinear, the converter and the parameter-group helpers."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pfl_kernels.nn import (MultiBranchConv2d, MultiBranchLinear, alpha_parameters, branch_parameters,
                            multibranch, multibranch_layers, project_alpha_)
from tests.nn.test_factorized_layers import CONV_ARGS, _ids, small_model
from tests.tolerances import assert_close


@pytest.mark.parametrize("simplex", ["softmax", "project"])
@pytest.mark.parametrize("branches", [1, 2, 5, 10])
@pytest.mark.parametrize("args", CONV_ARGS, ids=_ids)
def test_conv_from_dense_computes_the_same_function(args, branches, simplex):
    torch.manual_seed(0)
    dense = nn.Conv2d(4, 6, **args, dtype=torch.float64)
    layer = MultiBranchConv2d.from_dense(dense, branches=branches, simplex=simplex)
    assert_close(layer.alpha, torch.full((branches,), 1 / branches, dtype=torch.float64), torch.float64, "uniform α")
    x = torch.randn(2, 4, 11, 10, dtype=torch.float64, requires_grad=True)
    y_dense, y = dense(x), layer(x)
    assert_close(y, y_dense, torch.float64, "output")
    g = torch.randn_like(y)
    assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_dense, x, g)[0], torch.float64, "input grad")


@pytest.mark.parametrize("simplex", ["softmax", "project"])
def test_linear_from_dense_and_noise(simplex):
    torch.manual_seed(1)
    dense = nn.Linear(13, 7, dtype=torch.float64)
    layer = MultiBranchLinear.from_dense(dense, branches=4, simplex=simplex)
    x = torch.randn(3, 5, 13, dtype=torch.float64)
    assert_close(layer(x), dense(x), torch.float64, "output")
    noisy = MultiBranchLinear.from_dense(dense, branches=4, noise=0.1, simplex=simplex)
    spread = (noisy.branch_weight - dense.weight).std() / dense.weight.std()
    assert 0.05 < spread < 0.2, "noise is relative to the weight's std"
    assert not torch.equal(noisy.branch_weight[0], noisy.branch_weight[1])


@pytest.mark.parametrize("args", CONV_ARGS, ids=_ids)
def test_conv_takes_every_conv2d_argument(args):
    layer = MultiBranchConv2d(4, 6, **args, branches=3)
    dense = nn.Conv2d(4, 6, **args)
    assert layer.weight.shape == dense.weight.shape
    assert (layer.bias is None) == (dense.bias is None)
    x = torch.randn(2, 4, 9, 12)
    assert layer(x).shape == dense(x).shape


def test_parameters_alpha_and_combined_weight():
    layer = MultiBranchConv2d(4, 6, 3, groups=2, branches=5)
    assert layer.branch_weight.shape == (5, 6, 2, 3, 3) and layer.branch_bias.shape == (5, 6)
    assert layer.alpha_param.shape == (5,)
    with torch.no_grad():
        layer.alpha_param.copy_(torch.randn(5))
    alpha = torch.softmax(layer.alpha_param, -1)
    assert torch.allclose(layer.alpha, alpha)
    assert torch.allclose(layer.weight, torch.einsum("b,b...->...", alpha, layer.branch_weight), atol=1e-6)
    assert torch.allclose(layer.bias, alpha @ layer.branch_bias, atol=1e-6)
    bound = 1 / math.sqrt(2 * 3 * 3)
    assert layer.branch_weight.abs().max() <= bound and layer.branch_bias.abs().max() <= bound
    assert not torch.equal(layer.branch_weight[0], layer.branch_weight[1]), "branches drawn independently"


def test_project_mode_keeps_alpha_on_the_simplex_after_a_step():
    torch.manual_seed(2)
    layer = MultiBranchLinear(6, 3, branches=4, simplex="project")
    opt = torch.optim.SGD([layer.alpha_param], lr=5.0)
    loss = layer(torch.randn(8, 6)).square().sum()
    loss.backward()
    opt.step()
    assert not torch.isclose(layer.alpha.sum(), torch.tensor(1.0)) or (layer.alpha < 0).any()
    layer.project_alpha_()
    assert (layer.alpha >= 0).all() and torch.isclose(layer.alpha.sum(), torch.tensor(1.0))


def test_gradients_reach_alpha_and_branches():
    layer = MultiBranchConv2d(3, 4, 3, branches=3)
    layer(torch.randn(2, 3, 8, 8)).square().sum().backward()
    assert layer.alpha_param.grad is not None and layer.alpha_param.grad.abs().sum() > 0
    assert layer.branch_weight.grad.abs().sum() > 0 and layer.branch_bias.grad.abs().sum() > 0


def test_multibranch_whole_model_and_parameter_groups():
    torch.manual_seed(3)
    model = small_model().double().eval()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    y = model(x)
    assert multibranch(model, branches=5, exclude=["4"]) is model
    assert_close(model(x), y, torch.float64, "output")
    layers = multibranch_layers(model)
    assert len(layers) == 4 and isinstance(model[4], nn.Linear)
    alphas = alpha_parameters(model)
    assert len(alphas) == 4 and all(a.shape == (5,) for a in alphas)
    branch = branch_parameters(model)
    assert len(branch) == 4 + 2  # 4 branch weights; biases of the first conv and the linear
    ids = {id(p) for p in alphas} | {id(p) for p in branch}
    covered = {id(p) for layer in layers for p in layer.parameters()}
    assert ids == covered, "the two groups partition the multi-branch parameters"


def test_shared_alpha_is_one_parameter_for_the_whole_model():
    model = multibranch(small_model(), branches=3, simplex="project", shared_alpha=True)
    alphas = alpha_parameters(model)
    assert len(alphas) == 1
    assert all(layer.alpha_param is alphas[0] for layer in multibranch_layers(model))
    assert sum(1 for p in model.parameters() if p is alphas[0]) == 1
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    with torch.no_grad():
        alphas[0].add_(torch.tensor([2.0, -3.0, 0.5]))
    project_alpha_(model)
    assert (alphas[0] >= 0).all() and torch.isclose(alphas[0].sum(), torch.tensor(1.0))


def test_two_phase_training_alpha_then_weights():
    """pFedMB trains α with W fixed, then W with α fixed: the helpers make that two optimizers."""
    torch.manual_seed(4)
    model = multibranch(small_model(), branches=3, noise=0.05)
    x, target = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    w_before = [p.detach().clone() for p in branch_parameters(model)]
    a_before = [p.detach().clone() for p in alpha_parameters(model)]
    opt_alpha = torch.optim.SGD(alpha_parameters(model), lr=1.0)
    nn.functional.cross_entropy(model(x), target).backward()
    opt_alpha.step()
    assert all(torch.equal(a, b) for a, b in zip(branch_parameters(model), w_before))
    assert any(not torch.equal(a, b) for a, b in zip(alpha_parameters(model), a_before))


def test_compiled_model_matches_eager():
    torch.manual_seed(5)
    model = multibranch(small_model(), branches=4, noise=0.1)
    for a in alpha_parameters(model):
        with torch.no_grad():
            a.normal_()
    x = torch.randn(4, 3, 16, 16)
    params = list(model.parameters())
    loss = model(x).square().mean()
    grads = torch.autograd.grad(loss, params)
    loss_c = torch.compile(model, fullgraph=True)(x).square().mean()
    grads_c = torch.autograd.grad(loss_c, params)
    assert_close(loss_c, loss.double(), torch.float32, "loss")
    for g_c, g in zip(grads_c, grads):
        assert_close(g_c, g.double(), torch.float32, "gradient")


def test_state_dict_round_trip():
    a = MultiBranchLinear(5, 3, branches=2)
    b = MultiBranchLinear(5, 3, branches=2)
    assert set(a.state_dict()) == {"branch_weight", "branch_bias", "alpha_param"}
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.weight, b.weight)


# ---- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("branches", [0, -2, 2.0, True])
def test_error_bad_branches(branches):
    with pytest.raises(ValueError, match="branches must be an integer >= 1"):
        MultiBranchConv2d(3, 4, 3, branches=branches)
    with pytest.raises(ValueError, match="branches must be an integer >= 1"):
        multibranch(small_model(), branches=branches)


def test_error_bad_simplex():
    with pytest.raises(ValueError, match="simplex must be one of"):
        MultiBranchLinear(3, 4, simplex="sigmoid")


def test_error_channels_not_divisible_by_groups():
    with pytest.raises(ValueError, match="in_channels must be divisible by groups"):
        MultiBranchConv2d(5, 6, 3, groups=2)


def test_error_bad_noise_and_module():
    with pytest.raises(ValueError, match="noise must be a finite number >= 0, got -0.1"):
        MultiBranchLinear.from_dense(nn.Linear(3, 3), noise=-0.1)
    with pytest.raises(TypeError, match="module must be an nn.Conv2d"):
        MultiBranchConv2d.from_dense(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="exclude names modules the model does not have"):
        multibranch(small_model(), branches=2, exclude=["head"])

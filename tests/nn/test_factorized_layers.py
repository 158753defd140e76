"""FactorizedConv2d / FactorizedLinear and the converters."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from pfl_kernels.nn import (FactorizedConv2d, FactorizedLinear, MultiBranchConv2d, MultiBranchLinear, factorize,
                            factorized_layers, sparsity_loss)
from pfl_kernels.nn.factorized import best_rank_factors
from tests.tolerances import assert_close

CONV_ARGS = [
    dict(kernel_size=1),
    dict(kernel_size=3, padding=1),
    dict(kernel_size=5, stride=2, padding=2, bias=False),
    dict(kernel_size=7, padding=3, dilation=1),
    dict(kernel_size=(3, 5), stride=(2, 1), padding=(1, 2)),
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=(3, 5), padding="valid"),
    dict(kernel_size=3, padding=2, groups=2, dilation=2),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
    dict(kernel_size=(3, 5), padding="same", padding_mode="replicate"),
    dict(kernel_size=3, padding=(2, 1), padding_mode="circular", stride=2),
]


def _ids(args):
    return ",".join(f"{k}={v}" for k, v in args.items())


@pytest.mark.parametrize("layout", ["spatial", "simfed", "view"])
@pytest.mark.parametrize("args", CONV_ARGS, ids=_ids)
def test_conv_from_dense_computes_the_same_function(args, layout):
    torch.manual_seed(0)
    dense = nn.Conv2d(4, 6, **args, dtype=torch.float64)
    layer = FactorizedConv2d.from_dense(dense, rank=2, layout=layout)
    x = torch.randn(3, 4, 11, 10, dtype=torch.float64, requires_grad=True)
    y_dense, y = dense(x), layer(x)
    assert y.shape == y_dense.shape
    assert_close(y, y_dense, torch.float64, "output")
    g = torch.randn_like(y)
    (gx_dense,) = torch.autograd.grad(y_dense, x, g)
    (gx,) = torch.autograd.grad(y, x, g)
    assert_close(gx, gx_dense, torch.float64, "input gradient")


@pytest.mark.parametrize("args", CONV_ARGS, ids=_ids)
def test_conv_takes_every_conv2d_argument(args):
    layer = FactorizedConv2d(4, 6, **args)
    dense = nn.Conv2d(4, 6, **args)
    for name in ("kernel_size", "stride", "padding", "dilation", "groups", "padding_mode"):
        assert getattr(layer, name) == getattr(dense, name), name
    assert (layer.bias is None) == (dense.bias is None)
    assert layer.weight.shape == dense.weight.shape
    x = torch.randn(2, 4, 9, 12)
    assert layer(x).shape == dense(x).shape


@pytest.mark.parametrize("layout,rows,cols", [("spatial", 15, 6 * 2), ("simfed", 2 * 3, 6 * 5), ("view", 15, 12)])
def test_conv_parameters_and_init(layout, rows, cols):
    layer = FactorizedConv2d(4, 6, (3, 5), groups=2, rank=3, layout=layout)
    assert layer.u.shape == (rows, 3) and layer.v.shape == (3, cols)
    assert layer.mu.shape == (rows, cols) and torch.count_nonzero(layer.mu) == 0
    bound_u = math.sqrt(6 / (rows + 3))
    assert layer.u.abs().max() <= bound_u and layer.u.std() > 0
    assert layer.weight.shape == (6, 2, 3, 5)
    assert FactorizedConv2d(4, 6, 3, sparse=False).mu is None


@pytest.mark.parametrize("sparse", [True, False])
def test_linear_from_dense(sparse):
    torch.manual_seed(1)
    dense = nn.Linear(13, 7, dtype=torch.float64)
    layer = FactorizedLinear.from_dense(dense, rank=2, sparse=sparse)
    assert layer.u.shape == (13, 2) and layer.v.shape == (2, 7)
    x = torch.randn(4, 5, 13, dtype=torch.float64)
    if sparse:
        assert_close(layer(x), dense(x), torch.float64, "output")
    else:
        # Without μ only the best rank-2 part is kept (Eckart-Young): error = the tail singular values.
        s = torch.linalg.svdvals(dense.weight.detach())
        err = torch.linalg.matrix_norm(layer.weight - dense.weight)
        assert torch.isclose(err, s[2:].norm())


@pytest.mark.parametrize("rows,cols,rank", [(9, 300, 1), (9, 300, 3), (40, 25, 2), (25, 40, 25), (1, 12, 1),
                                           (12, 1, 2), (30, 30, 4)])
def test_best_rank_factors_match_the_svd(rows, cols, rank):
    """The Gram-matrix route gives the SVD's rank-r part, split sqrt(σ) / sqrt(σ) as before."""
    gen = torch.Generator().manual_seed(rows * 1000 + cols + rank)
    m = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    u, v = best_rank_factors(m, rank)
    left, sing, right = torch.linalg.svd(m, full_matrices=False)
    r = min(rank, rows, cols)
    assert u.shape == (rows, rank) and v.shape == (rank, cols)
    assert_close(u @ v, left[:, :r] @ torch.diag(sing[:r]) @ right[:r], torch.float64, "rank-r part")
    assert_close(u[:, :r].norm(dim=0), sing[:r].sqrt(), torch.float64, "norms of u's columns")
    assert_close(v[:r].norm(dim=1), sing[:r].sqrt(), torch.float64, "norms of v's rows")
    assert not u[:, r:].any() and not v[r:].any()


def test_best_rank_factors_of_a_rank_deficient_or_zero_matrix():
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(6, 1, generator=gen, dtype=torch.float64) @ torch.randn(1, 50, generator=gen, dtype=torch.float64)
    u, v = best_rank_factors(m, 3)  # rank 1: the other two triplets add (next to) nothing
    assert_close(u @ v, m, torch.float64, "rank-1 matrix")
    u, v = best_rank_factors(torch.zeros(4, 9, dtype=torch.float64), 2)
    assert not u.any() and not v.any()


def test_from_dense_leaves_the_thread_count_and_the_dense_layer_alone():
    dense = nn.Conv2d(8, 16, 3, dtype=torch.float64)
    before = dense.weight.detach().clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        FactorizedConv2d.from_dense(dense)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(dense.weight, before)


def test_from_dense_rank_above_matrix_rank_is_exact():
    dense = nn.Conv2d(2, 3, 1, dtype=torch.float64)  # spatial: M is 1 x 6, rank 1
    layer = FactorizedConv2d.from_dense(dense, rank=3, sparse=False)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    assert_close(layer(x), dense(x), torch.float64)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.bn(self.conv1(x))))


def small_model():
    return nn.Sequential(nn.Conv2d(3, 8, 5, stride=2, padding=2), Block(8), nn.MaxPool2d(2),
                         nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU()),
                         nn.Linear(16, 10))


def test_factorize_whole_model_keeps_outputs_and_input_gradients():
    torch.manual_seed(2)
    model = small_model().double().eval()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, requires_grad=True)
    y = model(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert factorize(model, rank=1, exclude=["4"]) is model
    kinds = [type(m).__name__ for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear,
                                                                           FactorizedConv2d, FactorizedLinear))]
    assert kinds == ["FactorizedConv2d", "FactorizedConv2d", "FactorizedConv2d", "FactorizedLinear", "Linear"]
    y2 = model(x)
    (gx2,) = torch.autograd.grad(y2.sum(), x)
    assert_close(y2, y, torch.float64, "output")
    assert_close(gx2, gx, torch.float64, "input gradient")
    assert len(factorized_layers(model)) == 4


def test_factorize_exclude_covers_children_and_rejects_unknown_names():
    model = small_model()
    factorize(model, exclude=["1"])
    assert isinstance(model[1].conv1, nn.Conv2d) and isinstance(model[0], FactorizedConv2d)
    with pytest.raises(ValueError, match=r"exclude names modules the model does not have: \['classifier'\]"):
        factorize(small_model(), exclude=["classifier"])
    with pytest.raises(ValueError, match="from_dense"):
        factorize(nn.Linear(3, 3))


def test_factorize_layout_and_sparse_reach_every_layer():
    model = factorize(small_model(), rank=2, layout="simfed", sparse=False)
    for layer in factorized_layers(model):
        assert layer.rank == 2 and layer.mu is None
        assert layer.layout == ("linear" if isinstance(layer, FactorizedLinear) else "simfed")


def test_sparsity_loss_has_a_real_gradient():
    model = factorize(small_model())
    for layer in factorized_layers(model):
        with torch.no_grad():
            layer.mu.normal_()
    loss = sparsity_loss(model)
    expected = sum(layer.mu.abs().sum() for layer in factorized_layers(model))
    assert torch.isclose(loss, expected)
    loss.backward()
    for layer in factorized_layers(model):
        assert torch.equal(layer.mu.grad, torch.sign(layer.mu.detach()))
    assert sparsity_loss(nn.Sequential(nn.ReLU())).item() == 0


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sparsity_loss_reductions_match_a_float64_reference(reduction):
    torch.manual_seed(5)
    model = factorize(small_model())
    model[1].conv2.mu = model[1].conv1.mu  # a tied μ: one Parameter, counted once
    with torch.no_grad():
        for layer in factorized_layers(model):
            layer.mu.normal_()
    mus = list({id(layer.mu): layer.mu for layer in factorized_layers(model)}.values())
    assert len(mus) == 4
    mus64 = [mu.detach().double().requires_grad_() for mu in mus]
    expected = sum(mu.abs().sum() for mu in mus64)
    if reduction == "mean":
        expected = expected / sum(mu.numel() for mu in mus64)
    loss = sparsity_loss(model, reduction=reduction)
    assert_close(loss, expected, torch.float32, "loss")
    for grad, grad64 in zip(torch.autograd.grad(loss, mus), torch.autograd.grad(expected, mus64)):
        assert_close(grad, grad64, torch.float32, "gradient")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sparsity_loss_without_mu_is_zero(reduction):
    assert sparsity_loss(nn.Sequential(nn.ReLU()), reduction=reduction).item() == 0
    assert sparsity_loss(factorize(small_model(), sparse=False), reduction=reduction).item() == 0


@pytest.mark.parametrize("bad", ["Sum", "max", "none", None, ["sum"]])
def test_sparsity_loss_rejects_an_unknown_reduction(bad):
    with pytest.raises(ValueError, match=r"reduction must be one of \('sum', 'mean'\), got"):
        sparsity_loss(factorize(small_model()), reduction=bad)


def test_nnz_and_parameter_count():
    layer = FactorizedLinear(5, 4, rank=2)
    with torch.no_grad():
        layer.mu.copy_(torch.tensor([[0.0, 1e-4, 1e-3, -2.0]] * 5))
    assert layer.nnz() == 15
    assert layer.nnz(5e-4) == 10
    assert layer.parameter_count(5e-4) == 5 * 2 + 2 * 4 + 10
    assert FactorizedLinear(5, 4, sparse=False).nnz() == 0
    with pytest.raises(ValueError, match="threshold must be a number >= 0"):
        layer.nnz(-1.0)


@pytest.mark.parametrize("bad", [float("nan"), "a", None, True, -1e-9, float("-inf")], ids=repr)
@pytest.mark.parametrize("sparse", [True, False])
def test_nnz_and_parameter_count_refuse_a_bad_threshold(bad, sparse):
    """nnz(nan) counted nothing (0) and nnz('a') failed in a comparison; checked without μ too."""
    layer = FactorizedLinear(5, 4, rank=2, sparse=sparse)
    for count in (layer.nnz, layer.parameter_count):
        with pytest.raises(ValueError, match=rf"threshold must be a number >= 0, got {re.escape(repr(bad))}"):
            count(bad)


def test_compiled_model_matches_eager():
    torch.manual_seed(3)
    model = factorize(small_model()).train()
    for layer in factorized_layers(model):
        with torch.no_grad():
            layer.mu.normal_(std=0.01)
    x = torch.randn(4, 3, 16, 16)
    compiled = torch.compile(model, fullgraph=True)
    params = list(model.parameters())
    loss = model(x).square().mean()
    grads = torch.autograd.grad(loss, params)
    loss_c = compiled(x).square().mean()
    grads_c = torch.autograd.grad(loss_c, params)
    assert_close(loss_c, loss.double(), torch.float32, "loss")
    for g_c, g in zip(grads_c, grads):
        assert_close(g_c, g.double(), torch.float32, "gradient")


def test_state_dict_round_trip():
    a, b = FactorizedConv2d(3, 4, 3), FactorizedConv2d(3, 4, 3)
    assert set(a.state_dict()) == {"u", "v", "mu", "bias"}
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.weight, b.weight)


# ---- bad input -------------------------------------------------------------------------

def test_error_channels_not_divisible_by_groups():
    with pytest.raises(ValueError, match="in_channels must be divisible by groups"):
        FactorizedConv2d(5, 6, 3, groups=2)


@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_error_bad_rank(rank):
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        FactorizedConv2d(4, 6, 3, rank=rank)
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        FactorizedLinear(4, 6, rank=rank)


def test_error_bad_layout():
    with pytest.raises(ValueError, match="layout must be one of"):
        FactorizedConv2d(4, 6, 3, layout="rows")
    with pytest.raises(ValueError, match="layout 'linear' is for FactorizedLinear"):
        FactorizedConv2d(4, 6, 3, layout="linear")


def test_error_bad_padding_mode():
    with pytest.raises(ValueError, match="padding_mode"):
        FactorizedConv2d(4, 6, 3, padding_mode="mirror")


def test_error_bad_features():
    with pytest.raises(ValueError, match="in_features must be an integer >= 1"):
        FactorizedLinear(0, 3)


@pytest.mark.parametrize("layer", [FactorizedConv2d, MultiBranchConv2d])
@pytest.mark.parametrize("args, message", [
    ((0, 4, 3), "in_channels must be an integer >= 1, got 0"),
    (("3", 4, 3), "in_channels must be an integer >= 1, got '3'"),  # nn.Conv2d: "not all arguments converted"
    ((3, True, 3), "out_channels must be an integer >= 1, got True"),
    ((3, 4, 0), "kernel_size must be an integer >= 1 or a pair of them, got 0"),
    ((3, 4, (3, 0)), r"kernel_size must be an integer >= 1 or a pair of them, got \(3, 0\)"),
    ((3, 4, (3, 3, 3)), r"kernel_size .* got \(3, 3, 3\)"),
])
def test_error_bad_conv_sizes_name_the_argument(layer, args, message):
    """nn.Conv2d builds 0 channels and a 0 kernel (the error came later, naming an internal
    shape) and fails inside its own message on a string; the layers name the argument."""
    with pytest.raises(ValueError, match=message):
        layer(*args, **({"branches": 2} if layer is MultiBranchConv2d else {}))


@pytest.mark.parametrize("layer", [FactorizedConv2d, MultiBranchConv2d])
def test_conv_sizes_take_numpy_integers_as_nn_conv2d_does(layer):
    extra = {"branches": np.int64(2)} if layer is MultiBranchConv2d else {"rank": np.int32(2)}
    conv = layer(np.int64(3), np.int64(4), (np.int64(3), 3), **extra)
    assert conv(torch.randn(1, 3, 5, 5)).shape == (1, 4, 3, 3)
    # kept as Python ints, so the repr and state read as for plain sizes
    assert [type(v) for v in (conv.in_channels, conv.out_channels, *conv.kernel_size)] == [int] * 4
    assert "np." not in repr(conv)


@pytest.mark.parametrize("layer", [FactorizedLinear, MultiBranchLinear])
def test_linear_sizes_take_numpy_integers_as_nn_linear_does(layer):
    """nn.Linear takes numpy integers; so do the Linear layers (they refused them before,
    where the Conv2d layers took them)."""
    extra = {"branches": np.int64(2)} if layer is MultiBranchLinear else {"rank": np.int32(2)}
    linear = layer(np.int64(5), np.int32(3), **extra)
    assert linear(torch.randn(2, 5)).shape == (2, 3)
    assert [type(v) for v in (linear.in_features, linear.out_features)] == [int, int]
    with pytest.raises(ValueError, match=r"in_features must be an integer >= 1, got np.float64\(5.0\)"):
        layer(np.float64(5), 3, **extra)


def test_error_from_dense_wrong_module():
    with pytest.raises(TypeError, match="module must be an nn.Conv2d"):
        FactorizedConv2d.from_dense(nn.Linear(3, 3))
    with pytest.raises(TypeError, match="module must be an nn.Linear"):
        FactorizedLinear.from_dense(nn.Conv2d(3, 3, 1))


def test_bias_init_matches_the_dense_layers_bound():
    torch.manual_seed(4)
    conv = FactorizedConv2d(4, 300, (3, 5), groups=2)
    assert conv.bias.abs().max() <= 1 / math.sqrt(2 * 3 * 5)
    assert conv.bias.abs().max() > 0.9 / math.sqrt(2 * 3 * 5)
    lin = FactorizedLinear(49, 500)
    assert 0.9 / 7 < lin.bias.abs().max() <= 1 / 7

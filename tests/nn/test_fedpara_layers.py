"""FedParaLinear / FedParaConv2d and fedpara(): the rebuilt weight that code written for the dense
layer reads, argument checks, reset_parameters() without arguments, the rank's parameter budget,
meta-device models, and the repr."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from pfl_kernels.nn import FedParaConv2d, FedParaLinear, fedpara, fedpara_rank

F64 = torch.float64


def _linear_weight(layer: FedParaLinear) -> torch.Tensor:
    """W1 ⊙ (W2 + 1), W_i = X_i Y_iᵀ, written from the factors (Proposition 1)."""
    return (layer.x1 @ layer.y1.T) * (layer.x2 @ layer.y2.T + 1)


# ---- the rebuilt weight: nn.MultiheadAttention reads out_proj.weight -------------------

def test_a_converted_transformer_layer_computes_the_dense_layer_of_its_weights():
    """fedpara converts nn.MultiheadAttention's out_proj (a Linear subclass that overrides
    nothing), and the attention reads its ``weight``: it failed with AttributeError.  The layer
    now computes the dense layer run with the FedPara weights, gradients included."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True, dtype=F64)
    dense = copy.deepcopy(layer)
    fedpara(layer)
    converted = ("self_attn.out_proj", "linear1", "linear2")
    assert all(isinstance(layer.get_submodule(name), FedParaLinear) for name in converted)
    # The dense layer, with the FedPara layers' weights and biases and every other parameter
    # (in_proj, the norms) taken from the converted layer: gradients reach the same leaves.
    own = {name: p for name, p in layer.named_parameters() if not name.startswith(converted)}

    def reference(x):
        params = dict(own)
        for name in converted:
            fp = layer.get_submodule(name)
            params[f"{name}.weight"], params[f"{name}.bias"] = _linear_weight(fp), fp.bias
        return functional_call(dense, params, (x,))

    x = torch.randn(3, 5, 8, dtype=F64)
    leaves = list(layer.parameters())
    out, want = layer(x), reference(x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    assert all(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():  # eval without grad: torch's fast-path checks read the weights too
        layer.eval(), dense.eval()
        torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("make", [lambda: FedParaLinear(5, 3, rank=2, dtype=F64),
                                  lambda: FedParaConv2d(3, 4, (3, 2), rank=2, dtype=F64)], ids=["linear", "conv"])
def test_weight_is_the_full_weight_in_the_dense_shape(make):
    layer = make()
    assert layer.weight.shape == layer.weight_shape == layer.full_weight().shape
    assert torch.equal(layer.weight, layer.full_weight())
    assert fedpara(nn.Sequential(nn.Linear(4, 3)))[0].weight.shape == (3, 4)


# ---- arguments -------------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: FedParaLinear(0, 3, 1), r"in_features must be an integer >= 1, got 0"),
    (lambda: FedParaLinear(-1, 3, 1), r"in_features must be an integer >= 1, got -1"),
    (lambda: FedParaLinear(2.5, 3, 1), r"in_features must be an integer >= 1, got 2\.5"),
    (lambda: FedParaLinear("4", 3, 1), r"in_features must be an integer >= 1, got '4'"),
    (lambda: FedParaLinear(4, 0, 1), r"out_features must be an integer >= 1, got 0"),
    (lambda: FedParaLinear(4, True, 1), r"out_features must be an integer >= 1, got True"),
    (lambda: FedParaLinear(4, 3, 0), r"rank must be an integer >= 1, got 0"),
    (lambda: FedParaLinear(4, 3, "2"), r"rank must be an integer >= 1, got '2'"),
    (lambda: FedParaLinear(4, 3, 1.5), r"rank must be an integer >= 1, got 1\.5"),
    (lambda: FedParaConv2d(0, 3, 3, 1), r"in_channels must be an integer >= 1, got 0"),
    (lambda: FedParaConv2d(2, -3, 3, 1), r"out_channels must be an integer >= 1, got -3"),
    (lambda: FedParaConv2d(2, 3.0, 3, 1), r"out_channels must be an integer >= 1, got 3\.0"),
    (lambda: FedParaConv2d(2, 3, 0, 1), r"kernel_size must be an integer >= 1 or a pair of them, got 0"),
    (lambda: FedParaConv2d(2, 3, (3,), 1), r"kernel_size must be an integer >= 1 or a pair of them, got \(3,\)"),
    (lambda: FedParaConv2d(2, 3, (3, 3, 3), 1), r"kernel_size must be .* got \(3, 3, 3\)"),
    (lambda: FedParaConv2d(2, 3, "3", 1), r"kernel_size must be an integer >= 1 or a pair of them, got '3'"),
    (lambda: FedParaConv2d(2, 3, 3, True), r"rank must be an integer >= 1, got True"),
    (lambda: FedParaConv2d(2, 3, 3, 0), r"rank must be an integer >= 1, got 0"),
])
def test_bad_sizes_are_refused_naming_the_argument(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_sizes_take_numpy_integers_as_nn_conv2d_does():
    torch.manual_seed(1)
    numpy_sized = FedParaConv2d(np.int64(3), np.int64(4), np.int64(3), np.int64(2), padding=1)
    torch.manual_seed(1)
    plain = FedParaConv2d(3, 4, 3, 2, padding=1)
    assert numpy_sized.kernel_size == (3, 3) and type(numpy_sized.kernel_size[0]) is int
    assert repr(numpy_sized) == repr(plain)
    assert all(torch.equal(a, b) for a, b in zip(numpy_sized.parameters(), plain.parameters()))
    assert FedParaConv2d(3, 4, (np.int64(3), np.int32(1)), 2).kernel_size == (3, 1)
    assert FedParaLinear(np.int64(5), np.int64(3), np.int64(2)).weight_shape == (3, 5)


@pytest.mark.parametrize("kwargs, message", [
    ({"init": "bogus"}, r"init must be one of \('variance', 'he'\), got 'bogus'"),
    ({"init": None}, r"init must be one of \('variance', 'he'\), got None"),
    ({"weight_var": -1}, r"weight_var must be a finite number >= 0 or None, got -1"),
    ({"weight_var": float("nan")}, r"weight_var must be a finite number >= 0 or None, got nan"),
    ({"weight_var": float("inf")}, r"weight_var must be a finite number >= 0 or None, got inf"),
    ({"weight_var": "0.1"}, r"weight_var must be a finite number >= 0 or None, got '0.1'"),
    ({"weight_var": True}, r"weight_var must be a finite number >= 0 or None, got True"),
])
@pytest.mark.parametrize("make", [lambda: FedParaLinear(4, 3, 2), lambda: FedParaConv2d(2, 3, 3, 2)],
                         ids=["linear", "conv"])
def test_reset_parameters_refuses_bad_arguments_and_changes_nothing(make, kwargs, message):
    """An unknown init drew 'variance' silently; a negative weight_var failed inside normal_."""
    layer = make()
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(ValueError, match=message):
        layer.reset_parameters(**kwargs)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


@pytest.mark.parametrize("make", [lambda: FedParaLinear(6, 5, 3), lambda: FedParaConv2d(2, 3, (3, 2), 2, padding=1)],
                         ids=["linear", "conv"])
def test_reset_parameters_without_arguments_draws_as_a_new_layer(make):
    """reset_parameters() took a required weight_var, so the meta-device recipe
    (to_empty(); reset_parameters()) failed; it now draws what making the layer draws."""
    torch.manual_seed(2)
    fresh = make()
    layer = make()
    torch.manual_seed(2)
    layer.reset_parameters()
    for (name, a), b in zip(fresh.named_parameters(), layer.parameters()):
        assert torch.equal(a, b), name
    with torch.device("meta"):
        meta = make()
    meta.to_empty(device="cpu")
    torch.manual_seed(2)
    meta.reset_parameters()
    for name, p in meta.named_parameters():
        if name != "bias":  # reset_parameters draws the factors only
            assert torch.equal(p, dict(fresh.named_parameters())[name]), name


def test_the_default_variance_is_the_dense_layers():
    """W1 and W2 start with nn.Linear's / nn.Conv2d's default weight variance, 1 / (3·fan_in)."""
    torch.manual_seed(3)
    for layer, fan_in in ((FedParaLinear(300, 400, 20, dtype=F64), 300),
                          (FedParaConv2d(32, 48, 3, 10, dtype=F64), 32 * 9)):
        layer.reset_parameters()
        var = 1 / (3 * fan_in)
        # W1 and W2 independent, mean 0, variance v each: W1 ⊙ (W2 + 1) has variance v (1 + v).
        assert layer.weight.detach().var().item() == pytest.approx(var * (1 + var), rel=0.15)


# ---- the rank's parameter budget --------------------------------------------------------

def _factor_count(layer: nn.Module) -> int:
    return sum(p.numel() for name, p in layer.named_parameters() if name != "bias")


# (in, out, kernel) of a Conv2d, (in, out) of a Linear.
BUDGET_SHAPES = [(64, 64, 1), (256, 128, 1), (3, 64, 1), (512, 2048, 1), (16, 16, 1), (64, 64, 3), (3, 64, 3),
                 (128, 256, 3), (64, 32, (3, 1)), (48, 96, 5), (7, 9, 2),
                 (512, 512), (784, 200), (84, 10), (10, 1000), (16, 16)]


@pytest.mark.parametrize("shape", BUDGET_SHAPES, ids=str)
def test_at_ratio_one_a_layer_holds_at_most_the_dense_weights_parameters(shape):
    """The module docstring's budget: r_max is the largest R whose factors fit in the dense
    weight.  A 1x1 convolution took the Linear formula, which leaves out the R×R core: a
    64->64 one got 4608 parameters for the dense 4096."""
    dense = nn.Conv2d(*shape) if len(shape) == 3 else nn.Linear(*shape)
    layer = fedpara(nn.Sequential(dense), 1.0)[0]
    budget = dense.weight.numel()
    assert _factor_count(layer) <= budget
    # ... and the largest such R: one more exceeds it.
    if isinstance(layer, FedParaConv2d):
        bigger = FedParaConv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.rank + 1, device="meta")
    else:
        bigger = FedParaLinear(layer.in_features, layer.out_features, layer.rank + 1, device="meta")
    assert _factor_count(bigger) > budget


def test_fedpara_rank_counts_the_core_of_a_1x1_convolution():
    # 64->64 1x1, the tensor form: R² + 128R ≤ 2048 holds for R = 14 (1988), not 15 (2145).
    assert fedpara_rank(64, 64, 1, 1.0, conv=True) == 14
    assert fedpara_rank(64, 64, 1, 1.0) == 16  # a Linear: 2R·128 ≤ 4096
    assert fedpara_rank(128, 64, 9, 1.0, conv=True) == fedpara_rank(128, 64, 9, 1.0) == 54


# ---- the meta device, and the repr -----------------------------------------------------

def test_fedpara_converts_a_meta_model_and_it_can_be_materialised():
    """The variance of a meta weight cannot be measured (it raised "Tensor.item() cannot be
    called on meta tensors"): the layers take the default, and to_empty + reset_parameters
    give the model its values."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(8 * 5 * 5, 10))
    fedpara(model, 0.5)
    assert all(p.is_meta for p in model.parameters())
    on_cpu = fedpara(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(200, 10)), 0.5)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in on_cpu.named_parameters()]
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, (FedParaLinear, FedParaConv2d)):
            module.reset_parameters()
    assert all(torch.isfinite(p).all() for n, p in model.named_parameters() if not n.endswith("bias"))
    assert model(torch.randn(2, 3, 7, 7)).shape == (2, 10)


def test_conv_repr_shows_every_argument_as_nn_conv2d_does():
    dense = nn.Conv2d(3, 4, 3, stride=2, padding=2, dilation=2, bias=False)
    layer = fedpara(nn.Sequential(dense), 0.5)[0]
    assert repr(layer) == f"FedParaConv2d({dense.extra_repr()}, rank={layer.rank})"
    assert "dilation=(2, 2)" in repr(layer)
    assert repr(FedParaConv2d(3, 4, 3, 2)) == ("FedParaConv2d(3, 4, kernel_size=(3, 3), stride=(1, 1), padding=(0, 0), "
                                               "rank=2)")

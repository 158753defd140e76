"""A factorized, multi-branch or FedPara layer's ``weight`` (and a multi-branch layer's ``bias``) is rebuilt
on every access: every way of writing to it raises, and every way of reading it still works."""
from __future__ import annotations

import copy
import importlib
import io

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pfl_kernels.nn import (FactorizedConv2d, FactorizedLinear, FedParaConv2d, FedParaLinear, MultiBranchConv2d,
                            MultiBranchLinear, ReadOnlyWeightError)

# By module path: the package's ``multibranch`` attribute is the converter function.
LAYER_MODULES = [importlib.import_module(f"pfl_kernels.nn.{name}") for name in ("factorized", "multibranch", "fedpara")]

LAYERS = {
    "FactorizedConv2d": lambda: FactorizedConv2d(3, 4, 3, rank=2),
    "FactorizedLinear": lambda: FactorizedLinear(5, 3, rank=2),
    "MultiBranchConv2d": lambda: MultiBranchConv2d(3, 4, 3, branches=3),
    "MultiBranchLinear": lambda: MultiBranchLinear(5, 3, branches=3),
    # FedPara layers had no weight: nn.MultiheadAttention, which reads out_proj.weight, failed.
    "FedParaConv2d": lambda: FedParaConv2d(3, 4, 3, rank=2),
    "FedParaLinear": lambda: FedParaLinear(5, 3, rank=2),
}
# What each message must point to instead of the weight.
INIT_HINT = {"Factorized": r"initialise the factors instead: reset_parameters\(\), .*from_dense.*layer\.u, "
                           r"layer\.v and layer\.mu",
             "MultiBranch": r"initialise the branches instead: reset_parameters\(\), .*from_dense.*"
                            r"layer\.branch_(weight|bias)",
             "FedPara": r"initialise the factors instead: reset_parameters\(\), or write layer\.x1"}


def _no_grad(write):
    def run(t):
        with torch.no_grad():
            write(t)
    return run


# Each takes the tensor the layer returned and writes to it.
WRITES = {
    "kaiming_normal_": lambda t: nn.init.kaiming_normal_(t),
    "xavier_uniform_": lambda t: nn.init.xavier_uniform_(t),
    "orthogonal_": lambda t: nn.init.orthogonal_(t),
    "zeros_": lambda t: nn.init.zeros_(t),
    "zero_": lambda t: t.zero_(),
    "zero_ under no_grad": _no_grad(lambda t: t.zero_()),
    "copy_ under no_grad": _no_grad(lambda t: t.copy_(torch.ones_like(t))),
    "mul_ under no_grad": _no_grad(lambda t: t.mul_(2)),
    "+= under no_grad": _no_grad(lambda t: t.__iadd__(1)),
    "setitem": _no_grad(lambda t: t.__setitem__(0, 1.0)),
    "data =": lambda t: setattr(t, "data", torch.zeros_like(t)),
    "data.normal_": lambda t: t.data.normal_(),
    "detach().zero_": lambda t: t.detach().zero_(),
    "slice fill_": _no_grad(lambda t: t[0].fill_(1.0)),
    "view(-1).zero_": _no_grad(lambda t: t.view(-1).zero_()),
    "set_": _no_grad(lambda t: t.set_(torch.zeros_like(t))),
    "out=": _no_grad(lambda t: torch.mul(torch.ones_like(t), 2, out=t)),
    "relu(inplace=True)": _no_grad(lambda t: F.relu(t, inplace=True)),
}


# Initialisers that need a fan in and out: for a bias torch refuses them before any write.
NEEDS_2D = {"kaiming_normal_", "xavier_uniform_", "orthogonal_"}


def _snapshot(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()}


def _unchanged(layer, before):
    return all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def _rebuilt(name):
    """The rebuilt attributes of a layer class: weight, and a multi-branch layer's bias."""
    return ["weight", "bias"] if name.startswith("MultiBranch") else ["weight"]


@pytest.mark.parametrize("write", WRITES, ids=str)
@pytest.mark.parametrize("name", LAYERS)
def test_every_write_to_the_rebuilt_weight_raises(name, write):
    torch.manual_seed(0)
    layer = LAYERS[name]()
    before = _snapshot(layer)
    hint = next(h for prefix, h in INIT_HINT.items() if name.startswith(prefix))
    for attr in _rebuilt(name):
        if attr == "bias" and write in NEEDS_2D:
            continue
        with pytest.raises(ReadOnlyWeightError, match=rf"{name}\.{attr} is .*rebuilt.*{hint}"):
            WRITES[write](getattr(layer, attr))
    assert _unchanged(layer, before)


def test_writes_inside_inference_mode_raise_too():
    # Tensors made in inference mode have no version counter; the check by name still holds.
    layer = LAYERS["FactorizedLinear"]()
    with torch.inference_mode(), pytest.raises(ReadOnlyWeightError):
        layer.weight.zero_()


@pytest.mark.parametrize("value", ["tensor", "parameter", "none"])
@pytest.mark.parametrize("name", LAYERS)
def test_assigning_the_rebuilt_weight_raises(name, value):
    layer = LAYERS[name]()
    before = _snapshot(layer)
    for attr in _rebuilt(name):
        shape = getattr(layer, attr).shape
        new = {"tensor": torch.zeros(shape), "parameter": nn.Parameter(torch.zeros(shape)), "none": None}[value]
        with pytest.raises(ReadOnlyWeightError, match=rf"{name}\.{attr} is .*rebuilt.*initialise"):
            setattr(layer, attr, new)
    assert _unchanged(layer, before)
    assert set(layer.state_dict()) == set(before)


def test_caught_as_attribute_error_or_runtime_error():
    layer = FactorizedLinear(4, 3)
    with pytest.raises(AttributeError, match="rebuilt"):
        layer.weight = torch.zeros(3, 4)
    with torch.no_grad(), pytest.raises(RuntimeError, match="rebuilt"):
        layer.weight.zero_()


def test_a_factorized_layers_bias_is_a_real_parameter():
    layer = FactorizedLinear(4, 3)
    nn.init.zeros_(layer.bias)
    assert torch.count_nonzero(layer.bias) == 0 and layer.bias is layer.state_dict(keep_vars=True)["bias"]


@pytest.mark.parametrize("name", LAYERS)
def test_reading_the_weight_works_as_for_a_dense_layer(name):
    torch.manual_seed(1)
    layer = LAYERS[name]().double()
    conv = "Conv" in name
    x = torch.randn(2, 3, 6, 7, dtype=torch.float64) if conv else torch.randn(2, 5, dtype=torch.float64)
    op = F.conv2d if conv else F.linear
    weight = layer.weight
    assert weight.shape == layer.weight_shape and weight.dtype == torch.float64
    # The functional form with the read weight computes the layer, with the same gradients.
    y = op(x, weight, layer.bias)
    torch.testing.assert_close(y, layer(x), rtol=0, atol=1e-12)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(y.square().sum(), params)
    for g, g_layer in zip(grads, torch.autograd.grad(layer(x).square().sum(), params)):
        torch.testing.assert_close(g, g_layer, rtol=0, atol=1e-12)
    # Copies and results are the user's own, plain tensors.
    for result in (weight.clone(), weight * 2, weight.detach().clone(), weight.cpu() + 0):
        assert type(result) is torch.Tensor
        with torch.no_grad():
            result.zero_()
    leaf = weight.detach().requires_grad_()
    assert leaf.is_leaf and leaf.requires_grad
    assert weight.detach().numpy().shape == tuple(layer.weight_shape)
    assert torch.equal(copy.deepcopy(weight.detach()), weight.detach())
    buffer = io.BytesIO()
    torch.save({"w": weight.detach()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, weight.detach())
    assert "tensor(" in repr(weight.detach()) or "Tensor(" in repr(weight.detach())


@pytest.mark.parametrize("name", LAYERS)
def test_a_parameter_made_from_the_weight_is_an_ordinary_parameter(name):
    torch.manual_seed(3)
    layer = LAYERS[name]()
    before = _snapshot(layer)
    for make in (lambda: nn.Parameter(layer.weight), lambda: nn.Parameter(layer.weight.detach())):
        param = make()
        assert isinstance(param, nn.Parameter) and param.is_leaf and torch.equal(param, layer.weight)
        optimizer = torch.optim.SGD([param], lr=0.1)
        param.square().sum().backward()
        optimizer.step()
        assert not torch.equal(param, layer.weight) and _unchanged(layer, before)
        copied = copy.deepcopy(param)
        assert type(copied) is nn.Parameter and torch.equal(copied, param)
        buffer = io.BytesIO()
        torch.save(param, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert type(loaded) is nn.Parameter and torch.equal(loaded, param)


@pytest.mark.parametrize("name", LAYERS)
def test_reading_the_weight_under_vmap_and_compile(name):
    torch.manual_seed(2)
    layer = LAYERS[name]()
    scales = torch.randn(4)
    per_scale = torch.func.vmap(lambda s: (layer.weight * s).sum())(scales)
    torch.testing.assert_close(per_scale, layer.weight.detach().sum() * scales)
    conv = "Conv" in name
    x = torch.randn(2, 3, 6, 7) if conv else torch.randn(2, 5)
    op = F.conv2d if conv else F.linear
    compiled = torch.compile(lambda x: op(x, layer.weight, layer.bias), fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    # Read outside and passed into a compiled function, as a plain tensor (torch 2.13's
    # inductor fails on tensor subclasses as inputs: pytorch/pytorch#193932); gradients
    # still reach the parameters.
    def plain(t):
        return None if t is None else t.as_subclass(torch.Tensor)

    compiled = torch.compile(lambda x, w, b: op(x, w, b), fullgraph=True)
    compiled(x, plain(layer.weight), plain(layer.bias)).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer(x).square().sum().backward()
    for g, p in zip(grads, layer.parameters()):
        torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("name", LAYERS)
def test_forward_and_backward_never_build_the_read_only_weight(name, monkeypatch):
    """Training pays nothing for the guard: only a user's read of ``weight`` builds it."""
    def refuse(tensor, message):
        raise AssertionError("forward read the guarded weight")

    for module in LAYER_MODULES:
        monkeypatch.setattr(module, "read_only", refuse)
    layer = LAYERS[name]()
    x = torch.randn(2, 3, 6, 7) if "Conv" in name else torch.randn(2, 5)
    layer(x).sum().backward()
    torch.compile(layer, fullgraph=True)(x).sum().backward()

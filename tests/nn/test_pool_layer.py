"""ReLUMaxPool2d and fuse_relu_max_pool / unfuse_relu_max_pool: a fused model computes what the
model did, gradient included, and the converter leaves alone what it cannot prove the same."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pfl_algorithms.models import build_model
from pfl_kernels.nn import ReLUMaxPool2d, factorize, fuse_relu_max_pool, unfuse_relu_max_pool


def _train_step(model, x, y):
    model.zero_grad()
    out = model(x)
    nn.functional.cross_entropy(out, y).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name, shape", [("lenet5", (3, 32, 32)), ("digits-cnn", (1, 8, 8)),
                                         ("pfedhn-cnn", (3, 32, 32))])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_fused_model_is_the_same_function(name, shape, layout):
    torch.manual_seed(0)
    model = build_model(name, input_shape=shape, num_classes=10).double()
    fused = copy.deepcopy(model)
    assert fuse_relu_max_pool(fused) >= 1
    assert list(fused.state_dict()) == list(model.state_dict())
    x = torch.randn(5, *shape, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x
    y = torch.randint(0, 10, (5,))
    out, grads = _train_step(model, x, y)
    fused_out, fused_grads = _train_step(fused, x, y)
    assert torch.equal(out, fused_out)
    for n in grads:
        assert torch.equal(grads[n], fused_grads[n]), n


def test_factorized_lenet_fuses_and_unfuses():
    torch.manual_seed(1)
    model = factorize(build_model("lenet5", input_shape=(3, 32, 32), num_classes=10), rank=1)
    plain = [type(m) for m in model.modules()]
    assert fuse_relu_max_pool(model) == 2
    assert sum(isinstance(m, ReLUMaxPool2d) for m in model.modules()) == 2
    assert unfuse_relu_max_pool(model) == 2
    assert [type(m) for m in model.modules()] == plain


def test_leaves_alone_what_it_cannot_prove_the_same():
    shared = nn.ReLU()
    hooked_relu, hooked_pool = nn.ReLU(), nn.MaxPool2d(2)
    hooked_relu.register_forward_hook(lambda m, i, o: None)
    hooked_pool.register_forward_pre_hook(lambda m, i: None)

    class Reordered(nn.Sequential):  # a subclass may run its children in another order
        pass

    model = nn.Sequential(
        nn.Sequential(shared, nn.MaxPool2d(2)), shared,                 # a ReLU used twice
        nn.Sequential(nn.ReLU(), nn.MaxPool2d(3)),                       # not a 2x2 pool
        nn.Sequential(nn.ReLU(), nn.MaxPool2d(2, stride=1)),             # not stride 2
        nn.Sequential(nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True)),       # ceil mode
        nn.Sequential(nn.ReLU(), nn.MaxPool2d(2, padding=1)),            # padding
        nn.Sequential(nn.MaxPool2d(2), nn.ReLU()),                       # the other order
        nn.Sequential(hooked_relu, nn.MaxPool2d(2)), nn.Sequential(nn.ReLU(), hooked_pool),
        Reordered(nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.ReLU(), nn.MaxPool2d((2, 2), (2, 2))),         # the one pair to fuse
    )
    assert fuse_relu_max_pool(model) == 1
    assert isinstance(model[-1][1], ReLUMaxPool2d) and isinstance(model[-1][0], nn.Identity)
    assert sum(isinstance(m, ReLUMaxPool2d) for m in model.modules()) == 1


def test_three_dim_input_is_one_image():
    x = torch.randn(4, 6, 6)
    assert torch.equal(ReLUMaxPool2d()(x), nn.functional.max_pool2d(torch.relu(x), 2))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 1, 4), (2, 3, 5, 1), (3, 1, 6)], ids=str)
def test_too_small_an_input_raises_as_max_pool2d_does(shape):
    """H or W below 2 pools to nothing: F.max_pool2d raises, the layer returned an empty tensor."""
    x = torch.randn(shape)
    with pytest.raises(RuntimeError, match="Output size is too small"):
        nn.functional.max_pool2d(torch.relu(x), 2)
    with pytest.raises(RuntimeError, match="Output size is too small"):
        ReLUMaxPool2d()(x)


@pytest.mark.parametrize("shape", [(1, 1, 2, 2), (0, 3, 2, 5), (2, 3, 3, 2)], ids=str)
def test_the_smallest_inputs_pool_as_max_pool2d_does(shape):
    x = torch.randn(shape, dtype=torch.float64)
    assert torch.equal(ReLUMaxPool2d()(x), nn.functional.max_pool2d(torch.relu(x), 2))

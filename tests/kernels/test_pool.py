"""pfl::relu_max_pool2d (ReLU + 2x2 max pool in one op) on CPU (the C++ kernel when built)
against ``F.max_pool2d(F.relu(x), 2)`` and the float64 reference, with every order of
derivative."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pfl_kernels.ops import relu_max_pool2d
from pfl_kernels.reference import pool as ref
from tests.kernels.autograd_checks import assert_all_orders
from tests.threads import on_one_and_many_threads

F64 = torch.float64
SHAPES = [(1, 1, 2, 2), (2, 3, 5, 7), (4, 6, 28, 28), (3, 17, 9, 10), (2, 16, 10, 10), (1, 2, 3, 33)]
LAYOUTS = ["contiguous", "channels_last", "strided"]


def make_input(shape, dtype=torch.float32, layout="contiguous", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=F64).to(dtype)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":  # every other column of a wider tensor
        wide = torch.randn(*shape[:3], 2 * shape[3], generator=g, dtype=F64).to(dtype)
        return wide[..., ::2]
    return x


def plain(x):
    """The unfused pair, as CNNs write it."""
    return F.max_pool2d(F.relu(x), 2)


def forward_and_grad(fn, x, grad):
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    out.backward(grad)
    return out.detach(), leaf.grad


def assert_same(a, b):
    """Equal values, NaN where the other has NaN (the op selects values: no rounding)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_relu_then_max_pool(shape, dtype, layout):
    x = make_input(shape, dtype, layout)
    grad = torch.randn(shape[0], shape[1], shape[2] // 2, shape[3] // 2, dtype=F64).to(dtype)
    before = x.clone()
    out, gx = forward_and_grad(relu_max_pool2d, x, grad)
    want_out, want_gx = forward_and_grad(plain, x, grad)
    assert_same(out, want_out)
    assert_same(gx, want_gx)
    assert torch.equal(x, before)  # the input is only read
    if layout == "channels_last" and shape[1] > 1 and shape[2] * shape[3] > 4:
        assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_nan_inf_ties_and_closed_windows(layout):
    x = torch.randn(3, 9, 6, 8, dtype=F64)
    x[0, 0, 0, 0] = float("nan")                       # NaN first in its window
    x[0, 1, 1, 1] = float("nan")                       # NaN last
    x[0, 2, 0, 0], x[0, 2, 1, 1] = float("nan"), float("nan")  # two NaNs: the last one wins
    x[1, 0, 2:4, 2:4] = float("inf")                   # ties at +inf: the first one wins
    x[1, 1, 0:2, 0:2] = -float("inf")                  # all -inf: closed
    x[1, 2, 0:2, 0:2] = -torch.rand(2, 2, dtype=F64)   # all negative: closed
    x[1, 3, 0:2, 0:2] = 0.0                            # all zero: closed
    x[2, 4, 2, 2], x[2, 4, 3, 3] = 5.0, 5.0            # a positive tie
    x = x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x
    grad = torch.randn(3, 9, 3, 4, dtype=F64)
    grad[0, 5, 0, 0] = float("nan")                    # a NaN gradient where the ReLU is open
    x[0, 5, 0, 0] = 1.0 + x[0, 5, 0:2, 0:2].abs().max()
    grad[1, 2, 0, 0] = float("nan")                    # and where it is closed: dropped
    out, gx = forward_and_grad(relu_max_pool2d, x, grad)
    want_out, want_gx = forward_and_grad(plain, x, grad)
    assert_same(out, want_out)
    assert_same(gx, want_gx)
    _, offsets = torch.ops.pfl.relu_max_pool2d(x)
    assert offsets[0, 0, 0, 0] == 0 and offsets[0, 1, 0, 0] == 3 and offsets[0, 2, 0, 0] == 3
    assert offsets[1, 0, 1, 1] == 0 and offsets[2, 4, 1, 1] == 0
    assert offsets[1, 1, 0, 0] == offsets[1, 2, 0, 0] == offsets[1, 3, 0, 0] == ref.CLOSED


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 0, 4, 4), (2, 3, 1, 4), (2, 3, 4, 1), (2, 3, 0, 0)], ids=str)
def test_empty(shape):
    x = torch.randn(*shape, requires_grad=True)
    out = relu_max_pool2d(x)
    assert out.shape == (shape[0], shape[1], shape[2] // 2, shape[3] // 2)
    out.sum().backward()
    assert x.grad.shape == x.shape and not x.grad.any()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_kernel_matches_reference(layout):
    x = make_input((5, 7, 11, 13), F64, layout, seed=3)
    out, offsets = torch.ops.pfl.relu_max_pool2d(x)
    want_out, want_offsets = ref.relu_max_pool2d(x)
    assert torch.equal(out, want_out) and torch.equal(offsets, want_offsets)
    grad = torch.randn_like(out)
    assert torch.equal(torch.ops.pfl.relu_max_pool2d_backward(grad, offsets, [11, 13]),
                       ref.relu_max_pool2d_backward(grad, offsets, [11, 13]))


def test_result_does_not_depend_on_threads():
    x = make_input((16, 6, 28, 28), layout="channels_last", seed=4)
    grad = torch.randn(16, 6, 14, 14)
    one, many = on_one_and_many_threads(lambda: forward_and_grad(relu_max_pool2d, x, grad))
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_every_order_of_derivative(layout):
    x = make_input((2, 3, 5, 6), F64, layout, seed=5).requires_grad_()  # random: no ties
    assert_all_orders(relu_max_pool2d, (x,))


def test_backward_op_every_order():
    x = make_input((2, 3, 5, 6), F64, seed=6)
    _, offsets = torch.ops.pfl.relu_max_pool2d(x)
    grad = torch.randn(2, 3, 2, 3, dtype=F64, requires_grad=True)
    assert_all_orders(lambda g: torch.ops.pfl.relu_max_pool2d_backward(g, offsets, [5, 6]), (grad,))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_opcheck(layout):
    x = make_input((2, 5, 7, 6), torch.float32, layout, seed=7).requires_grad_()
    torch.library.opcheck(torch.ops.pfl.relu_max_pool2d, (x,))
    _, offsets = torch.ops.pfl.relu_max_pool2d(x.detach())
    grad = torch.randn(2, 5, 3, 3, requires_grad=True)
    torch.library.opcheck(torch.ops.pfl.relu_max_pool2d_backward, (grad, offsets, [7, 6]))


def test_vmap_is_more_images():
    x = torch.randn(3, 2, 4, 6, 6, dtype=F64)
    got = torch.func.vmap(relu_max_pool2d)(x)
    assert torch.equal(got, torch.stack([relu_max_pool2d(xi) for xi in x]))
    grads = torch.func.vmap(torch.func.grad(lambda xi: relu_max_pool2d(xi).pow(2).sum()))(x)
    want = torch.stack([torch.func.grad(lambda xi: plain(xi).pow(2).sum())(xi) for xi in x])
    assert torch.equal(grads, want)


def test_vmap_over_a_convolutions_layout_folds_into_channels():
    """After a per-client convolution vmap holds [N, clients, C, H, W] (vmapped dim 1): the rule
    pools it as [N, clients·C, H, W], a view (no copy), and returns its outputs in that layout;
    values, offsets and gradients are each client's own (odd sizes: the last row and column
    dropped)."""
    from pfl_kernels.ops._vmap import fold_into_channels

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 2, 7, 9, generator=g, dtype=F64)  # [N, clients, C, H, W]
    info = type("Info", (), {"batch_size": 3})()
    (folded,), unfold = fold_into_channels(info, (1,), (x,))
    assert folded.shape == (4, 6, 7, 9) and folded.data_ptr() == x.data_ptr()
    assert unfold(folded).shape == x.shape
    # clients first and contiguous ([clients, N, C, H, W]): no view folds them into the channels
    assert fold_into_channels(info, (0,), (x.movedim(1, 0).contiguous(),)) is None
    out, offsets = torch.func.vmap(torch.ops.pfl.relu_max_pool2d, in_dims=1)(x)
    for k in range(3):
        want_out, want_offsets = torch.ops.pfl.relu_max_pool2d(x[:, k].contiguous())
        assert torch.equal(out[k], want_out) and torch.equal(offsets[k], want_offsets)
    grads = torch.func.vmap(torch.func.grad(lambda xi: relu_max_pool2d(xi).pow(2).sum()), in_dims=1)(x)
    for k in range(3):
        assert torch.equal(grads[k], torch.func.grad(lambda xi: plain(xi).pow(2).sum())(x[:, k].contiguous()))


@pytest.mark.parametrize("bad, error, message", [
    ("not a tensor", TypeError, "input must be a torch.Tensor"),
    (torch.ones(2, 3, 4, 4, dtype=torch.int64), TypeError, "input must be a floating tensor"),
    (torch.ones(3, 4, 4), ValueError, r"input must be \[N, C, H, W\]"),
])
def test_wrapper_errors(bad, error, message):
    with pytest.raises(error, match=message):
        relu_max_pool2d(bad)


def test_backward_op_errors():
    _, offsets = torch.ops.pfl.relu_max_pool2d(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match="offsets must be"):
        torch.ops.pfl.relu_max_pool2d_backward(torch.randn(2, 3, 2, 2), offsets, [6, 4])
    with pytest.raises(ValueError, match="grad must have the shape of offsets"):
        torch.ops.pfl.relu_max_pool2d_backward(torch.randn(2, 3, 2, 1), offsets, [4, 4])
    with pytest.raises(TypeError, match="offsets must be uint8"):
        torch.ops.pfl.relu_max_pool2d_backward(torch.randn(2, 3, 2, 2), offsets.long(), [4, 4])

"""Convolutions under ``vmap`` and bf16 autocast (``model_call.AutocastConvolutions``, entered by
``vmapped_autocast`` where the device's autocast leaves ``aten::convolution`` alone, as the
CPU's does): each client's convolution runs in bfloat16 as the unbatched one does (float64
reference of the bf16-rounded inputs), its gradients reach the float32 weights, calls outside
autocast and float64 ones are untouched, and every convolution of a bf16 round runs in bfloat16
on either executor (before the mode the batched executor's ran in float32 on a CPU)."""
from __future__ import annotations

import pytest
import torch
from torch.func import vmap
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pfl_algorithms.engine.model_call import (AutocastConvolutions, autocast_casts_batched_convolutions,
                                              vmapped_autocast)

from .test_conv_gemm import _run

CLIENTS = 3
CPU = torch.device("cpu")


class ConvolutionDtypes(TorchDispatchMode):
    """Records the dtypes of the tensors each convolution is given, forward and backward apart."""

    def __init__(self):
        super().__init__()
        self.forward, self.backward = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.convolution, torch.ops.aten.convolution_backward):
            seen = self.forward if func.overloadpacket is torch.ops.aten.convolution else self.backward
            seen.append({a.dtype for a in args if isinstance(a, torch.Tensor)})
        return func(*args, **(kwargs or {}))

    @property
    def seen(self):
        return self.forward + self.backward


# (functional, per-client input shape, per-client weight shape, keyword arguments)
CASES = {
    "conv1d": (F.conv1d, (2, 3, 11), (4, 3, 3), dict(padding=1)),
    "conv2d": (F.conv2d, (2, 3, 7, 6), (5, 3, 3, 2), dict(stride=(2, 1))),
    "conv3d": (F.conv3d, (2, 2, 5, 4, 3), (3, 2, 2, 2, 2), {}),
    "conv_transpose2d": (F.conv_transpose2d, (2, 4, 5, 5), (4, 3, 3, 3), dict(stride=2)),
}


def _clients(case):
    conv, x_shape, w_shape, kwargs = CASES[case]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(CLIENTS, *x_shape, generator=g)
    w = torch.randn(CLIENTS, *w_shape, generator=g)
    b = torch.randn(CLIENTS, w_shape[1] if case.startswith("conv_transpose") else w_shape[0], generator=g)
    return conv, x, w, b, kwargs


# A bf16 convolution rounds its result, and on some CPUs partial sums too: on an AVX2-only AMD
# EPYC, torch's own (unbatched) bf16 conv_transpose2d was off by 1.77 units of 2^-8 of the
# products' magnitude Σ|x||w| + |b|, past a bound of one rounding of the result.  Each rounding
# costs at most 2^-8 of a partial sum, which is at most that magnitude: four roundings' worth
# holds there (worst forward 1.77, gradients 1.52) and is still far from a wrong client's
# weights or a float32 convolution's dtype (the dtypes are checked apart).
BF16_ROUNDINGS = 4


def assert_within_bf16_roundings(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """|got - want| <= BF16_ROUNDINGS · 2^-8 · magnitude, elementwise (magnitude: the float64
    sums of the products' absolute values)."""
    error = (got.double() - want).abs()
    bound = BF16_ROUNDINGS * 2.0 ** -8 * magnitude
    worst = (error - bound).argmax()
    assert bool((error <= bound).all()), (f"off by {error.flatten()[worst]:.3g} at flat index {int(worst)}, "
                                          f"bound {bound.flatten()[worst]:.3g}")


def _per_client(conv, tensors, kwargs):
    return torch.stack([conv(*(t[c] for t in tensors), **kwargs) for c in range(CLIENTS)])


@pytest.mark.parametrize("case", list(CASES))
def test_a_vmapped_convolution_under_bf16_autocast_runs_in_bf16(case):
    conv, x, w, b, kwargs = _clients(case)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    record = ConvolutionDtypes()
    with vmapped_autocast("bf16", CPU), record:
        out = vmap(lambda xi, wi, bi: conv(xi, wi, bi, **kwargs))(*leaves)
    assert out.dtype == torch.bfloat16
    assert record.seen and all(dtypes == {torch.bfloat16} for dtypes in record.seen)
    # Client by client: the float64 convolution of the bfloat16-rounded inputs, within a few
    # bf16 roundings of the products' magnitude (the same convolution of absolute values).
    rounded = [t.to(torch.bfloat16).double() for t in (x, w, b)]
    wide = [t.clone().requires_grad_() for t in rounded]
    absolute = [t.abs().requires_grad_() for t in rounded]
    want, magnitude = _per_client(conv, wide, kwargs), _per_client(conv, absolute, kwargs)
    assert_within_bf16_roundings(out, want.detach(), magnitude.detach())
    # Gradients reach the float32 leaves, as bfloat16 products of bf16-rounded values (the
    # convolution is bilinear: the gradients of the absolute values are their magnitudes).
    grad_out = torch.linspace(-1, 1, out.numel()).view_as(out).to(torch.bfloat16)
    out.backward(grad_out)
    want.backward(grad_out.double())
    magnitude.backward(grad_out.double().abs())
    for leaf, ref, mag in zip(leaves, wide, absolute):
        assert leaf.grad.dtype == torch.float32
        assert_within_bf16_roundings(leaf.grad, ref.grad, mag.grad)


def test_calls_outside_autocast_and_float64_calls_are_untouched():
    conv, x, w, b, kwargs = _clients("conv2d")
    with AutocastConvolutions("cpu"):
        plain = conv(x[0], w[0], b[0], **kwargs)
    assert torch.equal(plain, conv(x[0], w[0], b[0], **kwargs)) and plain.dtype == torch.float32
    x64, w64, b64 = (t[0].double() for t in (x, w, b))
    with vmapped_autocast("bf16", CPU):
        wide = conv(x64, w64, b64, **kwargs)
    assert wide.dtype == torch.float64 and torch.equal(wide, conv(x64, w64, b64, **kwargs))


def test_which_autocasts_cast_batched_convolutions():
    assert not autocast_casts_batched_convolutions("cpu")
    assert autocast_casts_batched_convolutions("cuda")
    assert not autocast_casts_batched_convolutions("no-such-device")


@pytest.mark.parametrize("executor", ["batched", "sequential"])
def test_every_training_convolution_of_a_bf16_round_runs_in_bf16(executor):
    """Two FedAvg rounds of test_conv_gemm's SmallConvNet under ``--autocast bf16`` on a CPU,
    with vmap's grouped convolutions: before the mode the batched executor's ran in float32,
    forward and backward (the sequential executor's are unbatched: autocast casts them).  The
    evaluations after each round run without autocast: float32 forwards, as many on either
    executor."""
    record = ConvolutionDtypes()
    with record:
        _run("grouped", executor, False, dtype=torch.float32, autocast="bf16")
    assert record.backward and all(dtypes == {torch.bfloat16} for dtypes in record.backward)
    in_bf16 = sum(dtypes == {torch.bfloat16} for dtypes in record.forward)
    assert in_bf16 >= len(record.backward)
    evaluation = 2 * 3 * 2  # rounds x clients x convolutions
    assert in_bf16 + evaluation == len(record.forward)

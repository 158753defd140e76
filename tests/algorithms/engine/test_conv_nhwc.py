"""Per-client convolutions as one channels-last grouped convolution under ``vmap``
(``engine/conv_nhwc.py``, ``batched_conv='grouped-nhwc'``): vmap's grouped convolution's values and
gradients in float64 for every stride, padding and dilation form, with per-client, shared or no
bias and groups within a client; an output in channels-last that the next op folds; what it does
not fold runs as before; a batched run with it equals the grouped one."""
from __future__ import annotations

import pytest
import torch
from torch.func import vmap
from torch.nn import functional as F

from pfl_algorithms.engine import conv_nhwc
from pfl_algorithms.engine.conv_nhwc import NhwcConvolutions

from ..state_checks import assert_close_state
from .test_conv_gemm import CASES, _inputs, _run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def folded(monkeypatch):
    """[whether each conv2d_nhwc call folded]."""
    seen, real = [], conv_nhwc.conv2d_nhwc

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(conv_nhwc, "conv2d_nhwc", spy)
    return seen


class _Plain(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _values_and_gradients(mode, fn, tensors, in_dims):
    leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
    with mode:
        out = vmap(fn, in_dims=in_dims)(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out))
    return out.detach(), [None if t is None else t.grad for t in leaves]


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(got[1], want[1]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()) or "plain")
@pytest.mark.parametrize("bias", ["clients", "shared", None])
def test_values_and_gradients_equal_the_grouped_convolution(folded, kwargs, bias, device):
    x, w, b = _inputs(device=device)
    b = {"clients": b, "shared": b[0], None: None}[bias]
    in_dims = (0, 0, 0 if bias == "clients" else None)

    def conv(x, w, b):
        return F.conv2d(x, w, b, **kwargs)

    _assert_same(_values_and_gradients(NhwcConvolutions(), conv, (x, w, b), in_dims),
                 _values_and_gradients(_Plain(), conv, (x, w, b), in_dims))
    assert folded == [True]


def test_groups_within_a_client_and_vmaps_own_output_layout(folded):
    """A client's own groups (5 input channels, 5 groups) become groups·clients; the output is
    vmap's own layout, [N, clients, O, H', W'] contiguous, which the next op takes as it would
    take the grouped convolution's (a channels-last one failed GroupNorm's rule under vmap)."""
    assert_groups_and_vmaps_layout(NhwcConvolutions)
    assert folded == [True, True]


def assert_groups_and_vmaps_layout(mode):
    """Under ``mode()``, a depthwise convolution (groups within a client) then GroupNorm and a
    1x1 convolution: plain vmap's values and gradients, and the first output in vmap's own
    layout ([N, clients, O, H', W'] contiguous)."""
    x, _, _ = _inputs()
    g = torch.Generator().manual_seed(4)
    depthwise = torch.randn(3, 10, 1, 3, 3, generator=g, dtype=x.dtype)
    second = torch.randn(3, 4, 10, 1, 1, generator=g, dtype=x.dtype)
    layouts = []

    def net(x, w1, w2):
        y = F.conv2d(x, w1, groups=5, padding=1)
        physical, bdim = torch._C._functorch._unwrap_batched(y, torch._C._functorch.maybe_get_level(y))
        layouts.append((bdim, physical.is_contiguous()))
        return F.conv2d(F.group_norm(torch.relu(y), 5), w2)

    want = _values_and_gradients(_Plain(), net, (x, depthwise, second), (0, 0, 0))
    layouts.clear()
    got = _values_and_gradients(mode(), net, (x, depthwise, second), (0, 0, 0))
    _assert_same(got, want)
    assert layouts == [(1, True)]


def test_what_it_does_not_fold_runs_as_before(folded):
    """A weight shared by the clients (vmap makes one dense convolution of it), unbatched images
    [C, H, W], and shapes that do not fit (F.conv2d's own error)."""
    assert_runs_as_before(NhwcConvolutions)
    assert folded == [False, False, False]


def assert_runs_as_before(mode):
    """Under ``mode()``, a shared weight, unbatched images and shapes that do not fit give plain
    vmap's results and error."""
    x, w, b = _inputs()
    cases = [(lambda x, w: F.conv2d(x, w), (0, None), (x, w[0])), (lambda x, w: F.conv2d(x, w), (0, 0), (x[:, 0], w))]
    for fn, in_dims, args in cases:
        with mode():
            got = vmap(fn, in_dims=in_dims)(*args)
        torch.testing.assert_close(got, vmap(fn, in_dims=in_dims)(*args), rtol=0, atol=0)
    with mode(), pytest.raises(RuntimeError) as folded_error:
        vmap(F.conv2d)(x, w[:, :, :4])
    with pytest.raises(RuntimeError) as plain_error:
        vmap(F.conv2d)(x, w[:, :, :4])
    assert str(folded_error.value) == str(plain_error.value)


@pytest.mark.parametrize("factorized", [False, True], ids=["dense", "factorized"])
def test_a_batched_run_with_nhwc_convolutions_equals_the_grouped_one(factorized):
    """SmallConvNet (a strided, padded second convolution, BatchNorm and pooling between) on the
    batched executor, training and chunked evaluation: the grouped run's numbers."""
    assert_close_state(_run("grouped-nhwc", "batched", factorized), _run("grouped", "batched", factorized),
                       rtol=1e-9, atol=1e-10)


@cuda
def test_on_cuda_a_batched_run_with_nhwc_convolutions_equals_the_grouped_one():
    assert_close_state(_run("grouped-nhwc", "batched", False, device="cuda"),
                       _run("grouped", "batched", False, device="cuda"), rtol=1e-9, atol=1e-10)

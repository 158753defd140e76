"""BatchNorm of a bfloat16 input with float32 statistics under ``vmap`` (``model_call.MixedBatchNorm``,
the batched executor's forward under ``--autocast bf16``): each client's output, gradients and
running statistics as the unbatched mixed BatchNorm computes them (float64 reference), every
other call untouched, and a batched bf16 run of a BatchNorm model (its convolutions hand
BatchNorm bfloat16, grouped or lowered to GEMMs) trains as the sequential one."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from pfl_algorithms.engine.model_call import MixedBatchNorm, vmapped_autocast

from .test_conv_gemm import _run

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CLIENTS = 3


def _clients(training: bool, device: str = "cpu"):
    """A BatchNorm2d(5) template, per-client float32 parameters and buffers (random, not their
    defaults), and a bfloat16 input [C, 7, 5, 3, 4] with one row far from the others."""
    g = torch.Generator().manual_seed(11)
    bn = nn.BatchNorm2d(5).train(training)
    params = {"weight": 1 + 0.3 * torch.randn(CLIENTS, 5, generator=g), "bias": torch.randn(CLIENTS, 5, generator=g)}
    buffers = {"running_mean": torch.randn(CLIENTS, 5, generator=g), "running_var": 0.5 + torch.rand(CLIENTS, 5, generator=g),
               "num_batches_tracked": torch.zeros(CLIENTS, dtype=torch.int64)}
    x = (3 * torch.randn(CLIENTS, 7, 5, 3, 4, generator=g) + 2).to(torch.bfloat16)
    x[1, 2] += 40
    move = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return bn.to(device), move(params), move(buffers), x.to(device)


def _vmapped(bn, params, buffers, x, mode):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    parts = {k: v.clone() for k, v in buffers.items()}
    xs = x.clone().requires_grad_()
    with mode:
        out = vmap(lambda p, b, xi: functional_call(bn, {**p, **b}, (xi,)))(leaves, parts, xs)
    grad_out = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype)
    out.backward(grad_out)
    return out, xs.grad, {k: v.grad for k, v in leaves.items()}, parts, grad_out


def _reference(bn, params, buffers, x, grad_out):
    """Client by client in float64: the unbatched computation the mixed kernels approximate."""
    outs, x_grads, p_grads, stats = [], [], {"weight": [], "bias": []}, {"running_mean": [], "running_var": []}
    for c in range(CLIENTS):
        w, b = (params[k][c].double().requires_grad_() for k in ("weight", "bias"))
        mean, var = buffers["running_mean"][c].double().clone(), buffers["running_var"][c].double().clone()
        xc = x[c].double().requires_grad_()
        out = F.batch_norm(xc, mean, var, w, b, bn.training, bn.momentum, bn.eps)
        out.backward(grad_out[c].double())
        outs.append(out.detach())
        x_grads.append(xc.grad)
        p_grads["weight"].append(w.grad)
        p_grads["bias"].append(b.grad)
        stats["running_mean"].append(mean)
        stats["running_var"].append(var)
    stack = lambda ts: torch.stack(ts).cpu()  # noqa: E731
    return stack(outs), stack(x_grads), {k: stack(v) for k, v in p_grads.items()}, {k: stack(v) for k, v in stats.items()}


def _affine_gradient_scales(bn, buffers, x, grad_out):
    """Per client and channel, the magnitudes the weight and bias gradients add up: Σ|dy·x̂|
    and Σ|dy| (float64, on the CPU), x̂ normalized by the batch's statistics when training, by
    the running ones in eval."""
    xs, dy = x.double().cpu(), grad_out.double().cpu()
    dims = (1, 3, 4)
    if bn.training:
        mean, var = xs.mean(dims, keepdim=True), xs.var(dims, unbiased=False, keepdim=True)
    else:
        mean, var = (buffers[k].double().cpu()[:, None, :, None, None] for k in ("running_mean", "running_var"))
    x_hat = (xs - mean) / torch.sqrt(var + bn.eps)
    return {"weight": (dy * x_hat).abs().sum(dims), "bias": dy.abs().sum(dims)}


def _check(training: bool, device: str, mode=None):
    """``mode`` (default ``MixedBatchNorm()``) runs the vmapped bf16 BatchNorm as the unbatched
    mixed one computes it (``test_folded_channels`` passes its own)."""
    bn, params, buffers, x = _clients(training, device)
    out, x_grad, p_grads, parts, grad_out = _vmapped(bn, params, buffers, x, mode or MixedBatchNorm())
    want_out, want_x_grad, want_p_grads, want_stats = _reference(bn, params, buffers, x, grad_out)
    # 16-bit results: within a few bfloat16 roundings (2^-8 relative) of the float64 values
    assert out.dtype == x_grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.double().cpu(), want_out, rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(x_grad.double().cpu(), want_x_grad, rtol=2 ** -7, atol=2 ** -9)
    # float32 results (the affine gradients sum bf16 products: bfloat16's precision)
    scales = _affine_gradient_scales(bn, buffers, x, grad_out) if device == "cuda" else None
    for name in ("weight", "bias"):
        assert p_grads[name].dtype == torch.float32
        got = p_grads[name].double().cpu()
        if device == "cuda":
            # ATen's native mixed kernel on CUDA (unbatched and folded alike) rounds these sums
            # at bfloat16's precision: on an H200 off by up to 1.2e-3 of the magnitudes they add
            # up, 3% of a gradient whose terms cancel (benchmarks/bf16_batch_norm_error.py;
            # pytorch#156513).  The bound for such a sum is relative to those magnitudes.
            assert ((got - want_p_grads[name]).abs() <= 2 ** -7 * (want_p_grads[name].abs() + scales[name])).all(), name
        else:
            torch.testing.assert_close(got, want_p_grads[name], rtol=2 ** -7, atol=2 ** -7)
    for name in ("running_mean", "running_var"):
        assert parts[name].dtype == torch.float32
        torch.testing.assert_close(parts[name].double().cpu(), want_stats[name], rtol=1e-5, atol=1e-6)
    moved = parts["running_mean"] != buffers["running_mean"]
    assert bool(moved.all()) if training else not moved.any()
    assert parts["num_batches_tracked"].tolist() == [int(training)] * CLIENTS


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_vmapped_bf16_batch_norm_equals_the_unbatched_mixed_one(training):
    _check(training, "cpu")


@cuda
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_vmapped_bf16_batch_norm_on_cuda(training):
    _check(training, "cuda")


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float64, torch.float64)], ids=["float32", "bf16-params", "float64"])
def test_calls_that_are_not_mixed_are_untouched(dtypes):
    """Every other BatchNorm call (one dtype throughout) gives exactly what it gives without the
    mode; so does a call by keywords."""
    x_dtype, p_dtype = dtypes
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 4, 3, 3, generator=g).to(x_dtype)
    mean, var = torch.randn(4, generator=g).to(p_dtype), (0.5 + torch.rand(4, generator=g)).to(p_dtype)
    w, b = torch.randn(4, generator=g).to(p_dtype), torch.randn(4, generator=g).to(p_dtype)
    plain = F.batch_norm(x, mean.clone(), var.clone(), w, b, True, 0.1, 1e-5)
    with MixedBatchNorm():
        moded = F.batch_norm(x, mean.clone(), var.clone(), w, b, True, 0.1, 1e-5)
        by_keywords = F.batch_norm(input=x, running_mean=mean.clone(), running_var=var.clone(), weight=w, bias=b,
                                   training=True)
    assert torch.equal(moded, plain) and torch.equal(by_keywords, plain)


def test_a_mixed_call_by_keywords_runs_wide():
    x = torch.randn(6, 4, 3, 3).to(torch.bfloat16)
    mean, var = torch.zeros(4), torch.ones(4)
    with MixedBatchNorm():
        out = F.batch_norm(input=x, running_mean=mean, running_var=var, training=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.batch_norm(x.float(), torch.zeros(4), torch.ones(4), training=True).to(torch.bfloat16))
    assert mean.abs().sum() > 0  # the float32 running mean was updated


def test_vmapped_autocast_adds_the_mode_with_bf16_only():
    with vmapped_autocast(None, torch.device("cpu")):
        assert not torch._C._is_torch_function_mode_enabled() and not torch.is_autocast_enabled("cpu")
    with vmapped_autocast("bf16", torch.device("cpu")):
        assert torch._C._is_torch_function_mode_enabled() and torch.is_autocast_enabled("cpu")
    assert not torch._C._is_torch_function_mode_enabled()


def _bf16_losses(device: str, conv: str, executor: str) -> dict:
    """The clients' training losses of the first FedAvg round of ``test_conv_gemm``'s
    SmallConvNet (BatchNorm after its first convolution) in float32 under bf16 autocast."""
    records, _, _ = _run(conv, executor, False, device, dtype=torch.float32, autocast="bf16")
    return records[0]["train_loss"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_a_batched_bf16_run_of_a_batch_norm_model_trains_as_the_sequential_one(device):
    """The convolutions hand BatchNorm bfloat16: before the mode, on a CPU the GEMM-lowered ones
    failed ("expected scalar type BFloat16 but found Float"), and on CUDA the grouped ones too
    (an H100: the backward failed); on a CPU the grouped ones do since ``AutocastConvolutions``.
    The batched losses are the sequential executor's to bfloat16 precision."""
    sequential = _bf16_losses(device, "grouped", "sequential")
    for conv in ("grouped", "gemm"):
        batched = _bf16_losses(device, conv, "batched")
        assert batched.keys() == sequential.keys()
        for client, loss in batched.items():
            assert loss == pytest.approx(sequential[client], rel=0.05), (conv, client)

"""Each client's BatchNorm and max pooling under ``vmap`` as one native op over the clients'
channels (``engine/folded_channels.py``, the batched executor's forward): the batching rule's
output, gradients and running statistics in float64, the unbatched mixed BatchNorm's in bfloat16
with float32 statistics, and the batching rule itself wherever the call does not fold."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from pfl_algorithms.engine import folded_channels as folding
from pfl_algorithms.engine.folded_channels import FoldedChannels

from .test_mixed_batch_norm import _check, _clients, _vmapped

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
F64 = torch.float64
K = 3


@pytest.fixture
def folds(monkeypatch):
    """[whether each folded_batch_norm, folded_group_norm or folded_pooling call folded]."""
    seen = []

    def spy(real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            seen.append(out is not None)
            return out
        return call

    for name in ("folded_batch_norm", "folded_group_norm", "folded_pooling"):
        monkeypatch.setattr(folding, name, spy(getattr(folding, name)))
    return seen


def _module(kind: str, affine: bool, track: bool, training: bool) -> nn.Module:
    cls = nn.BatchNorm1d if kind.startswith("1d") else nn.BatchNorm2d
    return cls(4, affine=affine, track_running_stats=track, momentum=0.3).to(F64).train(training)


def _input(kind: str, g) -> torch.Tensor:
    """A client batch [K, N, 4, ...] with per-client shifts, so that the clients' statistics differ."""
    shape = {"1d": (K, 6, 4), "1d-seq": (K, 5, 4, 7), "2d": (K, 5, 4, 3, 2)}[kind]
    shift = torch.arange(K, dtype=F64).view(K, *[1] * (len(shape) - 1)) * 3
    return torch.randn(*shape, generator=g, dtype=F64) * (1 + shift) + shift


def _run(bn, params, buffers, x, mode, *, in_dims=0):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    parts = {k: v.clone() for k, v in buffers.items()}
    xs = x.clone().requires_grad_()
    with mode:
        out = vmap(lambda p, b, xi: functional_call(bn, {**p, **b}, (xi,)), in_dims=in_dims)(leaves, parts, xs)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=F64, device=out.device).view_as(out))
    return out.detach(), xs.grad, {k: v.grad for k, v in leaves.items()}, parts


def _assert_same(got, want, tol=1e-12):
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for grads_or_stats in (2, 3):
        assert got[grads_or_stats].keys() == want[grads_or_stats].keys()
        for k in got[grads_or_stats]:
            torch.testing.assert_close(got[grads_or_stats][k], want[grads_or_stats][k], rtol=tol, atol=tol)


@cuda
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_folded_equals_the_batching_rule_on_cuda(folds, training):
    """The same on CUDA (its BatchNorm kernels over the folded channels), float64."""
    g = torch.Generator().manual_seed(6)
    bn = _module("2d", True, True, training).cuda()
    x = _input("2d", g).cuda()
    params = {"weight": (1 + 0.3 * torch.randn(K, 4, generator=g, dtype=F64)).cuda(),
              "bias": torch.randn(K, 4, generator=g, dtype=F64).cuda()}
    buffers = {"running_mean": torch.randn(K, 4, generator=g, dtype=F64).cuda(),
               "running_var": (0.5 + torch.rand(K, 4, generator=g, dtype=F64)).cuda(),
               "num_batches_tracked": torch.zeros(K, dtype=torch.int64).cuda()}
    _assert_same(_run(bn, params, buffers, x, FoldedChannels()), _run(bn, params, buffers, x, _Plain()), tol=1e-10)
    assert folds == [True]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("track", [True, False], ids=["stats", "no-stats"])
@pytest.mark.parametrize("affine", ["clients", "shared", None])
@pytest.mark.parametrize("kind", ["1d", "1d-seq", "2d"])
def test_folded_equals_the_batching_rule_in_float64(folds, kind, affine, track, training):
    """Output, the input's and the affine parameters' gradients, and the running statistics (updated
    in place through the fold) as vmap's own rule computes them; each call folded."""
    g = torch.Generator().manual_seed(3)
    bn = _module(kind, affine is not None, track, training)
    x = _input(kind, g)
    params, buffers = {}, {}
    if affine == "clients":
        params = {"weight": 1 + 0.3 * torch.randn(K, 4, generator=g, dtype=F64),
                  "bias": torch.randn(K, 4, generator=g, dtype=F64)}
    if track:
        buffers = {"running_mean": torch.randn(K, 4, generator=g, dtype=F64),
                   "running_var": 0.5 + torch.rand(K, 4, generator=g, dtype=F64),
                   "num_batches_tracked": torch.zeros(K, dtype=torch.int64)}
    if affine == "shared":  # the module's own parameters, not mapped over
        with torch.no_grad():
            bn.weight.copy_(1 + 0.3 * torch.randn(4, generator=g, dtype=F64))
            bn.bias.copy_(torch.randn(4, generator=g, dtype=F64))
    want = _run(bn, params, buffers, x, _Plain())
    shared = [p.grad.clone() for p in bn.parameters()] if affine == "shared" else []
    bn.zero_grad()
    got = _run(bn, params, buffers, x, FoldedChannels())
    _assert_same(got, want)
    for p, grad in zip(bn.parameters(), shared):  # a shared affine's gradient sums the clients'
        torch.testing.assert_close(p.grad, grad, rtol=1e-12, atol=1e-12)
    assert folds == [True]
    if track:
        moved = got[3]["running_mean"] != buffers["running_mean"]
        assert bool(moved.all()) if training else not moved.any()


class _Plain(torch.overrides.TorchFunctionMode):
    """No change: vmap's own batching rule."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_folded_bf16_batch_norm_equals_the_unbatched_mixed_one(folds, training):
    """A bfloat16 input with float32 statistics goes to the native mixed kernel folded, with no
    cast of the activations (MixedBatchNorm's float32 copy and back, 1.7 GB of a batched ResNet-9
    round's traffic): within bfloat16 roundings of float64, as unbatched."""
    _check(training, "cpu", FoldedChannels())
    assert folds == [True]


@cuda
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_folded_bf16_batch_norm_on_cuda(training):
    _check(training, "cuda", FoldedChannels())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_folded_bf16_batch_norm_gives_the_sequential_executors_numbers(training, device):
    """Folded, each client's bfloat16 BatchNorm is the one its own unbatched call computes (the
    sequential executor's), to float32 rounding in the affine gradients.  On CUDA that call's
    native mixed kernel is only within bfloat16's rounding of float64 there (``_check``), and
    another way (MixedBatchNorm's float32) would give other numbers."""
    bn, params, buffers, x = _clients(training, device)
    out, x_grad, p_grads, parts, grad_out = _vmapped(bn, params, buffers, x, FoldedChannels())
    for c in range(x.shape[0]):
        w, b = (params[k][c].clone().requires_grad_() for k in ("weight", "bias"))
        mean, var = buffers["running_mean"][c].clone(), buffers["running_var"][c].clone()
        xc = x[c].clone().requires_grad_()
        want = F.batch_norm(xc, mean, var, w, b, bn.training, bn.momentum, bn.eps)
        want.backward(grad_out[c])
        torch.testing.assert_close(out[c], want, rtol=2 ** -8, atol=2 ** -8)
        torch.testing.assert_close(x_grad[c], xc.grad, rtol=2 ** -8, atol=2 ** -8)
        torch.testing.assert_close(p_grads["weight"][c], w.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p_grads["bias"][c], b.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(parts["running_mean"][c], mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(parts["running_var"][c], var, rtol=1e-6, atol=1e-6)


def _stats(g):
    return {"running_mean": torch.randn(K, 4, generator=g, dtype=F64),
            "running_var": 0.5 + torch.rand(K, 4, generator=g, dtype=F64)}


def test_calls_that_do_not_fold_run_the_batching_rule(folds):
    """Running statistics mapped over another dim (their rows fold into no view the in-place
    update would reach), nested vmaps (the inner level wraps another) and unbatched calls: the
    batching rule's results exactly."""
    g = torch.Generator().manual_seed(8)
    bn = _module("2d", True, True, True)
    x = _input("2d", g)
    stats = _stats(g)
    transposed = {k: v.t().contiguous() for k, v in stats.items()}  # [4, K], mapped over dim 1
    dims = (None, {k: 1 for k in transposed}, 0)
    _assert_same(_run(bn, {}, transposed, x, FoldedChannels(), in_dims=dims),
                 _run(bn, {}, transposed, x, _Plain(), in_dims=dims))
    assert folds == [False]

    nested_x = x.expand(2, *x.shape).clone()
    nested_stats = {k: v.expand(2, *v.shape).clone() for k, v in stats.items()}

    def nested(mode):
        parts = {k: v.clone() for k, v in nested_stats.items()}
        with mode:
            out = vmap(vmap(lambda b, xi: functional_call(bn, b, (xi,))))(parts, nested_x)
        return out, parts

    (out, parts), (want, want_parts) = nested(FoldedChannels()), nested(_Plain())
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for k in parts:
        torch.testing.assert_close(parts[k], want_parts[k], rtol=1e-12, atol=1e-12)
    assert folds[1:] and not any(folds[1:])

    plain_stats = {k: v[0].clone() for k, v in stats.items()}
    with FoldedChannels():
        out = bn(x[0])
    folds.clear()
    torch.testing.assert_close(out, F.batch_norm(
        x[0], plain_stats["running_mean"], plain_stats["running_var"], bn.weight, bn.bias, True, 0.3))


def test_one_value_per_channel_when_training_is_refused_as_unbatched():
    bn = _module("1d", True, True, True)
    stats = {k: v for k, v in _stats(torch.Generator().manual_seed(1)).items()}
    with FoldedChannels(), pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        vmap(lambda b, xi: functional_call(bn, b, (xi,)))(stats, torch.randn(K, 1, 4, dtype=F64))


POOLS = {"max": lambda x: F.max_pool2d(x, 2),
         "max-3-stride-2-pad-1": lambda x: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True),
         "adaptive": lambda x: F.adaptive_max_pool2d(x, 1),
         "adaptive-3x2": lambda x: F.adaptive_max_pool2d(x, (3, 2))}


@pytest.mark.parametrize("indices", [False, True], ids=["values", "indices"])
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_folded_max_pooling_equals_the_batching_rule(folds, pool, indices):
    """After a per-client convolution (vmap's [N, clients, C, ...] layout): values, indices (each a
    position in its own channel's plane) and the input's gradient as vmap's own rule gives them."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(K, 5, 2, 7, 9, generator=g, dtype=F64)
    w = torch.randn(K, 4, 2, 3, 3, generator=g, dtype=F64)

    def client(xi, wi):
        y = F.conv2d(xi, wi, padding=1)
        if not indices:
            return POOLS[pool](y)
        fn = F.adaptive_max_pool2d if pool.startswith("adaptive") else F.max_pool2d
        size = {"adaptive": (1,), "adaptive-3x2": ((3, 2),), "max": (2,)}.get(pool, (3, 2, 1, 1, True))
        return fn(y, *size, return_indices=True)

    def run(mode):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with mode:
            out = vmap(client)(xs, ws)
        values, where = out if indices else (out, None)
        values.backward(torch.linspace(-1, 1, values.numel(), dtype=F64).view_as(values))
        return values.detach(), where, xs.grad, ws.grad

    got, want = run(FoldedChannels()), run(_Plain())
    for a, b in zip(got, want):
        if a is None:
            assert b is None
        elif a.dtype == torch.int64:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert folds == [True]


def test_pooling_that_does_not_fold_runs_the_batching_rule(folds):
    """An unbatched-looking [C, H, W] input (no batch dim of its own) and an input the clients do
    not map over."""
    x = torch.randn(K, 2, 6, 6, dtype=F64)
    with FoldedChannels():
        got = vmap(lambda xi: F.max_pool2d(xi, 2))(x)
        shared = vmap(lambda w: F.max_pool2d(x[0][None], 2) * w)(torch.ones(K))
    torch.testing.assert_close(got, F.max_pool2d(x, 2))
    torch.testing.assert_close(shared[1], F.max_pool2d(x[0][None], 2))
    assert folds == [False, False]


def _group_norm_values_and_gradients(mode, x, w, b, in_dims, groups):
    leaves = [None if t is None else t.clone().detach().requires_grad_() for t in (x, w, b)]

    def norm(x, w, b):
        return F.group_norm(x, groups, w, b, 1e-3)

    with mode:
        out = vmap(norm, in_dims=in_dims)(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("affine", ["clients", "shared", None])
@pytest.mark.parametrize("shape", [(5, 6), (5, 6, 7), (4, 6, 5, 3)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("groups", [1, 3, 6])
def test_folded_group_norm_equals_the_batching_rule_in_float64(folds, affine, shape, groups):
    """K clients' GroupNorm (groups within each client's 6 channels; per-client, shared or no
    affine) as one GroupNorm over the clients' channels: the rule's values and gradients."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(K, *shape, generator=g, dtype=F64) * 3 + 1
    w, b = torch.randn(K, 6, generator=g, dtype=F64), torch.randn(K, 6, generator=g, dtype=F64)
    w, b = {"clients": (w, b), "shared": (w[0], b[0]), None: (None, None)}[affine]
    in_dims = (0, 0 if affine == "clients" else None, 0 if affine == "clients" else None)
    got = _group_norm_values_and_gradients(FoldedChannels(), x, w, b, in_dims, groups)
    want = _group_norm_values_and_gradients(_Plain(), x, w, b, in_dims, groups)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for a, c in zip(got[1], want[1]):
        assert (a is None) == (c is None)
        if a is not None:
            torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    assert folds == [True]


def test_folded_group_norm_takes_a_channels_last_input(folds):
    """A channels-last activation (a convolution with a channels-last weight gives one), which
    vmap's rule refuses: each client's own GroupNorm's values, in the standard layout."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(K, 4, 6, 5, 3, generator=g, dtype=F64)
    w, b = torch.randn(K, 6, generator=g, dtype=F64), torch.randn(K, 6, generator=g, dtype=F64)
    channels_last = x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)  # each client's channels-last
    assert channels_last[0].is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="is_contiguous inside of vmap"):
        _group_norm_values_and_gradients(_Plain(), channels_last, w, b, (0, 0, 0), 3)
    out, grads = _group_norm_values_and_gradients(FoldedChannels(), channels_last, w, b, (0, 0, 0), 3)
    want = torch.stack([F.group_norm(x[k], 3, w[k], b[k], 1e-3) for k in range(K)])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert all(t is not None and torch.isfinite(t).all() for t in grads)
    assert folds == [True]


def test_group_norm_that_does_not_fold_runs_the_batching_rule(folds):
    """Channels that the groups do not divide (F.group_norm's own error) and an unbatched input
    with a batched weight."""
    x = torch.randn(K, 4, 6, dtype=F64)
    with FoldedChannels(), pytest.raises(RuntimeError) as folded_error:
        vmap(lambda x: F.group_norm(x, 4))(x)
    with pytest.raises(RuntimeError) as plain_error:
        vmap(lambda x: F.group_norm(x, 4))(x)
    assert str(folded_error.value) == str(plain_error.value)
    w = torch.randn(K, 6, dtype=F64)
    with FoldedChannels():
        got = vmap(lambda w: F.group_norm(x[0], 3, w), in_dims=0)(w)
    torch.testing.assert_close(got, vmap(lambda w: F.group_norm(x[0], 3, w))(w), rtol=0, atol=0)
    assert folds == [False, False]

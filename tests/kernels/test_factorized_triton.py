"""The Triton factorized-weight kernels against the float64 reference.

In the Triton interpreter or on a CUDA device, skipped otherwise (see ``triton_support.py``):

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_factorized_triton.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import (
    DEVICE, F64, MARKS, RUNNABLE, all_masks, assert_registered_for_cuda, assert_rejects_overlap, gpu_only,
    interpreter_only, launchers_as_cpu_kernels, mask_id)

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels._layout import layout_geometry
    from tests.kernels.autograd_checks import (assert_all_orders, factorized_backward_fn, factorized_grad_w,
                                               factorized_leaves, present)
    from pfl_kernels.reference import factorized as ref
    from pfl_kernels.triton import factorized as tf

CONV = [(3, 2, 1, 1), (3, 2, 3, 3), (2, 3, 3, 5)]  # kernel sizes 1, 3, 3x5
CASES = [(layout, s) for layout in ("spatial", "simfed", "view") for s in CONV] + \
        [("linear", (5, 3)), ("linear", (1, 1))]
BIAS = ["none", "mu", "mu+mask"]
ALL_MASKS = all_masks(4)


@pytest.fixture(params=["one-tile", "many-tiles"])
def tiles(request, monkeypatch):
    """Default tiles, or tiny ones so every launch has several R- and C-blocks."""
    if request.param == "many-tiles":
        monkeypatch.setattr(tf, "_MAX_TILE", 16)
        monkeypatch.setattr(tf, "_MAX_BLOCK_R", 4)
        monkeypatch.setattr(tf, "_MAX_WHOLE_TILE", 0)
    return request.param


def assert_close(name, got, want, atol=1e-10, rtol=1e-10):
    """Compare in float64; on failure name the worst element and the max abs error."""
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    assert got.dtype == want.dtype or want.dtype == F64, f"{name}: dtype {got.dtype} != {want.dtype}"
    got64, want64 = got.detach().to("cpu", F64), want.detach().to("cpu", F64)
    if got64.numel() == 0:
        return
    err = (got64 - want64).abs()
    bad = err > atol + rtol * want64.abs()
    if bad.any():
        where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(
            f"{name}: max abs err {err.max().item():.3e} at {list(where)} (got {got64[where].item():.6g}, "
            f"want {want64[where].item():.6g}); {int(bad.sum())}/{bad.numel()} elements out of tolerance")


def make_factors(shape, layout, rank, bias, clients, dtype=F64, seed=0):
    """Random factors (never all zeros) on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    rows, cols, _, _ = layout_geometry(shape, layout)
    lead = () if clients is None else (clients,)

    def rnd(*size):
        return torch.randn(*size, generator=g, dtype=F64).to(DEVICE, dtype)

    u, v = rnd(*lead, rows, rank), rnd(*lead, rank, cols)
    mu = rnd(*lead, rows, cols) if bias != "none" else None
    mask = None
    if bias == "mu+mask":  # a 0/1 mask with a few non-binary values, so it really multiplies
        mask = ((torch.rand(*lead, rows, cols, generator=g) > 0.4).to(F64)
                + 0.5 * (torch.rand(*lead, rows, cols, generator=g) > 0.9)).to(DEVICE, dtype)
    return u, v, mu, mask


def reference_weight(u, v, mu, mask, shape, layout):
    f64 = [None if t is None else t.to(F64) for t in (u, v, mu, mask)]
    return ref.factorized_weight(*f64, shape=shape, layout=layout)


def reference_backward(g, u, v, mu, mask, shape, layout, output_mask):
    f64 = [t if t is None else t.to(F64) for t in (g, u, v, mu, mask)]
    return ref.factorized_weight_backward(*f64, shape=shape, layout=layout, output_mask=output_mask)


def check_backward(got, want, output_mask, mu, mask, **tol):
    names = ("grad_u", "grad_v", "grad_mu", "grad_mask")
    for i, (name, a, b) in enumerate(zip(names, got, want)):
        given = (True, True, mu is not None, mask is not None)[i]
        if output_mask[i] and given:
            assert a.is_contiguous(), f"{name} is not contiguous"
            assert_close(name, a, b, **tol)
        else:
            assert tuple(a.shape) == (0,), f"{name} not requested: want an empty [0] tensor, got {list(a.shape)}"


@pytest.mark.parametrize("clients", [None, 2])
@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("layout,shape", CASES)
def test_forward_and_backward(layout, shape, rank, bias, clients):
    _check_forward_and_backward(layout, shape, rank, bias, clients)


@pytest.mark.parametrize("layout,shape", CASES)
def test_many_tiles(layout, shape, tiles):
    """Several R- and C-blocks per client: the cross-tile sums of grad_u and grad_v."""
    _check_forward_and_backward(layout, shape, 2, "mu+mask", 2)


@pytest.mark.parametrize("layout,shape,clients", [("linear", (9, 70), 3), ("linear", (9, 70), None),
                                                   ("spatial", (2, 3, 9, 9), 2)])
def test_backward_whole_matrix_tile(layout, shape, clients):
    """R beyond _MAX_BLOCK_R (a linear layer of 70 inputs, a 9x9 kernel): the backward takes
    each client's whole matrix in one tile (no summing pass), and agrees with float64."""
    rows, cols, _, _ = layout_geometry(shape, layout)
    assert rows > tf._MAX_BLOCK_R
    u, v, mu, mask = make_factors(shape, layout, 2, "mu+mask", clients)
    lead = () if clients is None else (clients,)
    g = torch.randn(*lead, *shape, dtype=F64, device=DEVICE)
    plan = tf._backward_plan(g, u, v, mu, mask, list(shape), layout, [True] * 4, tf._MAX_TILE, tf._MAX_BLOCK_R,
                             tf._MAX_WHOLE_TILE)
    assert plan[1][-2:] == (1, 1), plan[1]  # one row block, one column block
    om = [True] * 4
    got = tf.factorized_weight_backward_triton(g, u, v, mu, mask, shape=list(shape), layout=layout, output_mask=om)
    check_backward(got, reference_backward(g, u, v, mu, mask, shape, layout, om), om, mu, mask)


def _check_forward_and_backward(layout, shape, rank, bias, clients):
    u, v, mu, mask = make_factors(shape, layout, rank, bias, clients)
    w = tf.factorized_weight_triton(u, v, mu, mask, shape=list(shape), layout=layout)
    assert w.is_contiguous()
    assert_close(f"W ({layout} {shape})", w, reference_weight(u, v, mu, mask, shape, layout))

    lead = () if clients is None else (clients,)
    g = torch.randn(*lead, *shape, dtype=F64, device=DEVICE)
    om = [True] * 4
    got = tf.factorized_weight_backward_triton(g, u, v, mu, mask, shape=list(shape), layout=layout,
                                               output_mask=om)
    check_backward(got, reference_backward(g, u, v, mu, mask, shape, layout, om), om, mu, mask)


@pytest.mark.parametrize("output_mask", ALL_MASKS, ids=mask_id)
@pytest.mark.parametrize("layout,shape", [("spatial", (3, 2, 3, 3)), ("simfed", (2, 3, 3, 5))])
def test_backward_output_mask(layout, shape, output_mask, tiles):
    u, v, mu, mask = make_factors(shape, layout, 2, "mu+mask", 2, seed=1)
    g = torch.randn(2, *shape, dtype=F64, device=DEVICE)
    got = tf.factorized_weight_backward_triton(g, u, v, mu, mask, shape=list(shape), layout=layout,
                                               output_mask=list(output_mask))
    want = reference_backward(g, u, v, mu, mask, shape, layout, list(output_mask))
    check_backward(got, want, output_mask, mu, mask)


@pytest.mark.parametrize("layout,shape", [("spatial", (3, 2, 3, 3)), ("simfed", (2, 3, 3, 5)),
                                          ("view", (3, 2, 3, 3)), ("linear", (5, 3))])
def test_strided_operands(layout, shape, tiles):
    """Shared factors expanded over K (stride 0), transposed v, strided mu, odd grad_w strides."""
    k, rank = 3, 2
    rows, cols, _, _ = layout_geometry(shape, layout)
    u1, v1, mu, mask = make_factors(shape, layout, rank, "mu+mask", k, seed=2)
    u = u1[0].expand(k, rows, rank)                                   # stride 0 on K
    v = torch.randn(k, cols, rank, dtype=F64, device=DEVICE).transpose(1, 2)  # column-major v
    mu = torch.randn(k, rows, 2 * cols, dtype=F64, device=DEVICE)[:, :, ::2]  # strided columns
    mask = mask[0].expand(k, rows, cols)                              # shared mask
    w = tf.factorized_weight_triton(u, v, mu, mask, shape=list(shape), layout=layout)
    assert_close("W", w, reference_weight(u, v, mu, mask, shape, layout))

    om = [True] * 4
    grads = {
        # a permuted grad_w: its strides cannot be viewed as [K, A, R, B] for most layouts
        "permuted": torch.randn(*reversed((k, *shape)), dtype=F64, device=DEVICE).permute(
            *reversed(range(len(shape) + 1))),
        # non-contiguous but viewable: every other client of a bigger bank
        "sliced": torch.randn(2 * k, *shape, dtype=F64, device=DEVICE)[::2],
        # the gradient of a sum: stride 0 everywhere
        "expanded": torch.randn(1, dtype=F64, device=DEVICE).expand(k, *shape),
    }
    for name, g in grads.items():
        assert not g.is_contiguous()
        got = tf.factorized_weight_backward_triton(g, u, v, mu, mask, shape=list(shape), layout=layout,
                                                   output_mask=om)
        want = reference_backward(g, u, v, mu, mask, shape, layout, om)
        try:
            check_backward(got, want, om, mu, mask)
        except AssertionError as exc:
            raise AssertionError(f"grad_w {name}: {exc}") from None


@pytest.mark.parametrize("layout,shape", [("spatial", (3, 2, 3, 3)), ("simfed", (2, 3, 3, 5)),
                                          ("linear", (5, 3))])
def test_float32(layout, shape, tiles):
    u, v, mu, mask = make_factors(shape, layout, 2, "mu+mask", 2, dtype=torch.float32, seed=3)
    w = tf.factorized_weight_triton(u, v, mu, mask, shape=list(shape), layout=layout)
    assert w.dtype == torch.float32
    assert_close("W", w, reference_weight(u, v, mu, mask, shape, layout), atol=1e-5, rtol=1e-5)
    g = torch.randn(2, *shape, device=DEVICE)
    got = tf.factorized_weight_backward_triton(g, u, v, mu, mask, shape=list(shape), layout=layout,
                                               output_mask=[True] * 4)
    assert all(t.dtype == torch.float32 for t in got)
    want = reference_backward(g, u, v, mu, mask, shape, layout, [True] * 4)
    check_backward(got, want, [True] * 4, mu, mask, atol=1e-5, rtol=1e-5)


def _soft_reference(x, t):
    y = x.detach().clone()
    ref.soft_threshold_(y, t)
    return y


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN * 0 in numpy
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("view", ["contiguous", "transposed", "strided", "permuted-3d", "sliced-5d", "0-d"])
def test_soft_threshold(view, dtype):
    g = torch.Generator().manual_seed(4)
    base = torch.randn(4, 6, 10, generator=g, dtype=F64).to(DEVICE, dtype)
    base[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    base[0, 1, :2] = 0.3  # within the threshold: becomes exactly 0
    if view == "0-d":
        base = torch.full((), -0.9, dtype=dtype, device=DEVICE)
    original = base.clone()
    views = {
        "contiguous": lambda t: t,
        "transposed": lambda t: t[1].t(),
        "strided": lambda t: t[:, ::2, 1:8],
        "permuted-3d": lambda t: t.permute(2, 0, 1),
        "sliced-5d": lambda t: t.reshape(2, 2, 3, 2, 10)[..., ::3],
        "0-d": lambda t: t,
    }
    x = views[view](base)
    want_all = original.clone()
    views[view](want_all).copy_(_soft_reference(views[view](original), 0.5))
    tf.soft_threshold_triton_(x, 0.5)
    # Also checks the elements outside the view are untouched.
    assert torch.equal(torch.isnan(base), torch.isnan(want_all))
    assert_close(f"soft_threshold_ ({view})", base.nan_to_num(), want_all.nan_to_num(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("threshold", [0.1, 1 / 3, 1e-8, 0.0, 2.0 ** -130, 5e-324])
def test_soft_threshold_rounds_the_threshold_as_the_reference(dtype, threshold):
    """The threshold travels as float64 bits and is rounded to float32 in the kernel for
    float32 mu: bitwise the reference's result, at thresholds float32 cannot hold exactly
    (and ones below its normal range; 5e-324 has the bits 1, which Triton passes as a constant)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 7, 11, generator=g, dtype=F64) * 0.3).to(DEVICE, dtype)
    x[0, 0, :4] = torch.tensor([threshold, -threshold, 0.1, 1 / 3], dtype=F64).to(dtype)
    want = _soft_reference(x, threshold)
    tf.soft_threshold_triton_(x, threshold)
    assert torch.equal(x, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_soft_threshold_beyond_the_dtype_keeps_infinities(dtype):
    """A finite threshold beyond mu's dtype acts as its largest finite value, as the reference
    and C++ do: +-inf stays +-inf (it was inf - inf: NaN), finite entries become 0."""
    big = torch.finfo(dtype).max
    x = torch.tensor([float("inf"), -float("inf"), big, -big, 2.0, float("nan")], dtype=F64).to(DEVICE, dtype)
    want = _soft_reference(x, 1e300)
    tf.soft_threshold_triton_(x, 1e300)
    assert torch.equal(want[:5].cpu(), torch.tensor([float("inf"), -float("inf"), 0, 0, 0], dtype=dtype))
    assert torch.equal(x[:5], want[:5]) and x[5].isnan()


@pytest.mark.parametrize("threshold", [0.3, 0.0, 1e300])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_soft_threshold_signs_of_zero_match_the_reference_bit_for_bit(dtype, threshold):
    """-0.0 where mu < 0 and |mu| <= t, +0.0 for mu = -0.0 (sign(-0.0) is 0): ``x * 0`` gave
    -0.0 for mu = -0.0 where the reference gives +0.0."""
    finfo = torch.finfo(dtype)
    special = [-threshold, threshold, -0.0, 0.0, -1e-45, 1e-45, -finfo.tiny, finfo.tiny, float("inf"),
               -float("inf"), finfo.max, -finfo.max, -0.3, 0.3]
    noise = torch.randn(67, generator=torch.Generator().manual_seed(6), dtype=F64)
    x = torch.cat([torch.tensor(special, dtype=F64), noise]).to(DEVICE, dtype)
    want = _soft_reference(x, threshold)
    tf.soft_threshold_triton_(x, threshold)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(x.view(bits), want.view(bits)), (x, want)


def test_soft_threshold_rejects_overlap():
    assert_rejects_overlap(tf.soft_threshold_triton_, 0.1)


@interpreter_only
def test_through_dispatcher_and_autograd():
    """The launchers accept the schema's args/kwargs: run them as the CPU kernels of the ops
    (in a scoped library, undone at exit) under the Python wrappers and autograd."""
    from pfl_kernels.ops import factorized_weight, soft_threshold_

    shape, layout = [3, 2, 3, 3], "spatial"
    u, _, mu, mask = make_factors(shape, layout, 2, "mu+mask", 2, seed=7)
    v = make_factors(shape, layout, 2, "none", None, seed=8)[1]  # shared: expanded by the wrapper
    leaves = [t.clone().requires_grad_(True) for t in (u, v, mu, mask)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (u, v, mu, mask)]
    g = torch.randn(2, *shape, dtype=F64)
    with launchers_as_cpu_kernels({"factorized_weight": tf.factorized_weight_triton,
                                   "factorized_weight_backward": tf.factorized_weight_backward_triton,
                                   "soft_threshold_": tf.soft_threshold_triton_}):
        w_default = torch.ops.pfl.factorized_weight(u, v.expand(2, -1, -1), shape=shape)  # mu, mask, layout defaulted
        w = factorized_weight(*leaves, shape=shape, layout=layout)
        w.backward(g)
        x = torch.randn(4, 5, dtype=F64)
        want_x = _soft_reference(x.t(), 0.4).t()
        soft_threshold_(x.t(), 0.4)
    assert_close("W (defaults)", w_default, reference_weight(u, v.expand(2, -1, -1), None, None, shape, layout))
    w_ref = ref.factorized_weight(ref_leaves[0], ref_leaves[1].expand(2, -1, -1), *ref_leaves[2:],
                                  shape=shape, layout=layout)
    w_ref.backward(g)
    assert_close("W", w, w_ref)
    for name, a, b in zip(("u", "v", "mu", "mask"), leaves, ref_leaves):
        assert_close(f"autograd grad of {name}", a.grad, b.grad)
    assert_close("soft_threshold_ through the op", x, want_x, atol=0, rtol=0)


@interpreter_only
@pytest.mark.parametrize("layout,shape,bias,clients", [
    ("spatial", (2, 2, 2, 2), "mu+mask", "shared"), ("spatial", (2, 2, 2, 2), "none", None),
    ("simfed", (2, 2, 2, 3), "mu", "shared"), ("view", (2, 2, 1, 3), "mu+mask", None),
    ("linear", (3, 4), "mu+mask", "shared")], ids=str)
def test_gradients_of_every_order_through_the_launchers(layout, shape, bias, clients):
    """gradcheck and gradgradcheck (reverse and forward mode) of both ops, with the launchers
    as their kernels: the autograd formulas call the ops, so every order runs on Triton."""
    from pfl_kernels.ops import factorized_weight

    leaves = factorized_leaves(shape, layout, bias, clients)
    backward = factorized_backward_fn(shape, layout, clients, [t is not None for t in leaves], (True,) * 4)
    with launchers_as_cpu_kernels({"factorized_weight": tf.factorized_weight_triton,
                                   "factorized_weight_backward": tf.factorized_weight_backward_triton}):
        assert_all_orders(lambda *t: factorized_weight(*t, shape=shape, layout=layout), present(leaves), fast=True)
        assert_all_orders(backward, [factorized_grad_w(shape, clients), *present(leaves)], fast=True)


def test_registered_for_cuda():
    assert_registered_for_cuda(("factorized_weight", "factorized_weight_backward", "soft_threshold_"))


# ---------------------------------------------------------------------------------------
# Real GPU only (``gpu_only``): the ops through the dispatcher, opcheck, autograd and half precision.


@gpu_only
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("layout,shape", [("spatial", (16, 8, 3, 3)), ("simfed", (8, 6, 3, 5)),
                                          ("view", (16, 8, 3, 3)), ("linear", (40, 130))])
def test_gpu_dtypes(layout, shape, dtype, tol):
    u, v, mu, mask = make_factors(shape, layout, 2, "mu+mask", 3, dtype=dtype, seed=5)
    w = torch.ops.pfl.factorized_weight(u, v, mu, mask, shape=list(shape), layout=layout)
    assert w.dtype == dtype
    scale = reference_weight(u, v, mu, mask, shape, layout).abs().max().item()
    assert_close("W", w, reference_weight(u, v, mu, mask, shape, layout), atol=tol * scale, rtol=tol)
    g = torch.randn(3, *shape, device=DEVICE).to(dtype)
    got = torch.ops.pfl.factorized_weight_backward(g, u, v, mu, mask, shape=list(shape), layout=layout,
                                                   output_mask=[True] * 4)
    want = reference_backward(g, u, v, mu, mask, shape, layout, [True] * 4)
    for name, a, b in zip(("grad_u", "grad_v", "grad_mu", "grad_mask"), got, want):
        assert a.dtype == dtype, name
        assert_close(name, a, b, atol=tol * b.abs().max().item(), rtol=tol)


@gpu_only
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("layout,shape", [("spatial", (4, 3, 3, 3)), ("simfed", (4, 3, 3, 5)),
                                          ("linear", (5, 7))])
def test_gpu_opcheck(layout, shape, bias, dtype):
    u, v, mu, mask = make_factors(shape, layout, 2, bias, 2, dtype=dtype, seed=6)
    for t in (u, v, mu, mask):
        if t is not None:
            t.requires_grad_(True)
    kwargs = {"shape": list(shape), "layout": layout}
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.pfl.factorized_weight.default, (u, v, mu, mask), kwargs,
                          test_utils=tests)
    g = torch.randn(2, *shape, device=DEVICE).to(dtype)
    torch.library.opcheck(torch.ops.pfl.factorized_weight_backward.default,
                          (g, u.detach(), v.detach(), None if mu is None else mu.detach(),
                           None if mask is None else mask.detach()),
                          {**kwargs, "output_mask": [True, True, True, True]}, test_utils=tests[:3])
    x = torch.randn(4, 6, device=DEVICE).to(dtype)
    torch.library.opcheck(torch.ops.pfl.soft_threshold_.default, (x, 0.1), test_utils=tests[:3])
    if dtype == F64:
        assert torch.autograd.gradcheck(
            lambda *t: torch.ops.pfl.factorized_weight(*t, **kwargs),
            tuple(t for t in (u, v, mu, mask) if t is not None))

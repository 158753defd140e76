"""The factorized-weight ops on CPU (the C++ kernels when built) against the float64 reference."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

import pfl_kernels
from pfl_kernels._layout import layout_geometry
from pfl_kernels.ops import factorized_weight, soft_threshold_
from pfl_kernels.reference import factorized as ref
from tests.kernels.autograd_checks import (CLIENT_MODES, assert_all_orders, factorized_backward_fn,
                                          factorized_grad_w, factorized_leaves, present)
from tests.tolerances import assert_close

CONV_SHAPES = [(5, 3, 1, 1), (7, 5, 3, 3), (6, 4, 5, 5), (3, 2, 7, 7), (5, 3, 3, 5)]
LINEAR_SHAPES = [(9, 13), (1, 1), (17, 4)]
CASES = [(layout, s) for layout in ("spatial", "simfed", "view") for s in CONV_SHAPES] + \
        [("linear", s) for s in LINEAR_SHAPES]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
BIAS_MODES = ["none", "mu", "mu+mask"]


def make_factors(shape, layout, rank, bias_mode, clients, dtype, seed=0):
    """Random factors (never zeros), in float64, and cast copies in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    rows, cols, _, _ = layout_geometry(shape, layout)
    lead = () if clients is None else (clients,)
    u = torch.randn(*lead, rows, rank, generator=g, dtype=torch.float64)
    v = torch.randn(*lead, rank, cols, generator=g, dtype=torch.float64)
    mu = torch.randn(*lead, rows, cols, generator=g, dtype=torch.float64) if bias_mode != "none" else None
    mask = None
    if bias_mode == "mu+mask":
        mask = (torch.rand(*lead, rows, cols, generator=g) > 0.5).to(torch.float64)
    exact = tuple(None if t is None else t.to(dtype).to(torch.float64) for t in (u, v, mu, mask))
    cast = tuple(None if t is None else t.to(dtype) for t in (u, v, mu, mask))
    return exact, cast


def naive_weight(m, shape, layout):
    """The layout table of the README, element by element (checks the reference itself)."""
    w = torch.empty(shape, dtype=m.dtype)
    if layout == "linear":
        for o, i in itertools.product(range(shape[0]), range(shape[1])):
            w[o, i] = m[i, o]
        return w
    out_c, in_c, kh, kw = shape
    for o, i, h, x in itertools.product(range(out_c), range(in_c), range(kh), range(kw)):
        if layout == "spatial":
            w[o, i, h, x] = m[h * kw + x, o * in_c + i]
        elif layout == "simfed":
            w[o, i, h, x] = m[i * kh + h, o * kw + x]
        else:  # view: row-major reshape of M
            w[o, i, h, x] = m.reshape(-1)[((o * in_c + i) * kh + h) * kw + x]
    return w


@pytest.mark.parametrize("layout,shape", [("spatial", (4, 3, 2, 3)), ("simfed", (4, 3, 2, 3)),
                                          ("view", (4, 3, 2, 3)), ("linear", (5, 3))])
def test_reference_follows_layout_table(layout, shape):
    (u, v, mu, mask), _ = make_factors(shape, layout, 2, "mu+mask", None, torch.float64)
    m = u @ v + mu * mask
    assert torch.equal(ref.factorized_weight(u, v, mu, mask, shape=shape, layout=layout),
                       naive_weight(m, shape, layout))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("clients", [None, 3])
@pytest.mark.parametrize("bias_mode", BIAS_MODES)
@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("layout,shape", CASES)
def test_forward_and_backward_match_reference(layout, shape, rank, bias_mode, clients, dtype):
    exact, cast = make_factors(shape, layout, rank, bias_mode, clients, dtype)
    w = torch.ops.pfl.factorized_weight(*cast, shape=list(shape), layout=layout)
    assert w.dtype == dtype and w.is_contiguous()
    assert_close(w, ref.factorized_weight(*exact, shape=shape, layout=layout), dtype, "W")

    grad_w = torch.randn(w.shape, dtype=torch.float64).to(dtype)
    output_mask = [True, True, bias_mode != "none", bias_mode == "mu+mask"]
    got = torch.ops.pfl.factorized_weight_backward(grad_w, *cast, shape=list(shape), layout=layout,
                                                   output_mask=output_mask)
    want = ref.factorized_weight_backward(grad_w.to(torch.float64), *exact, shape=shape, layout=layout,
                                          output_mask=output_mask)
    for name, g, e in zip(("grad_u", "grad_v", "grad_mu", "grad_mask"), got, want):
        assert g.dtype == dtype, name
        # Sums over up to C terms: scale the tolerance with the reduction length for bf16.
        assert_close(g, e, dtype, name)


@pytest.mark.parametrize("layout,shape", [("spatial", (6, 4, 3, 3)), ("simfed", (5, 3, 3, 5)),
                                          ("view", (4, 3, 5, 5)), ("linear", (7, 11))])
@pytest.mark.parametrize("output_mask", list(itertools.product([False, True], repeat=4)))
def test_backward_output_mask_subsets(layout, shape, output_mask):
    exact, _ = make_factors(shape, layout, 2, "mu+mask", 2, torch.float64)
    grad_w = torch.randn(2, *shape, dtype=torch.float64)
    got = torch.ops.pfl.factorized_weight_backward(grad_w, *exact, shape=list(shape), layout=layout,
                                                   output_mask=list(output_mask))
    want = ref.factorized_weight_backward(grad_w, *exact, shape=shape, layout=layout,
                                          output_mask=list(output_mask))
    for wanted, g, e, t in zip(output_mask, got, want, exact):
        if wanted:
            assert g.shape == t.shape
            assert_close(g, e, torch.float64)
        else:
            assert g.shape == (0,)


def _strided(t):
    """The same values as ``t`` in a non-contiguous tensor (a transposed, sliced buffer)."""
    big = torch.randn(*t.shape[:-2], t.shape[-1], 2 * t.shape[-2], dtype=t.dtype)
    view = big[..., ::2].transpose(-1, -2)
    view.copy_(t)
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("layout,shape", [("spatial", (8, 5, 3, 3)), ("simfed", (6, 5, 3, 5)),
                                          ("view", (5, 3, 5, 5)), ("linear", (13, 9))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_non_contiguous_and_expanded_inputs(layout, shape, dtype):
    k = 3
    exact, cast = make_factors(shape, layout, 2, "mu+mask", k, dtype)
    strided = tuple(_strided(t) for t in cast)
    # Shared factors arrive as stride-0 expansions of one client's tensor.
    shared = tuple(t[0].expand_as(t) for t in cast)
    for inputs, exact_inputs in ((strided, exact), (shared, tuple(t[0].expand_as(t) for t in exact))):
        w = torch.ops.pfl.factorized_weight(*inputs, shape=list(shape), layout=layout)
        assert_close(w, ref.factorized_weight(*exact_inputs, shape=shape, layout=layout), dtype, "W")
        grad_w = torch.randn(k, *shape, dtype=dtype).transpose(-1, -2).contiguous().transpose(-1, -2)
        assert not grad_w.is_contiguous() or shape[-1] == 1
        got = torch.ops.pfl.factorized_weight_backward(grad_w, *inputs, shape=list(shape), layout=layout,
                                                       output_mask=[True] * 4)
        want = ref.factorized_weight_backward(grad_w.to(torch.float64), *exact_inputs, shape=shape,
                                              layout=layout, output_mask=[True] * 4)
        for name, g, e in zip(("grad_u", "grad_v", "grad_mu", "grad_mask"), got, want):
            assert_close(g, e, dtype, name)


def test_wrapper_broadcasts_shared_factors_and_sums_their_gradients():
    shape, layout, k = (6, 4, 3, 3), "spatial", 4
    (u, v, mu, mask), _ = make_factors(shape, layout, 2, "mu+mask", k, torch.float64)
    u_shared = u[0].clone().requires_grad_()
    mask_shared = mask[0].clone()
    v, mu = v.requires_grad_(), mu.requires_grad_()
    w = factorized_weight(u_shared, v, mu, mask_shared, shape=shape, layout=layout)
    assert w.shape == (k, *shape)
    grad_w = torch.randn_like(w)
    w.backward(grad_w)
    u_ref, v_ref, mu_ref = (t.detach().clone().requires_grad_() for t in (u_shared, v, mu))
    ref.factorized_weight(u_ref.expand(k, -1, -1), v_ref, mu_ref, mask_shared.expand(k, -1, -1),
                          shape=shape, layout=layout).backward(grad_w)
    for name, a, b in (("u", u_shared, u_ref), ("v", v, v_ref), ("mu", mu, mu_ref)):
        assert_close(a.grad, b.grad, torch.float64, name)


def test_bool_mask_is_accepted():
    (u, v, mu, mask), _ = make_factors((4, 3, 3, 3), "spatial", 1, "mu+mask", None, torch.float32)
    u, v, mu, mask = (t.float() for t in (u, v, mu, mask))
    w = factorized_weight(u, v, mu, mask.bool(), shape=(4, 3, 3, 3))
    assert torch.equal(w, factorized_weight(u, v, mu, mask, shape=(4, 3, 3, 3)))


GRAD_CASES = [("spatial", (2, 2, 2, 2)), ("simfed", (2, 2, 2, 3)), ("view", (2, 2, 1, 3)), ("linear", (3, 4))]


@pytest.mark.parametrize("clients", CLIENT_MODES, ids=str)
@pytest.mark.parametrize("bias_mode", BIAS_MODES)
@pytest.mark.parametrize("layout,shape", GRAD_CASES)
def test_gradients_of_every_order(layout, shape, bias_mode, clients):
    """gradcheck and gradgradcheck (reverse and forward mode) through the wrapper, shared
    factors broadcast over K included."""
    leaves = factorized_leaves(shape, layout, bias_mode, clients)
    assert_all_orders(lambda *t: factorized_weight(*t, shape=shape, layout=layout), present(leaves))


@pytest.mark.parametrize("output_mask", [(True, True, True, True), (False, True, True, False)],
                         ids=lambda m: "".join(str(int(x)) for x in m))
@pytest.mark.parametrize("clients", CLIENT_MODES, ids=str)
@pytest.mark.parametrize("bias_mode", BIAS_MODES)
@pytest.mark.parametrize("layout,shape", GRAD_CASES)
def test_backward_op_gradients_of_every_order(layout, shape, bias_mode, clients, output_mask):
    """The backward op has derivatives of its own: what a Hessian-vector product differentiates."""
    leaves = factorized_leaves(shape, layout, bias_mode, clients)
    fn = factorized_backward_fn(shape, layout, clients, [t is not None for t in leaves], output_mask)
    assert_all_orders(fn, [factorized_grad_w(shape, clients), *present(leaves)])


@pytest.mark.parametrize("layout,shape", [("spatial", (3, 2, 3, 3)), ("simfed", (3, 2, 3, 2)),
                                          ("view", (2, 3, 2, 3)), ("linear", (4, 5))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck(layout, shape, dtype):
    _, (u, v, mu, mask) = make_factors(shape, layout, 2, "mu+mask", 3, dtype)
    kwargs = {"shape": list(shape), "layout": layout}
    torch.library.opcheck(torch.ops.pfl.factorized_weight,
                          (u.requires_grad_(), v.requires_grad_(), mu.requires_grad_(), mask), kwargs)
    torch.library.opcheck(torch.ops.pfl.factorized_weight, (u[0], v[0]), kwargs)
    grad_w = torch.randn(3, *shape, dtype=dtype)
    for output_mask in ([True, False, True, True], [False, True, False, False]):
        torch.library.opcheck(torch.ops.pfl.factorized_weight_backward,
                              (grad_w, u.detach(), v.detach(), mu.detach(), mask),
                              {**kwargs, "output_mask": output_mask})
        # With inputs that require grad: the backward op's own autograd (second order).
        torch.library.opcheck(torch.ops.pfl.factorized_weight_backward,
                              (grad_w.clone().requires_grad_(), u, v, mu, mask.clone().requires_grad_()),
                              {**kwargs, "output_mask": output_mask})
    torch.library.opcheck(torch.ops.pfl.soft_threshold_, (mu.detach().clone(), 0.3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threshold", [0.0, 0.5, 3.0])
def test_soft_threshold_matches_reference(dtype, threshold):
    mu = torch.randn(3, 17, 29, dtype=torch.float64).to(dtype)
    expected = mu.to(torch.float64)
    ref.soft_threshold_(expected, threshold)
    got = soft_threshold_(mu, threshold)
    assert got is mu
    assert_close(mu, expected, dtype, "mu")
    if threshold > 0:
        assert (mu[expected == 0] == 0).all(), "entries below the threshold must become exact zeros"


@pytest.mark.parametrize("path", ["op", "reference"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("threshold", [1e300, 1e39, 7e4])
def test_soft_threshold_beyond_the_dtype_keeps_infinities(path, dtype, threshold):
    """A finite threshold too large for mu's dtype: |inf| - threshold is still inf, and every
    finite entry (at most the dtype's largest) becomes 0.  Rounded to inf, the threshold gave
    inf - inf = NaN on every backend."""
    if threshold < torch.finfo(dtype).max:
        pytest.skip("the threshold fits this dtype")
    big = torch.finfo(dtype).max
    values = [float("inf"), -float("inf"), big, -big, 3.0, -0.5, 0.0]
    mu = torch.tensor(values, dtype=torch.float64).to(dtype)
    want = torch.tensor([float("inf"), -float("inf"), 0, 0, 0, 0, 0], dtype=dtype)
    (soft_threshold_ if path == "op" else ref.soft_threshold_)(mu, threshold)
    assert torch.equal(mu, want), mu
    nan = torch.full((3,), float("nan"), dtype=dtype)
    (soft_threshold_ if path == "op" else ref.soft_threshold_)(nan, threshold)
    assert nan.isnan().all()


def test_soft_threshold_non_contiguous_view_leaves_the_rest_untouched():
    base = torch.randn(4, 9, 10)
    before = base.clone()
    view = base[:, 1::2, ::3].transpose(1, 2)
    soft_threshold_(view, 0.4)
    expected = before.clone()
    ev = expected[:, 1::2, ::3].transpose(1, 2)
    ref.soft_threshold_(ev, 0.4)
    assert torch.equal(base, expected)


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def signed_zero_inputs(dtype: torch.dtype, threshold: float, n: int = 2053) -> torch.Tensor:
    """n entries of ``dtype`` (long enough for the vectorized loop and its tail): ±threshold
    (|mu| - t = 0 exactly), ±0, subnormals, ±inf, the dtype's largest, and random values
    around the threshold; no NaN (its sign bit is no part of the formula)."""
    finfo = torch.finfo(dtype)
    special = [-threshold, threshold, -0.0, 0.0, -1e-45, 1e-45, -finfo.tiny, finfo.tiny, float("inf"),
               -float("inf"), finfo.max, -finfo.max, -0.3, 0.3]
    spread = 2 * threshold if 0 < threshold < 1e30 else 1.0
    noise = torch.randn(n - len(special), generator=torch.Generator().manual_seed(n), dtype=torch.float64) * spread
    return torch.cat([torch.tensor(special, dtype=torch.float64), noise]).to(dtype)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("threshold", [0.3, 0.0, 1e300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_soft_threshold_signs_of_zero_match_the_reference_bit_for_bit(dtype, threshold, layout):
    """sign(mu) * max(|mu| - t, 0) is -0.0 for a negative mu with |mu| <= t and +0.0 for
    mu = -0.0 (sign(-0.0) is 0): the C++ kernel's mu - clamp(mu, -t, t) gave +0.0 for the
    first (mu = -0.3 or -1e-45 with t = 0.3, any finite mu with a t beyond the dtype)."""
    values = signed_zero_inputs(dtype, threshold)
    want = values.clone()
    ref.soft_threshold_(want, threshold)
    if layout == "strided":  # the kernel's strided loop
        got = torch.zeros(2 * values.numel(), dtype=dtype)[::2]
        got.copy_(values)
    else:
        got = values.clone()
    soft_threshold_(got, threshold)
    bits, want_bits = got.contiguous().view(_BITS[dtype]), want.view(_BITS[dtype])
    differ = (bits != want_bits).nonzero().flatten().tolist()
    assert not differ, (f"{len(differ)} entries differ, first mu = {values[differ[0]].item()!r}: "
                        f"got {got[differ[0]].item()!r}, reference {want[differ[0]].item()!r}")


@pytest.mark.parametrize("threshold", ["0.1", True, torch.tensor(0.1), None, torch.tensor([0.1, 0.2]), [0.1]],
                         ids=repr)
def test_error_soft_threshold_not_a_real_number(threshold):
    """A str, a bool or a tensor (0-d too, as similarity_weights' tau and scale) is a wrong kind
    of threshold: TypeError naming it, mu untouched (float() accepted "0.1", True and a 0-d
    tensor, and None or a 2-element tensor failed without naming threshold)."""
    mu = torch.randn(4)
    before = mu.clone()
    with pytest.raises(TypeError, match="^threshold must be a real number, got "):
        soft_threshold_(mu, threshold)
    assert torch.equal(mu, before)


@pytest.mark.parametrize("threshold", [1, np.float32(0.5), np.int64(1), np.float64(0.25)], ids=repr)
def test_soft_threshold_takes_python_and_numpy_numbers(threshold):
    mu = torch.randn(64, dtype=torch.float64)
    want = mu.clone()
    ref.soft_threshold_(want, float(threshold))
    assert torch.equal(soft_threshold_(mu, threshold), want)


def test_compile_matches_eager():
    shape, layout = (6, 4, 3, 3), "spatial"
    _, (u, v, mu, mask) = make_factors(shape, layout, 1, "mu+mask", 2, torch.float32)

    def fn(u, v, mu, mask):
        return (factorized_weight(u, v, mu, mask, shape=shape, layout=layout) ** 2).sum()

    args = [u.requires_grad_(), v.requires_grad_(), mu.requires_grad_(), mask]
    eager = fn(*args)
    eager_grads = torch.autograd.grad(eager, args[:3])
    compiled = torch.compile(fn, fullgraph=True)(*args)
    compiled_grads = torch.autograd.grad(compiled, args[:3])
    assert_close(compiled, eager.to(torch.float64), torch.float32, "loss")
    for g, e in zip(compiled_grads, eager_grads):
        assert_close(g, e.to(torch.float64), torch.float32, "grad")


# ---- bad input: one test per case, each error names the argument --------------------------

def _good(clients=None):
    _, (u, v, mu, mask) = make_factors((4, 3, 3, 3), "spatial", 2, "mu+mask", clients, torch.float32)
    return u, v, mu, mask


def test_error_unknown_layout():
    u, v, mu, _ = _good()
    with pytest.raises(ValueError, match="layout must be one of"):
        factorized_weight(u, v, mu, shape=(4, 3, 3, 3), layout="spatail")


def test_error_shape_rank_for_layout():
    u, v, _, _ = _good()
    with pytest.raises(ValueError, match="shape must be"):
        factorized_weight(u, v, shape=(12, 9), layout="spatial")


def test_error_u_rows_do_not_fit_shape():
    u, v, _, _ = _good()
    with pytest.raises(ValueError, match="u must have R=9 rows"):
        factorized_weight(u[:5], v, shape=(4, 3, 3, 3))


def test_error_v_does_not_match_u_rank():
    u, v, _, _ = _good()
    with pytest.raises(ValueError, match=r"v must have shape \[\.\.\., 2, 12\]"):
        factorized_weight(u, v[:1], shape=(4, 3, 3, 3))


def test_error_zero_rank():
    u, v, _, _ = _good()
    with pytest.raises(ValueError, match="rank >= 1"):
        factorized_weight(u[:, :0], v[:0], shape=(4, 3, 3, 3))


def test_error_mask_shape():
    u, v, mu, mask = _good()
    with pytest.raises(ValueError, match=r"mask must have shape \[\.\.\., 9, 12\]"):
        factorized_weight(u, v, mu, mask[:, :5], shape=(4, 3, 3, 3))


def test_error_mu_shape():
    u, v, mu, _ = _good()
    with pytest.raises(ValueError, match=r"mu must have shape"):
        factorized_weight(u, v, mu.t(), shape=(4, 3, 3, 3))


def test_error_mask_without_mu():
    u, v, _, mask = _good()
    with pytest.raises(ValueError, match="mask was given without mu"):
        factorized_weight(u, v, None, mask, shape=(4, 3, 3, 3))


def test_error_dtype_mixture():
    u, v, mu, _ = _good()
    with pytest.raises(TypeError, match=r"v must have the dtype of u"):
        factorized_weight(u, v.double(), mu, shape=(4, 3, 3, 3))


def test_error_integer_dtype():
    u, v, _, _ = _good()
    with pytest.raises(TypeError, match="u must be a floating tensor"):
        factorized_weight(u.long(), v, shape=(4, 3, 3, 3))


def test_error_device_mixture():
    u, v, mu, _ = _good()
    with pytest.raises(ValueError, match="mu must be on the device of u"):
        factorized_weight(u, v, mu.to("meta"), shape=(4, 3, 3, 3))


def test_error_client_counts_differ():
    u, v, mu, _ = _good(clients=3)
    with pytest.raises(ValueError, match="has 2 clients"):
        factorized_weight(u, v[:2], mu, shape=(4, 3, 3, 3))


def test_error_too_many_dims():
    u, v, _, _ = _good(clients=3)
    with pytest.raises(ValueError, match="u must have 2 or 3 dimensions"):
        factorized_weight(u[None], v, shape=(4, 3, 3, 3))


def test_error_op_level_checks_without_the_wrapper():
    u, v, _, _ = _good()
    # The wrapper's exception type, also from the op's own checks (test_error_types.py: every op).
    with pytest.raises(ValueError, match="v must have C=12 columns"):
        torch.ops.pfl.factorized_weight(u, v[:, :7], shape=[4, 3, 3, 3], layout="spatial")
    with pytest.raises(ValueError, match="layout"):
        torch.ops.pfl.factorized_weight(u, v, shape=[4, 3, 3, 3], layout="nope")


@pytest.mark.parametrize("threshold", [-0.1, float("nan"), float("inf")])
def test_error_soft_threshold_bad_threshold(threshold):
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        soft_threshold_(torch.randn(3, 3), threshold)


def test_error_soft_threshold_integer_tensor():
    with pytest.raises(TypeError, match="mu must be a floating"):
        soft_threshold_(torch.ones(3, dtype=torch.int64), 0.1)


def test_cpu_runs_the_cpp_kernels():
    """The C++ kernels are what the CPU tests above exercise, unless explicitly switched off."""
    if any(os.environ.get(v, "0") not in ("", "0") for v in ("PFL_KERNELS_SKIP_EXTENSION",
                                                              "PFL_KERNELS_DISABLE_EXTENSION")):
        pytest.skip("the C++ extension is switched off by the environment")
    assert pfl_kernels._extension.LOADED, pfl_kernels._extension.REASON
    info = pfl_kernels.backend_info()
    for op in ("pfl::factorized_weight", "pfl::factorized_weight_backward", "pfl::soft_threshold_"):
        assert info[op]["cpu"] == {"implementation": "cpp", "reason": ""}, op


@pytest.mark.parametrize("with_clients", [False, True])
def test_vmap_and_grad_over_stacked_clients(with_clients):
    """torch.func over a bank of factors (how a batched executor trains many clients at once)."""
    shape, layout, batch = (5, 3, 3, 3), "spatial", 4
    clients = 2 if with_clients else None
    stacks = [make_factors(shape, layout, 2, "mu+mask", clients, torch.float64, seed=s)[0] for s in range(batch)]
    u, v, mu, mask = (torch.stack([st[i] for st in stacks]) for i in range(4))
    mask_shared = mask[0]  # not vmapped: in_dims None

    w = torch.func.vmap(lambda u, v, mu: factorized_weight(u, v, mu, mask_shared, shape=shape,
                                                           layout=layout))(u, v, mu)
    expected = torch.stack([ref.factorized_weight(u[b], v[b], mu[b], mask_shared, shape=shape, layout=layout)
                            for b in range(batch)])
    assert_close(w, expected, torch.float64, "vmap forward")
    # Batched training: vmap the forward, then ordinary autograd through the folded op
    # (torch.func.grad inside vmap: tests/nn/test_functorch.py).
    params = [t.clone().requires_grad_() for t in (u, v, mu)]
    w = torch.func.vmap(lambda u, v, mu: factorized_weight(u, v, mu, mask_shared, shape=shape,
                                                           layout=layout))(*params)
    grads = torch.autograd.grad((w ** 2).sum(), params)
    for b in range(batch):
        args = [t[b].clone().requires_grad_() for t in (u, v, mu)]
        want = torch.autograd.grad(
            (ref.factorized_weight(*args, mask_shared, shape=shape, layout=layout) ** 2).sum(), args)
        for name, g, e in zip("u v mu".split(), grads, want):
            assert_close(g[b], e, torch.float64, f"vmap grad {name}")


def test_vmap_of_the_backward_op():
    shape, layout, batch = (4, 3, 3, 5), "simfed", 3
    stacks = [make_factors(shape, layout, 2, "mu+mask", 2, torch.float64, seed=s)[0] for s in range(batch)]
    u, v, mu, mask = (torch.stack([st[i] for st in stacks]) for i in range(4))
    grad_w = torch.randn(batch, 2, *shape, dtype=torch.float64)
    output_mask = [True, False, True, True]

    def bwd(g, u, v, mu):
        return torch.ops.pfl.factorized_weight_backward(g, u, v, mu, mask[0], shape=list(shape), layout=layout,
                                                        output_mask=output_mask)

    got = torch.func.vmap(bwd)(grad_w, u, v, mu)
    for b in range(batch):
        want = ref.factorized_weight_backward(grad_w[b], u[b], v[b], mu[b], mask[0], shape=shape, layout=layout,
                                              output_mask=output_mask)
        for wanted, g, e in zip(output_mask, got, want):
            if wanted:
                assert_close(g[b], e, torch.float64)
            else:
                assert g.shape == (batch, 0)  # vmap broadcasts the unbatched empty output


@pytest.mark.parametrize("bias_mode", BIAS_MODES)
def test_backward_op_gradients_not_computed_are_constants(bias_mode):
    """Gradients not asked for, or of absent inputs, are empty placeholders without a grad_fn."""
    layout, shape = GRAD_CASES[0]
    leaves = factorized_leaves(shape, layout, bias_mode, None)
    output_mask = [True, False, True, True]
    grads = torch.ops.pfl.factorized_weight_backward(factorized_grad_w(shape, None), *leaves, shape=list(shape),
                                                     layout=layout, output_mask=output_mask)
    computed = [m and t is not None for m, t in zip(output_mask, leaves)]
    assert [g.requires_grad for g in grads] == computed
    assert all(g.shape == (0,) for g, c in zip(grads, computed) if not c)

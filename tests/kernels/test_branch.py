"""The multi-branch ops on CPU (the C++ kernels when built) against the float64 reference."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

import pfl_kernels
from pfl_kernels.ops import branch_combine, project_simplex_
from pfl_kernels.reference import branch as ref
from tests.kernels.autograd_checks import (CLIENT_MODES, assert_all_orders, branch_backward_fn, branch_grad_w,
                                          branch_leaves)
from tests.tolerances import assert_close

SHAPES = [(6, 3, 5, 5), (16, 6, 5, 5), (7, 5, 3, 3), (5, 3, 1, 1), (4, 3, 3, 5), (120, 41), (10, 84), (13,)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def make_inputs(shape, branches, clients, dtype, seed=0):
    """Random branches and α on the simplex (never zeros), in float64 and cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    lead = () if clients is None else (clients,)
    weights = torch.randn(*lead, branches, *shape, generator=g, dtype=torch.float64)
    alpha = torch.softmax(torch.randn(*lead, branches, generator=g, dtype=torch.float64), -1)
    cast = (weights.to(dtype), alpha.to(dtype))
    return tuple(t.to(torch.float64) for t in cast), cast


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("clients", [None, 3])
@pytest.mark.parametrize("branches", [1, 2, 5, 10])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward_match_reference(shape, branches, clients, dtype):
    exact, cast = make_inputs(shape, branches, clients, dtype)
    w = torch.ops.pfl.branch_combine(*cast)
    assert w.dtype == dtype and w.is_contiguous()
    assert w.shape == ((clients,) if clients else ()) + shape
    assert_close(w, ref.branch_combine(*exact), dtype, "W")
    grad_w = torch.randn(w.shape, dtype=torch.float64).to(dtype)
    got = torch.ops.pfl.branch_combine_backward(grad_w, *cast, [True, True])
    want = ref.branch_combine_backward(grad_w.to(torch.float64), *exact, [True, True])
    # ⟨grad_W, W_b⟩ sums N products, each rounded in low precision: its error is bounded
    # relative to Σ_n |grad_W[n]|·|W_b[n]|, not to the (possibly cancelled) sum itself.
    magnitude = ref.branch_combine_backward(grad_w.to(torch.float64).abs(), exact[0].abs(), exact[1],
                                            [False, True])[1]
    for name, g, e in zip(("grad_weights", "grad_alpha"), got, want):
        assert g.dtype == dtype and g.is_contiguous(), name
        scale = magnitude if name == "grad_alpha" and dtype != torch.float64 else 1.0
        assert_close(g / scale, e / scale, dtype, name)


@pytest.mark.parametrize("output_mask", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("clients", [None, 2])
def test_backward_output_mask(output_mask, clients):
    exact, _ = make_inputs((5, 4, 3, 3), 3, clients, torch.float64)
    grad_w = torch.randn(((clients,) if clients else ()) + (5, 4, 3, 3), dtype=torch.float64)
    got = torch.ops.pfl.branch_combine_backward(grad_w, *exact, list(output_mask))
    want = ref.branch_combine_backward(grad_w, *exact, list(output_mask))
    for wanted, g, e, t in zip(output_mask, got, want, exact):
        if wanted:
            assert_close(g, e, torch.float64)
        else:
            assert g.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_non_contiguous_and_expanded_inputs(dtype):
    k, b, shape = 3, 4, (6, 5, 3, 3)
    exact, (weights, alpha) = make_inputs(shape, b, k, dtype)
    strided_w = torch.randn(k, b, 6, 5, 3, 6, dtype=dtype)[..., ::2]
    strided_w.copy_(weights)
    strided_a = torch.randn(b, k, dtype=dtype).t()
    strided_a.copy_(alpha)
    shared_w = weights[0].expand(k, *weights.shape[1:])
    grad_w = torch.randn(k, 6, 5, 3, 3, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
    for w_in, w_exact in ((strided_w, exact[0]), (shared_w, exact[0][0].expand_as(exact[0]))):
        assert not w_in.is_contiguous()
        assert_close(torch.ops.pfl.branch_combine(w_in, strided_a), ref.branch_combine(w_exact, exact[1]), dtype)
        got = torch.ops.pfl.branch_combine_backward(grad_w, w_in, strided_a, [True, True])
        want = ref.branch_combine_backward(grad_w.to(torch.float64), w_exact, exact[1], [True, True])
        for g, e in zip(got, want):
            assert_close(g, e, dtype)


def test_shared_branches_with_per_client_alpha():
    """pFedMB's local view of a global model: one set of branches, α per client."""
    exact, _ = make_inputs((4, 3, 3, 3), 5, None, torch.float64)
    weights = exact[0].clone().requires_grad_()
    alpha = torch.softmax(torch.randn(7, 5, dtype=torch.float64), -1).requires_grad_()
    w = branch_combine(weights, alpha)
    assert w.shape == (7, 4, 3, 3, 3)
    for k in range(7):
        assert_close(w[k], ref.branch_combine(weights.detach(), alpha[k].detach()), torch.float64)
    grad = torch.randn_like(w)
    w.backward(grad)
    w_ref, a_ref = weights.detach().clone().requires_grad_(), alpha.detach().clone().requires_grad_()
    ref.branch_combine(w_ref.expand(7, *w_ref.shape), a_ref).backward(grad)
    assert_close(weights.grad, w_ref.grad, torch.float64, "shared weights grad (summed over clients)")
    assert_close(alpha.grad, a_ref.grad, torch.float64, "alpha grad")


def test_ambiguous_shared_or_per_client_reading_must_be_stated():
    weights = torch.randn(3, 3, 4)
    alpha = torch.softmax(torch.randn(3, 3), -1)
    with pytest.raises(ValueError, match="pass shared_weights=True or False"):
        branch_combine(weights, alpha)
    per_client = branch_combine(weights, alpha, shared_weights=False)
    shared = branch_combine(weights, alpha, shared_weights=True)
    assert per_client.shape == (3, 4) and shared.shape == (3, 3, 4)
    assert torch.allclose(shared[1], ref.branch_combine(weights, alpha[1]))


GRAD_SHAPES = [(2, 2, 2, 3), (3, 4), (3,)]


@pytest.mark.parametrize("clients", CLIENT_MODES, ids=str)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
def test_gradients_of_every_order(shape, clients):
    """gradcheck and gradgradcheck (reverse and forward mode) through the wrapper, branches
    shared by the clients included (B = 3 != K, so the reading is not ambiguous)."""
    assert_all_orders(branch_combine, branch_leaves(shape, 3, clients))


@pytest.mark.parametrize("output_mask", [(True, True), (True, False), (False, True)], ids=str)
@pytest.mark.parametrize("clients", CLIENT_MODES, ids=str)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
def test_backward_op_gradients_of_every_order(shape, clients, output_mask):
    """The backward op has derivatives of its own: what a Hessian-vector product differentiates."""
    assert_all_orders(branch_backward_fn(output_mask), [branch_grad_w(shape, clients), *branch_leaves(shape, 3, clients)])


@pytest.mark.parametrize("output_mask", [(True, False), (False, True)], ids=str)
def test_backward_op_gradients_not_computed_are_constants(output_mask):
    """A gradient not asked for is an empty placeholder without a grad_fn."""
    grads = torch.ops.pfl.branch_combine_backward(branch_grad_w((3, 4), None), *branch_leaves((3, 4), 3, None),
                                                  list(output_mask))
    assert [g.requires_grad for g in grads] == list(output_mask)
    assert all(g.shape == (0,) for g, m in zip(grads, output_mask) if not m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("clients", [None, 3])
def test_opcheck(dtype, clients):
    _, (weights, alpha) = make_inputs((4, 3, 3, 3), 5, clients, dtype)
    torch.library.opcheck(torch.ops.pfl.branch_combine, (weights.requires_grad_(), alpha.requires_grad_()))
    torch.library.opcheck(torch.ops.pfl.branch_combine, (weights.detach(), alpha.detach().requires_grad_()))
    grad_w = torch.randn(((clients,) if clients else ()) + (4, 3, 3, 3), dtype=dtype)
    for output_mask in ([True, True], [False, True], [True, False]):
        torch.library.opcheck(torch.ops.pfl.branch_combine_backward,
                              (grad_w, weights.detach(), alpha.detach(), output_mask))
        # With inputs that require grad: the backward op's own autograd (second order).
        torch.library.opcheck(torch.ops.pfl.branch_combine_backward,
                              (grad_w.clone().requires_grad_(), weights, alpha, output_mask))
    x = torch.randn(4, 5, dtype=dtype)
    torch.library.opcheck(torch.ops.pfl.project_simplex_, (x,))


def test_compile_matches_eager():
    _, (weights, alpha) = make_inputs((6, 4, 3, 3), 5, 2, torch.float32)
    args = [weights.requires_grad_(), alpha.requires_grad_()]

    def fn(weights, alpha):
        return (branch_combine(weights, alpha) ** 2).sum()

    eager = fn(*args)
    eager_grads = torch.autograd.grad(eager, args)
    compiled = torch.compile(fn, fullgraph=True)(*args)
    compiled_grads = torch.autograd.grad(compiled, args)
    assert_close(compiled, eager.double(), torch.float32, "loss")
    for g, e in zip(compiled_grads, eager_grads):
        assert_close(g, e.double(), torch.float32, "grad")


# ---- simplex projection ----------------------------------------------------------------

def sort_based_projection(x: torch.Tensor) -> torch.Tensor:
    """Float64 reference, written independently: the KKT conditions row by row."""
    out = torch.empty_like(x, dtype=torch.float64)
    for idx in itertools.product(*(range(s) for s in x.shape[:-1])):
        row = x[idx].to(torch.float64)
        u = torch.sort(row, descending=True).values.tolist()
        total, theta = 0.0, None
        for j, uj in enumerate(u, start=1):
            total += uj
            if uj - (total - 1) / j > 0:
                theta = (total - 1) / j
        out[idx] = torch.clamp(row - theta, min=0)
    return out


ROWS = {
    "random": torch.randn(6, 7, dtype=torch.float64) * 3,
    "ties": torch.tensor([[0.5, 0.5, 0.5, 0.5], [2.0, 2.0, -1.0, -1.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64),
    "all_negative": -torch.rand(3, 5, dtype=torch.float64) - 0.5,
    "on_simplex": torch.softmax(torch.randn(4, 6, dtype=torch.float64), -1),
    "vertex": torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64),
    "single_entry": torch.randn(5, 1, dtype=torch.float64),
    "clients": torch.randn(3, 4, 10, dtype=torch.float64),
    "wide": torch.randn(2, 300, dtype=torch.float64),
    "beyond_1_over_eps": torch.tensor([[1e8, 3.0, -2.0], [1e9, 1e9 - 0.5, 0.0]], dtype=torch.float64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", list(ROWS))
def test_project_simplex_matches_sort_based_reference(case, dtype):
    x = ROWS[case].to(dtype)
    expected = sort_based_projection(x)
    got = project_simplex_(x.clone())
    assert_close(got, expected, dtype, case)
    assert (got >= 0).all()
    assert_close(got.sum(-1), torch.ones(got.shape[:-1], dtype=torch.float64), dtype, "row sums")
    if case == "on_simplex":
        assert_close(got, x.to(torch.float64), dtype, "a point on the simplex is its own projection")


def rows_spanning_the_float_range(dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite rows whose entries span more than half the float range (their shifted prefix
    sums once overflowed to -inf: a finite row came out all Inf), and their exact projections."""
    big = 0.9 * torch.finfo(dtype).max
    rows = torch.tensor([[big, 0.5, -big, 1.0, -big], [0.25, -big, 0.5, -big, -big],
                         [big, big, -big, 0.0, 0.0], [-big, -big, -big, -big, big]], dtype=torch.float64)
    want = torch.tensor([[1.0, 0, 0, 0, 0], [0.375, 0, 0.625, 0, 0], [0.5, 0.5, 0, 0, 0], [0, 0, 0, 0, 1.0]],
                        dtype=torch.float64)
    return rows.to(dtype), want.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kernel", ["op", "reference"])
def test_project_simplex_of_rows_spanning_the_float_range(kernel, dtype):
    x, want = rows_spanning_the_float_range(dtype)
    (project_simplex_ if kernel == "op" else ref.project_simplex_)(x)
    torch.testing.assert_close(x, want, rtol=0, atol=0)


def test_project_simplex_non_contiguous_view_leaves_the_rest_untouched():
    base = torch.randn(6, 9, dtype=torch.float64)
    before = base.clone()
    view = base[::2, 1::2]  # rows of 4, strided
    project_simplex_(view)
    assert_close(view, sort_based_projection(before[::2, 1::2]), torch.float64)
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[::2, 1::2] = False
    assert torch.equal(base[mask], before[mask])
    column_rows = torch.randn(5, 4, dtype=torch.float64)
    rows_t = column_rows.t()  # each row strided by 4
    expected = sort_based_projection(rows_t)
    project_simplex_(rows_t)
    assert_close(rows_t, expected, torch.float64)


# ---- bad input ---------------------------------------------------------------------------

def test_error_alpha_length_differs_from_branches():
    # One reading only (alpha has no client dim): the shape is named once.
    with pytest.raises(ValueError, match=r"^weights must have shape \[4, \*shape\] to match alpha \[4\], "
                                         r"got \[5, 3, 3\]$"):
        branch_combine(torch.randn(5, 3, 3), torch.rand(4))


def test_error_per_client_shapes_do_not_match():
    with pytest.raises(ValueError, match=r"^weights must have shape \[3, 5, \*shape\] or \[5, \*shape\] to match "
                                         r"alpha \[3, 5\], got \[2, 5, 3\]$"):
        branch_combine(torch.randn(2, 5, 3), torch.rand(3, 5))


def test_error_alpha_dims():
    with pytest.raises(ValueError, match="alpha must have 1 or 2 dimensions"):
        branch_combine(torch.randn(2, 3, 5, 4), torch.rand(2, 3, 5))


def test_error_zero_branches():
    with pytest.raises(ValueError, match="B >= 1"):
        branch_combine(torch.randn(0, 3), torch.rand(0))


def test_error_dtype_mixture():
    with pytest.raises(TypeError, match="weights must have the dtype of alpha"):
        branch_combine(torch.randn(3, 4, dtype=torch.float64), torch.rand(3))


def test_error_integer_inputs():
    with pytest.raises(TypeError, match="weights must be a floating"):
        branch_combine(torch.ones(3, 4, dtype=torch.int64), torch.rand(3))
    with pytest.raises(TypeError, match="alpha must be a floating"):
        branch_combine(torch.randn(3, 4), torch.ones(3, dtype=torch.int64))


def test_error_device_mixture():
    with pytest.raises(ValueError, match="weights must be on the device of alpha"):
        branch_combine(torch.randn(3, 4, device="meta"), torch.rand(3))


def test_error_op_level_checks_without_the_wrapper():
    with pytest.raises(ValueError, match="weights"):
        torch.ops.pfl.branch_combine(torch.randn(5, 3), torch.rand(4))


def test_error_project_simplex_bad_input():
    with pytest.raises(TypeError, match="x must be a floating"):
        project_simplex_(torch.ones(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="B >= 1"):
        project_simplex_(torch.empty(3, 0))
    with pytest.raises(ValueError, match="finite"):
        project_simplex_(torch.tensor([[0.2, float("nan")]]))


NAN, INF = float("nan"), float("inf")
# Rows holding NaN or ±Inf (all NaN after the op) between finite rows (projected as usual).
NON_FINITE_ROWS = [[0.2, NAN, 0.3, 0.1], [0.5, 0.1, -0.3, 2.0], [-INF, 0.0, 1.0, 0.5], [-INF] * 4,
                   [INF, 0.0, 0.0, 1.0], [NAN] * 4, [1.0, 2.0, 3.0, 4.0], [INF, -INF, 0.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kernel", ["op", "reference"])
def test_project_simplex_op_makes_rows_holding_nan_or_inf_nan(kernel, dtype):
    """The op's documented rule, the same in the C++ kernel (``op`` on CPU) and the reference:
    a row holding NaN or ±Inf comes out all NaN, the other rows are projected as usual and
    agree bit for bit between the two."""
    x = torch.tensor(NON_FINITE_ROWS, dtype=dtype)
    finite = torch.isfinite(x).all(-1)
    got = x.clone()
    (torch.ops.pfl.project_simplex_ if kernel == "op" else ref.project_simplex_)(got)
    assert got[~finite].isnan().all()
    assert not got[finite].isnan().any()
    assert_close(got[finite], sort_based_projection(x[finite]), dtype, "finite rows")
    by_reference = x.clone()
    ref.project_simplex_(by_reference)
    torch.testing.assert_close(got, by_reference, rtol=0, atol=0, equal_nan=True)
    strided = torch.tensor(NON_FINITE_ROWS, dtype=dtype).t().contiguous().t()  # rows strided by 8
    (torch.ops.pfl.project_simplex_ if kernel == "op" else ref.project_simplex_)(strided)
    torch.testing.assert_close(strided, by_reference, rtol=0, atol=0, equal_nan=True)


def test_project_simplex_wrapper_refuses_nan_and_leaves_x_unchanged():
    x = torch.tensor(NON_FINITE_ROWS)
    before = x.clone()
    with pytest.raises(ValueError, match="finite"):
        project_simplex_(x)
    torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_project_simplex_compiles_with_fullgraph(dynamic):
    """torch.compile(fullgraph=True) failed on the wrapper's host read of x's values (a
    data-dependent guard).  Compiled, the wrapper skips that read: finite x gives what eager
    gives; rows holding NaN/Inf come out all NaN, the op's documented behaviour (eager raises)."""
    torch._dynamo.reset()

    def step(x):
        project_simplex_(x)
        return x * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for shape in ((3, 4), (5, 7)):  # a second shape: a recompile, or the dynamic graph again
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
        want = x.clone()
        want_out = step(want)
        got = x.clone()
        assert torch.equal(compiled(got), want_out) and torch.equal(got, want)
    x = torch.tensor(NON_FINITE_ROWS)
    want = x.clone()
    torch.ops.pfl.project_simplex_(want)
    got = x.clone()
    compiled(got)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got).all(-1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("value", [NAN, INF, -INF, 3e38], ids=["nan", "inf", "-inf", "large"])
def test_the_wrapper_finds_one_non_finite_value_anywhere(value, dtype):
    """Its check is one reduction (``values_finite``): a single NaN, +Inf or -Inf among finite
    values, in a strided view, is refused; a large finite value is not (float16 and bfloat16
    hold 3e38 as Inf and 3e38, so it is refused only where it is not finite)."""
    from pfl_kernels.ops._checks import values_finite

    base = torch.rand(9, 7, dtype=torch.float64)
    base[5, 4] = value
    x = base.to(dtype).t()  # a strided view of x.T
    finite = bool(torch.isfinite(x).all())
    assert values_finite(x) == finite and values_finite(x[:0]) and values_finite(x[:, :5])  # x[4, 5] is the value
    before = x.clone()
    if finite:
        project_simplex_(x)
        assert torch.isfinite(x).all()
    else:
        with pytest.raises(ValueError, match="finite"):
            project_simplex_(x)
        torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)


def test_cpu_runs_the_cpp_kernels():
    if any(os.environ.get(v, "0") not in ("", "0") for v in ("PFL_KERNELS_SKIP_EXTENSION",
                                                              "PFL_KERNELS_DISABLE_EXTENSION")):
        pytest.skip("the C++ extension is switched off by the environment")
    info = pfl_kernels.backend_info()
    for op in ("pfl::branch_combine", "pfl::branch_combine_backward", "pfl::project_simplex_"):
        assert info[op]["cpu"] == {"implementation": "cpp", "reason": ""}, op


@pytest.mark.parametrize("clients", [None, 2])
def test_vmap_forward_backward_and_autograd(clients):
    """vmap over V copies (a batched executor) is one call on V·K clients."""
    shape, branches, copies = (4, 3, 3, 3), 3, 4
    stacks = [make_inputs(shape, branches, clients, torch.float64, seed=s)[0] for s in range(copies)]
    weights, alpha = (torch.stack([st[i] for st in stacks]) for i in range(2))
    shared_weights = weights[0].clone().requires_grad_()  # not vmapped
    alpha = alpha.clone().requires_grad_()
    w = torch.func.vmap(torch.ops.pfl.branch_combine, in_dims=(None, 0))(shared_weights, alpha)
    for c in range(copies):
        assert_close(w[c], ref.branch_combine(shared_weights.detach(), alpha[c].detach()), torch.float64)
    grad = torch.randn_like(w)
    w.backward(grad)
    expected = [ref.branch_combine_backward(grad[c], shared_weights.detach(), alpha[c].detach(), [True, True])
                for c in range(copies)]
    assert_close(shared_weights.grad, sum(e[0] for e in expected), torch.float64, "grad of unbatched weights")
    assert_close(alpha.grad, torch.stack([e[1] for e in expected]), torch.float64, "grad of alpha")
    got = torch.func.vmap(torch.ops.pfl.branch_combine_backward, in_dims=(0, None, 0, None))(
        grad, shared_weights.detach(), alpha.detach(), [False, True])
    assert got[0].shape == (copies, 0)
    assert_close(got[1], torch.stack([e[1] for e in expected]), torch.float64, "vmap of the backward op")

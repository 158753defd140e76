"""The Triton multi-branch kernels (pFedMB) against the float64 reference.

In the Triton interpreter or on a CUDA device, skipped otherwise (see ``triton_support.py``):

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_branch_triton.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import (
    DEVICE, F64, MARKS, RUNNABLE, all_masks, assert_registered_for_cuda, assert_rejects_overlap, gpu_only,
    interpreter_only, launchers_as_cpu_kernels, mask_id)
from tests.tolerances import assert_close

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels.reference import branch as ref
    from tests.kernels.autograd_checks import assert_all_orders, branch_backward_fn, branch_grad_w, branch_leaves
    from pfl_kernels.triton import branch as tb

SHAPES = [(5, 7), (3, 2, 3, 3), (13,), (2, 3, 1, 5)]  # a linear, a conv, a bias, odd sizes
ALL_MASKS = all_masks(2)


@pytest.fixture(params=["default-blocks", "many-blocks"])
def blocks(request, monkeypatch):
    """Default blocks, or tiny ones so every client has several N-blocks (partial sums)."""
    if request.param == "many-blocks":
        monkeypatch.setattr(tb, "_MAX_BLOCK_N", 16)
        monkeypatch.setattr(tb, "_MIN_BLOCK_N", 16)
    return request.param


def test_block_n_heuristic():
    """Full blocks when the grid is big; halved (to _MIN_BLOCK_N at most) when it is small."""
    cpu = torch.device("cpu")  # counted as 132 SMs
    assert tb._block_n(20, 589824, cpu) == 4096
    assert tb._block_n(1, 589824, cpu) == 1024
    assert tb._block_n(1, 450, cpu) == 512
    assert tb._block_n(1, 1, cpu) == 1
    assert tb._block_n(4, 2500, cpu) == 1024


def make_inputs(shape, branches, clients, dtype=F64, seed=0):
    """Random branches and α (never zeros; α not on the simplex, so any α works) on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    lead = () if clients is None else (clients,)
    weights = torch.randn(*lead, branches, *shape, generator=g, dtype=F64).to(DEVICE, dtype)
    alpha = (torch.rand(*lead, branches, generator=g, dtype=F64) + 0.5).to(DEVICE, dtype)
    return weights, alpha


def grad_like(weights, alpha, seed=1, dtype=None):
    g = torch.Generator().manual_seed(seed)
    shape = weights.shape[: alpha.dim() - 1] + weights.shape[alpha.dim():]
    return torch.randn(shape, generator=g, dtype=F64).to(DEVICE, dtype or alpha.dtype)


def f64(*ts):
    return tuple(t.to(F64) for t in ts)


def check_backward(got, want, output_mask, dtype=F64):
    for name, wanted, a, b in zip(("grad_weights", "grad_alpha"), output_mask, got, want):
        if wanted:
            assert a.is_contiguous(), f"{name} is not contiguous"
            assert a.dtype == dtype, f"{name}: dtype {a.dtype}"
            scale = max(1.0, b.abs().max().item()) if dtype != F64 else 1.0
            assert_close(a / scale, b / scale, dtype, name)
        else:
            assert tuple(a.shape) == (0,), f"{name} not requested: want an empty [0] tensor, got {list(a.shape)}"


def run_both(weights, alpha, grad_w, output_mask=(True, True), dtype=F64):
    w = tb.branch_combine_triton(weights, alpha)
    assert w.is_contiguous() and w.dtype == dtype
    assert_close(w, ref.branch_combine(*f64(weights, alpha)), dtype, "W")
    got = tb.branch_combine_backward_triton(grad_w, weights, alpha, list(output_mask))
    want = ref.branch_combine_backward(*f64(grad_w, weights, alpha), list(output_mask))
    check_backward(got, want, output_mask, dtype)


@pytest.mark.parametrize("clients", [None, 3])
@pytest.mark.parametrize("branches", [1, 2, 5])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward(shape, branches, clients, blocks):
    weights, alpha = make_inputs(shape, branches, clients)
    run_both(weights, alpha, grad_like(weights, alpha))


@pytest.mark.parametrize("output_mask", ALL_MASKS, ids=mask_id)
@pytest.mark.parametrize("clients", [None, 2])
def test_backward_output_mask(output_mask, clients, blocks):
    weights, alpha = make_inputs((4, 3, 3, 3), 3, clients, seed=2)
    grad_w = grad_like(weights, alpha)
    got = tb.branch_combine_backward_triton(grad_w, weights, alpha, list(output_mask))
    want = ref.branch_combine_backward(grad_w, weights, alpha, list(output_mask))
    check_backward(got, want, output_mask)
    if not any(output_mask):
        assert got[0] is not got[1]


def test_strided_operands(blocks):
    """Shared branches expanded over K (stride 0), channels_last-like permuted branches
    (copied once, not K times), a strided α and odd grad_w strides."""
    k, b, shape = 3, 4, (3, 2, 3, 3)
    w1, _ = make_inputs(shape, b, None, seed=3)
    alpha = (torch.rand(b, 2 * k, dtype=F64, device=DEVICE) + 0.5).t()[::2]  # [K, B], strided both ways
    permuted = torch.randn(b, 3, 3, 3, 2, dtype=F64, device=DEVICE).permute(0, 1, 4, 2, 3)  # not one run
    cases = {
        "shared": w1.expand(k, *w1.shape),
        "shared-permuted": permuted.expand(k, *permuted.shape),
        "per-client-sliced": torch.randn(k, 2 * b, *shape, dtype=F64, device=DEVICE)[:, ::2],
        "per-client-strided-n": torch.randn(k, b, *shape[:-1], 2 * shape[-1], dtype=F64, device=DEVICE)[..., ::2],
    }
    grads = {
        "contiguous": torch.randn(k, *shape, dtype=F64, device=DEVICE),
        # not viewable as [K, N]: copied
        "permuted": torch.randn(*reversed((k, *shape)), dtype=F64, device=DEVICE).permute(
            *reversed(range(len(shape) + 1))),
        "sliced": torch.randn(2 * k, *shape, dtype=F64, device=DEVICE)[::2],
        # the gradient of a sum: stride 0 everywhere
        "expanded": torch.randn(1, dtype=F64, device=DEVICE).expand(k, *shape),
    }
    # every weights case with a contiguous grad_w, every grad_w case with shared weights
    combos = [(wname, "contiguous") for wname in cases] + \
        [("shared", gname) for gname in grads if gname != "contiguous"]
    for wname, gname in combos:
        weights, grad_w = cases[wname], grads[gname]
        assert not weights.is_contiguous()
        try:
            run_both(weights, alpha, grad_w)
        except AssertionError as exc:
            raise AssertionError(f"weights {wname}, grad_w {gname}: {exc}") from None
    # The copy of non-run trailing dims keeps the stride-0 client dim.
    w3 = tb._as_kbn(cases["shared-permuted"], 2, (k, b, 54))
    assert w3.stride(0) == 0 and w3.stride(2) == 1


def test_shared_branches_one_dim_alpha(blocks):
    """alpha [B] with weights [B, *shape] (no client dim) and a non-contiguous branch dim."""
    weights = torch.randn(7, 2 * 5, dtype=F64, device=DEVICE).t()[::2]  # [5, 7], strides (2, 10)
    alpha = torch.rand(5, dtype=F64, device=DEVICE) + 0.5
    run_both(weights, alpha, torch.randn(7, dtype=F64, device=DEVICE))


@pytest.mark.parametrize("branches", [3, 7])
def test_runtime_branch_loop(branches, monkeypatch, blocks):
    """Branches beyond _UNROLL_B go through the runtime loop."""
    monkeypatch.setattr(tb, "_UNROLL_B", 2)
    weights, alpha = make_inputs((3, 5), branches, 2, seed=4)
    run_both(weights, alpha, grad_like(weights, alpha))


def test_empty_operands():
    for clients, shape in ((0, (3, 2)), (2, (0, 3))):
        weights, alpha = make_inputs(shape, 2, clients)
        w = tb.branch_combine_triton(weights, alpha)
        assert tuple(w.shape) == (clients, *shape)
        gw, ga = tb.branch_combine_backward_triton(grad_like(weights, alpha), weights, alpha, [True, True])
        assert tuple(gw.shape) == tuple(weights.shape)
        assert tuple(ga.shape) == tuple(alpha.shape) and not ga.any()


def test_float32(blocks):
    weights, alpha = make_inputs((3, 2, 3, 3), 5, 3, dtype=torch.float32, seed=5)
    run_both(weights, alpha, grad_like(weights, alpha), dtype=torch.float32)


# ---- simplex projection ----------------------------------------------------------------

SIMPLEX_CASES = {
    "random": lambda: torch.randn(9, 5, dtype=F64) * 2,
    "ties": lambda: torch.tensor([[0.5, 0.5, 0.5, 0.5], [2.0, 2.0, -1.0, -1.0], [1.0, 1.0, 1.0, 0.0],
                                  [0.3, -0.2, 0.3, 0.3], [3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64),
    "all_negative": lambda: -torch.rand(3, 5, dtype=F64) - 0.5,
    "on_simplex": lambda: torch.softmax(torch.randn(4, 6, dtype=F64), -1),
    "on_simplex_with_zeros": lambda: torch.tensor([[0.0, 0.25, 0.75, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=F64),
    "one_branch": lambda: torch.randn(6, 1, dtype=F64),
    "one_row": lambda: torch.randn(10, dtype=F64),
    "wide": lambda: torch.randn(3, 37, dtype=F64),
    "wide_ties": lambda: torch.randint(-3, 4, (5, 33)).to(F64) / 4,
}


def project_ref(x):
    y = x.detach().to(F64).clone()
    ref.project_simplex_(y)
    return y


def check_projection(got, x0, dtype=F64, what=""):
    want = project_ref(x0)
    assert_close(got, want, dtype, what)
    assert (got >= 0).all(), what
    assert_close(got.sum(-1), torch.ones(got.shape[:-1], dtype=F64), dtype, f"{what} row sums")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("case", sorted(SIMPLEX_CASES))
def test_project_simplex(case, dtype):
    torch.manual_seed(6)
    x0 = SIMPLEX_CASES[case]().to(DEVICE, dtype)
    x = x0.clone()
    tb.project_simplex_triton_(x)
    check_projection(x, x0, dtype, case)


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16, torch.float16], ids=str)
def test_project_simplex_of_rows_spanning_the_float_range(dtype):
    """Rows whose shifted sums once overflowed (every entry then in the support: all Inf)."""
    from tests.kernels.test_branch import rows_spanning_the_float_range

    x, want = rows_spanning_the_float_range(dtype)
    x = x.to(DEVICE)
    tb.project_simplex_triton_(x)
    torch.testing.assert_close(x.cpu(), want, rtol=0, atol=0)


def test_project_simplex_ties_exact():
    """Ties split evenly: the same zeros and equal values as the sorted reference."""
    x = torch.tensor([[2.0, 2.0, -1.0, -1.0], [1.0, 1.0, 1.0, 0.0], [0.3, -0.2, 0.3, 0.3]],
                     dtype=F64, device=DEVICE)
    tb.project_simplex_triton_(x)
    want = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 1 / 3, 1 / 3]], dtype=F64)
    assert torch.equal(x.cpu() == 0, want == 0)
    assert_close(x, want, F64)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_project_simplex_huge_entries(dtype):
    """Entries beyond 1/eps (where the reference's x - θ cancels and its support comes out
    empty): the kernel works on x - max(x), so the answer is still right."""
    x = torch.tensor([[1e8, 3.0], [3e7, 3e7], [1e30, -1e30], [-1e20, -1e20]], dtype=dtype, device=DEVICE)
    if dtype == F64:
        x = x * 1e9
    tb.project_simplex_triton_(x)
    want = torch.tensor([[1.0, 0.0], [0.5, 0.5], [1.0, 0.0], [0.5, 0.5]], dtype=F64)
    assert_close(x, want, dtype, "huge entries")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_project_simplex_rows_holding_nan_or_inf_come_out_nan(dtype):
    """The op's rule, as in the reference and the C++ kernel: a row holding NaN or ±Inf is all
    NaN after the op, the others are projected as usual."""
    nan, inf = float("nan"), float("inf")
    rows = [[0.2, nan, 0.3, 0.1], [0.5, 0.1, -0.3, 2.0], [-inf, 0.0, 1.0, 0.5], [-inf] * 4,
            [inf, 0.0, 0.0, 1.0], [nan] * 4, [1.0, 2.0, 3.0, 4.0], [inf, -inf, 0.0, 0.0]]
    x0 = torch.tensor(rows, dtype=dtype, device=DEVICE)
    x = x0.clone()
    tb.project_simplex_triton_(x)
    by_reference = project_ref(x0)
    finite = torch.isfinite(x0).all(-1)
    assert x[~finite].isnan().all() and by_reference[~finite.cpu()].isnan().all()
    check_projection(x[finite], x0[finite], dtype, "finite rows")


def test_project_simplex_views():
    """Non-contiguous rows (through their strides or a temporary); the rest untouched."""
    base = torch.randn(6, 8, 10, dtype=F64, device=DEVICE)
    views = {
        "transposed": lambda t: t[0].t(),                 # rows of stride 1, entries of stride 10
        "strided": lambda t: t[:, ::2, 1:8:2],            # leading dims merge: one row stride
        "permuted": lambda t: t.permute(2, 0, 1)[:, ::2],  # leading dims do not merge: temporary
        "column": lambda t: t[:, 3, :1],                  # B = 1
    }
    for name, view in views.items():
        x = base.clone()
        want = base.clone()
        view(want).copy_(project_ref(view(base)))
        tb.project_simplex_triton_(view(x))
        assert_close(x, want, F64, name)


@pytest.mark.parametrize("tile,max_b", [(16, 1024), (4096, 4)])
def test_project_simplex_long_rows(tile, max_b, monkeypatch):
    """Rows whose comparison tile is chunked along j, and rows beyond _MAX_SIMPLEX_B (reference)."""
    monkeypatch.setattr(tb, "_SIMPLEX_TILE", tile)
    monkeypatch.setattr(tb, "_MAX_SIMPLEX_B", max_b)
    x0 = torch.cat([torch.randn(3, 10, dtype=F64), torch.full((1, 10), 0.7, dtype=F64)]).to(DEVICE)
    x0[0, 4] = x0[0, 7]  # a tie across chunks
    x = x0.clone()
    tb.project_simplex_triton_(x)
    check_projection(x, x0, F64, f"tile {tile}")


def test_project_simplex_rejects_overlap():
    assert_rejects_overlap(tb.project_simplex_triton_)


@interpreter_only
def test_through_dispatcher_and_autograd():
    """The launchers accept the schema's args: run them as the CPU kernels of the ops (in a
    scoped library, undone at exit) under the Python wrappers and autograd."""
    from pfl_kernels.ops import branch_combine, project_simplex_

    shape = (3, 2, 3, 3)
    shared, _ = make_inputs(shape, 3, None, seed=7)
    _, alpha = make_inputs(shape, 3, 2, seed=8)
    leaves = [t.clone().requires_grad_(True) for t in (shared, alpha)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (shared, alpha)]
    g = torch.randn(2, *shape, dtype=F64)
    with launchers_as_cpu_kernels({"branch_combine": tb.branch_combine_triton,
                                   "branch_combine_backward": tb.branch_combine_backward_triton,
                                   "project_simplex_": tb.project_simplex_triton_}):
        w = branch_combine(*leaves)  # shared branches: expanded over K by the wrapper
        w.backward(g)
        x = torch.randn(5, 4, dtype=F64)
        want_x = project_ref(x.t()).t()
        project_simplex_(x.t())
    w_ref = ref.branch_combine(ref_leaves[0].expand(2, *ref_leaves[0].shape), ref_leaves[1])
    w_ref.backward(g)
    assert_close(w, w_ref, F64, "W")
    for name, a, b in zip(("weights", "alpha"), leaves, ref_leaves):
        assert_close(a.grad, b.grad, F64, f"autograd grad of {name}")
    assert_close(x, want_x, F64, "project_simplex_ through the op")


@interpreter_only
@pytest.mark.parametrize("shape,clients", [((2, 2, 1, 3), "shared"), ((3, 4), "clients"), ((3,), None)], ids=str)
def test_gradients_of_every_order_through_the_launchers(shape, clients):
    """gradcheck and gradgradcheck (reverse and forward mode) of both ops, with the launchers
    as their kernels: the autograd formulas call the ops, so every order runs on Triton."""
    from pfl_kernels.ops import branch_combine

    leaves = branch_leaves(shape, 3, clients)
    with launchers_as_cpu_kernels({"branch_combine": tb.branch_combine_triton,
                                   "branch_combine_backward": tb.branch_combine_backward_triton}):
        assert_all_orders(branch_combine, leaves, fast=True)
        assert_all_orders(branch_backward_fn((True, True)), [branch_grad_w(shape, clients), *leaves], fast=True)


def test_registered_for_cuda():
    assert_registered_for_cuda(("branch_combine", "branch_combine_backward", "project_simplex_"))


# ---------------------------------------------------------------------------------------
# Real GPU only (``gpu_only``): the ops through the dispatcher, opcheck, autograd and half precision.


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape,clients", [((16, 8, 3, 3), 3), ((40, 130), None), ((256, 128, 3, 3), 2),
                                           ((84,), 20)], ids=str)
def test_gpu_dtypes(shape, clients, dtype):
    weights, alpha = make_inputs(shape, 5, clients, dtype=dtype, seed=9)
    w = torch.ops.pfl.branch_combine(weights, alpha)
    assert w.dtype == dtype and w.is_contiguous()
    assert_close(w, ref.branch_combine(*f64(weights, alpha)), dtype, "W")
    grad_w = grad_like(weights, alpha, dtype=dtype)
    got = torch.ops.pfl.branch_combine_backward(grad_w, weights, alpha, [True, True])
    want = ref.branch_combine_backward(*f64(grad_w, weights, alpha), [True, True])
    check_backward(got, want, (True, True), dtype)
    x0 = torch.randn(7, 5, device=DEVICE).to(dtype)
    x = x0.clone()
    torch.ops.pfl.project_simplex_(x)
    assert_close(x, project_ref(x0), dtype, "project_simplex_")


@gpu_only
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("clients", [None, 2])
def test_gpu_opcheck(clients, dtype):
    weights, alpha = make_inputs((4, 3, 3, 3), 3, clients, dtype=dtype, seed=10)
    weights.requires_grad_(True)
    alpha.requires_grad_(True)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.pfl.branch_combine.default, (weights, alpha), test_utils=tests)
    grad_w = grad_like(weights, alpha, dtype=dtype)
    for mask in ALL_MASKS:
        torch.library.opcheck(torch.ops.pfl.branch_combine_backward.default,
                              (grad_w, weights.detach(), alpha.detach(), list(mask)), test_utils=tests[:3])
    x = torch.randn(4, 6, device=DEVICE).to(dtype)
    torch.library.opcheck(torch.ops.pfl.project_simplex_.default, (x,), test_utils=tests[:3])
    if dtype == F64:
        assert torch.autograd.gradcheck(torch.ops.pfl.branch_combine, (weights, alpha))
        shared = weights[0].detach().clone().requires_grad_(True) if clients else None
        if shared is not None:
            assert torch.autograd.gradcheck(lambda w, a: torch.ops.pfl.branch_combine(w.expand(clients, *w.shape), a),
                                            (shared, alpha))

"""The Triton branch_aggregate kernel against the float64 reference.

In the Triton interpreter or on a CUDA device, skipped otherwise (see ``triton_support.py``):

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_branch_aggregate_triton.py -q
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.triton_support import (
    DEVICE, F64, MARKS, RUNNABLE, assert_registered_for_cuda, gpu_only, interpreter_only, launchers_as_cpu_kernels)
from tests.tolerances import assert_close

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels.reference import branch_aggregate as ref
    from pfl_kernels.triton import branch_aggregate as tba
    from tests.kernels.branch_aggregate_oracle import EXTREME_CASES, case, exact_aggregate


@pytest.fixture(params=["default-blocks", "tiny-blocks"])
def blocks(request, monkeypatch):
    """Default blocks, or tiny ones so that P spans several programs."""
    if request.param == "tiny-blocks":
        monkeypatch.setattr(tba, "_MAX_BLOCK_P", 16)
        monkeypatch.setattr(tba, "_MIN_BLOCK_P", 16)
        monkeypatch.setattr(tba, "_BLOCK_I", 2)  # clients over several steps (float64: one a step)
        monkeypatch.setattr(tba, "_COEF_BLOCK_K", 2)  # alpha over several tiles each way
        monkeypatch.setattr(tba, "_MAX_COEF_BLOCK_B", 2)
    return request.param


def make_inputs(k, b, shape, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = torch.randn(k, b, *shape, generator=g, dtype=F64).to(DEVICE, dtype)
    alpha = (torch.rand(k, b, generator=g, dtype=F64) + 0.05).to(DEVICE)
    counts = torch.randint(1, 50, (k,), generator=g).to(DEVICE)
    return params, alpha, counts


def check(params, alpha, counts, dtype=F64):
    out = tba.branch_aggregate_triton(params, alpha, counts)
    assert out.dtype == params.dtype and out.is_contiguous() and out.shape == params.shape[1:]
    want = ref.branch_aggregate(params.to(F64), alpha.to(F64), counts)
    assert_close(out, want, dtype, "W")
    return out


@pytest.mark.parametrize("k,b,shape", [(1, 1, (5,)), (3, 2, (7,)), (5, 3, (2, 3, 3)), (40, 2, (33,))], ids=str)
def test_matches_reference(k, b, shape, blocks):
    check(*make_inputs(k, b, shape))


_DTYPE_PAIRS = [(a, c) for a in (torch.float16, torch.bfloat16, torch.float32, F64)
                for c in (torch.int64, torch.int32, torch.uint8, torch.float32, F64)]


@pytest.mark.parametrize("k,b,alpha_dtype,counts_dtype", [
    *((9, 5, a, c) for a, c in _DTYPE_PAIRS),  # every dtype pair; tiny blocks: 5 x 3 tiles of alpha
    (1, 1, torch.float32, torch.int64), (130, 20, torch.float32, torch.int64),  # default blocks: 3 x 2 tiles
], ids=str)
def test_coefficients_match_the_reference(k, b, alpha_dtype, counts_dtype, blocks):
    """One launch forms the reference's float64 coefficients (then rounded to the accumulation
    dtype), over several tiles of alpha each way, K = 1 (a specialized int) included, with a
    strided alpha, unweighted branches and zero counts, and flags nothing."""
    g = torch.Generator().manual_seed(k * b)
    alpha = torch.rand(b, k, generator=g, dtype=F64).t().to(alpha_dtype)  # strides (1, K)
    alpha[0, :] = 0
    if b > 1:
        alpha[:, 1] = 0  # nobody weights branch 1: 1/K
    counts = torch.randint(0, 50, (k,), generator=g).to(counts_dtype)
    params = torch.zeros(k, b, 1, device=DEVICE)
    for acc in (torch.float32, F64):
        coef, flags = tba._coefficients_and_checks(params.to(acc), alpha.to(DEVICE), counts.to(DEVICE))
        assert coef.dtype == acc and coef.is_contiguous() and flags.tolist() == [0, 0]
        want = ref.coefficients(alpha.to(F64), counts, acc)
        # The sums run in another order: within K ulps of float64, then one rounding to float32.
        rtol = 2.0 ** -23 if acc == torch.float32 else k * 2.0 ** -52
        torch.testing.assert_close(coef.cpu(), want, rtol=rtol, atol=0)


@pytest.mark.parametrize("bad", ["alpha nan", "alpha inf", "alpha negative", "counts negative", "counts nan"])
@pytest.mark.parametrize("variant", ["functional", "out"])
def test_bad_values_raise_the_ops_error_and_leave_out_untouched(bad, variant, blocks):
    params, alpha, counts = make_inputs(9, 3, (9,), seed=5)
    if bad.startswith("counts"):
        counts = counts.double()
    target, value = bad.split()
    tensor = alpha if target == "alpha" else counts
    index = (6, 2) if target == "alpha" else (6,)
    tensor[index] = {"nan": math.nan, "inf": math.inf, "negative": -1.0}[value]
    name = "alpha" if target == "alpha" else "counts"
    out = torch.full((3, 9), 7.0, dtype=F64, device=DEVICE)
    with pytest.raises(ValueError, match=rf"{name} must be >= 0 and finite, got {name}\[6[,\]]"):
        if variant == "out":
            tba.branch_aggregate_out_triton(params, alpha, counts, out=out)
        else:
            tba.branch_aggregate_triton(params, alpha, counts)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("name", list(EXTREME_CASES) if RUNNABLE else [])
def test_extreme_counts_and_alpha_match_the_exact_formula(name, blocks):
    """Counts and α whose products overflow float64 (every branch was NaN) or underflow it:
    the coefficient kernel scales them per branch as the reference does."""
    params, alpha, counts = (t.to(DEVICE) for t in case(name))
    want = exact_aggregate(params.cpu(), alpha.cpu(), counts.cpu())
    for out in (tba.branch_aggregate_triton(params, alpha, counts),
                tba.branch_aggregate_out_triton(params, alpha, counts, out=torch.empty_like(params[0]))):
        assert torch.allclose(out.cpu(), want, rtol=1e-13, atol=1e-300), f"{name}: {out} != {want}"
    coef, flags = tba._coefficients_and_checks(params, alpha, counts)
    assert flags.tolist() == [0, 0]
    torch.testing.assert_close(coef.cpu(), ref.coefficients(alpha.cpu(), counts.cpu(), F64), rtol=4 * 2.0**-52, atol=0)


def test_float32(blocks):
    check(*make_inputs(6, 3, (37,), torch.float32, seed=1), dtype=torch.float32)


def test_unweighted_branch_and_zero_weight_rows(blocks):
    params, alpha, counts = make_inputs(6, 3, (21,), seed=2)
    alpha[:, 1] = 0.0  # nobody weights branch 1: plain average
    counts[2] = 0
    params[2] = float("nan")  # n = 0: never read for branches 0 and 2 (read for branch 1)
    alpha[4, 0] = 0.0
    params[4, 0] = float("inf")
    out = tba.branch_aggregate_triton(params, alpha, counts)
    assert torch.isfinite(out[[0, 2]]).all()
    assert torch.isnan(out[1]).all(), "the plain average of branch 1 reads every client"
    clean = params.clone()
    clean[2] = 0.0
    clean[4, 0] = 0.0
    assert_close(out[[0, 2]], ref.branch_aggregate(clean, alpha, counts)[[0, 2]], F64)


def test_strided_params(blocks):
    params, alpha, counts = make_inputs(4, 3, (5, 6), seed=3)
    strided = torch.randn(4, 6, 5, 12, dtype=F64, device=DEVICE)[:, ::2, :, ::2]
    strided.copy_(params)
    permuted = params.transpose(2, 3).contiguous().transpose(2, 3)  # not one run: copied
    for p in (strided, permuted):
        assert not p.is_contiguous()
        check(p, alpha, counts)


@pytest.mark.parametrize("layout", ["bank-slice", "permuted", "overlaps-params"])
def test_out(layout, blocks):
    """out=: straight into a bank slice, through a copy for a layout that is not [B, P] rows
    or for an out that is client 0's own copy of the branches."""
    params, alpha, counts = make_inputs(5, 3, (4, 7), seed=7)
    want = ref.branch_aggregate(params, alpha, counts)
    bank = torch.full((3, 40), 9.0, dtype=F64, device=DEVICE)
    if layout == "bank-slice":
        out = bank[:, 5:33].view(3, 4, 7)
    elif layout == "permuted":
        out = torch.empty(7, 3, 4, dtype=F64, device=DEVICE).permute(1, 2, 0)
    else:
        params = params.clone()
        out = params[0]
    got = tba.branch_aggregate_out_triton(params, alpha, counts, out=out)
    assert got is out
    assert_close(out, want, F64, "W")
    assert (bank[:, :5] == 9).all() and (bank[:, 33:] == 9).all()


@interpreter_only
def test_through_dispatcher_and_autograd():
    """The launcher as the CPU kernel of the op, under the wrapper and autograd."""
    from pfl_kernels.ops import branch_aggregate

    params, alpha, counts = make_inputs(4, 3, (6,), seed=4)
    leaves = [t.clone().requires_grad_(True) for t in (params, alpha)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (params, alpha)]
    g = torch.randn(3, 6, dtype=F64)
    with launchers_as_cpu_kernels({"branch_aggregate": tba.branch_aggregate_triton}):
        out = branch_aggregate(*leaves, counts)
        out.backward(g)
    want = ref.branch_aggregate(*ref_leaves, counts)
    want.backward(g)
    assert_close(out, want, F64, "W")
    for name, a, b in zip(("branch_params", "alpha"), leaves, ref_leaves):
        assert_close(a.grad, b.grad, F64, f"grad of {name}")


def test_registered_for_cuda():
    assert_registered_for_cuda(("branch_aggregate", "branch_aggregate.out"))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_dtypes(dtype):
    params, alpha, counts = make_inputs(30, 5, (4099,), dtype, seed=5)
    out = torch.ops.pfl.branch_aggregate(params, alpha.float(), counts)
    assert out.dtype == dtype
    assert_close(out, ref.branch_aggregate(params.to(F64), alpha, counts), dtype, "W")


@gpu_only
def test_gpu_opcheck_and_gradcheck():
    params, alpha, counts = make_inputs(4, 3, (5,), seed=6)
    torch.library.opcheck(torch.ops.pfl.branch_aggregate.default,
                          (params.requires_grad_(), alpha.requires_grad_(), counts))
    torch.library.opcheck(torch.ops.pfl.branch_aggregate.out, (params.detach(), alpha.detach(), counts),
                          {"out": torch.empty(3, 5, dtype=F64, device=DEVICE)},
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert torch.autograd.gradcheck(lambda p, a: torch.ops.pfl.branch_aggregate(p, a, counts), (params, alpha))

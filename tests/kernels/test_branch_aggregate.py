"""pfl::branch_aggregate (pFedMB Eq. 5) on CPU (the C++ kernel when built) against the float64 reference."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import pfl_kernels
from pfl_kernels.ops import branch_aggregate
from pfl_kernels.reference import branch_aggregate as ref
from tests.kernels.branch_aggregate_oracle import EXTREME_CASES, case, exact_aggregate, exact_grad_alpha
from tests.threads import on_one_and_many_threads
from tests.tolerances import assert_close

F64 = torch.float64
DTYPES = [torch.float32, F64, torch.bfloat16]


def make_inputs(k, b, shape, dtype=torch.float32, seed=0, alpha_dtype=None, counts_dtype=torch.int64):
    """Random branches (never zeros), α in (0.05, 1.05) and counts in [1, 100]."""
    g = torch.Generator().manual_seed(seed)
    params = torch.randn(k, b, *shape, generator=g, dtype=F64).to(dtype)
    alpha = (torch.rand(k, b, generator=g, dtype=F64) + 0.05).to(alpha_dtype or (F64 if dtype == F64 else torch.float32))
    counts = torch.randint(1, 101, (k,), generator=g).to(counts_dtype)
    return params, alpha, counts


def expected(params, alpha, counts):
    """Eq. 5 straight from its definition, in float64 (independent of the reference's form)."""
    k, b = alpha.shape
    w = params.to(F64).reshape(k, b, -1)
    n = counts.to(F64)[:, None] * alpha.to(F64)
    out = torch.empty(b, w.shape[-1], dtype=F64)
    for j in range(b):
        total = n[:, j].sum()
        if total > 0:
            keep = n[:, j] != 0
            out[j] = (n[keep, j, None] * w[keep, j]).sum(0) / total
        else:
            out[j] = w[:, j].mean(0)
    return out.reshape(params.shape[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,b,shape", [(1, 1, (7,)), (1, 5, (65,)), (3, 2, (5, 3, 3)), (20, 5, (1001,)),
                                       (37, 3, (4099,)), (300, 5, (129,)), (9, 10, (8193,)), (13, 4, (2, 3, 1, 5))],
                         ids=str)
def test_matches_reference(k, b, shape, dtype):
    params, alpha, counts = make_inputs(k, b, shape, dtype)
    out = branch_aggregate(params, alpha, counts)
    assert out.dtype == dtype and out.shape == (b, *shape) and out.is_contiguous()
    want = expected(params, alpha, counts)
    assert_close(out, want, dtype, "W")
    assert_close(ref.branch_aggregate(params.to(F64), alpha.to(F64), counts), want, F64, "reference")


@pytest.mark.parametrize("counts_dtype", [torch.int64, torch.int32, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("alpha_dtype", [torch.float32, F64, torch.bfloat16], ids=str)
def test_mixed_dtypes_bf16_params(alpha_dtype, counts_dtype):
    """bfloat16 params with float32/float64/bfloat16 α and integer/floating counts: fp32 accumulation."""
    params, alpha, counts = make_inputs(40, 5, (333,), torch.bfloat16, seed=1, alpha_dtype=alpha_dtype,
                                        counts_dtype=counts_dtype)
    out = branch_aggregate(params, alpha, counts)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected(params, alpha, counts), torch.bfloat16, "W")


def test_bf16_accumulates_in_float32():
    """Many clients with equal weights: a bf16 accumulator would lose the small terms."""
    k = 256
    params = torch.full((k, 1, 64), 1.0, dtype=torch.bfloat16)
    params[1:] = 2.0 ** -9  # each below bf16's half-ulp of 1
    out = branch_aggregate(params, torch.ones(k, 1), torch.ones(k, dtype=torch.int64))
    want = (1.0 + (k - 1) * 2.0 ** -9) / k
    assert_close(out, torch.full((1, 64), want, dtype=F64), torch.bfloat16)


def test_duplicated_and_zero_rows():
    params, alpha, counts = make_inputs(6, 3, (101,), seed=2)
    params[2] = params[1]  # duplicated client
    params[4] = 0.0  # a client whose branches are zero
    assert_close(branch_aggregate(params, alpha, counts), expected(params, alpha, counts), torch.float32)
    # identical clients: the aggregate is that client's branches, whatever the weights
    same = params[1:2].expand(6, 3, 101).contiguous()
    assert_close(branch_aggregate(same, alpha, counts), params[1].to(F64), torch.float32, "identical clients")


def test_branch_nobody_weights_is_the_plain_average():
    params, alpha, counts = make_inputs(5, 3, (77,), F64, seed=3)
    alpha[:, 1] = 0.0  # branch 1: every α is 0
    out = branch_aggregate(params, alpha, counts)
    assert_close(out[1], params[:, 1].mean(0), F64, "unweighted branch")
    assert_close(out, expected(params, alpha, counts), F64)
    # all counts 0: every branch is the plain average
    out0 = branch_aggregate(params, alpha, torch.zeros(5, dtype=torch.int64))
    assert_close(out0, params.mean(0), F64, "all counts 0")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_non_finite_rows_reach_only_the_branches_they_weight(bad):
    params, alpha, counts = make_inputs(8, 4, (50,), seed=4)
    params[2, 0] = bad  # client 2's branch 0: weighted (α > 0, n > 0)
    params[3] = bad  # client 3: every branch, but n_3 = 0
    counts[3] = 0
    params[5, 1] = bad  # client 5's branch 1, α_51 = 0
    alpha[5, 1] = 0.0
    out = branch_aggregate(params, alpha, counts)
    assert not torch.isfinite(out[0]).any(), "a weighted NaN/Inf row makes its branch non-finite"
    assert torch.isfinite(out[1:]).all(), "rows with zero weight must not be read"
    clean = params.clone()
    clean[2, 0] = 0.0
    assert_close(out[1:], expected(clean, alpha, counts)[1:], torch.float32, "the other branches")


def test_zero_weight_clients_are_skipped_exactly():
    params, alpha, counts = make_inputs(7, 2, (300,), F64, seed=5)
    counts[[0, 4]] = 0
    alpha[6, 0] = 0.0
    out = branch_aggregate(params, alpha, counts)
    keep = [1, 2, 3, 5, 6]
    out_kept = branch_aggregate(params[keep].contiguous(), alpha[keep].contiguous(), counts[keep].contiguous())
    assert_close(out, out_kept, F64)


def _reference_kernels():
    """The reference kernel of every op in place of the C++ one, for CPU tensors."""
    from pfl_kernels.ops._library import REFERENCE_KERNELS
    from pfl_kernels.triton import launchers_on_cpu

    return launchers_on_cpu({q.split("::", 1)[1]: kernel for q, kernel in REFERENCE_KERNELS.items()})


@pytest.mark.parametrize("kernel", ["cpu", "reference"])
@pytest.mark.parametrize("name", list(EXTREME_CASES))
def test_extreme_counts_and_alpha_match_the_exact_formula(name, kernel):
    """Counts and α of 1e300 (products beyond float64) made every branch NaN silently, and
    tiny ones (products below it) a branch nobody weights; the coefficients are scale-
    invariant, and every backend now forms them without overflow or underflow."""
    params, alpha, counts = case(name)
    with _reference_kernels() if kernel == "reference" else contextlib.nullcontext():
        out = branch_aggregate(params, alpha, counts)
        into = branch_aggregate(params, alpha, counts, out=torch.empty_like(params[0]))
    want = exact_aggregate(params, alpha, counts)
    assert torch.allclose(out, want, rtol=1e-13, atol=1e-300), f"{name}: {out} != {want}"
    assert torch.equal(into, out)
    if name == "products overflow, equal":  # equal coefficients: the plain mean
        assert torch.allclose(out, params.mean(0), rtol=1e-13, atol=0)


def test_extreme_values_keep_zero_weight_clients_unread():
    """NaN isolation with products beyond float64: a client with α_ib = 0 (or n_i = 0) among
    counts of 1e300 is still not read for b, and the others' weights are exact."""
    params, alpha, counts = case("products overflow, unequal")
    params[1, 1] = float("nan")  # α_11 = 0
    out = branch_aggregate(params, alpha, counts)
    assert torch.isfinite(out).all()
    clean = params.clone()
    clean[1, 1] = 0.0
    assert torch.allclose(out, exact_aggregate(clean, alpha, counts), rtol=1e-13, atol=0)


def test_coefficients_of_ordinary_values_are_the_plain_formula_bit_for_bit():
    """The per-branch power-of-two scaling is exact: for products in float64's normal range
    the coefficients are n_i α_ib / Σ_j n_j α_jb, every bit (no change to ordinary results)."""
    _, alpha, counts = make_inputs(13, 4, (1,), F64, seed=21)
    alpha[3, 1] = 0.0
    weight = counts.to(F64)[:, None] * alpha
    assert torch.equal(ref.coefficients(alpha, counts, F64), weight / weight.sum(0))


@pytest.mark.parametrize("name", ["products overflow, equal", "products overflow, unequal", "products underflow",
                                  "ordinary"])
def test_grad_alpha_of_extreme_values(name):
    """The backward's n_i / D_b: D_b = Σ_j n_j α_jb overflowed to inf (a zero gradient); it
    is formed from the same scaled products as the coefficients."""
    params, alpha, counts = case(name)
    # n_i / D_b itself finite (1e300 / (1e300 · 1e300) is not): products of 1e400
    alpha, counts = alpha.clamp_max(1e200), counts.clamp_max(1e200)
    a = alpha.clone().requires_grad_()
    out = branch_aggregate(params, a, counts)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    out.backward(g)
    want = exact_grad_alpha(params, alpha, counts, g)
    assert torch.allclose(a.grad, want, rtol=1e-10, atol=1e-300), f"{a.grad} != {want}"


def test_non_contiguous_inputs():
    params, alpha, counts = make_inputs(6, 4, (9, 11), F64, seed=6)
    strided = torch.randn(6, 8, 9, 22, dtype=F64)[:, ::2, :, ::2]
    strided.copy_(params)
    permuted = params.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    alpha_t = alpha.t().contiguous().t()
    counts_s = torch.stack([counts, counts], 1)[:, 0]
    want = expected(params, alpha, counts)
    for name, p in (("strided", strided), ("permuted", permuted)):
        assert not p.is_contiguous()
        assert_close(branch_aggregate(p, alpha_t, counts_s), want, F64, name)


# ---- out= ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,b,shape", [(1, 1, (7,)), (20, 5, (1001,)), (9, 3, (8193,)), (5, 4, (3, 1, 5))], ids=str)
def test_out_into_a_bank_slice(k, b, shape, dtype):
    """out= writes W into rows of a bank (row stride > P) and nothing else of the bank; the
    values are those of the allocating call, bit for bit."""
    params, alpha, counts = make_inputs(k, b, shape, dtype, seed=13)
    p = params[0, 0].numel()
    bank = torch.full((b, p + 10), 7.0, dtype=dtype)
    out = bank[:, 3:3 + p].view(b, *shape)
    got = branch_aggregate(params, alpha, counts, out=out)
    assert got is out
    assert torch.equal(out, branch_aggregate(params, alpha, counts))
    assert_close(out, expected(params, alpha, counts), dtype, "W")
    assert (bank[:, :3] == 7).all() and (bank[:, 3 + p:] == 7).all()


def test_out_of_any_layout():
    """An out that is not [B, P] rows with unit stride (permuted, strided) gets the same W."""
    params, alpha, counts = make_inputs(6, 3, (4, 9), seed=14)
    want = branch_aggregate(params, alpha, counts)
    for out in (torch.empty(9, 3, 4).permute(1, 2, 0), torch.empty(3, 4, 18)[..., ::2]):
        branch_aggregate(params, alpha, counts, out=out)
        assert torch.equal(out, want)


@pytest.mark.parametrize("which", ["client-0", "client-last", "shifted"])
def test_out_overlapping_params(which):
    """out sharing memory with branch_params (a client's own copy of the branches, or a
    shifted window of them) gets the result without overlap."""
    params, alpha, counts = make_inputs(5, 3, (257,), seed=15)
    want = branch_aggregate(params, alpha, counts)
    bank = params.clone()
    out = {"client-0": bank[0], "client-last": bank[4],
           "shifted": bank.view(-1)[100:100 + 3 * 257].view(3, 257)}[which]
    branch_aggregate(bank, alpha, counts, out=out)
    assert torch.equal(out, want)


def test_out_empty_params():
    params, alpha, counts = make_inputs(3, 2, (0,))
    out = torch.empty(2, 0)
    assert branch_aggregate(params, alpha, counts, out=out) is out


def test_deterministic_across_thread_counts():
    params, alpha, counts = make_inputs(50, 5, (40000,), seed=7)
    one, many = on_one_and_many_threads(lambda: branch_aggregate(params, alpha, counts))
    assert torch.equal(one, many)


@pytest.mark.parametrize("k,b,shape", [(1, 1, (3,)), (4, 3, (5,)), (6, 2, (2, 3))], ids=str)
def test_gradcheck(k, b, shape):
    params, alpha, counts = make_inputs(k, b, shape, F64, seed=8)
    counts[0] = 0 if k > 1 else counts[0]  # a client without samples: no gradient to its α
    inputs = [params.requires_grad_(), alpha.requires_grad_()]
    assert torch.autograd.gradcheck(lambda p, a: branch_aggregate(p, a, counts), inputs)


def test_gradients_of_special_cases():
    """n_i = 0: grad α_i = 0; a branch nobody weights: grad α = 0, grad W = g / K; NaN rows of
    zero-weight clients do not poison the gradient of the other clients' α."""
    params, alpha, counts = make_inputs(5, 3, (20,), F64, seed=9)
    counts[1] = 0
    alpha[:, 2] = 0.0
    params[1] = float("nan")
    p, a = params.clone().requires_grad_(), alpha.clone().requires_grad_()
    out = branch_aggregate(p, a, counts)
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(a.grad[1], torch.zeros(3, dtype=F64))
    assert torch.equal(a.grad[:, 2], torch.zeros(5, dtype=F64))
    assert torch.isfinite(a.grad).all() and torch.isfinite(p.grad).all()
    assert_close(p.grad[:, 2], (g[2] / 5).expand(5, 20), F64, "unweighted branch: g / K")
    assert torch.equal(p.grad[1, :2], torch.zeros(2, 20, dtype=F64))


def test_bf16_gradients():
    params, alpha, counts = make_inputs(10, 3, (257,), torch.bfloat16, seed=10)
    p, a = params.clone().requires_grad_(), alpha.clone().requires_grad_()
    out = branch_aggregate(p, a, counts)
    g = torch.randn(out.shape, dtype=torch.bfloat16)
    out.backward(g)
    p64, a64 = params.to(F64).requires_grad_(), alpha.to(F64).requires_grad_()
    ref.branch_aggregate(p64, a64, counts).backward(g.to(F64))
    assert p.grad.dtype == torch.bfloat16 and a.grad.dtype == torch.float32
    assert_close(p.grad, p64.grad, torch.bfloat16, "grad params")
    scale = a64.grad.abs().max().item()
    assert_close(a.grad / scale, a64.grad / scale, torch.bfloat16, "grad alpha")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_opcheck(dtype):
    params, alpha, counts = make_inputs(4, 3, (5, 3), dtype, seed=11)
    torch.library.opcheck(torch.ops.pfl.branch_aggregate.default, (params.requires_grad_(), alpha.requires_grad_(), counts))
    torch.library.opcheck(torch.ops.pfl.branch_aggregate.default, (params.detach(), alpha.detach().requires_grad_(), counts))
    torch.library.opcheck(torch.ops.pfl.branch_aggregate.default, (params.detach(), alpha.detach(), counts.to(dtype)))
    # torch cannot functionalize a custom op that returns an alias (Tensor(a!)), so the out
    # overload is checked without aot_dispatch (as weighted_average.out).
    torch.library.opcheck(torch.ops.pfl.branch_aggregate.out, (params.detach(), alpha.detach(), counts),
                          {"out": torch.empty(3, 5, 3, dtype=dtype)},
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile_matches_eager():
    params, alpha, counts = make_inputs(6, 3, (40,), seed=12)
    args = [params.requires_grad_(), alpha.requires_grad_()]

    def fn(p, a):
        return (torch.ops.pfl.branch_aggregate(p, a, counts) ** 2).sum()

    eager = fn(*args)
    eager_grads = torch.autograd.grad(eager, args)
    compiled = torch.compile(fn, fullgraph=True)(*args)
    for g, e in zip(torch.autograd.grad(compiled, args), eager_grads):
        assert_close(g, e.double(), torch.float32, "grad")
    assert_close(compiled, eager.double(), torch.float32, "loss")


# ---- bad input ---------------------------------------------------------------------------

def test_errors_shapes():
    p, a, n = make_inputs(3, 2, (4,))
    with pytest.raises(ValueError, match=r"branch_params must have shape \[K=3, B=2"):
        branch_aggregate(p[:, :1], a, n)
    with pytest.raises(ValueError, match=r"counts must have shape \[K=3\]"):
        branch_aggregate(p, a, n[:2])
    with pytest.raises(ValueError, match="alpha must be \\[K, B\\]"):
        branch_aggregate(p, a[0], n)
    with pytest.raises(ValueError, match="K >= 1"):
        branch_aggregate(p[:0], a[:0], n[:0])
    with pytest.raises(ValueError, match="B >= 1"):
        branch_aggregate(p[:, :0], a[:, :0], n)


VALUE_CALLS = {"wrapper": branch_aggregate, "op": torch.ops.pfl.branch_aggregate}


@pytest.mark.parametrize("call", list(VALUE_CALLS))
def test_errors_values(call):
    """The op checks the data itself (every kernel, the same ValueError), not only the wrapper."""
    p, a, n = make_inputs(3, 2, (4,))
    agg = VALUE_CALLS[call]
    with pytest.raises(ValueError, match=r"counts must be >= 0 and finite, got counts\[1\] = -2$"):
        agg(p, a, torch.tensor([1, -2, 3]))
    with pytest.raises(ValueError, match=r"counts must be >= 0 and finite, got counts\[1\] = nan"):
        agg(p, a, torch.tensor([1.0, float("nan"), 3.0]))
    bad = a.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"alpha must be >= 0 and finite, got alpha\[2, 1\] = nan"):
        agg(p, bad, n)
    bad[2, 1] = -0.5
    with pytest.raises(ValueError, match=r"alpha must be >= 0 and finite, got alpha\[2, 1\] = -0.5"):
        agg(p, bad, n)
    bad[0, 0] = float("inf")  # counts first, then alpha in row-major order
    with pytest.raises(ValueError, match=r"alpha\[0, 0\] = inf"):
        agg(p, bad, n)
    with pytest.raises(ValueError, match=r"counts\[2\] = -1"):
        agg(p, bad, torch.tensor([1, 2, -1]))


def test_errors_types_and_devices():
    p, a, n = make_inputs(3, 2, (4,))
    with pytest.raises(TypeError, match="branch_params must be a floating"):
        branch_aggregate(p.to(torch.int64), a, n)
    with pytest.raises(TypeError, match="alpha must be a floating"):
        branch_aggregate(p, a.to(torch.int64), n)
    with pytest.raises(TypeError, match="counts must be an integer or floating"):
        branch_aggregate(p, a, n.to(torch.bool))
    with pytest.raises(TypeError, match="counts must be a torch.Tensor"):
        branch_aggregate(p, a, [1, 2, 3])
    with pytest.raises(ValueError, match="alpha must be on the device of branch_params"):
        branch_aggregate(p, a.to("meta"), n)


def test_errors_bad_out():
    p, a, n = make_inputs(3, 2, (4,))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        branch_aggregate(p, a, n, out=[0.0] * 8)
    with pytest.raises(TypeError, match=r"out must have the dtype of branch_params \(torch.float32\)"):
        branch_aggregate(p, a, n, out=torch.empty(2, 4, dtype=F64))
    with pytest.raises(ValueError, match=r"out must have shape \[2, 4\]"):
        branch_aggregate(p, a, n, out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="out must be on the device of branch_params"):
        branch_aggregate(p, a, n, out=torch.empty(2, 4, device="meta"))
    with pytest.raises(ValueError, match="out must not have elements that share memory"):
        branch_aggregate(p, a, n, out=torch.empty(4).expand(2, 4))
    with pytest.raises(RuntimeError, match="does not support autograd"):
        branch_aggregate(p.requires_grad_(), a, n, out=torch.empty(2, 4))
    with torch.no_grad():
        branch_aggregate(p, a, n, out=torch.empty(2, 4))  # fine without grad mode


def test_op_level_checks_without_the_wrapper():
    p, a, n = make_inputs(3, 2, (4,))
    with pytest.raises(ValueError, match="counts must have shape"):
        torch.ops.pfl.branch_aggregate(p, a, n[:2])
    with pytest.raises(ValueError, match="counts must be >= 0"):
        torch.ops.pfl.branch_aggregate(p, a, torch.tensor([1, -2, 3]))
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        torch.ops.pfl.branch_aggregate.out(p, -a, n, out=torch.empty(2, 4))


def test_op_level_out_checks_without_the_wrapper():
    p, a, n = make_inputs(3, 2, (4,))
    with pytest.raises(ValueError, match="out must have shape"):
        torch.ops.pfl.branch_aggregate.out(p, a, n, out=torch.empty(2, 5))
    with pytest.raises(TypeError, match="out must have branch_params' dtype"):
        torch.ops.pfl.branch_aggregate.out(p, a, n, out=torch.empty(2, 4, dtype=F64))
    with pytest.raises(ValueError, match="out must not have elements that share memory"):
        torch.ops.pfl.branch_aggregate.out(p, a, n, out=torch.empty(4).expand(2, 4))


def test_cpu_runs_the_cpp_kernel():
    if any(os.environ.get(v, "0") not in ("", "0") for v in ("PFL_KERNELS_SKIP_EXTENSION",
                                                              "PFL_KERNELS_DISABLE_EXTENSION")):
        pytest.skip("the C++ extension is switched off by the environment")
    info = pfl_kernels.backend_info()
    for op in ("pfl::branch_aggregate", "pfl::branch_aggregate.out"):
        assert info[op]["cpu"] == {"implementation": "cpp", "reason": ""}, op

"""weighted_average and reflection_weights on CPU (the C++ kernels when built) against float64."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import pfl_kernels
from pfl_kernels.ops import reflection_weights, weighted_average
from pfl_kernels.reference import aggregate as ref
from tests.threads import on_one_and_many_threads
from tests.tolerances import assert_close

F64 = torch.float64
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
SHAPES = [(1, 1, 1), (3, 5, 7), (20, 20, 333), (64, 70, 129), (150, 300, 65), (257, 1, 31)]
# The C++ kernel has three paths; each is forced in turn (the variable is read per call).
PATHS = ["auto", "sparse", "dense", "mm"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv("PFL_KERNELS_AGGREGATE_PATH", request.param)
    return request.param


def make(k, m, p, dtype, density=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(k, m, generator=g, dtype=F64) + 0.1
    if density < 1:
        w = w * (torch.rand(k, m, generator=g, dtype=F64) < density)
    w = w / w.sum(1, keepdim=True).clamp_min(1e-12)
    params = torch.randn(m, p, generator=g, dtype=F64).to(dtype)
    return w.float(), params


def expected(w, params):
    return ref.weighted_average(w.to(F64), params.to(F64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", [1.0, 0.05])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, density, dtype, path):
    w, params = make(*shape, dtype, density)
    out = weighted_average(w, params)
    assert out.dtype == dtype and out.shape == (shape[0], shape[2]) and out.is_contiguous()
    # bf16 inputs are exact in float64; the result is rounded once to bf16.
    assert_close(out, expected(w, params), dtype)


def test_weights_float64_with_float32_params_read_in_float32():
    w, params = make(5, 6, 17, torch.float32)
    assert_close(weighted_average(w.double(), params), expected(w, params), torch.float32)


def test_duplicated_rows_and_zero_rows(path):
    w, params = make(9, 8, 41, torch.float32)
    params[3] = params[1]
    params[5] = 0
    w[2] = 0  # a client with no weights gets zeros
    w[4] = w[0]
    out = weighted_average(w, params)
    assert_close(out, expected(w, params), torch.float32)
    assert torch.equal(out[2], torch.zeros(41))
    assert torch.equal(out[4], out[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_finite_row_only_reaches_clients_that_weight_it(bad, dtype, path):
    """A diverged client (NaN/Inf row) poisons exactly the clients with a nonzero weight on it."""
    k, m, p = 70, 66, 300
    w, params = make(k, m, p, dtype, density=0.2, seed=3)
    params[7, 100:105] = bad
    w[:, 7] = 0
    w[[0, 11, 69], 7] = 0.25
    out = weighted_average(w, params)
    hit = torch.zeros(k, dtype=torch.bool)
    hit[[0, 11, 69]] = True
    assert not torch.isfinite(out[hit][:, 100:105]).any()
    assert torch.isfinite(out[hit][:, :100]).all()
    clean = params.clone()
    clean[7] = 0
    assert_close(out[~hit], expected(w[~hit], clean), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_into_a_bank_slice(dtype, path):
    w, params = make(6, 9, 37, dtype, density=0.5)
    bank = torch.full((10, 50), 7.0, dtype=dtype)
    out = bank[2:8, 5:42]
    assert out.stride() == (50, 1)
    got = weighted_average(w, params, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, expected(w, params), dtype)
    untouched = torch.ones_like(bank, dtype=torch.bool)
    untouched[2:8, 5:42] = False
    assert (bank[untouched] == 7).all()


@pytest.mark.parametrize("density", [1.0, 0.3])
def test_out_aliasing_params_in_place(density, path):
    """bank <- W @ bank (out is params itself) equals the out-of-place result."""
    w, params = make(40, 40, 523, torch.float32, density)
    want = weighted_average(w, params)
    bank = params.clone()
    weighted_average(w, bank, out=bank)
    assert_close(bank, expected(w, params), torch.float32)
    if path in ("dense", "sparse"):  # the same loop as without overlap (auto/mm: BLAS there)
        assert torch.equal(bank, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("in_place", [False, True])
def test_many_column_blocks_with_a_non_finite_block(in_place, dtype, path):
    """P wide enough for many column blocks of the BLAS path (run in parallel; bf16: each block
    converted to float32 first): a NaN/Inf in one block is fixed there only, and in-place
    aggregation reads each block before writing it."""
    k, p = 7, 5000
    w, params = make(k, k, p, dtype, density=0.6, seed=5)
    params[2, 2345] = float("nan")
    params[4, 4990:] = float("inf")
    w[:, 2] = 0
    w[[1, 5], 2] = 0.5
    _check_with_non_finite_rows(w, params, in_place, dtype)


def _check_with_non_finite_rows(w, params, in_place, dtype):
    """weighted_average (into params itself when ``in_place``) against float64: NaN and Inf
    exactly where the reference has them, the finite values within dtype's tolerance."""
    want = expected(w, params)
    if in_place:
        got = params.clone()
        weighted_average(w, got, out=got)
    else:
        got = weighted_average(w, params)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert_close(got[fin], want[fin], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("in_place", [False, True])
def test_weights_beyond_the_cache_wide_blocks(in_place, dtype):
    """K = M = 1500 (9 MB of float32 weights, past the BLAS path's cache threshold): wide blocks
    (one block of all 300 columns here, not five of 64), with a NaN row some clients
    weight, still give the reference and keep the NaN to those clients."""
    k, p = 1500, 300
    w, params = make(k, k, p, dtype, seed=9)
    params[5, 3] = float("nan")
    params[5, 290] = float("nan")
    w[:, 5] = 0
    w[[2, 1499], 5] = 0.5
    _check_with_non_finite_rows(w, params, in_place, dtype)


def test_out_aliasing_rows_of_a_bank(path):
    """out and params are different row ranges of one bank (with the same column layout)."""
    bank = torch.randn(30, 200, dtype=torch.float64)
    w, _ = make(20, 25, 200, torch.float64, 0.4)
    params = bank[0:25]
    want = expected(w, params.clone())
    weighted_average(w, params, out=bank[5:25])
    assert_close(bank[5:25], want, torch.float64)


def test_out_aliasing_shifted_columns(path):
    """A column-shifted overlap is resolved by reading a copy of params: still exact."""
    bank = torch.randn(8, 120, dtype=torch.float64)
    w, _ = make(8, 8, 100, torch.float64)
    params = bank[:, 0:100]
    want = expected(w, params.clone())
    weighted_average(w, params, out=bank[:, 7:107])
    assert_close(bank[:, 7:107], want, torch.float64)


def test_non_contiguous_params_and_weights(path):
    w, params = make(12, 10, 63, torch.float32, 0.5)
    pt = torch.empty(63, 10).t()
    pt.copy_(params)
    wt = torch.empty(10, 12).t()
    wt.copy_(w)
    assert_close(weighted_average(wt, pt), expected(w, params), torch.float32)


def test_empty_shapes():
    assert weighted_average(torch.rand(0, 3), torch.randn(3, 5)).shape == (0, 5)
    assert weighted_average(torch.rand(2, 3), torch.randn(3, 0)).shape == (2, 0)
    assert torch.equal(weighted_average(torch.rand(2, 0), torch.randn(0, 4)), torch.zeros(2, 4))


def test_deterministic_across_thread_counts(path):
    w, params = make(50, 60, 4099, torch.float32, 0.3)
    one, many = on_one_and_many_threads(lambda: weighted_average(w, params))
    assert torch.equal(one, many)


@pytest.mark.parametrize("density", [1.0, 0.4])
def test_gradcheck(density):
    w, params = make(5, 4, 9, F64, density)
    w = w.double().requires_grad_()
    params = params.requires_grad_()
    assert torch.autograd.gradcheck(weighted_average, (w, params))


def test_gradients_match_reference_bf16():
    w, params = make(6, 5, 33, torch.bfloat16)
    w.requires_grad_()
    params.requires_grad_()
    g = torch.randn(6, 33)
    weighted_average(w, params).backward(g.bfloat16())
    w64, p64 = w.detach().double().requires_grad_(), params.detach().double().requires_grad_()
    (w64 @ p64).backward(g.bfloat16().double())
    assert w.grad.dtype == torch.float32 and params.grad.dtype == torch.bfloat16
    assert_close(w.grad, w64.grad, torch.bfloat16)
    assert_close(params.grad, p64.grad, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck(dtype):
    w, params = make(4, 6, 11, dtype, 0.5)
    # The overloads one at a time (opcheck refuses a packet with two).
    torch.library.opcheck(torch.ops.pfl.weighted_average.default, (w.to(dtype).requires_grad_(), params.requires_grad_()))
    # torch cannot functionalize a custom op that returns an alias (Tensor(a!)), so the out
    # overload (schema as in torch's out= convention) is checked without aot_dispatch.
    torch.library.opcheck(torch.ops.pfl.weighted_average.out, (w.detach(), params.detach()),
                          {"out": torch.empty(4, 11, dtype=dtype)},
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile_matches_eager():
    w, params = make(5, 7, 19, torch.float32)
    # Not fullgraph: the wrapper's NaN/Inf check of weights reads values (a graph break).
    fn = torch.compile(weighted_average, backend="aot_eager")
    assert_close(fn(w, params), expected(w, params), torch.float32)


def test_error_shape_mismatch():
    with pytest.raises(ValueError, match=r"params must be \[M=3, P\]"):
        weighted_average(torch.rand(2, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match="weights must be"):
        weighted_average(torch.rand(3), torch.randn(3, 5))
    with pytest.raises(ValueError, match="params must be"):
        weighted_average(torch.rand(2, 3), torch.randn(3))


def test_error_non_finite_weights():
    for bad in (float("nan"), float("inf")):
        w = torch.rand(3, 4)
        w[1, 2] = bad
        with pytest.raises(ValueError, match="weights must be finite"):
            weighted_average(w, torch.randn(4, 5))


def test_error_non_finite_weights_at_op_level():
    w = torch.rand(3, 4)
    w[0, 0] = float("nan")
    if pfl_kernels.ops._library.has_kernel("pfl::weighted_average", "CPU"):
        with pytest.raises(ValueError, match="weights must be finite"):
            torch.ops.pfl.weighted_average(w, torch.randn(4, 5))


def test_error_dtypes_and_devices():
    with pytest.raises(TypeError, match="weights must be a floating"):
        weighted_average(torch.ones(2, 3, dtype=torch.int64), torch.randn(3, 4))
    with pytest.raises(TypeError, match="params must be a floating"):
        weighted_average(torch.rand(2, 3), torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="device"):
        weighted_average(torch.rand(2, 3, device="meta"), torch.randn(3, 4))


def test_error_bad_out():
    w, p = torch.rand(2, 3), torch.randn(3, 4)
    with pytest.raises(TypeError, match="out must have the dtype of params"):
        weighted_average(w, p, out=torch.empty(2, 4, dtype=F64))
    with pytest.raises(ValueError, match=r"out must have shape \[2, 4\]"):
        weighted_average(w, p, out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="unit stride"):
        weighted_average(w, p, out=torch.empty(2, 8)[:, ::2])
    with pytest.raises(ValueError, match="rows overlap"):
        weighted_average(w, p, out=torch.empty(4).expand(2, 4))
    with pytest.raises(RuntimeError, match="does not support autograd"):
        weighted_average(w.requires_grad_(), p, out=torch.empty(2, 4))


def test_error_op_level_checks_without_the_wrapper():
    with pytest.raises(ValueError, match="params must have M=3"):
        torch.ops.pfl.weighted_average(torch.rand(2, 3), torch.randn(4, 5))


def test_cpu_runs_the_cpp_kernels():
    if any(os.environ.get(v, "0") not in ("", "0") for v in ("PFL_KERNELS_SKIP_EXTENSION",
                                                              "PFL_KERNELS_DISABLE_EXTENSION")):
        pytest.skip("the C++ extension is switched off by the environment")
    info = pfl_kernels.backend_info()
    for op in ("pfl::weighted_average", "pfl::weighted_average.out"):
        assert info[op]["cpu"] == {"implementation": "cpp", "reason": ""}, op


# ---------------------------------------------------------------- reflection_weights (SimFed Eq. 8)

def test_reflection_is_simfed_eq8():
    g = torch.Generator().manual_seed(1)
    k, p = 6, 23
    a = torch.softmax(torch.randn(k, k, generator=g, dtype=F64), -1) * 0.7
    a[:, 2] = 0  # a client nobody selects
    theta = torch.randn(k, p, generator=g, dtype=F64)
    want = theta + torch.stack([(a[i, :, None] * (theta - theta[i])).sum(0) for i in range(k)])
    w = reflection_weights(a)
    assert_close(w.sum(1), torch.ones(k, dtype=F64), F64)
    assert_close(weighted_average(w, theta), want, F64)


def test_reflection_with_self_index_and_grad():
    a = torch.rand(3, 5, dtype=F64, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its finiteness check reads a tensor that requires grad: no warning
        w = reflection_weights(a, self_index=idx)
    want = a.detach().clone()
    for i, j in enumerate(idx.tolist()):
        want[i, j] += 1 - a[i].sum().item()
    assert_close(w, want, F64)
    assert torch.autograd.gradcheck(lambda x: reflection_weights(x, self_index=idx), (a,))


def test_reflection_errors():
    with pytest.raises(ValueError, match="not square"):
        reflection_weights(torch.rand(2, 3))
    for value in (float("nan"), float("inf"), -float("inf")):  # one value among finite ones
        attention = torch.rand(3, 4)
        attention[2, 1] = value
        with pytest.raises(ValueError, match="attention must be finite"):
            reflection_weights(attention, self_index=torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="self_index must be an integer"):
        reflection_weights(torch.rand(2, 3), self_index=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"self_index must have shape \[2\]"):
        reflection_weights(torch.rand(2, 3), self_index=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"columns in \[0, 3\)"):
        reflection_weights(torch.rand(2, 3), self_index=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="attention must be"):
        reflection_weights(torch.rand(3))
    with pytest.raises(TypeError, match="attention must be a floating"):
        reflection_weights(torch.ones(2, 2, dtype=torch.int64))

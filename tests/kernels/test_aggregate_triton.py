"""The Triton weighted_average kernels (dense tl.dot tiles, sparse gather) against float64.

In the Triton interpreter or on a CUDA device, skipped otherwise (see ``triton_support.py``):

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_aggregate_triton.py -q -m triton_interpret
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import (
    DEVICE, F64, MARKS, RUNNABLE, assert_registered_for_cuda, gpu_only, interpreter_only, launchers_as_cpu_kernels)
from tests.tolerances import assert_close

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels.reference import aggregate as ref
    from pfl_kernels.triton import aggregate as ta

SHAPES = [(1, 1, 1), (3, 5, 7), (20, 17, 33), (5, 40, 70)]


@pytest.fixture(params=["dense", "sparse", "gemm"])
def path(request, monkeypatch):
    """Force a path through the density threshold (dense: never sparse; sparse: always) and
    the routing of dense weights (dense: the Triton kernel, also on a GPU; gemm: the cuBLAS
    form, also in the interpreter)."""
    monkeypatch.setattr(ta, "_SPARSE_DENSITY", 2.0 if request.param == "sparse" else 0.0)
    monkeypatch.setattr(ta, "_GEMM_DEVICES", ("cuda", "cpu") if request.param == "gemm" else ())
    return request.param


@pytest.fixture(params=["default-blocks", "small-blocks"])
def blocks(request, monkeypatch):
    """Default tiles, or the smallest ones so that K, M and P span several blocks."""
    if request.param == "small-blocks":
        monkeypatch.setattr(ta, "_MAX_BLOCK_K", 16)
        monkeypatch.setattr(ta, "_BLOCK_M", 16)
        monkeypatch.setattr(ta, "_BLOCK_P", 16)
        monkeypatch.setattr(ta, "_SPARSE_BLOCK_P", 16)
        monkeypatch.setattr(ta, "_SPARSE_BLOCK_E", 2)  # a row's kept clients over several steps
        monkeypatch.setattr(ta, "_COMPACT_BLOCK", 4)  # a row of weights compacted over several steps
    return request.param


def make(k, m, p, dtype=torch.float32, density=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(k, m, generator=g, dtype=F64) + 0.1
    if density < 1:
        w = w * (torch.rand(k, m, generator=g, dtype=F64) < density)
    w = w / w.sum(1, keepdim=True).clamp_min(1e-12)
    params = torch.randn(m, p, generator=g, dtype=F64).to(dtype)
    return w.float().to(DEVICE), params.to(DEVICE)


def expected(w, params):
    return ref.weighted_average(w.to(F64), params.to(F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("density", [1.0, 0.3])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, density, dtype, path, blocks):
    w, params = make(*shape, dtype, density)
    out = ta.weighted_average_triton(w, params)
    assert out.dtype == dtype and tuple(out.shape) == (shape[0], shape[2]) and out.is_contiguous()
    assert_close(out, expected(w, params), dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_row_only_reaches_clients_that_weight_it(bad, path, blocks):
    k, m, p = 20, 18, 40
    w, params = make(k, m, p, density=0.5, seed=3)
    params[7, 10:15] = bad
    w[:, 7] = 0
    w[[0, 11, 19], 7] = 0.25
    out = ta.weighted_average_triton(w, params)
    hit = torch.zeros(k, dtype=torch.bool, device=DEVICE)
    hit[[0, 11, 19]] = True
    assert not torch.isfinite(out[hit][:, 10:15]).any()
    assert torch.isfinite(out[hit][:, :10]).all() and torch.isfinite(out[hit][:, 15:]).all()
    clean = params.clone()
    clean[7] = 0
    assert_close(out[~hit], expected(w[~hit], clean), torch.float32)
    if bad != bad:  # NaN: the same positions as the reference
        assert torch.equal(torch.isnan(out), torch.isnan(expected(w, params)))


def test_out_into_a_bank_slice(path, blocks):
    w, params = make(6, 9, 37, density=0.5)
    bank = torch.full((10, 50), 7.0, device=DEVICE)
    out = bank[2:8, 5:42]
    got = ta.weighted_average_out_triton(w, params, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, expected(w, params), torch.float32)
    untouched = torch.ones_like(bank, dtype=torch.bool)
    untouched[2:8, 5:42] = False
    assert (bank[untouched] == 7).all()


@pytest.mark.parametrize("k", [12, 40])  # one K-block (read in place) and several (copied)
def test_out_aliasing_params_in_place(k, path, blocks):
    w, params = make(k, k, 53, density=0.6, seed=1)
    want = expected(w, params)
    bank = params.clone()
    ta.weighted_average_out_triton(w, bank, out=bank)
    assert_close(bank, want, torch.float32)


def test_out_aliasing_rows_and_shifted_columns(path, blocks):
    bank = torch.randn(30, 120, dtype=F64, device=DEVICE)
    w, _ = make(20, 25, 100, F64, 0.4)
    params = bank[0:25, 0:100]
    want = expected(w, params.clone())
    ta.weighted_average_out_triton(w, params, out=bank[5:25, 0:100])  # other rows of one bank
    assert_close(bank[5:25, 0:100], want, F64)
    bank = torch.randn(30, 120, dtype=F64, device=DEVICE)
    params = bank[0:25, 0:100]
    want = expected(w, params.clone())
    ta.weighted_average_out_triton(w, params, out=bank[3:23, 7:107])  # shifted columns: copied
    assert_close(bank[3:23, 7:107], want, F64)


def test_helpers_detect_overlap():
    bank = torch.zeros(10, 20, device=DEVICE)
    assert ta.may_overlap(bank[0:5], bank[4:9]) and not ta.may_overlap(bank[0:4], bank[4:9])
    assert ta._rows_of(bank[2:6], bank) and not ta._rows_of(bank[2:6, 1:], bank[:, :19])
    assert not ta.may_overlap(bank, torch.zeros(10, 20, device=DEVICE))


def test_strided_params_and_weights(path, blocks):
    w, params = make(12, 10, 63, density=0.5)
    pt = torch.empty(63, 10, device=DEVICE).t()
    pt.copy_(params)
    wt = torch.empty(10, 12, device=DEVICE).t()
    wt.copy_(w)
    rows = torch.empty(10, 80, device=DEVICE)[:, 5:68]
    rows.copy_(params)
    assert_close(ta.weighted_average_triton(wt, pt), expected(w, params), torch.float32)
    assert_close(ta.weighted_average_triton(w, rows), expected(w, params), torch.float32)


def test_float64_weights_with_float32_params(path):
    w, params = make(5, 6, 17)
    assert_close(ta.weighted_average_triton(w.double(), params), expected(w, params), torch.float32)


def test_empty_and_zero_rows(path):
    assert tuple(ta.weighted_average_triton(torch.rand(0, 3, device=DEVICE),
                                            torch.randn(3, 5, device=DEVICE)).shape) == (0, 5)
    assert tuple(ta.weighted_average_triton(torch.rand(2, 3, device=DEVICE),
                                            torch.randn(3, 0, device=DEVICE)).shape) == (2, 0)
    zeros = ta.weighted_average_triton(torch.rand(2, 0, device=DEVICE), torch.randn(0, 4, device=DEVICE))
    assert torch.equal(zeros, torch.zeros(2, 4, device=DEVICE))
    w, params = make(6, 6, 19)
    w[2] = 0  # a client with no weights gets zeros
    out = ta.weighted_average_triton(w, params)
    assert torch.equal(out[2], torch.zeros(19, device=DEVICE))


def test_non_finite_weights_raise():
    w = torch.rand(3, 4, device=DEVICE)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="weights must be finite"):
        ta.weighted_average_triton(w, torch.randn(4, 5, device=DEVICE))


@pytest.mark.parametrize("block", [1024, 4, 1], ids=["one-step", "several-steps", "one-column-steps"])
def test_compact_puts_each_rows_nonzeros_first_with_the_stats(block, monkeypatch):
    """Every row's nonzero weights in column order at the front of its row (a row spanning
    several steps of the compaction), each row's count and NaN/Inf; -0.0 is zero, NaN and
    ±Inf are kept and counted."""
    monkeypatch.setattr(ta, "_COMPACT_BLOCK", block)
    g = torch.Generator().manual_seed(3)
    w = torch.rand(5, 11, generator=g, dtype=F64) * (torch.rand(5, 11, generator=g) < 0.4)
    w[1] = 0.0
    w[2, 3], w[3, 0], w[3, 10], w[4, 5] = -0.0, float("nan"), float("inf"), -float("inf")
    w[4, 6] = 1.0
    cols, vals, stats, flag = ta._compact(w.to(DEVICE), flag=True)
    nonzero = w != 0
    assert stats.dtype == torch.int32 and stats.tolist() == [nonzero.sum(1).tolist(), (~w.isfinite()).sum(1).tolist()]
    assert flag.dtype == torch.int32 and flag.tolist() == [int((~w.isfinite()).sum())]
    assert ta._compact(w.to(DEVICE)).flag is None
    for k in range(5):
        n = int(nonzero[k].sum())
        want = nonzero[k].nonzero().flatten()
        assert cols.dtype == torch.int32 and cols[k, :n].tolist() == want.tolist()
        torch.testing.assert_close(vals[k, :n].cpu(), w[k, want], rtol=0, atol=0, equal_nan=True)
    assert stats[0, 1] == 0  # an all-zero row keeps nothing


def test_compact_of_empty_weights():
    for shape in [(0, 4), (3, 0), (0, 0)]:
        cols, vals, stats, flag = ta._compact(torch.empty(shape, device=DEVICE), flag=True)
        assert cols.shape == vals.shape == shape and stats.shape == (2, shape[0])
        assert stats.tolist() == [[0] * shape[0]] * 2 and flag.tolist() == [0]


@interpreter_only
def test_through_dispatcher_and_autograd(path):
    """The launchers as the CPU kernels of the op, under the wrapper and autograd (the
    backward's grad_params is itself a weighted_average)."""
    from pfl_kernels.ops import weighted_average

    w, params = make(5, 6, 9, torch.float32, 0.6, seed=4)
    leaves = [t.clone().requires_grad_(True) for t in (w, params)]
    ref_leaves = [t.double().requires_grad_(True) for t in (w, params)]
    g = torch.randn(5, 9)
    with launchers_as_cpu_kernels({"weighted_average": ta.weighted_average_triton,
                                   "weighted_average.out": ta.weighted_average_out_triton}):
        out = weighted_average(*leaves)
        out.backward(g)
        into = torch.empty(5, 9)
        weighted_average(w, params, out=into)
    want = ref_leaves[0] @ ref_leaves[1]
    want.backward(g.double())
    assert_close(out, want, torch.float32)
    assert_close(into, want, torch.float32)
    for name, a, b in zip(("weights", "params"), leaves, ref_leaves):
        assert_close(a.grad, b.grad, torch.float32, f"grad of {name}")


def test_registered_for_cuda():
    assert_registered_for_cuda(("weighted_average", "weighted_average.out"))


@gpu_only
@pytest.mark.parametrize("density", [1.0, 0.05])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_dtypes(dtype, density):
    w, params = make(100, 100, 4099, dtype, density, seed=5)
    out = torch.ops.pfl.weighted_average(w, params)
    assert out.dtype == dtype
    assert_close(out, expected(w, params), dtype)


@gpu_only
def test_gpu_large_offsets_and_nan():
    """Rows of params starting past 2^31 elements (int64 addressing), one with a NaN."""
    w, params = make(5, 5, 7, seed=6)
    big = torch.zeros(5, (1 << 29) + 7, device=DEVICE)  # 10.7 GB: row 4 starts past 2^31
    big[:, -7:] = params
    big[4, -3] = float("nan")
    w[0, 4] = 0
    for density in (0.0, 2.0):  # dense and sparse kernels (not the GEMM form)
        ta._SPARSE_DENSITY, ta._GEMM_DEVICES = density, ()
        try:
            out = torch.ops.pfl.weighted_average(w, big)
        finally:
            ta._SPARSE_DENSITY, ta._GEMM_DEVICES = 0.3, ("cuda",)
        assert torch.isfinite(out[0]).all() and torch.isnan(out[1:, -3]).all()
        assert_close(out[0, -7:], expected(w, params)[0], torch.float32)
    del big


@gpu_only
def test_gpu_opcheck_and_gradcheck():
    w, params = make(4, 6, 11, F64, 0.5, seed=7)
    # make() gives float32 weights (what callers pass), whose gradient the op returns in
    # float32: gradcheck needs float64 for both, or it compares float32-rounded Jacobians.
    w = w.to(F64)
    torch.library.opcheck(torch.ops.pfl.weighted_average.default, (w.requires_grad_(), params.requires_grad_()))
    torch.library.opcheck(torch.ops.pfl.weighted_average.out, (w.detach(), params.detach()),
                          {"out": torch.empty(4, 11, dtype=F64, device=DEVICE)},
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert torch.autograd.gradcheck(torch.ops.pfl.weighted_average, (w, params))


@pytest.mark.parametrize("density", [1.0, 0.05], ids=["gemm", "sparse"])
def test_repeated_signature_gives_first_call_numbers_and_keeps_a_refused_out(density, monkeypatch):
    """A signature's later calls launch its last path before the weights' stats are read
    (through ``read_early``; on a GPU the host does not wait for that launch): the numbers are
    a first call's, and ``out=`` stays as it was when the weights are then refused (the sparse
    kernel is guarded on the device, the GEMM waits for the check)."""
    monkeypatch.setattr(ta, "_LAST_PATH", {})
    monkeypatch.setattr(ta, "_GEMM_DEVICES", ("cuda", "cpu"))  # the interpreter's tensors take the GEMM too
    w, params = make(40, 40, 1031, density=density, seed=8)
    first = ta.weighted_average_triton(w, params)
    again = [ta.weighted_average_triton(w, params) for _ in range(2)]
    out = torch.full_like(first, 7.0)
    again.append(ta.weighted_average_out_triton(w, params, out=out))
    for result in again:  # cuBLAS on one stream, or the sparse kernel: the same bits
        assert torch.equal(result, first)
    assert_close(first, expected(w, params), torch.float32)
    bad = w.clone()
    bad[tuple(bad.nonzero()[-1])] = float("nan")
    out.fill_(7.0)
    with pytest.raises(ValueError, match="weights must be finite"):
        ta.weighted_average_out_triton(bad, params, out=out)
    assert bool((out == 7.0).all())


def test_early_read_gives_the_values():
    from pfl_kernels.triton._early_read import read_early

    x = torch.arange(5, device=DEVICE, dtype=torch.int32)
    read = read_early(x * 2)
    x += 100  # later work on the device does not change what was read
    assert read.tolist() == [0, 2, 4, 6, 8]
    assert read_early(torch.empty(0, 2, dtype=torch.int64, device=DEVICE)).tolist() == []


@gpu_only
def test_gpu_early_read_does_not_wait_for_later_kernels():
    """The host waits for the copy's event only: a long kernel queued after it is still
    running when ``tolist`` returns."""
    from pfl_kernels.triton._early_read import read_early

    read = read_early(torch.arange(3, device=DEVICE) + 1)
    torch.cuda._sleep(200_000_000)  # about 0.1 s of one SM's cycles, queued behind the copy
    assert read.tolist() == [1, 2, 3]
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running


@pytest.mark.parametrize("density", [1.0, 0.05], ids=["dense-weights", "sparse-weights"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_kernel_at_float32_accuracy_with_extreme_values(dtype, density, monkeypatch):
    """The dense kernel (3xTF32 dots on a GPU) against float64 at float32's tolerance, with
    magnitudes over six decades and a float32 maximum, which a TF32 split may round to Inf:
    its column is summed again exactly, so the result stays finite and right."""
    monkeypatch.setattr(ta, "_PATH_OVERRIDE", "dense")
    k, m, p = 100, 100, 1031
    w, params = make(k, m, p, density=density, seed=9)
    params = (params.float() * torch.logspace(-3, 3, p, device=DEVICE)).to(dtype)
    if dtype == torch.float32:
        params[3, 5] = torch.finfo(torch.float32).max
        w[:, 3] = w[:, 3].clamp_max(0.5)
    out = ta.weighted_average_triton(w, params)
    want = expected(w, params)
    assert torch.isfinite(want).all()
    assert_close(out, want, dtype)

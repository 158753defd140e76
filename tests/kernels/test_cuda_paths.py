"""The faster path per shape on CUDA (issue 30, item 2), checked on the CPU: the routing rules
(``cuda_path``, ``cuda_pairwise_path``) and the routed GEMM form of ``weighted_average``, which
is written for any device, against the float64 reference, NaN/Inf/extreme rows and empty
shapes included.

(``test_cuda_paths_triton.py`` checks that the Triton wrappers route to them; the pairwise GEMM
form ends in a Triton epilogue: ``test_similarity_triton.py`` runs its cases on it too.)
"""
from __future__ import annotations

import math

import pytest
import torch

from pfl_kernels.ops import aggregate as agg
from pfl_kernels.ops import similarity as sim
from pfl_kernels.reference import aggregate as ref_agg
from tests.tolerances import assert_close

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


# ---------------------------------------------------------------- routing

def test_weighted_average_path():
    # dense weights: the GEMM (the dense kernel lost 55x to torch.mm on an H200)
    assert agg.cuda_path(100, 100, 100 * 100, F32, tf32=False) == "gemm"
    assert agg.cuda_path(100, 100, 3000, BF16, tf32=False) == "gemm"  # density 0.3: not sparse
    assert agg.cuda_path(100, 100, 2999, F32, tf32=False) == "sparse"
    assert agg.cuda_path(100, 100, 500, F64, tf32=False) == "sparse"
    # TF32 allowed: the ieee kernel keeps float32 accumulation; float64 is never TF32
    assert agg.cuda_path(100, 100, 10_000, F32, tf32=True) == "dense"
    assert agg.cuda_path(100, 100, 10_000, F64, tf32=True) == "gemm"
    assert agg.cuda_path(4, 4, 0, F32, tf32=False, sparse_density=0.0) == "gemm"
    assert agg.cuda_path(0, 0, 0, F32, tf32=False) == "gemm"


def test_pairwise_path():
    d = sim.GEMM_MIN_DIM
    assert d == 65_536
    assert sim.cuda_pairwise_path(d, F32, tf32=False) == "gemm"
    assert sim.cuda_pairwise_path(10_000_000, F32, tf32=False) == "gemm"
    assert sim.cuda_pairwise_path(d - 1, F32, tf32=False) == "triton"
    assert sim.cuda_pairwise_path(d, F32, tf32=True) == "triton"
    assert sim.cuda_pairwise_path(d, BF16, tf32=False) == "triton"
    assert sim.cuda_pairwise_path(d, torch.float16, tf32=False) == "triton"
    assert sim.cuda_pairwise_path(3, F64, tf32=False) == "reference"


def test_python_m_pfl_kernels_says_which_path_serves_which_shapes():
    from pfl_kernels.__main__ import format_cuda_paths

    text = format_cuda_paths()
    assert "weighted_average" in text and "gemm" in text and "65536" in text and "pairwise_cosine" in text
    assert "Triton launches in eager mode: " in text


def test_python_m_pfl_kernels_says_how_triton_kernels_are_launched(monkeypatch):
    from pfl_kernels.__main__ import direct_launch_state
    from pfl_kernels.triton import _direct

    monkeypatch.setattr(_direct, "REASON", None)
    monkeypatch.setattr(_direct, "ENABLED", True)
    assert direct_launch_state().startswith("direct")
    monkeypatch.setattr(_direct, "ENABLED", False)
    assert direct_launch_state().startswith("through Triton's launcher (PFL_KERNELS_DIRECT_LAUNCH=0")
    monkeypatch.setattr(_direct, "REASON", "no triton (x)")
    assert direct_launch_state() == "through Triton's launcher (no triton (x))"


def test_python_m_pfl_kernels_says_whether_eager_calls_skip_the_dispatcher(monkeypatch):
    from pfl_kernels.__main__ import dispatch_bypass_state, format_cuda_paths
    from pfl_kernels.ops import _eager

    assert "Functional ops in plain eager mode: " in format_cuda_paths()
    monkeypatch.setattr(_eager, "ENABLED", True)
    assert dispatch_bypass_state().startswith("the CUDA launcher called directly")
    monkeypatch.setattr(_eager, "ENABLED", False)
    assert dispatch_bypass_state() == "through the dispatcher (PFL_KERNELS_DISPATCH_BYPASS=0)"


# ---------------------------------------------------------------- weighted_average

def bank(k, m, p, dtype=F32, density=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(k, m, generator=g, dtype=F64) + 0.1
    if density < 1:
        w = w * (torch.rand(k, m, generator=g, dtype=F64) < density)
    w = (w / w.sum(1, keepdim=True).clamp_min(1e-12)).float()
    params = torch.randn(m, p, generator=g, dtype=F64).to(dtype)
    return w, params


def want(w, params):
    return ref_agg.weighted_average(w.to(F64), params.to(F64))


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (20, 17, 33), (100, 100, 257)], ids=str)
def test_gemm_weighted_average_matches_the_reference(shape, dtype):
    w, params = bank(*shape, dtype, density=0.6)
    out = agg.gemm_weighted_average(w, params)
    assert out.dtype == dtype and list(out.shape) == [shape[0], shape[2]] and out.is_contiguous()
    assert_close(out, want(w, params), dtype)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("first_row_weights_it", [False, True])
def test_a_non_finite_row_only_reaches_clients_that_weight_it(bad, first_row_weights_it):
    k, m, p = 6, 5, 9
    w, params = bank(k, m, p, seed=1)
    params[2, 3] = bad
    params[4] = bad  # a whole diverged client
    w[:, 2] = 0
    w[:, 4] = 0
    w[[1, 3], 2] = 0.5
    w[5, 4] = 0.25
    if first_row_weights_it:
        w[0, 2] = 0.5
    expected = want(w, params)
    got = agg.gemm_weighted_average(w, params)
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert (finite.all(1).tolist() == [not first_row_weights_it, False, True, False, True, False])
    assert_close(got[finite], expected[finite], F32)


def test_an_overflowing_sum_is_inf_as_in_the_reference():
    w = torch.tensor([[1.0, 1.0], [0.5, 0.0]])
    params = torch.tensor([[3e38, 1.0], [3e38, 2.0]])
    got = agg.gemm_weighted_average(w, params)
    expected = ref_agg.weighted_average(w, params)
    assert torch.equal(got, expected) and torch.isinf(got[0, 0]) and got[1, 0] == 1.5e38


@pytest.mark.parametrize("shape", [(0, 4, 5), (3, 0, 5), (3, 4, 0), (0, 0, 0)], ids=str)
def test_empty(shape):
    w, params = bank(*shape)
    got = agg.gemm_weighted_average(w, params)
    assert list(got.shape) == [shape[0], shape[2]]
    assert torch.equal(got, ref_agg.weighted_average(w, params))
    out = torch.full((shape[0], shape[2]), 7.0)
    assert agg.gemm_weighted_average(w, params, out) is out and torch.equal(out, got)


def test_out_into_a_bank_slice():
    w, params = bank(4, 6, 10)
    big = torch.full((4, 16), -1.0)
    out = big[:, 3:13]
    assert agg.gemm_weighted_average(w, params, out) is out
    assert_close(out, want(w, params), F32)
    assert (big[:, :3] == -1).all() and (big[:, 13:] == -1).all()


@pytest.mark.parametrize("with_nan", [False, True])
def test_out_overlapping_params_in_place(with_nan):
    """bank <- W @ bank, also when a row of the bank is NaN (the fix-up re-reads params)."""
    w, bank_ = bank(5, 5, 11, seed=2)
    if with_nan:
        bank_[1, 4] = math.nan
        w[:, 1] = 0
        w[3, 1] = 0.5
    expected = want(w, bank_)
    assert agg.gemm_weighted_average(w, bank_, bank_) is bank_
    assert torch.equal(torch.isnan(bank_), torch.isnan(expected))
    assert_close(bank_[~torch.isnan(expected)], expected[~torch.isnan(expected)], F32)


def test_bfloat16_params_and_float64_weights():
    w, params = bank(7, 9, 13, BF16)
    got = agg.gemm_weighted_average(w.double(), params)
    assert got.dtype == BF16
    assert_close(got, want(w, params), BF16)


# ---------------------------------------------------------------- pairwise similarity

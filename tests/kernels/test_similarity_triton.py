"""The Triton similarity kernels against the float64 reference.

In the Triton interpreter or on a CUDA device, skipped otherwise (see ``triton_support.py``):

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_similarity_triton.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import (
    DEVICE, F64, MARKS, RUNNABLE, assert_registered_for_cuda, gpu_only, launchers_as_cpu_kernels)
from tests.tolerances import assert_close

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels.ops import pairwise_cosine, pairwise_sqdist, similarity_weights
    from pfl_kernels.reference import similarity as ref
    from pfl_kernels.triton import similarity as ts
    from tests.kernels import similarity_cases as extreme


@pytest.fixture(params=["default-tiles", "small-tiles", "gemm-form"])
def tiles(request, monkeypatch):
    """Default tiles, or 16 x 16 x 16 tiles so that the shapes below span several tiles of
    every dimension and D is split over several programs (partials summed in the epilogue), or
    float32 rows of every length routed to the GEMM form (``_gemm_pairwise``: cuBLAS's product
    and one epilogue launch) with 16 x 16 epilogue tiles, so that a tile with an extreme row
    sits among ordinary ones."""
    if request.param == "small-tiles":
        for name in ("_BLOCK_K", "_BLOCK_M", "_BLOCK_D"):
            monkeypatch.setattr(ts, name, 16)
    if request.param == "gemm-form":
        from pfl_kernels.ops import similarity as ops

        monkeypatch.setattr(ops, "GEMM_MIN_DIM", 0)
        monkeypatch.setattr(ts, "_GEMM_DEVICES", (torch.device(DEVICE).type,))
        monkeypatch.setattr(ts, "_GEMM_BLOCK", 16)
        monkeypatch.setattr(ts, "_BLOCK_D", 16)
    return request.param


def rows(k, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, d, generator=g, dtype=F64).to(DEVICE, dtype)


def check_pair(x, y):
    xe, ye = x.to(F64), None if y is None else y.to(F64)
    c = ts.pairwise_cosine_triton(x, y, 1e-8)
    assert c.dtype == torch.float32
    assert_close(c, ref.pairwise_cosine(xe, ye, 1e-8), torch.float32, "cosine")
    s = ts.pairwise_sqdist_triton(x, y)
    want = ref.pairwise_sqdist(xe, ye)
    sx = xe.pow(2).sum(1)
    sy = sx if ye is None else ye.pow(2).sum(1)
    err = ((s.to(F64) - want).abs() / (sx[:, None] + sy[None, :] + 1e-300)).max()
    assert err <= 4e-6, f"sqdist error {float(err):.3e} relative to the norms"
    assert (s >= 0).all()
    if y is None:
        assert torch.equal(c, c.t()) and torch.equal(s, s.t())
        assert (s.diagonal() == 0).all()
    return c, s


@pytest.mark.parametrize("with_y", [False, True], ids=["y=None", "y"])
@pytest.mark.parametrize("k, m, d", [(1, 1, 1), (3, 5, 7), (17, 9, 33), (40, 35, 70)])
def test_pairwise(k, m, d, with_y, tiles):
    x = rows(k, d)
    check_pair(x, rows(m, d, seed=1) if with_y else None)


def test_split_over_d(monkeypatch):
    monkeypatch.setattr(ts, "_BLOCK_D", 16)
    assert ts._split(2, 2, 1000, torch.device("cpu")) == 63  # capped by D / BLOCK_D
    assert ts._split(2000, 2000, 10 ** 6, torch.device("cpu")) == 1  # enough tiles already
    check_pair(rows(3, 1000), rows(2, 1000, seed=2))


def test_zero_rows_and_strides(tiles):
    x = rows(8, 2 * 21)[:, ::2]
    x[3] = 0
    c, s = check_pair(x, None)
    assert (c[3] == 0).all() and (c[:, 3] == 0).all()
    check_pair(x, rows(21, 5, seed=3).t())


def test_float64_uses_the_reference():
    x = rows(4, 9, dtype=F64)
    assert_close(ts.pairwise_cosine_triton(x, None, 1e-8), ref.pairwise_cosine(x, None, 1e-8), F64)


def test_empty():
    assert ts.pairwise_cosine_triton(rows(0, 4), rows(3, 4), 1e-8).shape == (0, 3)


# The first pass's unscaled product overflows on 1e19 rows (numpy says so in the interpreter);
# the second pass redoes those tiles.
expected_overflow = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                               "ignore:invalid value encountered:RuntimeWarning")


@expected_overflow
@pytest.mark.parametrize("with_y", [False, True], ids=["y=None", "y"])
def test_extreme_rows(with_y, tiles):
    """NaN, ±Inf, 1e19, 1e-30 and zero rows (issue 13, item 4): the exact values, NaN exactly
    at the non-finite rows' rows and columns (own entries included)."""
    x, y = extreme.inputs(torch.float32, with_y)
    x, y = x.to(DEVICE), None if y is None else y.to(DEVICE)
    for eps in (1e-8, extreme.TINY_EPS[torch.float32]):
        extreme.assert_cosine_exact(ts.pairwise_cosine_triton(x, y, eps), x.cpu(), None if y is None else y.cpu(),
                                    eps, f"cosine eps={eps}")
    d = ts.pairwise_sqdist_triton(x, y)
    extreme.assert_sqdist_exact(d, x.cpu(), None if y is None else y.cpu(), "sqdist")
    if y is None:
        finite = torch.isfinite(x).all(1)
        assert (d.diagonal()[finite] == 0).all() and torch.isnan(d.diagonal()[~finite]).all()
        c = ts.pairwise_cosine_triton(x, y, 1e-8)
        for r in (c, d):  # exactly symmetric, the tiles redone from scaled rows included
            assert torch.equal(r.nan_to_num(), r.t().nan_to_num())


@expected_overflow
@pytest.mark.parametrize("with_y", [False, True], ids=["y=None", "y"])
def test_the_gemm_forms_tiles_with_and_without_an_extreme_row(with_y, monkeypatch):
    """The GEMM form's epilogue over 16 x 16 tiles: those without an extreme row (x's second
    and fourth blocks, y's last two) take cuBLAS's product as it is, those with one (1e19, NaN,
    zero, 1e-30 rows) are redone from the scaled rows, y None's tiles below the diagonal as
    their mirrors (exactly symmetric)."""
    from pfl_kernels.ops import similarity as ops

    monkeypatch.setattr(ops, "GEMM_MIN_DIM", 0)
    monkeypatch.setattr(ts, "_GEMM_DEVICES", (torch.device(DEVICE).type,))
    monkeypatch.setattr(ts, "_GEMM_BLOCK", 16)  # tl.dot's least block on a GPU
    monkeypatch.setattr(ts, "_BLOCK_D", 16)
    x = rows(70, 37) + 0.2
    x[3] *= 1e19
    x[11] = float("nan")
    x[40] = 0
    x[66] *= 1e-30
    y = None
    if with_y:
        y = rows(60, 37, seed=4)
        y[[2, 9]] = x[[3, 66]]
        y[20, 5] = float("inf")
    xc, yc = x.cpu(), None if y is None else y.cpu()
    c = ts.pairwise_cosine_triton(x, y, 1e-8)
    d = ts.pairwise_sqdist_triton(x, y)
    extreme.assert_cosine_exact(c, xc, yc, 1e-8, "cosine")
    extreme.assert_sqdist_exact(d, xc, yc, "sqdist")
    if y is None:
        assert torch.equal(c.nan_to_num(), c.t().nan_to_num()) and torch.equal(d.nan_to_num(), d.t().nan_to_num())


@expected_overflow
def test_extreme_rows_split_over_d(monkeypatch):
    """An extreme row's tiles redone over several D-splits (partials of the scaled rows)."""
    monkeypatch.setattr(ts, "_BLOCK_D", 16)
    x, _ = extreme.inputs(torch.float32, False)
    x = torch.cat([x, x * 0.5], dim=1).repeat(1, 4).to(DEVICE)  # D = 72: five splits of 16
    extreme.assert_cosine_exact(ts.pairwise_cosine_triton(x, None, 1e-36), x.cpu(), None, 1e-36, "cosine")
    extreme.assert_sqdist_exact(ts.pairwise_sqdist_triton(x, None), x.cpu(), None, "sqdist")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_weights_raise_on_non_finite_sim(bad):
    """The Triton kernel itself raises the ValueError of every backend (a direct op call too)."""
    sim = sim_of(5, 5)
    sim[2, 4] = bad
    with pytest.raises(ValueError, match=r"sim must be finite \(it holds NaN or Inf\)"):
        ts.similarity_weights_triton(sim, 0.2, 3.0, 1, None)
    with pytest.raises(ValueError, match=r"self_index values must be in \[-1, 5\)"):
        ts.similarity_weights_triton(sim.nan_to_num(0.0), 0.2, 3.0, 1, torch.tensor([0, 5, 1, 2, 3], device=DEVICE))
    with launchers_as_cpu_kernels({"similarity_weights": ts.similarity_weights_triton}) if DEVICE == "cpu" \
            else _nullcontext():
        with pytest.raises(ValueError, match="sim must be finite"):
            torch.ops.pfl.similarity_weights(sim, 0.2, 3.0, 1, None)


def test_weights_flags_every_bad_row_and_own_column():
    """The kernel's flags: NaN in a client's own column (which the weights overwrite) still
    raises; an own column of -2 or M; with both, self_index's error, as check_weights_values."""
    sim = sim_of(6, 7)
    sim[5, 5] = float("nan")
    own = torch.tensor([0, 1, 2, 3, 4, 5], device=DEVICE)
    with pytest.raises(ValueError, match="sim must be finite"):
        ts.similarity_weights_triton(sim, 0.2, 3.0, 1, own)
    for value in (-2, 7):
        bad_own = own.clone()
        bad_own[3] = value
        with pytest.raises(ValueError, match=rf"self_index values must be in \[-1, 7\) .*got {value} in row 3"):
            ts.similarity_weights_triton(sim, 0.2, 3.0, 1, bad_own)
    minus_one = own.clone()
    minus_one[0] = -1
    ts.similarity_weights_triton(sim.nan_to_num(0.0), 0.2, 3.0, 1, minus_one)  # -1: no own column


def sim_of(k, m, seed=0, levels=None):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(k, m, generator=g, dtype=F64) * 2 - 1
    if levels:  # many ties
        s = torch.round(s * levels) / levels
    return s.to(DEVICE, torch.float32)


@pytest.mark.parametrize("case", [  # (K, M, tau, scale, min_keep, ties)
    (1, 1, 0.5, 1.0, 0, None), (7, 7, 0.3, 20.0, 4, None), (9, 9, 1.0, 5.0, 0, None), (9, 9, 1.0, 5.0, 50, None),
    (12, 12, 0.9, 3.0, 5, 4), (30, 30, 0.0, -2.0, 8, 2), (20, 20, -1.0, 1.0, 0, None), (5, 37, 0.99, 7.0, 11, 3),
], ids=str)
def test_weights(case):
    k, m, tau, scale, min_keep, levels = case
    sim = sim_of(k, m, levels=levels)
    own = None if k == m else torch.randint(-1, m, (k,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    w = ts.similarity_weights_triton(sim, tau, scale, min_keep, own)
    want = ref.similarity_weights(sim.to(F64), tau, scale, min_keep, own)
    assert w.dtype == torch.float32
    assert torch.equal((w > 0).cpu(), (want > 0).cpu()), "kept sets (tie-breaking)"
    assert_close(w, want, torch.float32, "weights")


def test_weights_negative_values_keys_and_own_minus_one():
    sim = torch.tensor([[-0.5, -0.25, -0.75, -0.25, 0.0, -1.0]], device=DEVICE)
    for own, min_keep in ((-1, 3), (2, 4), (-1, 0)):
        idx = torch.tensor([own], device=DEVICE)
        w = ts.similarity_weights_triton(sim, 0.5, 2.0, min_keep, idx)
        assert_close(w, ref.similarity_weights(sim.to(F64), 0.5, 2.0, min_keep, idx), torch.float32)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_weights_read_a_strided_self_index(dtype):
    """An int64 self_index view kept its strides through .to(int64), and the kernel read it as
    contiguous: another row's own column (0.82 off), or the filler's value."""
    sim = sim_of(3, 5, seed=3)
    for filler in (0, 9):
        own = torch.tensor([0, filler, 2, filler, 1, filler], device=DEVICE, dtype=dtype)[::2]
        w = ts.similarity_weights_triton(sim, 0.5, 5.0, 3, own)
        assert_close(w, ref.similarity_weights(sim.to(F64), 0.5, 5.0, 3, own.contiguous()), torch.float32)


def test_through_the_ops(tiles):
    """The wrappers and autograd on the Triton launchers (as the CPU kernels, in the interpreter)."""
    launchers = {"pairwise_cosine": ts.pairwise_cosine_triton, "pairwise_sqdist": ts.pairwise_sqdist_triton,
                 "similarity_weights": ts.similarity_weights_triton}
    x = rows(6, 19).requires_grad_()
    with launchers_as_cpu_kernels(launchers) if DEVICE == "cpu" else _nullcontext():
        w = similarity_weights(pairwise_cosine(x), tau=0.0, scale=3.0, min_keep=2)
        loss = (w * pairwise_sqdist(x)).sum()
        loss.backward()
    xe = x.detach().to(F64).requires_grad_()
    we = ref.similarity_weights(ref.pairwise_cosine(xe, None, 1e-8).detach(), 0.0, 3.0, 2, None)
    assert_close(w, we, torch.float32, "weights through the ops")
    assert x.grad is not None and torch.isfinite(x.grad).all()


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


@gpu_only
def test_registered_for_cuda():
    assert_registered_for_cuda(["pairwise_cosine", "pairwise_sqdist", "similarity_weights"])


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_on_gpu(dtype):
    x, y = rows(50, 3001, dtype=dtype), rows(30, 3001, seed=1, dtype=dtype)
    c = pairwise_cosine(x, y)
    assert_close(c, ref.pairwise_cosine(x.double(), y.double(), 1e-8), torch.float32, "cosine")


@gpu_only
def test_gradcheck_on_gpu():
    x = rows(4, 7, dtype=F64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a: pairwise_cosine(a), (x,))
    assert torch.autograd.gradcheck(lambda a: pairwise_sqdist(a), (x,))

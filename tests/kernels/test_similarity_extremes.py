"""The similarity ops on non-finite and extreme rows (issue 13, item 4): NaN, ±Inf, 1e19, 1e-30
and zero rows, in x and in y, against their exact values (``similarity_oracle``).

Each test runs the op (the C++ kernels when built, else the reference; the Triton kernels
have ``test_similarity_triton.py``) and the plain-PyTorch reference called directly.
"""
from __future__ import annotations

import pytest
import torch

from pfl_kernels.ops import pairwise_cosine, pairwise_sqdist, similarity_weights
from pfl_kernels.ops import similarity as similarity_ops
from pfl_kernels.reference import similarity as ref
from tests.kernels.similarity_cases import (
    HUGE, TINY, TINY_EPS, assert_cosine_exact, assert_sqdist_exact, inputs, special_rows)

F64 = torch.float64
DTYPES = [torch.float32, F64, torch.bfloat16]

COSINE = {"op": lambda x, y, eps: pairwise_cosine(x, y, eps=eps), "reference": ref.pairwise_cosine}
SQDIST = {"op": pairwise_sqdist, "reference": ref.pairwise_sqdist}


def every_case(test):
    """Each dtype, with and without y, the op and the reference, both C++ product paths."""
    for mark in (pytest.mark.parametrize("path", ["split", "large"]),
                 pytest.mark.parametrize("backend", ["op", "reference"]),
                 pytest.mark.parametrize("with_y", [False, True], ids=["y=None", "y"]),
                 pytest.mark.parametrize("dtype", DTYPES, ids=str)):
        test = mark(test)
    return test


def grow(x, y, rows: int):
    """x (and y) padded with normal rows to ``rows`` rows: K·M > 4096 sends the C++ kernels to
    their large-product path (the default is the split-D path)."""
    g = torch.Generator().manual_seed(3)
    pad = lambda t: torch.cat([t, torch.randn(rows - t.shape[0], t.shape[1], generator=g).to(t.dtype)])  # noqa: E731
    return pad(x), None if y is None else pad(y)


@every_case
def test_cosine_of_extreme_rows(dtype, with_y, backend, path):
    x, y = inputs(dtype, with_y)
    if path == "large":
        x, y = grow(x, y, 70)
    for eps in (1e-8, TINY_EPS[dtype]):
        c = COSINE[backend](x, y, eps)
        assert_cosine_exact(c, x, y, eps, f"{backend} eps={eps}")
    if not with_y:  # own entries: 1 for finite nonzero rows (1e19 and 1e-30 included), NaN for NaN/Inf
        c = COSINE[backend](x, None, TINY_EPS[dtype])
        finite = torch.isfinite(x.to(F64)).all(1)
        nonzero = x.to(F64).abs().amax(1) > 0
        assert torch.isnan(c.diagonal()[~finite]).all()
        assert ((c.diagonal()[finite & nonzero] - 1).abs() < 1e-5).all()
        assert (c.diagonal()[finite & ~nonzero] == 0).all()


@every_case
def test_sqdist_of_extreme_rows(dtype, with_y, backend, path):
    x, y = inputs(dtype, with_y)
    if path == "large":
        x, y = grow(x, y, 70)
    d = SQDIST[backend](x, y)
    assert_sqdist_exact(d, x, y, backend)
    if not with_y:  # the own distance: 0 for finite rows, NaN (not 0) for a NaN/Inf row
        finite = torch.isfinite(x.to(F64)).all(1)
        assert (d.diagonal()[finite] == 0).all() and torch.isnan(d.diagonal()[~finite]).all()


@pytest.mark.parametrize("backend", ["op", "reference"])
def test_a_non_finite_row_touches_only_its_row_and_column(backend):
    """Every other entry is the one computed without the diverged rows (to rounding: BLAS
    may block the two products differently; distances of 1e19 rows are +Inf in both)."""
    x, _ = inputs(torch.float32, False)
    finite = torch.isfinite(x).all(1)
    for op in (COSINE[backend], lambda a, b, eps: SQDIST[backend](a, b)):
        full = op(x, None, 1e-8)
        alone = op(x[finite], None, 1e-8)
        torch.testing.assert_close(full[finite][:, finite], alone, rtol=2e-5, atol=2e-5)  # Inf: 1e19 rows
        assert torch.isnan(full[~finite]).all() and torch.isnan(full[:, ~finite]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cosine_gradient_of_extreme_rows(dtype):
    """1e19 and 1e-30 rows: the gradient of the exact cosine (float64 autograd of the plain
    formula, which no float32 value overflows), row by row to float32 accuracy."""
    rows, kinds = special_rows(dtype)
    keep = [i for i, k in enumerate(kinds) if k in ("normal", "huge", "tiny", "one-huge-entry", "1e19", "1e-30")]
    x = rows[keep].clone().requires_grad_()
    y = special_rows(dtype, seed=5)[0][keep].clone().requires_grad_()
    eps = TINY_EPS[dtype]
    grad = torch.randn(len(keep), len(keep), generator=torch.Generator().manual_seed(2))
    for with_y in (False, True):
        args = (x, y) if with_y else (x, None)
        gx, *gy = torch.autograd.grad(pairwise_cosine(*args, eps=eps), [x, y] if with_y else [x], grad)
        xe, ye = x.detach().to(F64).requires_grad_(), y.detach().to(F64).requires_grad_()
        yy = ye if with_y else xe
        want = (xe @ yy.t()) / (xe.norm(dim=1)[:, None] * yy.norm(dim=1)[None, :])
        ex, *ey = torch.autograd.grad(want, [xe, ye] if with_y else [xe], grad.to(F64))
        for got, exp in [(gx, ex)] + list(zip(gy, ey)):
            err = (got.to(F64) - exp).norm(dim=1) / exp.norm(dim=1)
            assert err.max() < 2e-2 if dtype == torch.bfloat16 else err.max() < 1e-4, err


def test_cosine_gradient_of_huge_float64_rows():
    """1e160 rows (squares overflow float64): the cosine is scale invariant, so its gradient
    at t·x is the gradient at x divided by t."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 7, generator=g, dtype=F64)
    grad = torch.randn(5, 5, generator=g, dtype=F64)
    big = (x * 1e160).requires_grad_()
    (got,) = torch.autograd.grad(pairwise_cosine(big), big, grad)
    small = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(pairwise_cosine(small), small, grad)
    assert torch.allclose(got * 1e160, want, rtol=1e-10, atol=1e-12)


def test_gradient_of_a_nan_row_is_nan():
    x = torch.randn(4, 6, dtype=F64)
    x[2, 3] = float("nan")
    x.requires_grad_()
    pairwise_cosine(x).sum().backward()
    assert torch.isnan(x.grad[2]).all()


# ---- similarity_weights on a diverged client: ValueError on every backend ------------------

def test_weights_of_a_diverged_client_raise():
    """pairwise_cosine of a NaN or 1e19 row must not be a finite similarity that
    similarity_weights turns into a weight: NaN in, ValueError out."""
    g = torch.Generator().manual_seed(6)
    for kind in ("nan", "inf"):
        x = torch.randn(6, 11, generator=g)
        x[3, 4] = float(kind)
        with pytest.raises(ValueError, match="sim must be finite"):
            similarity_weights(pairwise_cosine(x), tau=0.5, scale=5.0, min_keep=2)
    x = torch.randn(6, 11, generator=g)
    x[3] *= HUGE[torch.float32]
    w = similarity_weights(pairwise_cosine(x), tau=0.5, scale=5.0, min_keep=2)
    want = ref.similarity_weights(ref.pairwise_cosine(x.double(), None, 1e-8), 0.5, 5.0, 2, None)
    assert torch.allclose(w.double(), want, atol=1e-5)
    x[3] = x[3] / HUGE[torch.float32] * TINY[torch.float32]
    w = similarity_weights(pairwise_cosine(x, eps=1e-36), tau=0.5, scale=5.0, min_keep=2)
    want = ref.similarity_weights(ref.pairwise_cosine(x.double(), None, 1e-36), 0.5, 5.0, 2, None)
    assert torch.allclose(w.double(), want, atol=1e-5)


WEIGHTS = {"wrapper": lambda s, i: similarity_weights(s, tau=0.2, scale=3.0, min_keep=1, self_index=i),
           "op": lambda s, i: torch.ops.pfl.similarity_weights(s, 0.2, 3.0, 1, i),
           "reference kernel": lambda s, i: similarity_ops._reference_weights(s, 0.2, 3.0, 1, i)}


@pytest.mark.parametrize("call", list(WEIGHTS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_weights_raise_the_same_error_on_every_path(bad, call):
    sim = torch.rand(5, 5, generator=torch.Generator().manual_seed(7))
    sim[1, 3] = bad
    with pytest.raises(ValueError, match=r"sim must be finite \(it holds NaN or Inf\)"):
        WEIGHTS[call](sim, None)
    own = torch.tensor([0, 1, 2, 7, -1])
    with pytest.raises(ValueError, match=r"self_index values must be in \[-1, 5\) .*got 7 in row 3"):
        WEIGHTS[call](sim.nan_to_num(0.0), own)

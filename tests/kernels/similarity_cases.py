"""Rows that have broken the similarity ops (issue 13, item 4), and the checks against the exact
answer of ``similarity_oracle``; shared by the CPU tests and the Triton interpreter tests."""
from __future__ import annotations

import math

import torch

from tests.kernels import similarity_oracle as oracle

F64 = torch.float64

# Entries whose squares overflow / underflow the accumulation dtype (float32 for float32 and
# bfloat16 inputs), and the float64 counterparts.
HUGE = {torch.float32: 1e19, torch.bfloat16: 1e19, F64: 1e160}
TINY = {torch.float32: 1e-30, torch.bfloat16: 1e-30, F64: 1e-170}
# An eps below the tiny rows' norms, so that their cosine is the exact one (not eps-floored).
TINY_EPS = {torch.float32: 1e-36, torch.bfloat16: 1e-36, F64: 1e-300}

KINDS = ["normal", "nan", "+inf", "-inf", "huge", "tiny", "zero", "one-huge-entry", "1e19", "1e-30"]


def special_rows(dtype: torch.dtype, d: int = 9, seed: int = 0):
    """(rows [len(KINDS), d] in ``dtype``, kinds): one row of each kind, random directions."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(len(KINDS), d, generator=g, dtype=F64) + 0.1
    rows = base.clone()
    for i, kind in enumerate(KINDS):
        if kind == "nan":
            rows[i, d // 2] = math.nan
        elif kind == "+inf":
            rows[i, 1] = math.inf
        elif kind == "-inf":
            rows[i, 0] = -math.inf
        elif kind == "huge":
            rows[i] *= HUGE[dtype]
        elif kind == "tiny":
            rows[i] *= TINY[dtype]
        elif kind == "zero":
            rows[i] = 0
        elif kind == "one-huge-entry":
            rows[i, 2] = HUGE[dtype]
        elif kind == "1e19":  # the values, in every dtype
            rows[i] *= 1e19
        elif kind == "1e-30":
            rows[i] *= 1e-30
    return rows.to(dtype), list(KINDS)


def inputs(dtype: torch.dtype, with_y: bool, k_normal: int = 3, seed: int = 0):
    """x: the special rows mixed with normal ones; y: copies of some special rows of x (cosine
    1, distance 0 with them), the special rows again and normal rows (None without y)."""
    g = torch.Generator().manual_seed(seed + 1)
    rows, _ = special_rows(dtype, seed=seed)
    normal = torch.randn(k_normal, rows.shape[1], generator=g, dtype=F64).to(dtype)
    x = torch.cat([normal[:1], rows, normal[1:]])
    if not with_y:
        return x, None
    y = torch.cat([rows.flip(0), torch.randn(2, rows.shape[1], generator=g, dtype=F64).to(dtype), x[[5, 6, 0]]])
    return x, y


def acc_of(dtype: torch.dtype) -> torch.dtype:
    return F64 if dtype == F64 else torch.float32


def assert_cosine_exact(c: torch.Tensor, x, y, eps: float, what: str = "") -> None:
    """c is the exact cosine rounded (float32 / float64 tolerance), NaN exactly where a row of
    x or y is non-finite (its own entry included)."""
    want = oracle.cosine(x, y, eps)
    assert c.shape == want.shape, f"{what}: shape {list(c.shape)}"
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(c.cpu()), nan), f"{what}: NaN at {torch.isnan(c.cpu()).nonzero().tolist()}, " \
                                                   f"expected at {nan.nonzero().tolist()}"
    tol = 1e-12 if c.dtype == F64 else 2e-6
    err = (c.cpu().to(F64) - want).abs()[~nan]
    assert err.numel() == 0 or err.max() <= tol, f"{what}: cosine error {float(err.max()):.3e} > {tol}"


def assert_sqdist_exact(d: torch.Tensor, x, y, what: str = "") -> None:
    """d is ‖x_i − y_j‖² within tol·(‖x_i‖² + ‖y_j‖²) (the expanded form's rounding) plus the
    dtype's smallest normal (values below it round to 0); +Inf only where the exact value is
    at least the largest finite number within that bound; NaN exactly at non-finite rows."""
    want, scale = oracle.sqdist(x, y)
    assert d.shape == want.shape, f"{what}: shape {list(d.shape)}"
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(d.cpu()), nan), f"{what}: NaN at {torch.isnan(d.cpu()).nonzero().tolist()}, " \
                                                   f"expected at {nan.nonzero().tolist()}"
    info = torch.finfo(d.dtype)
    tol = (1e-14 if d.dtype == F64 else 4e-6) * scale + info.tiny
    got = d.cpu().to(F64)
    ok = (got - want).abs() <= tol
    ok |= torch.isposinf(got) & (want + tol >= info.max)
    ok |= nan
    assert (got[~nan] >= 0).all(), f"{what}: negative distances"
    assert ok.all(), f"{what}: {int((~ok).sum())} entries off, first at {(~ok).nonzero()[0].tolist()}: " \
                     f"got {float(got[~ok][0]):.6g}, exact {float(want[~ok][0]):.6g}"

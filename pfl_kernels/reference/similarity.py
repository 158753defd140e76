"""Plain-PyTorch definition of the similarity ops (any device; float64 is the definition of correct).

* ``pairwise_cosine(x, y, eps)``: c[i, j] = clamp(x_i·y_j / (max(‖x_i‖, eps)·max(‖y_j‖, eps)), -1, 1).
* ``pairwise_sqdist(x, y)``: d[i, j] = max(‖x_i‖² + ‖y_j‖² − 2·x_i·y_j, 0), exactly 0 on the
  diagonal when ``y`` is None.
* ``similarity_weights(sim, tau, scale, min_keep, self_index)``: the matching rule of
  Factorized-FL Eq. 4–5 / SimFed Eq. 3 (see ``pfl_kernels.ops.similarity``).

Inputs are read in the accumulation dtype (float32 for bfloat16/float16/float32, float64
for float64) and the results are returned in it.  With ``y`` None, the norms are read off
the diagonal of the Gram matrix (no second pass over x).

Extreme and non-finite rows (the contract every backend follows):

* Each row is scaled by a power of two σ_i (``row_scales``) that brings its largest |entry|
  into [0.5, 1) before anything is squared or multiplied, and the products and norms are
  taken of the scaled rows: entries up to the dtype's largest finite value (1e19 in float32,
  whose squares overflow) and down to its smallest subnormal (1e-30, whose squares
  underflow) give the cosine and distance of the exact definition, rounded once more at
  most.  A power of two scales exactly, so rows of ordinary size give the same bits as
  without scaling.  A distance too large for the dtype is +Inf (its true value overflows).
* A row of x that holds a NaN, +Inf or -Inf (a diverged client) makes its whole row of the
  result NaN, and its column too when ``y`` is None, its own entry c[i, i] / d[i, i]
  included; a non-finite row of y makes its column NaN.  Nothing else changes: the other
  entries are those of the finite rows alone.
* A row of zeros has cosine 0 with every finite row (itself included) and distance ‖y_j‖².
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation (and result) dtype of an input dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scale_exponent_limit(acc: torch.dtype) -> int:
    """Largest |e| of a row scale 2^-e in ``acc``: 2^±e stays a normal number (125 in float32,
    1021 in float64), so scaling never flushes to zero where denormals are disabled."""
    return math.frexp(torch.finfo(acc).max)[1] - 3


def row_scales(t: torch.Tensor):
    """(σ [R], finite [R]) for the rows of ``t`` [R, D] (already in the accumulation dtype).

    σ_r = 2^-e_r with e_r the binary exponent of m_r = max_d |t_rd| (so max_d |σ_r t_rd| is in
    [0.5, 1)), e_r clamped to ±``scale_exponent_limit``; σ_r = 1 for a row of zeros and for a
    non-finite row.  finite_r is False where the row holds a NaN or ±Inf.  Not differentiated
    (σ is piecewise constant and cancels out of every result).
    """
    with torch.no_grad():
        t = t.detach()
        if t.shape[1] == 0:
            m = torch.zeros(t.shape[0], dtype=t.dtype, device=t.device)
        else:
            m = t.abs().amax(1)  # NaN propagates, so m is finite exactly for finite rows
        finite = torch.isfinite(m)
        _, e = torch.frexp(torch.where(finite & (m > 0), m, torch.ones((), dtype=t.dtype, device=t.device)))
        limit = scale_exponent_limit(t.dtype)
        sigma = torch.ldexp(torch.ones_like(m), -e.clamp(-limit, limit))
    return sigma, finite


def scaled_rows(t: torch.Tensor):
    """(t̂ = σ·t in the accumulation dtype, σ, finite): ``t``'s rows scaled by ``row_scales``."""
    ta = t.to(acc_dtype(t.dtype))
    sigma, finite = row_scales(ta)
    return ta * sigma[:, None], sigma, finite


def inverse_norms(norm: torch.Tensor, sigma: torch.Tensor, eps: float):
    """(f, live) from the norms ‖t̂_i‖ of scaled rows: f_i = 1 / max(‖t̂_i‖, eps·σ_i), so that
    t̂_i·f_i = t_i / max(‖t_i‖, eps); live_i = ‖t_i‖ > eps."""
    floor = eps * sigma
    return 1 / torch.maximum(norm, floor), norm > floor


def _product(x: torch.Tensor, y: Optional[torch.Tensor]):
    """(ŝ = x̂·ŷᵀ, ‖x̂_i‖², ‖ŷ_j‖², σ_x, σ_y, finite_x, finite_y) of the scaled rows."""
    xs, sig_x, fin_x = scaled_rows(x)
    if y is None:
        s = xs @ xs.t()
        # BLAS need not sum s[i, j] and s[j, i] in the same order: (a + b)/2 is exactly
        # symmetric, and so then is every result computed from it.
        s = 0.5 * (s + s.t())
        sq = s.diagonal().clone()
        return s, sq, sq, sig_x, sig_x, fin_x, fin_x
    ys, sig_y, fin_y = scaled_rows(y)
    return xs @ ys.t(), (xs * xs).sum(1), (ys * ys).sum(1), sig_x, sig_y, fin_x, fin_y


def _mark_non_finite(r: torch.Tensor, fin_x: torch.Tensor, fin_y: torch.Tensor) -> torch.Tensor:
    """NaN in the rows of non-finite x rows and the columns of non-finite y rows."""
    nan = torch.full((), float("nan"), dtype=r.dtype, device=r.device)
    return torch.where(fin_x[:, None] & fin_y[None, :], r, nan)


def pairwise_cosine(x: torch.Tensor, y: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """c[i, j] = clamp(x_i·y_j / (max(‖x_i‖, eps)·max(‖y_j‖, eps)), -1, 1); [K, M] (see the
    module docstring for extreme and non-finite rows)."""
    s, sx, sy, sig_x, sig_y, fin_x, fin_y = _product(x, y)
    f_x, _ = inverse_norms(sx.sqrt(), sig_x, eps)
    f_y = f_x if y is None else inverse_norms(sy.sqrt(), sig_y, eps)[0]
    # The scale as one factor (f_i·f_j commutes): symmetric s stays symmetric.  Two zero rows
    # with a tiny eps have f_i·f_j = 1/eps² = Inf: their ŝ = 0 stays 0 (not 0·Inf = NaN).
    c = torch.where(s == 0, s, s * (f_x[:, None] * f_y[None, :])).clamp_(-1, 1)
    return _mark_non_finite(c, fin_x, fin_y)


def pairwise_sqdist(x: torch.Tensor, y: Optional[torch.Tensor]) -> torch.Tensor:
    """d[i, j] = max(‖x_i‖² + ‖y_j‖² − 2·x_i·y_j, 0); [K, M], diagonal 0 when y is None (see
    the module docstring for extreme and non-finite rows).

    With a_i = 1/σ_i and a = max(a_i, a_j), r_i = a_i/a (powers of two, r <= 1):
    d = (r_i²‖x̂_i‖² + r_j²‖ŷ_j‖² − 2 r_i r_j x̂_i·ŷ_j)·a·a, the bracket at most 4·D.
    """
    s, sx, sy, sig_x, sig_y, fin_x, fin_y = _product(x, y)
    a_x, a_y = 1 / sig_x, 1 / sig_y
    a = torch.maximum(a_x[:, None], a_y[None, :])
    r_x, r_y = a_x[:, None] / a, a_y[None, :] / a
    d = (r_x * r_x * sx[:, None] + r_y * r_y * sy[None, :] - 2 * (r_x * r_y) * s).clamp_min_(0)
    d = d * a * a
    if y is None:
        d.fill_diagonal_(0)
    return _mark_non_finite(d, fin_x, fin_y)


def self_columns(sim: torch.Tensor, self_index: Optional[torch.Tensor]) -> torch.Tensor:
    """[K] int64: each row's own column, -1 for none (None: the diagonal)."""
    if self_index is None:
        return torch.arange(sim.shape[0], device=sim.device)
    return self_index.to(device=sim.device, dtype=torch.int64)


def similarity_weights(sim: torch.Tensor, tau: float, scale: float, min_keep: int,
                       self_index: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax(scale·v) over the kept entries of each row, 0 elsewhere (see the op's docstring).

    v is sim with the row's own entry set to 1.0.  Kept: v >= tau, the own entry, and the
    ``min_keep`` first entries in the order (own entry first, then v descending, then
    column ascending) — a stable sort gives that tie-breaking.
    """
    acc = acc_dtype(sim.dtype)
    k, m = sim.shape
    v = sim.to(acc).clone()
    own = self_columns(sim, self_index)
    has_own = own >= 0
    is_own = torch.zeros(k, m, dtype=torch.bool, device=sim.device)
    rows = torch.arange(k, device=sim.device)[has_own]
    is_own[rows, own[has_own]] = True
    v = torch.where(is_own, torch.ones((), dtype=acc, device=sim.device), v)
    kept = (v >= tau) | is_own
    if min_keep > 0 and m > 0:
        key = torch.where(is_own, torch.full((), float("inf"), dtype=acc, device=sim.device), v)
        order = torch.sort(key, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(m, device=sim.device).expand(k, m))
        kept |= rank < min_keep
    logits = torch.where(kept, scale * v, torch.full((), float("-inf"), dtype=acc, device=sim.device))
    w = torch.softmax(logits, dim=1)
    # A row that keeps nothing (no own column, nothing >= tau, min_keep 0) is all zeros.
    return torch.where(kept, w, torch.zeros((), dtype=acc, device=sim.device))


def similarity_weights_backward(grad: torch.Tensor, weights: torch.Tensor,
                                self_index: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """grad_sim[i, j] = scale·w_ij·(g_ij − Σ_l g_il·w_il) on kept non-own entries, 0 elsewhere.

    The kept set is piecewise constant in sim (no gradient through it); entries outside it
    have w = 0, so the formula gives them 0 by itself; the own entry is the constant 1.0.
    """
    g = grad.to(weights.dtype)
    out = scale * weights * (g - (g * weights).sum(1, keepdim=True))
    own = self_columns(weights, self_index)
    has_own = own >= 0
    out[torch.arange(weights.shape[0], device=weights.device)[has_own], own[has_own]] = 0
    return out

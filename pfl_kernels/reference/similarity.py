"""Plain-PyTorch definition of the similarity ops (any device; float64 is the definition of correct).

* ``pairwise_cosine(x, y, eps)``: c[i, j] = clamp(x_i·y_j / (max(‖x_i‖, eps)·max(‖y_j‖, eps)), -1, 1).
* ``pairwise_sqdist(x, y)``: d[i, j] = max(‖x_i‖² + ‖y_j‖² − 2·x_i·y_j, 0), exactly 0 on the
  diagonal when ``y`` is None.
* ``similarity_weights(sim, tau, scale, min_keep, self_index)``: the matching rule of
  Factorized-FL Eq. 4–5 / SimFed Eq. 3 (see ``pfl_kernels.ops.similarity``).

Inputs are read in the accumulation dtype (float32 for bfloat16/float16/float32, float64
for float64) and the results are returned in it.  With ``y`` None, the norms are read off
the diagonal of the Gram matrix (no second pass over x).
"""
from __future__ import annotations

from typing import Optional

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation (and result) dtype of an input dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _product(x: torch.Tensor, y: Optional[torch.Tensor]):
    """(x·yᵀ, ‖x_i‖², ‖y_j‖²) in the accumulation dtype."""
    acc = acc_dtype(x.dtype)
    xa = x.to(acc)
    if y is None:
        s = xa @ xa.t()
        # BLAS need not sum s[i, j] and s[j, i] in the same order: (a + b)/2 is exactly
        # symmetric, and so then is every result computed from it.
        s = 0.5 * (s + s.t())
        sq = s.diagonal().clone()
        return s, sq, sq
    ya = y.to(acc)
    return xa @ ya.t(), (xa * xa).sum(1), (ya * ya).sum(1)


def pairwise_cosine(x: torch.Tensor, y: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """c[i, j] = clamp(x_i·y_j / (max(‖x_i‖, eps)·max(‖y_j‖, eps)), -1, 1); [K, M]."""
    s, sx, sy = _product(x, y)
    inv_x = 1 / sx.sqrt().clamp_min(eps)
    inv_y = inv_x if y is None else 1 / sy.sqrt().clamp_min(eps)
    # The scale as one factor (inv_x_i·inv_y_j commutes): symmetric s stays symmetric.
    return (s * (inv_x[:, None] * inv_y[None, :])).clamp_(-1, 1)


def pairwise_sqdist(x: torch.Tensor, y: Optional[torch.Tensor]) -> torch.Tensor:
    """d[i, j] = max(‖x_i‖² + ‖y_j‖² − 2·x_i·y_j, 0); [K, M], diagonal 0 when y is None."""
    s, sx, sy = _product(x, y)
    d = (sx[:, None] + sy[None, :] - 2 * s).clamp_min_(0)
    if y is None:
        d.fill_diagonal_(0)
    return d


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

"""pFedMB Eq. 5 in exact rational arithmetic, for counts and α of any finite magnitude.

``exact_aggregate`` forms c_ib = n_i α_ib / Σ_j n_j α_jb with ``fractions.Fraction`` (no
overflow, no underflow, one rounding to float64 at the end), so it checks every backend's
coefficients where float64 products overflow (1e300 · 1e300) or underflow (1e-200 · 1e-200).
Shared by ``test_branch_aggregate.py`` and its Triton twin.
"""
from __future__ import annotations

from fractions import Fraction

import torch

F64 = torch.float64
NAN = float("nan")

# name -> (alpha [K, B], counts [K]), all finite and >= 0
EXTREME_CASES = {
    "products overflow, equal": ([[1e300, 1e300], [1e300, 1e300], [1e300, 1e300]], [1e300, 1e300, 1e300]),
    "products overflow, unequal": ([[1e300, 1.0], [2e300, 0.0], [1e-300, 7.0]], [1e300, 3e299, 5.0]),
    "products underflow": ([[1e-200, 1e-300], [1e-200, 0.0], [3e-200, 5e-324]], [1e-200, 3e-200, 2e-200]),
    "extremes in one branch": ([[0.0, 1.0], [1.0, 1e300]], [1e300, 1e-300]),
    "subnormal counts": ([[1.0, 1.0], [1.0, 0.5]], [5e-324, 1e-323]),
    "largest finite": ([[1.7976931348623157e308, 1.0], [1.7976931348623157e308, 1e-300]],
                       [1.7976931348623157e308, 1.0]),
    "ordinary": ([[0.3, 0.7], [0.55, 0.45], [0.1, 0.9]], [17.0, 3.0, 250.0]),
}


def exact_coefficients(alpha: torch.Tensor, counts: torch.Tensor) -> list[list[Fraction]]:
    """c [K][B] exactly (1/K on a branch nobody weights)."""
    k, b = alpha.shape
    n = [Fraction(float(x)) for x in counts.to(F64)]
    coef = [[Fraction(0)] * b for _ in range(k)]
    for j in range(b):
        w = [n[i] * Fraction(float(alpha[i, j])) for i in range(k)]
        total = sum(w)
        for i in range(k):
            coef[i][j] = w[i] / total if total else Fraction(1, k)
    return coef


def exact_aggregate(params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """W [B, *shape] in float64: Σ_i c_ib W_ib over the clients with c_ib != 0 (the others are
    not read), each c_ib rounded once from its exact value."""
    k, b = alpha.shape
    coef = exact_coefficients(alpha, counts)
    w = params.to(F64).reshape(k, b, -1)
    out = torch.zeros(b, w.shape[-1], dtype=F64)
    for j in range(b):
        for i in range(k):
            if coef[i][j]:
                out[j] += float(coef[i][j]) * w[i, j]
    return out.reshape(params.shape[1:])


def exact_grad_alpha(params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor,
                     grad: torch.Tensor) -> torch.Tensor:
    """∂⟨grad, W⟩/∂α_ib = n_i (⟨g_b, W_ib⟩ − ⟨g_b, W_b⟩) / D_b, with n_i / D_b exact (0 on a
    branch nobody weights); the dot products in float64."""
    k, b = alpha.shape
    w = params.to(F64).reshape(k, b, -1)
    g = grad.to(F64).reshape(b, -1)
    mean = exact_aggregate(params, alpha, counts).reshape(b, -1)
    n = [Fraction(float(x)) for x in counts.to(F64)]
    out = torch.zeros(k, b, dtype=F64)
    for j in range(b):
        total = sum(n[i] * Fraction(float(alpha[i, j])) for i in range(k))
        for i in range(k):
            if total and n[i]:
                out[i, j] = float(n[i] / total) * float((g[j] * (w[i, j] - mean[j])).sum())
    return out


def case(name: str, p: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(branch_params [K, B, p] float64, alpha, counts) of ``EXTREME_CASES[name]``."""
    alpha, counts = (torch.tensor(v, dtype=F64) for v in EXTREME_CASES[name])
    k, b = alpha.shape
    params = torch.randn(k, b, p, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return params, alpha, counts

"""Plain-PyTorch definition of pFedMB's server aggregation (Eq. 5), any device, any float dtype.

``branch_params`` is [K, B, *shape] (client i's copy of branch b), ``alpha`` [K, B] (the
clients' branch weights) and ``counts`` [K] (their sample counts n_i).  The result is

    W_b = Σ_i n_i α_ib W_ib / Σ_i n_i α_ib                                   (pFedMB Eq. 5)

computed as Σ_i c_ib W_ib with the normalized coefficients c_ib = n_i α_ib / Σ_j n_j α_jb
(``coefficients``).  A branch that nobody weights (Σ_j n_j α_jb = 0) gets the plain average
over all K clients (c_ib = 1/K).  Clients with c_ib = 0 are not read for branch b, so a
NaN/Inf row of a client that does not weight b leaves W_b finite.
"""
from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of parameters of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def coefficients(alpha: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """c [K, B] with c_ib = n_i α_ib / Σ_j n_j α_jb (1/K where that sum is 0), in ``dtype``.

    Computed in float64 whatever ``dtype`` is, then rounded once: with float32 counts and
    alpha the products n_i α_ib (n_i up to 2^53) would otherwise lose digits before the sum.
    """
    weight = counts.to(torch.float64)[:, None] * alpha.to(torch.float64)  # [K, B]
    total = weight.sum(0)  # [B]
    uniform = torch.full_like(weight, 1.0 / weight.shape[0])
    coef = torch.where(total > 0, weight / torch.where(total > 0, total, 1.0), uniform)
    return coef.to(dtype)


def branch_aggregate(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """W [B, *shape] = Σ_i c_ib W_ib (pFedMB Eq. 5), accumulated in float32 (float64 for float64)
    and returned in branch_params' dtype.  Zero-coefficient clients contribute exactly 0."""
    k, b = alpha.shape
    acc = acc_dtype(branch_params.dtype)
    coef = coefficients(alpha, counts, acc)
    w = branch_params.reshape(k, b, -1).to(acc)
    # A client that does not weight b is not read: 0 · NaN would be NaN.
    w = torch.where((coef != 0)[..., None], w, torch.zeros((), dtype=acc, device=w.device))
    out = torch.einsum("kb,kbp->bp", coef, w)
    return out.to(branch_params.dtype).reshape(branch_params.shape[1:])


def branch_aggregate_backward(grad_out, branch_params, alpha, counts, output_mask):
    """(grad_branch_params, grad_alpha) of ``branch_aggregate``; an unrequested one is None.

    grad_W_ib = c_ib g_b.  For a weighted branch (D_b = Σ_j n_j α_jb > 0),
    ∂W_b/∂α_ib = n_i (W_ib − W_b) / D_b, so grad_α_ib = n_i (⟨g_b, W_ib⟩ − ⟨g_b, W_b⟩) / D_b
    with ⟨g_b, W_b⟩ = Σ_j c_jb ⟨g_b, W_jb⟩ (no need to keep W_b).  grad_α_ib is exactly 0
    where n_i = 0 (α_ib does not enter) and on a branch nobody weights (its plain average is
    taken as constant in α there).  Plain PyTorch ops: one pass over branch_params for the
    dot products, one write of grad_branch_params.
    """
    k, b = alpha.shape
    acc = acc_dtype(branch_params.dtype)
    coef = coefficients(alpha, counts, acc)
    g = grad_out.reshape(b, -1)
    grad_params = grad_alpha = None
    if output_mask[0]:
        # In branch_params' dtype: one pass, products rounded once (opmath inside the kernel).
        grad_params = (coef.to(branch_params.dtype)[..., None] * g[None]).reshape(branch_params.shape)
    if output_mask[1]:
        n = counts.to(torch.float64)
        weight = n[:, None] * alpha.to(torch.float64)
        total = weight.sum(0)
        dots = torch.einsum("kbp,bp->kb", branch_params.reshape(k, b, -1), g).to(torch.float64)
        c64 = coefficients(alpha, counts, torch.float64)
        zero = torch.zeros((), dtype=torch.float64, device=dots.device)
        mean_dot = torch.where(c64 != 0, c64 * dots, zero).sum(0)  # ⟨g_b, W_b⟩
        scale = torch.where(total > 0, n[:, None] / torch.where(total > 0, total, 1.0), zero)  # [K, B]
        grad_alpha = torch.where(scale != 0, scale * (dots - mean_dot), zero).to(alpha.dtype)
    return grad_params, grad_alpha

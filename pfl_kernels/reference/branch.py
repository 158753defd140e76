"""Plain-PyTorch definition of the multi-branch ops of pFedMB (any device, any float dtype).

``weights`` is [K?, B, *shape] and ``alpha`` [K?, B]: alpha's shape is the leading part
of weights' shape, so the optional client dimension K needs no extra argument.
"""
from __future__ import annotations

import torch


def _flat(weights: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """weights as [K?, B, N]."""
    return weights.reshape(*alpha.shape, -1)


def branch_combine(weights: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """W = Σ_b alpha[..., b] · weights[..., b, *shape] (pFedMB Eq. 1–2)."""
    w = torch.einsum("...b,...bn->...n", alpha, _flat(weights, alpha))
    return w.reshape(weights.shape[: alpha.dim() - 1] + weights.shape[alpha.dim():])


def branch_combine_backward(grad_w, weights, alpha, output_mask):
    """(grad_weights, grad_alpha) with grad_weights[b] = α_b · grad_W, grad_alpha[b] = ⟨grad_W, W_b⟩.

    A gradient not asked for by ``output_mask`` is an empty tensor of shape [0].
    """
    g = grad_w.reshape(*alpha.shape[:-1], 1, -1)  # [K?, 1, N]
    grad_weights = alpha.new_empty(0)
    if output_mask[0]:
        grad_weights = (alpha[..., None] * g).reshape(weights.shape)
    grad_alpha = alpha.new_empty(0)
    if output_mask[1]:
        grad_alpha = (g * _flat(weights, alpha)).sum(-1)
    return grad_weights, grad_alpha


def project_simplex_(x: torch.Tensor) -> None:
    """In place: each row x[..., :] <- argmin_{p ∈ simplex} ‖p − x‖₂ (sort-based, Duchi et al. 2008).

    With u = x sorted descending and c = cumsum(u): ρ = max{j : u_j − (c_j − 1)/j > 0},
    θ = (c_ρ − 1)/ρ, and the projection is max(x − θ, 0).

    A row holding NaN or ±Inf has no projection: it comes out all NaN, the other rows as if
    it were not there (the C++ and Triton kernels do the same).
    """
    not_finite = ~torch.isfinite(x).all(dim=-1, keepdim=True)
    v = torch.where(not_finite, 0, x)  # finite rows unchanged: the C++ kernel's arithmetic, bit for bit
    # The projection commutes with adding a constant to a row (θ absorbs it): working on
    # x − max(x) keeps u_1 = 0 in the support even when |x| is beyond 1/eps.
    x_max = v.amax(dim=-1, keepdim=True)
    # Shifted entries below -1 are never in the support (θ >= -1: the maximum, shifted to 0,
    # projects to -θ <= 1): raised to -2, they leave ρ and θ as they are, and the prefix sums
    # stay within 2B + 1 (a row spanning more than half the float range summed to -inf, which
    # put every entry in the support and made a finite row all Inf).
    u, _ = torch.sort((v - x_max).clamp_min(-2), dim=-1, descending=True)
    c = torch.cumsum(u, dim=-1) - 1
    j = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=x.dtype)
    support = (u - c / j) > 0  # true for j = 1..ρ (a prefix; ρ >= 1 since u_1 = 0)
    rho = support.sum(-1, keepdim=True)
    theta = torch.gather(c, -1, rho - 1) / rho.to(x.dtype)
    x.copy_(torch.where(not_finite, float("nan"), torch.clamp(v - x_max - theta, min=0)))

"""Plain-PyTorch definition of the factorized-weight ops (any device, any float dtype).

This is the meaning of correct for every kernel, and the fallback on devices without
a faster implementation.  Inputs carry an optional leading client dimension K.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._layout import layout_geometry


def factors_to_matrix(u: torch.Tensor, v: torch.Tensor, mu: Optional[torch.Tensor],
                      mask: Optional[torch.Tensor]) -> torch.Tensor:
    """M = u @ v (+ mu * mask): the (R, C) matrix of Factorized-FL Eq. 2 / SimFed Eq. 6."""
    m = torch.matmul(u, v)
    if mu is not None:
        m = m + (mu * mask if mask is not None else mu)
    return m


def place(m: torch.Tensor, shape: Sequence[int], layout: str) -> torch.Tensor:
    """Lay M [..., R, C] onto a contiguous weight [..., *shape] (see ``_layout``)."""
    rows, _, outer, inner = layout_geometry(shape, layout)
    lead = m.shape[:-2]
    w = m.reshape(*lead, rows, outer, inner).transpose(-3, -2)
    return w.contiguous().reshape(*lead, *shape)


def unplace(grad_w: torch.Tensor, shape: Sequence[int], layout: str) -> torch.Tensor:
    """Inverse of ``place``: read a weight-shaped tensor back in (R, C) order."""
    rows, cols, outer, inner = layout_geometry(shape, layout)
    lead = grad_w.shape[: grad_w.dim() - len(shape)]
    g = grad_w.reshape(*lead, outer, rows, inner).transpose(-3, -2)
    return g.reshape(*lead, rows, cols)


def factorized_weight(u, v, mu=None, mask=None, *, shape, layout="spatial"):
    """W = place(u @ v + mu * mask, shape, layout)."""
    return place(factors_to_matrix(u, v, mu, mask), shape, layout)


def factorized_weight_backward(grad_w, u, v, mu, mask, *, shape, layout, output_mask):
    """Gradients (u, v, mu, mask) of ``factorized_weight``; unrequested ones are empty.

    With G = grad_W in (R, C) order: grad_u = G vᵀ, grad_v = uᵀ G, grad_mu = G * mask,
    grad_mask = G * mu.
    """
    g = unplace(grad_w, shape, layout)
    # Outputs are contiguous, like every kernel's (g is a permuted view of grad_w), and
    # never alias each other or the inputs.
    grad_u = torch.matmul(g, v.transpose(-1, -2)).contiguous() if output_mask[0] else u.new_empty(0)
    grad_v = torch.matmul(u.transpose(-1, -2), g).contiguous() if output_mask[1] else u.new_empty(0)
    grad_mu = u.new_empty(0)
    if output_mask[2] and mu is not None:
        grad_mu = (g * mask).contiguous() if mask is not None else g.clone(memory_format=torch.contiguous_format)
    grad_mask = (g * mu).contiguous() if output_mask[3] and mask is not None else u.new_empty(0)
    return grad_u, grad_v, grad_mu, grad_mask


def soft_threshold_(mu: torch.Tensor, threshold: float) -> None:
    """In place: mu <- sign(mu) * max(|mu| - threshold, 0) (proximal step of an L1 penalty).

    A finite threshold beyond mu's dtype acts as its largest finite value, which gives the
    exact result: every finite entry becomes 0 and +-inf stays +-inf (rounded to inf, the
    threshold would turn +-inf into inf - inf = NaN).
    """
    threshold = min(float(threshold), torch.finfo(mu.dtype).max)
    mu.copy_(torch.sign(mu) * torch.clamp(mu.abs() - threshold, min=0))

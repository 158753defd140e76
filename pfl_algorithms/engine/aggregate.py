"""Weighted combinations of client rows, the server's basic reduction."""
from __future__ import annotations

import torch


def average_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_i weights[i] · rows[i] for rows [M, P] and weights [M]: the [P] combination."""
    if rows.dim() != 2 or weights.shape != (rows.shape[0],):
        raise ValueError(f"rows must be [M, P] and weights [M], got {list(rows.shape)} and {list(weights.shape)}")
    return torch.mv(rows.t(), weights.to(rows.dtype))

"""Weighted combinations of client rows: the server's basic reduction, one op over a bank slice."""
from __future__ import annotations

from typing import Optional

import torch

from pfl_kernels.ops import weighted_average


def average_rows(rows: torch.Tensor, weights: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ_i weights[i] · rows[i] for rows [M, P] (e.g. ``bank.data[:, span]``, a strided view) and
    weights [M]: the [P] combination.

    Clients outside the round get weight 0 and are never read (``weighted_average``'s rule),
    so the whole bank can be passed without gathering the senders' rows first; a diverged
    (NaN) client with weight 0 cannot reach the result.
    """
    if rows.dim() != 2 or weights.shape != (rows.shape[0],):
        raise ValueError(f"rows must be [M, P] and weights [M], got {list(rows.shape)} and {list(weights.shape)}")
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    result = weighted_average(weights.to(device=rows.device, dtype=acc)[None], rows,
                              out=None if out is None else out[None])
    return result[0]

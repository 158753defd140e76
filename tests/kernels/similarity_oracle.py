"""An exact statement of the similarity ops for tests: Python decimals (60 digits, an exponent
range no float reaches), so extreme rows (1e19 in float32, 1e-30, 1e160 in float64) and
non-finite rows have an answer that owes nothing to the scaling the kernels use.

The contract (``pfl_kernels/reference/similarity.py``): a row of x with a NaN or ±Inf entry
makes its row of the result NaN (and its column when y is None, its own entry included); a
non-finite row of y makes its column NaN; everything else is the exact value rounded.
"""
from __future__ import annotations

import math
from decimal import Decimal, localcontext
from typing import Optional

import torch

F64 = torch.float64


def _rows(t: torch.Tensor):
    """Each row as (finite, [Decimal]): the float values exactly (bfloat16 upcasts exactly)."""
    out = []
    for row in t.detach().to(F64).cpu().tolist():
        finite = all(math.isfinite(v) for v in row)
        out.append((finite, [Decimal(v) for v in row] if finite else None))
    return out


def _to_float(v: Decimal) -> float:
    """The nearest float64 (±inf beyond its range)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def cosine(x: torch.Tensor, y: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """c[i, j] = clamp(x_i·y_j / (max(‖x_i‖, eps)·max(‖y_j‖, eps)), -1, 1) exactly, NaN for
    non-finite rows; float64 [K, M]."""
    xs = _rows(x)
    ys = xs if y is None else _rows(y)
    out = torch.empty(len(xs), len(ys), dtype=F64)
    with localcontext() as ctx:
        ctx.prec = 60
        e = Decimal(eps)
        norm = lambda r: max(sum(v * v for v in r).sqrt(), e)  # noqa: E731
        nx = [norm(r) if ok else None for ok, r in xs]
        ny = nx if y is None else [norm(r) if ok else None for ok, r in ys]
        for i, (oki, ri) in enumerate(xs):
            for j, (okj, rj) in enumerate(ys):
                if not (oki and okj):
                    out[i, j] = math.nan
                    continue
                c = sum(a * b for a, b in zip(ri, rj)) / (nx[i] * ny[j])
                out[i, j] = min(1.0, max(-1.0, _to_float(c)))
    return out


def sqdist(x: torch.Tensor, y: Optional[torch.Tensor]):
    """(d, scale): d[i, j] = ‖x_i − y_j‖² exactly (0 on the diagonal when y is None), NaN for
    non-finite rows, as float64 (inf beyond its range); scale[i, j] = ‖x_i‖² + ‖y_j‖², the
    size the expanded form's rounding error is relative to."""
    xs = _rows(x)
    ys = xs if y is None else _rows(y)
    d = torch.empty(len(xs), len(ys), dtype=F64)
    scale = torch.empty_like(d)
    with localcontext() as ctx:
        ctx.prec = 60
        for i, (oki, ri) in enumerate(xs):
            for j, (okj, rj) in enumerate(ys):
                if not (oki and okj):
                    d[i, j] = scale[i, j] = math.nan
                    continue
                d[i, j] = 0.0 if y is None and i == j else _to_float(sum((a - b) ** 2 for a, b in zip(ri, rj)))
                scale[i, j] = _to_float(sum(a * a for a in ri) + sum(b * b for b in rj))
    return d, scale

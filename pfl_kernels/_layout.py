"""How a factor matrix M of shape (R, C) is laid onto a weight tensor.

Every layout in the table of the README is one rule: view M as [R, A, B] and W as
[A, R, B], then ``W[a, r, b] = M[r, a*B + b]``.  So a kernel needs only (R, C, A, B):

* ``spatial`` (Factorized-FL): R = kh*kw, C = O*I, A = C, B = 1 (W is Mᵀ in memory);
* ``linear``: R = I, C = O, A = C, B = 1 (again Mᵀ);
* ``view`` (the authors' released code): R = kh*kw, C = O*I, A = 1, B = C (W is M);
* ``simfed`` (SimFed Eq. 6): R = I*kh, C = O*kw, A = O, B = kw.

I is in_channels / groups, as in ``nn.Conv2d.weight``.
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

from .ops._memo import metadata_cached

LAYOUTS = ("spatial", "simfed", "view", "linear")


class LayoutGeometry(NamedTuple):
    """Sizes of a layout: M is (rows, cols); W viewed as [outer, rows, inner]."""

    rows: int
    cols: int
    outer: int
    inner: int


def _sizes(shape: Sequence[int]) -> tuple[int, ...]:
    """The sizes of ``shape`` as ints; TypeError naming ``shape`` for one that is not an int (a
    float such as 3.0 passed here and failed in torch's dispatcher with a RuntimeError).
    Anything with ``__index__`` is an int, as for torch's size arguments (a numpy int, a
    SymInt); a bool is not."""
    sizes = []
    for i, size in enumerate(shape):
        try:
            if isinstance(size, bool):
                raise TypeError
            sizes.append(operator.index(size))
        except TypeError:
            raise TypeError(f"shape must hold ints, got {type(size).__name__} {size!r} at index {i}") from None
    return tuple(sizes)


@metadata_cached
def layout_geometry(shape: Sequence[int], layout: str) -> LayoutGeometry:
    """Return (R, C, A, B) for a weight of ``shape`` under ``layout``.

    Raises:
        TypeError: a size that is not an int (3.0 included).
        ValueError: unknown layout, or a shape of the wrong rank or with a size < 1.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shape = _sizes(shape)
    want = 2 if layout == "linear" else 4
    if len(shape) != want:
        kind = "[out_features, in_features]" if want == 2 else "[O, I, kh, kw]"
        raise ValueError(f"shape must be {kind} ({want} sizes) for layout {layout!r}, got {list(shape)}")
    if any(s < 1 for s in shape):
        raise ValueError(f"shape must have sizes >= 1, got {list(shape)}")
    if layout == "linear":
        out_f, in_f = shape
        return LayoutGeometry(in_f, out_f, out_f, 1)
    out_c, in_c, kh, kw = shape
    if layout == "spatial":
        return LayoutGeometry(kh * kw, out_c * in_c, out_c * in_c, 1)
    if layout == "view":
        return LayoutGeometry(kh * kw, out_c * in_c, 1, out_c * in_c)
    return LayoutGeometry(in_c * kh, out_c * kw, out_c, kw)  # simfed

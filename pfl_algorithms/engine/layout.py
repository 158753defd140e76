"""Where each tensor of a model lives in a flat client-state vector.

A :class:`FlatLayout` lists a module's parameters (or buffers) of one dtype in a fixed order
with their offsets, so that a client's whole state is one row of a bank and every tensor is a
view of that row.  Tensors can be ordered by group (e.g. body first, head last), which makes
each group one contiguous range: aggregating "what is sent" is then one op over a [K, P']
slice instead of a loop over tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class Entry:
    """One tensor in a flat vector: ``flat[offset : offset + numel].view(shape)``."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def stop(self) -> int:
        return self.offset + self.numel


class FlatLayout:
    """An ordered list of named tensors of one dtype packed into a flat vector."""

    def __init__(self, entries: Sequence[Entry], dtype: torch.dtype):
        self.entries = tuple(entries)
        self.dtype = dtype
        self.by_name = {e.name: e for e in self.entries}
        if len(self.by_name) != len(self.entries):
            raise ValueError("layout entries must have distinct names")
        self.numel = self.entries[-1].stop if self.entries else 0

    @classmethod
    def of_tensors(cls, named: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype,
                   order: Optional[Callable[[str], int]] = None) -> "FlatLayout":
        """Pack ``(name, tensor)`` pairs; ``order(name)`` (stable) sorts them into groups."""
        named = list(named)
        if order is not None:
            named.sort(key=lambda item: order(item[0]))
        entries, offset = [], 0
        for name, t in named:
            entries.append(Entry(name, tuple(t.shape), offset))
            offset += t.numel()
        return cls(entries, dtype)

    @classmethod
    def parameters_of(cls, module: nn.Module, *, order: Optional[Callable[[str], int]] = None) -> "FlatLayout":
        """The floating parameters of ``module`` (all must share one dtype)."""
        params = list(module.named_parameters())
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) > 1:
            raise ValueError(f"the module's parameters must share one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32
        return cls.of_tensors(params, dtype=dtype, order=order)

    @classmethod
    def buffers_of(cls, module: nn.Module, *, floating: bool,
                   order: Optional[Callable[[str], int]] = None) -> "FlatLayout":
        """The module's floating buffers (``floating=True``) or its integer ones (e.g. BatchNorm's
        ``num_batches_tracked``), each kind in its own layout so no value is ever cast;
        ``order(name)`` (stable) sorts them into groups."""
        named = [(n, b) for n, b in module.named_buffers() if b.is_floating_point() == floating]
        dtypes = {b.dtype for _, b in named}
        if len(dtypes) > 1:
            raise ValueError(f"the module's {'floating' if floating else 'integer'} buffers must share one "
                             f"dtype, got {sorted(map(str, dtypes))}")
        default = torch.float32 if floating else torch.int64
        return cls.of_tensors(named, dtype=dtypes.pop() if dtypes else default, order=order)

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def ranges(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """The offsets of ``names`` as sorted, merged ``(start, stop)`` ranges."""
        spans = sorted((self.by_name[n].offset, self.by_name[n].stop) for n in self._known(names))
        merged: list[tuple[int, int]] = []
        for start, stop in spans:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        return merged

    def span(self, names: Iterable[str]) -> slice:
        """The one contiguous range holding exactly ``names`` (ValueError if they are not one)."""
        ranges = self.ranges(names)
        if len(ranges) > 1:
            raise ValueError(f"{sorted(names)} are not contiguous in this layout; order it by group")
        return slice(*ranges[0]) if ranges else slice(0, 0)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor as a view of ``flat`` ([..., numel]; leading dims are kept)."""
        if flat.shape[-1] != self.numel:
            raise ValueError(f"flat must have {self.numel} entries in its last dim, got {list(flat.shape)}")
        lead = flat.shape[:-1]
        return {e.name: flat[..., e.offset:e.stop].view(tuple(lead) + e.shape) for e in self.entries}

    def _known(self, names: Iterable[str]) -> list[str]:
        names = list(names)
        unknown = [n for n in names if n not in self.by_name]
        if unknown:
            raise KeyError(f"not in the layout: {unknown}; known: {self.names()}")
        return names

    def __repr__(self) -> str:
        return f"FlatLayout({len(self.entries)} tensors, {self.numel} {self.dtype})"

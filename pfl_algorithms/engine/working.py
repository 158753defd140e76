"""One template module whose parameters, gradients and buffers are views of flat vectors.

Clients are trained one after another on the same module: loading a client copies its bank
rows into the flat working vectors (one copy per bank, no per-tensor Python work), training
runs the module as usual (autograd accumulates every ``.grad`` in place into the flat
gradient vector), the optimizer steps the flat vectors with a handful of fused ops, and
storing copies the rows back.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
from torch import nn

from .layout import FlatLayout


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


class WorkingModel:
    """``module`` rebound so that its state lives in flat vectors.

    Attributes:
        params: [P] flat parameters (``module``'s parameters are views of it).
        grads: [P] flat gradients (every parameter's ``.grad`` is a view of it).
        buffers / int_buffers: flat floating / integer buffers (BatchNorm statistics).
    """

    def __init__(self, module: nn.Module, *, order: Optional[Callable[[str], int]] = None,
                 buffer_order: Optional[Callable[[str], int]] = None):
        self.module = module
        self._orders = (order, buffer_order)
        self.layout = FlatLayout.parameters_of(module, order=order)
        self.buffer_layout = FlatLayout.buffers_of(module, floating=True, order=buffer_order)
        self.int_buffer_layout = FlatLayout.buffers_of(module, floating=False)
        device = next(module.parameters()).device
        self.params = torch.empty(self.layout.numel, dtype=self.layout.dtype, device=device)
        self.grads = torch.zeros_like(self.params)
        self.buffers = torch.empty(self.buffer_layout.numel, dtype=self.buffer_layout.dtype, device=device)
        self.int_buffers = torch.empty(self.int_buffer_layout.numel, dtype=self.int_buffer_layout.dtype,
                                       device=device)
        self._bind()

    def _bind(self) -> None:
        current = dict(self.module.named_parameters())
        # A parameter tied into several modules (pFedMB's shared α) has one entry in the layout
        # under its first name; every module holding it must get the same flat-vector view.
        aliases: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        param_views = self.layout.views(self.params)
        grad_views = self.layout.views(self.grads)
        with torch.no_grad():
            for name, view in param_views.items():
                view.copy_(current[name])
                param = nn.Parameter(view, requires_grad=current[name].requires_grad)
                param.grad = grad_views[name]
                for alias in aliases[id(current[name])]:
                    owner, leaf = _owner(self.module, alias)
                    owner._parameters[leaf] = param
            for layout, flat in ((self.buffer_layout, self.buffers), (self.int_buffer_layout, self.int_buffers)):
                current_buffers = dict(self.module.named_buffers())
                for name, view in layout.views(flat).items():
                    view.copy_(current_buffers[name])
                    owner, leaf = _owner(self.module, name)
                    owner._buffers[leaf] = view

    def copy(self) -> "WorkingModel":
        """An independent working model of a deep copy of the module, with the same layouts."""
        order, buffer_order = self._orders
        return WorkingModel(copy.deepcopy(self.module), order=order, buffer_order=buffer_order)

    def zero_grad(self) -> None:
        """Zero the flat gradient (the ``.grad`` views stay bound)."""
        self.grads.zero_()

    @torch.no_grad()
    def load(self, params: torch.Tensor, buffers: Optional[torch.Tensor] = None,
             int_buffers: Optional[torch.Tensor] = None) -> None:
        """Copy a client's rows into the working vectors (``store_into``: an empty row into an
        empty vector, a model without buffers, is skipped, each copy a dispatch per client)."""
        self.params.copy_(params)
        for mine, row in ((self.buffers, buffers), (self.int_buffers, int_buffers)):
            if row is not None:
                store_into(mine, row)

    @torch.no_grad()
    def store(self, params: torch.Tensor, buffers: Optional[torch.Tensor] = None,
              int_buffers: Optional[torch.Tensor] = None) -> None:
        """Copy the working vectors into a client's rows."""
        params.copy_(self.params)
        if buffers is not None:
            buffers.copy_(self.buffers)
        if int_buffers is not None:
            int_buffers.copy_(self.int_buffers)

    def bound(self) -> bool:
        """Whether the module still uses the flat vectors (nothing replaced its tensors)."""
        base = self.params.untyped_storage().data_ptr()
        return all(p.untyped_storage().data_ptr() == base for p in self.module.parameters())


@torch.no_grad()
def store_into(row: torch.Tensor, value: torch.Tensor, where: Optional[torch.Tensor] = None) -> None:
    """``row <- value``; with ``where`` (a 0-dim bool tensor on ``row``'s device), only if it
    holds: an elementwise select into ``row`` itself, bit for bit either value, and no sync.
    Both empty (a model without buffers): nothing to do, and no dispatch."""
    if row.numel() == 0 and value.numel() == 0:
        return
    if where is None:
        row.copy_(value)
    else:
        torch.where(where, value, row, out=row)

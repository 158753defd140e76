"""Rank-r-plus-sparse weight reconstruction (Factorized-FL Eq. 2, SimFed Eq. 6).

Ops in the ``pfl`` namespace:

* ``factorized_weight(u, v, mu, mask, *, shape, layout) -> W``
* ``factorized_weight_backward(grad_w, u, v, mu, mask, *, shape, layout, output_mask)``
  ``-> (grad_u, grad_v, grad_mu, grad_mask)``; a gradient not asked for by
  ``output_mask`` (or whose input is None) is an empty tensor of shape [0].
* ``soft_threshold_(mu, threshold)``: in-place proximal L1 step.

At the op level every tensor has the same number of dimensions (2, or 3 with the same
client count K); the Python wrappers below broadcast shared (2-D) factors over K.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._layout import layout_geometry
from ..reference import factorized as ref
from ._checks import check_same, check_tensor, client_count
from ._library import define_op, has_kernel
from ._vmap import fold_vmap_dim, logical_dim, unfold_gradients


def _check_op_args(u, v, mu, mask, shape, layout, grad_w=None):
    """Checks of the op contract that also hold under tracing (fake tensors)."""
    rows, cols, _, _ = layout_geometry(shape, layout)
    torch._check(u.dim() in (2, 3), lambda: f"u must be [R, r] or [K, R, r], got {list(u.shape)}")
    torch._check(v.dim() == u.dim(), lambda: f"v must have u's {u.dim()} dims, got {list(v.shape)}")
    torch._check(u.shape[-2] == rows, lambda: f"u must have R={rows} rows for shape {list(shape)} "
                 f"and layout {layout!r}, got {list(u.shape)}")
    torch._check(v.shape[-1] == cols, lambda: f"v must have C={cols} columns for shape {list(shape)} "
                 f"and layout {layout!r}, got {list(v.shape)}")
    torch._check(v.shape[-2] == u.shape[-1], lambda: f"v must have rank {u.shape[-1]} rows (u's last dim), "
                 f"got {list(v.shape)}")
    lead = list(u.shape[:-2])
    for name, t in (("mu", mu), ("mask", mask)):
        if t is not None:
            torch._check(list(t.shape) == lead + [rows, cols],
                         lambda: f"{name} must have shape {lead + [rows, cols]}, got {list(t.shape)}")
    for name, t in (("v", v), ("mu", mu), ("mask", mask), ("grad_w", grad_w)):
        if t is not None:
            torch._check(t.dtype == u.dtype, lambda: f"{name} must have u's dtype {u.dtype}, got {t.dtype}")
            torch._check(t.device == u.device, lambda: f"{name} must be on u's device {u.device}, got {t.device}")
    torch._check(mask is None or mu is not None, lambda: "mask given without mu")
    if u.dim() == 3:
        torch._check(v.shape[0] == u.shape[0], lambda: f"v must have u's {u.shape[0]} clients")
    if grad_w is not None:
        torch._check(list(grad_w.shape) == lead + list(shape),
                     lambda: f"grad_w must have shape {lead + list(shape)}, got {list(grad_w.shape)}")
    return lead


def _reference_forward(u, v, mu=None, mask=None, *, shape, layout="spatial"):
    _check_op_args(u, v, mu, mask, shape, layout)
    return ref.factorized_weight(u, v, mu, mask, shape=shape, layout=layout)


def _reference_backward(grad_w, u, v, mu, mask, *, shape, layout, output_mask):
    _check_op_args(u, v, mu, mask, shape, layout, grad_w)
    return ref.factorized_weight_backward(grad_w, u, v, mu, mask, shape=shape, layout=layout,
                                          output_mask=output_mask)


# The reference runs wherever no kernel is registered; it checks the op contract like the
# kernels do, so a direct torch.ops call with bad input fails the same way on every device.
FACTORIZED_WEIGHT = define_op(
    "factorized_weight(Tensor u, Tensor v, Tensor? mu=None, Tensor? mask=None, *, "
    "SymInt[] shape, str layout='spatial') -> Tensor",
    _reference_forward,
)
FACTORIZED_WEIGHT_BACKWARD = define_op(
    "factorized_weight_backward(Tensor grad_w, Tensor u, Tensor v, Tensor? mu, Tensor? mask, *, "
    "SymInt[] shape, str layout, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)",
    _reference_backward,
)
SOFT_THRESHOLD = define_op("soft_threshold_(Tensor(a!) mu, float threshold) -> ()", ref.soft_threshold_)


@torch.library.register_fake(FACTORIZED_WEIGHT)
def _factorized_weight_fake(u, v, mu=None, mask=None, *, shape, layout="spatial"):
    lead = _check_op_args(u, v, mu, mask, shape, layout)
    return u.new_empty(lead + list(shape))


@torch.library.register_fake(FACTORIZED_WEIGHT_BACKWARD)
def _factorized_weight_backward_fake(grad_w, u, v, mu, mask, *, shape, layout, output_mask):
    _check_op_args(u, v, mu, mask, shape, layout, grad_w)
    shapes = (u.shape, v.shape, None if mu is None else mu.shape, None if mask is None else mask.shape)
    return tuple(u.new_empty(s if wanted and s is not None else (0,)) for s, wanted in zip(shapes, output_mask))


@torch.library.register_fake(SOFT_THRESHOLD)
def _soft_threshold_fake(mu, threshold):
    torch._check(threshold >= 0, lambda: f"threshold must be >= 0, got {threshold}")


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    # Optional inputs left at their default are absent from ``inputs``.
    u, v, mu, mask = tuple(inputs) + (None,) * (4 - len(inputs))
    ctx.save_for_backward(u, v, mu, mask)
    ctx.shape = keyword_only_inputs["shape"]
    ctx.layout = keyword_only_inputs["layout"]


def _backward(ctx, grad_w):
    u, v, mu, mask = ctx.saved_tensors
    need = tuple(ctx.needs_input_grad) + (False,) * (4 - len(ctx.needs_input_grad))
    output_mask = [need[0], need[1], need[2] and mu is not None, need[3] and mask is not None]
    grads = torch.ops.pfl.factorized_weight_backward(
        grad_w, u, v, mu, mask, shape=ctx.shape, layout=ctx.layout, output_mask=output_mask)
    n_inputs = len(ctx.needs_input_grad)
    return tuple(g if wanted else None for g, wanted in zip(grads, output_mask))[:n_inputs]


# The C++ extension registers the same autograd formula for the Autograd key (no Python
# round trip per call, csrc/autograd/factorized.cpp); without it, register it here.
if not has_kernel(FACTORIZED_WEIGHT, "Autograd"):
    torch.library.register_autograd(FACTORIZED_WEIGHT, _backward, setup_context=_setup_context)


@torch.library.register_vmap(FACTORIZED_WEIGHT)
def _factorized_weight_vmap(info, in_dims, u, v, mu=None, mask=None, *, shape, layout="spatial"):
    has_clients = logical_dim(u, in_dims[0]) == 3
    (u, v, mu, mask), unfold = fold_vmap_dim(info, in_dims, (u, v, mu, mask), has_clients)
    return unfold(torch.ops.pfl.factorized_weight(u, v, mu, mask, shape=shape, layout=layout)), 0


@torch.library.register_vmap(FACTORIZED_WEIGHT_BACKWARD)
def _factorized_weight_backward_vmap(info, in_dims, grad_w, u, v, mu, mask, *, shape, layout, output_mask):
    has_clients = logical_dim(u, in_dims[1]) == 3
    (grad_w, u, v, mu, mask), unfold = fold_vmap_dim(info, in_dims, (grad_w, u, v, mu, mask), has_clients)
    grads = torch.ops.pfl.factorized_weight_backward(grad_w, u, v, mu, mask, shape=shape, layout=layout,
                                                     output_mask=output_mask)
    asked = [m and t is not None for m, t in zip(output_mask, (u, v, mu, mask))]
    return unfold_gradients(grads, asked, unfold)


def factorized_weight(u: torch.Tensor, v: torch.Tensor, mu: Optional[torch.Tensor] = None,
                      mask: Optional[torch.Tensor] = None, *, shape: Sequence[int],
                      layout: str = "spatial") -> torch.Tensor:
    """Reconstruct a weight from its factors: ``W = place(u @ v + mu * mask, shape, layout)``.

    Factorized-FL Eq. 2 (W = u vᵀ ⊕ μ, rank r) and SimFed Eq. 6; see ``pfl_kernels._layout``
    for how each ``layout`` places the (R, C) matrix onto ``shape``.

    Args:
        u: [R, r] or [K, R, r] (K clients).
        v: [r, C] or [K, r, C].
        mu: optional sparse bias [R, C] or [K, R, C].
        mask: optional mask on mu, [R, C] or [K, R, C]; a bool mask is converted to mu's dtype.
        shape: the weight shape, [O, I, kh, kw] (conv; I = in_channels / groups) or
            [out_features, in_features] (layout 'linear').
        layout: 'spatial' | 'simfed' | 'view' | 'linear'.

    Factors without the client dimension are shared by all K clients.

    Returns:
        W of shape [*shape], or [K, *shape] if any factor has a client dimension.

    Raises:
        TypeError: non-tensor or non-floating input, dtypes that differ.
        ValueError: unknown layout, factor shapes that do not fit ``shape``, devices that differ,
            mask without mu, client counts that differ.
    """
    rows, cols, _, _ = layout_geometry(shape, layout)
    check_tensor("u", u, dims=(2, 3))
    check_tensor("v", v, dims=(2, 3))
    check_same("u", u, "v", v)
    if mu is not None:
        check_tensor("mu", mu, dims=(2, 3))
        check_same("u", u, "mu", mu)
    if mask is not None:
        if mu is None:
            raise ValueError("mask was given without mu: the mask multiplies the sparse bias mu")
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            mask = mask.to(u.dtype)
        check_tensor("mask", mask, dims=(2, 3))
        check_same("u", u, "mask", mask)
    if u.shape[-2] != rows:
        raise ValueError(f"u must have R={rows} rows for shape {list(shape)} and layout {layout!r}, "
                         f"got u of shape {list(u.shape)}")
    if u.shape[-1] < 1:
        raise ValueError(f"u must have rank >= 1 (its last dim), got shape {list(u.shape)}")
    if v.shape[-2] != u.shape[-1] or v.shape[-1] != cols:
        raise ValueError(f"v must have shape [..., {u.shape[-1]}, {cols}] (rank of u, C for shape "
                         f"{list(shape)} and layout {layout!r}), got {list(v.shape)}")
    for name, t in (("mu", mu), ("mask", mask)):
        if t is not None and tuple(t.shape[-2:]) != (rows, cols):
            raise ValueError(f"{name} must have shape [..., {rows}, {cols}], got {list(t.shape)}")
    k = client_count({"u": u, "v": v, "mu": mu, "mask": mask}, base_dims=2)
    if k is not None:
        u, v, mu, mask = (None if t is None else (t if t.dim() == 3 else t.expand(k, *t.shape))
                          for t in (u, v, mu, mask))
    return torch.ops.pfl.factorized_weight(u, v, mu, mask, shape=list(shape), layout=layout)


def soft_threshold_(mu: torch.Tensor, threshold: float) -> torch.Tensor:
    """In place ``mu <- sign(mu) * max(|mu| - threshold, 0)`` and return ``mu``.

    The proximal step of the L1 penalty ``threshold * ||mu||_1`` (Factorized-FL Eq. 6's
    sparsity term, with threshold = lr * lambda), which produces exact zeros.  Any shape,
    so a bank of clients' mu [K, R, C] is one call.  Call it under ``torch.no_grad()``.

    Raises:
        TypeError: mu not a floating tensor.  ValueError: threshold negative or not finite.
    """
    if not isinstance(mu, torch.Tensor) or mu.dtype not in (torch.float16, torch.bfloat16,
                                                          torch.float32, torch.float64):
        raise TypeError(f"mu must be a floating torch.Tensor, got {getattr(mu, 'dtype', type(mu))}")
    threshold = float(threshold)
    if not threshold >= 0 or threshold == float("inf"):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold}")
    torch.ops.pfl.soft_threshold_(mu, threshold)
    return mu

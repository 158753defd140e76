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

import math
from typing import Optional, Sequence

import torch

from .._layout import layout_geometry
from ..reference import factorized as ref
from ._checks import (FLOAT_DTYPES, check_is_tensor, check_no_internal_overlap, check_same, check_tensor, client_count,
                      real_number)
from ._memo import metadata_cached
from ._eager import kernel_for
from ._library import define_op, has_kernel, register_autograd, sum_defined
from ._vmap import fold_vmap_dim, logical_dim, unfold_gradients


@metadata_cached
def _check_op_args(u, v, mu, mask, shape, layout, grad_w=None):
    """Checks of the op contract that also hold under tracing (fake tensors)."""
    rows, cols, _, _ = layout_geometry(shape, layout)
    torch._check_value(u.dim() in (2, 3), lambda: f"u must be [R, r] or [K, R, r], got {list(u.shape)}")
    torch._check_value(v.dim() == u.dim(), lambda: f"v must have u's {u.dim()} dims, got {list(v.shape)}")
    torch._check_value(u.shape[-2] == rows, lambda: f"u must have R={rows} rows for shape {list(shape)} "
                       f"and layout {layout!r}, got {list(u.shape)}")
    torch._check_value(v.shape[-1] == cols, lambda: f"v must have C={cols} columns for shape {list(shape)} "
                       f"and layout {layout!r}, got {list(v.shape)}")
    torch._check_value(v.shape[-2] == u.shape[-1], lambda: f"v must have rank {u.shape[-1]} rows (u's last dim), "
                       f"got {list(v.shape)}")
    lead = list(u.shape[:-2])
    for name, t in (("mu", mu), ("mask", mask)):
        if t is not None:
            torch._check_value(list(t.shape) == lead + [rows, cols],
                               lambda: f"{name} must have shape {lead + [rows, cols]}, got {list(t.shape)}")
    for name, t in (("v", v), ("mu", mu), ("mask", mask), ("grad_w", grad_w)):
        if t is not None:
            torch._check_type(t.dtype == u.dtype, lambda: f"{name} must have u's dtype {u.dtype}, got {t.dtype}")
            torch._check_value(t.device == u.device, lambda: f"{name} must be on u's device {u.device}, got {t.device}")
    torch._check_type(u.dtype in FLOAT_DTYPES, lambda: f"u must be a floating tensor, got {u.dtype}")
    torch._check_value(mask is None or mu is not None, lambda: "mask given without mu")
    if u.dim() == 3:
        torch._check_value(v.shape[0] == u.shape[0], lambda: f"v must have u's {u.shape[0]} clients")
    if grad_w is not None:
        torch._check_value(list(grad_w.shape) == lead + list(shape),
                           lambda: f"grad_w must have shape {lead + list(shape)}, got {list(grad_w.shape)}")
    return lead


def _reference_forward(u, v, mu=None, mask=None, *, shape, layout="spatial"):
    _check_op_args(u, v, mu, mask, shape, layout)
    return ref.factorized_weight(u, v, mu, mask, shape=shape, layout=layout)


@metadata_cached
def _check_soft_threshold_args(mu, threshold):
    """Checks of soft_threshold_ that also hold under tracing (the C++ kernel's, in its order)."""
    torch._check_type(mu.dtype in FLOAT_DTYPES, lambda: f"mu must be a floating tensor, got {mu.dtype}")
    torch._check_value(0 <= threshold < math.inf, lambda: f"threshold must be a finite number >= 0, got {threshold}")
    # Elements that share memory would be shrunk twice.
    check_no_internal_overlap("mu", mu)


def _reference_soft_threshold(mu, threshold):
    _check_soft_threshold_args(mu, threshold)
    ref.soft_threshold_(mu, threshold)


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
SOFT_THRESHOLD = define_op("soft_threshold_(Tensor(a!) mu, float threshold) -> ()", _reference_soft_threshold)


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
    _check_soft_threshold_args(mu, threshold)


# ---- autograd, every order ------------------------------------------------------------------
#
# The backward is linear in grad_w and bilinear in the factors, so every derivative of either
# op is again made of the two ops (and elementwise products): gradients of any order and
# forward mode follow from the two functions below.  csrc/autograd/factorized.cpp registers
# the same formulas in C++ (no Python round trip per call); without the extension they are
# registered here.

def _weight_derivative(u, v, mu, mask, du, dv, dmu, dmask, *, shape, layout):
    """place(du·v + u·dv + dmu∘mask + mu∘dmask), the derivative of ``factorized_weight`` at
    (u, v, mu, mask) in the direction (du, dv, dmu, dmask), where None is no change; None
    when nothing changes.  It is also the adjoint of the backward's linear map grad_w ->
    grads, so it gives the gradient of ``factorized_weight_backward`` with respect to grad_w.
    """
    sparse = None
    if dmu is not None:
        sparse = dmu * mask if mask is not None else dmu
    if dmask is not None and mask is not None:
        sparse = sum_defined(sparse, mu * dmask)
    if du is not None and dv is not None:  # du·v + u·dv as one rank-2r product
        fu, fv = torch.cat([du, u], -1), torch.cat([v, dv], -2)
    elif du is not None or dv is not None:
        fu, fv = (du, v) if du is not None else (u, dv)
    elif sparse is not None:  # place(sparse) alone: a zero rank-r product adds nothing
        fu, fv = u, torch.zeros_like(v)
    else:
        return None
    return torch.ops.pfl.factorized_weight(fu, fv, sparse, None, shape=shape, layout=layout)


def _backward_derivative(grad_w, u, v, mu, mask, du, dv, dmu, dmask, wanted, *, shape, layout):
    """The outputs of ``factorized_weight_backward(grad_w, ...)`` that vary along (du, dv, dmu,
    dmask): (G·dvᵀ, duᵀ·G, G∘dmask, G∘dmu) with G = grad_w in (R, C) order, None where the
    output is not ``wanted`` or does not vary.  The same four products are the gradients of
    the backward op's (u, v, mu, mask) for incoming gradients (du, dv, dmu, dmask).
    """
    has_mask = mask is not None
    output_mask = [wanted[0] and dv is not None, wanted[1] and du is not None,
                   wanted[2] and has_mask and dmask is not None, wanted[3] and has_mask and dmu is not None]
    if not any(output_mask):
        return (None,) * 4
    pick = [d if d is not None else t for d, t in zip((du, dv, dmu, dmask), (u, v, mu, mask))]
    grads = torch.ops.pfl.factorized_weight_backward(grad_w, *pick, shape=shape, layout=layout,
                                                     output_mask=output_mask)
    return tuple(g if m else None for g, m in zip(grads, output_mask))


def _present(grads, output_mask):
    """The incoming gradients of the outputs asked for (the others are empty placeholders)."""
    return [g if m else None for g, m in zip(grads, output_mask)]


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.save_for_forward(*inputs)
    ctx.shape = keyword_only_inputs["shape"]
    ctx.layout = keyword_only_inputs["layout"]


def _backward(ctx, grad_w):
    u, v, mu, mask = ctx.saved_tensors
    need = ctx.needs_input_grad
    output_mask = [need[0], need[1], need[2] and mu is not None, need[3] and mask is not None]
    if grad_w is None or not any(output_mask):
        return (None,) * 4
    grads = torch.ops.pfl.factorized_weight_backward(
        grad_w, u, v, mu, mask, shape=ctx.shape, layout=ctx.layout, output_mask=output_mask)
    return tuple(_present(grads, output_mask))


def _jvp(ctx, du, dv, dmu, dmask):
    u, v, mu, mask = ctx.saved_tensors
    return _weight_derivative(u, v, mu, mask, du, dv, dmu, dmask, shape=ctx.shape, layout=ctx.layout)


def _backward_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.save_for_forward(*inputs)
    ctx.shape = keyword_only_inputs["shape"]
    ctx.layout = keyword_only_inputs["layout"]
    # A gradient is computed where it is asked for and its input is given; the others are
    # empty placeholders.
    ctx.output_mask = [m and t is not None for m, t in zip(keyword_only_inputs["output_mask"], inputs[1:])]
    ctx.mark_non_differentiable(*(g for g, m in zip(output, ctx.output_mask) if not m))


def _backward_backward(ctx, *grads):
    grad_w, u, v, mu, mask = ctx.saved_tensors
    directions = _present(grads, ctx.output_mask)
    kw = {"shape": ctx.shape, "layout": ctx.layout}
    grad_grad_w = _weight_derivative(u, v, mu, mask, *directions, **kw) if ctx.needs_input_grad[0] else None
    return (grad_grad_w, *_backward_derivative(grad_w, u, v, mu, mask, *directions, ctx.needs_input_grad[1:], **kw))


def _backward_jvp(ctx, dgrad_w, du, dv, dmu, dmask):
    grad_w, u, v, mu, mask = ctx.saved_tensors
    kw = {"shape": ctx.shape, "layout": ctx.layout}
    linear = [None] * 4  # the part along grad_w: the backward op itself
    if dgrad_w is not None:
        linear = _present(torch.ops.pfl.factorized_weight_backward(dgrad_w, u, v, mu, mask, output_mask=ctx.output_mask,
                                                                  **kw), ctx.output_mask)
    along_factors = _backward_derivative(grad_w, u, v, mu, mask, du, dv, dmu, dmask, ctx.output_mask, **kw)
    tangents = [sum_defined(a, b) for a, b in zip(linear, along_factors)]
    # A Python Function must give every differentiable output a tangent (None fails in torch).
    return tuple(torch.zeros_like(like) if t is None and m else t
                 for t, m, like in zip(tangents, ctx.output_mask, (u, v, mu, mask)))


# The C++ extension registers the same formulas for the Autograd key (no Python round trip
# per call, csrc/autograd/factorized.cpp); without it, register them here.
if not has_kernel(FACTORIZED_WEIGHT, "Autograd"):
    register_autograd(FACTORIZED_WEIGHT, _backward, _setup_context, _jvp)
if not has_kernel(FACTORIZED_WEIGHT_BACKWARD, "Autograd"):
    register_autograd(FACTORIZED_WEIGHT_BACKWARD, _backward_backward, _backward_setup_context, _backward_jvp)


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


@metadata_cached
def _check_wrapper_args(u, v, mu, mask, shape, layout) -> Optional[int]:
    """The wrapper's checks of ``factorized_weight`` (errors that name the argument), once per
    signature (``metadata_cached``); returns the client count K, or None."""
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
    return client_count({"u": u, "v": v, "mu": mu, "mask": mask}, base_dims=2)


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
        TypeError: non-tensor or non-floating input, dtypes that differ, a shape that is not a
            list or tuple of ints (3.0 included).
        ValueError: unknown layout, factor shapes that do not fit ``shape``, devices that differ,
            mask without mu, client counts that differ.
    """
    if not isinstance(shape, (list, tuple)):  # torch.Size is a tuple
        raise TypeError(f"shape must be a list or tuple of ints, got {type(shape).__name__}")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = mask.to(u.dtype) if isinstance(u, torch.Tensor) else mask
    k = _check_wrapper_args(u, v, mu, mask, list(shape), layout)
    if k is not None:
        u, v, mu, mask = (None if t is None else (t if t.dim() == 3 else t.expand(k, *t.shape))
                          for t in (u, v, mu, mask))
    return kernel_for("factorized_weight", u, v, mu, mask)(u, v, mu, mask, shape=list(shape), layout=layout)


def soft_threshold_(mu: torch.Tensor, threshold: float) -> torch.Tensor:
    """In place ``mu <- sign(mu) * max(|mu| - threshold, 0)`` and return ``mu``.

    The proximal step of the L1 penalty ``threshold * ||mu||_1`` (Factorized-FL Eq. 6's
    sparsity term, with threshold = lr * lambda), which produces exact zeros.  Any shape,
    so a bank of clients' mu [K, R, C] is one call.  Call it under ``torch.no_grad()``.

    Raises:
        TypeError: mu not a floating tensor; threshold not a real number (a Python or numpy
        int or float; not a bool, a str, None or a tensor, 0-d included, as for
        ``similarity_weights``' tau).  ValueError: mu not dense (sparse); threshold negative
        or not finite.
    """
    check_is_tensor("mu", mu)
    if mu.dtype not in FLOAT_DTYPES:
        raise TypeError(f"mu must be a floating torch.Tensor, got {mu.dtype}")
    threshold = _threshold(threshold)
    kernel_for("soft_threshold_", mu)(mu, threshold)
    return mu


def _threshold(value) -> float:
    """soft_threshold_'s threshold as a float: ``real_number``'s TypeError unless a real
    number; ValueError unless finite and >= 0, in the op's own words (one message for both)."""
    try:
        threshold = real_number("threshold", value)
    except ValueError:
        threshold = math.nan
    if not threshold >= 0:
        raise ValueError(f"threshold must be a finite number >= 0, got {float(value)}")
    return threshold

"""Convex combination of branches (pFedMB Eq. 1–2) and the projection onto the simplex.

Ops in the ``pfl`` namespace:

* ``branch_combine(weights, alpha) -> W``: W = Σ_b alpha[..., b] · weights[..., b, *shape].
* ``branch_combine_backward(grad_w, weights, alpha, output_mask) -> (grad_weights, grad_alpha)``:
  one pass over grad_W; a gradient not asked for is an empty tensor of shape [0].
* ``project_simplex_(x)``: in place, each row of x [..., B] onto the probability simplex; a
  row holding NaN or ±Inf comes out all NaN (every kernel: reference, C++, Triton), as a
  reduction propagates NaN.  The Python wrapper refuses such input instead (in eager mode;
  under torch.compile it cannot read the values and leaves them to the op).

At the op level ``alpha``'s shape is the leading part of ``weights``' shape: weights
[B, *shape] with alpha [B], or weights [K, B, *shape] with alpha [K, B].  The Python
wrapper also takes branches shared by all clients (weights [B, *shape], alpha [K, B]).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..reference import branch as ref
from ._checks import (FLOAT_DTYPES, check_is_tensor, check_no_internal_overlap, check_same, check_tensor, has_values,
                      values_finite)
from ._eager import kernel_for
from ._memo import metadata_cached
from ._library import define_op, has_kernel, register_autograd, sum_defined
from ._vmap import fold_vmap_dim, logical_dim, unfold_gradients


@metadata_cached
def _check_op_args(weights, alpha, grad_w=None):
    """Checks of the op contract that also hold under tracing (fake tensors)."""
    torch._check_value(alpha.dim() in (1, 2), lambda: f"alpha must be [B] or [K, B], got {list(alpha.shape)}")
    torch._check_value(alpha.shape[-1] >= 1, lambda: f"alpha must have B >= 1 branches, got {list(alpha.shape)}")
    torch._check_value(weights.dim() >= alpha.dim() and list(weights.shape[: alpha.dim()]) == list(alpha.shape),
                       lambda: f"weights must have shape [{', '.join(map(str, alpha.shape))}, *shape] to match "
                               f"alpha, got {list(weights.shape)}")
    for name, t in (("weights", weights), ("grad_w", grad_w)):
        if t is not None:
            torch._check_type(t.dtype == alpha.dtype,
                              lambda: f"{name} must have alpha's dtype {alpha.dtype}, got {t.dtype}")
            torch._check_value(t.device == alpha.device,
                               lambda: f"{name} must be on alpha's device {alpha.device}, got {t.device}")
    torch._check_type(alpha.dtype in FLOAT_DTYPES, lambda: f"alpha must be a floating tensor, got {alpha.dtype}")
    out_shape = list(weights.shape[: alpha.dim() - 1]) + list(weights.shape[alpha.dim():])
    if grad_w is not None:
        torch._check_value(list(grad_w.shape) == out_shape,
                           lambda: f"grad_w must have shape {out_shape}, got {list(grad_w.shape)}")
    return out_shape


def _reference_forward(weights, alpha):
    _check_op_args(weights, alpha)
    return ref.branch_combine(weights, alpha)


def _reference_backward(grad_w, weights, alpha, output_mask):
    _check_op_args(weights, alpha, grad_w)
    return ref.branch_combine_backward(grad_w, weights, alpha, output_mask)


@metadata_cached
def _check_project_args(x):
    """Checks of project_simplex_ that also hold under tracing (the C++ kernel's, in its order)."""
    torch._check_value(x.dim() >= 1 and x.shape[-1] >= 1,
                       lambda: f"x must be [..., B] with B >= 1, got {list(x.shape)}")
    torch._check_type(x.dtype in FLOAT_DTYPES, lambda: f"x must be a floating tensor, got {x.dtype}")
    # Rows that share memory would be projected twice, the second time from the first's result.
    check_no_internal_overlap("x", x)


def _reference_project(x):
    _check_project_args(x)
    ref.project_simplex_(x)


BRANCH_COMBINE = define_op("branch_combine(Tensor weights, Tensor alpha) -> Tensor", _reference_forward)
BRANCH_COMBINE_BACKWARD = define_op(
    "branch_combine_backward(Tensor grad_w, Tensor weights, Tensor alpha, bool[2] output_mask) "
    "-> (Tensor, Tensor)", _reference_backward)
PROJECT_SIMPLEX = define_op("project_simplex_(Tensor(a!) x) -> ()", _reference_project)


@torch.library.register_fake(BRANCH_COMBINE)
def _branch_combine_fake(weights, alpha):
    return weights.new_empty(_check_op_args(weights, alpha))


@torch.library.register_fake(BRANCH_COMBINE_BACKWARD)
def _branch_combine_backward_fake(grad_w, weights, alpha, output_mask):
    _check_op_args(weights, alpha, grad_w)
    return (weights.new_empty(weights.shape if output_mask[0] else (0,)),
            alpha.new_empty(alpha.shape if output_mask[1] else (0,)))


@torch.library.register_fake(PROJECT_SIMPLEX)
def _project_simplex_fake(x):
    _check_project_args(x)


# ---- autograd, every order ------------------------------------------------------------------
#
# branch_combine is bilinear in (weights, alpha) and its backward is linear in grad_w and
# bilinear in (weights, alpha): every derivative of either op is again made of the two ops,
# so gradients of any order and forward mode follow from the two functions below.
# csrc/autograd/branch.cpp registers the same formulas in C++; without the extension they
# are registered here.

def _combine_derivative(weights, alpha, dweights, dalpha):
    """Σ_b alpha_b·dweights_b + dalpha_b·weights_b, the derivative of ``branch_combine`` at
    (weights, alpha) in the direction (dweights, dalpha), where None is no change; None when
    nothing changes.  Also the gradient of ``branch_combine_backward`` with respect to grad_w
    for incoming gradients (dweights, dalpha)."""
    return sum_defined(None if dweights is None else torch.ops.pfl.branch_combine(dweights, alpha),
                        None if dalpha is None else torch.ops.pfl.branch_combine(weights, dalpha))


def _combine_backward_derivative(grad_w, weights, alpha, dweights, dalpha, wanted):
    """The outputs of ``branch_combine_backward(grad_w, ...)`` that vary along (dweights, dalpha):
    (dalpha_b·grad_w, ⟨grad_w, dweights_b⟩), None where not ``wanted`` or constant.  The same
    products are the gradients of the backward op's (weights, alpha) for incoming gradients
    (dweights, dalpha)."""
    output_mask = [wanted[0] and dalpha is not None, wanted[1] and dweights is not None]
    if not any(output_mask):
        return None, None
    grads = torch.ops.pfl.branch_combine_backward(grad_w, dweights if dweights is not None else weights,
                                                  dalpha if dalpha is not None else alpha, output_mask)
    return tuple(g if m else None for g, m in zip(grads, output_mask))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.save_for_forward(*inputs)


def _backward(ctx, grad_w):
    weights, alpha = ctx.saved_tensors
    output_mask = list(ctx.needs_input_grad[:2])
    if grad_w is None or not any(output_mask):
        return None, None
    grads = torch.ops.pfl.branch_combine_backward(grad_w, weights, alpha, output_mask)
    return tuple(g if m else None for g, m in zip(grads, output_mask))


def _jvp(ctx, dweights, dalpha):
    weights, alpha = ctx.saved_tensors
    return _combine_derivative(weights, alpha, dweights, dalpha)


def _backward_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.save_for_forward(*inputs[:3])
    ctx.output_mask = list(inputs[3])
    ctx.mark_non_differentiable(*(g for g, m in zip(output, ctx.output_mask) if not m))


def _backward_backward(ctx, grad_grad_weights, grad_grad_alpha):
    grad_w, weights, alpha = ctx.saved_tensors
    # Gradients of the empty placeholders (outputs not asked for) carry nothing.
    dweights, dalpha = (g if m else None for g, m in zip((grad_grad_weights, grad_grad_alpha), ctx.output_mask))
    need = ctx.needs_input_grad
    grad_grad_w = _combine_derivative(weights, alpha, dweights, dalpha) if need[0] else None
    return (grad_grad_w, *_combine_backward_derivative(grad_w, weights, alpha, dweights, dalpha, need[1:3]), None)


def _backward_jvp(ctx, dgrad_w, dweights, dalpha, _):
    grad_w, weights, alpha = ctx.saved_tensors
    linear = (None, None)  # the part along grad_w: the backward op itself
    if dgrad_w is not None:
        grads = torch.ops.pfl.branch_combine_backward(dgrad_w, weights, alpha, ctx.output_mask)
        linear = tuple(g if m else None for g, m in zip(grads, ctx.output_mask))
    along = _combine_backward_derivative(grad_w, weights, alpha, dweights, dalpha, ctx.output_mask)
    tangents = [sum_defined(a, b) for a, b in zip(linear, along)]
    # A Python Function must give every differentiable output a tangent (None fails in torch).
    return tuple(torch.zeros_like(like) if t is None and m else t
                 for t, m, like in zip(tangents, ctx.output_mask, (weights, alpha)))


# As for factorized_weight: C++ autograd when the extension is loaded, else these.
if not has_kernel(BRANCH_COMBINE, "Autograd"):
    register_autograd(BRANCH_COMBINE, _backward, _setup_context, _jvp)
if not has_kernel(BRANCH_COMBINE_BACKWARD, "Autograd"):
    register_autograd(BRANCH_COMBINE_BACKWARD, _backward_backward, _backward_setup_context, _backward_jvp)


@torch.library.register_vmap(BRANCH_COMBINE)
def _branch_combine_vmap(info, in_dims, weights, alpha):
    has_clients = logical_dim(alpha, in_dims[1]) == 2
    (weights, alpha), unfold = fold_vmap_dim(info, in_dims, (weights, alpha), has_clients)
    return unfold(torch.ops.pfl.branch_combine(weights, alpha)), 0


@torch.library.register_vmap(BRANCH_COMBINE_BACKWARD)
def _branch_combine_backward_vmap(info, in_dims, grad_w, weights, alpha, output_mask):
    has_clients = logical_dim(alpha, in_dims[2]) == 2
    (grad_w, weights, alpha), unfold = fold_vmap_dim(info, in_dims, (grad_w, weights, alpha), has_clients)
    grads = torch.ops.pfl.branch_combine_backward(grad_w, weights, alpha, output_mask)
    return unfold_gradients(grads, list(output_mask), unfold)


@metadata_cached
def _combine_expands(weights, alpha, shared_weights) -> bool:
    """The checks of ``branch_combine`` (errors that name the argument), once per signature
    (``metadata_cached``); whether the weights are shared and must be expanded over K."""
    check_tensor("alpha", alpha, dims=(1, 2))
    check_is_tensor("weights", weights)
    if weights.dtype not in FLOAT_DTYPES:
        raise TypeError(f"weights must be a floating torch.Tensor, got {weights.dtype}")
    check_same("alpha", alpha, "weights", weights)
    n_branches = alpha.shape[-1]
    if n_branches < 1:
        raise ValueError(f"alpha must have B >= 1 branches (its last dim), got shape {list(alpha.shape)}")
    if alpha.dim() == 2:
        per_client = weights.dim() >= 2 and tuple(weights.shape[:2]) == tuple(alpha.shape)
        shared = weights.dim() >= 1 and weights.shape[0] == n_branches
        if shared_weights is None:
            if per_client and shared:
                raise ValueError(
                    f"weights {list(weights.shape)} reads both as [K, B, *shape] and as shared [B, *shape] "
                    f"for alpha {list(alpha.shape)}: pass shared_weights=True or False")
            shared_weights = shared and not per_client
        if shared_weights:
            if not shared:
                raise ValueError(f"shared weights must be [B={n_branches}, *shape], got {list(weights.shape)}")
            return True
    elif shared_weights is False:
        raise ValueError("shared_weights=False needs alpha with a client dimension [K, B]")
    if weights.dim() < alpha.dim() or tuple(weights.shape[: alpha.dim()]) != tuple(alpha.shape):
        # With alpha [B] the two readings are one shape: name it once.
        shared_reading = f" or [{n_branches}, *shape]" if alpha.dim() == 2 else ""
        raise ValueError(f"weights must have shape [{', '.join(map(str, alpha.shape))}, *shape]{shared_reading} "
                         f"to match alpha {list(alpha.shape)}, got {list(weights.shape)}")
    return False


def branch_combine(weights: torch.Tensor, alpha: torch.Tensor, *,
                   shared_weights: Optional[bool] = None) -> torch.Tensor:
    """Combine branches with simplex weights: ``W = Σ_b alpha[..., b] · weights[..., b, *shape]``.

    pFedMB Eq. 1–2 (every layer is a convex combination of B branches, α per client).

    Args:
        weights: [B, *shape] (branches shared by all clients) or [K, B, *shape].
        alpha: [B] or [K, B] (one row of branch weights per client).  α is used as given:
            keeping it on the simplex is the caller's (the layers do it).
        shared_weights: whether weights lacks the client dimension.  Inferred from the
            shapes; needed only when both readings fit (K == B and weights [B, B, ...]).

    Returns:
        W [*shape], or [K, *shape] when alpha is [K, B].  Gradients flow to both inputs; for
        shared weights they are summed over the clients.

    Raises:
        TypeError: non-floating or differing dtypes.  ValueError: shapes that do not fit,
        B < 1, devices that differ, or an ambiguous shared/per-client reading.
    """
    if _combine_expands(weights, alpha, shared_weights):
        weights = weights.expand(alpha.shape[0], *weights.shape)
    return torch.ops.pfl.branch_combine(weights, alpha)


def project_simplex_(x: torch.Tensor) -> torch.Tensor:
    """In place, replace each row of ``x`` [..., B] by its Euclidean projection onto the simplex.

    The projection argmin_{p: p ≥ 0, Σp = 1} ‖p − x‖₂ keeps pFedMB's α on the simplex after an
    optimizer step (``simplex='project'``).  Rows of a bank [K, B] are projected in one call.
    Call it under ``torch.no_grad()``.  Returns ``x``.

    Non-finite input: in eager mode this wrapper refuses x holding NaN or ±Inf (ValueError,
    x unchanged).  The op itself, ``torch.ops.pfl.project_simplex_`` called directly, makes
    every row holding NaN or ±Inf all NaN and projects the other rows as usual, in every
    kernel (reference, C++, Triton) alike.  Under torch.compile (``fullgraph=True`` too) the
    wrapper cannot read x's values without a graph break, so it does not: a compiled call
    gives what eager gives on finite x, and the op's all-NaN rows (no ValueError) on rows
    holding NaN or ±Inf.

    Raises:
        TypeError: x not a floating tensor.  ValueError: x not dense (sparse), x without a
        last dim of size >= 1, or (in eager mode) holding NaN/Inf.
    """
    check_is_tensor("x", x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be a floating torch.Tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have B >= 1 entries in its last dim, got shape {list(x.shape)}")
    # Meta and fake tensors have no values to read, and under torch.compile a read is a
    # data-dependent guard (fullgraph=True failed on it): there the op's NaN rows stand in.
    if has_values(x) and not values_finite(x):
        raise ValueError("x must be finite to be projected onto the simplex (it holds NaN or Inf)")
    kernel_for("project_simplex_", x)(x)
    return x

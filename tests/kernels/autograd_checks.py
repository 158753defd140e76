"""Autograd of every order for the factorized-weight and multi-branch ops: the inputs and the
checks that their tests share (C++ kernels, the reference without the extension, and the
Triton launchers in the interpreter).

Every case runs the ops through their autograd formulas, so a backward op without a
derivative of its own (a silently wrong Hessian-vector product) or a tangent that is
dropped (forward mode) fails here.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence

import torch

from pfl_kernels._layout import layout_geometry

F64 = torch.float64
K = 2  # clients, where there are some
# How inputs reach the op: no client dim; a client dim on every input; "shared": the client
# dim on some inputs only, the others broadcast over K (stride 0 at the op).
CLIENT_MODES = [None, "clients", "shared"]


# PFL_TEST_GRADCHECK=fast: every check below in gradcheck's fast mode, the vmap-batched check kept.
# scripts/test.sh sets it for its no-extension and floor phases, where a full Jacobian costs about
# ten times a projection (a backward-op case without the extension: 3 s against 0.3 s; those cases
# were two thirds of that phase).  The main phase checks every entry of the C++ formulas; the
# Python ones (the fallback without the extension) are the same equations, checked by projection.
_MODE = os.environ.get("PFL_TEST_GRADCHECK", "full") or "full"
if _MODE not in ("full", "fast"):
    raise ValueError(f"PFL_TEST_GRADCHECK must be 'full' (the default) or 'fast', got {_MODE!r}")
FAST_BY_REQUEST = _MODE == "fast"


def assert_all_orders(fn, inputs: Sequence[torch.Tensor], *, fast: bool = False) -> None:
    """gradcheck in reverse and forward mode, and gradgradcheck reverse-over-reverse and
    forward-over-reverse, in float64.  ``fast``: a random projection of the Jacobian, no
    vmap-batched check and no undefined-gradient check (for the slow Triton interpreter);
    under ``PFL_TEST_GRADCHECK=fast`` a projection, the other checks kept.  A projection on
    random vectors differs between a right and a wrong Jacobian almost surely (gradcheck's
    ``fast_mode``)."""
    kw = {"fast_mode": fast or FAST_BY_REQUEST, "check_batched_grad": not fast}
    # Undefined gradients and tangents are handled by the autograd formulas, which every other
    # phase checks with the same formulas over the C++ and the reference kernels; what reaches a
    # kernel from them is a partial output_mask, which the launchers' tests compare with the
    # reference directly (test_backward_output_mask).  In the interpreter the undefined checks
    # took 21 s of the slowest case's 34 (linear, mu+mask, shared clients).
    undefined = not fast
    with warnings.catch_warnings():
        # A right number that comes with "an autograd kernel was not registered" is luck.
        warnings.simplefilter("error", UserWarning)
        assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_undefined_grad=undefined, **kw)
        assert torch.autograd.gradgradcheck(fn, inputs, check_fwd_over_rev=True, check_undefined_grad=undefined, **kw)


def _leaf(g: torch.Generator, *size: int, positive: bool = False) -> torch.Tensor:
    t = torch.rand(*size, generator=g, dtype=F64) + 0.5 if positive else torch.randn(*size, generator=g, dtype=F64)
    return t.requires_grad_()


def _lead(clients: Optional[str], per_client: bool) -> tuple[int, ...]:
    return (K,) if clients == "clients" or (clients == "shared" and per_client) else ()


def present(tensors) -> list[torch.Tensor]:
    """The tensors that are not None, in order."""
    return [t for t in tensors if t is not None]


def factorized_leaves(shape, layout: str, bias_mode: str, clients: Optional[str], rank: int = 2, seed: int = 0):
    """(u, v, mu, mask) as float64 leaves that require grad (None where ``bias_mode`` has none).

    With clients="shared", u, mu and mask are shared by the K clients (no client dim) and v
    is per client.  The mask is random in [0.5, 1.5), so that it really multiplies.
    """
    g = torch.Generator().manual_seed(seed)
    rows, cols, _, _ = layout_geometry(shape, layout)
    u = _leaf(g, *_lead(clients, False), rows, rank)
    v = _leaf(g, *_lead(clients, True), rank, cols)
    mu = _leaf(g, *_lead(clients, False), rows, cols) if bias_mode != "none" else None
    mask = _leaf(g, *_lead(clients, False), rows, cols, positive=True) if bias_mode == "mu+mask" else None
    return u, v, mu, mask


def factorized_grad_w(shape, clients: Optional[str], seed: int = 1) -> torch.Tensor:
    """A random grad_w leaf for ``factorized_weight_backward``."""
    return _leaf(torch.Generator().manual_seed(seed), *(() if clients is None else (K,)), *shape)


def factorized_backward_fn(shape, layout: str, clients: Optional[str], given, output_mask):
    """``(grad_w, *present factors) -> the asked-for gradients`` of ``factorized_weight_backward``;
    ``given`` says which of (u, v, mu, mask) are present.  Shared factors are expanded over K."""

    def fn(grad_w, *factors):
        it = iter(factors)
        u, v, mu, mask = (next(it) if g else None for g in given)
        if clients is not None:
            u, v, mu, mask = (t if t is None or t.dim() == 3 else t.expand(K, *t.shape) for t in (u, v, mu, mask))
        grads = torch.ops.pfl.factorized_weight_backward(grad_w, u, v, mu, mask, shape=list(shape), layout=layout,
                                                         output_mask=list(output_mask))
        return tuple(t for t, m, g in zip(grads, output_mask, given) if m and g)

    return fn


def branch_leaves(shape, branches: int, clients: Optional[str], seed: int = 0):
    """(weights, alpha) as float64 leaves that require grad.  With clients="shared" the
    branches [B, *shape] are shared by the K clients and alpha is [K, B]."""
    g = torch.Generator().manual_seed(seed)
    weights = _leaf(g, *_lead(clients, False), branches, *shape)
    alpha = _leaf(g, *(() if clients is None else (K,)), branches, positive=True)
    return weights, alpha


def branch_grad_w(shape, clients: Optional[str], seed: int = 1) -> torch.Tensor:
    """A random grad_w leaf for ``branch_combine_backward``."""
    return _leaf(torch.Generator().manual_seed(seed), *(() if clients is None else (K,)), *shape)


def branch_backward_fn(output_mask):
    """``(grad_w, weights, alpha) -> the asked-for gradients`` of ``branch_combine_backward``
    (shared weights [B, *shape] with alpha [K, B] are expanded over K)."""

    def fn(grad_w, weights, alpha):
        if alpha.dim() == 2 and weights.shape[0] != alpha.shape[0]:
            weights = weights.expand(alpha.shape[0], *weights.shape)
        grads = torch.ops.pfl.branch_combine_backward(grad_w, weights, alpha, list(output_mask))
        return tuple(t for t, m in zip(grads, output_mask) if m)

    return fn

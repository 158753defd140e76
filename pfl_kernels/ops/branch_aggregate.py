"""Server aggregation of multi-branch models (pFedMB Eq. 5).

Ops in the ``pfl`` namespace:

* ``branch_aggregate(branch_params, alpha, counts) -> W``: branch_params [K, B, *shape]
  (client i's copy of branch b), alpha [K, B], counts [K] -> W [B, *shape] with
  W_b = Σ_i n_i α_ib W_ib / Σ_i n_i α_ib.
* ``branch_aggregate.out(branch_params, alpha, counts, *, out) -> out``: the same, written
  into ``out`` [B, *shape] (e.g. the server's bank of global branches), so that each round
  reuses its memory instead of faulting in a fresh W (at K = 20, B = 5, P = 10^7 on a 2-core
  CPU, the first touch of a fresh 200 MB W took 37-260 ms; reading the 4 GB of
  branch_params took about 120 ms).  Any layout; ``out`` may overlap ``branch_params``
  (e.g. ``out = branch_params[0]``): the result is the same as without overlap.  No
  autograd (as torch's out= variants).

dtypes.  branch_params float16/bfloat16/float32/float64; the result is a set of
PARAMETERS, returned in branch_params' dtype.  alpha may be any floating dtype (e.g. float32
with bfloat16 params) and counts any integer or floating dtype: both are read in float64 to
form the normalized coefficients c_ib = n_i α_ib / Σ_j n_j α_jb, which are then used in the
accumulation dtype (float32, float64 for float64 params).

Semantics.
* Finite counts and alpha of any magnitude give finite coefficients: each product n_i α_ib is
  scaled per branch by a power of two before the sum (``reference.branch_aggregate.
  scaled_products``), so counts and alpha of 1e300 (whose products overflow float64) give the
  plain mean, as equal coefficients should, not NaN.
* A branch nobody weights (Σ_j n_j α_jb = 0: all its α are 0, or all counts are) gets the
  plain average over the K clients instead of 0/0, and its gradient w.r.t. α is 0.
* A client with c_ib = 0 (n_i = 0 or α_ib = 0) is not read for branch b: a NaN/Inf row of
  such a client does not reach W_b.  A non-finite row of a client that does weight b
  makes W_b non-finite (as the formula says), and only W_b.  On a branch nobody weights,
  every client is read.
* Differentiable w.r.t. branch_params and alpha (not counts); the backward is plain
  PyTorch (``reference.branch_aggregate.branch_aggregate_backward``): one pass over
  branch_params for the dot products ⟨g_b, W_ib⟩ and one write of the gradient.

The op checks the data (counts >= 0 and finite, alpha >= 0 and finite) in every kernel, the
same ValueError on every backend (a device sync for the Triton one), never in the wrapper or
the fake kernel: the op runs on meta tensors and under torch.compile.

Aliasing.  ``out`` may overlap any input (branch_params along any dim, alpha, counts, also
through another storage such as ``torch.from_numpy`` of the same array): every kernel then
computes into a fresh W first.  An ``out`` whose own elements share memory (an expanded
view, or strides such as [3, 6, 1] for [3, 2, 3]) is refused with ValueError.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..reference import branch_aggregate as ref
from ._checks import (FLOAT_DTYPES, check_is_tensor, check_no_internal_overlap, check_out, check_out_without_grad,
                      copy_into_when_compiling)
from ._eager import kernel_for
from ._library import define_op, register_autograd
from ._memo import metadata_cached

__all__ = ["branch_aggregate"]


@metadata_cached
def _check_op_args(branch_params, alpha, counts, out=None):
    """Checks of the op contract that also hold under tracing (fake tensors); returns W's shape."""
    torch._check_value(alpha.dim() == 2, lambda: f"alpha must be [K, B], got {list(alpha.shape)}")
    torch._check_value(alpha.shape[0] >= 1, lambda: f"alpha must have K >= 1 clients, got {list(alpha.shape)}")
    torch._check_value(alpha.shape[1] >= 1, lambda: f"alpha must have B >= 1 branches, got {list(alpha.shape)}")
    torch._check_value(branch_params.dim() >= 2 and list(branch_params.shape[:2]) == list(alpha.shape),
                       lambda: f"branch_params must have shape [{alpha.shape[0]}, {alpha.shape[1]}, *shape] to match "
                               f"alpha, got {list(branch_params.shape)}")
    torch._check_value(counts.dim() == 1 and counts.shape[0] == alpha.shape[0],
                       lambda: f"counts must have shape [{alpha.shape[0]}] (one count per client), "
                               f"got {list(counts.shape)}")
    torch._check_type(branch_params.dtype in FLOAT_DTYPES,
                      lambda: f"branch_params must be a floating tensor, got {branch_params.dtype}")
    torch._check_type(alpha.dtype in FLOAT_DTYPES, lambda: f"alpha must be a floating tensor, got {alpha.dtype}")
    torch._check_type(counts.dtype != torch.bool and not counts.dtype.is_complex,
                      lambda: f"counts must be an integer or floating tensor, got {counts.dtype}")
    for name, t in (("alpha", alpha), ("counts", counts)):
        torch._check_value(t.device == branch_params.device,
                           lambda: f"{name} must be on branch_params' device {branch_params.device}, got {t.device}")
    shape = list(branch_params.shape[1:])
    if out is not None:
        torch._check_value(list(out.shape) == shape, lambda: f"out must have shape {shape}, got {list(out.shape)}")
        torch._check_type(out.dtype == branch_params.dtype,
                          lambda: f"out must have branch_params' dtype {branch_params.dtype}, got {out.dtype}")
        torch._check_value(out.device == branch_params.device,
                           lambda: f"out must be on branch_params' device {branch_params.device}, got {out.device}")
        check_no_internal_overlap("out", out)
    return shape


def check_branch_values(alpha, counts) -> None:
    """The checks that read the data (counts >= 0 and finite, then alpha >= 0 and finite):
    every kernel makes them (the C++ one while forming the coefficients, the reference and
    Triton ones here), none of the wrappers or fake kernels, so the op traces on meta/fake
    tensors and raises the same ValueError on every backend, also as ``torch.ops.pfl``."""
    bad_counts = counts < 0
    if counts.dtype.is_floating_point:
        bad_counts |= ~torch.isfinite(counts)
    bad_alpha = (alpha < 0) | ~torch.isfinite(alpha)
    any_counts, any_alpha = torch.stack([bad_counts.any(), bad_alpha.any()]).tolist()  # one sync
    if any_counts:
        i = int(bad_counts.nonzero()[0, 0])
        raise ValueError(f"counts must be >= 0 and finite, got counts[{i}] = {float(counts[i]):g}")
    if any_alpha:
        i, j = (int(v) for v in bad_alpha.nonzero()[0])
        raise ValueError(f"alpha must be >= 0 and finite, got alpha[{i}, {j}] = {float(alpha[i, j]):g}")


def _reference_forward(branch_params, alpha, counts):
    _check_op_args(branch_params, alpha, counts)
    check_branch_values(alpha, counts)
    return ref.branch_aggregate(branch_params, alpha, counts)


def _reference_out(branch_params, alpha, counts, *, out):
    _check_op_args(branch_params, alpha, counts, out)
    check_branch_values(alpha, counts)
    # The whole result exists before out is written, so out may overlap branch_params, alpha
    # or counts.
    out.copy_(ref.branch_aggregate(branch_params, alpha, counts))
    return out


BRANCH_AGGREGATE = define_op("branch_aggregate(Tensor branch_params, Tensor alpha, Tensor counts) -> Tensor",
                             _reference_forward)
BRANCH_AGGREGATE_OUT = define_op(
    "branch_aggregate.out(Tensor branch_params, Tensor alpha, Tensor counts, *, Tensor(a!) out) -> Tensor(a!)",
    _reference_out)


@torch.library.register_fake(BRANCH_AGGREGATE)
def _branch_aggregate_fake(branch_params, alpha, counts):
    return branch_params.new_empty(_check_op_args(branch_params, alpha, counts))


@torch.library.register_fake(BRANCH_AGGREGATE_OUT)
def _branch_aggregate_out_fake(branch_params, alpha, counts, *, out):
    _check_op_args(branch_params, alpha, counts, out)
    return out


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    branch_params, alpha, counts = inputs
    # The dot products of grad_alpha read branch_params; grad_branch_params needs only α and n.
    ctx.save_for_backward(branch_params if ctx.needs_input_grad[1] else None, alpha, counts)
    ctx.params_shape = branch_params.shape
    ctx.params_dtype = branch_params.dtype


def _backward(ctx, grad_out):
    branch_params, alpha, counts = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    if branch_params is None:  # only grad_branch_params: it reads neither the params nor their values
        branch_params = grad_out.new_empty((), dtype=ctx.params_dtype).expand(ctx.params_shape)
    grad_params, grad_alpha = ref.branch_aggregate_backward(grad_out, branch_params, alpha, counts, mask)
    return grad_params, grad_alpha, None


register_autograd(BRANCH_AGGREGATE, _backward, _setup_context)


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def branch_aggregate(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor, *,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Aggregate every branch over the clients, weighted by sample count and branch weight.

    pFedMB Eq. 5: ``W_b = Σ_i n_i α_ib W_ib / Σ_i n_i α_ib`` for each branch b, in one pass
    over ``branch_params``.

    Args:
        branch_params: [K, B, *shape] (or [K, B, P]): client i's copy of branch b, any float
            dtype (float32/bfloat16/float16/float64).
        alpha: [K, B] branch weights, any floating dtype (read in float64), >= 0 and finite.
        counts: [K] sample counts n_i, integer or floating, >= 0 (and finite).
        out: optional [B, *shape] tensor of branch_params' dtype to write W into (e.g. the
            server's bank of global branches, reused every round); any layout, and it may
            overlap branch_params.  Not differentiable.

    Returns:
        W [B, *shape] in branch_params' dtype (``out`` when given), accumulated in float32
        (float64 for float64).
        A branch nobody weights (Σ_i n_i α_ib = 0) is the plain average over the K clients.
        Clients with n_i α_ib = 0 are not read for branch b, so their NaN/Inf rows do not
        reach W_b.  Differentiable w.r.t. branch_params and alpha; counts get no gradient.

    Raises:
        TypeError: a non-tensor argument, non-floating branch_params or alpha, counts neither
        integer nor floating.  ValueError: shapes that do not fit (K = 0, B = 0, alpha not
        [K, B], counts not [K]), devices that differ, negative or non-finite counts, negative
        or NaN/Inf alpha, out of the wrong shape or with elements that share memory.
        RuntimeError: out= with inputs that require grad (under grad mode).
    """
    for name, t in (("branch_params", branch_params), ("alpha", alpha), ("counts", counts)):
        check_is_tensor(name, t)
    if branch_params.dtype not in FLOAT_DTYPES:
        raise TypeError(f"branch_params must be a floating tensor (float16/bfloat16/float32/float64), "
                        f"got {branch_params.dtype}")
    if alpha.dtype not in FLOAT_DTYPES:
        raise TypeError(f"alpha must be a floating tensor, got {alpha.dtype}")
    if not (_is_int_dtype(counts.dtype) or counts.dtype in FLOAT_DTYPES):
        raise TypeError(f"counts must be an integer or floating tensor, got {counts.dtype}")
    if alpha.dim() != 2:
        raise ValueError(f"alpha must be [K, B] (one row of branch weights per client), got shape {list(alpha.shape)}")
    k, b = alpha.shape
    if k < 1:
        raise ValueError(f"alpha must have K >= 1 clients, got shape {list(alpha.shape)}")
    if b < 1:
        raise ValueError(f"alpha must have B >= 1 branches, got shape {list(alpha.shape)}")
    if branch_params.dim() < 2 or tuple(branch_params.shape[:2]) != (k, b):
        raise ValueError(f"branch_params must have shape [K={k}, B={b}, *shape] to match alpha, "
                         f"got {list(branch_params.shape)}")
    if counts.dim() != 1 or counts.shape[0] != k:
        raise ValueError(f"counts must have shape [K={k}] (one sample count per client), got {list(counts.shape)}")
    for name, t in (("alpha", alpha), ("counts", counts)):
        if t.device != branch_params.device:
            raise ValueError(f"{name} must be on the device of branch_params ({branch_params.device}), got {t.device}")
    # Negative or non-finite counts and alpha: checked by the op itself (every kernel), not here.
    if out is None:
        return kernel_for("branch_aggregate", branch_params, alpha, counts)(branch_params, alpha, counts)
    check_out(out, "branch_params", branch_params, list(branch_params.shape[1:]), "[B, *shape] of branch_params")
    check_no_internal_overlap("out", out)
    check_out_without_grad("branch_aggregate", branch_params, alpha, out)
    compiled = copy_into_when_compiling(out, lambda: torch.ops.pfl.branch_aggregate(branch_params, alpha, counts))
    return compiled if compiled is not None else torch.ops.pfl.branch_aggregate.out(branch_params, alpha, counts,
                                                                                   out=out)

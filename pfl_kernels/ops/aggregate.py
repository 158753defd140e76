"""Weighted aggregation of stacked client parameters (Factorized-FL, FedAvg, SimFed reflection).

Ops in the ``pfl`` namespace:

* ``weighted_average(weights, params) -> out``: weights [K, M], params [M, P] -> out [K, P],
  ``out[k] = Σ_j weights[k, j] · params[j]``, one pass over params.
* ``weighted_average.out(weights, params, *, out) -> out``: the same, written into ``out``
  (e.g. a slice of a client bank: any row stride, unit stride in the last dim).  ``out`` may
  overlap ``params`` (in-place aggregation ``bank <- W @ bank``) or ``weights``, also through
  another storage (``torch.from_numpy`` of the same array): the result is the same as
  without overlap (every kernel compares addresses, not storages).  Rows of ``out`` that
  share memory are refused (ValueError) by every kernel.

Semantics (documented, tested):

* **A zero weight never reads its row of params**: ``out[k] = Σ_{j: w_kj != 0} w_kj θ_j``.  A
  NaN or Inf row of params (a diverged client) reaches exactly the clients that give it a
  nonzero weight; every other client's result is untouched (a plain ``weights @ params``
  would compute 0·NaN = NaN and poison all of them).
* NaN or Inf in ``weights`` raises ``ValueError``.
* dtypes: params float32, float64, bfloat16 or float16; the sums run in the accumulation
  dtype (float32 for bfloat16/float16 params, else the params' dtype), weights (any floating
  dtype, e.g. float32 weights with bfloat16 params) are read in that dtype, and the result
  has the params' dtype (it holds parameters).
* Sparse weights (after ``similarity_weights`` most entries are zero) are exploited: the
  cost grows with the number of nonzero weights, not with K·M.
* Kernels: C++ on CPU (``csrc/cpu/aggregate.cpp``: BLAS per column block for dense
  float32/float64, a CSR gather for sparse weights, a register-blocked loop for bf16/fp16),
  Triton on CUDA (``pfl_kernels/triton/aggregate.py``: ``tl.dot`` tiles or a sparse gather), the
  plain-PyTorch reference elsewhere; all with the semantics above.

Gradients: ``grad_weights = g θᵀ`` and ``grad_params = wᵀ g`` (itself a weighted average).
``out=`` does not support autograd (as in torch).

``reflection_weights(attention)`` builds the weights that make SimFed's reflection (Eq. 8) a
weighted average.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..reference import aggregate as ref
from ._checks import (FLOAT_DTYPES, check_is_tensor, check_out, check_out_without_grad, copy_into_when_compiling,
                      has_values, may_overlap, values_finite)
from ._eager import kernel_for
from ._library import define_op, register_autograd
from ._memo import metadata_cached

__all__ = ["weighted_average", "reflection_weights"]


@metadata_cached
def _check_op_args(weights, params, out=None):
    """Checks of the op contract that also hold under tracing (fake tensors); returns [K, P]."""
    torch._check_value(weights.dim() == 2, lambda: f"weights must be [K, M], got {list(weights.shape)}")
    torch._check_value(params.dim() == 2, lambda: f"params must be [M, P], got {list(params.shape)}")
    torch._check_value(weights.shape[1] == params.shape[0],
                       lambda: f"params must have M={weights.shape[1]} rows (weights' last dim), "
                               f"got {list(params.shape)}")
    torch._check_type(weights.dtype in FLOAT_DTYPES, lambda: f"weights must be floating, got {weights.dtype}")
    torch._check_type(params.dtype in FLOAT_DTYPES, lambda: f"params must be floating, got {params.dtype}")
    torch._check_value(weights.device == params.device,
                       lambda: f"weights must be on params' device {params.device}, got {weights.device}")
    shape = [weights.shape[0], params.shape[1]]
    if out is not None:
        torch._check_value(list(out.shape) == shape, lambda: f"out must have shape {shape}, got {list(out.shape)}")
        torch._check_type(out.dtype == params.dtype,
                          lambda: f"out must have params' dtype {params.dtype}, got {out.dtype}")
        torch._check_value(out.device == params.device,
                           lambda: f"out must be on params' device {params.device}, got {out.device}")
        torch._check_value(out.shape[1] <= 1 or out.stride(1) == 1,
                           lambda: f"out must have unit stride in its last dim, got strides {list(out.stride())}")
        # Rows that share memory would keep whichever value came last (the C++ kernel's check).
        torch._check_value(out.shape[0] <= 1 or out.shape[1] == 0 or abs(out.stride(0)) >= out.shape[1],
                           lambda: f"out's rows overlap (row stride {out.stride(0)} < P={out.shape[1]})")
    return shape


# ---------------------------------------------------------------- the CUDA paths (issue 30, item 2)

# Below this fraction of nonzero weights the CSR gather serves (the CPU kernel's rule too).
SPARSE_DENSITY = 0.3


def cuda_path(k: int, m: int, nnz: int, dtype: torch.dtype, tf32: bool,
              sparse_density: float = SPARSE_DENSITY) -> str:
    """Which implementation serves ``weighted_average`` of [K, M] weights (``nnz`` nonzero)
    and params of ``dtype`` on CUDA: 'sparse' (the Triton sparse gather), 'gemm'
    (``gemm_weighted_average``: one cuBLAS GEMM) or 'dense' (the Triton ``tl.dot`` kernel).

    Dense weights go to the GEMM: on an H200 (issue 30) the dense Triton kernel took 39.5 ms at
    K = 100, P = 10^6 against torch.mm's 0.71 ms, its cost in its float32 ``ieee`` dot, which
    bfloat16/float16 params are widened to as well.  Only where torch's float32 matmuls may
    use TF32 (``torch.backends.cuda.matmul.allow_tf32``, off by default) does the Triton
    kernel keep them, since TF32 would lose three decimal digits of the parameters and the
    op promises float32 accumulation; float64 always takes the GEMM (dgemm)."""
    if nnz < sparse_density * k * m:
        return "sparse"
    if tf32 and dtype != torch.float64:
        return "dense"
    return "gemm"


def gemm_weighted_average(weights: torch.Tensor, params: torch.Tensor,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The op's result through one GEMM (``torch.mm``: cuBLAS on CUDA), on any device.

    Weights are assumed finite (every kernel checks them first).  ``w @ θ`` computes
    0·NaN = NaN, so a NaN/Inf entry of params makes its whole column of the product
    non-finite, row 0 included; a finite row 0 thus proves params finite, and then the plain
    product is the contract's result.  Checking row 0 reads P values (one device sync)
    instead of all M·P of params.  Otherwise (a diverged client, or a sum that overflowed)
    the reference computes it (each non-finite row added back only where its weight is
    nonzero).  A BLAS that skips zero weights everywhere gives the contract's result too.

    ``out``: written in place (any row stride, unit column stride); it may overlap params or
    weights (then the product goes to a new tensor first).  Returns the result (``out`` when
    given), in params' dtype."""
    product = gemm_product(weights, params, out)
    return gemm_finish(product, values_finite(product.result[0]) if product.checkable else True, out)


class GemmProduct(NamedTuple):
    """``gemm_product``'s result: the product (in the accumulation dtype; ``out`` itself where
    it was written in place), the operands in that dtype, params' own dtype, whether the
    product went straight into ``out``, and whether it has a row 0 to check (K, P and M all
    nonzero)."""

    result: torch.Tensor
    weights: torch.Tensor
    params: torch.Tensor
    dtype: torch.dtype
    direct: bool
    checkable: bool


def gemm_product(weights: torch.Tensor, params: torch.Tensor, out: Optional[torch.Tensor] = None) -> GemmProduct:
    """The GEMM of ``gemm_weighted_average`` without its check: ``w @ θ`` in the accumulation
    dtype, into ``out`` when that can be written directly (its dtype, no overlap).  A caller
    reads ``isfinite(result[0]).all()`` (with whatever else it must read in the same device
    sync) and passes it to ``gemm_finish``."""
    acc = ref.accumulation_dtype(params.dtype)
    w = weights.to(acc)
    theta = params.to(acc)
    direct = (out is not None and out.dtype == acc and not may_overlap(out, params)
              and not may_overlap(out, weights))
    result = torch.mm(w, theta, out=out) if direct else torch.mm(w, theta)
    return GemmProduct(result, w, theta, params.dtype, direct,
                       bool(result.shape[0] and result.shape[1] and theta.shape[0]))


def gemm_finish(product: GemmProduct, row0_finite: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gemm_weighted_average``'s result from its product and the check of row 0: the product
    where row 0 is finite, else the reference's (the fix-up); in params' dtype, written into
    ``out`` when given."""
    result, direct = product.result, product.direct
    if not row0_finite:
        result = None  # the product is freed before the fix-up allocates its own
        result = ref.weighted_average(product.weights, product.params)
        direct = False
    result = result.to(product.dtype)
    if out is None:
        return result
    if not direct:
        out.copy_(result)
    return out


# Every kernel checks the weights once rounded to the accumulation dtype, where they are used:
# a float64 weight of 1e300 is Inf in float32 (the kernels said "NaN or Inf" of finite weights
# and the reference returned Inf).
NON_FINITE_WEIGHTS = ("weights must be finite (they hold NaN or Inf, or values beyond the accumulation "
                      "dtype's range: float32's, float64's for float64 params)")


def _checked_weights(weights, params):
    """The weights in the accumulation dtype, once checked finite there: the op's check of
    their values (every kernel makes it: the C++ one while counting nonzeros, the Triton one in
    the same sync, the reference here), so the wrapper makes no second pass over K·M weights
    (300 ms of 1.3 s at K = M = 10^4 on 2 cores).  The reference computes with the tensor
    returned, so mixed dtypes are cast once."""
    cast = weights.to(ref.accumulation_dtype(params.dtype))
    if not values_finite(cast):
        raise ValueError(NON_FINITE_WEIGHTS)
    return cast


def _reference(weights, params):
    _check_op_args(weights, params)
    return ref.weighted_average(_checked_weights(weights, params), params)


def _reference_out(weights, params, *, out):
    _check_op_args(weights, params, out)
    # The whole result exists before out is written, so out may overlap params.
    out.copy_(ref.weighted_average(_checked_weights(weights, params), params))
    return out


WEIGHTED_AVERAGE = define_op("weighted_average(Tensor weights, Tensor params) -> Tensor", _reference)
WEIGHTED_AVERAGE_OUT = define_op(
    "weighted_average.out(Tensor weights, Tensor params, *, Tensor(a!) out) -> Tensor(a!)", _reference_out)


@torch.library.register_fake(WEIGHTED_AVERAGE)
def _weighted_average_fake(weights, params):
    return params.new_empty(_check_op_args(weights, params))


@torch.library.register_fake(WEIGHTED_AVERAGE_OUT)
def _weighted_average_out_fake(weights, params, *, out):
    _check_op_args(weights, params, out)
    return out


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    weights, params = inputs
    ctx.save_for_backward(weights, params)


def _backward(ctx, grad):
    weights, params = ctx.saved_tensors
    grad_weights = grad_params = None
    if ctx.needs_input_grad[0]:
        acc = ref.accumulation_dtype(params.dtype)
        grad_weights = (grad.to(acc) @ params.to(acc).t()).to(weights.dtype)
    if ctx.needs_input_grad[1]:
        # wᵀ g is a weighted average of the rows of g with the transposed weights.
        grad_params = torch.ops.pfl.weighted_average(weights.t(), grad)
    return grad_weights, grad_params


register_autograd(WEIGHTED_AVERAGE, _backward, _setup_context)


def _check_floating(name: str, t) -> None:
    check_is_tensor(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got {t.dtype}")


def weighted_average(weights: torch.Tensor, params: torch.Tensor, *,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weighted combinations of stacked parameters: ``out[k] = Σ_j weights[k, j] · params[j]``.

    The server aggregation of Factorized-FL (Eq. 5: each client's new shared parameters are
    the softmax-weighted sum of its kept clients') and of FedAvg (one row of sample fractions),
    in one pass over ``params``.  With ``reflection_weights`` it is SimFed's reflection (Eq. 8).

    A zero weight never reads its row: ``out[k] = Σ_{j: w_kj != 0} w_kj θ_j``, so a NaN/Inf
    row of params only reaches the clients that give it a nonzero weight.  Sparse weights
    (most entries zero, as after ``similarity_weights``) cost in proportion to their nonzeros.

    Args:
        weights: [K, M], any floating dtype (read in the accumulation dtype), finite.
        params: [M, P], float32/float64/bfloat16/float16 (e.g. a bank of flattened models).
        out: optional [K, P] tensor of params' dtype to write into (a bank slice: any row
            stride, unit stride in the last dim).  It may overlap params (in-place
            aggregation): the result is the same.  Not differentiable.

    Returns:
        [K, P] in params' dtype (``out`` when given).  Differentiable in weights and params.

    Raises:
        TypeError: non-tensor or non-floating inputs, out of another dtype.
        ValueError: shapes that do not fit, differing devices, NaN/Inf in weights, out
            without unit stride in its last dim or with overlapping rows.
        RuntimeError: out= with inputs that require grad (under grad mode).
    """
    _check_floating("weights", weights)
    _check_floating("params", params)
    if weights.dim() != 2:
        raise ValueError(f"weights must be [K, M] (2 dims), got shape {list(weights.shape)}")
    if params.dim() != 2:
        raise ValueError(f"params must be [M, P] (2 dims), got shape {list(params.shape)}")
    if weights.shape[1] != params.shape[0]:
        raise ValueError(f"params must be [M={weights.shape[1]}, P] to match weights {list(weights.shape)}, "
                         f"got {list(params.shape)}")
    if weights.device != params.device:
        raise ValueError(f"weights must be on the device of params ({params.device}), got {weights.device}")
    # NaN/Inf in weights: checked by the op itself (every kernel), not here.
    if out is None:
        return kernel_for("weighted_average", weights, params)(weights, params)
    shape = [weights.shape[0], params.shape[1]]
    check_out(out, "params", params, shape, "[K, P]")
    if shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have unit stride in its last dim, got strides {list(out.stride())}")
    if shape[0] > 1 and shape[1] > 0 and abs(out.stride(0)) < shape[1]:
        raise ValueError(f"out's rows overlap (row stride {out.stride(0)} < P={shape[1]})")
    check_out_without_grad("weighted_average", weights, params, out)
    compiled = copy_into_when_compiling(out, lambda: torch.ops.pfl.weighted_average(weights, params))
    return compiled if compiled is not None else torch.ops.pfl.weighted_average.out(weights, params, out=out)


def reflection_weights(attention: torch.Tensor, *, self_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weights that make SimFed's reflection (Eq. 8) one ``weighted_average``.

    SimFed updates each client by ``θ_k <- θ_k + Σ_j a_kj (θ_j − θ_k)`` (a_kj: the normalized
    attention exp(α σ_j) / Σ exp(α σ) over the selected clients, 0 elsewhere).  That equals
    ``Σ_j a_kj θ_j + (1 − Σ_j a_kj) θ_k``: the attention with ``1 − Σ_j a_kj`` added to the
    client's own column.  Then ``weighted_average(reflection_weights(a), params)`` is the
    reflection of every client at once.  Plain torch ops: differentiable in ``attention``.

    Args:
        attention: [K, M] floating, finite.
        self_index: the column of each client itself: None for square attention (client k is
            column k), else an integer tensor [K] with values in [0, M).

    Returns:
        [K, M] weights in attention's dtype; each row sums to 1.

    Raises:
        TypeError: attention not floating, self_index not an integer tensor.
        ValueError: attention not 2-D or not finite, non-square attention without
            self_index, self_index of the wrong shape/device or out of range.
    """
    _check_floating("attention", attention)
    if attention.dim() != 2:
        raise ValueError(f"attention must be [K, M] (2 dims), got shape {list(attention.shape)}")
    # The checks of values read the data: not on meta or fake tensors (there is none) nor
    # while torch.compile traces (a graph break); non-finite weights still meet
    # weighted_average's own check, and an out-of-range self_index the scatter's.
    check_values = has_values(attention)
    if check_values and not values_finite(attention):
        raise ValueError("attention must be finite (it holds NaN or Inf)")
    k, m = attention.shape
    if self_index is None:
        if k != m:
            raise ValueError(f"attention {list(attention.shape)} is not square: pass self_index "
                             f"(each client's column, an integer tensor [{k}])")
        self_index = torch.arange(k, device=attention.device)
    else:
        if isinstance(self_index, torch.Tensor):
            check_is_tensor("self_index", self_index)  # a sparse one: the layout's ValueError
        if not isinstance(self_index, torch.Tensor) or self_index.dtype.is_floating_point \
                or self_index.dtype.is_complex or self_index.dtype == torch.bool:
            raise TypeError(f"self_index must be an integer tensor [{k}], got "
                            f"{getattr(self_index, 'dtype', type(self_index).__name__)}")
        if list(self_index.shape) != [k]:
            raise ValueError(f"self_index must have shape [{k}] (one column per row of attention), "
                             f"got {list(self_index.shape)}")
        if self_index.device != attention.device:
            raise ValueError(f"self_index must be on attention's device ({attention.device}), "
                             f"got {self_index.device}")
        if check_values and k and (bool((self_index < 0).any()) or bool((self_index >= m).any())):
            raise ValueError(f"self_index must hold columns in [0, {m}), got values from "
                             f"{int(self_index.min())} to {int(self_index.max())}")
    return ref.reflection_weights(attention, self_index)

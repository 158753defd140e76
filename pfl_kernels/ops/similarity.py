"""Similarity of clients and the weights built from it (server side of Factorized-FL, SimFed,
FedAMP, FedFomo, FedDAF).

Ops in the ``pfl`` namespace:

* ``pairwise_cosine(x, y, eps) -> [K, M]``: cosine of every row of x [K, D] with every row
  of y [M, D] (y None: with x itself), normalization fused into the product.
* ``pairwise_sqdist(x, y) -> [K, M]``: squared Euclidean distances, never negative.
* ``similarity_weights(sim, tau, scale, min_keep, self_index) -> [K, M]``: the matching
  rule of Factorized-FL Eq. 4–5 / SimFed Eq. 3 (threshold, keep at least ``min_keep``,
  softmax over the kept entries).

Dtypes.  x and y may be float32, float64, bfloat16 or float16 (both the same).  The
products are accumulated in float32 (float64 for float64 inputs) and, since the results
are statistics, returned in that accumulation dtype: float32 for bfloat16/float16/float32
inputs, float64 for float64.  ``similarity_weights`` reads sim in the accumulation dtype
and returns weights in it as well.

Diverged clients and extreme values (every backend: C++, Triton, reference).

* A row of x holding a NaN, +Inf or -Inf makes its whole row of the result NaN (and its
  column too when y is None), its own entry c[i, i] / d[i, i] included; a non-finite row of
  y makes its column NaN.  The other entries are those of the finite rows alone.  So a
  diverged client is never similar (cosine -1 or 0) nor close (distance 0) to anyone, and
  ``similarity_weights`` of such a row raises ValueError.
* Finite rows of any size are exact to the dtype's rounding: before anything is squared a
  row is scaled by a power of two that brings its max |entry| into [0.5, 1) (exact), so
  entries of 1e19 (whose float32 squares overflow) or 1e-30 (whose squares underflow) give
  the true cosine; a squared distance beyond the dtype's range is +Inf.  The C++ and Triton
  kernels scale only the rows whose squared norm leaves a safe band (ordinary rows keep
  the fast path, at no cost).
* A row of zeros has cosine 0 with every finite row, itself included, and distance ‖y_j‖².
* ``pairwise_sqdist`` with y None: d[i, i] is exactly 0 for a finite row, NaN otherwise.

Checks of values.  The checks that read the data (NaN/Inf in sim, self_index values) are
made by every kernel of ``similarity_weights`` (the same ValueError on each, also for a
direct ``torch.ops.pfl`` call), never by the wrapper or the fake kernel: every op runs on
meta tensors, under FakeTensorMode and torch.compile(fullgraph=True).

Gradients.  pairwise_cosine and pairwise_sqdist are differentiable in x and y; the
backward is two matrix products (BLAS / cuBLAS) plus O(K·M) elementwise work, written
with torch ops (nothing in it to fuse that BLAS does not already do).  The clamps of the
definitions are not differentiated: the gradient is that of the unclamped expression
(they only differ where rounding pushed a value past the bound, and there the true
gradient is ~0 anyway: a cosine of ±1 or a distance of 0 is a stationary point).
similarity_weights is differentiable in sim through the softmax over the kept entries.
The backward formulas are differentiable torch ops (the cosine's reads the rows scaled as
above, so 1e19 rows get their true gradient): gradgradcheck holds for every op.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..reference import similarity as ref
from ._checks import FLOAT_DTYPES, check_is_tensor, check_same, check_tensor, integer, real_number, values_finite
from ._eager import kernel_for
from ._library import define_op, register_autograd
from ._memo import metadata_cached

__all__ = ["pairwise_cosine", "pairwise_sqdist", "similarity_weights"]


# ---------------------------------------------------------------- op-level checks

@metadata_cached
def _check_pair(x, y, eps=None):
    """Checks of pairwise_cosine (with its ``eps``) / pairwise_sqdist that also hold under
    tracing, with the exception types of the wrappers'.  -> [K, M]."""
    torch._check_value(x.dim() == 2, lambda: f"x must be [K, D], got {list(x.shape)}")
    torch._check_type(x.dtype in FLOAT_DTYPES, lambda: f"x must be a floating tensor, got {x.dtype}")
    if eps is not None:
        # Comparisons, not math.isfinite: eps may be a symbolic float under torch.compile.
        torch._check_value(-math.inf < eps < math.inf, lambda: f"eps must be finite, got {eps}")
        torch._check_value(eps > 0, lambda: f"eps must be > 0, got {eps}")
    if y is None:
        return [x.shape[0], x.shape[0]]
    torch._check_value(y.dim() == 2 and y.shape[1] == x.shape[1],
                       lambda: f"y must be [M, D] with D = {x.shape[1]} (x's), got {list(y.shape)}")
    torch._check_type(y.dtype == x.dtype, lambda: f"y must have x's dtype {x.dtype}, got {y.dtype}")
    torch._check_value(y.device == x.device, lambda: f"y must be on x's device {x.device}, got {y.device}")
    return [x.shape[0], y.shape[0]]


def _scale_range_message(scale: float, dtype: torch.dtype) -> Optional[str]:
    """Why ``scale`` cannot serve sim of ``dtype``, or None: the kernels scale in the
    accumulation dtype, where a larger |scale| rounds to Inf and every weight became NaN."""
    acc = ref.acc_dtype(dtype)
    largest = torch.finfo(acc).max
    if abs(scale) <= largest:
        return None
    return (f"scale must be within {str(acc).removeprefix('torch.')}'s range (|scale| <= {largest:.4g}), "
            f"the accumulation dtype of {dtype} sim, got {scale}")


@metadata_cached
def _check_weights_args(sim, tau, scale, min_keep, self_index):
    """Checks of similarity_weights that also hold under tracing (none reads sim's values)."""
    torch._check_value(sim.dim() == 2, lambda: f"sim must be [K, M], got {list(sim.shape)}")
    torch._check_type(sim.dtype in FLOAT_DTYPES, lambda: f"sim must be a floating tensor, got {sim.dtype}")
    torch._check_value(-1.0 <= tau <= 1.0, lambda: f"tau must be in [-1, 1], got {tau}")
    torch._check_value(-math.inf < scale < math.inf, lambda: f"scale must be finite, got {scale}")
    torch._check_value(_scale_range_message(scale, sim.dtype) is None,
                       lambda: _scale_range_message(scale, sim.dtype))
    torch._check_value(min_keep >= 0, lambda: f"min_keep must be >= 0, got {min_keep}")
    if self_index is None:
        torch._check_value(sim.shape[0] == sim.shape[1],
                           lambda: f"sim is {list(sim.shape)}, not square: pass self_index (each row's own "
                                   f"column, -1 for none)")
    else:
        torch._check_value(self_index.dim() == 1 and self_index.shape[0] == sim.shape[0],
                           lambda: f"self_index must be [K] with K = {sim.shape[0]}, got {list(self_index.shape)}")
        torch._check_type(self_index.dtype in (torch.int64, torch.int32),
                          lambda: f"self_index must be an int64 or int32 tensor, got {self_index.dtype}")
        torch._check_value(self_index.device == sim.device,
                           lambda: f"self_index must be on sim's device {sim.device}, got {self_index.device}")


def check_weights_values(sim, self_index) -> None:
    """The checks of similarity_weights that read the data: every kernel makes them (the C++
    one in its own pass, the reference and Triton ones here), none of the wrappers or fake
    kernels, so the op traces on meta/fake tensors and raises the same ValueError on every
    backend, also when called as ``torch.ops.pfl.similarity_weights``."""
    k, m = sim.shape
    if self_index is not None and k:
        bad = (self_index < -1) | (self_index >= m)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"self_index values must be in [-1, {m}) (a column of sim, or -1 for none), "
                             f"got {int(self_index[i])} in row {i}")
    if not values_finite(sim):
        raise ValueError("sim must be finite (it holds NaN or Inf)")


def _reference_cosine(x, y, eps):
    _check_pair(x, y, eps)
    return ref.pairwise_cosine(x, y, eps)


def _reference_sqdist(x, y):
    _check_pair(x, y)
    return ref.pairwise_sqdist(x, y)


def _reference_weights(sim, tau, scale, min_keep, self_index):
    _check_weights_args(sim, tau, scale, min_keep, self_index)
    check_weights_values(sim, self_index)
    return ref.similarity_weights(sim, tau, scale, min_keep, self_index)


PAIRWISE_COSINE = define_op("pairwise_cosine(Tensor x, Tensor? y, float eps) -> Tensor", _reference_cosine)
PAIRWISE_SQDIST = define_op("pairwise_sqdist(Tensor x, Tensor? y) -> Tensor", _reference_sqdist)
SIMILARITY_WEIGHTS = define_op(
    "similarity_weights(Tensor sim, float tau, float scale, int min_keep, Tensor? self_index) -> Tensor",
    _reference_weights)


@torch.library.register_fake(PAIRWISE_COSINE)
def _pairwise_cosine_fake(x, y, eps):
    return x.new_empty(_check_pair(x, y, eps), dtype=ref.acc_dtype(x.dtype))


@torch.library.register_fake(PAIRWISE_SQDIST)
def _pairwise_sqdist_fake(x, y):
    return x.new_empty(_check_pair(x, y), dtype=ref.acc_dtype(x.dtype))


@torch.library.register_fake(SIMILARITY_WEIGHTS)
def _similarity_weights_fake(sim, tau, scale, min_keep, self_index):
    _check_weights_args(sim, tau, scale, min_keep, self_index)
    return sim.new_empty(sim.shape, dtype=ref.acc_dtype(sim.dtype))


# ---------------------------------------------------------------- the CUDA paths (issue 30, item 2)

# pairwise_cosine / pairwise_sqdist of float32 rows this long or longer take the GEMM form on
# CUDA.  On an H200 (issue 30, gpu_similarity.py --quick: K in {20, 100}, D in {65536, 10^6},
# y None) the Triton kernels ran at 0.07x-1.02x of the eager F.normalize + mm / cdist: at no
# measured D did they win by more than 2%, and at K = 20, D = 65536 they lost 14x.  65536 is
# the smallest D measured; shorter rows (unmeasured, where one fused launch may still win)
# keep the kernel until a GPU says otherwise.
GEMM_MIN_DIM = 65_536
# A float32 row whose norm lies in [2^-32, sqrt(max / 8)] (its squared norm in [2^-64, max/8],
# the C++ and Triton kernels' safe band) squares, multiplies and sums without over- or
# underflow that matters: the GEMM form takes such rows as they are (its epilogue recomputes
# a tile with any other row from the rows scaled by powers of two, as the reference does).
_NORM_LOW = 2.0 ** -32
_NORM_HIGH = math.sqrt(torch.finfo(torch.float32).max / 8)


def cuda_pairwise_path(d: int, dtype: torch.dtype, tf32: bool) -> str:
    """Which implementation serves ``pairwise_cosine`` / ``pairwise_sqdist`` of rows of length
    ``d`` and ``dtype`` on CUDA: 'reference' (float64: cuBLAS dgemm), 'gemm' (the GEMM form,
    ``pfl_kernels.triton.similarity._gemm_pairwise``: one cuBLAS GEMM, with y the rows' norms,
    as ``torch.cdist`` does, then one fused epilogue; no device sync) or 'triton' (the fused
    kernel).

    'gemm' for float32 at D >= ``GEMM_MIN_DIM``, unless torch's float32 matmuls may use TF32
    (``torch.backends.cuda.matmul.allow_tf32``; the op promises float32 accumulation, which the
    kernel's ``ieee`` dot keeps).  bfloat16/float16 keep the kernel (tensor cores, float32
    results; not measured against the GEMM form yet)."""
    if dtype == torch.float64:
        return "reference"
    if dtype == torch.float32 and d >= GEMM_MIN_DIM and not tf32:
        return "gemm"
    return "triton"


# ---------------------------------------------------------------- autograd

def _normalized_rows(t: torch.Tensor, acc: torch.dtype, eps: float):
    """(t_i / max(‖t_i‖, eps), 1 / max(‖t_i‖, eps), ‖t_i‖ > eps) for t's rows, in ``acc``.

    From the rows scaled by a power of two (``reference.similarity.scaled_rows``): no square
    overflows or underflows, so rows of 1e19 or 1e-30 in float32 get their true gradient
    (their norm squared in float32 is Inf or 0).  Plain differentiable torch ops (σ is a
    constant), so the backward can itself be differentiated.
    """
    scaled, sigma, _ = ref.scaled_rows(t.to(acc))
    # vector_norm, not sqrt of a sum: its derivative at a zero row is 0, not 0·Inf = NaN.
    f, live = ref.inverse_norms(torch.linalg.vector_norm(scaled, dim=1), sigma, eps)
    return scaled * f[:, None], sigma * f, live


def _cosine_setup(ctx, inputs, keyword_only_inputs, output):
    x, y, eps = inputs
    ctx.eps = eps
    ctx.has_y = y is not None
    ctx.save_for_backward(x, y, output)


def _cosine_backward(ctx, grad):
    """d c_ij / d x_i = y_j / (a_i b_j) − c_ij x_i / a_i² (the second term only where ‖x_i‖ > eps,
    where a_i = ‖x_i‖ depends on x_i), a_i = max(‖x_i‖, eps), b_j = max(‖y_j‖, eps).

    Written with the normalized rows x̂_i = x_i / a_i and 1/a_i factored out,
    grad_x_i = (1/a_i)·(Σ_j g_ij ŷ_j − (Σ_j g_ij c_ij) x̂_i): nothing is squared, so extreme
    rows (1e19, 1e-30) neither overflow nor underflow.  A NaN/Inf row makes its gradient NaN.
    """
    x, y, c = ctx.saved_tensors
    acc = c.dtype
    g = grad.to(acc)
    xn, inv_x, live_x = _normalized_rows(x, acc, ctx.eps)
    gc = g * c
    if not ctx.has_y:
        coef = (gc.sum(1) + gc.sum(0)) * live_x
        grad_x = inv_x[:, None] * ((g + g.t()) @ xn - xn * coef[:, None])
        return grad_x.to(x.dtype), None, None
    yn, inv_y, live_y = _normalized_rows(y, acc, ctx.eps)
    grad_x = grad_y = None
    if ctx.needs_input_grad[0]:
        grad_x = (inv_x[:, None] * (g @ yn - xn * (gc.sum(1) * live_x)[:, None])).to(x.dtype)
    if ctx.needs_input_grad[1]:
        grad_y = (inv_y[:, None] * (g.t() @ xn - yn * (gc.sum(0) * live_y)[:, None])).to(y.dtype)
    return grad_x, grad_y, None


def _sqdist_setup(ctx, inputs, keyword_only_inputs, output):
    x, y = inputs
    ctx.has_y = y is not None
    ctx.acc = output.dtype
    ctx.save_for_backward(x, y)


def _sqdist_backward(ctx, grad):
    """d ‖x_i − y_j‖² / d x_i = 2 (x_i − y_j): grad_x = 2 (rowsum(G) x − G y)."""
    x, y = ctx.saved_tensors
    g = grad.to(ctx.acc)
    xa = x.to(ctx.acc)
    if not ctx.has_y:
        grad_x = 2 * ((g.sum(1) + g.sum(0))[:, None] * xa - (g + g.t()) @ xa)
        return grad_x.to(x.dtype), None
    ya = y.to(ctx.acc)
    grad_x = grad_y = None
    if ctx.needs_input_grad[0]:
        grad_x = (2 * (g.sum(1)[:, None] * xa - g @ ya)).to(x.dtype)
    if ctx.needs_input_grad[1]:
        grad_y = (2 * (g.sum(0)[:, None] * ya - g.t() @ xa)).to(y.dtype)
    return grad_x, grad_y


def _weights_setup(ctx, inputs, keyword_only_inputs, output):
    sim, tau, scale, min_keep, self_index = inputs
    ctx.scale = scale
    ctx.sim_dtype = sim.dtype
    ctx.save_for_backward(output, self_index)


def _weights_backward(ctx, grad):
    weights, self_index = ctx.saved_tensors
    grad_sim = ref.similarity_weights_backward(grad, weights, self_index, ctx.scale)
    return grad_sim.to(ctx.sim_dtype), None, None, None, None


register_autograd(PAIRWISE_COSINE, _cosine_backward, _cosine_setup)
register_autograd(PAIRWISE_SQDIST, _sqdist_backward, _sqdist_setup)
register_autograd(SIMILARITY_WEIGHTS, _weights_backward, _weights_setup)


# ---------------------------------------------------------------- wrappers

def _check_pair_args(x, y) -> None:
    check_tensor("x", x, dims=(2,))
    if y is None:
        return
    check_tensor("y", y, dims=(2,))
    check_same("x", x, "y", y)
    if y.shape[1] != x.shape[1]:
        raise ValueError(f"y must be [M, D] with D = {x.shape[1]} (x is {list(x.shape)}), got {list(y.shape)}")


def pairwise_cosine(x: torch.Tensor, y: Optional[torch.Tensor] = None, *, eps: float = 1e-8) -> torch.Tensor:
    """Cosine similarity of every row of ``x`` with every row of ``y``, normalization fused.

    c[i, j] = x_i·y_j / (max(‖x_i‖, eps)·max(‖y_j‖, eps)), clamped to [-1, 1].  Factorized-FL
    matches clients by the cosine of their v vectors (Eq. 4), SimFed by the cosine of their
    encoders' outputs (Eq. 3); FedDAF's angle between two mean gradients is M = 1.

    A zero vector (‖x_i‖ <= eps, in the limit ‖x_i‖ = 0) has similarity 0 with every finite
    vector, itself included: the numerator is 0 and the denominator at least eps·eps.
    Vectors with 0 < ‖x_i‖ < eps are scaled by 1/eps instead of 1/‖x_i‖ (|c| < 1 there).
    A row with a NaN or ±Inf entry gives NaN in its row (and column when y is None, c[i, i]
    included); rows of 1e19 or 1e-30 give their true cosine (see the module docstring).

    No normalized copy of x is made: the product x·yᵀ is computed once (BLAS on CPU, a
    tiled Triton kernel on CUDA) and scaled in its epilogue.  With ``y`` None the squared
    norms are the diagonal of the Gram matrix x·xᵀ (no extra pass), and the result is
    symmetric.

    Args:
        x: [K, D] float32/float64/bfloat16/float16.
        y: [M, D] of x's dtype and device, or None for ``x`` itself (M = K).
        eps: floor of the norms, > 0.

    Returns:
        [K, M] in float32 (float64 for float64 inputs).  Differentiable in x and y.

    Raises:
        TypeError: non-tensor or non-floating inputs, differing dtypes, non-real eps.
        ValueError: inputs that are not 2-D, differing D, differing devices, eps <= 0 or
        not finite.
    """
    _check_pair_args(x, y)
    eps = real_number("eps", eps)
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    return kernel_for("pairwise_cosine", x, y)(x, y, eps)


def pairwise_sqdist(x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Squared Euclidean distance of every row of ``x`` to every row of ``y``.

    d[i, j] = max(‖x_i‖² + ‖y_j‖² − 2·x_i·y_j, 0) (FedAMP's exp(−‖w_i − w_j‖²/σ), FedFomo's
    ‖θ_j − θ_i‖), computed from one matrix product; with ``y`` None the norms come from
    the Gram matrix's diagonal, the diagonal is exactly 0 (for finite rows) and the result
    is symmetric.

    A row with a NaN or ±Inf entry gives NaN in its row (and column when y is None, its own
    d[i, i] included, never 0); rows of 1e19 or 1e-30 are scaled before squaring, and a
    distance beyond the dtype's range is +Inf (see the module docstring).

    Precision.  This expanded form cancels for near-duplicate rows: its absolute error is
    about u·(‖x_i‖² + ‖y_j‖²) times a small factor (u = 2^-24 in float32, with float32
    accumulation also for bfloat16 inputs), the factor growing about like √D (measured:
    5e-6·(‖x_i‖² + ‖y_j‖²) in float32 at D = 10⁵), not relative to d itself; so two distinct rows
    closer than about sqrt(u)·‖x_i‖ can come out as 0, and small distances carry a large
    relative error.  The clamp keeps them from going negative.  Where near-duplicates must
    be told apart, pass float64 inputs (u = 2^-53) or subtract explicitly.

    Args:
        x: [K, D] float32/float64/bfloat16/float16.
        y: [M, D] of x's dtype and device, or None for ``x`` itself.

    Returns:
        [K, M] in float32 (float64 for float64 inputs), >= 0 (or NaN for non-finite rows).
        Differentiable in x and y (the gradient of ‖x_i − y_j‖², 2·(x_i − y_j)).

    Raises:
        TypeError / ValueError: as ``pairwise_cosine``.
    """
    _check_pair_args(x, y)
    return kernel_for("pairwise_sqdist", x, y)(x, y)


def similarity_weights(sim: torch.Tensor, *, tau: float, scale: float, min_keep: int = 0,
                       self_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Aggregation weights from similarities: Factorized-FL Eq. 4–5, SimFed Eq. 3.

    For each row i of ``sim`` [K, M] (client i against M candidates), with v = sim[i] and
    its own entry v[self] taken as 1.0 (a client's similarity with itself, as in the
    papers, whatever sim holds there):

    * kept: every j with v_j >= tau; the own entry, always; and, if that is fewer than
      ``min_keep``, the most similar others until ``min_keep`` are kept, the own entry
      counting as one (the released code's ``minimum_aggr``);
    * w[i, j] = exp(scale·v_j) / Σ_{kept l} exp(scale·v_l) on the kept entries, 0 elsewhere.

    Rows sum to 1.  ``min_keep`` larger than the row keeps the whole row.  A row without an
    own column (``self_index`` -1) keeps its entries >= tau and at least its ``min_keep``
    most similar; if that is nothing (nothing reaches tau and min_keep is 0) the row is
    all zeros (it sums to 0: nothing to aggregate).

    Ties.  Deterministic: among equal similarities the lower column index is kept first.

    Args:
        sim: [K, M] similarities (e.g. from ``pairwise_cosine``), finite, any float dtype.
        tau: threshold in [-1, 1] (Factorized-FL: 0.95 domain-heterogeneous, 0 permuted).
        scale: the softmax's inverse temperature (Factorized-FL's ε, SimFed's α), finite in
            the accumulation dtype (float32 but for float64 sim).
        min_keep: keep at least this many entries per row (>= 0).
        self_index: None when row i's own column is column i (sim must be square); else an
            int64/int32 tensor [K] of column indices in [0, M), -1 for "no own column".

    Returns:
        [K, M] weights in float32 (float64 for float64 sim).  Differentiable in sim through
        the softmax on the kept entries (the kept set is piecewise constant; the own entry
        is the constant 1.0 and gets no gradient).

    Raises:
        TypeError: sim not a floating tensor, self_index not an integer tensor, tau/scale
        not real numbers, min_keep not an int.  ValueError: sim not 2-D, NaN/Inf in sim, tau
        outside [-1, 1], scale not finite (in the accumulation dtype), min_keep < 0, sim not
        square with self_index None, self_index of the wrong shape, device, or with values
        outside [-1, M).
    """
    check_tensor("sim", sim, dims=(2,))
    tau = real_number("tau", tau)
    if not -1.0 <= tau <= 1.0:
        raise ValueError(f"tau must be in [-1, 1], got {tau}")
    scale = real_number("scale", scale)
    if (message := _scale_range_message(scale, sim.dtype)) is not None:
        raise ValueError(message)
    min_keep = integer("min_keep", min_keep)
    if min_keep < 0:
        raise ValueError(f"min_keep must be >= 0, got {min_keep}")
    k, m = sim.shape
    min_keep = min(int(min_keep), m)  # more than the row keeps the row: the op's int is 64-bit
    if self_index is None:
        if k != m:
            raise ValueError(f"sim is [{k}, {m}], not square: pass self_index (row i's own column, "
                             f"-1 for none)")
    else:
        check_is_tensor("self_index", self_index, or_none=True)
        if self_index.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"self_index must be an int64 or int32 tensor, got {self_index.dtype}")
        if self_index.dim() != 1 or self_index.shape[0] != k:
            raise ValueError(f"self_index must be [K] with K = {k} (sim's rows), got {list(self_index.shape)}")
        if self_index.device != sim.device:
            raise ValueError(f"self_index must be on sim's device {sim.device}, got {self_index.device}")
    # NaN/Inf in sim and self_index values: checked by the op itself (every kernel), not here.
    return kernel_for("similarity_weights", sim, self_index)(sim, tau, scale, min_keep, self_index)

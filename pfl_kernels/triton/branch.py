"""Triton kernels of the multi-branch ops (pFedMB), registered for the CUDA dispatch key.

The combine ops are memory bound (B is 2..10, one multiply-add per element and branch):
the floor is reading the B branches once and writing W once (forward), reading G and
writing the B gradients once (backward).  So every kernel makes exactly one pass:

* forward: one program per (client, N-block), clients the fastest grid axis, reads
  ``weights[k, b, n-block]`` for every branch b (a loop over b, unrolled for the first
  ``_UNROLL_B`` branches), accumulates ``alpha[k, b] * weights`` in float32 (float64 for
  float64) registers and stores the block of W once;
* backward: one program per (client, N-block) reads its block of G once, then for every
  b writes ``alpha[k, b] * G`` into grad_weights and/or the block's partial sum of
  ``G * weights[k, b]`` into a small float32/float64 buffer [K, n_blocks, B]; a
  ``torch.sum`` over the block axis finishes grad_alpha.  No atomics, so the result is
  deterministic; with a single N-block the kernel writes grad_alpha itself and no summing
  pass runs.

Addressing.  The trailing ``*shape`` dims of weights are read as one run of N elements
with a stride (any client and branch strides, stride 0 included: branches shared by all
clients arrive as ``weights.expand(K, ...)`` and are read, never copied).  When the
trailing dims are not one strided run (e.g. a channels_last or permuted weight), that
operand is copied to a contiguous one first; a stride-0 client (or branch) dim is kept
out of that copy (one copy of the shared branches, re-expanded), so nothing is ever
materialized K times.  The same holds for grad_w.  Offsets inside one (client, branch)
slice are int32; the client and branch offsets are int64.

``project_simplex_`` projects each row [B] of x in registers with a sort-free O(B²)
formulation of the sort-based reference (see ``_project_simplex_kernel``), several rows
per program; rows longer than ``_MAX_SIMPLEX_B`` (1024) go to the plain-PyTorch reference.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..ops import branch as _ops  # noqa: F401  (defines the schemas implemented here)
from . import register_cuda
from ..ops.branch import _check_op_args, _check_project_args
from ..ops._memo import cdiv, metadata_cached, next_power_of_2
from ..reference import branch as _ref
from .factorized import _acc_dtype, _check_devices, _device_guard, _launch, _launch_planned, _meta_twin


# Block budget: BLOCK_N = 4096 is 16 fp32 values per thread at 8 warps, enough bytes in
# flight per SM to saturate HBM.  A launch with few blocks (K = 1, a small layer) uses
# smaller blocks, down to _MIN_BLOCK_N, so that every SM gets work.  Tests shrink these.
_MAX_BLOCK_N = 4096
_MIN_BLOCK_N = 1024
_WAVES = 4  # aim for at least this many blocks per SM before shrinking stops
_UNROLL_B = 16  # branches 0.._UNROLL_B-1 are unrolled (static); the rest is a runtime loop
_MAX_SIMPLEX_B = 1024  # longer rows: plain-PyTorch reference
_SIMPLEX_TILE = 4096  # elements of the [rows, i, j] comparison tile of one program


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _block_n(kk: int, n: int, device: torch.device) -> int:
    """BLOCK_N: _MAX_BLOCK_N, halved (not below _MIN_BLOCK_N) while the grid is small."""
    block = min(_MAX_BLOCK_N, next_power_of_2(max(n, 1)))
    floor = min(_MIN_BLOCK_N, block)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132
    while block > floor and kk * cdiv(n, block) < _WAVES * sms:
        block //= 2
    return block


def _num_warps(block: int) -> int:
    """8 warps for a full block (16 fp32 per thread), fewer for small ones."""
    return max(1, min(8, block // 512))


def _as_kbn(t: torch.Tensor, lead: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` [*lead dims, *rest] as a view ``shape`` ([K, B, N] or [K, N]) through its strides.

    When the trailing dims cannot be viewed as one strided run, copy: only the leading
    dims with a nonzero stride are copied (a stride-0 client dim stays stride 0).
    """
    try:
        return t.view(shape)
    except RuntimeError:
        pass
    # Narrow every stride-0 leading dim to size 1, copy that, view it, expand it back.
    narrowed = t
    for d in range(lead):
        if t.stride(d) == 0 and t.shape[d] > 1:
            narrowed = narrowed.narrow(d, 0, 1)
    small = narrowed.contiguous()
    return small.view(*narrowed.shape[:lead], -1).expand(shape)


@triton.jit
def _block(N, K, BLOCK_N: tl.constexpr):
    """This program's client k (int64), block index nb, offsets n and their mask.

    Clients are the fastest axis: the programs running together read the same block of
    branches shared by all clients (stride 0 on K), which L2 then serves once.  With
    per-client branches the order makes no difference (each program reads whole blocks).
    """
    pid = tl.program_id(0)
    k = (pid % K).to(tl.int64)
    nb = pid // K
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    return k, nb, n, n < N


@triton.jit
def _combine_step(acc, w_ptr, a_ptr, k, b, n, nm, sw_k, sw_b, sw_n, sa_k, sa_b):
    """acc + alpha[k, b] * weights[k, b, n]."""
    a = tl.load(a_ptr + k * sa_k + b * sa_b).to(acc.dtype)
    base = k * sw_k + (k * 0 + b) * sw_b  # int64 (b may be a constexpr or an int32)
    w = tl.load(w_ptr + base + n * sw_n, mask=nm, other=0).to(acc.dtype)
    return acc + a * w


@triton.jit
def _branch_combine_kernel(
    w_ptr, a_ptr, out_ptr,
    N, B, K,
    sw_k, sw_b, sw_n, sa_k, sa_b,
    B_UNROLL: tl.constexpr, ACC_F64: tl.constexpr, BLOCK_N: tl.constexpr,
):
    k, _, n, nm = _block(N, K, BLOCK_N)
    if ACC_F64:
        acc = tl.zeros([BLOCK_N], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for b in tl.static_range(B_UNROLL):
        acc = _combine_step(acc, w_ptr, a_ptr, k, b, n, nm, sw_k, sw_b, sw_n, sa_k, sa_b)
    for b in range(B_UNROLL, B):
        acc = _combine_step(acc, w_ptr, a_ptr, k, b, n, nm, sw_k, sw_b, sw_n, sa_k, sa_b)
    # W is contiguous [K, N].
    tl.store(out_ptr + k * N + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _backward_step(g, w_ptr, a_ptr, gw_ptr, ga_ptr, k, nb, b, n, nm, N, B, n_nb,
                   sw_k, sw_b, sw_n, sa_k, sa_b, NEED_W: tl.constexpr, NEED_ALPHA: tl.constexpr):
    """Branch b of the backward: grad_weights[k, b, n-block] and grad_alpha's partial sum."""
    kb = k * B + b  # int64: (client, branch) index of the contiguous outputs
    if NEED_W:
        a = tl.load(a_ptr + k * sa_k + b * sa_b).to(g.dtype)
        tl.store(gw_ptr + kb * N + n, (a * g).to(gw_ptr.dtype.element_ty), mask=nm)
    if NEED_ALPHA:
        base = k * sw_k + (k * 0 + b) * sw_b  # int64
        w = tl.load(w_ptr + base + n * sw_n, mask=nm, other=0).to(g.dtype)
        # G is 0 outside the block, so the masked lanes add nothing.
        part = tl.sum(g * w, axis=0)
        tl.store(ga_ptr + (k * n_nb + nb) * B + b, part.to(ga_ptr.dtype.element_ty))


@triton.jit
def _branch_combine_backward_kernel(
    g_ptr, w_ptr, a_ptr, gw_ptr, ga_ptr,
    N, B, K, n_nb,
    sg_k, sg_n, sw_k, sw_b, sw_n, sa_k, sa_b,
    NEED_W: tl.constexpr, NEED_ALPHA: tl.constexpr,
    B_UNROLL: tl.constexpr, ACC_F64: tl.constexpr, BLOCK_N: tl.constexpr,
):
    k, nb, n, nm = _block(N, K, BLOCK_N)
    if ACC_F64:
        g = tl.load(g_ptr + k * sg_k + n * sg_n, mask=nm, other=0).to(tl.float64)
    else:
        g = tl.load(g_ptr + k * sg_k + n * sg_n, mask=nm, other=0).to(tl.float32)
    for b in tl.static_range(B_UNROLL):
        _backward_step(g, w_ptr, a_ptr, gw_ptr, ga_ptr, k, nb, b, n, nm, N, B, n_nb,
                       sw_k, sw_b, sw_n, sa_k, sa_b, NEED_W, NEED_ALPHA)
    for b in range(B_UNROLL, B):
        _backward_step(g, w_ptr, a_ptr, gw_ptr, ga_ptr, k, nb, b, n, nm, N, B, n_nb,
                       sw_k, sw_b, sw_n, sa_k, sa_b, NEED_W, NEED_ALPHA)


@triton.jit
def _project_simplex_kernel(
    x_ptr, n_rows, B, s_r, s_b,
    ACC_F64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """Each row x [B] <- max(x - θ, 0), the reference's θ without sorting.

    With u = x sorted descending, S_j its prefix sums and f(j) = u_j - (S_j - 1)/j, the
    reference takes ρ = #{j : f(j) > 0} and θ = (S_ρ - 1)/ρ.  j·f(j) is non-increasing in j
    and constant over a run of ties, so the support is a prefix made of whole tie groups,
    and ρ is the end of a tie group.  For element i, n_i = #{j : x_j >= x_i} is the end of
    i's tie group and s_i = Σ_{x_j >= x_i} x_j = S_{n_i}: i is in the support iff
    x_i - (s_i - 1)/n_i > 0 (the reference's test, at the end of i's group), ρ is the
    largest n_i in the support and θ = (s_i - 1)/n_i for that i.

    The sums run on x - max(x) (the projection commutes with a shift): the same result up
    to rounding for ordinary rows, and still right for rows with huge entries (|x| beyond
    1/eps), where x - θ would cancel.  The maximum is then exactly in the support (0 > -1/m).
    """
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, BLOCK_B)
    rm = rows < n_rows
    m2 = rm[:, None] & (i < B)[None, :]
    row_off = rows[:, None] * s_r
    ptrs = x_ptr + row_off + i[None, :] * s_b
    if ACC_F64:
        x = tl.load(ptrs, mask=m2, other=0).to(tl.float64)
    else:
        x = tl.load(ptrs, mask=m2, other=0).to(tl.float32)
    # A row holding NaN or ±Inf comes out all NaN (the op's rule; the reference's too).
    not_finite = tl.max((m2 & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32), axis=1) > 0
    x_max = tl.max(tl.where(m2, x, -float("inf")), axis=1)
    x_max = tl.where(rm, x_max, 0)  # rows past the end: keep them finite
    xs = x - x_max[:, None]
    # Entries more than 1 below the maximum are never in the support (θ >= -1): summed and
    # tested as -2 (the reference's clamp), the sums stay finite for rows spanning more than
    # half the float range.
    xc = tl.maximum(xs, -2.0)

    cnt = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.int32)
    s = tl.zeros([BLOCK_R, BLOCK_B], dtype=x.dtype)
    if BLOCK_J == BLOCK_B:  # the whole row in one chunk: compare x with itself
        ge = (x[:, None, :] >= x[:, :, None]) & m2[:, None, :]  # [r, i, j]: x_j >= x_i
        cnt += tl.sum(ge.to(tl.int32), axis=2)
        s += tl.sum(tl.where(ge, xc[:, None, :], 0), axis=2)
    else:  # long rows: the j axis in chunks (re-read from L1/L2)
        for j0 in range(0, B, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            mj = rm[:, None] & (j < B)[None, :]
            xj = tl.load(x_ptr + row_off + j[None, :] * s_b, mask=mj, other=0).to(x.dtype)
            ge = (xj[:, None, :] >= x[:, :, None]) & mj[:, None, :]
            cnt += tl.sum(ge.to(tl.int32), axis=2)
            s += tl.sum(tl.where(ge, tl.maximum(xj - x_max[:, None], -2.0)[:, None, :], 0), axis=2)

    c = s - 1
    nf = tl.maximum(cnt, 1).to(x.dtype)  # cnt >= 1 on valid lanes (x_i >= x_i)
    t = c / nf
    support = (xc - t > 0) & m2
    rho = tl.max(tl.where(support, cnt, 0), axis=1)
    theta = tl.max(tl.where(support & (cnt == rho[:, None]), t, -float("inf")), axis=1)
    theta = tl.where(rm, theta, 0)
    y = tl.maximum(xs - theta[:, None], 0.0)
    y = tl.where(not_finite[:, None], float("nan"), y)
    tl.store(ptrs, y.to(x_ptr.dtype.element_ty), mask=m2)


@metadata_cached
def _plan(weights, alpha, grad_w, max_block_n, min_block_n, unroll_b):
    """A combine call's geometry after the op's checks, one run per signature
    (``metadata_cached``; the block limits are arguments so that a test that changes them
    gets a plan of its own): (W's shape, K, B, N, alpha's (client, branch) strides, BLOCK_N,
    blocks per client, B_UNROLL)."""
    out_shape = _check_op_args(weights, alpha) if grad_w is None else _check_op_args(weights, alpha, grad_w)
    _check_devices(alpha, weights, grad_w)
    kk = alpha.shape[0] if alpha.dim() == 2 else 1
    nbr = alpha.shape[-1]
    n = 1
    for d in weights.shape[alpha.dim():]:
        n *= int(d)
    sa = (alpha.stride(0), alpha.stride(1)) if alpha.dim() == 2 else (0, alpha.stride(0))
    block = _block_n(kk, n, weights.device)
    return tuple(out_shape), kk, nbr, n, sa, block, cdiv(n, block), min(nbr, unroll_b)


def _weights_kbn(weights: torch.Tensor, alpha: torch.Tensor, kk: int, nbr: int, n: int) -> torch.Tensor:
    """weights as [K, B, N] (``_as_kbn``; shared branches get a client dim of 1 first)."""
    return _as_kbn(weights if alpha.dim() == 2 else weights.unsqueeze(0), 2, (kk, nbr, n))


def _grad_kn(grad_w: torch.Tensor, alpha: torch.Tensor, kk: int, n: int) -> torch.Tensor:
    """grad_w as [K, N] (``_as_kbn``)."""
    return _as_kbn(grad_w if alpha.dim() == 2 else grad_w.unsqueeze(0), 1, (kk, n))


@metadata_cached
def _combine_launch(weights, alpha, max_block_n, min_block_n, unroll_b):
    """The forward launch of a signature, made once (``metadata_cached``): (``_plan``'s
    geometry, the kernel's scalar arguments, its meta-parameters), the strides of weights as
    [K, B, N] read from a meta twin, as the launcher will view them (``_as_kbn``)."""
    plan = _plan(weights, alpha, None, max_block_n, min_block_n, unroll_b)
    _, kk, nbr, n, (sa_k, sa_b), block, _, unroll = plan
    w3 = _weights_kbn(_meta_twin(weights), alpha, kk, nbr, n)
    scalars = (n, nbr, kk, *w3.stride(), sa_k, sa_b)
    meta = dict(B_UNROLL=unroll, ACC_F64=alpha.dtype == torch.float64, BLOCK_N=block, num_warps=_num_warps(block))
    return plan, scalars, meta


@metadata_cached
def _combine_backward_launch(grad_w, weights, alpha, need_w, need_a, max_block_n, min_block_n, unroll_b):
    """The backward launch of a signature (see ``_combine_launch``), grad_w's strides as
    [K, N] from its meta twin too."""
    plan = _plan(weights, alpha, grad_w, max_block_n, min_block_n, unroll_b)
    _, kk, nbr, n, (sa_k, sa_b), block, n_nb, unroll = plan
    w3 = _weights_kbn(_meta_twin(weights), alpha, kk, nbr, n)
    g2 = _grad_kn(_meta_twin(grad_w), alpha, kk, n)
    scalars = (n, nbr, kk, n_nb, *g2.stride(), *w3.stride(), sa_k, sa_b)
    meta = dict(NEED_W=need_w, NEED_ALPHA=need_a, B_UNROLL=unroll, ACC_F64=_acc_dtype(alpha.dtype) == torch.float64,
                BLOCK_N=block, num_warps=_num_warps(block))
    return plan, scalars, meta


def branch_combine_triton(weights: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Triton ``pfl::branch_combine``: W[k, n] = Σ_b alpha[k, b] · weights[k, b, n].

    Same contract as ``pfl_kernels.reference.branch.branch_combine``: alpha [B] or [K, B],
    weights [*alpha.shape, *shape] with any strides (stride 0 on K for shared branches);
    returns a contiguous W [K?, *shape] in alpha's dtype.  Trailing dims of weights that
    are not one strided run (e.g. channels_last) are copied first (once, not K times).
    """
    launch = _combine_launch(weights, alpha, _MAX_BLOCK_N, _MIN_BLOCK_N, _UNROLL_B)
    (out_shape, kk, nbr, n, _, _, n_nb, _), scalars, meta = launch
    w = alpha.new_empty(out_shape)
    if w.numel() == 0:
        return w
    w3 = _weights_kbn(weights, alpha, kk, nbr, n)
    with _device_guard(alpha):
        _launch_planned(_launch(_branch_combine_kernel), (kk * n_nb,), launch, (w3, alpha, w), scalars, meta)
    return w


def branch_combine_backward_triton(grad_w: torch.Tensor, weights: torch.Tensor, alpha: torch.Tensor,
                                   output_mask):
    """Triton ``pfl::branch_combine_backward``: (grad_weights, grad_alpha) in one pass over G.

    grad_weights[k, b] = alpha[k, b] · G[k] (contiguous, weights' shape), grad_alpha[k, b] =
    ⟨G[k], weights[k, b]⟩ (alpha's shape), summed in float32 (float64 for float64) over
    per-block partial sums: deterministic.  A gradient not asked for by ``output_mask`` is
    ``alpha.new_empty(0)``, as in the reference.  grad_w and weights may have any strides.
    """
    need_w, need_a = bool(output_mask[0]), bool(output_mask[1])
    launch = _combine_backward_launch(grad_w, weights, alpha, need_w, need_a, _MAX_BLOCK_N, _MIN_BLOCK_N, _UNROLL_B)
    (_, kk, nbr, n, _, _, n_nb, _), scalars, meta = launch
    if not (need_w or need_a):
        return alpha.new_empty(0), alpha.new_empty(0)
    acc = _acc_dtype(alpha.dtype)
    gw = alpha.new_empty(weights.shape) if need_w else alpha
    if kk * n == 0:  # nothing to read: grad_alpha is an empty sum
        ga = alpha.new_zeros(alpha.shape) if need_a else alpha.new_empty(0)
        return (gw if need_w else alpha.new_empty(0)), ga
    w3 = _weights_kbn(weights, alpha, kk, nbr, n)
    g2 = _grad_kn(grad_w, alpha, kk, n)
    # One block per client: the kernel writes grad_alpha itself (alpha's dtype, no sum).
    ga_part = alpha.new_empty((kk, n_nb, nbr), dtype=alpha.dtype if n_nb == 1 else acc) if need_a else alpha
    with _device_guard(alpha):
        _launch_planned(_launch(_branch_combine_backward_kernel), (kk * n_nb,), launch, (g2, w3, alpha, gw, ga_part),
                        scalars, meta)
    grad_alpha = alpha.new_empty(0)
    if need_a:  # finish the cross-block sum (deterministic: a fixed-order torch.sum)
        grad_alpha = (ga_part if n_nb == 1 else ga_part.sum(1).to(alpha.dtype)).reshape(alpha.shape)
    return (gw if need_w else alpha.new_empty(0)), grad_alpha


def _simplex_blocks(b: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_B, BLOCK_J): the [rows, i, j] tile within _SIMPLEX_TILE elements."""
    block_b = next_power_of_2(b)
    block_j = block_b if block_b * block_b <= _SIMPLEX_TILE else max(1, _SIMPLEX_TILE // block_b)
    block_r = max(1, min(64, _SIMPLEX_TILE // (block_b * block_j)))
    return block_r, block_b, block_j


def project_simplex_triton_(x: torch.Tensor) -> None:
    """Triton ``pfl::project_simplex_``: in place, each row x[..., :] onto the simplex.

    The reference's (sort-based, Duchi et al.) projection, computed without sorting and on
    x - max(x) (see ``_project_simplex_kernel``), in float32 (float64 for float64): the
    same result up to rounding, ties, all-negative rows and rows already on the simplex
    included, and a right one for rows with entries beyond 1/eps, where the reference's
    support comes out empty and it raises.  A row holding NaN or ±Inf comes out all NaN,
    as in the reference and the C++ kernel.  Rows whose leading dims can be viewed as one
    strided dim are read and written through their strides; others go through a
    contiguous temporary.  Rows longer than 1024 (``_MAX_SIMPLEX_B``) use the plain-PyTorch
    reference.
    """
    _check_project_args(x)
    if x.numel() == 0:
        return
    b = x.shape[-1]
    if b > _MAX_SIMPLEX_B:
        _ref.project_simplex_(x)
        return
    try:
        rows = x.view(-1, b)
    except RuntimeError:
        tmp = x.contiguous()
        project_simplex_triton_(tmp)
        x.copy_(tmp)
        return
    block_r, block_b, block_j = _simplex_blocks(b)
    n_rows = rows.shape[0]
    with _device_guard(x):
        _launch(_project_simplex_kernel)[(cdiv(n_rows, block_r),)](
            rows, n_rows, b, rows.stride(0), rows.stride(1),
            ACC_F64=x.dtype == torch.float64, BLOCK_R=block_r, BLOCK_B=block_b, BLOCK_J=block_j,
            num_warps=4,
        )


register_cuda("branch_combine", branch_combine_triton)
register_cuda("branch_combine_backward", branch_combine_backward_triton)
register_cuda("project_simplex_", project_simplex_triton_)

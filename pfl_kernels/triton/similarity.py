"""Triton kernels of the similarity ops, registered for the CUDA dispatch key.

``pairwise_cosine`` / ``pairwise_sqdist``: one tiled product kernel and one epilogue kernel.

* product: program (tile of BLOCK_K rows of x, tile of BLOCK_M rows of y, split s) walks its
  share of D in BLOCK_D steps: ``tl.dot`` of the two tiles with float32 accumulation
  (tensor cores for bfloat16/float16; ``input_precision="ieee"`` for float32, since TF32
  would cost the cosine three decimal digits) and, in the same loop over the same loaded
  tiles, the rows' sums of squares.  Nothing is read twice and no normalized copy exists.
  With few output tiles (K = 20: one tile) D is split over ``SPLIT`` programs per tile so
  that every SM has work; each writes its partial product and partial norms to float32
  buffers [SPLIT, K, M], [SPLIT, K], [SPLIT, M].  No atomics: deterministic.
  The same loop keeps each row's max |entry| (NaN counted as Inf).
* extreme rows: a row whose max m is outside [2^-32, sqrt(max/8/D)] may have a squared norm
  that over- or underflows float32 (1e19, 1e-30).  A second launch of the product kernel
  (FIX) redoes only the tiles that hold such a row or column, from the rows scaled by a
  power of two σ (``reference.similarity.row_scales``, exact); its other programs return at
  once (no host sync, no cost without extreme rows).
* epilogue: per output tile, sums the SPLIT partials in order and applies the cosine
  (clamp(s / (max(‖x‖, eps) max(‖y‖, eps)), -1, 1)) or the squared distance
  (max(‖x‖² + ‖y‖² − 2 s, 0)), undoing σ as the reference does.  With y None it reads
  s[min(i, j), max(i, j)] (exactly symmetric result) and sets the distance's diagonal to 0.
  A row with a NaN/Inf entry gives NaN in its row (and column), its own entry included.

float64 inputs use the plain-PyTorch reference (cuBLAS dgemm), which is what a float64
Triton dot would lower to at best.  float32 rows of D >= ``GEMM_MIN_DIM`` (65536) on CUDA take
the GEMM form (``_gemm_pairwise``: s = x·yᵀ by cuBLAS, as ``torch.cdist`` does, then
``_gemm_epilogue_kernel``, which takes s and the norms as they are on tiles whose rows all have
norms in the safe band and recomputes any other tile from the scaled rows: two launches and
no device sync), where on an H200 the kernels ran at 0.07x-1.02x of eager (issue 30; the
choice is ``cuda_pairwise_path``, documented there).  Before, the GEMM form was ten PyTorch
launches and a sync to check the norms' band, and ran at 0.21-0.83x of eager on an H100.

``similarity_weights``: one program per row holds the row in registers (rows up to
``_MAX_ROW`` = 16384 entries; longer rows use the reference).  The kept set is the
threshold mask plus the own entry; when that is fewer than min_keep, the remaining ones
are the largest of the rest found without sorting: the values are mapped to int32 keys in
the same order, a binary search over the key range (32 counting passes over the row in
registers) finds the threshold key T of the need-th largest, and of the entries equal to
T the lowest columns are taken (a cumulative count): the reference's tie-breaking.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..ops import similarity as _ops  # (also defines the schemas implemented here)
from . import emulate_good_flags, register_cuda
from ..ops._checks import raise_flagged
from ..ops.similarity import _check_pair, _check_weights_args
from ..ops._memo import cdiv, metadata_cached, next_power_of_2
from ..ops.similarity import check_weights_values
from ..reference import similarity as _ref
from .branch import _sm_count
from .factorized import _check_devices, _device_guard, _launch, _launch_planned


# Tiles of the product: 64 x 64 outputs, 64 of D per step (tests shrink them).
_BLOCK_K = 64
_BLOCK_M = 64
_BLOCK_D = 64
_WAVES = 4  # split D until there are about this many programs per SM
_MAX_PARTIAL_BYTES = 256 << 20  # cap on the float32 partials [SPLIT, K, M]
_MAX_ROW = 16384  # similarity_weights: longer rows use the reference
_GEMM_BLOCK = 64  # the GEMM form's epilogue tiles: 64 x 64 outputs (tests shrink them)
# Devices on which long float32 rows take the GEMM form (``ops.similarity.cuda_pairwise_path``);
# the interpreter tests add "cpu" to check the routing.
_GEMM_DEVICES = ("cuda",)
MODE_COSINE = 0
MODE_SQDIST = 1


@triton.jit
def _row_scales(mx_ptr, rows, mask, R, SPLIT, m_low, m_high):
    """(σ, extreme, finite) of ``rows`` from the split partial maxima of |entry| (NaN stored as
    Inf): see ``_scales_of_maxima``."""
    m = tl.zeros_like(rows).to(tl.float32)
    for p in range(0, SPLIT):
        m = tl.maximum(m, tl.load(mx_ptr + p * R + rows, mask=mask, other=0))
    return _scales_of_maxima(m, m_low, m_high)


@triton.jit
def _abs_max_rows(t):
    """Each row's max |entry| of a tile, NaN counted as Inf (so that it is finite exactly for
    finite rows)."""
    return tl.max(tl.where(t == t, tl.abs(t), float("inf")), axis=1)


@triton.jit
def _scales_of_maxima(m, m_low, m_high):
    """(σ, extreme, finite) of rows whose max |entry| is m (NaN counted as Inf): a row is
    extreme where m is finite, nonzero and outside [m_low, m_high] (then its squared norm may
    over- or underflow); σ = 2^-e with e = frexp's exponent of m, clamped to ±125
    (reference.similarity.row_scales), 1 for the other rows."""
    finite = m < float("inf")
    extreme = finite & (m > 0) & ((m < m_low) | (m > m_high))
    e = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # subnormal m: below -125, clamped
    e = tl.minimum(tl.maximum(e, -125), 125)
    sigma = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return tl.where(extreme, sigma, 1.0), extreme, finite


@triton.jit
def _product_kernel(
    x_ptr, y_ptr, part_ptr, nx_ptr, ny_ptr, mx_ptr, my_ptr,
    K, M, D, d_per_split, SPLIT, m_low, m_high,
    sx_k, sx_d, sy_m, sy_d,
    IEEE: tl.constexpr, FIX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pk = tl.program_id(0)
    pm = tl.program_id(1)
    ps = tl.program_id(2)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    mk = rk < K
    mm = rm < M
    if FIX:
        # Second pass: only tiles with an extreme row or column, recomputed from the rows
        # scaled by σ (exact: powers of two); every other program returns at once.
        sig_x, ext_x, _ = _row_scales(mx_ptr, rk, mk, K, SPLIT, m_low, m_high)
        sig_y, ext_y, _ = _row_scales(my_ptr, rm, mm, M, SPLIT, m_low, m_high)
        run = tl.max(ext_x.to(tl.int32), axis=0) + tl.max(ext_y.to(tl.int32), axis=0) > 0
    else:
        sig_x = tl.full([BLOCK_K], 1.0, tl.float32)
        sig_y = tl.full([BLOCK_M], 1.0, tl.float32)
        run = True
    if run:
        acc = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
        nx = tl.zeros([BLOCK_K], dtype=tl.float32)
        ny = tl.zeros([BLOCK_M], dtype=tl.float32)
        ax = tl.zeros([BLOCK_K], dtype=tl.float32)
        ay = tl.zeros([BLOCK_M], dtype=tl.float32)
        d_lo = ps.to(tl.int64) * d_per_split
        x_row = x_ptr + rk.to(tl.int64)[:, None] * sx_k
        y_row = y_ptr + rm.to(tl.int64)[:, None] * sy_m
        for d0 in range(0, d_per_split, BLOCK_D):
            rd = d_lo + d0 + tl.arange(0, BLOCK_D)
            md = (rd < D) & (d0 + tl.arange(0, BLOCK_D) < d_per_split)
            xt = tl.load(x_row + rd[None, :] * sx_d, mask=mk[:, None] & md[None, :], other=0)
            yt = tl.load(y_row + rd[None, :] * sy_d, mask=mm[:, None] & md[None, :], other=0)
            xf = xt.to(tl.float32)
            yf = yt.to(tl.float32)
            if FIX:
                xf = xf * sig_x[:, None]
                yf = yf * sig_y[:, None]
                acc = tl.dot(xf, tl.trans(yf), acc, input_precision="ieee")
            else:
                if IEEE:
                    acc = tl.dot(xt, tl.trans(yt), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xt, tl.trans(yt), acc)
                ax = tl.maximum(ax, _abs_max_rows(xf))
                ay = tl.maximum(ay, _abs_max_rows(yf))
            nx += tl.sum(xf * xf, axis=1)
            ny += tl.sum(yf * yf, axis=1)
        base = ps.to(tl.int64) * K * M
        tl.store(part_ptr + base + rk.to(tl.int64)[:, None] * M + rm[None, :], acc, mask=mk[:, None] & mm[None, :])
        # Each row's partial norm (and max) is stored by one program only.
        if pm == 0:
            tl.store(nx_ptr + ps.to(tl.int64) * K + rk, nx, mask=mk)
            if not FIX:
                tl.store(mx_ptr + ps.to(tl.int64) * K + rk, ax, mask=mk)
        if pk == 0:
            tl.store(ny_ptr + ps.to(tl.int64) * M + rm, ny, mask=mm)
            if not FIX:
                tl.store(my_ptr + ps.to(tl.int64) * M + rm, ay, mask=mm)


@triton.jit
def _epilogue_kernel(
    part_ptr, nx_ptr, ny_ptr, mx_ptr, my_ptr, out_ptr, K, M, SPLIT, eps, m_low, m_high,
    MODE: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mk = rk < K
    mm = rm < M
    m2 = mk[:, None] & mm[None, :]
    i = rk.to(tl.int64)[:, None]
    j = rm.to(tl.int64)[None, :]
    if SYMMETRIC:  # read the upper triangle only: s[i, j] and s[j, i] are the same number
        idx = tl.where(i <= j, i * M + j, j * M + i)
    else:
        idx = i * M + j
    s = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
    sx = tl.zeros([BLOCK_K], dtype=tl.float32)
    sy = tl.zeros([BLOCK_M], dtype=tl.float32)
    k64 = tl.program_id(0).to(tl.int64) * 0 + K  # int64 offsets: SPLIT·K·M may pass 2^31
    m64 = k64 * 0 + M
    for p in range(0, SPLIT):  # in split order: deterministic
        s += tl.load(part_ptr + p * k64 * m64 + idx, mask=m2, other=0)
        sx += tl.load(nx_ptr + p * k64 + rk, mask=mk, other=0)
        sy += tl.load(ny_ptr + p * m64 + rm, mask=mm, other=0)
    # s, sx, sy are of the rows scaled by σ (1 but for extreme rows): see _row_scales.
    sig_x, _, fin_x = _row_scales(mx_ptr, rk, mk, K, SPLIT, m_low, m_high)
    sig_y, _, fin_y = _row_scales(my_ptr, rm, mm, M, SPLIT, m_low, m_high)
    v = _pairwise_values(s, sx, sy, sig_x, sig_y, fin_x, fin_y, i, j, eps, MODE, SYMMETRIC)
    tl.store(out_ptr + i * M + j, v, mask=m2)


@triton.jit
def _pairwise_values(s, sx, sy, sig_x, sig_y, fin_x, fin_y, i, j, eps, MODE: tl.constexpr, SYMMETRIC: tl.constexpr):
    """The cosine (MODE 0) or squared distance (MODE 1) of a tile from the product s and the
    squared norms sx, sy of its rows scaled by σ (as the reference computes them), NaN in the
    rows and columns of non-finite rows; with SYMMETRIC (y None) the distance's diagonal is 0."""
    if MODE == 0:
        fx = 1.0 / tl.maximum(tl.sqrt(sx), eps * sig_x)
        fy = 1.0 / tl.maximum(tl.sqrt(sy), eps * sig_y)
        v = s * (fx[:, None] * fy[None, :])
        v = tl.where(s == 0, s, v)  # two zero rows with a tiny eps: f_i·f_j = Inf, 0·Inf = NaN
        v = tl.where(v < -1.0, -1.0, tl.where(v > 1.0, 1.0, v))  # a clamp that keeps NaN
    else:
        # d = (r_i² ŝx_i + r_j² ŝy_j − 2 r_i r_j ŝ)·a·a with a_i = 1/σ_i, a = max(a_i, a_j),
        # r = a_•/a (reference.similarity.pairwise_sqdist).
        ax = 1.0 / sig_x
        ay = 1.0 / sig_y
        a = tl.maximum(ax[:, None], ay[None, :])
        r_x = ax[:, None] / a
        r_y = ay[None, :] / a
        v = r_x * r_x * sx[:, None] + r_y * r_y * sy[None, :] - 2.0 * (r_x * r_y) * s
        v = tl.where(v < 0, 0.0, v) * a * a
        if SYMMETRIC:
            v = tl.where(i == j, 0.0, v)
    return tl.where(fin_x[:, None] & fin_y[None, :], v, float("nan"))


@triton.jit
def _gemm_epilogue_kernel(
    s_ptr, nx_ptr, ny_ptr, x_ptr, y_ptr, out_ptr,
    K, M, D, sx_k, sx_d, sy_m, sy_d, eps, n_low, n_high, m_low, m_high,
    MODE: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The GEMM form's one launch after cuBLAS's s = x·yᵀ: a tile whose rows and columns all
    have norms in [n_low, n_high] (the safe band, where scaling changes nothing) takes them and
    s as they are (y None: the norms from s's diagonal and s[i, j] as (s[i, j] + s[j, i]) / 2,
    as the reference makes it exactly symmetric); a tile with another row (NaN, Inf, zero, 1e19,
    1e-30) recomputes its product from x and y scaled by σ, as the fused kernel's second pass
    does, so no host sync ever decides the path.  With y None a tile below the diagonal
    computes its mirror's product and stores it transposed: s[i, j] and s[j, i] are the same
    sums, and the result is exactly symmetric in either case."""
    pk = tl.program_id(0)
    pm = tl.program_id(1)
    rk = pk * BLOCK + tl.arange(0, BLOCK)
    rm = pm * BLOCK + tl.arange(0, BLOCK)
    mk = rk < K
    mm = rm < M
    if SYMMETRIC:  # the squared norms are s's diagonal
        sq_x = tl.load(s_ptr + rk.to(tl.int64) * (M + 1), mask=mk, other=1.0)
        sq_y = tl.load(s_ptr + rm.to(tl.int64) * (M + 1), mask=mm, other=1.0)
        n_x = tl.sqrt(sq_x)
        n_y = tl.sqrt(sq_y)
    else:
        n_x = tl.load(nx_ptr + rk, mask=mk, other=1.0)
        n_y = tl.load(ny_ptr + rm, mask=mm, other=1.0)
        sq_x = n_x * n_x
        sq_y = n_y * n_y
    # NaN norms fail both comparisons: outside
    out_x = ((n_x >= n_low) & (n_x <= n_high)) == 0
    out_y = ((n_y >= n_low) & (n_y <= n_high)) == 0
    outside = tl.sum((out_x & mk).to(tl.int32), axis=0) + tl.sum((out_y & mm).to(tl.int32), axis=0)
    if outside == 0:
        i = rk.to(tl.int64)[:, None]
        j = rm.to(tl.int64)[None, :]
        m2 = mk[:, None] & mm[None, :]
        s = tl.load(s_ptr + i * M + j, mask=m2, other=0)
        if SYMMETRIC:
            s = 0.5 * (s + tl.load(s_ptr + j * M + i, mask=m2, other=0))
        one_x = tl.full([BLOCK], 1.0, tl.float32)
        one_y = tl.full([BLOCK], 1.0, tl.float32)
        v = _pairwise_values(s, sq_x, sq_y, one_x, one_y, mk | True, mm | True, i, j, eps, MODE, SYMMETRIC)
        tl.store(out_ptr + i * M + j, v, mask=m2)
    else:
        if SYMMETRIC:
            swap = pk > pm
        else:
            swap = pk < 0  # never
        # the product's rows (of x) and columns (of y), the tile's or its mirror's
        ra = tl.where(swap, rm, rk)
        rb = tl.where(swap, rk, rm)
        ma = ra < K
        mb = rb < M
        a_row = x_ptr + ra.to(tl.int64)[:, None] * sx_k
        b_row = y_ptr + rb.to(tl.int64)[:, None] * sy_m
        ax = tl.zeros([BLOCK], dtype=tl.float32)
        ay = tl.zeros([BLOCK], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):  # max |entry| per row, NaN counted as Inf
            rd = (d0 + tl.arange(0, BLOCK_D)).to(tl.int64)
            md = rd < D
            xf = tl.load(a_row + rd[None, :] * sx_d, mask=ma[:, None] & md[None, :], other=0).to(tl.float32)
            yf = tl.load(b_row + rd[None, :] * sy_d, mask=mb[:, None] & md[None, :], other=0).to(tl.float32)
            ax = tl.maximum(ax, _abs_max_rows(xf))
            ay = tl.maximum(ay, _abs_max_rows(yf))
        sig_x, _, fin_x = _scales_of_maxima(ax, m_low, m_high)
        sig_y, _, fin_y = _scales_of_maxima(ay, m_low, m_high)
        acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
        sx = tl.zeros([BLOCK], dtype=tl.float32)
        sy = tl.zeros([BLOCK], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            rd = (d0 + tl.arange(0, BLOCK_D)).to(tl.int64)
            md = rd < D
            xf = tl.load(a_row + rd[None, :] * sx_d, mask=ma[:, None] & md[None, :], other=0).to(tl.float32)
            yf = tl.load(b_row + rd[None, :] * sy_d, mask=mb[:, None] & md[None, :], other=0).to(tl.float32)
            xf = xf * sig_x[:, None]
            yf = yf * sig_y[:, None]
            acc = tl.dot(xf, tl.trans(yf), acc, input_precision="ieee")
            sx += tl.sum(xf * xf, axis=1)
            sy += tl.sum(yf * yf, axis=1)
        ia = ra.to(tl.int64)[:, None]
        jb = rb.to(tl.int64)[None, :]
        v = _pairwise_values(acc, sx, sy, sig_x, sig_y, fin_x, fin_y, ia, jb, eps, MODE, SYMMETRIC)
        if SYMMETRIC:
            # A diagonal tile keeps its upper triangle's values for both halves (off the
            # diagonal ia <= jb everywhere).  Mirroring the dot alone was not enough on an H200,
            # likely because sx and sy, the same rows' squared norms, are reduced in the two
            # operands' register layouts (possibly in different orders), and the distance's sums
            # may contract into FMAs in an order that is not symmetric in i and j.
            v = tl.where(ia <= jb, v, tl.trans(v))
        tl.store(out_ptr + tl.where(swap, jb * M + ia, ia * M + jb), v, mask=ma[:, None] & mb[None, :])


class _GemmPlan(NamedTuple):
    """A GEMM-form call's output shape and its epilogue launch: grid, scalars, meta-parameters
    (made once per signature by ``_pairwise_plan``; the plan is its launch's token)."""

    k: int
    m: int
    grid: tuple
    scalars: tuple
    meta: dict


def _gemm_plan(x, y, mode, eps, k, m, d) -> _GemmPlan:
    """The GEMM form's plan for a [K, D] x (and [M, D] y): the epilogue's grid over _GEMM_BLOCK-square
    output tiles, its scalars (strides, eps, the norm band, the max band of unscaled rows) and
    meta-parameters."""
    yy = x if y is None else y
    scalars = (k, m, d, x.stride(0), x.stride(1), yy.stride(0), yy.stride(1), eps, _ops._NORM_LOW, _ops._NORM_HIGH,
               _M_LOW, math.sqrt(_Q_HIGH / max(d, 1)))
    meta = dict(MODE=mode, SYMMETRIC=y is None, BLOCK=_GEMM_BLOCK, BLOCK_D=_BLOCK_D, num_warps=4)
    return _GemmPlan(k, m, (cdiv(k, _GEMM_BLOCK), cdiv(m, _GEMM_BLOCK)), scalars, meta)


def _gemm_pairwise(x: torch.Tensor, y, plan: _GemmPlan) -> torch.Tensor:
    """The GEMM form (float32 rows of D >= ``GEMM_MIN_DIM`` on CUDA, TF32 off): s = x·yᵀ by
    cuBLAS (``torch.mm``), with y the rows' norms (``torch.linalg.vector_norm``), then one
    ``_gemm_epilogue_kernel`` launch.  No device sync: the reference's result, NaN and extreme
    rows included, from two launches (four with y) where the norm-plus-GEMM form in PyTorch
    took about ten and a sync to check the norms' band (on an H100 that form ran at 0.21-0.83x
    of eager)."""
    out = x.new_empty((plan.k, plan.m), dtype=torch.float32)
    if out.numel() == 0:
        return out
    yy = x if y is None else y
    s = torch.mm(x, yy.t())
    if y is None:
        nx = ny = s  # not read: the kernel takes the norms from s's diagonal
    else:
        nx, ny = torch.linalg.vector_norm(x, dim=1), torch.linalg.vector_norm(y, dim=1)
    with _device_guard(x):
        _launch_planned(_launch(_gemm_epilogue_kernel), plan.grid, plan, (s, nx, ny, x, yy, out), plan.scalars,
                        plan.meta)
    return out


def _scratch_layout(shapes) -> tuple[int, tuple]:
    """(total elements, ((shape, strides, offset) per buffer)) of contiguous buffers of
    ``shapes`` in one allocation, each starting 16-byte aligned as Triton assumes."""
    views, total = [], 0
    for shape in shapes:
        strides, step = [], 1
        for size in reversed(shape):
            strides.insert(0, step)
            step *= size
        views.append((tuple(shape), tuple(strides), total))
        total += cdiv(math.prod(shape), 4) * 4  # whole 16-byte units
    return total, tuple(views)


def _scratch(like: torch.Tensor, layout) -> list[torch.Tensor]:
    """Float32 buffers of ``layout`` (``_scratch_layout``) carved from one allocation: one
    allocator call and one view per buffer (a slice and a view each cost twice that)."""
    total, views = layout
    flat = like.new_empty(total, dtype=torch.float32)
    return [flat.as_strided(shape, strides, offset) for shape, strides, offset in views]


def _split(k: int, m: int, d: int, device: torch.device) -> int:
    """Programs per output tile along D: enough for _WAVES programs per SM, within the cap."""
    tiles = cdiv(k, _BLOCK_K) * cdiv(m, _BLOCK_M)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132
    split = max(1, cdiv(_WAVES * sms, tiles))
    split = min(split, cdiv(max(d, 1), _BLOCK_D), max(1, _MAX_PARTIAL_BYTES // (4 * max(k * m, 1))))
    return max(1, split)


# Rows whose max |entry| m lies in [_M_LOW, sqrt(_Q_HIGH / D)] have float32 squared norms in
# [2^-64, max/8] (C++ kernel: the safe band) and are taken as they are; others are scaled.
_M_LOW = 2.0 ** -32
_Q_HIGH = torch.finfo(torch.float32).max / 8


@metadata_cached
def _pairwise_plan(x, y, mode, eps, tf32, tuning):
    """A pairwise call's checks and geometry, once per signature (``metadata_cached``): None
    where the reference serves (float64), a ``_GemmPlan`` where the GEMM form does, else (K, M,
    D, D per split, the scratch layout, the product grid, the row band's upper end, the
    launches' arguments: see ``_launch_arguments``).  ``tuning`` holds the block sizes and routing settings read here
    (tests change them), so that they are in the key."""
    k, m = _check_pair(x, y, eps if mode == MODE_COSINE else None)
    _check_devices(x, y)
    d = x.shape[1]
    if x.dtype == torch.float64:
        return None
    if x.device.type in _GEMM_DEVICES and _ops.cuda_pairwise_path(d, x.dtype, tf32) == "gemm":
        return _gemm_plan(x, y, mode, eps, k, m, d)
    if k == 0 or m == 0:  # an empty result: nothing to launch
        return k, m, d, 0, 0, None, None, 0.0, None
    split = _split(k, m, d, x.device)
    # Each split's share of D, a multiple of BLOCK_D.
    d_per_split = cdiv(cdiv(max(d, 1), split), _BLOCK_D) * _BLOCK_D
    split = cdiv(max(d, 1), d_per_split)
    layout = _scratch_layout([(split, k, m), (split, k), (split, m), (split, k), (split, m)])
    grid = (cdiv(k, _BLOCK_K), cdiv(m, _BLOCK_M), split)
    m_high = math.sqrt(_Q_HIGH / max(d, 1))
    return k, m, d, d_per_split, split, layout, grid, m_high, _launch_arguments(x, y, mode, eps, k, m, d, d_per_split,
                                                                               split, m_high)


def _launch_arguments(x, y, mode, eps, k, m, d, d_per_split, split, m_high):
    """The scalar arguments and meta-parameters of a call's launches, made with its plan:
    (the product's scalars, its two passes' meta-parameters, the epilogue's grid, scalars
    and meta-parameters).  Each meta dict is its launch's token (``_launch_planned``): it
    lives as long as the plan and belongs to it alone."""
    yy = x if y is None else y
    product_scalars = (k, m, d, d_per_split, split, _M_LOW, m_high, x.stride(0), x.stride(1),
                       yy.stride(0), yy.stride(1))
    product_metas = tuple(dict(IEEE=x.dtype == torch.float32, FIX=fix, BLOCK_K=_BLOCK_K, BLOCK_M=_BLOCK_M,
                               BLOCK_D=_BLOCK_D, num_warps=4) for fix in (False, True))
    epilogue_grid = (cdiv(k, _BLOCK_K), cdiv(m, _BLOCK_M))
    epilogue_scalars = (k, m, split, eps, _M_LOW, m_high)
    epilogue_meta = dict(MODE=mode, SYMMETRIC=y is None, BLOCK_K=_BLOCK_K, BLOCK_M=_BLOCK_M, num_warps=4)
    return product_scalars, product_metas, epilogue_grid, epilogue_scalars, epilogue_meta


def _pairwise(x: torch.Tensor, y, mode: int, eps: float) -> torch.Tensor:
    tuning = (_BLOCK_K, _BLOCK_M, _BLOCK_D, _WAVES, _MAX_PARTIAL_BYTES, _GEMM_DEVICES, _ops.GEMM_MIN_DIM,
              _GEMM_BLOCK)
    plan = _pairwise_plan(x, y, mode, eps, torch.backends.cuda.matmul.allow_tf32, tuning)
    if plan is None:  # float64
        return _ref.pairwise_cosine(x, y, eps) if mode == MODE_COSINE else _ref.pairwise_sqdist(x, y)
    if isinstance(plan, _GemmPlan):
        return _gemm_pairwise(x, y, plan)
    k, m, d, d_per_split, split, layout, grid, m_high, launches = plan
    out = x.new_empty((k, m), dtype=torch.float32)
    if out.numel() == 0:
        return out
    product_scalars, product_metas, epilogue_grid, epilogue_scalars, epilogue_meta = launches
    yy = x if y is None else y
    part, nx, ny, mx, my = _scratch(x, layout)
    with _device_guard(x):
        for meta in product_metas:  # FIX False, then True: the second pass redoes only tiles with an extreme row
            _launch_planned(_launch(_product_kernel), grid, meta, (x, yy, part, nx, ny, mx, my), product_scalars, meta)
        _launch_planned(_launch(_epilogue_kernel), epilogue_grid, epilogue_meta, (part, nx, ny, mx, my, out),
                        epilogue_scalars, epilogue_meta)
    return out


def pairwise_cosine_triton(x: torch.Tensor, y, eps: float) -> torch.Tensor:
    """Triton ``pfl::pairwise_cosine``: the reference's result, float32 accumulation, [K, M] float32."""
    return _pairwise(x, y, MODE_COSINE, eps)


def pairwise_sqdist_triton(x: torch.Tensor, y) -> torch.Tensor:
    """Triton ``pfl::pairwise_sqdist``: the reference's result, float32 accumulation, [K, M] float32."""
    return _pairwise(x, y, MODE_SQDIST, 0.0)


@triton.jit
def _weights_kernel(
    sim_ptr, own_ptr, out_ptr, flags_ptr, M, s_k, s_m, tau, scale, keep_at_least,
    HAS_OWN: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < M
    v = tl.load(sim_ptr + row * s_k + cols * s_m, mask=valid, other=0).to(tl.float32)
    # The row's data checks, read on the host after the launch: NaN/Inf in sim, an own
    # column outside [-1, M).  (A bad row's weights are garbage; the op raises then.)
    bad = tl.max(((tl.abs(v) < float("inf")) == 0).to(tl.int32), axis=0)
    if HAS_OWN:
        own = tl.load(own_ptr + row)
        bad = bad | ((own < -1) | (own >= M)).to(tl.int32)
    else:
        own = row
    tl.store(flags_ptr + row, bad)
    is_own = cols.to(tl.int64) == own
    v = tl.where(is_own, 1.0, v)
    kept = valid & ((v >= tau) | is_own)
    need = keep_at_least - tl.sum(kept.to(tl.int32), axis=0)
    if need > 0:
        cand = valid & (kept == 0)
        # int32 keys in the order of the floats: negative floats get their magnitude bits
        # flipped, and -0.0 the key of 0.0.  Non-candidates get INT32_MIN, below every finite value's key.
        bits = v.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        key = tl.where(v == 0, 0, key)  # -0.0 ties with 0.0, as the float comparison says
        key = tl.where(cand, key, -2147483648)
        lo = tl.full([], -2147483647, tl.int64)  # count(key >= lo) = candidates >= need
        hi = tl.full([], 2147483647, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            ok = tl.sum((key >= mid).to(tl.int32), axis=0) >= need
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        above = cand & (key > lo)
        ties = cand & (key == lo)
        rank = tl.cumsum(ties.to(tl.int32), axis=0)
        take = ties & (rank <= need - tl.sum(above.to(tl.int32), axis=0))
        kept = kept | above | take
    logits = tl.where(kept, scale * v, -float("inf"))
    mx = tl.max(logits, axis=0)
    e = tl.where(kept, tl.exp(logits - mx), 0.0)
    total = tl.sum(e, axis=0)
    w = tl.where(total > 0, e / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + row * M + cols, w.to(out_ptr.dtype.element_ty), mask=valid)


emulate_good_flags(_weights_kernel)  # the weights are left unwritten there


def similarity_weights_triton(sim: torch.Tensor, tau: float, scale: float, min_keep: int, self_index):
    """Triton ``pfl::similarity_weights`` (float32 math; float64 sim and rows longer than
    _MAX_ROW use the reference).  Raises ValueError for NaN/Inf in sim or self_index values
    outside [-1, M), as every kernel of the op: the kernel flags each row, read in one sync after
    it (the checks in PyTorch took five launches and a sync before it, two syncs with self_index)."""
    _check_weights_args(sim, tau, scale, min_keep, self_index)
    _check_devices(sim, self_index)
    k, m = sim.shape
    if sim.dtype == torch.float64 or m > _MAX_ROW:
        check_weights_values(sim, self_index)
        return _ref.similarity_weights(sim, tau, scale, min_keep, self_index)
    out = sim.new_empty((k, m), dtype=torch.float32)
    if out.numel() == 0:
        check_weights_values(sim, self_index)  # self_index of K rows against M = 0 columns
        return out
    # Contiguous: the kernel reads row r's own column at own_ptr + r (an int64 view kept its strides).
    own = self_index.to(torch.int64).contiguous() if self_index is not None else out
    flags = torch.empty(k, dtype=torch.int32, device=sim.device)
    block = next_power_of_2(m)
    with _device_guard(sim):
        _launch(_weights_kernel)[(k,)](
            sim, own, out, flags, m, sim.stride(0), sim.stride(1), tau, scale, min(min_keep, m),
            HAS_OWN=self_index is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)),
        )
    if bool(flags.any()):
        raise_flagged(check_weights_values, sim, self_index)
    return out


register_cuda("pairwise_cosine", pairwise_cosine_triton)
register_cuda("pairwise_sqdist", pairwise_sqdist_triton)
register_cuda("similarity_weights", similarity_weights_triton)

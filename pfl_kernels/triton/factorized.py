"""Triton kernels of the factorized-weight ops, registered for the CUDA dispatch key.

The ops are memory bound (rank r is 1..4, so the FLOPs are tiny): the floor is reading
mu and mask once and writing W once (forward), reading G, mu, mask once and writing
grad_mu, grad_mask once (backward).  So every kernel makes exactly one pass:

* forward: one program per (client, R-block, C-block) tile computes the rank-r outer
  product plus ``mu * mask`` in registers and stores it straight into the final layout
  of W (no separate permute pass);
* backward: one program per tile reads G (through grad_w's strides), writes the
  grad_mu / grad_mask tiles and the tile's partial sums of grad_u (over its columns) and
  grad_v (over its rows) into small float32/float64 buffers; a ``torch.sum`` over the
  tile axis finishes them.  No atomics, so the result is deterministic; when one tile
  spans all of R (the common conv case) grad_v needs no summing pass at all.

Addressing.  W viewed as [K, A, R, B] holds M[k, r, c] at ``(a, r, b) = (c // B, r, c % B)``
(see ``pfl_kernels._layout``).  ``MODE`` picks how c maps to (a, b) so that the compiler
sees the contiguous axis: MODE_T (B == 1, W is Mᵀ: r is the contiguous axis of W, and
Triton's coalescing pass stages the tile through shared memory so that both the row-major
loads of mu/mask and the r-major stores of W are coalesced), MODE_M (A == 1, W is M) and
MODE_GENERAL (simfed: runs of B contiguous columns).

All operands are read through their strides (stride 0 for factors shared over K), so
nothing big is copied; the only exception is a grad_w whose strides cannot express the
[K, A, R, B] view (e.g. a channels_last gradient), which is made contiguous first.
Offsets inside one client are int32; the client offset is int64.
"""
from __future__ import annotations

import contextlib
import struct
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .._layout import layout_geometry
from . import register_cuda
from ._direct import DirectLaunch, direct
from ..ops import factorized as _ops  # noqa: F401  (defines the schemas implemented here)
from ..ops.factorized import _check_op_args, _check_soft_threshold_args
from ..ops._memo import cdiv, metadata_cached, next_power_of_2, tracing


try:  # torch >= 2.6: launches that torch.compile, make_fx and torch.export can trace
    from torch.library import wrap_triton as _wrap_triton
except ImportError:  # pragma: no cover
    _wrap_triton = None

MODE_GENERAL, MODE_T, MODE_M = 0, 1, 2

# Tile budget: 4096 elements per program is 16 fp32 values per thread at 8 warps, enough
# bytes in flight per SM to saturate HBM.  BLOCK_R <= 64 keeps all of R in one tile for
# every conv kernel up to 7x7 (R = kh*kw), so grad_v needs no summing pass there.
# Tests shrink these to force many tiles.
_MAX_TILE = 4096
_MAX_BLOCK_R = 64
# The backward takes a client's whole (R, C) matrix in one tile up to this many elements (a
# linear layer of LeNet-5, 120 x 84: 128 x 128 padded): no summing pass then for grad_u or
# grad_v, two launches fewer, which at such sizes cost more than the kernel (on an H200 the
# 84 x 120 backward, four tiles and two torch.sum passes, took 0.15 ms against eager's 0.05).
# At 16 warps that is 32 values per thread per operand.  Tests set it to 0 to keep many tiles.
_MAX_WHOLE_TILE = 16384
_SOFT_BLOCK = 4096


def _launch(kernel):
    """What to index with the grid and call: the kernel itself in eager mode, and
    ``wrap_triton(kernel)`` (where torch has it) when the launch is traced.

    ``wrap_triton`` is what puts the kernel into a traced graph (and lets fake tensors, which
    have no memory, through), but in eager mode its higher-order op costs about 300 µs of host
    time per launch, against about 100 µs for the whole op launched directly (issue 30).  In
    eager mode the launch goes through ``_direct.direct`` (the compiled kernel launched
    without Triton's per-call binding, where switched on)."""
    if not tracing():
        return direct(kernel)
    if _wrap_triton is None:
        return kernel
    try:
        return _wrap_triton(kernel)
    except RuntimeError:  # older torch refuses the interpreter's InterpretedFunction
        return kernel


def _launch_planned(launcher, grid, token, tensors: tuple, scalars: tuple, meta: dict) -> None:
    """``launcher[grid](*tensors, *scalars, **meta)``, for ``launcher = _launch(kernel)`` (each
    module's own ``_launch``, which tools patch), where ``token`` belongs to the cached launch
    plan that holds ``scalars`` and ``meta`` (the plan itself, or its meta dict where a plan
    has several launches of one kernel) and to no other: a direct launch then keys only the
    tensors (``DirectLaunch.planned``)."""
    if isinstance(launcher, DirectLaunch):
        launcher.planned(grid, token, tensors, scalars, meta)
    else:
        launcher[grid](*tensors, *scalars, **meta)


def _meta_twin(t: torch.Tensor) -> torch.Tensor:
    """A tensor on the meta device with t's sizes, strides and dtype: what a view of t would
    look like, without touching t's data (a launch plan reads the strides of its views so)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


_SAME_DEVICE = contextlib.nullcontext()  # stateless, so one instance serves every call


def _device_guard(t: torch.Tensor):
    """Launch on the tensor's GPU, not the current one (Triton launches on the current); no
    device switch (two driver calls) when it is the current one already."""
    device = t.device
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(device)


@metadata_cached
def _check_devices(*tensors: Optional[torch.Tensor]) -> None:
    """A kernel reads raw pointers: every operand must be on the first one's device."""
    dev = tensors[0].device
    for t in tensors:
        torch._check_value(t is None or t.device == dev,
                           lambda: f"all operands must be on {dev}, got one on {t.device}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mode(a: int, b: int) -> int:
    if b == 1:
        return MODE_T
    if a == 1:
        return MODE_M
    return MODE_GENERAL


def _blocks(rows: int, cols: int, max_tile: int, max_block_r: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): all of R in one tile when R is small (conv kernels: 1..25)."""
    block_r = min(next_power_of_2(rows), max_block_r)
    block_c = min(next_power_of_2(cols), max(1, max_tile // block_r))
    return block_r, block_c


def _num_warps(block_r: int, block_c: int) -> int:
    """8 warps for a full tile, fewer for the small tiles of small layers, 16 for a backward
    whole-matrix tile beyond _MAX_TILE (``_backward_blocks``)."""
    return max(1, min(16 if block_r * block_c > 4096 else 8, block_r * block_c // 512))


def _backward_blocks(rows: int, cols: int, max_tile: int, max_block_r: int, max_whole: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the backward: the whole matrix where it fits in ``max_whole``
    elements (padded to powers of 2), else ``_blocks``'."""
    whole_r, whole_c = next_power_of_2(rows), next_power_of_2(cols)
    if whole_r * whole_c <= max_whole:
        return whole_r, whole_c
    return _blocks(rows, cols, max_tile, max_block_r)


def _strides3(t: Optional[torch.Tensor]) -> tuple[int, int, int]:
    """(client, row, col) strides of a [R, C] or [K, R, C] operand; client stride 0 when 2-D."""
    if t is None:
        return 0, 0, 0
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


@triton.jit
def _w_offsets(r, c, B, s_a, s_r, s_b, MODE: tl.constexpr):
    """Offsets in W (viewed [A, R, B] with strides s_a, s_r, s_b) of M[r, c]: a 2-D tile."""
    if MODE == 1:  # MODE_T, B == 1: c is a
        offs = c[None, :] * s_a + r[:, None] * s_r
    elif MODE == 2:  # MODE_M, A == 1: c is b
        offs = r[:, None] * s_r + c[None, :] * s_b
    else:
        a = c // B
        b = c - a * B
        offs = a[None, :] * s_a + r[:, None] * s_r + b[None, :] * s_b
    return offs


@triton.jit
def _tile(R, C, n_rb, n_cb, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile: client k (int64), block indices (rb, cb), rows r, columns c,
    and the bounds masks of r, c and the 2-D tile.

    Tiles of one client are consecutive, C-blocks fastest: neighbouring programs touch
    neighbouring memory of mu/mask (row-major) and of W.
    """
    pid = tl.program_id(0)
    tiles = n_rb * n_cb
    k = (pid // tiles).to(tl.int64)
    t = pid % tiles
    rb = t // n_cb
    cb = t % n_cb
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    rm = r < R
    cm = c < C
    return k, rb, cb, r, c, rm, cm, rm[:, None] & cm[None, :]


@triton.jit
def _factorized_weight_kernel(
    u_ptr, v_ptr, mu_ptr, mask_ptr, w_ptr,
    R, C, B, n_rb, n_cb,
    su_k, su_r, su_j, sv_k, sv_j, sv_c,
    smu_k, smu_r, smu_c, smk_k, smk_r, smk_c,
    sw_k, sw_a, sw_r, sw_b,
    RANK: tl.constexpr, MODE: tl.constexpr, HAS_MU: tl.constexpr, HAS_MASK: tl.constexpr,
    ACC_F64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    k, _, _, r, c, rm, cm, m2 = _tile(R, C, n_rb, n_cb, BLOCK_R, BLOCK_C)

    if ACC_F64:
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(RANK):
        uj = tl.load(u_ptr + k * su_k + r * su_r + j * su_j, mask=rm, other=0).to(acc.dtype)
        vj = tl.load(v_ptr + k * sv_k + j * sv_j + c * sv_c, mask=cm, other=0).to(acc.dtype)
        acc += uj[:, None] * vj[None, :]
    if HAS_MU:
        mu = tl.load(mu_ptr + k * smu_k + r[:, None] * smu_r + c[None, :] * smu_c,
                     mask=m2, other=0).to(acc.dtype)
        if HAS_MASK:
            mk = tl.load(mask_ptr + k * smk_k + r[:, None] * smk_r + c[None, :] * smk_c,
                         mask=m2, other=0).to(acc.dtype)
            mu = mu * mk
        acc += mu
    offs = _w_offsets(r, c, B, sw_a, sw_r, sw_b, MODE)
    tl.store(w_ptr + k * sw_k + offs, acc.to(w_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _factorized_weight_backward_kernel(
    g_ptr, u_ptr, v_ptr, mu_ptr, mask_ptr,
    gu_ptr, gv_ptr, gmu_ptr, gmask_ptr,
    R, C, B, n_rb, n_cb,
    sg_k, sg_a, sg_r, sg_b,
    su_k, su_r, su_j, sv_k, sv_j, sv_c,
    smu_k, smu_r, smu_c, smk_k, smk_r, smk_c,
    RANK: tl.constexpr, MODE: tl.constexpr, HAS_MASK: tl.constexpr,
    NEED_U: tl.constexpr, NEED_V: tl.constexpr, NEED_MU: tl.constexpr, NEED_MASK: tl.constexpr,
    ACC_F64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    k, rb, cb, r, c, rm, cm, m2 = _tile(R, C, n_rb, n_cb, BLOCK_R, BLOCK_C)

    if ACC_F64:
        g = tl.load(g_ptr + k * sg_k + _w_offsets(r, c, B, sg_a, sg_r, sg_b, MODE),
                    mask=m2, other=0).to(tl.float64)
    else:
        g = tl.load(g_ptr + k * sg_k + _w_offsets(r, c, B, sg_a, sg_r, sg_b, MODE),
                    mask=m2, other=0).to(tl.float32)

    # grad_mu / grad_mask: contiguous [K, R, C] outputs.
    out = k * R * C + r[:, None] * C + c[None, :]
    if NEED_MU:
        gmu = g
        if HAS_MASK:
            gmu = gmu * tl.load(mask_ptr + k * smk_k + r[:, None] * smk_r + c[None, :] * smk_c,
                                mask=m2, other=0).to(g.dtype)
        tl.store(gmu_ptr + out, gmu.to(gmu_ptr.dtype.element_ty), mask=m2)
    if NEED_MASK:
        gmk = g * tl.load(mu_ptr + k * smu_k + r[:, None] * smu_r + c[None, :] * smu_c,
                          mask=m2, other=0).to(g.dtype)
        tl.store(gmask_ptr + out, gmk.to(gmask_ptr.dtype.element_ty), mask=m2)

    # Partial sums (G is 0 outside the tile, so the masked lanes add nothing):
    # grad_u partials [K, n_cb, R, RANK], grad_v partials [K, n_rb, RANK, C], float32/64
    # (or the gradient itself, in its dtype, when n_cb / n_rb is 1).
    for j in tl.static_range(RANK):
        if NEED_U:
            vj = tl.load(v_ptr + k * sv_k + j * sv_j + c * sv_c, mask=cm, other=0).to(g.dtype)
            gu = tl.sum(g * vj[None, :], axis=1)
            tl.store(gu_ptr + ((k * n_cb + cb) * R + r) * RANK + j, gu.to(gu_ptr.dtype.element_ty),
                     mask=rm)
        if NEED_V:
            uj = tl.load(u_ptr + k * su_k + r * su_r + j * su_j, mask=rm, other=0).to(g.dtype)
            gv = tl.sum(g * uj[:, None], axis=0)
            tl.store(gv_ptr + ((k * n_rb + rb) * RANK + j) * C + c, gv.to(gv_ptr.dtype.element_ty),
                     mask=cm)


@triton.jit(do_not_specialize=["thr_bits"])  # one compiled kernel whatever the threshold
def _soft_threshold_kernel(
    x_ptr, thr_bits, n, size1, size2, size3, st0, st1, st2, st3, ACC_F64: tl.constexpr, BLOCK: tl.constexpr,
):
    # Element i of the (up to 4-D, row-major) index space sits at sum(index_d * stride_d);
    # a dense tensor is passed as one dim (sizes 1, which Triton specializes away).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    i3 = i % size3
    rest = i // size3
    i2 = rest % size2
    rest = rest // size2
    i1 = rest % size1
    i0 = rest // size1
    ptrs = x_ptr + i0 * st0 + i1 * st1 + i2 * st2 + i3 * st3
    x = tl.load(ptrs, mask=m, other=0)
    # The threshold arrives as the bits of a float64 (a Python float argument would be float32,
    # not exact enough for float64 mu) and is rounded to the accumulation dtype here, as
    # ``torch.full((1,), threshold, dtype=acc)`` would round it.
    # (An int that fits in 32 bits arrives as int32: widen it first.)
    thr = thr_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if not ACC_F64:
        thr = thr.to(tl.float32)
    xa = x.to(thr.dtype)
    # sign(x) * max(|x| - t, 0); ``(x + 0) * 0`` keeps the reference's NaN and its zero's sign,
    # bit for bit: -0.0 where x < 0, +0.0 for x = -0.0 (sign(-0.0) is 0; -0.0 + 0 is +0.0).
    y = tl.where(xa > thr, xa - thr, tl.where(xa < -thr, xa + thr, (xa + 0.0) * 0.0))
    tl.store(ptrs, y.to(x_ptr.dtype.element_ty), mask=m)


@metadata_cached
def _forward_plan(u, v, mu, mask, shape, layout, max_tile, max_block_r):
    """(W's shape, grid, the kernel's scalar arguments, its meta-parameters) of a forward call,
    after the op's checks: one run per signature (``metadata_cached``); the tile limits are
    arguments so that a test that shrinks them gets a plan of its own."""
    lead = _check_op_args(u, v, mu, mask, shape, layout)
    _check_devices(u, v, mu, mask)
    rows, cols, outer, inner = layout_geometry(shape, layout)
    block_r, block_c = _blocks(rows, cols, max_tile, max_block_r)
    n_rb, n_cb = cdiv(rows, block_r), cdiv(cols, block_c)
    kk = lead[0] if lead else 1
    scalars = (rows, cols, inner, n_rb, n_cb, *_strides3(u), *_strides3(v), *_strides3(mu), *_strides3(mask),
               rows * cols, rows * inner, inner, 1)
    meta = dict(RANK=u.shape[-1], MODE=_mode(outer, inner), HAS_MU=mu is not None, HAS_MASK=mask is not None,
                ACC_F64=u.dtype == torch.float64, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=_num_warps(block_r, block_c))
    return tuple(lead) + tuple(int(s) for s in shape), (kk * n_rb * n_cb,), scalars, meta


def factorized_weight_triton(u: torch.Tensor, v: torch.Tensor, mu: Optional[torch.Tensor] = None,
                             mask: Optional[torch.Tensor] = None, *, shape: Sequence[int],
                             layout: str = "spatial") -> torch.Tensor:
    """Triton ``pfl::factorized_weight``: W = place(u @ v + mu * mask, shape, layout).

    Same contract as ``pfl_kernels.reference.factorized.factorized_weight``: u [K?, R, r],
    v [K?, r, C], mu/mask [K?, R, C] (any strides, stride 0 for shared factors); returns a
    contiguous W [K?, *shape] in u's dtype.
    """
    plan = _forward_plan(u, v, mu, mask, shape, layout, _MAX_TILE, _MAX_BLOCK_R)
    w_shape, grid, scalars, meta = plan
    w = torch.empty(w_shape, dtype=u.dtype, device=u.device)
    if w.numel() == 0:
        return w
    with _device_guard(u):
        _launch_planned(_launch(_factorized_weight_kernel), grid, plan,
                        (u, v, u if mu is None else mu, u if mask is None else mask, w), scalars, meta)
    return w


@metadata_cached
def _backward_plan(grad_w, u, v, mu, mask, shape, layout, output_mask, max_tile, max_block_r, max_whole):
    """The backward call's geometry after the op's checks, one run per signature (see
    ``_forward_plan``): (lead dims, (K, R, C, A, B, rank, row blocks, column blocks), the
    partial sums' dtype, the kernel's scalar arguments, its meta-parameters); None when no
    gradient is asked for."""
    lead = _check_op_args(u, v, mu, mask, shape, layout, grad_w)
    _check_devices(u, v, mu, mask, grad_w)
    rows, cols, outer, inner = layout_geometry(shape, layout)
    need_u, need_v = bool(output_mask[0]), bool(output_mask[1])
    need_mu = bool(output_mask[2]) and mu is not None
    need_mask = bool(output_mask[3]) and mask is not None
    if not (need_u or need_v or need_mu or need_mask):
        return None
    acc = _acc_dtype(u.dtype)
    block_r, block_c = _backward_blocks(rows, cols, max_tile, max_block_r, max_whole)
    geometry = (lead[0] if lead else 1, rows, cols, outer, inner, u.shape[-1],
                cdiv(rows, block_r), cdiv(cols, block_c))
    factor_strides = (*_strides3(u), *_strides3(v), *_strides3(mu), *_strides3(mask))
    # grad_w's strides as the launcher will view it (``_grad_as_kark``), read from a meta twin
    g = _grad_as_kark(_meta_twin(grad_w), bool(lead), geometry[0], outer, rows, inner)
    scalars = (rows, cols, inner, geometry[6], geometry[7], *g.stride(), *factor_strides)
    meta = dict(RANK=u.shape[-1], MODE=_mode(outer, inner), HAS_MASK=mask is not None,
                NEED_U=need_u, NEED_V=need_v, NEED_MU=need_mu, NEED_MASK=need_mask,
                ACC_F64=acc == torch.float64, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=_num_warps(block_r, block_c))
    return lead, geometry, acc, scalars, meta


def _grad_as_kark(grad_w: torch.Tensor, has_lead: bool, kk: int, outer: int, rows: int, inner: int) -> torch.Tensor:
    """grad_w as [K, A, R, B] through its own strides; a copy only where they cannot say it
    (a channels_last gradient)."""
    g = grad_w if has_lead else grad_w.unsqueeze(0)
    try:
        return g.view(kk, outer, rows, inner)
    except RuntimeError:
        return g.reshape(kk, outer, rows, inner)


def factorized_weight_backward_triton(grad_w: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                                      mu: Optional[torch.Tensor], mask: Optional[torch.Tensor], *,
                                      shape: Sequence[int], layout: str,
                                      output_mask: Sequence[bool]):
    """Triton ``pfl::factorized_weight_backward``: (grad_u, grad_v, grad_mu, grad_mask).

    With G = grad_W in (R, C) order: grad_u = G vᵀ, grad_v = uᵀ G, grad_mu = G * mask (or G),
    grad_mask = G * mu.  A gradient not asked for by ``output_mask`` (or whose input is
    None) is ``u.new_empty(0)``, as in the reference.  grad_w may have any strides.
    """
    plan = _backward_plan(grad_w, u, v, mu, mask, shape, layout, output_mask, _MAX_TILE, _MAX_BLOCK_R,
                          _MAX_WHOLE_TILE)
    if plan is None:
        return tuple(u.new_empty(0) for _ in range(4))
    lead, (kk, rows, cols, outer, inner, rank, n_rb, n_cb), acc, scalars, meta = plan
    need_u, need_v, need_mu, need_mask = meta["NEED_U"], meta["NEED_V"], meta["NEED_MU"], meta["NEED_MASK"]
    g = _grad_as_kark(grad_w, bool(lead), kk, outer, rows, inner)
    # Unused outputs get a dummy pointer (u); each returned empty is its own tensor, as
    # outputs of an op must not alias one another.
    # A partial-sum buffer with one tile along its summed axis is the gradient itself:
    # the kernel then writes it in u's dtype and no summing pass runs.
    gu_part = u.new_empty((kk, n_cb, rows, rank), dtype=u.dtype if n_cb == 1 else acc) if need_u else u
    gv_part = u.new_empty((kk, n_rb, rank, cols), dtype=u.dtype if n_rb == 1 else acc) if need_v else u
    gmu = u.new_empty(lead + [rows, cols]) if need_mu else u
    gmask = u.new_empty(lead + [rows, cols]) if need_mask else u
    if kk > 0:
        with _device_guard(u):
            _launch_planned(_launch(_factorized_weight_backward_kernel), (kk * n_rb * n_cb,), plan,
                            (g, u, v, u if mu is None else mu, u if mask is None else mask,
                             gu_part, gv_part, gmu, gmask), scalars, meta)
    # Finish the cross-tile reductions (deterministic: a fixed-order torch.sum).
    grad_u = grad_v = None
    if need_u:
        grad_u = (gu_part if n_cb == 1 else gu_part.sum(1).to(u.dtype)).reshape(lead + [rows, rank])
    if need_v:
        grad_v = (gv_part if n_rb == 1 else gv_part.sum(1).to(u.dtype)).reshape(lead + [rank, cols])
    return tuple(t if need else u.new_empty(0) for t, need in
                 ((grad_u, need_u), (grad_v, need_v), (gmu, need_mu), (gmask, need_mask)))


@metadata_cached
def _dense_span(t: torch.Tensor) -> bool:
    """Whether t's elements fill a contiguous block of memory (any order, no overlap)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def soft_threshold_triton_(mu: torch.Tensor, threshold: float) -> None:
    """Triton ``pfl::soft_threshold_``: in place mu <- sign(mu) * max(|mu| - threshold, 0).

    Any shape and strides: a dense tensor (contiguous in any dim order) is one flat pass;
    other views of up to 4 dims are addressed through their strides; anything else goes
    through a contiguous temporary.
    """
    _check_soft_threshold_args(mu, threshold)
    n = mu.numel()
    if n == 0:
        return
    # No tensor for the threshold (a fill kernel and an allocation per call): its float64 bits.
    # A threshold beyond mu's dtype acts as its largest finite value (the reference's rule:
    # +-inf stays +-inf rather than becoming inf - inf = NaN).
    threshold = min(float(threshold), torch.finfo(mu.dtype).max)
    thr_bits = struct.unpack("<q", struct.pack("<d", threshold))[0]
    if _dense_span(mu):
        flat = mu.as_strided((n,), (1,), mu.storage_offset())
        target, sizes, strides = flat, [n, 1, 1, 1], [1, 0, 0, 0]
    elif mu.dim() <= 4:
        target = mu
        sizes = [1] * (4 - mu.dim()) + list(mu.shape)
        strides = [0] * (4 - mu.dim()) + list(mu.stride())
    else:
        tmp = mu.contiguous()
        soft_threshold_triton_(tmp, threshold)
        mu.copy_(tmp)
        return
    with _device_guard(mu):
        _launch(_soft_threshold_kernel)[(cdiv(n, _SOFT_BLOCK),)](
            target, thr_bits, n, sizes[1], sizes[2], sizes[3], *strides, ACC_F64=mu.dtype == torch.float64,
            BLOCK=_SOFT_BLOCK, num_warps=4,
        )


register_cuda("factorized_weight", factorized_weight_triton)
register_cuda("factorized_weight_backward", factorized_weight_backward_triton)
register_cuda("soft_threshold_", soft_threshold_triton_)

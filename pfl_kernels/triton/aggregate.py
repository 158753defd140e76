"""Triton kernels of ``pfl::weighted_average`` (and its ``.out`` overload), registered for CUDA.

``out[k] = Σ_{j: w_kj != 0} w_kj θ_j`` with weights [K, M] and params [M, P] (schemas and
semantics in ``pfl_kernels/ops/aggregate.py``).  Two kernels, chosen like the CPU kernels by
the density of the weights (nonzeros < ``_SPARSE_DENSITY`` · K·M: sparse), never by the
device:

* dense: one program per (K-block, P-block) tile of out walks M in BLOCK_M steps, ``tl.dot``
  of the weights tile [BLOCK_K, BLOCK_M] with the params tile [BLOCK_M, BLOCK_P], float32
  accumulation with ``input_precision="tf32x3"`` (``_DENSE_PRECISION``: three tensor-core
  products of two-part TF32 splits, each product to about 2^-21; plain TF32 would lose three
  decimal digits of the parameters; bfloat16/float16 params are widened to float32 in
  registers, where the split is exact, so weights are read in float32 as the contract says).
  K-blocks are the fastest grid axis, so the programs of one P-block run together and read
  its params from L2; at K <= BLOCK_K (the memory-bound case, e.g. K = 20) params are read
  exactly once.  The main loop is loads and dots alone; a zero weight's NaN/Inf row still
  makes its column of the tile non-finite (0·NaN), so after the loop the tile's non-finite
  columns, and only in the tiles that have one, are summed again exactly with zero weights
  skipped: each NaN/Inf reaches only the rows that weight it.  (The kernel of before, with
  ``ieee`` dots and a reduction over every params tile for its NaN/Inf, took 39.5 ms against
  torch.mm's 0.71 ms on an H200 at K = 100, P = 10^6; this one has not run on a GPU yet.)
* sparse: each row's nonzero weights compacted to the front of its row of a [K, M] pair (int32
  columns, values in the accumulation dtype) with the row's count, by ``_compact_kernel``;
  one program per (row, P-block) gathers only the kept rows of params, ``_SPARSE_BLOCK_E``
  of them per step (one: see there).  Cost ∝ nnz · P.  Rows are the
  fastest grid axis, so rows sharing kept clients read them from L2 (loaded evict-last; out
  is stored evict-first).

Which one serves (issue 30, item 2; ``pfl_kernels.ops.aggregate.cuda_path``): sparse weights
take the sparse kernel; dense weights on CUDA take ``gemm_weighted_average`` (one cuBLAS GEMM,
a check of the product's first row for NaN/Inf, the reference's fix-up only when params hold
NaN/Inf), since the dense kernel of before measured 39.5 ms against torch.mm's 0.71 ms on an
H200 (K = 100, P = 10^6); ``benchmarks/gpu_aggregate.py`` times the 3xTF32 dense kernel
beside the path that serves (``_PATH_OVERRIDE``), for every density, so that the next GPU run
says where it wins.  The dense kernel serves only where torch's float32 matmuls may use TF32
(``torch.backends.cuda.matmul.allow_tf32``), which the op's float32 accumulation forbids, and
in the Triton interpreter (CPU tensors), where its tests run it.

float64 params: the sparse kernel accumulates in float64; dense float64 weights always take
the GEMM form (cuBLAS dgemm), which is what a float64 Triton dot would lower to at best.

Weights are checked for NaN/Inf here too (one device sync, shared with counting the nonzeros).
The weights' stats (each row's nonzeros and NaN/Inf) come from the same ``_compact_kernel``
launch that lays out the sparse kernel's input, so the sparse path makes two launches and
no other (the PyTorch reductions and the CSR build it replaces were 16, then 8 launches,
each a host round trip on a GPU); the GEMM product's row-0 check, and the weights' stats
where the GEMM runs speculatively, come from ``_count_kernel``, one launch each into a
zeroed int64 buffer.  With every weight nonzero (FedAvg's and softmax weights) the product
is the contract's result as it is, so only weights with zeros pay for the row-0 check.

Syncs: the stats are read with ``read_early`` (an event behind their copy to the host), so
the host waits for the small kernel that made them, not for the big one queued after it,
and the GPU is not left idle while the host finishes the call.  The path a signature took
last is launched before the stats are read: the GEMM into a new result (the op's own
tensor), the sparse or dense Triton kernel into any out, guarded on the device by the
compaction's NaN/Inf total (it writes nothing where a weight is NaN/Inf, so a caller's out
stays as it was when the op raises).  A wrong guess is rerun on the right path, so a call's numbers never depend
on the calls before it.  ``.out`` with dense weights reads the stats before its GEMM (which
cannot be guarded) writes out: one sync, for the counting alone.

``out=``: out may overlap params.  The dense kernel with a single K-block reads the whole
params block of its columns before it writes the same columns of out, so an overlap in
which out's rows are params' rows (the in-place ``bank <- W @ bank``, or another row range of
the same bank) is safe there; every other overlap (several K-blocks, the sparse kernel, a
shifted or differently strided view) first copies params.  Offsets are int64.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..ops import aggregate as _ops  # (also defines the schemas implemented here)
from . import register_cuda
from ..ops._checks import may_overlap
from ..ops.aggregate import _check_op_args
from ..ops._memo import cdiv, next_power_of_2
from ._early_read import EarlyRead, read_early
from .factorized import _check_devices, _device_guard, _launch


# Dense tiles: up to 64 rows of out x 128 columns, 32 rows of params per step (tl.dot needs
# at least 16 in every dimension).  Tests shrink these.
_MAX_BLOCK_K = 64
_BLOCK_M = 32
_BLOCK_P = 128
# The dense kernel's tl.dot: 3xTF32 (each float32 operand split into two TF32 parts, three
# tensor-core products, float32 sums) keeps each product to about 2^-21 of its value, where
# plain TF32 loses three decimal digits; "ieee" is the tensor-core-free float32 dot (on the
# H200 of issue 30 that kernel took 39.5 ms against torch.mm's 0.71 ms at K = 100, P = 10^6).
_DENSE_PRECISION = "tf32x3"
# The path every call takes whatever its weights' density ("dense", "sparse" or "gemm"), or
# None: ``ops.aggregate.cuda_path`` chooses.  benchmarks/gpu_aggregate.py times the paths
# against each other with it; float64 params never take the dense kernel.
_PATH_OVERRIDE: Optional[str] = None
# Sparse: columns per program, kept rows gathered per step (8 warps: per thread 4 columns of
# each of the BLOCK_E rows).  One row per step: on both GPUs of issue 30 (gpu_aggregate.py
# --quick, density 0.05) 8 rows per step were slower at three of four shapes and no faster at
# the fourth: K = 100, P = 10^7 took 4.02 ms against 3.01 (H200) and 4.42 against 3.54
# (H100); K = 20, P = 10^7 0.70 against 0.43 (H200).  With a few kept rows per out row, the
# [8, BLOCK_P] tile's registers cost more occupancy than its loads in flight gain.
# benchmarks/gpu_aggregate.py times 8 rows per step beside the default.
_SPARSE_BLOCK_P = 1024
_SPARSE_BLOCK_E = 1
# The compaction of the weights: columns of a row per step (a row of M weights takes
# cdiv(M, this) steps of one program).  Tests shrink it.
_COMPACT_BLOCK = 1024
# The counting kernel: values per block, and at most this many programs (each adds its two
# totals atomically).  Tests shrink these.
_COUNT_BLOCK = 4096
_COUNT_PROGRAMS = 1024
# Below this fraction of nonzero weights, the sparse kernel runs (as on CPU).  Tests change it.
_SPARSE_DENSITY = _ops.SPARSE_DENSITY
# Devices whose dense weights go to the GEMM form (``ops.aggregate.cuda_path``); the
# interpreter tests add "cpu" to check the routing.
_GEMM_DEVICES = ("cuda",)


@triton.jit
def _dense_kernel(
    w_ptr, p_ptr, out_ptr, flag_ptr,
    K, M, P, n_kb,
    sp_m, so_k,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
    GUARDED: tl.constexpr,
):
    pid = tl.program_id(0)
    kb = pid % n_kb
    pb = pid // n_kb
    rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    rp = pb.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    mk = rk < K
    if GUARDED:  # launched before the weights' stats are read: as the sparse kernel
        mp = rp < tl.where(tl.load(flag_ptr) == 0, P, 0)
    else:
        mp = rp < P
    w_rows = w_ptr + rk.to(tl.int64)[:, None] * M  # weights: contiguous [K, M], float32
    acc = tl.zeros([BLOCK_K, BLOCK_P], dtype=tl.float32)
    # The main loop is loads and dots alone (no branch, no reduction), so it pipelines.
    for m0 in range(0, M, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mm = rm < M
        wt = tl.load(w_rows + rm[None, :], mask=mk[:, None] & mm[None, :], other=0)
        pt = tl.load(p_ptr + rm.to(tl.int64)[:, None] * sp_m + rp[None, :],
                     mask=mm[:, None] & mp[None, :], other=0).to(tl.float32)
        acc = tl.dot(wt, pt, acc, input_precision=PRECISION)
    # A NaN/Inf value of params makes its column of acc non-finite in every row of the tile
    # (0·NaN = NaN, and 3xTF32 splits ±Inf into Inf and NaN), as does a sum that overflows or
    # a value near the float32 maximum that the TF32 split rounds up.  Those columns, and only
    # in tiles that have one, are summed again exactly, zero weights skipped: the contract's
    # result, each non-finite value reaching only the rows that weight it.
    redo = tl.max(((tl.abs(acc) < float("inf")) == 0).to(tl.int32), axis=0) != 0  # [BLOCK_P]
    if tl.max(redo.to(tl.int32), axis=0) > 0:
        # In acc itself (a second tile would double the registers the main loop may use).
        acc = tl.where(redo[None, :], 0.0, acc)
        w_col = w_ptr + rk.to(tl.int64) * M
        t_row = p_ptr + rp  # row j of params' tile: a pointer stepped by sp_m (64-bit offsets)
        for j in range(0, M):
            wj = tl.load(w_col + j, mask=mk, other=0)
            tj = tl.load(t_row, mask=mp & redo, other=0).to(tl.float32)
            acc += tl.where((wj != 0)[:, None] & redo[None, :], wj[:, None] * tj[None, :], 0.0)
            t_row += sp_m
    o = out_ptr + rk.to(tl.int64)[:, None] * so_k + rp[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mk[:, None] & mp[None, :])


@triton.jit
def _compact_kernel(w_ptr, col_ptr, val_ptr, stats_ptr, flag_ptr, K, M, BLOCK: tl.constexpr,
                    HAS_FLAG: tl.constexpr):
    # Row k of w [K, M] (contiguous): its nonzero weights, in column order, at the front of
    # row k of col [K, M] (their columns, int32) and val [K, M] (their values); stats[0, k]
    # = their number, stats[1, k] = the row's NaN/Inf (NaN != 0: kept, and then refused);
    # with HAS_FLAG, flag[0] (zeroed) += the row's NaN/Inf, for a guarded sparse kernel.
    k = tl.program_id(0).to(tl.int64)
    kept = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    bad = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for m0 in range(0, M, BLOCK):
        rm = m0 + tl.arange(0, BLOCK)
        mm = rm < M
        v = tl.load(w_ptr + k * M + rm, mask=mm, other=0)
        keep = ((v != 0) & mm).to(tl.int32)
        at = k * M + kept + tl.cumsum(keep, axis=0) - 1  # each kept weight's slot
        tl.store(col_ptr + at, rm.to(tl.int32), mask=keep != 0)
        tl.store(val_ptr + at, v, mask=keep != 0)
        kept += tl.sum(keep, axis=0)
        bad += tl.sum((((tl.abs(v) < float("inf")) == 0) & mm).to(tl.int32), axis=0)  # NaN and ±Inf
    tl.store(stats_ptr + k, kept)
    tl.store(stats_ptr + K + k, bad)
    if HAS_FLAG:
        tl.atomic_add(flag_ptr, bad, sem="relaxed")


def _compact_emulated(w_ptr, col_ptr, val_ptr, stats_ptr, flag_ptr, K, M, **meta):
    """``_compact_kernel``'s effect in plain PyTorch, for tools that record launches instead of
    making them (the compile test, ``gpu_launch.py --host``): its stats are read on the host."""
    w = w_ptr[:K * M].view(K, M)
    keep = w != 0
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # kept columns first, in order
    col_ptr[:K * M].view(K, M).copy_(order)
    val_ptr[:K * M].view(K, M).copy_(w.gather(1, order))
    bad = (~torch.isfinite(w)).sum(1)
    stats_ptr.view(2, K).copy_(torch.stack([keep.sum(1), bad]))
    if meta.get("HAS_FLAG"):
        flag_ptr[:1] += bad.sum()


_compact_kernel.emulate = _compact_emulated


@triton.jit
def _sparse_kernel(
    col_ptr, val_ptr, stats_ptr, flag_ptr, p_ptr, out_ptr,
    K, M, P,
    sp_m, so_k,
    ACC_F64: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, GUARDED: tl.constexpr,
):
    pid = tl.program_id(0)
    k = (pid % K).to(tl.int64)
    pb = (pid // K).to(tl.int64)
    rp = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    if ACC_F64:
        acc = tl.zeros([BLOCK_P], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    e0 = k * M  # row k's kept weights: the first stats[0, k] of its row of col and val
    kept = tl.load(stats_ptr + k)
    if GUARDED:
        # Launched before the host has read the weights' stats: where any weight is NaN/Inf
        # (flag[0], summed by the compaction) nothing is read or written, so out is left as it
        # was when the op then raises.  (Limits, not a scalar mask: the interpreter refuses
        # a scalar & a block as a mask.)
        ok = tl.load(flag_ptr) == 0
        kept = tl.where(ok, kept, 0)
        mp = rp < tl.where(ok, P, 0)
    else:
        mp = rp < P
    e1 = e0 + kept
    # BLOCK_E kept rows per step, their loads issued together (1 by default: see
    # _SPARSE_BLOCK_E).  Masked entries read 0 for both weight and row: 0·0, so no NaN comes
    # from a padded entry.
    for e in range(e0, e1, BLOCK_E):
        re = e + tl.arange(0, BLOCK_E)
        me = re < e1
        j = tl.load(col_ptr + re, mask=me, other=0).to(tl.int64)
        v = tl.load(val_ptr + re, mask=me, other=0)
        # Rows stay in L2 for the other rows of out that keep them (the grid's fastest axis);
        # out is written once and never read, so it is evicted first.
        t = tl.load(p_ptr + j[:, None] * sp_m + rp[None, :], mask=me[:, None] & mp[None, :], other=0,
                    eviction_policy="evict_last").to(acc.dtype)
        acc += tl.sum(v[:, None] * t, axis=0)
    tl.store(out_ptr + k * so_k + rp, acc.to(out_ptr.dtype.element_ty), mask=mp, eviction_policy="evict_first")


@triton.jit
def _count_kernel(x_ptr, n, counts_ptr, BLOCK: tl.constexpr):
    # counts[0] += nonzeros of x[:n], counts[1] += its NaN/Inf; each program strides over
    # the blocks and adds its two totals atomically (counts start at 0).
    pid = tl.program_id(0)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    nonzero = tl.zeros([BLOCK], dtype=tl.int64)
    nonfinite = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(pid.to(tl.int64) * BLOCK, n, step):
        r = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r, mask=r < n, other=0)  # a masked lane reads 0: zero and finite
        nonzero += (x != 0).to(tl.int64)
        nonfinite += ((tl.abs(x) < float("inf")) == 0).to(tl.int64)  # NaN and ±Inf
    tl.atomic_add(counts_ptr, tl.sum(nonzero, axis=0), sem="relaxed")
    tl.atomic_add(counts_ptr + 1, tl.sum(nonfinite, axis=0), sem="relaxed")


def _count_emulated(x_ptr, n, counts_ptr, **meta):
    """``_count_kernel``'s effect in plain PyTorch, for tools that record launches instead of
    making them (the compile test, ``gpu_launch.py --host``): the counts are read on the host."""
    x = x_ptr[:n]
    counts_ptr += torch.stack([(x != 0).sum(), (~torch.isfinite(x)).sum()])


_count_kernel.emulate = _count_emulated


def _count_values(x: torch.Tensor, counts: torch.Tensor) -> None:
    """counts [2] int64 += (nonzeros of x, NaN/Inf of x): one launch, no sync (the counts are
    read with whatever else the call reads: two small PyTorch reductions took about 8)."""
    x = x.reshape(-1)
    if x.element_size() < 4:  # the op counts float32/float64 values; 16-bit ones are widened
        x = x.float()
    if x.numel() > 1 and x.stride(0) != 1:
        x = x.contiguous()
    n = x.numel()
    if n == 0:
        return
    with _device_guard(x):
        _launch(_count_kernel)[(min(cdiv(n, _COUNT_BLOCK), _COUNT_PROGRAMS),)](
            x, n, counts, BLOCK=_COUNT_BLOCK, num_warps=8)


def _new_counts(n: int, like: torch.Tensor) -> torch.Tensor:
    """n zeroed int64 counts on like's device."""
    return torch.zeros(n, dtype=torch.int64, device=like.device)


def _block_k(k: int) -> int:
    return max(16, min(_MAX_BLOCK_K, next_power_of_2(max(k, 1))))


def _block_p(block_k: int) -> int:
    """The dense kernel's columns per program: _BLOCK_P for 16 rows of out, half beyond.  Compiled
    for sm_90 (ptxas -v, 4 warps, 3xTF32), 16 x 128 tiles take 128 registers a thread, 32 x 128
    244 and 64 x 128 255 (32 x 64: 162, 64 x 64: 167), so the wider tiles would leave one or
    two programs a multiprocessor.  Untimed on a GPU (gpu_aggregate.py times the kernel)."""
    return _BLOCK_P if block_k <= 16 else max(16, _BLOCK_P // 2)


def _rows_of(out: torch.Tensor, params: torch.Tensor) -> bool:
    """Whether every row of out is a whole row of params or shares no memory with params
    (same row stride, start a whole number of rows apart): then the columns of out only
    overlap the same columns of params."""
    if params.shape[0] > 1 and out.shape[0] > 1 and out.stride(0) != params.stride(0):
        return False
    stride = params.stride(0) if params.shape[0] > 1 else out.stride(0)
    diff = out.data_ptr() - params.data_ptr()
    size = params.element_size()
    return stride > 0 and diff % size == 0 and (diff // size) % stride == 0


class Compact(NamedTuple):
    """``_compact``'s result: each row's nonzero weights at the front of its row of ``cols``
    [K, M] int32 and ``vals`` [K, M], ``stats`` [2, K] int32 on the device (each row's
    nonzeros, then its NaN/Inf), and ``flag`` (their total NaN/Inf, [1] int32, for a guarded
    sparse kernel) or None."""
    cols: torch.Tensor
    vals: torch.Tensor
    stats: torch.Tensor
    flag: Optional[torch.Tensor] = None


def _compact(w: torch.Tensor, flag: bool = False) -> Compact:
    """The sparse kernel's input and the weights' stats from contiguous [K, M] weights: one
    launch (and a zeroed flag with ``flag``), no sync."""
    k, m = w.shape
    cols = torch.empty((k, m), dtype=torch.int32, device=w.device)
    vals = torch.empty_like(w)
    stats = torch.empty((2, k), dtype=torch.int32, device=w.device)
    total = torch.zeros(1, dtype=torch.int32, device=w.device) if flag else None
    if k and m:
        with _device_guard(w):
            _launch(_compact_kernel)[(k,)](w, cols, vals, stats, stats if total is None else total, k, m,
                                           BLOCK=min(_COMPACT_BLOCK, next_power_of_2(m)), HAS_FLAG=flag,
                                           num_warps=4)
    elif k:
        stats.zero_()
    return Compact(cols, vals, stats, total)


def _stats_of(read: EarlyRead) -> int:
    """The weights' nonzero count from a read of ``Compact.stats``; ValueError on NaN/Inf."""
    nonzeros, bad = read.tolist()
    if any(bad):
        raise ValueError(_ops.NON_FINITE_WEIGHTS)
    return sum(nonzeros)


def _weights_stats(w: torch.Tensor) -> tuple[int, Compact]:
    """(nonzeros of w, ``_compact(w)``); raises ValueError on NaN/Inf (one device sync for both)."""
    compact = _compact(w)
    return _stats_of(read_early(compact.stats)), compact


def _sparse_into(compact: Compact, params: torch.Tensor, out: torch.Tensor) -> None:
    """The sparse kernel into ``out`` (sharing no memory with params), guarded by
    ``compact.flag`` where the compaction made one (launched before the stats are read)."""
    k, p = out.shape
    m = params.shape[0]
    with _device_guard(params):
        _launch(_sparse_kernel)[(k * cdiv(p, _SPARSE_BLOCK_P),)](
            compact.cols, compact.vals, compact.stats,
            compact.stats if compact.flag is None else compact.flag, params, out,
            k, m, p, params.stride(0), out.stride(0),
            ACC_F64=params.dtype == torch.float64, BLOCK_E=_SPARSE_BLOCK_E,
            BLOCK_P=_SPARSE_BLOCK_P, GUARDED=compact.flag is not None,
            num_warps=max(1, min(8, _SPARSE_BLOCK_P // 128)),
        )


# The path each signature of (weights, params) took last: the next call of a signature that
# took the GEMM, the sparse or the dense kernel launches it before the weights' stats are read.
_LAST_PATH: dict = {}
_LAST_PATH_ENTRIES = 1024


def _path(k: int, m: int, nnz: int, dtype: torch.dtype) -> str:
    """The path that serves [K, M] weights with ``nnz`` nonzeros: ``_PATH_OVERRIDE``, else
    ``ops.aggregate.cuda_path`` (every choice of a path goes through here)."""
    return _PATH_OVERRIDE or _ops.cuda_path(k, m, nnz, dtype, torch.backends.cuda.matmul.allow_tf32,
                                            _SPARSE_DENSITY)


def _remember(key, path: str) -> None:
    if len(_LAST_PATH) >= _LAST_PATH_ENTRIES:
        _LAST_PATH.clear()
    _LAST_PATH[key] = path


def _row0_finite(product: "_ops.GemmProduct") -> bool:
    """Whether the GEMM product's row 0 is finite (one launch, one device sync)."""
    if not product.checkable:
        return True
    counts = _new_counts(2, product.result)
    _count_values(product.result[0], counts)
    return counts.tolist()[1] == 0


def _gemm_finish(product: "_ops.GemmProduct", all_nonzero: bool, out: torch.Tensor) -> None:
    """``ops.aggregate.gemm_finish`` into out.  With every weight nonzero the plain product
    is the contract's result (no zero weight is there to skip a NaN/Inf row), so only weights
    with zeros pay for the check of row 0 and its sync."""
    _ops.gemm_finish(product, all_nonzero or _row0_finite(product), out)


def _speculative_gemm(w: torch.Tensor, params: torch.Tensor, out: torch.Tensor) -> Optional[int]:
    """The GEMM form into ``out`` (a new tensor of the op's, so writing it early loses nothing),
    where the path is known only from the weights' stats: those are counted first and read
    early (``read_early``), so the host waits for the counting and not for the GEMM.  Returns
    None when the GEMM served (out holds the result), else the weights' nonzero count for the
    path that serves instead (out is then rewritten).  Raises ValueError on NaN/Inf weights,
    as ``_weights_stats``."""
    counts = _new_counts(2, w)
    _count_values(w, counts)
    stats = read_early(counts)
    product = _ops.gemm_product(w, params, out)
    nnz, bad = stats.tolist()
    if bad:
        raise ValueError(_ops.NON_FINITE_WEIGHTS)
    k, m = w.shape
    if _path(k, m, int(nnz), params.dtype) != "gemm":
        return int(nnz)
    _gemm_finish(product, nnz == k * m, out)
    return None


def _speculative_kernel(path: str, w: torch.Tensor, params: torch.Tensor, out: torch.Tensor
                        ) -> tuple[int, Compact]:
    """The sparse or dense Triton kernel (``path``) into ``out`` before the weights' stats are
    read, guarded (it writes nothing where a weight is NaN/Inf, so even the caller's out is
    safe); returns (nonzeros, the compaction) as ``_weights_stats`` does, raising the same
    ValueError.  The caller reruns another path where the stats say it serves (out is then
    rewritten)."""
    compact = _compact(w, flag=True)
    stats = read_early(compact.stats)
    if path == "sparse":
        _sparse_into(compact, params, out)
    else:
        _dense_into(w, params, out, compact.flag)
    return _stats_of(stats), compact


def _gemm_into(w: torch.Tensor, params: torch.Tensor, out: torch.Tensor, all_nonzero: bool) -> None:
    """``ops.aggregate.gemm_weighted_average`` into out (which may overlap params)."""
    _gemm_finish(_ops.gemm_product(w, params, out), all_nonzero, out)


def _weighted_average_into(weights: torch.Tensor, params: torch.Tensor, out: torch.Tensor,
                           fresh: bool = False) -> None:
    """out <- the op's result.  ``fresh``: out is the op's own new tensor (not the caller's),
    so it may be written before the path is known."""
    k, p = out.shape
    m = params.shape[0]
    acc = torch.float64 if params.dtype == torch.float64 else torch.float32
    w = weights.to(acc).contiguous()
    if not fresh and may_overlap(out, w):
        w = w.clone()
    if p > 1 and params.stride(1) != 1:
        params = params.contiguous()
    key = (weights.shape, weights.dtype, params.shape, params.dtype, params.device)
    gemm_device = acc == torch.float64 or out.device.type in _GEMM_DEVICES
    guess = _LAST_PATH.get(key) if k and p and m else None
    copied = False
    if guess in ("sparse", "dense") and not fresh and _reads_after_writing(guess, out, params):
        params, copied = params.clone(), True
    nnz = compact = None
    if guess == "gemm" and fresh and gemm_device:
        nnz = _speculative_gemm(w, params, out)
        if nnz is None:
            return
    elif guess == "sparse" or (guess == "dense" and acc == torch.float32):
        nnz, compact = _speculative_kernel(guess, w, params, out)
    if nnz is None:
        nnz, compact = _weights_stats(w)
    if k == 0 or p == 0:
        return
    if m == 0:
        out.zero_()
        return
    path = _path(k, m, nnz, params.dtype)
    _remember(key, path)
    if path == guess and compact is not None and compact.flag is not None:
        return  # the speculative launch served
    if path != "sparse" and (acc == torch.float64 or (path == "gemm" and out.device.type in _GEMM_DEVICES)):
        _gemm_into(w, params, out, nnz == k * m)
        return
    # A fresh out (the op's own new tensor) shares no memory with params: no check to pay for.
    if not fresh and not copied and _reads_after_writing(path, out, params):
        params = params.clone()
    if path == "sparse":
        _sparse_into(_compact(w) if compact is None else compact, params, out)  # None: the GEMM was guessed
    else:
        _dense_into(w, params, out)


def _reads_after_writing(path: str, out: torch.Tensor, params: torch.Tensor) -> bool:
    """Whether the Triton kernel of ``path`` may read params where it has written out already:
    the sparse kernel wherever they overlap, the dense kernel unless its single K-block reads
    each column block of params before it writes the same columns of out's rows."""
    if not may_overlap(out, params):
        return False
    return path == "sparse" or cdiv(out.shape[0], _block_k(out.shape[0])) > 1 or not _rows_of(out, params)


def _dense_into(w: torch.Tensor, params: torch.Tensor, out: torch.Tensor, flag: Optional[torch.Tensor] = None
                ) -> None:
    """The dense kernel into ``out`` (float32 weights [K, M]), guarded by ``flag`` where given
    (launched before the weights' stats are read)."""
    k, p = out.shape
    m = params.shape[0]
    block_k = _block_k(k)
    n_kb = cdiv(k, block_k)
    block_p = _block_p(block_k)
    with _device_guard(params):
        _launch(_dense_kernel)[(n_kb * cdiv(p, block_p),)](
            w, params, out, w if flag is None else flag, k, m, p, n_kb, params.stride(0), out.stride(0),
            BLOCK_K=block_k, BLOCK_M=_BLOCK_M, BLOCK_P=block_p, PRECISION=_DENSE_PRECISION,
            GUARDED=flag is not None, num_warps=4,
        )


def weighted_average_triton(weights: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Triton ``pfl::weighted_average``: [K, P] in params' dtype, the reference's result
    (zero weights never read their row) with float32 (float64) accumulation."""
    shape = _check_op_args(weights, params)
    _check_devices(params, weights)
    out = params.new_empty(shape)
    _weighted_average_into(weights, params, out, fresh=True)
    return out


def weighted_average_out_triton(weights: torch.Tensor, params: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """Triton ``pfl::weighted_average.out``: the same, written into ``out`` (any row stride,
    unit column stride; it may overlap params)."""
    _check_op_args(weights, params, out)
    _check_devices(params, weights, out)
    _weighted_average_into(weights, params, out)
    return out


register_cuda("weighted_average", weighted_average_triton)
register_cuda("weighted_average.out", weighted_average_out_triton)

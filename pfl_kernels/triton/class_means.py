"""Triton kernel of ``pfl::class_means`` (Fed-CMA's class-conditional means), for CUDA.

Deterministic, without floating-point atomics: the samples are first grouped by (client,
class) with plain PyTorch ops on the device (``segment_keys``: a stable sort of one key per
sample, the counts by an integer scatter, exact in any order, and their exclusive prefix
sums), then one program per (client·class, D-block, chunk of a class's rows) adds its rows
in sample order in float32 (float64 for float64) registers.  With one chunk a class (no
class above ``_CHUNK_ROWS`` samples) it divides by the count and stores its block of means
once; with several, each chunk stores its partial sums and ``torch.sum`` adds them in chunk
order (a fixed-shape reduction: the same order every call), then one division.  Every
feature row is read once (per D-block).  A class without a sample gets 0.

Labels outside [0, num_classes) raise ValueError, as in every kernel of the op: both paths
count them with the rest (read in the path's one device sync), and
``ops.class_means.check_label_values`` then names the first.

One program per class and D-block, as the kernel was, gave a small grid that added its rows
one after another (C = 10, N = 100,000, D = 256 on the H200 of issue 30: 2.2 ms against
0.31 ms for ``index_add_``); the chunks give every class's rows to many programs.  Where C <= D
the sums come from a one-hot GEMM instead (issue 30, item 2; see ``class_means_triton``), and
the segment kernel serves more classes than feature dims, TF32 matmuls, and features holding
NaN/Inf.  The chunked kernel has not run on a GPU yet.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ops import class_means as _ops  # noqa: F401  (defines the schema implemented here)
from . import register_cuda
from ..ops._checks import raise_flagged
from ..ops.class_means import _check_op_args, check_output_fits
from ..ops._memo import cdiv, next_power_of_2
from ..ops.class_means import check_label_values, cuda_path, gemm_class_sums
from ..reference import class_means as _ref
from .factorized import _check_devices, _device_guard, _launch


_MAX_BLOCK_D = 256
# Rows of a class per program (at least; more where a class would need more than _MAX_CHUNKS
# chunks), and the partial sums' memory cap.  Tests shrink _CHUNK_ROWS.
_CHUNK_ROWS = 64
_MAX_CHUNKS = 256
_MAX_PARTIAL_BYTES = 64 << 20
# Devices whose sums may come from the one-hot GEMM (``ops.class_means.cuda_path``); the
# interpreter tests add "cpu" to check the routing.
_GEMM_DEVICES = ("cuda",)


@triton.jit
def _class_means_kernel(
    f_ptr, order_ptr, start_ptr, count_ptr, out_ptr,
    N, D, n_db, n_chunks, chunk_rows,
    sf_k, sf_n, sf_d, C,
    ACC_F64: tl.constexpr, BLOCK_D: tl.constexpr, PARTIAL: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = pid % n_chunks
    rest = pid // n_chunks
    seg = (rest // n_db).to(tl.int64)  # k·C + c
    db = rest % n_db
    k = seg // C
    slot = seg + 2 * k + 1  # k·(C + 2) + c + 1: each client's keys hold two more slots, for the labels out of range
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    start = tl.load(start_ptr + slot)
    count = tl.load(count_ptr + slot)
    if ACC_F64:
        acc = tl.zeros([BLOCK_D], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = f_ptr + k * sf_k + d * sf_d
    j0 = chunk * chunk_rows
    j1 = tl.minimum(count, j0 + chunk_rows)  # below j0 where the class has fewer rows: no step
    for j in range(j0, j1):
        n = tl.load(order_ptr + start + j) - k * N  # the flat sample index, back to client k's row
        acc += tl.load(base + n * sf_n, mask=dm, other=0).to(acc.dtype)
    if PARTIAL:  # partial sums [K·C, n_chunks, D], added in chunk order by the launcher
        tl.store(out_ptr + (seg * n_chunks + chunk) * D + d, acc, mask=dm)
    else:
        denom = tl.maximum(count, 1).to(acc.dtype)
        tl.store(out_ptr + seg * D + d, acc / denom, mask=dm)


def segment_keys(labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment kernel's grouping of labels [K, N] (int64): (keys [K·N], counts [K·(C+2)]
    int64), no sync.

    Client k's label l has key k·(C+2) + clamp(l, -1, C) + 1: its classes are slots 1..C of
    its C+2, a label below 0 lands in slot 0 and one of C or more in slot C+1, so one sort of
    the keys groups every client's classes in sample order (stable) and the out-of-range
    labels are counted with the rest, without the reads of a separate check (``bincount``
    also reads the keys' maximum on CUDA: a second sync).  Integer sums are exact in any
    order, so the counts are deterministic."""
    k, n = labels.shape
    width = num_classes + 2
    # Each client's class 0; one launch, and empty for K = 0 (an end of k·width refused K = 0).
    first_slots = torch.arange(1, k * width + 1, width, device=labels.device)
    keys = (labels.clamp(-1, num_classes) + first_slots[:, None]).reshape(-1)
    counts = torch.zeros(k * width, dtype=torch.int64, device=labels.device)
    counts.index_add_(0, keys, torch.ones((), dtype=torch.int64, device=labels.device).expand(k * n))
    return keys, counts


def segment_stats(counts: torch.Tensor, k: int, num_classes: int) -> tuple[int, int]:
    """(labels outside [0, C), the largest class) from ``segment_keys``' counts: one device
    read for both."""
    slots = counts.view(k, num_classes + 2)
    outside, largest = torch.stack([slots[:, ::num_classes + 1].sum(), slots[:, 1:-1].max()]).tolist()
    return int(outside), int(largest)


def chunking(largest: int, k: int, num_classes: int, dim: int, itemsize: int) -> tuple[int, int]:
    """(rows a program adds, chunks a class): at least ``_CHUNK_ROWS`` rows, at most
    ``_MAX_CHUNKS`` chunks, and partial sums within ``_MAX_PARTIAL_BYTES``."""
    rows = max(_CHUNK_ROWS, cdiv(largest, _MAX_CHUNKS))
    while cdiv(largest, rows) > 1 and k * num_classes * cdiv(largest, rows) * dim * itemsize > _MAX_PARTIAL_BYTES:
        rows *= 2
    return rows, max(1, cdiv(largest, rows))


def class_means_triton(features: torch.Tensor, labels: torch.Tensor, num_classes: int):
    """Triton ``pfl::class_means``: (means [K?, C, D] in the accumulation dtype, counts [K?, C] int64).

    Where ``ops.class_means.cuda_path`` says 'gemm' (C <= D, no TF32), the sums and counts come
    from one one-hot GEMM per client, checked together with the labels in one device sync;
    sums that are not all finite (NaN/Inf features, which the GEMM spreads to every class) are
    recomputed by the segment kernel, which keeps each in its own class as the reference does.
    """
    means_shape, counts_shape = _check_op_args(features, labels, num_classes)
    check_output_fits(features, num_classes)
    _check_devices(features, labels)
    acc = _ref.acc_dtype(features.dtype)
    batched = features.dim() == 3
    f = features if batched else features.unsqueeze(0)
    lab = (labels if batched else labels.unsqueeze(0)).to(torch.int64)
    k, n, d = f.shape
    c = num_classes
    gemm = (k * n > 0 and d > 0 and features.device.type in _GEMM_DEVICES
            and cuda_path(c, d, features.dtype, torch.backends.cuda.matmul.allow_tf32) == "gemm")
    if gemm:
        sums, counts64 = gemm_class_sums(f, lab, c)
        # One device sync for both: whether every label fell in a class (the counts total K·N)
        # and whether the GEMM's sums can be used (their float64 total is finite exactly when
        # they all are).  About 12 launches in all; the labels' own checks and bincount (which
        # syncs for the labels' maximum) made it 25 and two syncs.
        in_range, total = torch.stack([counts64.sum(), sums.sum(dtype=torch.float64)]).tolist()
        if in_range != k * n:
            raise_flagged(check_label_values, labels, num_classes)  # names the first label outside the range
        if math.isfinite(total):
            means = sums.div_(counts64.clamp_min(1).to(acc).unsqueeze(-1))
            return means.reshape(means_shape), counts64.to(torch.int64).reshape(counts_shape)
    # The segment kernel: about 14 launches and one sync (the out-of-range labels' count,
    # which the GEMM's sync has counted already where it ran first, and the largest class).
    keys, slots = segment_keys(lab, c)
    counts = slots.view(k, c + 2)[:, 1:c + 1].contiguous().reshape(counts_shape)
    if k * n == 0:
        return torch.zeros(means_shape, dtype=acc, device=features.device), counts
    outside, largest = segment_stats(slots, k, c)
    if outside:
        raise_flagged(check_label_values, labels, num_classes)  # names the first label outside the range
    if d == 0:
        return torch.zeros(means_shape, dtype=acc, device=features.device), counts
    order = torch.sort(keys, stable=True).indices  # flat sample indices k·N + n, grouped by key
    start = torch.cumsum(slots, 0) - slots
    block = min(_MAX_BLOCK_D, next_power_of_2(d))
    n_db = cdiv(d, block)
    rows, n_chunks = chunking(largest, k, c, d, acc.itemsize)
    # One chunk: the kernel writes every class's means (empty ones 0); several: partial sums.
    out = torch.empty(means_shape if n_chunks == 1 else (k * c, n_chunks, d), dtype=acc, device=features.device)
    with _device_guard(features):
        _launch(_class_means_kernel)[(k * c * n_db * n_chunks,)](
            f, order, start, slots, out, n, d, n_db, n_chunks, rows, *f.stride(), c,
            ACC_F64=acc == torch.float64, BLOCK_D=block, PARTIAL=n_chunks > 1,
            num_warps=max(1, min(4, block // 64)),
        )
    if n_chunks == 1:
        return out, counts
    means = out.sum(1).div_(counts.reshape(k * c, 1).clamp_min(1).to(acc))
    return means.reshape(means_shape), counts


register_cuda("class_means", class_means_triton)

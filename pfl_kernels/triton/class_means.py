"""Triton kernel of ``pfl::class_means`` (Fed-CMA's class-conditional means), for CUDA.

Deterministic, without floating-point atomics: the samples are first grouped by (client,
class) with plain PyTorch ops on the device (``segment_keys``: a stable sort of one key per
sample, the counts by an integer scatter, exact in any order, and their exclusive prefix
sums), then one program per (client·class, D-block) adds its class's rows in sample order in
float32 (float64 for float64) registers, divides by the count and stores its block of means
once.  Every feature row is read once (per D-block).  A class without a sample stores 0.

Labels outside [0, num_classes) raise ValueError, as in every kernel of the op: both paths
count them with the rest (read in the path's one device sync), and
``ops.class_means.check_label_values`` then names the first.

With few classes that grid is small (C = 10: ten programs per D-block, each adding N/10 rows
in turn), so where C <= D the sums come from a one-hot GEMM instead (issue 30, item 2; see
``class_means_triton``), and the segment kernel serves more classes than feature dims, TF32
matmuls, and features holding NaN/Inf.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ops import class_means as _ops  # noqa: F401  (defines the schema implemented here)
from . import register_cuda
from ..ops._checks import raise_flagged
from ..ops.class_means import _check_op_args, check_output_size
from ..ops._memo import cdiv, next_power_of_2
from ..ops.class_means import check_label_values, cuda_path, gemm_class_sums
from ..reference import class_means as _ref
from .factorized import _check_devices, _device_guard, _launch


_MAX_BLOCK_D = 256
# Devices whose sums may come from the one-hot GEMM (``ops.class_means.cuda_path``); the
# interpreter tests add "cpu" to check the routing.
_GEMM_DEVICES = ("cuda",)


@triton.jit
def _class_means_kernel(
    f_ptr, order_ptr, start_ptr, count_ptr, out_ptr,
    N, D, n_db,
    sf_k, sf_n, sf_d, C,
    ACC_F64: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = (pid // n_db).to(tl.int64)  # k·C + c
    db = pid % n_db
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
    for j in range(count):
        n = tl.load(order_ptr + start + j) - k * N  # the flat sample index, back to client k's row
        acc += tl.load(base + n * sf_n, mask=dm, other=0).to(acc.dtype)
    denom = tl.maximum(count, 1).to(acc.dtype)
    tl.store(out_ptr + seg * D + d, acc / denom, mask=dm)


def segment_keys(labels: torch.Tensor, num_classes: int, *, count_outside: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The segment kernel's grouping of labels [K, N] (int64): (keys [K·N], counts [K·(C+2)]
    int64, the number of labels outside [0, C)), with one device sync for that number (none,
    and 0, when not ``count_outside``: labels already checked).

    Client k's label l has key k·(C+2) + clamp(l, -1, C) + 1: its classes are slots 1..C of
    its C+2, a label below 0 lands in slot 0 and one of C or more in slot C+1, so one sort of
    the keys groups every client's classes in sample order (stable) and the out-of-range
    labels are counted with the rest, without the reads of a separate check (``bincount``
    also reads the keys' maximum on CUDA: a second sync).  Integer sums are exact in any
    order, so the counts are deterministic."""
    k, n = labels.shape
    width = num_classes + 2
    first_slots = torch.arange(1, k * width, width, device=labels.device)  # each client's class 0
    keys = (labels.clamp(-1, num_classes) + first_slots[:, None]).reshape(-1)
    counts = torch.zeros(k * width, dtype=torch.int64, device=labels.device)
    counts.index_add_(0, keys, torch.ones((), dtype=torch.int64, device=labels.device).expand(k * n))
    outside = int(counts.view(k, width)[:, ::width - 1].sum()) if count_outside and k * n else 0
    return keys, counts, outside


def class_means_triton(features: torch.Tensor, labels: torch.Tensor, num_classes: int):
    """Triton ``pfl::class_means``: (means [K?, C, D] in the accumulation dtype, counts [K?, C] int64).

    Where ``ops.class_means.cuda_path`` says 'gemm' (C <= D, no TF32), the sums and counts come
    from one one-hot GEMM per client, checked together with the labels in one device sync;
    sums that are not all finite (NaN/Inf features, which the GEMM spreads to every class) are
    recomputed by the segment kernel, which keeps each in its own class as the reference does.
    """
    means_shape, counts_shape = _check_op_args(features, labels, num_classes)
    check_output_size(features, num_classes)
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
    # The segment kernel: about 12 launches and one sync (the out-of-range labels' count; the
    # GEMM's sync has counted them where it ran first).
    keys, slots, outside = segment_keys(lab, c, count_outside=not gemm)
    if outside:
        raise_flagged(check_label_values, labels, num_classes)  # names the first label outside the range
    counts = slots.view(k, c + 2)[:, 1:c + 1].contiguous().reshape(counts_shape)
    if k * n == 0 or d == 0:
        return torch.zeros(means_shape, dtype=acc, device=features.device), counts
    means = torch.empty(means_shape, dtype=acc, device=features.device)  # the kernel writes every class, empty ones 0
    order = torch.sort(keys, stable=True).indices  # flat sample indices k·N + n, grouped by key
    start = torch.cumsum(slots, 0) - slots
    block = min(_MAX_BLOCK_D, next_power_of_2(d))
    n_db = cdiv(d, block)
    with _device_guard(features):
        _launch(_class_means_kernel)[(k * c * n_db,)](
            f, order, start, slots, means, n, d, n_db, *f.stride(), c,
            ACC_F64=acc == torch.float64, BLOCK_D=block, num_warps=max(1, min(4, block // 64)),
        )
    return means, counts


register_cuda("class_means", class_means_triton)

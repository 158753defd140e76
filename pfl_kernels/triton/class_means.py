"""Triton kernel of ``pfl::class_means`` (Fed-CMA's class-conditional means), for CUDA.

Deterministic, without atomics: the samples are first grouped by (client, class) with plain
PyTorch ops on the device (a stable sort of the keys k·C + label, the counts by ``bincount``
and their exclusive prefix sums), then one program per (client·class, D-block) adds its
class's rows in sample order in float32 (float64 for float64) registers, divides by the count
and stores its block of means once.  Every feature row is read once (per D-block).  A class
without a sample stores 0.

Labels outside [0, num_classes) raise ValueError, as in every kernel of the op
(``ops.class_means.check_label_values``; on the GEMM path the counts tell, read in the sync
that also checks the sums).

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
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    start = tl.load(start_ptr + seg)
    count = tl.load(count_ptr + seg)
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
    else:
        check_label_values(labels, num_classes)
    segments = k * c
    valid = (lab >= 0) & (lab < c)
    keys = torch.where(valid, lab + torch.arange(k, device=lab.device)[:, None] * c, segments).reshape(-1)
    counts = torch.bincount(keys, minlength=segments + 1)[:segments]
    means = torch.zeros(means_shape, dtype=acc, device=features.device)
    if k * n == 0 or d == 0:
        return means, counts.reshape(counts_shape)
    order = torch.sort(keys, stable=True).indices  # flat sample indices k·N + n, grouped by segment
    start = torch.cumsum(counts, 0) - counts
    block = min(_MAX_BLOCK_D, next_power_of_2(d))
    n_db = cdiv(d, block)
    with _device_guard(features):
        _launch(_class_means_kernel)[(segments * n_db,)](
            f, order, start, counts, means, n, d, n_db, *f.stride(), c,
            ACC_F64=acc == torch.float64, BLOCK_D=block, num_warps=max(1, min(4, block // 64)),
        )
    return means, counts.reshape(counts_shape)


register_cuda("class_means", class_means_triton)

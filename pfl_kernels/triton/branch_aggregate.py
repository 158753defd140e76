"""Triton kernel of ``pfl::branch_aggregate`` (pFedMB Eq. 5), registered for the CUDA dispatch key.

W[b, p] = Σ_i c[i, b] · branch_params[i, b, p] with the normalized coefficients
c = ``reference.branch_aggregate.coefficients`` (K·B numbers, formed in float64 with plain
PyTorch ops on the device: no sync).  Memory bound: one program per (branch, P-block),
branches the fastest grid axis; it walks the K clients in order, loads the block of a client
only where its coefficient is nonzero (a zero-weight client is not read, so its NaN/Inf row
does not reach W), accumulates in float32 (float64 for float64) registers and stores the
block of W once.  The sum runs in client order: deterministic, no atomics.

Addressing: branch_params is read as [K, B, P] through its strides when its trailing dims
are one strided run, else through a contiguous copy.  Offsets are int64.

``branch_aggregate.out``: W is stored straight into out where out views as [B, P] with unit
stride in P and shares no memory with branch_params; otherwise (another layout, or an
overlap such as out = branch_params[0]) into a fresh W that is then copied into out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import branch_aggregate as _ops  # noqa: F401  (defines the schema implemented here)
from . import register_cuda
from ..ops._checks import may_overlap
from ..ops.branch_aggregate import _check_op_args
from ..ops._memo import cdiv, next_power_of_2
from ..ops.branch_aggregate import check_branch_values
from ..reference import branch_aggregate as _ref
from .factorized import _check_devices, _device_guard, _launch


# 4096 fp32 per program at 8 warps: 16 values in flight per thread per client.  With few
# programs (small P) the block shrinks, down to _MIN_BLOCK_P, to give every SM work.
_MAX_BLOCK_P = 4096
_MIN_BLOCK_P = 512
_TARGET_PROGRAMS = 4 * 132  # about four waves on an H100


def _block_p(b: int, p: int) -> int:
    block = min(_MAX_BLOCK_P, next_power_of_2(max(p, 1)))
    floor = min(_MIN_BLOCK_P, block)
    while block > floor and b * cdiv(p, block) < _TARGET_PROGRAMS:
        block //= 2
    return block


@triton.jit
def _branch_aggregate_kernel(
    w_ptr, c_ptr, out_ptr,
    K, B, P,
    sw_k, sw_b, sw_p, so_b,
    ACC_F64: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid % B).to(tl.int64)
    pb = (pid // B).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < P
    if ACC_F64:
        acc = tl.zeros([BLOCK_P], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    # A running pointer to client i's block (64-bit pointer arithmetic: no int32 overflow of
    # i * sw_k however large branch_params is).
    w_i = w_ptr + b * sw_b + p * sw_p
    for i in range(K):
        c = tl.load(c_ptr + i * B + b)  # coefficients: contiguous [K, B], accumulation dtype
        if c != 0:  # a client that does not weight b is not read
            w = tl.load(w_i, mask=pm, other=0).to(acc.dtype)
            acc += c * w
        w_i += sw_k
    tl.store(out_ptr + b * so_b + p, acc.to(out_ptr.dtype.element_ty), mask=pm)


def _aggregate_into(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor,
                    out: torch.Tensor) -> None:
    """W into ``out`` [B, P] (unit stride in P, any row stride), which must not overlap branch_params."""
    k, b = alpha.shape
    p = out.shape[1]
    if p == 0:
        return
    try:
        w3 = branch_params.view(k, b, p)
    except RuntimeError:
        w3 = branch_params.contiguous().view(k, b, p)
    acc = _ref.acc_dtype(branch_params.dtype)
    coef = _ref.coefficients(alpha, counts, acc).contiguous()
    block = _block_p(b, p)
    with _device_guard(branch_params):
        _launch(_branch_aggregate_kernel)[(b * cdiv(p, block),)](
            w3, coef, out, k, b, p, *w3.stride(), out.stride(0),
            ACC_F64=acc == torch.float64, BLOCK_P=block, num_warps=max(1, min(8, block // 512)),
        )


def branch_aggregate_triton(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Triton ``pfl::branch_aggregate``: W [B, *shape] in branch_params' dtype.

    Same contract as ``pfl_kernels.reference.branch_aggregate.branch_aggregate``, with the
    op's data checks (counts >= 0, α >= 0, both finite: one device sync).
    """
    out_shape = _check_op_args(branch_params, alpha, counts)
    _check_devices(branch_params, alpha, counts)
    check_branch_values(alpha, counts)
    out = branch_params.new_empty(out_shape)
    _aggregate_into(branch_params, alpha, counts, out.view(alpha.shape[1], -1))
    return out


def branch_aggregate_out_triton(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor, *,
                                out: torch.Tensor) -> torch.Tensor:
    """Triton ``pfl::branch_aggregate.out``: the same, written into ``out`` (any layout; it may
    overlap any input; its own elements must not share memory)."""
    _check_op_args(branch_params, alpha, counts, out)
    _check_devices(branch_params, alpha, counts, out)
    check_branch_values(alpha, counts)
    b = alpha.shape[1]
    p = out.numel() // b
    try:
        out2 = out.view(b, p)
    except RuntimeError:
        out2 = None
    if (out2 is not None and (p <= 1 or out2.stride(1) == 1) and (b == 1 or abs(out2.stride(0)) >= p)
            and not may_overlap(out2, branch_params)):
        _aggregate_into(branch_params, alpha, counts, out2)
    else:
        w = branch_params.new_empty(out.shape)
        _aggregate_into(branch_params, alpha, counts, w.view(b, p))
        out.copy_(w)
    return out


register_cuda("branch_aggregate", branch_aggregate_triton)
register_cuda("branch_aggregate.out", branch_aggregate_out_triton)

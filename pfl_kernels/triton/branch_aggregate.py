"""Triton kernel of ``pfl::branch_aggregate`` (pFedMB Eq. 5), registered for the CUDA dispatch key.

W[b, p] = Σ_i c[i, b] · branch_params[i, b, p] with the normalized coefficients
c = ``reference.branch_aggregate.coefficients`` (K·B numbers).  Two launches and one sync:

* ``_coefficients_kernel`` (one program) forms c in float64 as the reference does (each
  product scaled per branch by a power of two: no overflow), rounds it
  to the accumulation dtype, and flags bad data (counts or alpha negative, NaN or Inf).  The
  plain-PyTorch coefficients and checks were about 20 small launches, each a host round trip
  (on the H200 of issue 30 the op took 350 µs against eager's 147 at K = 20, B = 5, P = 10^6).
* ``_branch_aggregate_kernel``: memory bound, one program per (branch, P-block), branches the
  fastest grid axis; it walks the K clients ``_BLOCK_I`` at a time with their loads in flight
  together, loads the block of a client only where its coefficient is nonzero (a zero-weight
  client is not read, so its NaN/Inf row does not reach W), accumulates in float32 (float64
  for float64) registers and stores the block of W once.  Deterministic, no atomics.

The flags are copied to the host right after the first launch and read (``read_early``:
the host waits for the coefficient kernel, not for the aggregation) after the second.  For
``.out`` the aggregation is guarded on the device by the same flags, so it writes nothing of
the caller's where the data is bad; bad data raises ``check_branch_values``' ValueError.

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
from . import emulate_good_flags, register_cuda
from ..ops._checks import may_overlap, raise_flagged
from ..ops.branch_aggregate import _check_op_args
from ..ops._memo import cdiv, next_power_of_2
from ..ops.branch_aggregate import check_branch_values
from ..reference import branch_aggregate as _ref
from ._early_read import EarlyRead, read_early
from .factorized import _check_devices, _device_guard, _launch


# 4096 fp32 per program at 8 warps: 16 values in flight per thread per client.  With few
# programs (small P) the block shrinks, down to _MIN_BLOCK_P, to give every SM work.
_MAX_BLOCK_P = 4096
_MIN_BLOCK_P = 512
_TARGET_PROGRAMS = 4 * 132  # about four waves on an H100
# Clients gathered per step (float64: half as many, for registers).  Tests shrink these.
_BLOCK_I = 4
# The coefficient kernel's tile of alpha (clients x branches).
_COEF_BLOCK_K = 64
_MAX_COEF_BLOCK_B = 16


def _block_p(b: int, p: int) -> int:
    block = min(_MAX_BLOCK_P, next_power_of_2(max(p, 1)))
    floor = min(_MIN_BLOCK_P, block)
    while block > floor and b * cdiv(p, block) < _TARGET_PROGRAMS:
        block //= 2
    return block


@triton.jit
def _counts_and_alpha(alpha_ptr, counts_ptr, k0, rb, mb, K, sa_k, sa_b, s_n, BLOCK_K: tl.constexpr):
    """Clients k0 .. k0 + BLOCK_K: their indices, counts [BLOCK_K] and alpha [BLOCK_K, BLOCK_B]
    at branches rb, in float64 (0 outside K and the mask mb)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    mk = rk < K
    n = tl.load(counts_ptr + rk.to(tl.int64) * s_n, mask=mk, other=0).to(tl.float64)
    a = tl.load(alpha_ptr + rk.to(tl.int64)[:, None] * sa_k + rb[None, :] * sa_b,
                mask=mk[:, None] & mb[None, :], other=0).to(tl.float64)
    return rk, n, a


@triton.jit
def _frexp(x):
    """(m, e) with x = m 2^e, m in [0.5, 1) (0 for x = 0), for float64 x >= 0, exactly: from
    its bits, a subnormal x first scaled by 2^64 (exact) into the normal range."""
    subnormal = ((x.to(tl.int64, bitcast=True) >> 52) & 0x7FF) == 0
    bits = tl.where(subnormal, x * 18446744073709551616.0, x).to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1022 - tl.where(subnormal, 64, 0)
    m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FE0000000000000).to(tl.float64, bitcast=True)
    return tl.where(x == 0, 0.0, m), e


@triton.jit
def _products(n, a):
    """Each n_i α_ib as (mantissa product in [0.25, 1) or 0, int64 exponent) [BLOCK_K, BLOCK_B]."""
    mn, en = _frexp(n)
    ma, ea = _frexp(a)
    return mn[:, None] * ma, en[:, None].to(tl.int64) + ea.to(tl.int64)


@triton.jit
def _scaled_products(n, a, top):
    """n_i α_ib 2^-top_b [BLOCK_K, BLOCK_B] in float64, as ``reference.branch_aggregate.
    scaled_products`` forms it (2^k built from its bits: exact; 0 below 2^-1022), with
    (mantissa product, exponent) = ``_products(n, a)``."""
    m, e = _products(n, a)
    k = tl.where(m != 0, e - top[None, :], 0)  # <= 0 where used
    p = ((tl.maximum(k, -1022) + 1023) << 52).to(tl.float64, bitcast=True)
    return tl.where((m != 0) & (k >= -1022), m * p, 0.0)


@triton.jit
def _coefficients_kernel(
    alpha_ptr, counts_ptr, coef_ptr, flags_ptr,
    K, B, sa_k, sa_b, s_n,
    BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # One program: c = n_i α_ib / Σ_j n_j α_jb (1/K where that sum is not > 0) in float64,
    # stored in coef's dtype, and the data checks' flags (counts bad, alpha bad) in int32.
    # The products are scaled per branch by 2^-top_b, top_b the largest product's exponent
    # (the reference's ``scaled_products``): none overflows, even for counts and α of 1e300.
    bad_n = tl.zeros([BLOCK_K], dtype=tl.int32)
    bad_a = tl.zeros([BLOCK_K, BLOCK_B], dtype=tl.int32)
    for b0 in range(0, B, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B)
        mb = rb < B
        top = tl.full([BLOCK_B], -(1 << 40), tl.int64)  # below any product's exponent
        for k0 in range(0, K, BLOCK_K):
            rk, n, a = _counts_and_alpha(alpha_ptr, counts_ptr, k0, rb, mb, K, sa_k, sa_b, s_n, BLOCK_K)
            # (x >= 0) & (x < inf) is False for NaN, ±Inf and negatives alike
            bad_n |= ((n >= 0) & (n < float("inf"))) == 0
            bad_a |= ((a >= 0) & (a < float("inf"))) == 0
            m, e = _products(n, a)
            top = tl.maximum(top, tl.max(tl.where(m != 0, e, -(1 << 40)), axis=0))
        total = tl.zeros([BLOCK_B], dtype=tl.float64)
        for k0 in range(0, K, BLOCK_K):
            rk, n, a = _counts_and_alpha(alpha_ptr, counts_ptr, k0, rb, mb, K, sa_k, sa_b, s_n, BLOCK_K)
            total += tl.sum(_scaled_products(n, a, top), axis=0)
        weighted = total > 0
        safe = tl.where(weighted, total, 1.0)
        for k0 in range(0, K, BLOCK_K):
            rk, n, a = _counts_and_alpha(alpha_ptr, counts_ptr, k0, rb, mb, K, sa_k, sa_b, s_n, BLOCK_K)
            # 1/K in float64 (a float literal over an int would be float32)
            uniform = tl.full([BLOCK_K, BLOCK_B], 1.0, tl.float64) / K
            c = tl.where(weighted[None, :], _scaled_products(n, a, top) / safe[None, :], uniform)
            tl.store(coef_ptr + rk.to(tl.int64)[:, None] * B + rb[None, :], c.to(coef_ptr.dtype.element_ty),
                     mask=(rk < K)[:, None] & mb[None, :])
    tl.store(flags_ptr, tl.max(bad_n, axis=0))
    tl.store(flags_ptr + 1, tl.max(tl.max(bad_a, axis=1), axis=0))


emulate_good_flags(_coefficients_kernel)  # the coefficients are left unwritten there


@triton.jit
def _branch_aggregate_kernel(
    w_ptr, c_ptr, flags_ptr, out_ptr,
    K, B, P,
    sw_k, sw_b, sw_p, so_b,
    ACC_F64: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_P: tl.constexpr, GUARDED: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid % B).to(tl.int64)
    pb = (pid // B).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    if GUARDED:
        # Launched into the caller's out before the host has read the flags: where the data
        # is bad nothing is read or written, so out stays as it was when the op raises.
        ok = (tl.load(flags_ptr) | tl.load(flags_ptr + 1)) == 0
        pm = p < tl.where(ok, P, 0)
    else:
        pm = p < P
    if ACC_F64:
        acc = tl.zeros([BLOCK_P], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    w_b = w_ptr + b * sw_b + p * sw_p
    # BLOCK_I clients per step, their loads in flight together (one at a time, each load
    # waited on its coefficient, then on itself).  A client whose coefficient is 0 is masked
    # out: not read, and its 0·0 adds nothing, so its NaN/Inf row never reaches W.
    for i0 in range(0, K, BLOCK_I):
        ri = i0 + tl.arange(0, BLOCK_I)
        c = tl.load(c_ptr + ri * B + b, mask=ri < K, other=0)  # coefficients: contiguous [K, B], acc dtype
        w = tl.load(w_b[None, :] + ri.to(tl.int64)[:, None] * sw_k, mask=(c != 0)[:, None] & pm[None, :],
                    other=0).to(acc.dtype)
        acc += tl.sum(c[:, None] * w, axis=0)
    tl.store(out_ptr + b * so_b + p, acc.to(out_ptr.dtype.element_ty), mask=pm)


def _coefficients_and_checks(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor):
    """(c [K, B] contiguous in the accumulation dtype, flags [2] int32: counts bad, alpha bad),
    both from one launch (the plain-PyTorch coefficients and checks took about 20)."""
    k, b = alpha.shape
    coef = torch.empty(k, b, dtype=_ref.acc_dtype(branch_params.dtype), device=alpha.device)
    flags = torch.empty(2, dtype=torch.int32, device=alpha.device)
    block_b = min(_MAX_COEF_BLOCK_B, next_power_of_2(b))
    with _device_guard(branch_params):
        _launch(_coefficients_kernel)[(1,)](
            alpha, counts, coef, flags, k, b, alpha.stride(0), alpha.stride(1), counts.stride(0),
            BLOCK_K=_COEF_BLOCK_K, BLOCK_B=block_b, num_warps=4,
        )
    return coef, flags


def _raise_on_bad_values(flags: EarlyRead, alpha: torch.Tensor, counts: torch.Tensor) -> None:
    """The op's ValueError where the flags (read early: the wait is for the coefficient
    kernel only) say the data is bad; the message, with the first bad entry, comes from
    ``check_branch_values``."""
    if any(flags.tolist()):
        raise_flagged(check_branch_values, alpha, counts)


def _aggregate_into(branch_params: torch.Tensor, coef: torch.Tensor, flags: torch.Tensor, out: torch.Tensor,
                    guarded: bool = False) -> None:
    """W into ``out`` [B, P] (unit stride in P, any row stride), which must not overlap
    branch_params; ``guarded``: nothing is written where ``flags`` are set."""
    k, b = coef.shape
    p = out.shape[1]
    if p == 0:
        return
    try:
        w3 = branch_params.view(k, b, p)
    except RuntimeError:
        w3 = branch_params.contiguous().view(k, b, p)
    f64 = coef.dtype == torch.float64
    block = _block_p(b, p)
    with _device_guard(branch_params):
        _launch(_branch_aggregate_kernel)[(b * cdiv(p, block),)](
            w3, coef, flags, out, k, b, p, *w3.stride(), out.stride(0),
            ACC_F64=f64, BLOCK_I=_BLOCK_I // 2 if f64 else _BLOCK_I, BLOCK_P=block, GUARDED=guarded,
            num_warps=max(1, min(8, block // 512)),
        )


def branch_aggregate_triton(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Triton ``pfl::branch_aggregate``: W [B, *shape] in branch_params' dtype.

    Same contract as ``pfl_kernels.reference.branch_aggregate.branch_aggregate``, with the
    op's data checks (counts >= 0, α >= 0, both finite: one device sync, for the
    coefficient kernel alone).
    """
    out_shape = _check_op_args(branch_params, alpha, counts)
    _check_devices(branch_params, alpha, counts)
    coef, flags = _coefficients_and_checks(branch_params, alpha, counts)
    checks = read_early(flags)
    out = branch_params.new_empty(out_shape)
    # A new W may be written before the checks are read.
    _aggregate_into(branch_params, coef, flags, out.view(alpha.shape[1], -1))
    _raise_on_bad_values(checks, alpha, counts)
    return out


def branch_aggregate_out_triton(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor, *,
                                out: torch.Tensor) -> torch.Tensor:
    """Triton ``pfl::branch_aggregate.out``: the same, written into ``out`` (any layout; it may
    overlap any input; its own elements must not share memory)."""
    _check_op_args(branch_params, alpha, counts, out)
    _check_devices(branch_params, alpha, counts, out)
    # out is the caller's: nothing is written into it where the checks fail.  The
    # coefficients are formed first (should out overlap alpha or counts); the kernel that
    # writes out straight is guarded by the flags on the device, so it is launched before
    # they are read; the copy of the other layouts waits for them.
    coef, flags = _coefficients_and_checks(branch_params, alpha, counts)
    checks = read_early(flags)
    b = alpha.shape[1]
    p = out.numel() // b
    try:
        out2 = out.view(b, p)
    except RuntimeError:
        out2 = None
    if (out2 is not None and (p <= 1 or out2.stride(1) == 1) and (b == 1 or abs(out2.stride(0)) >= p)
            and not may_overlap(out2, branch_params)):
        _aggregate_into(branch_params, coef, flags, out2, guarded=True)
        _raise_on_bad_values(checks, alpha, counts)
    else:
        w = branch_params.new_empty(out.shape)
        _aggregate_into(branch_params, coef, flags, w.view(b, p))
        _raise_on_bad_values(checks, alpha, counts)
        out.copy_(w)
    return out


register_cuda("branch_aggregate", branch_aggregate_triton)
register_cuda("branch_aggregate.out", branch_aggregate_out_triton)

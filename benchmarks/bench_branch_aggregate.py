"""CPU benchmark of ``pfl::branch_aggregate`` (pFedMB Eq. 5) against its floor and eager PyTorch.

One case, ``aggregate``: W_b = Σ_i n_i α_ib W_ib / Σ_i n_i α_ib over K clients' copies of B
branches of P parameters each (float32), at K ∈ {20, 100, 1000}, B = 5 and
P ∈ {65536 (ResNet-9's matching vector), 10^5, 10^6, 10^7}, plus B ∈ {2, 10} at K = 100,
P = 10^5 and K = 20, P = 10^6.

Skipped shapes.  Shapes whose branch_params exceed ``MAX_BYTES`` (4 GB; the floor's copy
needs as much again) are left out: K = 100 with P = 10^7 (20 GB), K = 1000 with P = 10^6 and
10^7 (20 GB, 200 GB).  K = 20, B = 5, P = 10^7 (4.0 GB) is kept.

Sides.
* ours: ``torch.ops.pfl.branch_aggregate.out(params, alpha, counts, out=W)`` into a
  preallocated W (the C++ kernel when built), as a server writes its bank of global
  branches, and as the floor writes a preallocated ``dst``.  The allocating call adds the page
  faults of a fresh W (at K = 20, B = 5, P = 10^7 on the 2-core CI machine: 37-260 ms for
  200 MB, against about 120 ms to read the 4 GB of params), which measure the OS, not the op.
* baseline: the eager composition research code writes: the normalized weights
  ``n[:, None] * alpha / (n[:, None] * alpha).sum(0)`` and ``torch.einsum('kb,kbp->bp', ...)``
  (a batched GEMV in BLAS).
* floor: the op is bound by memory traffic (one multiply-add per element read): it reads
  K·B·P + 2K·B (+K) elements and writes B·P.  The floor is ``dst.copy_(src)`` between two
  preallocated float32 tensors of M = ceil(traffic / 2) elements, which moves the same bytes
  (as in ``bench_branch.py``).

Inputs are random, never zeros: params standard normal, α uniform in (0.05, 1.05), counts in
[1, 1000].  Labels in ``extra_info``: case, shape, weight_shape [K, B, P], branches, clients,
params, side, impl, repeat, traffic_bytes.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py --suite branch_aggregate [--quick]
    python -m pytest benchmarks/bench_branch_aggregate.py -p no:cacheprovider --benchmark-disable

A second case, ``aggregate-bf16``: bfloat16 branch_params (float32 accumulation) at
``BF16_SHAPES``, against the eager einsum on the params upcast to float32 (what keeps float32
accumulation in eager code) and the copy of the op's bfloat16 bytes (the same 1.5x target).

``PFL_BENCH_QUICK=1``: K = 20 and 100 at P = 65536 and 10^5, B = 5 only (bf16: K = 20,
P = 65536), one repeat.
"""
from __future__ import annotations

import pytest
import torch

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from benchmarks import _common as common
from benchmarks._common import Shape

MAX_BYTES = 4_000_000_000
CLIENTS = (20, 100, 1000)
PARAMS = (65536, 10 ** 5, 10 ** 6, 10 ** 7)
BRANCHES = 5
EXTRA_BRANCHES = ((100, 10 ** 5), (20, 10 ** 6))  # (K, P) also measured at B = 2 and 10
BF16_SHAPES = [(20, BRANCHES, 65536)] if common.QUICK else \
    [(20, BRANCHES, 10 ** 6), (100, BRANCHES, 10 ** 5), (100, BRANCHES, 10 ** 6)]


def _name(p: int) -> str:
    return {65536: "65536", 10 ** 5: "1e5", 10 ** 6: "1e6", 10 ** 7: "1e7"}.get(p, str(p))


def shapes() -> list[Shape]:
    """(K, B, P) as ``Shape`` (weight = [K, B, P]), within MAX_BYTES of float32 params."""
    if common.QUICK:
        grid = [(k, BRANCHES, p) for k in (20, 100) for p in (65536, 10 ** 5)]
    else:
        grid = [(k, BRANCHES, p) for k in CLIENTS for p in PARAMS]
        grid += [(k, b, p) for k, p in EXTRA_BRANCHES for b in (2, 10)]
    return [Shape(f"K{k}-B{b}-P{_name(p)}", (k, b, p)) for k, b, p in grid if 4 * k * b * p <= MAX_BYTES]


SIDES = (("ours", "fused"), ("baseline", "eager-einsum"), ("floor", "copy"))

pytestmark = common.benchmark_mark(max_time=0.5, quick_max_time=0.2)


def traffic_bytes(k: int, b: int, p: int, elem: int = 4) -> int:
    """Minimum traffic in bytes: read params, alpha and counts, write W (params and W of
    ``elem`` bytes, alpha and counts counted as float32)."""
    return elem * (k * b * p + b * p) + 4 * (k * b + k)


def _copy_fn(nbytes: int):
    """dst.copy_(src) between preallocated float32 tensors, moving ``nbytes`` (half each way)."""
    src = torch.randn(-(-nbytes // 8), generator=torch.Generator().manual_seed(3))
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _inputs(k: int, b: int, p: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(k, b, p, generator=gen).to(dtype)
    alpha = torch.rand(k, b, generator=gen) + 0.05
    counts = torch.randint(1, 1001, (k,), generator=gen)
    return params, alpha, counts


def _eager(params, alpha, counts):
    weight = counts[:, None].to(alpha.dtype) * alpha
    if params.dtype != weight.dtype:  # upcast: float32 accumulation, as the op
        return torch.einsum("kb,kbp->bp", weight / weight.sum(0), params.to(weight.dtype)).to(params.dtype)
    return torch.einsum("kb,kbp->bp", weight / weight.sum(0), params)


def _measure(benchmark, case: str, shape: Shape, impl: str, dtype: torch.dtype):
    k, b, p = shape.weight
    nbytes = traffic_bytes(k, b, p, elem=torch.empty((), dtype=dtype).element_size())
    if impl == "copy":
        fn = _copy_fn(nbytes)
    else:
        params, alpha, counts = _inputs(k, b, p, dtype)
        if impl == "fused":
            out = torch.empty(b, p, dtype=dtype)

            def fn():
                return torch.ops.pfl.branch_aggregate.out(params, alpha, counts, out=out)
        else:
            def fn():
                return _eager(params, alpha, counts)
    out = common.run(benchmark, case, fn, {"branches": b, "clients": k, "params": p}, {"traffic_bytes": nbytes})
    if impl != "copy":
        assert tuple(out.shape) == (b, p) and out.dtype == dtype


@pytest.mark.parametrize("shape, side, impl, repeat",
                         [pytest.param(s, side, impl, r, id=f"{s.name}-r{r}-{impl}")
                          for r in range(common.REPEATS) for s in shapes() for side, impl in SIDES])
def test_aggregate(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    _measure(benchmark, "aggregate", shape, impl, torch.float32)


@pytest.mark.parametrize("shape, side, impl, repeat",
                         [pytest.param(Shape(f"K{k}-B{b}-P{_name(p)}", (k, b, p)), side, impl, r,
                                       id=f"K{k}-B{b}-P{_name(p)}-r{r}-{impl}")
                          for r in range(common.REPEATS) for k, b, p in BF16_SHAPES for side, impl in SIDES])
def test_aggregate_bf16(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    _measure(benchmark, "aggregate-bf16", shape, impl, torch.bfloat16)

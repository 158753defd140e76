"""CPU benchmark of ``pfl::branch_aggregate`` (pFedMB Eq. 5) against its floor and eager PyTorch.

One case, ``aggregate``: W_b = Σ_i n_i α_ib W_ib / Σ_i n_i α_ib over K clients' copies of B
branches of P parameters each (float32), at K ∈ {20, 100, 1000}, B = 5 and
P ∈ {65536 (ResNet-9's matching vector), 10^5, 10^6, 10^7}, plus B ∈ {2, 10} at K = 100,
P = 10^5 and K = 20, P = 10^6.

Skipped shapes.  Shapes whose branch_params exceed ``MAX_BYTES`` (4 GB; the floor's copy
needs as much again) are left out: K = 100 with P = 10^7 (20 GB), K = 1000 with P = 10^6 and
10^7 (20 GB, 200 GB).  K = 20, B = 5, P = 10^7 (4.0 GB) is kept.

Sides.
* ours: ``torch.ops.pfl.branch_aggregate(params, alpha, counts)`` (the C++ kernel when built).
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

``PFL_BENCH_QUICK=1``: K = 20 and 100 at P = 65536 and 10^5, B = 5 only, one repeat.
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


def traffic(k: int, b: int, p: int) -> int:
    """Minimum traffic in elements: read params, alpha and counts, write W."""
    return k * b * p + k * b + k + b * p


def _inputs(k: int, b: int, p: int):
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(k, b, p, generator=gen)
    alpha = torch.rand(k, b, generator=gen) + 0.05
    counts = torch.randint(1, 1001, (k,), generator=gen)
    return params, alpha, counts


def _eager(params, alpha, counts):
    weight = counts[:, None].to(alpha.dtype) * alpha
    return torch.einsum("kb,kbp->bp", weight / weight.sum(0), params)


@pytest.mark.parametrize("shape, side, impl, repeat",
                         [pytest.param(s, side, impl, r, id=f"{s.name}-r{r}-{impl}")
                          for r in range(common.REPEATS) for s in shapes() for side, impl in SIDES])
def test_aggregate(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    k, b, p = shape.weight
    if impl == "copy":
        src = torch.randn(-(-traffic(k, b, p) // 2), generator=torch.Generator().manual_seed(3))
        dst = torch.empty_like(src)

        def fn():
            return dst.copy_(src)
    else:
        params, alpha, counts = _inputs(k, b, p)
        if impl == "fused":
            def fn():
                return torch.ops.pfl.branch_aggregate(params, alpha, counts)
        else:
            def fn():
                return _eager(params, alpha, counts)
    out = common.run(benchmark, "aggregate", fn, {"branches": b, "clients": k, "params": p},
                     {"traffic_bytes": 4 * traffic(k, b, p)})
    if impl != "copy":
        assert tuple(out.shape) == (b, p)

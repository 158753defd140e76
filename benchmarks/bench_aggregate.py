"""CPU benchmarks of ``weighted_average`` against ``torch.mm`` (the floor of a dense product).

Cases (float32 params and weights, M = K clients, P parameters per client):

* ``dense``: dense softmax weights, ``weighted_average(w, params, out=out)`` (ours) against
  ``torch.mm(w, params, out=out)`` (floor: the BLAS product it replaces, same shapes and
  dtype; side 'baseline').  Target: ours <= 1.1 x torch.mm.  Peak memory: the op allocates nothing of size [K, P]
  besides its output (here it writes a preallocated ``out``); ``extra_info['rss_delta_mb']``
  records the growth of the process's peak RSS over the call (resource.getrusage), which stays
  near zero.
* ``sparse``: weights thresholded to 5% nonzero per row (as after ``similarity_weights``), at
  K = 1000, P = 10^5: ours against the dense product ``torch.mm`` of the same weights
  (side 'baseline').  Target: >= 5 x faster than torch.mm.

* ``dense-bf16``: bfloat16 params and out, float32 weights (float32 accumulation) at
  ``BF16_SHAPES``: ours against the eager code that keeps float32 accumulation (``torch.mm``
  of the weights and the params upcast to float32, written back as bfloat16; 'baseline'),
  and, as the 'floor' side, ``torch.mm`` in bfloat16 (weights rounded to bfloat16, the
  output rounded by BLAS: less precise, but what the CPU's bfloat16 instructions reach).
  No target: reported to show where bfloat16 stands.

Shapes: K in {20, 100, 1000}, P in {65536, 10^5, 10^6, 10^7}, skipping those whose params +
out exceed ~4 GB (K = 100 and 1000 at P = 10^7; K = 1000 at P = 10^6) or whose dense product
takes more than ~10 s on 2 cores; plus K = 10^4, P = 1000 (dense and bf16: 400 MB of weights).
``PFL_BENCH_QUICK=1``: K = 20 and 100 at P = 65536 and the sparse case only, one repeat.

Labels in ``extra_info``: case, shape (``K<K>-P<P>``), weight_shape [K, M, P], clients,
params_per_client, density, side, impl, repeat, rss_delta_mb.

Run: ``OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py --suite aggregate [--quick]``.
"""
from __future__ import annotations

import resource

import pytest
import torch

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from benchmarks import _common as common
from pfl_kernels.ops import weighted_average

GB = 1 << 30
MAX_BYTES = 4 * GB
CLIENTS = (20, 100, 1000)
PARAMS = (65536, 10**5, 10**6, 10**7)
SPARSE_SHAPE = (1000, 10**5)
SPARSE_DENSITY = 0.05
# K = 10^4 clients (the top of the range; 400 MB of weights, past the cache) at P = 1000.
LARGE_K_SHAPE = (10**4, 1000)
BF16_SHAPES = [(20, 65536)] if common.QUICK else [(100, 10**6), (1000, 65536), LARGE_K_SHAPE]


def _fits(k: int, p: int) -> bool:
    return 2 * k * p * 4 <= MAX_BYTES and k * k * p <= 2 * 10**11


DENSE_SHAPES = [(20, 65536), (100, 65536)] if common.QUICK else \
    [(k, p) for k in CLIENTS for p in PARAMS if _fits(k, p)] + [LARGE_K_SHAPE]
# torch.mm is both the eager code the op replaces and the floor of a dense product: it is the
# 'baseline' side, so report.py's ratio is ours / torch.mm (dense) or torch.mm / ours (sparse).
SIDES = (("ours", "pfl"), ("baseline", "torch.mm"))
BENCH = common.benchmark_mark(max_time=2.0, quick_max_time=0.5)


def _inputs(k: int, p: int, density: float):
    g = torch.Generator().manual_seed(0)
    w = torch.softmax(torch.randn(k, k, generator=g), -1)
    if density < 1:
        keep = torch.rand(k, k, generator=g).argsort(1) < max(1, int(density * k))
        w = torch.softmax(torch.where(keep, w, -float("inf")), -1)
    return w, torch.randn(k, p, generator=g), torch.empty(k, p)


def _params(shapes):
    return [pytest.param((k, p), side, impl, repeat, id=f"K{k}-P{p}-r{repeat}-{side}")
            for repeat in range(common.REPEATS) for k, p in shapes for side, impl in SIDES]


def _run(benchmark, case, shape, side, impl, repeat, density):
    k, p = shape
    w, params, out = _inputs(k, p, density)
    fn = (lambda: weighted_average(w, params, out=out)) if side == "ours" else \
        (lambda: torch.mm(w, params, out=out))
    _measure(benchmark, case, shape, side, impl, repeat, density, fn)


def _measure(benchmark, case, shape, side, impl, repeat, density, fn):
    """Benchmark ``fn`` labelled for the report, with the growth of peak RSS over the calls."""
    k, p = shape
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    benchmark.group = f"{case}/K{k}-P{p}"
    benchmark.extra_info.update(case=case, shape=f"K{k}-P{p}", weight_shape=[k, k, p], clients=k, params_per_client=p,
                                density=density, side=side, impl=impl, repeat=repeat)
    benchmark(fn)
    benchmark.extra_info["rss_delta_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


@BENCH
@pytest.mark.parametrize("shape,side,impl,repeat", _params(DENSE_SHAPES))
def test_dense(benchmark, shape, side, impl, repeat):
    _run(benchmark, "dense", shape, side, impl, repeat, 1.0)


@BENCH
@pytest.mark.parametrize("shape,side,impl,repeat", _params([SPARSE_SHAPE]))
def test_sparse(benchmark, shape, side, impl, repeat):
    _run(benchmark, "sparse", shape, side, impl, repeat, SPARSE_DENSITY)


BF16_SIDES = (("ours", "pfl"), ("baseline", "upcast+torch.mm"), ("floor", "torch.mm-bf16"))


@BENCH
@pytest.mark.parametrize("shape,side,impl,repeat",
                         [pytest.param((k, p), side, impl, repeat, id=f"K{k}-P{p}-r{repeat}-{side}")
                          for repeat in range(common.REPEATS) for k, p in BF16_SHAPES for side, impl in BF16_SIDES])
def test_dense_bf16(benchmark, shape, side, impl, repeat):
    k, p = shape
    w, params, _ = _inputs(k, p, 1.0)
    params = params.bfloat16()
    out = torch.empty_like(params)
    if side == "ours":
        def fn():
            return weighted_average(w, params, out=out)
    elif side == "baseline":
        def fn():
            return out.copy_(torch.mm(w, params.float()))
    else:
        w_bf16 = w.bfloat16()

        def fn():
            return torch.mm(w_bf16, params, out=out)
    _measure(benchmark, "dense-bf16", shape, side, impl, repeat, 1.0, fn)

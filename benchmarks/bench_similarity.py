"""CPU benchmarks of the similarity ops against torch.mm (their floor) and the eager code they replace.

Three cases (float32; the issue's targets are on CPU):

* ``cosine``: ``pfl_kernels.ops.pairwise_cosine(x)`` (x [K, D], every client against every
  client, as Factorized-FL matches its clients) against
  - floor: ``torch.mm(x, x.t())`` on the same shapes: the product is the op's arithmetic
    (2·K²·D flops) and its reads of x; the normalization is an O(K²) epilogue on top;
  - baseline: ``F.normalize(x) @ F.normalize(x).t()``, the eager composition research code
    uses (a normalized copy of x, then the product).
* ``sqdist``: ``pairwise_sqdist(x)`` against the same floor and ``torch.cdist(x, x) ** 2``
  (FedAMP, FedFomo).
* ``weights``: ``similarity_weights(sim, tau=0.9, scale=20, min_keep=4)`` on a [K, K] sim
  (uniform in [-1, 1], so about 5% of each row reaches tau, as after Factorized-FL's
  matching) against the eager torch rule (own entry set to 1, ``topk`` for min_keep,
  threshold mask, masked softmax).  No floor side: it reads sim once and writes the
  weights once, and its baseline is the eager code.

Shapes.  cosine and sqdist at K in {20, 100, 1000} clients and D in {65,536 (ResNet-9's
matching vector), 10^5, 10^6, 10^7} parameters, except (``SKIPPED``):
  * inputs of 4 GB or more (K = 100 at D = 10^7; K = 1000 at D = 10^6 and 10^7): beyond what
    the 2-core benchmark machine can hold with a baseline's copy next to them;
  * none else: K = 1000 at D = 10^5 is 2·10^11 flops (seconds per call on 2 cores), the
    slowest kept.
weights at K = M in {100, 1000, 10000}.

A fourth case, ``cosine-bf16``: bfloat16 x (float32 accumulation and result) at
``BF16_SHAPES``, against ``F.normalize(x.float())`` + mm (the eager code with float32
accumulation) and, as the floor side, ``torch.mm(x, x.t())`` in bfloat16 (the CPU's bfloat16
instructions; its result is rounded to bfloat16, so it is less precise than the op: no target).
``PFL_BENCH_QUICK=1`` keeps K in {20, 100} at D in {65536, 10^5} and weights at K in
{100, 1000}, with one repeat of fewer rounds.

Every test benchmarks one function; ``benchmark.extra_info`` names the case, the shape
(``K<K>-D<D>``, or ``K<K>`` for weights), ``weight_shape`` ([K, D] or [K, K]), the side
('ours', 'baseline' or 'floor'), the implementation, the repeat and ``clients``/``dim``.
The sides of a shape run back to back, repeats spread over the run (see bench_branch.py,
whose conventions this suite follows).  Inputs are standard normal (never zeros).

Not part of the test suite.  Run through the report::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py --suite similarity [--quick]

or as a smoke check that runs each benchmarked function once::

    python -m pytest benchmarks/bench_similarity.py -p no:cacheprovider --benchmark-disable
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from benchmarks import _common as common
from pfl_kernels.ops import pairwise_cosine, pairwise_sqdist, similarity_weights

CLIENTS = (20, 100) if common.QUICK else (20, 100, 1000)
DIMS = (65_536, 100_000) if common.QUICK else (65_536, 100_000, 1_000_000, 10_000_000)
MAX_INPUT_BYTES = 4 * 10 ** 9
SKIPPED = [(k, d) for k in CLIENTS for d in DIMS if 4 * k * d >= MAX_INPUT_BYTES]
PAIR_SHAPES = [(k, d) for k in CLIENTS for d in DIMS if (k, d) not in SKIPPED]
WEIGHT_CLIENTS = (100, 1000) if common.QUICK else (100, 1000, 10_000)
BF16_SHAPES = [(20, 65_536)] if common.QUICK else [(100, 1_000_000), (1000, 65_536)]
TAU, SCALE, MIN_KEEP = 0.9, 20.0, 4  # Factorized-FL's domain setting has tau 0.95, eps 20, 4 kept

# Calls last from ~1 ms (K = 20, D = 65536) to seconds (K = 1000, D = 10^5): pytest-benchmark
# gives the slow ones min_rounds (3).
pytestmark = common.benchmark_mark(max_time=1.0, quick_max_time=0.3)

CASES = {
    "cosine": (("ours", "fused"), ("baseline", "normalize_mm"), ("floor", "mm")),
    "sqdist": (("ours", "fused"), ("baseline", "cdist_sq"), ("floor", "mm")),
    "weights": (("ours", "fused"), ("baseline", "eager")),
    "cosine-bf16": (("ours", "fused"), ("baseline", "normalize_mm"), ("floor", "mm")),
}


def _params(case: str):
    shapes = {"weights": [(k, k) for k in WEIGHT_CLIENTS], "cosine-bf16": BF16_SHAPES}.get(case, PAIR_SHAPES)
    return [pytest.param(k, d, side, impl, repeat, id=f"K{k}-D{d}-r{repeat}-{impl}" if case != "weights"
                         else f"K{k}-r{repeat}-{impl}")
            for repeat in range(common.REPEATS) for k, d in shapes for side, impl in CASES[case]]


def _run(benchmark, case: str, fn: Callable[[], object], k: int, d: int):
    """Benchmark ``fn`` under the group ``case/shape``, labelled for ``benchmarks/report.py``."""
    shape = f"K{k}" if case == "weights" else f"K{k}-D{d}"
    benchmark.group = f"{case}/{shape}"
    benchmark.extra_info.update(case=case, shape=shape, weight_shape=[k, d], side=benchmark.params["side"],
                                impl=benchmark.params["impl"], repeat=benchmark.params["repeat"],
                                clients=k, dim=d)
    if case != "weights":
        benchmark.extra_info["flops"] = 2 * k * k * d
    return benchmark(fn)


def _rows(k: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(k, d, generator=torch.Generator().manual_seed(seed))


def _pair_fn(case: str, impl: str, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    if impl == "mm":
        return lambda: torch.mm(x, x.t())
    if case.startswith("cosine"):
        if impl == "fused":
            return lambda: pairwise_cosine(x)

        def normalize_mm():
            xn = F.normalize(x.float(), dim=1)  # bfloat16 x: float32, as the op accumulates
            return xn @ xn.t()
        return normalize_mm
    if impl == "fused":
        return lambda: pairwise_sqdist(x)
    return lambda: torch.cdist(x, x) ** 2


@pytest.mark.parametrize("k, d, side, impl, repeat", _params("cosine"))
def test_cosine(benchmark, k: int, d: int, side: str, impl: str, repeat: int):
    """Every client's cosine with every client: the fused op, normalize + mm, and mm alone."""
    x = _rows(k, d)
    out = _run(benchmark, "cosine", _pair_fn("cosine", impl, x), k, d)
    assert tuple(out.shape) == (k, k)


@pytest.mark.parametrize("k, d, side, impl, repeat", _params("cosine-bf16"))
def test_cosine_bf16(benchmark, k: int, d: int, side: str, impl: str, repeat: int):
    """bfloat16 x: the fused op (float32 accumulation), normalize + mm in float32, mm in bfloat16."""
    x = _rows(k, d).bfloat16()
    out = _run(benchmark, "cosine-bf16", _pair_fn("cosine-bf16", impl, x), k, d)
    assert out.shape == (k, k)


@pytest.mark.parametrize("k, d, side, impl, repeat", _params("sqdist"))
def test_sqdist(benchmark, k: int, d: int, side: str, impl: str, repeat: int):
    """Every pair's squared distance: the fused op, cdist squared, and mm alone."""
    x = _rows(k, d)
    out = _run(benchmark, "sqdist", _pair_fn("sqdist", impl, x), k, d)
    assert tuple(out.shape) == (k, k)


def eager_weights(sim: torch.Tensor, tau: float, scale: float, min_keep: int) -> torch.Tensor:
    """The rule as research code writes it in torch: own entry 1, topk, threshold, masked softmax."""
    v = sim.clone()
    v.fill_diagonal_(1.0)
    kept = v >= tau
    kept.scatter_(1, v.topk(min(min_keep, v.shape[1]), dim=1).indices, True)  # the own entry is the max
    return torch.softmax((scale * v).masked_fill(~kept, float("-inf")), dim=1)


@pytest.mark.parametrize("k, d, side, impl, repeat", _params("weights"))
def test_weights(benchmark, k: int, d: int, side: str, impl: str, repeat: int):
    """Factorized-FL's matching rule on a [K, K] similarity matrix: the fused op and eager torch."""
    sim = torch.rand(k, k, generator=torch.Generator().manual_seed(1)) * 2 - 1
    if impl == "fused":
        def fn():
            return similarity_weights(sim, tau=TAU, scale=SCALE, min_keep=MIN_KEEP)
    else:
        def fn():
            return eager_weights(sim, TAU, SCALE, MIN_KEEP)
    w = _run(benchmark, "weights", fn, k, d)
    assert tuple(w.shape) == (k, k)

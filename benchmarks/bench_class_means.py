"""CPU benchmark of ``pfl::class_means`` (Fed-CMA's class-conditional means) against its floor
and eager PyTorch.

One case, ``class_means``: means [C, D] and counts [C] of N float32 feature vectors of size
D with labels in [0, C), at N ∈ {10^4, 10^5}, D ∈ {256, 512}, C ∈ {10, 100}.

Sides.
* ours: ``torch.ops.pfl.class_means(features, labels, C)`` (the C++ kernel when built).
* baseline: the eager composition: ``torch.zeros(C, D).index_add_(0, labels, features)``,
  ``torch.bincount(labels, minlength=C)`` and the division by the counts.
* floor: the op reads N·D features (and N labels) and writes C·D means: bound by memory.
  The floor is ``dst.copy_(src)`` of N·D float32 elements (preallocated), the issue's
  definition: a copy of the features.

Inputs: features standard normal, labels uniform in [0, C).  Labels in ``extra_info``: case,
shape, weight_shape [N, D, C], samples, dim, classes, side, impl, repeat, traffic_bytes.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py --suite class_means [--quick]
    python -m pytest benchmarks/bench_class_means.py -p no:cacheprovider --benchmark-disable

A second case, ``class_means-bf16``: bfloat16 features (float32 means) at N = 10^5 (quick:
10^4), D in {256, 512}, C = 10, against the eager composition on the features upcast to
float32 and the copy of the bfloat16 features (the same 1.5x target).

``PFL_BENCH_QUICK=1``: N = 10^4 only, one repeat.
"""
from __future__ import annotations

import pytest
import torch

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from benchmarks import _common as common
from benchmarks._common import Shape

SAMPLES = (10 ** 4,) if common.QUICK else (10 ** 4, 10 ** 5)
DIMS = (256, 512)
CLASSES = (10, 100)
SHAPES = [Shape(f"N{'1e4' if n == 10 ** 4 else '1e5'}-D{d}-C{c}", (n, d, c))
          for n in SAMPLES for d in DIMS for c in CLASSES]
BF16_SHAPES = [Shape(f"N{'1e4' if common.QUICK else '1e5'}-D{d}-C10", (10 ** 4 if common.QUICK else 10 ** 5, d, 10))
               for d in DIMS]
SIDES = (("ours", "fused"), ("baseline", "eager-index_add"), ("floor", "copy"))

pytestmark = common.benchmark_mark(max_time=0.3, quick_max_time=0.1)


def _eager(features, labels, c):
    features = features.float() if features.dtype == torch.bfloat16 else features  # float32 sums, as the op
    sums = torch.zeros(c, features.shape[1], dtype=features.dtype).index_add_(0, labels, features)
    counts = torch.bincount(labels, minlength=c)
    return sums / counts.clamp_min(1)[:, None].to(features.dtype), counts


def _measure(benchmark, case: str, shape: Shape, impl: str, dtype: torch.dtype):
    n, d, c = shape.weight
    gen = torch.Generator().manual_seed(0)
    elem = torch.empty((), dtype=dtype).element_size()
    if impl == "copy":
        src = torch.randn(n * d, generator=gen).to(dtype)
        dst = torch.empty_like(src)

        def fn():
            return dst.copy_(src), None
    else:
        features = torch.randn(n, d, generator=gen).to(dtype)
        labels = torch.randint(0, c, (n,), generator=gen)
        if impl == "fused":
            def fn():
                return torch.ops.pfl.class_means(features, labels, c)
        else:
            def fn():
                return _eager(features, labels, c)
    means, _ = common.run(benchmark, case, fn, {"samples": n, "dim": d, "classes": c},
                          {"traffic_bytes": elem * n * d + 4 * c * d + 8 * n})
    if impl != "copy":
        assert tuple(means.shape) == (c, d) and means.dtype == torch.float32


@pytest.mark.parametrize("shape, side, impl, repeat",
                         [pytest.param(s, side, impl, r, id=f"{s.name}-r{r}-{impl}")
                          for r in range(common.REPEATS) for s in SHAPES for side, impl in SIDES])
def test_class_means(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    _measure(benchmark, "class_means", shape, impl, torch.float32)


@pytest.mark.parametrize("shape, side, impl, repeat",
                         [pytest.param(s, side, impl, r, id=f"{s.name}-r{r}-{impl}")
                          for r in range(common.REPEATS) for s in BF16_SHAPES for side, impl in SIDES])
def test_class_means_bf16(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    _measure(benchmark, "class_means-bf16", shape, impl, torch.bfloat16)

"""CPU benchmarks of the multi-branch ops and layers (pFedMB) against their floor and PyTorch.

Three cases, at the ResNet-9 and LeNet-5 weight shapes of ``SHAPES``:

* ``combine_forward``, for B in ``BRANCHES``: the fused op ``torch.ops.pfl.branch_combine``
  (W = sum_b alpha_b W_b) against the eager composition
  ``torch.einsum('b,bn->n', alpha, weights.reshape(B, -1)).reshape(shape)`` and against its
  memory-traffic floor (below).
* ``combine_backward``, for B in ``BRANCHES``: ``torch.ops.pfl.branch_combine_backward``
  (the grads of the branches and of alpha in one call) against eager autograd through the
  einsum, and against its floor.
* ``layer_train_step``, at B = ``LAYER_BRANCHES`` only: forward + backward of
  ``MultiBranchConv2d`` / ``MultiBranchLinear`` against ``nn.Conv2d`` / ``nn.Linear`` of the
  same shape, batch 32, 32x32 inputs.

The floor.  The combination does no arithmetic to speak of: it is bound by memory traffic,
so its floor is the time of moving its minimum traffic with a plain copy.  In float32
elements, with N the size of one weight::

    forward:  reads B*N (branches) + B (alpha), writes N (W)                   = (B+1)*N + B
    backward: reads N (grad_W) + B*N (branches) + B (alpha),
              writes B*N (grad of the branches) + B (grad of alpha)           = (2B+1)*N + 2B

The floor of a case is ``dst.copy_(src)`` between two preallocated float32 tensors of
M = ceil(traffic / 2) elements each: it reads M and writes M, so it moves the same number of
bytes, and its working set (src + dst) is the op's (inputs + outputs), so both see the same
level of the cache hierarchy.  The construction is the same for every shape and B.  It is
strict in two ways: the copy allocates nothing (the op allocates its outputs), and it is a
single stream per direction (the op reads B + 1 streams).  ratio fused / floor = 1 would mean
the op moves its bytes as fast as a copy does.

Every test benchmarks one function; ``benchmark.extra_info`` names the case, the shape, B and
the side ('ours', 'baseline' or 'floor'), which ``benchmarks/report.py`` uses to group them.
The sides of a (shape, B) run back to back (ours, baseline, floor), and in full mode each
group is measured ``REPEATS`` times (``benchmarks/_common.py``), spread over the run: the
report takes each side's median over its repeats (see bench_factorized.py, whose conventions
this suite follows).

Inputs are random, never zeros: weights and grad_W standard normal, alpha a random point in
the interior of the simplex (normalized exponential draws: uniform on the simplex).

Not part of the test suite (pyproject's testpaths is ``tests``).  Run through the report::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py --suite branch [--quick]

or as a smoke check that runs each benchmarked function once::

    python -m pytest benchmarks/bench_branch.py -p no:cacheprovider --benchmark-disable

``PFL_BENCH_QUICK=1`` shortens the run (same shapes and B; one repeat of fewer rounds).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from benchmarks import _common as common
from benchmarks._common import SHAPES, Shape
from pfl_kernels.nn import MultiBranchConv2d, MultiBranchLinear

BRANCHES = (2, 5, 10)
LAYER_BRANCHES = 5

# As in bench_factorized.py (see ``common.benchmark_mark``), but the op cases are many short
# measurements (9 shapes x 3 B x 3 sides), hence a shorter max_time than the layer steps
# get (``common.LAYER_BENCHMARK``): even at 0.2 s the slowest op (~1 ms) gets ~200 rounds.
pytestmark = common.benchmark_mark(max_time=0.2, quick_max_time=0.08)
LAYER_BENCHMARK = common.LAYER_BENCHMARK

# case -> (side, implementation) for every side, in the order they run inside a group.
CASES = {
    "combine_forward": (("ours", "fused"), ("baseline", "eager"), ("floor", "copy")),
    "combine_backward": (("ours", "fused"), ("baseline", "eager"), ("floor", "copy")),
    "layer_train_step": (("ours", "multibranch"), ("baseline", "dense")),
}


def min_traffic(case: str, n: int, branches: int) -> int:
    """The op's minimum memory traffic in float32 elements (read + written); see the docstring."""
    if case == "combine_forward":
        return (branches + 1) * n + branches
    if case == "combine_backward":
        return (2 * branches + 1) * n + 2 * branches
    raise ValueError(f"no floor for case {case!r}")


def _params(case: str):
    branch_counts = (LAYER_BRANCHES,) if case == "layer_train_step" else BRANCHES
    return common.params(SHAPES, CASES[case], branch_counts)


def _run(benchmark, case: str, fn: Callable[[], object]):
    """Benchmark ``fn`` under the group ``case/shape/B``, labelled for the report to group."""
    shape: Shape = benchmark.params["shape"]
    branches: int = benchmark.params["branches"]
    extra = {}
    if case in ("combine_forward", "combine_backward"):
        extra["traffic_bytes"] = 4 * min_traffic(case, shape.numel, branches)
    return common.run(benchmark, case, fn, {"layer": "linear" if shape.is_linear else "conv",
                                            "branches": branches}, extra)


def _branches(shape: Shape, branches: int, *, requires_grad: bool = False, seed: int = 0):
    """Random weights [B, *shape] and alpha [B] in the interior of the simplex."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(branches, *shape.weight, generator=gen)
    draws = torch.empty(branches).exponential_(generator=gen)
    alpha = draws / draws.sum()
    assert bool((alpha > 0).all()), "alpha must be in the interior of the simplex"
    return weights.requires_grad_(requires_grad), alpha.requires_grad_(requires_grad)


def _eager_combine(weights: torch.Tensor, alpha: torch.Tensor, shape: Shape) -> torch.Tensor:
    return torch.einsum("b,bn->n", alpha, weights.reshape(alpha.shape[0], -1)).reshape(shape.weight)


def _floor_copy(case: str, shape: Shape, branches: int) -> Callable[[], torch.Tensor]:
    """``dst.copy_(src)`` moving the op's minimum traffic (M read + M written, preallocated)."""
    elements = -(-min_traffic(case, shape.numel, branches) // 2)
    src = torch.randn(elements, generator=torch.Generator().manual_seed(3))
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


@pytest.mark.parametrize("shape, branches, side, impl, repeat", _params("combine_forward"))
def test_combine_forward(benchmark, shape: Shape, branches: int, side: str, impl: str, repeat: int):
    """W = sum_b alpha_b W_b: the fused op against the eager einsum and the copy floor.

    Nothing requires grad, so the op alone is timed; autograd is in ``layer_train_step``.
    """
    if impl == "copy":
        fn = _floor_copy("combine_forward", shape, branches)
    else:
        weights, alpha = _branches(shape, branches)
        if impl == "fused":
            def fn():
                return torch.ops.pfl.branch_combine(weights, alpha)
        else:
            def fn():
                return _eager_combine(weights, alpha, shape)
    w = _run(benchmark, "combine_forward", fn)
    if impl != "copy":
        assert tuple(w.shape) == shape.weight


@pytest.mark.parametrize("shape, branches, side, impl, repeat", _params("combine_backward"))
def test_combine_backward(benchmark, shape: Shape, branches: int, side: str, impl: str, repeat: int):
    """Grads of the branches and of alpha from grad_W: the fused op, eager autograd, the floor.

    The eager forward graph is built once, outside the timed region, and kept with
    ``retain_graph=True``, so only the backward pass is timed.
    """
    if impl == "copy":
        fn = _floor_copy("combine_backward", shape, branches)
    else:
        weights, alpha = _branches(shape, branches, requires_grad=(impl == "eager"))
        grad_w = torch.randn(shape.weight, generator=torch.Generator().manual_seed(1))
        if impl == "fused":
            def fn():
                return torch.ops.pfl.branch_combine_backward(grad_w, weights, alpha, [True, True])
        else:
            w = _eager_combine(weights, alpha, shape)

            def fn():
                return torch.autograd.grad(w, [weights, alpha], grad_w, retain_graph=True)
    grads = _run(benchmark, "combine_backward", fn)
    if impl != "copy":
        assert [tuple(g.shape) for g in grads] == [(branches, *shape.weight), (branches,)]


@LAYER_BENCHMARK
@pytest.mark.parametrize("shape, branches, side, impl, repeat", _params("layer_train_step"))
def test_layer_train_step(benchmark, shape: Shape, branches: int, side: str, impl: str, repeat: int):
    """One training step of the layer (``common.train_step``, as in bench_factorized.py):
    forward, then backward from a fixed random grad.  Random parameters, alpha's logits too
    (they start at zero); the grads are those of the branches and alpha's logits (the dense
    weight's on the baseline side).
    """
    layer = common.make_layer(shape, impl, MultiBranchLinear, MultiBranchConv2d, branches=branches)
    grads = _run(benchmark, "layer_train_step", common.train_step(layer, shape))
    assert len(grads) == (1 if impl == "dense" else 2)

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
group is measured ``REPEATS`` times, spread over the run: the report takes each side's median
over its repeats (see bench_factorized.py, whose conventions this suite follows).

Inputs are random, never zeros: weights and grad_W standard normal, alpha a random point in
the interior of the simplex (normalized exponential draws: uniform on the simplex).

Not part of the test suite (pyproject's testpaths is ``tests``).  Run through the report::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py --suite branch [--quick]

or as a smoke check that runs each benchmarked function once::

    python -m pytest benchmarks/bench_branch.py -p no:cacheprovider --benchmark-disable

``PFL_BENCH_QUICK=1`` shortens the run (same shapes and B; one repeat of fewer rounds).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from pfl_kernels.nn import MultiBranchConv2d, MultiBranchLinear

QUICK = os.environ.get("PFL_BENCH_QUICK", "") not in ("", "0")

BATCH = 32
IMAGE_SIZE = 32
BRANCHES = (2, 5, 10)
LAYER_BRANCHES = 5
REPEATS = 1 if QUICK else 3

# As in bench_factorized.py: pytest-benchmark calibrates the iterations per round (each
# round >= min_time) and runs rounds until max_time, at least min_rounds; its untimed
# calibration calls warm each function up.  The op cases are many short measurements
# (9 shapes x 3 B x 3 sides), hence a shorter max_time than the layer steps get: even
# at 0.2 s the slowest op (~1 ms) gets ~200 rounds.
pytestmark = pytest.mark.benchmark(
    min_rounds=3,
    max_time=0.08 if QUICK else 0.2,
    min_time=1e-4 if QUICK else 2e-4,
    warmup=False,
)
LAYER_BENCHMARK = pytest.mark.benchmark(
    min_rounds=3,
    max_time=0.25 if QUICK else 0.5,
    min_time=1e-4 if QUICK else 2e-4,
    warmup=False,
)


@dataclass(frozen=True)
class Shape:
    """A layer of the benchmarked networks: its weight shape and how it is applied."""

    name: str
    weight: tuple[int, ...]  # [O, I, kh, kw] for a conv, [out_features, in_features] for a linear
    stride: int = 1
    padding: int = 0

    @property
    def is_linear(self) -> bool:
        return len(self.weight) == 2

    @property
    def numel(self) -> int:
        return math.prod(self.weight)


SHAPES = [
    # ResNet-9: the k5 layer has stride 2 and padding 2, the k3 layers padding 1.
    Shape("resnet9-conv64-128k5", (128, 64, 5, 5), stride=2, padding=2),
    Shape("resnet9-conv128-128k3", (128, 128, 3, 3), padding=1),
    Shape("resnet9-conv128-256k3", (256, 128, 3, 3), padding=1),
    Shape("resnet9-conv256-256k3", (256, 256, 3, 3), padding=1),
    # LeNet-5 (pFedMB's CNN): unpadded k5 convs, then the fully connected layers.
    Shape("lenet5-conv3-6k5", (6, 3, 5, 5)),
    Shape("lenet5-conv6-16k5", (16, 6, 5, 5)),
    Shape("lenet5-fc400-120", (120, 400)),
    Shape("lenet5-fc120-84", (84, 120)),
    Shape("lenet5-fc84-10", (10, 84)),
]

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
    # Repeats are the outer loop, which spreads a group's repeats over the whole case; the
    # sides are the inner one, so the sides of a group run back to back.
    return [pytest.param(shape, branches, side, impl, repeat,
                         id=f"{shape.name}-B{branches}-r{repeat}-{impl}")
            for repeat in range(REPEATS) for shape in SHAPES for branches in branch_counts
            for side, impl in CASES[case]]


def _run(benchmark, case: str, fn: Callable[[], object]):
    """Benchmark ``fn`` under the group ``case/shape/B``, labelled for the report to group."""
    shape: Shape = benchmark.params["shape"]
    branches: int = benchmark.params["branches"]
    benchmark.group = f"{case}/{shape.name}/B{branches}"
    benchmark.extra_info.update(case=case, shape=shape.name, weight_shape=list(shape.weight),
                                layer="linear" if shape.is_linear else "conv",
                                branches=branches, side=benchmark.params["side"],
                                impl=benchmark.params["impl"], repeat=benchmark.params["repeat"])
    if case in ("combine_forward", "combine_backward"):
        benchmark.extra_info["traffic_bytes"] = 4 * min_traffic(case, shape.numel, branches)
    return benchmark(fn)


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


def _make_layer(shape: Shape, branches: int, impl: str) -> nn.Module:
    """The layer of ``shape`` with random parameters (alpha's logits too: they start at zero).

    No bias on either side (ResNet-9's convs have none; for the others it costs the same on
    both sides, so leaving it out only makes the ratio stricter).
    """
    torch.manual_seed(0)
    if shape.is_linear:
        out_f, in_f = shape.weight
        if impl == "dense":
            return nn.Linear(in_f, out_f, bias=False)
        layer = MultiBranchLinear(in_f, out_f, bias=False, branches=branches)
    else:
        out_c, in_c, kh, kw = shape.weight
        args = (in_c, out_c, (kh, kw), shape.stride, shape.padding)
        if impl == "dense":
            return nn.Conv2d(*args, bias=False)
        layer = MultiBranchConv2d(*args, bias=False, branches=branches)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


@LAYER_BENCHMARK
@pytest.mark.parametrize("shape, branches, side, impl, repeat", _params("layer_train_step"))
def test_layer_train_step(benchmark, shape: Shape, branches: int, side: str, impl: str, repeat: int):
    """One training step of the layer: forward, then backward from a fixed random grad.

    As in bench_factorized.py: ``torch.autograd.grad`` returns the parameter grads (the
    branches and alpha's logits; the dense weight) without accumulating them, and the input
    does not require grad (the layer's own cost, the stricter ratio).
    """
    layer = _make_layer(shape, branches, impl)
    params = list(layer.parameters())
    gen = torch.Generator().manual_seed(2)
    if shape.is_linear:
        x = torch.randn(BATCH, shape.weight[1], generator=gen)
        out_shape = (BATCH, shape.weight[0])
    else:
        x = torch.randn(BATCH, shape.weight[1], IMAGE_SIZE, IMAGE_SIZE, generator=gen)
        out_size = [(IMAGE_SIZE + 2 * shape.padding - k) // shape.stride + 1 for k in shape.weight[2:]]
        out_shape = (BATCH, shape.weight[0], *out_size)
    grad_out = torch.randn(out_shape, generator=gen)

    def fn():
        return torch.autograd.grad(layer(x), params, grad_out)

    grads = _run(benchmark, "layer_train_step", fn)
    assert len(grads) == (1 if impl == "dense" else 2)

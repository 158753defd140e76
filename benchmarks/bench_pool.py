"""CPU benchmark of ``pfl::relu_max_pool2d`` (ReLU + 2x2 max pool in one op) against the pair
of ops it replaces.

One case, ``relu_max_pool``: forward and backward of ReLU then a 2x2 max pool over a batch of
64 channels-last float32 maps, the layout the engine trains convolutions in.  The shapes are
LeNet-5's two pools (6x28x28 and 16x10x10) and a wider map (32x8x8).

Sides (the same input, the same incoming gradient, the gradient of the input computed).
* ours: ``pfl_kernels.ops.relu_max_pool2d(x)`` (the C++ kernel when built).
* baseline: ``F.max_pool2d(F.relu(x), 2)``, as CNNs write the pair.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py --suite pool [--quick]

``PFL_BENCH_QUICK=1``: one repeat.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from benchmarks import _common as common
from benchmarks._common import Shape
from pfl_kernels.ops import relu_max_pool2d

SHAPES = [Shape("lenet5-pool1-64x6x28x28", (64, 6, 28, 28)), Shape("lenet5-pool2-64x16x10x10", (64, 16, 10, 10)),
          Shape("64x32x8x8", (64, 32, 8, 8))]
SIDES = (("ours", "fused"), ("baseline", "relu-max_pool2d"))

pytestmark = common.benchmark_mark(max_time=0.3, quick_max_time=0.1)


def _pair(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(F.relu(x), 2)


@pytest.mark.parametrize("shape, side, impl, repeat", common.params(SHAPES, SIDES))
def test_relu_max_pool(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    n, c, h, w = shape.weight
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=gen).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(n, c, h // 2, w // 2, generator=gen).contiguous(memory_format=torch.channels_last)
    op = relu_max_pool2d if impl == "fused" else _pair

    def fn():
        leaf = x.detach().requires_grad_()
        (grad_x,) = torch.autograd.grad(op(leaf), leaf, grad)
        return grad_x

    grad_x = common.run(benchmark, "relu_max_pool", fn, {"maps": c, "size": h})
    assert grad_x.shape == x.shape

"""CPU benchmarks of the factorized-weight ops and layers against the PyTorch they replace.

Three cases, each at the ResNet-9 and LeNet-5 weight shapes of ``SHAPES``:

* ``reconstruct_forward``: the fused op ``torch.ops.pfl.factorized_weight`` against the
  eager composition it replaces (``pfl_kernels.reference.factorized.factorized_weight``:
  matmul, add of mu * mask, reshape/transpose, contiguous).  ratio = eager / fused.
* ``reconstruct_backward``: ``torch.ops.pfl.factorized_weight_backward`` (grads of u, v, mu)
  against eager autograd through that composition.  ratio = eager / fused.
* ``layer_train_step``: forward + backward of ``FactorizedConv2d`` / ``FactorizedLinear``
  (rank 1, with mu) against ``nn.Conv2d`` / ``nn.Linear`` of the same shape, batch 32,
  32x32 inputs.  ratio = factorized / dense (a cost, so lower is better).

Every test benchmarks one function; ``benchmark.extra_info`` names the case, the shape and
the side ('ours' or 'baseline'), which ``benchmarks/report.py`` uses to pair them.  The
pairs run back to back (ours, then baseline), and in full mode each pair is measured
``REPEATS`` times, spread over the run: the report takes each side's median over its
repeats, so a burst of load from elsewhere on a shared machine spoils one repeat, not
one side of the comparison (and prints the per-repeat ratios, to show the spread).

Not part of the test suite (pyproject's testpaths is ``tests``).  Run through the report::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py [--quick]

or as a smoke check that runs each benchmarked function once::

    python -m pytest benchmarks/bench_factorized.py -p no:cacheprovider --benchmark-disable

``PFL_BENCH_QUICK=1`` shortens the run (same shapes; one repeat of fewer rounds).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from pfl_kernels._layout import layout_geometry
from pfl_kernels.nn import FactorizedConv2d, FactorizedLinear
from pfl_kernels.reference import factorized as ref

QUICK = os.environ.get("PFL_BENCH_QUICK", "") not in ("", "0")

BATCH = 32
IMAGE_SIZE = 32
RANK = 1
REPEATS = 1 if QUICK else 3

# pytest-benchmark picks the iterations per round (each round lasts >= min_time, which
# keeps microsecond-scale ops above the timer's noise) and runs rounds until max_time,
# but at least min_rounds: the slowest layer step (~0.4 s on 2 cores) gets min_rounds.
# Its calibration calls are untimed and warm up each function (first-call allocations,
# oneDNN primitive creation), so no separate warm-up phase: it would only add calls
# of the slow layer steps.
pytestmark = pytest.mark.benchmark(
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
    def layout(self) -> str:
        return "linear" if self.is_linear else "spatial"


SHAPES = [
    # ResNet-9: the k5 layer has stride 2 and padding 2, the k3 layers padding 1.
    Shape("resnet9-conv64-128k5", (128, 64, 5, 5), stride=2, padding=2),
    Shape("resnet9-conv128-128k3", (128, 128, 3, 3), padding=1),
    Shape("resnet9-conv128-256k3", (256, 128, 3, 3), padding=1),
    Shape("resnet9-conv256-256k3", (256, 256, 3, 3), padding=1),
    # LeNet-5: unpadded k5 convs, then the fully connected layers.
    Shape("lenet5-conv3-6k5", (6, 3, 5, 5)),
    Shape("lenet5-conv6-16k5", (16, 6, 5, 5)),
    Shape("lenet5-fc400-120", (120, 400)),
    Shape("lenet5-fc120-84", (84, 120)),
]

# case -> (side, implementation) for both sides; 'ours' first, and the parametrization
# below keeps that order inside each (repeat, shape), so each pair runs back to back.
# Repeats are the outer loop, which spreads a pair's repeats over the whole case.
CASES = {
    "reconstruct_forward": (("ours", "fused"), ("baseline", "eager")),
    "reconstruct_backward": (("ours", "fused"), ("baseline", "eager")),
    "layer_train_step": (("ours", "factorized"), ("baseline", "dense")),
}


def _params(case: str):
    return [pytest.param(shape, side, impl, repeat, id=f"{shape.name}-r{repeat}-{impl}")
            for repeat in range(REPEATS) for shape in SHAPES for side, impl in CASES[case]]


def _run(benchmark, case: str, fn: Callable[[], object]):
    """Benchmark ``fn`` under the group ``case/shape``, labelled for the report to pair."""
    shape: Shape = benchmark.params["shape"]
    benchmark.group = f"{case}/{shape.name}"
    benchmark.extra_info.update(case=case, shape=shape.name, weight_shape=list(shape.weight),
                                layout=shape.layout, side=benchmark.params["side"],
                                impl=benchmark.params["impl"], repeat=benchmark.params["repeat"])
    return benchmark(fn)


def _factors(shape: Shape, *, requires_grad: bool = False, seed: int = 0):
    """Random u [R, r], v [r, C], mu [R, C] and a random 0/1 float mask [R, C] for ``shape``."""
    rows, cols, _, _ = layout_geometry(shape.weight, shape.layout)
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(rows, RANK, generator=gen)
    v = torch.randn(RANK, cols, generator=gen)
    mu = torch.randn(rows, cols, generator=gen)
    mask = (torch.rand(rows, cols, generator=gen) < 0.5).float()
    for t in (u, v, mu):
        t.requires_grad_(requires_grad)
    return u, v, mu, mask


@pytest.mark.parametrize("shape, side, impl, repeat", _params("reconstruct_forward"))
def test_reconstruct_forward(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    """W = place(u @ v + mu * mask): one fused op against the eager composition.

    The factors do not require grad, so both sides time the reconstruction alone; the
    autograd bookkeeping around it is part of ``layer_train_step``.
    """
    u, v, mu, mask = _factors(shape)
    kwargs = {"shape": list(shape.weight), "layout": shape.layout}
    if impl == "fused":
        def fn():
            return torch.ops.pfl.factorized_weight(u, v, mu, mask, **kwargs)
    else:
        def fn():
            return ref.factorized_weight(u, v, mu, mask, **kwargs)
    w = _run(benchmark, "reconstruct_forward", fn)
    assert tuple(w.shape) == shape.weight


@pytest.mark.parametrize("shape, side, impl, repeat", _params("reconstruct_backward"))
def test_reconstruct_backward(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    """Gradients of u, v and mu from grad_W: the fused backward op against eager autograd.

    The eager forward graph is built once, outside the timed region, and kept with
    ``retain_graph=True``, so only the backward pass is timed on both sides.
    """
    u, v, mu, mask = _factors(shape, requires_grad=(impl == "eager"))
    grad_w = torch.randn(shape.weight, generator=torch.Generator().manual_seed(1))
    kwargs = {"shape": list(shape.weight), "layout": shape.layout}
    if impl == "fused":
        def fn():
            return torch.ops.pfl.factorized_weight_backward(
                grad_w, u, v, mu, mask, output_mask=[True, True, True, False], **kwargs)
    else:
        w = ref.factorized_weight(u, v, mu, mask, **kwargs)

        def fn():
            return torch.autograd.grad(w, [u, v, mu], grad_w, retain_graph=True)
    grads = _run(benchmark, "reconstruct_backward", fn)
    assert [tuple(g.shape) for g in grads[:3]] == [tuple(u.shape), tuple(v.shape), tuple(mu.shape)]


def _make_layer(shape: Shape, impl: str) -> nn.Module:
    """The layer of ``shape`` with random parameters (mu too: the layers start it at zero).

    No bias on either side (ResNet-9 convs have none; for the others it costs the same on
    both sides, so leaving it out only makes the ratio stricter).
    """
    torch.manual_seed(0)
    if shape.is_linear:
        out_f, in_f = shape.weight
        if impl == "dense":
            return nn.Linear(in_f, out_f, bias=False)
        layer = FactorizedLinear(in_f, out_f, bias=False, rank=RANK)
    else:
        out_c, in_c, kh, kw = shape.weight
        args = (in_c, out_c, (kh, kw), shape.stride, shape.padding)
        if impl == "dense":
            return nn.Conv2d(*args, bias=False)
        layer = FactorizedConv2d(*args, bias=False, rank=RANK)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


@pytest.mark.parametrize("shape, side, impl, repeat", _params("layer_train_step"))
def test_layer_train_step(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    """One training step of the layer: forward, then backward from a fixed random grad.

    ``torch.autograd.grad`` returns the parameter grads without accumulating them in
    ``.grad`` (like a step after ``zero_grad(set_to_none=True)``).  The input does not
    require grad: the layer's own cost without the input gradient, the stricter ratio.
    """
    layer = _make_layer(shape, impl)
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
    assert len(grads) == (1 if impl == "dense" else 3)

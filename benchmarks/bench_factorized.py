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
``REPEATS`` times (``benchmarks/_common.py``), spread over the run: the report takes each
side's median over its repeats, so a burst of load from elsewhere on a shared machine spoils
one repeat, not one side of the comparison (and prints the per-repeat ratios, to show the
spread).

Not part of the test suite (pyproject's testpaths is ``tests``).  Run through the report::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/report.py [--quick]

or as a smoke check that runs each benchmarked function once::

    python -m pytest benchmarks/bench_factorized.py -p no:cacheprovider --benchmark-disable

``PFL_BENCH_QUICK=1`` shortens the run (same shapes; one repeat of fewer rounds).
"""
from __future__ import annotations

import pytest
import torch

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from benchmarks import _common as common
from benchmarks._common import Shape
from pfl_kernels._layout import layout_geometry
from pfl_kernels.nn import FactorizedConv2d, FactorizedLinear
from pfl_kernels.reference import factorized as ref

RANK = 1

# Every case gets the layer steps' timing settings (see ``benchmarks/_common.py``).
pytestmark = common.LAYER_BENCHMARK

# The shared shapes but LeNet-5's last layer (10 outputs), which this suite does not measure.
SHAPES = [shape for shape in common.SHAPES if shape.name != "lenet5-fc84-10"]

# case -> (side, implementation) for both sides; 'ours' first, and the parametrization
# keeps that order inside each (repeat, shape), so each pair runs back to back.
# Repeats are the outer loop, which spreads a pair's repeats over the whole case.
CASES = {
    "reconstruct_forward": (("ours", "fused"), ("baseline", "eager")),
    "reconstruct_backward": (("ours", "fused"), ("baseline", "eager")),
    "layer_train_step": (("ours", "factorized"), ("baseline", "dense")),
}


def _params(case: str):
    return common.params(SHAPES, CASES[case])


def _run(benchmark, case: str, fn):
    """Benchmark ``fn`` under the group ``case/shape``, labelled for the report to pair."""
    return common.run(benchmark, case, fn, {"layout": benchmark.params["shape"].layout})


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


@pytest.mark.parametrize("shape, side, impl, repeat", _params("layer_train_step"))
def test_layer_train_step(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    """One training step of the layer (``common.train_step``): forward, then backward from a
    fixed random grad.  Random parameters, mu too (the layers start it at zero).
    """
    layer = common.make_layer(shape, impl, FactorizedLinear, FactorizedConv2d, rank=RANK)
    grads = _run(benchmark, "layer_train_step", common.train_step(layer, shape))
    assert len(grads) == (1 if impl == "dense" else 3)

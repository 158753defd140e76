"""Hessian-vector products through the drop-in layers against central finite differences of
the gradient.

Per-FedAvg's Hessian-free variant and MAML-style methods differentiate a gradient again
(``torch.autograd.grad(..., create_graph=True)``).  Through the C++ autograd this gave
numbers 54% (FactorizedConv2d) and 130% (MultiBranchConv2d) off, with only a UserWarning:
the backward ops had no derivative of their own.  Runs on the C++ kernels, on the
reference without the extension, and on the Triton launchers in the interpreter.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.kernels.triton_support import interpreter_only
from tests.nn.layer_cases import LAYERS, make_layer, scalar_loss

EPS = 1e-5  # float64: truncation ~ EPS² and rounding ~ 1e-16 / EPS, both far below the tolerance
RTOL = 1e-6


def gradient(layer, x, create_graph=False):
    params = list(layer.parameters())
    return torch.autograd.grad(scalar_loss(layer(x)), params, create_graph=create_graph)


def hessian_vector_product(layer, x, direction):
    """H·direction by double backward: the gradient of ⟨∇loss, direction⟩."""
    grads = gradient(layer, x, create_graph=True)
    dot = sum((g * d).sum() for g, d in zip(grads, direction))
    return torch.autograd.grad(dot, list(layer.parameters()))


def finite_difference_hvp(layer, x, direction):
    """(∇loss(θ + ε·d) − ∇loss(θ − ε·d)) / 2ε."""
    params = list(layer.parameters())

    def shifted(sign):
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(sign * EPS * d)
        g = gradient(layer, x)
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.sub_(sign * EPS * d)
        return g

    return [(a - b) / (2 * EPS) for a, b in zip(shifted(1), shifted(-1))]


def check_hvp(name):
    layer, x = make_layer(name)
    direction = [torch.randn_like(p) for p in layer.parameters()]
    with warnings.catch_warnings():
        # A right number that comes with "an autograd kernel was not registered" is luck.
        warnings.simplefilter("error", UserWarning)
        got = hessian_vector_product(layer, x, direction)
    want = finite_difference_hvp(layer, x, direction)
    for (pname, _), g, w in zip(layer.named_parameters(), got, want):
        err = float((g - w).norm() / w.norm().clamp_min(1e-30))
        assert err < RTOL, f"{name}: H·v for {pname} is {err:.1e} off the finite difference"


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_hvp_matches_finite_differences(name):
    check_hvp(name)


@pytest.mark.triton_interpret
@interpreter_only
@pytest.mark.parametrize("name", ["FactorizedConv2d-simfed", "FactorizedLinear", "MultiBranchConv2d-softmax",
                                  "MultiBranchLinear"])
def test_hvp_matches_finite_differences_on_the_triton_launchers(name):
    pytest.importorskip("triton")
    from pfl_kernels.triton import launchers_on_cpu

    with launchers_on_cpu():
        check_hvp(name)

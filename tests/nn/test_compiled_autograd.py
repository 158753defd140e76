"""Compiled autograd (torch._dynamo.compiled_autograd) through the drop-in layers gives the
eager gradients: the C++ graph nodes offer it their functional backward, and the Python
registration (without the extension) is an ordinary autograd.Function outside torch.func.
"""
from __future__ import annotations

import pytest
import torch

from tests.nn.layer_cases import make_layer, scalar_loss
from tests.tolerances import assert_close


@pytest.mark.parametrize("name", ["FactorizedConv2d-spatial", "MultiBranchLinear"])
def test_compiled_autograd_matches_eager(name):
    # MultiBranchLinear combines its weight and its bias: two nodes of one kind in one graph.
    layer, x = make_layer(name)
    eager = torch.autograd.grad(scalar_loss(layer(x)), list(layer.parameters()))
    torch._dynamo.reset()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        for _ in range(2):  # the second backward runs the cached graph
            layer.zero_grad(set_to_none=True)
            scalar_loss(layer(x)).backward()
            for (pname, p), e in zip(layer.named_parameters(), eager):
                assert_close(p.grad, e, torch.float64, f"compiled autograd grad of {pname}")

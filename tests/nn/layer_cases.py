"""The drop-in layers as the second-order and torch.func tests use them: small float64
layers with random parameters (mu and alpha too), and the same function written in plain
PyTorch from the parameters (the reference)."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from pfl_kernels.nn import FactorizedConv2d, FactorizedLinear, MultiBranchConv2d, MultiBranchLinear
from pfl_kernels.nn._conv import conv2d_forward
from pfl_kernels.reference import branch as branch_ref
from pfl_kernels.reference import factorized as factorized_ref

F64 = torch.float64

LAYERS = {
    "FactorizedConv2d-spatial": lambda: FactorizedConv2d(3, 4, 3, padding=1, rank=2, dtype=F64),
    "FactorizedConv2d-simfed": lambda: FactorizedConv2d(2, 3, (3, 2), stride=2, rank=2, layout="simfed", dtype=F64),
    "FactorizedConv2d-view": lambda: FactorizedConv2d(2, 4, 2, groups=2, rank=1, layout="view", dtype=F64),
    "FactorizedLinear": lambda: FactorizedLinear(5, 4, rank=2, dtype=F64),
    "MultiBranchConv2d-softmax": lambda: MultiBranchConv2d(3, 4, 3, padding=1, branches=3, dtype=F64),
    "MultiBranchConv2d-project": lambda: MultiBranchConv2d(2, 3, 2, branches=2, simplex="project", dtype=F64),
    "MultiBranchLinear": lambda: MultiBranchLinear(5, 4, branches=3, dtype=F64),
}


def make_layer(name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """The layer ``name`` with random parameters, and a batch of 3 inputs for it."""
    torch.manual_seed(seed)
    layer = LAYERS[name]()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        if getattr(layer, "simplex", None) == "project":
            layer.alpha_param.copy_(torch.softmax(layer.alpha_param, -1))
    if isinstance(layer, (FactorizedLinear, MultiBranchLinear)):
        x = torch.randn(3, layer.in_features, dtype=F64)
    else:
        x = torch.randn(3, layer.in_channels, 5, 4, dtype=F64)
    return layer, x


def reference_forward(layer: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """What ``layer`` computes with ``params``, in plain PyTorch (no pfl op)."""
    if isinstance(layer, (FactorizedConv2d, FactorizedLinear)):
        weight = factorized_ref.factorized_weight(params["u"], params["v"], params.get("mu"),
                                                  shape=layer.weight_shape, layout=layer.layout)
        bias = params.get("bias")
    else:
        alpha = params["alpha_param"]
        if layer.simplex == "softmax":
            alpha = torch.softmax(alpha, -1)
        weight = branch_ref.branch_combine(params["branch_weight"], alpha)
        bias = branch_ref.branch_combine(params["branch_bias"], alpha) if "branch_bias" in params else None
    if isinstance(layer, (FactorizedLinear, MultiBranchLinear)):
        return F.linear(x, weight, bias)
    return conv2d_forward(layer, x, weight, bias)


def scalar_loss(output: torch.Tensor) -> torch.Tensor:
    """A loss whose Hessian in the weight is not constant (tanh), so second order matters."""
    return output.tanh().pow(2).sum()

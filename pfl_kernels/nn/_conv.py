"""What every drop-in Conv2d / Linear replacement shares: the dense layer's arguments and forward."""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..ops._checks import is_positive_int, positive_int

_CONV_STATE = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
               "groups", "padding_mode", "_reversed_padding_repeated_twice")


def adopt_conv2d_arguments(module: nn.Module, in_channels, out_channels, kernel_size, stride, padding,
                           dilation, groups, bias, padding_mode) -> tuple[int, ...]:
    """Validate the arguments as ``nn.Conv2d`` does, copy its state onto ``module``, return the weight shape.

    A Conv2d built on the meta device allocates nothing, and gives the same errors
    (groups, padding strings, padding_mode) and the same derived padding state.  The sizes
    are checked first, naming the argument: nn.Conv2d accepts 0 channels and a 0 kernel, and
    a string for a channel count fails inside its own error message.
    """
    in_channels = positive_int("in_channels", in_channels)
    out_channels = positive_int("out_channels", out_channels)
    sizes = tuple(kernel_size) if isinstance(kernel_size, (tuple, list)) else (kernel_size, kernel_size)
    if len(sizes) != 2 or not all(map(is_positive_int, sizes)):
        raise ValueError(f"kernel_size must be an integer >= 1 or a pair of them, got {kernel_size!r}")
    sizes = tuple(map(operator.index, sizes))  # numpy ints become Python ints, as in the repr
    spec = nn.Conv2d(in_channels, out_channels, sizes, stride, padding, dilation, groups, bias,
                     padding_mode, device="meta")
    for name in _CONV_STATE:
        setattr(module, name, getattr(spec, name))
    return (out_channels, in_channels // groups, *spec.kernel_size)


def conv2d_forward(module: nn.Module, input: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``nn.Conv2d``'s forward with a given weight and bias (every padding mode)."""
    if module.padding_mode != "zeros":
        padded = F.pad(input, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        return F.conv2d(padded, weight, bias, module.stride, 0, module.dilation, module.groups)
    return F.conv2d(input, weight, bias, module.stride, module.padding, module.dilation, module.groups)


def conv2d_extra_repr(module: nn.Module) -> str:
    """The arguments part of ``nn.Conv2d``'s repr."""
    s = (f"{module.in_channels}, {module.out_channels}, kernel_size={module.kernel_size}, "
         f"stride={module.stride}, padding={module.padding}")
    if module.dilation != (1, 1):
        s += f", dilation={module.dilation}"
    if module.groups != 1:
        s += f", groups={module.groups}"
    if module.bias is None:
        s += ", bias=False"
    if module.padding_mode != "zeros":
        s += f", padding_mode={module.padding_mode!r}"
    return s


def conv2d_arguments(module: nn.Conv2d) -> tuple:
    """The positional arguments that rebuild ``module`` (for ``from_dense``)."""
    return (module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
            module.dilation, module.groups, module.bias is not None, module.padding_mode)


def linear_arguments(module: nn.Linear) -> tuple:
    """The positional arguments that rebuild ``module`` (for ``from_dense``)."""
    return (module.in_features, module.out_features, module.bias is not None)


def keep_requires_grad(layer: nn.Module, module: nn.Module, made_from: dict[str, tuple[str, ...]]) -> None:
    """Give each parameter of ``layer`` made from ``module``'s weight or bias (``made_from``:
    role -> names) that Parameter's ``requires_grad``: converting a frozen layer keeps it frozen."""
    for role, names in made_from.items():
        source = module._parameters.get(role)
        if source is None:
            continue
        for name in names:
            param = layer._parameters.get(name)
            if param is not None:
                param.requires_grad_(source.requires_grad)

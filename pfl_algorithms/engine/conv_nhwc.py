"""Per-client convolutions as one grouped convolution in channels-last layout under ``vmap``
(the batched executor's ``batched_conv='grouped-nhwc'``).

vmap's own rule for a convolution with each client's weight makes one grouped convolution over
[N, clients·C, H, W] in the layout the input has (NCHW from a stacked batch), adds each client's
bias as a separate pass over the output, and lays the output out as [N, clients, O, H', W'].
On an H200, cuDNN ran those grouped convolutions through NHWC kernels with explicit NCHW↔NHWC
conversions around them (``nchwToNhwcKernel``/``nhwcToNchwKernel``: about 10% of a batched
LeNet-5 round's kernel time) and a slow weight gradient (README, "Executors").

Here the same grouped convolution is called on the clients' channels folded ([N, clients·C,
H, W], a view where the input comes from such a convolution or from the folded BatchNorm and
pools of ``folded_channels``) copied to channels-last memory, with the bias folded into the
call, so the kernels that take that layout run without converting it themselves; the output is
copied back to vmap's own layout, [N, clients, O, H', W'] contiguous, since a batched tensor in
channels-last fails every op whose rule asks for its memory format under vmap (GroupNorm's did,
before ``folded_channels`` folded it; other rules still ask).
The values are the grouped convolution's (the same sums; a kernel of another layout may order
them differently).  On 2 CPU cores a batched LeNet-5 round took 77 ms with it against 149 ms,
a factorized ResNet-9 round 2253 against 2078 ms (README).  On an H200 (``benchmarks/gpu_executor.py``,
20 clients, captured) it was slower than grouped: LeNet-5 30.0 against 27.1 ms, ResNet-9 290.9
against 237.2 ms, so the default stays ``'grouped'``.

Folded: ``F.conv2d`` with a batched input [N, C, H, W] and a batched weight at the innermost vmap
level (no other transform), bias batched, shared or None, any stride, padding (numbers or a
string), dilation and groups.  Anything else runs as before.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._C import _functorch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .folded_channels import client_conv_operands


def conv2d_nhwc(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> Optional[Tensor]:
    """``F.conv2d`` (same arguments) of each client under ``vmap`` as one channels-last grouped
    convolution over the clients' channels (module docstring), or None where it does not fold."""
    operands = client_conv_operands(input, weight, bias, groups)
    if operands is None:
        return None
    moved, level, weights, biases = operands
    clients, out_channels = weights.shape[:2]
    folded_bias = None if biases is None else biases.reshape(-1)
    x_nhwc = moved.flatten(1, 2).contiguous(memory_format=torch.channels_last)
    w_nhwc = weights.reshape(-1, *weights.shape[2:]).contiguous(memory_format=torch.channels_last)
    out = F.conv2d(x_nhwc, w_nhwc, folded_bias, stride, padding, dilation, groups * clients)
    # Back to vmap's own layout (a copy): a batched tensor in channels-last memory fails every op
    # whose rule asks for its memory format under vmap ("NYI: querying is_contiguous inside of
    # vmap for memory_format other than torch.contiguous_format"; GroupNorm's did before it folded).
    return _functorch._add_batch_dim(out.contiguous().unflatten(1, (clients, out_channels)), 1, level)


class NhwcConvolutions(TorchFunctionMode):
    """Within the mode, ``F.conv2d`` under ``vmap`` runs as ``conv2d_nhwc`` where it folds, and
    as it would otherwise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.conv2d:
            out = conv2d_nhwc(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

"""Per-client convolutions as each client's own dense convolution under ``vmap`` (the batched
executor's ``batched_conv='per-client'``).

vmap's rule for a convolution with each client's weight runs one grouped convolution over
[N, clients·C, H, W]; cuDNN's grouped kernels, and their weight gradient above all, can be far
slower than its dense ones at the same FLOPs (a factorized ResNet-9 round on an H100: the batched
executor at 0.90x the sequential one, whose convolutions are dense).  Here each client's
convolution is one ``F.conv2d`` of its own samples [N, C, H, W] with its own weight, the call the
sequential executor makes, and the outputs are stacked into vmap's own layout [N, clients, O,
H', W'] (a copy of the output).  The backward is each client's dense backward.  Inside a captured
step the clients' launches cost no host time at replay; the other ops of the step (BatchNorm and
pools folded by ``folded_channels``, the optimizer) still run once for all clients.

The values are each client's dense convolution's (the grouped one sums the same products,
perhaps in another order).  On 2 CPU cores (one process, 7 interleaved rounds, medians) a
batched LeNet-5 round (10 clients x 128, batch 64) took 94 ms with it against 156 ms grouped
(85 ms ``'grouped-nhwc'``), a factorized ResNet-9 round (4 x 64, batch 32) 2076 against 2166 ms
(2433 ms).  On an H200 (``benchmarks/gpu_executor.py``, 20 clients, captured, float32) it was
slower than grouped: LeNet-5 37.8 against 27.1 ms, ResNet-9 254.3 against 237.2 ms, so the
default stays ``'grouped'`` (under bf16 it is untimed: the ``batched+bf16+per-client`` row).

Used for: ``F.conv2d`` with a batched input [N, C, H, W] and a batched weight at the innermost
vmap level (no other transform), bias batched, shared or None, any stride, padding, dilation and
groups.  Anything else runs as before.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._C import _functorch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .folded_channels import client_conv_operands


def conv2d_per_client(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> Optional[Tensor]:
    """``F.conv2d`` (same arguments) of each client under ``vmap`` as that client's own dense
    convolution, outputs stacked (module docstring), or None where it does not apply."""
    operands = client_conv_operands(input, weight, bias, groups)
    if operands is None:
        return None
    moved, level, weights, biases = operands  # [N, clients, C, H, W], [clients, O, C / groups, kh, kw], [clients, O]
    # unbind, not an index per client: each index's backward writes a zero gradient of the whole
    # stacked tensor and autograd sums them (traffic quadratic in the clients: 614 against 118 MB
    # for 16 clients' 3x3 convolution, forward and backward); unbind's backward is one stack.
    inputs, client_weights = moved.unbind(1), weights.unbind(0)
    biases = [None] * len(inputs) if biases is None else biases.unbind(0)
    outputs = [F.conv2d(x, w, b, stride, padding, dilation, groups) for x, w, b in zip(inputs, client_weights, biases)]
    return _functorch._add_batch_dim(torch.stack(outputs, 1), 1, level)


class PerClientConvolutions(TorchFunctionMode):
    """Within the mode, ``F.conv2d`` under ``vmap`` runs as ``conv2d_per_client`` where it
    applies, and as it would otherwise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.conv2d:
            out = conv2d_per_client(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

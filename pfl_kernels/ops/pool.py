"""ReLU fused with 2x2 max pooling: ``relu(max_pool2d(x, 2))`` in one pass, forward and backward.

Ops in the ``pfl`` namespace:

* ``relu_max_pool2d(input) -> (out, offsets)``: input [N, C, H, W] -> out [N, C, H // 2, W // 2]
  and offsets (uint8, same shape): the window position (0..3, row-major) that each output's
  gradient goes to, 4 where the ReLU stops it.
* ``relu_max_pool2d_backward(grad, offsets, input_size) -> grad_input`` [N, C, H, W].

Semantics: ``F.max_pool2d(x, 2)`` (kernel 2, stride 2, no padding, floor mode: the first of
equal values, the last NaN), then ReLU; equal, values and gradients, to ReLU then
``MaxPool2d(2)``, the order CNNs write it in, since ReLU is monotone.  The ReLU runs on a
quarter of the values and the gradient is one scatter, with no int64 indices.  The outputs
take the input's memory layout (channels-last stays channels-last).  Differentiable to any
order (the backward is linear in grad; its derivative is a gather), with a forward-mode
rule and a vmap rule: vmap over copies is more channels where that folds into a view (the
[N, clients, C, H, W] of vmap's per-client convolution, so neither the forward nor the backward
copies the activations), more images otherwise.

Kernels: C++ on CPU (an AVX2 loop for float32); plain PyTorch elsewhere.  On CUDA the plain
version is cuDNN's pooling and one elementwise op, which a fused kernel would gain little on.
"""
from __future__ import annotations

import torch

from ..reference import pool as ref
from ._checks import FLOAT_DTYPES, check_is_tensor
from ._library import define_op, has_kernel, register_autograd
from ._vmap import fold_into_channels, fold_vmap_dim

__all__ = ["relu_max_pool2d"]


def _check_forward(x):
    """Checks of the op contract that also hold under tracing (fake tensors)."""
    torch._check_value(x.dim() == 4, lambda: f"input must be [N, C, H, W], got {list(x.shape)}")
    torch._check_type(x.dtype in FLOAT_DTYPES, lambda: f"input must be a floating tensor, got {x.dtype}")


def _check_backward(grad, offsets, input_size):
    torch._check_value(len(input_size) == 2, lambda: f"input_size must be [H, W], got {list(input_size)}")
    torch._check_value(offsets.dim() == 4 and input_size[0] >= 0 and input_size[1] >= 0
                       and offsets.shape[2] == input_size[0] // 2 and offsets.shape[3] == input_size[1] // 2,
                       lambda: f"offsets must be [N, C, H // 2, W // 2] for input_size {list(input_size)}, "
                               f"got {list(offsets.shape)}")
    torch._check_value(grad.shape == offsets.shape,
                       lambda: f"grad must have the shape of offsets {list(offsets.shape)}, got {list(grad.shape)}")
    torch._check_type(grad.dtype in FLOAT_DTYPES, lambda: f"grad must be a floating tensor, got {grad.dtype}")
    torch._check_type(offsets.dtype == torch.uint8, lambda: f"offsets must be uint8, got {offsets.dtype}")


def _reference_forward(x):
    _check_forward(x)
    return ref.relu_max_pool2d(x)


def _reference_backward(grad, offsets, input_size):
    _check_backward(grad, offsets, input_size)
    return ref.relu_max_pool2d_backward(grad, offsets, input_size)


RELU_MAX_POOL2D = define_op("relu_max_pool2d(Tensor input) -> (Tensor, Tensor)", _reference_forward, cuda=None)
RELU_MAX_POOL2D_BACKWARD = define_op(
    "relu_max_pool2d_backward(Tensor grad, Tensor offsets, SymInt[] input_size) -> Tensor", _reference_backward,
    cuda=None)


@torch.library.register_fake(RELU_MAX_POOL2D)
def _relu_max_pool2d_fake(x):
    _check_forward(x)
    n, c, h, w = x.shape
    fmt = ref.memory_format(x)
    out = x.new_empty(n, c, h // 2, w // 2).contiguous(memory_format=fmt)
    return out, torch.empty_like(out, dtype=torch.uint8)


@torch.library.register_fake(RELU_MAX_POOL2D_BACKWARD)
def _relu_max_pool2d_backward_fake(grad, offsets, input_size):
    _check_backward(grad, offsets, input_size)
    n, c = offsets.shape[:2]
    return grad.new_empty(n, c, *input_size).contiguous(memory_format=ref.memory_format(offsets))


def _forward_setup(ctx, inputs, keyword_only_inputs, output):
    (x,) = inputs
    ctx.save_for_backward(output[1])
    ctx.save_for_forward(output[1])
    ctx.input_size = list(x.shape[-2:])


def _forward_backward(ctx, grad_out, grad_offsets):
    (offsets,) = ctx.saved_tensors
    if grad_out is None or not ctx.needs_input_grad[0]:
        return (None,)
    return (torch.ops.pfl.relu_max_pool2d_backward(grad_out, offsets, ctx.input_size),)


def _forward_jvp(ctx, tangent):
    (offsets,) = ctx.saved_tensors
    out_tangent = None if tangent is None else ref.gather_windows(tangent, offsets)
    return out_tangent, None


# csrc/autograd/pool.cpp registers the same formulas in C++ when the extension is loaded.
if not has_kernel(RELU_MAX_POOL2D, "Autograd"):
    register_autograd(RELU_MAX_POOL2D, _forward_backward, _forward_setup, jvp=_forward_jvp)


def _backward_setup(ctx, inputs, keyword_only_inputs, output):
    _, offsets, input_size = inputs
    ctx.save_for_backward(offsets)
    ctx.save_for_forward(offsets)
    ctx.input_size = list(input_size)


def _backward_backward(ctx, grad_grad_input):
    (offsets,) = ctx.saved_tensors
    grad = None
    if grad_grad_input is not None and ctx.needs_input_grad[0]:
        grad = ref.gather_windows(grad_grad_input, offsets)  # the transpose of the scatter
    return grad, None, None


def _backward_jvp(ctx, tangent_grad, tangent_offsets, tangent_size):
    (offsets,) = ctx.saved_tensors
    if tangent_grad is None:
        return None
    return torch.ops.pfl.relu_max_pool2d_backward(tangent_grad, offsets, ctx.input_size)  # linear in grad


if not has_kernel(RELU_MAX_POOL2D_BACKWARD, "Autograd"):
    register_autograd(RELU_MAX_POOL2D_BACKWARD, _backward_backward, _backward_setup, jvp=_backward_jvp)


def _folded(info, in_dims, tensors):
    """(folded tensors, unfold, the outputs' vmapped dim): the vmapped dim folded into the
    channels where that is a view (vmap's convolution output, [N, V, C, H, W]: no copy either
    way), else into the images (a copy for such a layout): each plane is pooled on its own."""
    channels = fold_into_channels(info, in_dims, tensors)
    if channels is not None:
        return (*channels, 1)
    return (*fold_vmap_dim(info, in_dims, tensors, True), 0)


@torch.library.register_vmap(RELU_MAX_POOL2D)
def _relu_max_pool2d_vmap(info, in_dims, x):
    (x,), unfold, dim = _folded(info, in_dims, (x,))
    out, offsets = torch.ops.pfl.relu_max_pool2d(x)
    return (unfold(out), unfold(offsets)), (dim, dim)


@torch.library.register_vmap(RELU_MAX_POOL2D_BACKWARD)
def _relu_max_pool2d_backward_vmap(info, in_dims, grad, offsets, input_size):
    (grad, offsets), unfold, dim = _folded(info, in_dims, (grad, offsets))
    return unfold(torch.ops.pfl.relu_max_pool2d_backward(grad, offsets, input_size)), dim


def relu_max_pool2d(input: torch.Tensor) -> torch.Tensor:
    """``relu(max_pool2d(input, 2))``, equal to ``max_pool2d(relu(input), 2)``, in one pass.

    The ReLU + ``nn.MaxPool2d(2)`` pair of LeNet-style CNNs as one op: 2x2 windows, stride 2,
    no padding, floor mode, F.max_pool2d's choice among equal values and NaN.

    Args:
        input: [N, C, H, W], float16/bfloat16/float32/float64, any layout (channels-last is
            fastest on CPU, and kept).

    Returns:
        [N, C, H // 2, W // 2] in input's layout, differentiable w.r.t. input.

    Raises:
        TypeError: a non-tensor or non-floating input.  ValueError: input not 4-D.
    """
    check_is_tensor("input", input)
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input must be a floating tensor (float16/bfloat16/float32/float64), got {input.dtype}")
    if input.dim() != 4:
        raise ValueError(f"input must be [N, C, H, W], got shape {list(input.shape)}")
    return torch.ops.pfl.relu_max_pool2d(input)[0]

"""Per-client convolutions as batched GEMMs under ``vmap`` (the batched executor's
``batched_conv='gemm'``).

Under ``vmap`` a convolution whose weight is batched (each client its own) becomes one grouped
convolution, a group per client.  On an H200 cuDNN's kernels for those grouped convolutions
took about 70% of a batched LeNet-5 round's GPU time, its weight gradient alone a third
(``sm80_xmma_wgrad_implicit_gemm_indexed``, 0.3-0.6 ms a call for 20 clients of 64 images;
README, "Executors").  Here the same convolution is im2col (``F.unfold``) and a matmul, which
vmap turns into one ``bmm`` over every client's images; the backward is a ``bmm`` and a sum
over the images for the weight, a ``bmm`` and col2im (``F.fold``) for the input: no grouped
kernel and no layout conversion anywhere.

The choice is a measured one, per device: on this project's 2-core CPUs the grouped
convolution is faster, since the CPU's im2col outweighs it (a vmapped LeNet-5 step, forward
and backward, 20 clients x 64 CIFAR-shaped images: 194 ms grouped, 405 ms as GEMMs; medians
of 9 interleaved repeats in one process), so ``'grouped'`` stays the default;
``benchmarks/gpu_executor.py`` times the batched LeNet-5 round both ways on a GPU.  The im2col
buffer holds C_in·k_h·k_w values per output pixel (25x LeNet's first input, 9x a 3x3
convolution's), so the lowering suits small convolutions.

Only what the lowering computes exactly as ``F.conv2d`` does is lowered: a batched weight on a
batched input, ``groups == 1``, numeric padding or ``'valid'``, or ``'same'`` where it pads
both sides alike.  Everything else runs ``F.conv2d``: a shared weight or input (vmap folds it
into one dense convolution), grouped and depthwise convolutions, ``'same'`` with uneven
padding.  Under autocast the float32 input and weight are cast to the autocast dtype first, as
``conv2d``'s autocast does, so the im2col buffer is in that dtype too.  (The grouped form is
cast too: by CUDA's autocast, and on a CPU, whose autocast lists ``conv2d`` but not the
``aten::convolution`` that vmap's batching rule calls, by ``model_call.AutocastConvolutions``.)
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .conv_nhwc import NhwcConvolutions
from .conv_per_client import PerClientConvolutions
from .folded_channels import FoldedChannels
from .model_call import to_autocast_dtype

CHOICES = ("grouped", "gemm", "grouped-nhwc", "per-client")


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _padding(padding, kernel: tuple[int, int], dilation: tuple[int, int]) -> Optional[tuple[int, int]]:
    """``padding`` as the symmetric pair F.unfold takes, or None where it has none ('same' with an
    odd total, which F.conv2d pads one more on the bottom and right)."""
    if padding == "valid":
        return 0, 0
    if padding == "same":
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return None if any(t % 2 for t in totals) else (totals[0] // 2, totals[1] // 2)
    return _pair(padding)


def conv2d_gemm(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, stride=1, padding=0,
                dilation=1, groups: int = 1) -> Optional[torch.Tensor]:
    """``F.conv2d(input, weight, bias, stride, padding, dilation, groups)`` as im2col and a
    matmul (module docstring), or None where it is not lowered; ``input`` [N, C, H, W] or
    [C, H, W], ``weight`` [O, C, k_h, k_w]."""
    if groups != 1 or weight.dim() != 4 or input.dim() not in (3, 4) or (
            isinstance(padding, str) and stride not in (1, (1, 1))):
        return None
    if not (torch._C._functorch.is_batchedtensor(weight) and torch._C._functorch.is_batchedtensor(input)):
        return None  # a shared weight or a shared input: vmap makes one dense convolution of it
    kernel, dilation_, stride_ = (int(weight.shape[2]), int(weight.shape[3])), _pair(dilation), _pair(stride)
    pad = _padding(padding, kernel, dilation_)
    if pad is None:
        return None
    unbatched = input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    device = x.device.type
    if torch.is_autocast_enabled(device):  # as conv2d's autocast casts its operands
        dtype = torch.get_autocast_dtype(device)
        x, weight = to_autocast_dtype(x, dtype), to_autocast_dtype(weight, dtype)
    n, _, height, width = x.shape
    out_h = (height + 2 * pad[0] - dilation_[0] * (kernel[0] - 1) - 1) // stride_[0] + 1
    out_w = (width + 2 * pad[1] - dilation_[1] * (kernel[1] - 1) - 1) // stride_[1] + 1
    columns = F.unfold(x, kernel, dilation=dilation_, padding=pad, stride=stride_)  # [N, C·k_h·k_w, L]
    out = torch.matmul(weight.flatten(1), columns)  # [N, O, L]: vmap makes it one batched GEMM
    if bias is not None:
        out = out + bias.to(out.dtype)[:, None]
    out = out.reshape(n, weight.shape[0], out_h, out_w)
    return out[0] if unbatched else out


class GemmConvolutions(TorchFunctionMode):
    """Within the mode, ``F.conv2d`` calls that ``conv2d_gemm`` lowers run as im2col and a matmul;
    every other call runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.conv2d:
            out = conv2d_gemm(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def check_choice(choice) -> None:
    """ValueError unless ``choice`` is one of ``CHOICES`` (the ``batched_conv`` setting)."""
    if choice not in CHOICES:
        raise ValueError(f"batched_conv must be one of {', '.join(CHOICES)}, got {choice!r}")


def batched_convolutions(choice: str):
    """The context a vmapped forward of per-client weights runs in: its convolutions as
    ``choice`` says, ``'grouped'`` (vmap's grouped convolutions), ``'gemm'``
    (``GemmConvolutions``), ``'grouped-nhwc'`` (``conv_nhwc.NhwcConvolutions``) or
    ``'per-client'`` (``conv_per_client.PerClientConvolutions``), and its
    BatchNorm and max pools folded into the clients' channels (``folded_channels``), the
    outermost mode, so that it sees those calls first (before ``MixedBatchNorm``'s cast)."""
    check_choice(choice)
    stack = contextlib.ExitStack()
    if choice == "gemm":
        stack.enter_context(GemmConvolutions())
    elif choice == "grouped-nhwc":
        stack.enter_context(NhwcConvolutions())
    elif choice == "per-client":
        stack.enter_context(PerClientConvolutions())
    stack.enter_context(FoldedChannels())
    return stack

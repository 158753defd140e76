"""Plain-PyTorch definition of ReLU fused with 2x2 max pooling, any device, any float dtype.

    out[n, c, i, j] = relu(max_{a, b in {0, 1}} x[n, c, 2i + a, 2j + b])

the max taken as ``F.max_pool2d(x, 2)`` takes it (the first of equal values, the last NaN),
which equals ``F.max_pool2d(F.relu(x), 2)`` exactly, gradient included.  ``offsets`` record
where each window's gradient goes: the window position 2a + b of the max, or 4 where the
ReLU stops it (the max is <= 0).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

CLOSED = 4  # the offset of a window whose gradient the ReLU stops


def memory_format(x: torch.Tensor) -> torch.memory_format:
    """channels-last for a channels-last input (that is not also contiguous), else contiguous:
    the layout of every output of the ops."""
    last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if last else torch.contiguous_format


def relu_max_pool2d(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, C, H // 2, W // 2], offsets of the same shape, uint8), in x's layout."""
    n, c, h, w = x.shape
    fmt = memory_format(x)
    if n * c * (h // 2) * (w // 2) == 0:
        empty = x.new_empty(n, c, h // 2, w // 2).contiguous(memory_format=fmt)
        return empty, empty.to(torch.uint8)
    pooled, index = F.max_pool2d(x, 2, return_indices=True)  # index: h * W + w in each map
    oh = torch.arange(h // 2, device=x.device)[:, None]
    ow = torch.arange(w // 2, device=x.device)
    position = (index // w - 2 * oh) * 2 + (index % w - 2 * ow)
    open_ = (pooled > 0) | pooled.isnan()
    out = torch.where(open_, pooled, torch.zeros((), dtype=x.dtype, device=x.device))
    offsets = torch.where(open_, position, CLOSED).to(torch.uint8)
    return out.contiguous(memory_format=fmt), offsets.contiguous(memory_format=fmt)


def _window_view(t: torch.Tensor, oh: int, ow: int) -> torch.Tensor:
    """[N, C, OH, OW, 4]: the windows' values of t [N, C, H, W], position 2a + b last."""
    n, c = t.shape[:2]
    t = t[:, :, : 2 * oh, : 2 * ow].reshape(n, c, oh, 2, ow, 2)
    return t.permute(0, 1, 2, 4, 3, 5).reshape(n, c, oh, ow, 4)


def relu_max_pool2d_backward(grad: torch.Tensor, offsets: torch.Tensor, input_size) -> torch.Tensor:
    """grad_x [N, C, H, W]: each window's grad at its offset, 0 elsewhere (and where closed)."""
    n, c, oh, ow = offsets.shape
    h, w = (int(s) for s in input_size)
    fmt = memory_format(offsets)
    grad_x = grad.new_zeros(n, c, h, w)
    if grad.numel():
        k = offsets.to(torch.int64)
        passed = torch.where(k < CLOSED, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
        windows = torch.zeros(n, c, oh, ow, 4, dtype=grad.dtype, device=grad.device)
        windows.scatter_(-1, k.clamp_max(3)[..., None], passed[..., None])
        grad_x[:, :, : 2 * oh, : 2 * ow] = windows.reshape(n, c, oh, ow, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(
            n, c, 2 * oh, 2 * ow)
    return grad_x.contiguous(memory_format=fmt)


def gather_windows(t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[N, C, OH, OW]: t [N, C, H, W] at each window's offset, 0 where closed.  The derivative
    of the backward w.r.t. its grad (and the forward's tangent map).  Plain ops only, in no
    particular layout: autograd formulas run it inside vmap (batched gradients)."""
    n, c, oh, ow = offsets.shape
    if t.numel() == 0 or offsets.numel() == 0:
        return t.new_zeros(n, c, oh, ow)
    k = offsets.to(torch.int64)
    values = _window_view(t, oh, ow).gather(-1, k.clamp_max(3)[..., None]).squeeze(-1)
    return torch.where(k < CLOSED, values, torch.zeros((), dtype=t.dtype, device=t.device))

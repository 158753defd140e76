"""Each client's channel-wise ops under ``vmap`` as one native op over the clients' channels
(the batched executor's forward): BatchNorm, GroupNorm and max pooling.

vmap lays a per-client convolution's output out as [N, clients, C, ...] (one grouped
convolution).  Its batching rules for the channel-wise ops that follow then move data:

* BatchNorm with each client's affine parameters: the normalization without the affine, then
  ``x̂ · weight + bias`` as two more passes over the activations in the forward, and their
  gradients as more passes in the backward (a ``mul`` and a ``sum`` over the activations for
  each of weight and bias).  Counted on a CPU (``benchmarks/step_roofline.TrafficCounter`` over
  a batched round of the factorized ResNet-9, 2 clients x 128 CIFAR-shaped images), those
  passes moved 3.1 of the round's 9.3 GB, where the sequential executor's round moved 5.6 GB in
  all; under bf16 autocast, ``MixedBatchNorm``'s casts of the bfloat16 activations to float32
  and back (the batching rule has no mixed form) moved 1.7 GB more.
* max pooling: the clients moved into the batch dim, a copy of the activations, and the next
  convolution's rule copies its output back into channels.

Here the clients' channels are folded into one channel axis, [N, clients·C, ...], a view of that
layout: one ``torch.batch_norm`` with weight, bias and running statistics [clients·C], which
normalizes, applies the affine and updates the statistics in one kernel and takes a bfloat16
input with float32 statistics as the unbatched kernels do (cuDNN's, the CPU's); one max pool,
whose output (and indices, each a position within its own channel's plane) keeps the layout.
Each client's channels are normalized over that client's N samples alone and pooled alone, as
before: the same values up to float rounding (BatchNorm's fused affine), the same running
statistics.

GroupNorm folds the same way: a client's G groups of its C channels are clients·G groups of
[N, clients·C, ...], each inside one client's channels.  Its batching rule moved more bytes
(a vmapped GroupNorm of 16 clients x 32 x 32 channels of 16x16, forward and backward: 285 MB,
folded 235) and refused a channels-last input (a convolution with a channels-last weight makes
one: pFedPara's did), which the fold takes.

Only what folds exactly is folded: a batched input [N, C, ...] at the innermost ``vmap`` level
with every other transform absent; for BatchNorm, running statistics batched at that level whose
client rows fold into a view (the in-place update must reach them), or none, and weight and bias
batched, shared or None.  Anything else runs the batching rule as before.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch._C import _functorch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode


def unwrap_level(t: Tensor, level: int) -> Optional[tuple[Tensor, Optional[int]]]:
    """(the tensor under ``t``'s vmap wrapper, its batch dim), (t, None) for a plain tensor,
    or None where ``t`` is wrapped otherwise (another level, another transform)."""
    if not _functorch.is_functorch_wrapped_tensor(t):
        return t, None
    if not _functorch.is_batchedtensor(t) or _functorch.maybe_get_level(t) != level:
        return None
    physical, bdim = _functorch._unwrap_batched(t, level)
    return (physical, bdim) if not _functorch.is_functorch_wrapped_tensor(physical) else None


def _per_channel(t: Optional[Tensor], level: int, clients: int, channels: int, *, in_place: bool):
    """``t`` (a client's [C], batched or shared) as [clients·C]; a view of the batched rows when
    ``in_place`` (running statistics, updated through it).  False where it does not fold."""
    if t is None:
        return None
    unwrapped = unwrap_level(t, level)
    if unwrapped is None:
        return False
    physical, bdim = unwrapped
    if bdim is None:
        if in_place or physical.dim() != 1:  # shared running statistics: the batching rule's case
            return False
        return physical.expand(clients, channels).reshape(clients * channels)
    rows = physical.movedim(bdim, 0)
    if rows.shape != (clients, channels):
        return False
    if in_place:
        try:
            return rows.view(clients * channels)
        except RuntimeError:  # rows that do not fold into one view: the update would be lost
            return False
    return rows.reshape(clients * channels)


def clients_in_channels(x, *, min_dims: int) -> Optional[tuple[Tensor, int]]:
    """(x's clients as [N, clients, C, ...], a view where vmap's convolution laid them out so;
    its vmap level) for a batched x of at least ``min_dims`` dims at the innermost level with no
    other transform, else None."""
    if not (isinstance(x, Tensor) and _functorch.is_batchedtensor(x)) or x.dim() < min_dims:
        return None
    level = _functorch.maybe_get_level(x)
    if level != _functorch.current_level():
        return None
    unwrapped = unwrap_level(x, level)
    if unwrapped is None:
        return None
    physical, bdim = unwrapped
    return physical.movedim(bdim, 1), level


def client_conv_operands(input, weight, bias, groups) -> Optional[tuple[Tensor, int, Tensor, Optional[Tensor]]]:
    """The operands of ``F.conv2d(input, weight, bias, groups=groups)`` under ``vmap`` with a
    weight per client, unwrapped: (input as [N, clients, C, H, W], the vmap level, the weights
    [clients, O, C / groups, kh, kw], the biases [clients, O] or None).  None where the call is
    not that: unbatched images, a weight shared by the clients (vmap makes it one dense
    convolution), another transform, or shapes that do not fit (vmap's rule then raises
    F.conv2d's own error)."""
    batched = clients_in_channels(input, min_dims=4)
    if batched is None or input.dim() != 4 or not isinstance(weight, Tensor) or weight.dim() != 4:
        return None
    moved, level = batched
    unwrapped = unwrap_level(weight, level)
    if unwrapped is None or unwrapped[1] is None:
        return None
    weights = unwrapped[0].movedim(unwrapped[1], 0)
    clients, out_channels = weights.shape[:2]
    if moved.shape[1] != clients or moved.shape[2] != weights.shape[2] * groups:
        return None
    if bias is None:
        return moved, level, weights, None
    unwrapped_bias = unwrap_level(bias, level)
    if unwrapped_bias is None:
        return None
    b, bdim = unwrapped_bias
    return moved, level, weights, b.expand(clients, out_channels) if bdim is None else b.movedim(bdim, 0)


def _unfold(out: Tensor, moved: Tensor, level: int) -> Tensor:
    """A folded result [N, clients·C, ...] as each client's [N, C, ...] at ``level``."""
    return _functorch._add_batch_dim(out.view(*moved.shape[:3], *out.shape[2:]), 1, level)


def folded_pooling(func, x, *args, **kwargs):
    """``func(x, *args, **kwargs)``, a max pool over a batched [N, C, H, W] (values, or values and
    indices), as one pool over the clients' channels; None where it does not fold."""
    batched = clients_in_channels(x, min_dims=4)
    if batched is None or x.dim() != 4:
        return None
    moved, level = batched
    out = func(moved.flatten(1, 2), *args, **kwargs)
    if isinstance(out, tuple):
        return tuple(_unfold(t, moved, level) for t in out)
    return _unfold(out, moved, level)


def folded_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                      eps=1e-5) -> Optional[Tensor]:
    """``F.batch_norm`` (same arguments) of each client under ``vmap`` as one native BatchNorm
    over the clients' channels (module docstring), or None where it does not fold."""
    x = input
    batched = clients_in_channels(x, min_dims=2)
    if batched is None:
        return None
    moved, level = batched
    samples, clients, channels = moved.shape[:3]
    folded = [_per_channel(t, level, clients, channels, in_place=in_place)
              for t, in_place in ((running_mean, True), (running_var, True), (weight, False), (bias, False))]
    if any(f is False for f in folded):
        return None
    if training and samples * math.prod(moved.shape[3:]) == 1:  # F.batch_norm's own check, per client
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")
    # torch.batch_norm, the op F.batch_norm calls: its mixed kernels take a bfloat16 input with
    # float32 statistics, and MixedBatchNorm (which intercepts F.batch_norm) leaves it alone.
    running_mean, running_var, weight, bias = folded
    out = torch.batch_norm(moved.flatten(1, 2), weight, bias, running_mean, running_var, training, momentum, eps,
                           torch.backends.cudnn.enabled)
    return _unfold(out, moved, level)


def folded_group_norm(input, num_groups, weight=None, bias=None, eps=1e-5) -> Optional[Tensor]:
    """``F.group_norm`` (same arguments) of each client under ``vmap`` as one native GroupNorm
    over the clients' channels: ``num_groups`` groups of a client's C channels are
    ``clients * num_groups`` groups of [N, clients·C, ...], each within one client's channels,
    so every group holds the same values as before.  The output is in the standard layout,
    whatever the input's (vmap's own rule refuses a channels-last one: "NYI: querying
    is_contiguous inside of vmap").  None where it does not fold."""
    batched = clients_in_channels(input, min_dims=2)
    if batched is None or not isinstance(num_groups, int) or num_groups < 1:
        return None
    moved, level = batched
    clients, channels = moved.shape[1:3]
    if channels % num_groups:
        return None  # vmap's rule raises F.group_norm's own error
    folded = [_per_channel(t, level, clients, channels, in_place=False) for t in (weight, bias)]
    if any(f is False for f in folded):
        return None
    out = F.group_norm(moved.flatten(1, 2), clients * num_groups, *folded, eps)
    return _unfold(out.contiguous(), moved, level)


# The max pools F.max_pool2d and F.adaptive_max_pool2d hand the mode (with or without indices).
_POOLS = frozenset({F.max_pool2d, F.max_pool2d_with_indices, F.adaptive_max_pool2d,
                    F.adaptive_max_pool2d_with_indices})


class FoldedChannels(TorchFunctionMode):
    """Within the mode, ``F.batch_norm``, ``F.group_norm`` and the 2-d max pools under ``vmap``
    run folded (``folded_batch_norm``, ``folded_group_norm``, ``folded_pooling``) where they
    fold, and as they would otherwise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            out = folded_batch_norm(*args, **kwargs)
        elif func is F.group_norm:
            out = folded_group_norm(*args, **kwargs)
        elif func in _POOLS:
            out = folded_pooling(func, *args, **kwargs)
        else:
            out = None
        return func(*args, **kwargs) if out is None else out

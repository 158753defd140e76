"""``ReLUMaxPool2d``: ReLU then ``MaxPool2d(2)`` as one fused op, and the converter that puts
it into a model."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ..ops.pool import relu_max_pool2d

__all__ = ["ReLUMaxPool2d", "fuse_relu_max_pool", "unfuse_relu_max_pool"]


class ReLUMaxPool2d(nn.Module):
    """``MaxPool2d(2)(ReLU()(x))`` in one pass (``pfl_kernels.ops.relu_max_pool2d``): the same
    values and gradients, a quarter of the ReLU work, no int64 indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """relu(max_pool2d(x, 2)) of x [N, C, H, W]; a 3-D x [C, H, W] is one image.

        Raises RuntimeError, as ``F.max_pool2d(x, 2)`` does, where H or W is below 2 (the op
        itself returns an empty output there, which would pass unnoticed into the next layer).
        """
        if x.dim() in (3, 4):  # other shapes: the op's own error
            h, w = x.shape[-2:]
            torch._check(h >= 2 and w >= 2, lambda: f"ReLUMaxPool2d: input of spatial size {h}x{w} pools to "
                                                    f"{h // 2}x{w // 2}: Output size is too small")
        if x.dim() == 3:
            return relu_max_pool2d(x.unsqueeze(0)).squeeze(0)
        return relu_max_pool2d(x)


def _unhooked(m: nn.Module) -> bool:
    """No hooks: a fused module would silently skip them."""
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _is_pool2(m: nn.Module) -> bool:
    """A MaxPool2d that pools 2x2 windows at stride 2 with nothing else on."""
    def pair(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    return (type(m) is nn.MaxPool2d and pair(m.kernel_size) == (2, 2) and pair(m.stride) == (2, 2)
            and pair(m.padding) == (0, 0) and pair(m.dilation) == (1, 1) and not m.ceil_mode
            and not m.return_indices)


def _adjacent_pairs(model: nn.Module) -> Iterator[tuple[nn.Sequential, str, str]]:
    """(container, name, next name) for each two neighbours in every plain ``nn.Sequential`` of
    ``model``; the containers are listed first, so replacing a pair's modules is safe."""
    for seq in [m for m in model.modules() if type(m) is nn.Sequential]:
        names = list(seq._modules)
        for first, second in zip(names, names[1:]):
            yield seq, first, second


def fuse_relu_max_pool(model: nn.Module) -> int:
    """Replace, in place, each ``nn.ReLU`` directly followed by a 2x2 ``nn.MaxPool2d`` in an
    ``nn.Sequential`` by ``nn.Identity`` and a ``ReLUMaxPool2d``; returns how many pairs.

    The Sequential keeps its length and every index (state_dict names do not change: neither
    module has state), and its output, gradient included, is the same.  Only plain
    ``nn.Sequential`` containers are rewritten (a subclass may run its children in another
    order), only ReLU modules that appear once in the model (a shared one may also run
    elsewhere), and only modules without hooks (they would no longer fire).  What the Identity
    passes on is the pre-ReLU value, so code that runs a slice ending at the ReLU
    (``seq[:i + 1]``) sees the difference: fuse working copies that are run whole.
    """
    uses: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        uses[id(m)] = uses.get(id(m), 0) + 1
    fused = 0
    for seq, first, second in _adjacent_pairs(model):
        relu, pool = seq._modules[first], seq._modules[second]
        if type(relu) is nn.ReLU and uses[id(relu)] == 1 and _is_pool2(pool) and _unhooked(relu) and _unhooked(pool):
            seq._modules[first] = nn.Identity()
            seq._modules[second] = ReLUMaxPool2d()
            fused += 1
    return fused


def unfuse_relu_max_pool(model: nn.Module) -> int:
    """Undo ``fuse_relu_max_pool`` in place: each ``nn.Identity`` followed by a
    ``ReLUMaxPool2d`` in an ``nn.Sequential`` becomes ``nn.ReLU()`` and ``nn.MaxPool2d(2)``
    again (for plain-PyTorch copies of an engine's model, or export); returns how many."""
    restored = 0
    for seq, first, second in _adjacent_pairs(model):
        if type(seq._modules[first]) is nn.Identity and type(seq._modules[second]) is ReLUMaxPool2d:
            seq._modules[first] = nn.ReLU()
            seq._modules[second] = nn.MaxPool2d(2)
            restored += 1
    return restored

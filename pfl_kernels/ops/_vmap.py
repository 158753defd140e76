"""vmap rules for ops with a client dimension: vmap over copies is the op on more clients."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def fold_vmap_dim(info, in_dims, tensors: Sequence[Optional[torch.Tensor]], has_clients: bool):
    """Move the vmapped dim to the front and fold it into the client dim K.

    vmap over V copies of an op on [K?, ...] inputs is the op on V·K clients (V clients
    when the op is called without a client dim); inputs that are not vmapped are expanded
    (stride 0, no copy).  Returns the folded tensors and a function that unfolds an
    output [V·K?, ...] back to [V, K?, ...].
    """
    batch = info.batch_size
    dims = tuple(in_dims) + (None,) * (len(tensors) - len(in_dims))
    folded = []
    for t, d in zip(tensors, dims):
        if t is not None:
            t = t.movedim(d, 0) if d is not None else t.expand(batch, *t.shape)
            if has_clients:
                t = t.reshape(-1, *t.shape[2:])
        folded.append(t)

    def unfold(out: torch.Tensor) -> torch.Tensor:
        return out.reshape(batch, -1, *out.shape[1:]) if has_clients else out

    return folded, unfold


def fold_into_channels(info, in_dims, tensors: Sequence[torch.Tensor]):
    """For an op on [N, C, ...] tensors that treats each (image, channel) plane on its own: fold
    the vmapped dim V into the channels, [N, V·C, ...], as views, where every tensor is vmapped
    and its layout allows (vmap's per-client convolution lays its output out as [N, V, C, ...]).
    Returns the folded tensors and a function that unfolds an output [N, V·C, ...] to
    [N, V, C, ...] (vmapped dim 1), or None where a tensor does not fold into a view (the caller
    folds V into the images instead: ``fold_vmap_dim``, which copies such a layout)."""
    folded = []
    for t, d in zip(tensors, in_dims):
        if d is None:
            return None
        moved = t.movedim(d, 1)
        try:
            folded.append(moved.view(moved.shape[0], -1, *moved.shape[3:]))
        except RuntimeError:  # not one strided run over (V, C)
            return None

    def unfold(out: torch.Tensor) -> torch.Tensor:
        return out.unflatten(1, (info.batch_size, -1))

    return folded, unfold


def logical_dim(t: torch.Tensor, in_dim: Optional[int]) -> int:
    """The number of dims the op sees for ``t`` (without the vmapped one)."""
    return t.dim() - (in_dim is not None)


def unfold_gradients(grads, asked, unfold):
    """(outputs, out_dims) of a backward op: asked-for gradients unfolded; the empty [0]
    placeholders of the others stay unbatched (vmap broadcasts them)."""
    return (tuple(unfold(g) if a else g for g, a in zip(grads, asked)),
            tuple(0 if a else None for a in asked))

"""What a CUDA graph capture refuses, on a CPU: reading a tensor's values on the host.

While a CUDA stream captures, a call that copies values to the host (``.item()``, ``bool()``,
``float()``, ``.tolist()``, a boolean mask's ``nonzero``) fails the capture ("operation not
permitted when stream is capturing"), and the step then runs uncaptured, with a sync each
time.  ``HostReadsRefused`` raises on those calls at the Python level, so a CPU test can run a
step as a capture would and learn that it would not be captured.  Reads inside C++ kernels
are not seen; the ops' Python wrappers, checks and Autograd kernels are.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
# Calls that need a tensor's values on the host (on CUDA: a device-to-host copy and a sync).
HOST_READS = frozenset({
    T.item, T.tolist, T.numpy, T.__bool__, T.__float__, T.__int__, T.__index__, T.__complex__, T.__repr__,
    T.__format__, T.__array__, T.nonzero, torch.nonzero, torch.argwhere, T.argwhere, T.masked_select,
    torch.masked_select, T.unique, torch.unique, torch.unique_consecutive, T.unique_consecutive, T.equal,
    torch.equal, T.allclose, torch.allclose, T.is_nonzero, torch.is_nonzero,
})


def _has_mask(index) -> bool:
    """Whether an indexing key holds a boolean tensor (a mask: its nonzero is read on the host)."""
    keys = index if isinstance(index, tuple) else (index,)
    return any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys)


def reads_on_host(func, args) -> bool:
    """Whether the call ``func(*args)`` reads tensor values on the host."""
    return func in HOST_READS or (func in (T.__getitem__, T.__setitem__) and len(args) > 1 and _has_mask(args[1]))


class HostReadsRefused(TorchFunctionMode):
    """Within the mode, a call that reads tensor values on the host raises RuntimeError, as a
    CUDA graph capture fails on it (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if reads_on_host(func, args):
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(f"operation not permitted when stream is capturing: {name} reads values on the host")
        return func(*args, **(kwargs or {}))


class HostReadsCounted(TorchFunctionMode):
    """Within the mode, ``count`` is the number of calls that read tensor values on the host
    (on a GPU, each a device sync; on a CPU some read tensors that live on the host anyway)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += reads_on_host(func, args)
        return func(*args, **(kwargs or {}))

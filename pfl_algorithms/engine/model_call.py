"""How the engine calls a model in a training step: its outputs, and the autocast around them
(every executor's step, captured or not, goes through these two)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only


def forward(module: nn.Module, inputs: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """(logits, embeddings) of ``module``; embeddings from ``embed`` where the model has one
    and a ``head`` (the registry's models: logits = head(embed(x)), their forward), else None."""
    if hasattr(module, "embed") and isinstance(getattr(module, "head", None), nn.Module):
        embeddings = module.embed(inputs)
        return module.head(embeddings), embeddings
    return module(inputs), None


def autocast(mode, device: torch.device, *, cache: bool = True):
    """``torch.autocast`` for the forward of a training step: mode 'bf16' (bfloat16 matmuls and
    convolutions, the rest and the loss in float32), None: off.  ``cache=False`` for a step
    captured as a CUDA graph (torch's autocast cache cannot outlive a capture)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16", cache_enabled=cache)


class MixedBatchNorm(TorchFunctionMode):
    """Within the mode, ``F.batch_norm`` of a 16-bit input with float32 statistics or affine
    parameters runs in float32 and returns the input's dtype: what the native kernels do
    unbatched (cuDNN's and the CPU's mixed BatchNorm: bfloat16 in and out, float32 statistics).

    Under ``vmap`` BatchNorm's batching rule has no mixed form: a bfloat16 input (autocast's
    convolution output, on CUDA) with each client's float32 running statistics failed (on an
    H100: "Expected running_mean to have type BFloat16 but got Float" in the backward; on a CPU
    already in the forward).  The cast up is exact, so the statistics are float32 ones as
    unbatched; only the output is rounded to bfloat16, as cuDNN rounds it.  The batched
    executor's own calls fold (``folded_channels.folded_batch_norm``) and never reach this
    mode: they run the native mixed kernel, without the casts."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            x, statistics_and_affine = _batch_norm_tensors(*args, **kwargs)
            wide = {t.dtype for t in statistics_and_affine if t is not None}
            if x.dtype in (torch.bfloat16, torch.float16) and len(wide) == 1 and x.dtype not in wide:
                wide_x = x.to(wide.pop())
                if args:
                    return func(wide_x, *args[1:], **kwargs).to(x.dtype)
                return func(**{**kwargs, "input": wide_x}).to(x.dtype)
        return func(*args, **kwargs)


def _batch_norm_tensors(input, running_mean, running_var, weight=None, bias=None, *_, **__):
    """``F.batch_norm``'s input, and its statistics and affine parameters (each may be None)."""
    return input, (running_mean, running_var, weight, bias)


def vmapped_autocast(mode, device: torch.device, *, cache: bool = True):
    """``autocast`` for a forward under ``vmap`` (the batched executor's): with 'bf16' it also
    runs BatchNorm mixed as unbatched (``MixedBatchNorm``) and, where autocast would miss them,
    casts convolutions as unbatched (``AutocastConvolutions``)."""
    stack = contextlib.ExitStack()
    stack.enter_context(autocast(mode, device, cache=cache))
    if mode == "bf16":
        stack.enter_context(MixedBatchNorm())
        if not autocast_casts_batched_convolutions(device.type):
            stack.enter_context(AutocastConvolutions(device.type))
    return stack


# The autocast dispatch key of each device type whose autocast torch implements.
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"}


def autocast_casts_batched_convolutions(device_type: str) -> bool:
    """Whether ``device_type``'s autocast casts ``aten::convolution``, the op a vmapped
    convolution reaches it as (CUDA's does; the CPU's casts only ``conv2d`` and its kin)."""
    key = _AUTOCAST_KEYS.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("aten::convolution", key)


_CONVOLUTIONS = frozenset({F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d})


class AutocastConvolutions(TorchFunctionMode):
    """Within the mode, a convolution (``F.conv2d`` and its kin) under an enabled autocast of
    ``device_type`` gets its floating inputs cast to autocast's dtype, as autocast casts an
    unbatched one (float64 is left as it is, as autocast leaves it).

    Under ``vmap`` a convolution reaches autocast as ``aten::convolution``: vmap's batching rule
    (its dispatch key comes before autocast's) calls that op, not ``conv2d``.  CUDA's autocast
    casts it; the CPU's does not, so before this mode a batched CPU step under ``--autocast
    bf16`` ran its convolutions in float32 while the sequential executor's ran in bfloat16 (the
    same step, other numbers).  ``vmapped_autocast`` enters it only where autocast leaves
    ``aten::convolution`` alone."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CONVOLUTIONS and torch.is_autocast_enabled(self.device_type):
            dtype = torch.get_autocast_dtype(self.device_type)
            args, kwargs = tree_map_only(Tensor, lambda t: to_autocast_dtype(t, dtype), (args, kwargs))
        return func(*args, **kwargs)


def to_autocast_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as autocast hands it to an op it runs in ``dtype`` (a convolution, a matmul): a
    floating tensor in ``dtype``, but float64 and non-floating tensors as they are."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


class ModelOutputs(nn.Module):
    """``forward(model, inputs)`` as a module, for ``torch.func.functional_call`` on a client's
    tensors (named as the model's, prefixed 'model.'): (logits, embeddings), or logits alone
    where the model has no embeddings."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs):
        logits, embeddings = forward(self.model, inputs)
        return logits if embeddings is None else (logits, embeddings)

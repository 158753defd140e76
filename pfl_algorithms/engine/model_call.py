"""How the engine calls a model in a training step: its outputs, and the autocast around them
(every executor's step, captured or not, goes through these two)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode


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
    unbatched; only the output is rounded to bfloat16, as cuDNN rounds it."""

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
    runs BatchNorm mixed as unbatched (``MixedBatchNorm``)."""
    stack = contextlib.ExitStack()
    stack.enter_context(autocast(mode, device, cache=cache))
    if mode == "bf16":
        stack.enter_context(MixedBatchNorm())
    return stack


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

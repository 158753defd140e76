"""How the engine calls a model in a training step: its outputs, and the autocast around them
(every executor's step, captured or not, goes through these two)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


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

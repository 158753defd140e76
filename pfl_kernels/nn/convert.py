"""Converters that turn any model's Conv2d / Linear layers into factorized layers in place."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .factorized import FactorizedConv2d, FactorizedLinear


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _check_exclude(model: nn.Module, exclude: Iterable[str]) -> set[str]:
    if isinstance(exclude, str):
        exclude = (exclude,)
    exclude = set(exclude)
    names = {name for name, _ in model.named_modules()}
    unknown = sorted(exclude - names)
    if unknown:
        raise ValueError(f"exclude names modules the model does not have: {unknown}")
    return exclude


def factorize(model: nn.Module, *, rank: int = 1, layout: str = "spatial", sparse: bool = True,
              exclude: Iterable[str] = ()) -> nn.Module:
    """Replace every ``nn.Conv2d`` and ``nn.Linear`` of ``model`` (at any depth) in place.

    Each layer becomes ``FactorizedConv2d.from_dense`` / ``FactorizedLinear.from_dense``
    of itself, so with sparse=True the model computes the same function as before.

    Args:
        model: any module (nested, Sequential, residual blocks...).  A bare Conv2d/Linear
            cannot be replaced in place: use ``from_dense`` on it.
        rank, sparse: as for the layers.  layout: for convolutions ('spatial', 'simfed', 'view');
            linears always use 'linear'.
        exclude: qualified module names (as in ``model.named_modules()``) to leave dense,
            e.g. the classifier; a module inside an excluded one is left dense too.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: a name in ``exclude`` that the model does not have; ``model`` itself a
            Conv2d/Linear.
    """
    if isinstance(model, (nn.Conv2d, nn.Linear)):
        raise ValueError("model is itself a Conv2d/Linear; use FactorizedConv2d.from_dense or "
                         "FactorizedLinear.from_dense on it")
    exclude = _check_exclude(model, exclude)
    targets = []
    for name, module in model.named_modules():
        if not name or any(name == e or name.startswith(e + ".") for e in exclude):
            continue
        if isinstance(module, nn.Conv2d):
            targets.append((name, FactorizedConv2d.from_dense(module, rank=rank, layout=layout, sparse=sparse)))
        elif isinstance(module, nn.Linear):
            targets.append((name, FactorizedLinear.from_dense(module, rank=rank, sparse=sparse)))
    for name, new in targets:
        _replace(model, name, new)
    return model


def factorized_layers(model: nn.Module) -> list[nn.Module]:
    """All FactorizedConv2d / FactorizedLinear layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (FactorizedConv2d, FactorizedLinear))]


def sparsity_loss(model: nn.Module) -> torch.Tensor:
    """Σ over the model's factorized layers of ‖μ‖₁ (Factorized-FL Eq. 6), differentiable."""
    losses = [layer.sparsity_loss() for layer in factorized_layers(model)]
    if not losses:
        param = next(model.parameters(), None)
        return torch.zeros((), device=None if param is None else param.device)
    return torch.stack(losses).sum()

"""Converters that turn any model's Conv2d / Linear layers into factorized or multi-branch
layers in place, and helpers that address those layers' parameter groups."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..ops import project_simplex_
from ._convertible import check_allow_subclasses, check_convertible
from .factorized import FactorizedConv2d, FactorizedLinear
from .multibranch import MultiBranchConv2d, MultiBranchLinear


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
              exclude: Iterable[str] = (), allow_subclasses=False) -> nn.Module:
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
        allow_subclasses: convert subclasses of Conv2d/Linear that override ``forward``
            (refused by default, since the factorized layer computes the base class's
            function): True for all, or a class or classes to accept exactly those.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: a name in ``exclude`` that the model does not have; ``model`` itself a
            Conv2d/Linear; a module that cannot be replaced exactly (a subclass overriding
            ``forward`` not allowed by ``allow_subclasses``, parametrizations, hooks, an
            uninitialised lazy module), named with its class.  Nothing is changed when it raises.
    """
    def make(module):
        if isinstance(module, nn.Conv2d):
            return FactorizedConv2d.from_dense(module, rank=rank, layout=layout, sparse=sparse,
                                               allow_subclasses=allow_subclasses)
        return FactorizedLinear.from_dense(module, rank=rank, sparse=sparse, allow_subclasses=allow_subclasses)

    return _convert(model, exclude, allow_subclasses, make, "FactorizedConv2d.from_dense or FactorizedLinear.from_dense")


def _convert(model: nn.Module, exclude: Iterable[str], allow_subclasses, make, from_dense_names: str) -> nn.Module:
    """Replace every Conv2d/Linear outside ``exclude`` by ``make(module)``, in place.  Checks
    every module first, so nothing changes when it raises."""
    if isinstance(model, (nn.Conv2d, nn.Linear)):
        raise ValueError(f"model is itself a Conv2d/Linear; use {from_dense_names} on it")
    check_allow_subclasses(allow_subclasses)
    exclude = _check_exclude(model, exclude)
    found = []
    for name, module in model.named_modules():
        if not name or any(name == e or name.startswith(e + ".") for e in exclude):
            continue
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            kind = nn.Conv2d if isinstance(module, nn.Conv2d) else nn.Linear
            check_convertible(module, kind, allow_subclasses=allow_subclasses, where=repr(name))
            found.append((name, module))
    targets = [(name, make(module)) for name, module in found]
    for name, new in targets:
        _replace(model, name, new)
    return model


def multibranch(model: nn.Module, *, branches: int, simplex: str = "softmax", shared_alpha: bool = False,
                exclude: Iterable[str] = (), noise: float = 0.0, allow_subclasses=False) -> nn.Module:
    """Replace every ``nn.Conv2d`` and ``nn.Linear`` of ``model`` by its multi-branch version, in place.

    Each layer becomes ``MultiBranchConv2d.from_dense`` / ``MultiBranchLinear.from_dense`` of
    itself (pFedMB Eq. 1–2), so with noise=0 the model computes the same function as before.

    Args:
        branches: B >= 1.  simplex: 'softmax' or 'project' (see the layers).
        shared_alpha: one α for the whole model (pFedMB Section 5.2) instead of one per layer:
            every converted layer then holds the same ``alpha_param`` Parameter.
        exclude: qualified module names to leave dense (their children too).
        noise: symmetry-breaking noise of the branches, relative to each weight's std.
        allow_subclasses: as for ``factorize``.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: bad branches/simplex/noise; and every error of ``factorize``.
    """
    def make(module):
        kind = MultiBranchConv2d if isinstance(module, nn.Conv2d) else MultiBranchLinear
        return kind.from_dense(module, branches=branches, noise=noise, simplex=simplex,
                               allow_subclasses=allow_subclasses)

    _convert(model, exclude, allow_subclasses, make, "MultiBranchConv2d.from_dense or MultiBranchLinear.from_dense")
    layers = multibranch_layers(model)
    if shared_alpha and layers:
        shared = layers[0].alpha_param
        for layer in layers[1:]:
            layer.alpha_param = shared
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


def multibranch_layers(model: nn.Module) -> list[nn.Module]:
    """All MultiBranchConv2d / MultiBranchLinear layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (MultiBranchConv2d, MultiBranchLinear))]


def branch_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The branch weights and biases W_b of every multi-branch layer (pFedMB's W group)."""
    return [p for layer in multibranch_layers(model) for p in (layer.branch_weight, layer.branch_bias)
            if p is not None]


def alpha_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The α parameters of the multi-branch layers, each once (a shared α appears once).

    pFedMB trains α with W fixed, then W with α fixed: give the two groups to two optimizers
    or to one optimizer as two parameter groups.
    """
    seen: dict[int, nn.Parameter] = {}
    for layer in multibranch_layers(model):
        seen.setdefault(id(layer.alpha_param), layer.alpha_param)
    return list(seen.values())


@torch.no_grad()
def project_alpha_(model: nn.Module) -> None:
    """Project every α of ``simplex='project'`` layers back onto the simplex (after an optimizer step)."""
    for layer in multibranch_layers(model):
        if layer.simplex == "project":
            project_simplex_(layer.alpha_param)

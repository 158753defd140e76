"""Converters that turn any model's Conv2d / Linear layers into factorized or multi-branch
layers in place, and helpers that address those layers' parameter groups."""
from __future__ import annotations

import collections.abc
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from ..ops import project_simplex_
from ._convertible import check_allow_subclasses, check_convertible, describe
from .factorized import FactorizedConv2d, FactorizedLinear
from .multibranch import MultiBranchConv2d, MultiBranchLinear, check_noise


@dataclass(frozen=True)
class _Conversion:
    """What differs between the two converters.

    ``ties`` names, for the dense weight and bias, the new layer's parameters made from
    them: dense layers that share a Parameter (tied weights) become layers that share these,
    so the tie holds exactly.  Layers linked by a chain of such ties also share
    ``tied_together`` (multi-branch layers: α, since their combined weights are equal only
    under the same α).
    """

    converter: str
    for_a_bare_layer: str
    ties: dict[str, tuple[str, ...]]
    tied_together: tuple[str, ...] = ()


_FACTORIZE = _Conversion("factorize", "use FactorizedConv2d.from_dense or FactorizedLinear.from_dense on it",
                         FactorizedConv2d.made_from)
_MULTIBRANCH = _Conversion("multibranch", "use MultiBranchConv2d.from_dense or MultiBranchLinear.from_dense on it",
                           {"weight": ("branch_weight",), "bias": ("branch_bias",)}, ("alpha_param",))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _check_exclude(names: set[str], exclude: Optional[Iterable[str]]) -> set[str]:
    """``exclude`` (None, one name or an iterable of names) as a set of names of ``names``."""
    if exclude is None:
        return set()
    if isinstance(exclude, str):
        exclude = (exclude,)
    if not isinstance(exclude, collections.abc.Iterable):
        raise TypeError(f"exclude must be a module name, an iterable of them, or None, got {exclude!r}")
    exclude = set(exclude)
    unknown = sorted(exclude - names)
    if unknown:
        raise ValueError(f"exclude names modules the model does not have: {unknown}")
    return exclude


def factorize(model: nn.Module, *, rank: int = 1, layout: str = "spatial", sparse: bool = True,
              exclude: Optional[Iterable[str]] = (), allow_subclasses=False) -> nn.Module:
    """Replace every ``nn.Conv2d`` and ``nn.Linear`` of ``model`` (at any depth) in place.

    Each layer becomes ``FactorizedConv2d.from_dense`` / ``FactorizedLinear.from_dense``
    of itself, so with sparse=True the model computes the same function as before.

    A module registered under several names becomes one factorized layer registered under
    all of them.  Layers that share a Parameter (tied weights or biases) become layers that
    share the corresponding u, v, mu (or bias) Parameters, so they stay tied.

    Args:
        model: any module (nested, Sequential, residual blocks...).  A bare Conv2d/Linear
            cannot be replaced in place: use ``from_dense`` on it.
        rank, sparse: as for the layers.  layout: for convolutions ('spatial', 'simfed', 'view');
            linears always use 'linear'.
        exclude: qualified module names (as in ``model.named_modules()``) to leave dense,
            e.g. the classifier; a module inside an excluded one is left dense too.  None
            excludes nothing.
        allow_subclasses: convert subclasses of Conv2d/Linear that override ``forward``
            (refused by default, since the factorized layer computes the base class's
            function): True for all, or a class or classes to accept exactly those.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``sparse`` is not a bool.
        ValueError: a bad rank or layout (checked first, whatever the model holds); a name
            in ``exclude`` that the model does not have; ``model`` itself a
            Conv2d/Linear; a module that cannot be replaced exactly (a subclass overriding
            ``forward`` not allowed by ``allow_subclasses``, an instance-level ``forward``,
            parametrizations, module hooks or gradient hooks on its weight or bias, a parameter,
            buffer or submodule besides its weight and bias, an uninitialised lazy module, a
            non-finite weight), named with its class; a module excluded under one
            of its names only; a layer whose weight or bias is also used by a module that
            stays as it is (e.g. a classifier tied to an embedding), naming both places.
            Nothing is changed when it raises.
    """
    # The layers' own checks of rank, layout and sparse, on the meta device (nothing allocated),
    # so a bad argument is refused even where no layer would use it.
    FactorizedConv2d(1, 1, 1, rank=rank, layout=layout, sparse=sparse, device="meta")
    FactorizedLinear(1, 1, rank=rank, sparse=sparse, device="meta")

    def make(module):
        if isinstance(module, nn.Conv2d):
            return FactorizedConv2d.from_dense(module, rank=rank, layout=layout, sparse=sparse,
                                               allow_subclasses=allow_subclasses)
        return FactorizedLinear.from_dense(module, rank=rank, sparse=sparse, allow_subclasses=allow_subclasses)

    _convert(model, exclude, allow_subclasses, make, _FACTORIZE)
    return model


def _convert(model: nn.Module, exclude: Optional[Iterable[str]], allow_subclasses, make,
             conversion: _Conversion, check_targets=None) -> list[nn.Module]:
    """Replace every Conv2d/Linear outside ``exclude`` by ``make(module)``, in place, under every
    name it has, keeping tied parameters tied (``conversion.ties``); return the new layers in
    module order.  ``check_targets(targets)``, if given, sees the (module, names) to replace
    once each module passed its own checks.  Checks everything first, so nothing changes when
    it raises."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (nn.Conv2d, nn.Linear)):
        raise ValueError(f"model is itself a Conv2d/Linear; {conversion.for_a_bare_layer}")
    check_allow_subclasses(allow_subclasses)
    named = list(model.named_modules(remove_duplicate=False))
    exclude = _check_exclude({name for name, _ in named}, exclude)
    targets = _targets(named, exclude)
    for module, names in targets:
        kind = nn.Conv2d if isinstance(module, nn.Conv2d) else nn.Linear
        check_convertible(module, kind, allow_subclasses=allow_subclasses, where=repr(names[0]))
    if check_targets is not None:
        check_targets(targets)
    tied_groups = _tied_groups(model, targets, conversion.converter)
    new = {id(module): make(module) for module, _ in targets}
    _tie(tied_groups, new, conversion)
    for module, names in targets:
        for name in names:
            _replace(model, name, new[id(module)])
    return list(new.values())


def _targets(named: list[tuple[str, nn.Module]], exclude: set[str]) -> list[tuple[nn.Module, list[str]]]:
    """The Conv2d/Linear modules to replace, each once with every name it is registered under
    (``named`` lists a shared module under each of its names).  Raises for a module excluded
    under some of its names only: converting it would change the others too."""
    def excluded(name):
        return any(name == e or name.startswith(e + ".") for e in exclude)

    found: dict[int, tuple[nn.Module, list[str]]] = {}
    found_names: set[str] = set()
    for name, module in named:
        # A module inside a replaced one goes away with it.  named_modules lists a module before
        # what it holds, so its name is in found_names by then: looking up each prefix of a name
        # keeps this linear in the number of modules (scanning every found name was quadratic:
        # 5.5 s for 16k modules).
        if name and isinstance(module, (nn.Conv2d, nn.Linear)) and not _inside(name, found_names):
            found.setdefault(id(module), (module, []))[1].append(name)
            found_names.add(name)
    targets = []
    for module, names in found.values():
        left_out = [name for name in names if excluded(name)]
        if left_out and len(left_out) < len(names):
            kept = next(name for name in names if not excluded(name))
            raise ValueError(f"{left_out[0]!r} and {kept!r} are the same {type(module).__qualname__} module, "
                             f"excluded under the first name only; exclude both names or neither")
        if not left_out:
            targets.append((module, names))
    return targets


def _inside(name: str, names: set[str]) -> bool:
    """Whether ``name`` is a module inside one of ``names`` (one of them is a dotted prefix of it)."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in names for i in range(1, len(parts)))


def _tied_groups(model: nn.Module, targets: list[tuple[nn.Module, list[str]]],
                 converter: str) -> list[tuple[str, list[nn.Module]]]:
    """(role, modules) for every weight or bias Parameter that several target modules share.

    Raises when a target's weight or bias is also registered somewhere that will not be
    converted (an embedding tied to a classifier, an excluded layer, a parent's own
    Parameter): the conversion would untie them.
    """
    places: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        places.setdefault(id(param), []).append(name)
    converted = {f"{name}.{role}" for module, names in targets for name in names for role in ("weight", "bias")}
    groups: dict[int, tuple[str, list[nn.Module]]] = {}
    for module, names in targets:
        for role in ("weight", "bias"):
            param = module._parameters.get(role)
            if param is None:
                continue
            for place in places[id(param)]:
                if place not in converted:
                    raise ValueError(
                        f"the {role} of {describe(repr(names[0]), module)} is the same Parameter as {place!r}, "
                        f"which {converter} does not convert, so converting would untie them; exclude "
                        f"{names[0]!r}, or untie the two first")
            group = groups.setdefault(id(param), (role, []))[1]
            if not any(m is module for m in group):
                group.append(module)
    return [(role, modules) for role, modules in groups.values() if len(modules) > 1]


def _tie(groups: list[tuple[str, list[nn.Module]]], new: dict[int, nn.Module], conversion: _Conversion) -> None:
    """Make the new layers of each group share the first one's ``conversion.ties[role]``
    parameters, and every layer linked through groups share one set of
    ``conversion.tied_together`` parameters."""
    root = {key: key for key in new}

    def find(key):
        while root[key] != key:
            key = root[key]
        return key

    for role, modules in groups:
        first = new[id(modules[0])]
        for module in modules[1:]:
            for attr in conversion.ties[role]:
                if hasattr(first, attr):  # a FedPara Linear has no t1, t2
                    setattr(new[id(module)], attr, getattr(first, attr))
            root[find(id(module))] = find(id(modules[0]))
    for key, layer in new.items():
        for attr in conversion.tied_together:
            setattr(layer, attr, getattr(new[find(key)], attr))


def multibranch(model: nn.Module, *, branches: int, simplex: str = "softmax", shared_alpha: bool = False,
                exclude: Optional[Iterable[str]] = (), noise: float = 0.0, allow_subclasses=False) -> nn.Module:
    """Replace every ``nn.Conv2d`` and ``nn.Linear`` of ``model`` by its multi-branch version, in place.

    Each layer becomes ``MultiBranchConv2d.from_dense`` / ``MultiBranchLinear.from_dense`` of
    itself (pFedMB Eq. 1–2), so with noise=0 the model computes the same function as before.

    A module registered under several names becomes one multi-branch layer registered under
    all of them.  Layers that share a Parameter (tied weights or biases) become layers that
    share the corresponding branch Parameters and one α, so they stay tied.

    Args:
        branches: B >= 1.  simplex: 'softmax' or 'project' (see the layers).
        shared_alpha: one α for the whole model (pFedMB Section 5.2) instead of one per layer:
            every layer this call converts then holds the same ``alpha_param`` Parameter
            (multi-branch layers the model had before keep theirs).  The layers must then
            share one dtype and device (α's).
        exclude: qualified module names to leave dense (their children too); None: none.
        noise: symmetry-breaking noise of the branches, relative to each weight's std.
        allow_subclasses: as for ``factorize``.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: bad branches/simplex/noise (checked first, whatever the model holds); with
            shared_alpha, two layers to convert whose weights differ in dtype or device (one α
            cannot serve both), naming them; and every error of ``factorize``.
    """
    # The layers' own checks of branches and simplex on the meta device, and noise's, so a bad
    # argument is refused even where no layer would use it.
    MultiBranchLinear(1, 1, branches=branches, simplex=simplex, device="meta")
    check_noise(noise)
    if not isinstance(shared_alpha, bool):
        raise TypeError(f"shared_alpha must be a bool, got {shared_alpha!r}")

    def make(module):
        kind = MultiBranchConv2d if isinstance(module, nn.Conv2d) else MultiBranchLinear
        return kind.from_dense(module, branches=branches, noise=noise, simplex=simplex,
                               allow_subclasses=allow_subclasses)

    layers = _convert(model, exclude, allow_subclasses, make, _MULTIBRANCH,
                      _one_dtype_and_device if shared_alpha else None)
    if shared_alpha and layers:
        shared = layers[0].alpha_param
        # One α for all: trained wherever one of the dense weights it weighs was.
        shared.requires_grad_(any(layer.alpha_param.requires_grad for layer in layers))
        for layer in layers[1:]:
            layer.alpha_param = shared
    return model


def _one_dtype_and_device(targets: list[tuple[nn.Module, list[str]]]) -> None:
    """ValueError naming two of ``targets`` whose weights differ in dtype or device: a shared α
    (made in the first one's) would fail the other's forward."""
    if not targets:
        return
    first, first_names = targets[0]
    for module, names in targets[1:]:
        if (module.weight.dtype, module.weight.device) != (first.weight.dtype, first.weight.device):
            raise ValueError(
                f"shared_alpha=True needs every layer it converts in one dtype and on one device, but "
                f"{describe(repr(first_names[0]), first)} has a {first.weight.dtype} weight on {first.weight.device} "
                f"and {describe(repr(names[0]), module)} a {module.weight.dtype} one on {module.weight.device}; "
                f"move the model to one dtype and device first, or use shared_alpha=False")


def factorized_layers(model: nn.Module) -> list[nn.Module]:
    """All FactorizedConv2d / FactorizedLinear layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (FactorizedConv2d, FactorizedLinear))]


_SPARSITY_REDUCTIONS = ("sum", "mean")


def sparsity_loss(model: nn.Module, reduction: str = "sum") -> torch.Tensor:
    """The L1 penalty on μ of the model's factorized layers, differentiable (each shared μ once).

    ``reduction='sum'`` (default): Σ_layers ‖μ‖₁, the term the papers weigh with λ
    (Factorized-FL Eq. 6, λ_sparsity‖M‖₁; SimFed Eq. 7, λ1‖φ‖₁).  The papers start μ at zero
    (u, v Xavier-uniform), so the term starts at 0 and grows as μ learns; their λ: SimFed's
    λ1 = 1e-4, the released Factorized-FL code's 5e-4 (its threshold on |μ| as well).  After
    ``factorize`` μ holds each weight minus its rank-r part, so the sum starts large:
    197,343 on ResNet-18 (torchvision's init, rank 1, fc left dense), which λ = 1e-4 turns
    into ~20 against a cross-entropy of ~2.3.  That value does not make the penalty strong:
    its gradient on each μ entry is λ·sign(μ) whatever the model's size.

    ``reduction='mean'``: the same sum divided by the number of μ entries (11,166,912 there, a
    mean of 0.0177), a value on the task loss's scale.  Its gradient per entry is λ·sign(μ)/N,
    so λ_mean = λ_sum·N reproduces the papers' penalty; use it to log or compare the term
    across models, or with a λ tuned per entry.  0 for both when there is no μ.

    Raises:
        ValueError: ``reduction`` is not 'sum' or 'mean'.
    """
    if not isinstance(reduction, str) or reduction not in _SPARSITY_REDUCTIONS:
        raise ValueError(f"reduction must be one of {_SPARSITY_REDUCTIONS}, got {reduction!r}")
    # Each μ once: tied layers share theirs (one Parameter, one penalty).
    mus = _each_once(layer.mu for layer in factorized_layers(model))
    if not mus:
        param = next(model.parameters(), None)
        return torch.zeros((), device=None if param is None else param.device)
    total = torch.stack([mu.abs().sum() for mu in mus]).sum()
    if reduction == "mean":
        total = total / sum(mu.numel() for mu in mus)
    return total


def multibranch_layers(model: nn.Module) -> list[nn.Module]:
    """All MultiBranchConv2d / MultiBranchLinear layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (MultiBranchConv2d, MultiBranchLinear))]


def branch_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The branch weights and biases W_b of every multi-branch layer (pFedMB's W group), each once
    (tied layers share theirs)."""
    return _each_once(p for layer in multibranch_layers(model) for p in (layer.branch_weight, layer.branch_bias))


def alpha_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The α parameters of the multi-branch layers, each once (a shared α appears once).

    pFedMB trains α with W fixed, then W with α fixed: give the two groups to two optimizers
    or to one optimizer as two parameter groups.
    """
    return _each_once(layer.alpha_param for layer in multibranch_layers(model))


@torch.no_grad()
def project_alpha_(model: nn.Module) -> None:
    """Project every α of ``simplex='project'`` layers back onto the simplex (after an optimizer step)."""
    for alpha in _each_once(layer.alpha_param for layer in multibranch_layers(model) if layer.simplex == "project"):
        project_simplex_(alpha)


def _each_once(params: Iterable[Optional[nn.Parameter]]) -> list[nn.Parameter]:
    """``params`` without None and without repeats (shared Parameters), in first-seen order."""
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        if p is not None:
            seen.setdefault(id(p), p)
    return list(seen.values())

"""Which dense layers a drop-in layer can replace without changing what the model computes.

A converted layer computes ``nn.Conv2d``'s (or ``nn.Linear``'s) function of its weight and
bias, and nothing else.  So a dense module is refused, with an error naming it, when its
output is something else or it does more than that:

* a subclass that overrides ``forward`` (or ``Conv2d._conv_forward``), or defines
  ``weight`` / ``bias`` on the class (weight standardization, custom padding, ...), unless
  ``allow_subclasses`` vouches for it.  Subclasses that override none of these (e.g.
  ``nn.MultiheadAttention``'s ``NonDynamicallyQuantizableLinear``) are converted;
* a module with parametrizations (``torch.nn.utils.parametrize``: ``weight_norm``,
  ``spectral_norm``, ``orthogonal``), with forward / backward hooks (the older
  ``torch.nn.utils.weight_norm`` and ``spectral_norm``, ``torch.nn.utils.prune``), with
  gradient hooks on its weight or bias (``weight.register_hook``, a gradient mask), or with
  ``forward`` set on the instance (a wrapper patched in): the new layer would silently drop them;
* a module holding a parameter, buffer or submodule besides its weight and bias (a subclass's
  extra state): the new layer would drop it, state_dict entry included;
* a lazy module (``nn.LazyLinear``) whose parameters are not initialised yet;
* a module whose weight holds a NaN or Inf: nothing can be made from it (factorize's
  decomposition fails on it, the other layers would carry it on).
"""
from __future__ import annotations

import collections.abc

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..ops._checks import has_values, values_finite

# The attributes through which a subclass changes what the layer computes.
_COMPUTING_ATTRIBUTES = {nn.Conv2d: ("forward", "_conv_forward", "weight", "bias"),
                         nn.Linear: ("forward", "weight", "bias")}
_HOOKS = {"_forward_pre_hooks": "forward pre-", "_forward_hooks": "forward ",
          "_backward_pre_hooks": "backward pre-", "_backward_hooks": "backward "}


def check_allow_subclasses(allow_subclasses) -> bool | frozenset[type]:
    """``allow_subclasses`` as True/False or a set of classes; TypeError for anything else.

    Accepted: a bool, or one class or an iterable of classes derived from ``nn.Conv2d`` or
    ``nn.Linear``.
    """
    if isinstance(allow_subclasses, bool):
        return allow_subclasses
    classes = (allow_subclasses,) if isinstance(allow_subclasses, type) else allow_subclasses
    if isinstance(classes, collections.abc.Iterable) and not isinstance(classes, str):
        classes = tuple(classes)
        if all(isinstance(c, type) and issubclass(c, tuple(_COMPUTING_ATTRIBUTES)) for c in classes):
            return frozenset(classes)
    raise TypeError("allow_subclasses must be a bool, or a class or classes derived from nn.Conv2d / nn.Linear, "
                    f"got {allow_subclasses!r}")


def describe(name: str, module: nn.Module) -> str:
    """How errors name a module: its qualified name and its class."""
    return f"{name} ({type(module).__qualname__})"


def check_convertible(module: nn.Module, kind: type, *, allow_subclasses=False, where: str = "module") -> None:
    """Raise unless a drop-in layer can replace ``module``, an instance of ``kind``
    (``nn.Conv2d`` or ``nn.Linear``), and compute exactly what it computes.

    ``where`` names the module in the messages (a qualified name for the converters).

    Raises:
        TypeError: ``module`` is not a ``kind``; a bad ``allow_subclasses``.
        ValueError: ``module`` is lazy and uninitialised, has parametrizations, hooks or an
            instance-level ``forward``, holds state besides its weight and bias, is a subclass
            of ``kind`` that changes what it computes and is not allowed by
            ``allow_subclasses``, or has a non-finite weight (see the module docstring).
    """
    if not isinstance(module, kind):
        raise TypeError(f"module must be an nn.{kind.__name__}, got {type(module).__name__}")
    allowed = check_allow_subclasses(allow_subclasses)
    where = describe(where, module)
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
        raise ValueError(f"{where} is a lazy module whose parameters are not initialised yet; run one forward "
                         "pass through the model before converting it")
    if parametrize.is_parametrized(module):
        names = ", ".join(sorted(module.parametrizations))
        raise ValueError(f"{where} has parametrizations on {names} (torch.nn.utils.parametrize: weight_norm, "
                         "spectral_norm, ...), which the converted layer would drop; remove them first "
                         "(torch.nn.utils.parametrize.remove_parametrizations) or exclude the module")
    _check_hooks(module, where)
    _check_own_attributes(module, kind, where)
    _check_class(module, kind, allowed, where)
    _check_finite(module, where)


def _check_hooks(module: nn.Module, where: str) -> None:
    """ValueError if ``module`` has module hooks, or gradient hooks on its weight or bias."""
    hooks = [what for attr, what in _HOOKS.items() if getattr(module, attr, None)]
    if hooks:
        raise ValueError(f"{where} has {' and '.join(h + 'hooks' for h in hooks)} (as torch.nn.utils.weight_norm, "
                         "spectral_norm and prune add), which the converted layer would not run; remove them "
                         "first (and add them to the new layer if they still apply) or exclude the module")
    for role in ("weight", "bias"):
        param = module._parameters.get(role)
        # Tensor.register_hook and register_post_accumulate_grad_hook keep theirs on the tensor.
        if param is not None and (param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None)):
            raise ValueError(f"{where} has a gradient hook on its {role} (Tensor.register_hook or "
                             f"register_post_accumulate_grad_hook), which the converted layer's parameters would "
                             f"not have; remove it first (and add it to the new layer's parameters if it still "
                             f"applies) or exclude the module")


def _check_own_attributes(module: nn.Module, kind: type, where: str) -> None:
    """ValueError if ``module`` sets a computing attribute on the instance (a patched ``forward``,
    which the class checks cannot see), or holds a parameter, buffer or submodule besides its
    weight and bias (the new layer would drop it)."""
    patched = [a for a in _COMPUTING_ATTRIBUTES[kind] if a in vars(module)]
    if patched:
        raise ValueError(f"{where} has {', '.join(patched)} set on the instance (not its class), which the "
                         f"converted layer would not run; remove it first (del module.{patched[0]}) or exclude "
                         f"the module")
    extra = ([f"parameter {n!r}" for n in module._parameters if n not in ("weight", "bias")]
             + [f"buffer {n!r}" for n in module._buffers] + [f"submodule {n!r}" for n in module._modules])
    if extra:
        raise ValueError(f"{where} holds {', '.join(extra)} besides its weight and bias, which the converted layer "
                         f"would drop (state_dict entries included); exclude the module, or move them elsewhere")


def _check_class(module: nn.Module, kind: type, allowed, where: str) -> None:
    """ValueError if ``module``'s class overrides what ``kind`` computes and ``allowed`` (checked
    ``allow_subclasses``) does not vouch for it."""
    cls = type(module)
    if cls is kind or allowed is True or cls in (allowed or ()):
        return
    changed = [a for a in _COMPUTING_ATTRIBUTES[kind] if getattr(cls, a, None) is not getattr(kind, a, None)]
    if changed:
        raise ValueError(f"{where} is a subclass of nn.{kind.__name__} that overrides {', '.join(changed)}, so the "
                         f"converted layer, which computes nn.{kind.__name__}'s function of its weight, may compute "
                         f"something else; exclude the module, or pass allow_subclasses=True (or a set holding "
                         f"{cls.__qualname__}) if it computes the same")


def _check_finite(module: nn.Module, where: str) -> None:
    """ValueError if ``module``'s weight holds a NaN or Inf (not checked where it has no values:
    on the meta device, under FakeTensorMode)."""
    weight = module.weight
    if isinstance(weight, torch.Tensor) and has_values(weight) and not values_finite(weight):
        raise ValueError(f"{where} has a non-finite weight (NaN or Inf), from which no converted layer can be made; "
                         f"re-initialise or repair the weight first, or exclude the module")

"""The ``pfl`` operator namespace, the registry behind ``backend_info()``, and what every op
gets from autograd whatever its kernel.

Schemas, fake kernels and autograd are defined in Python (``ops/<family>.py``); C++
kernels register per device with ``TORCH_LIBRARY_IMPL(pfl, CPU, m)``; Triton kernels
register for CUDA; the plain-PyTorch reference is the default for every other device.

Two things are registered here for every op, above the kernels, so no kernel can miss them:

* an op that writes one of its arguments (``Tensor(a!)`` in its schema) bumps the autograd
  version counter of that argument, and refuses inputs that need a gradient
  (``_guard_mutation``);
* ``register_autograd`` registers a backward (and a forward-mode) formula that also works
  inside ``torch.func`` transforms.

Both need private torch API, because the public ``torch.library`` cannot do either
(tests/kernels/test_public_torch_limits.py fails when a torch release can, so the private
use can go):

* the redispatch below autograd (``torch._C._AutoDispatchBelowAutograd``,
  ``torch._C._after_autograd_keyset``, ``OpOverload.redispatch``), which every Python
  autograd kernel needs, torch's own ``register_autograd`` included: that one fails inside
  ``torch.func`` (pytorch/pytorch#168393, #170834), takes no forward-mode formula (a
  ``register_jvp`` was proposed and closed unmerged, pytorch/pytorch#131116), and refuses
  ops that write an argument, for which it has no replacement;
* inside a ``torch.func`` transform, functorch's single-level Function
  (``torch.autograd.function._SingleLevelFunction``,
  ``torch._functorch.utils.enable_single_level_autograd_function``,
  ``torch._C._are_functorch_transforms_active``) and the forward-mode grad switch
  (``torch._C._is_fwd_grad_enabled``, ``torch.autograd.forward_ad._set_fwd_grad_enabled``):
  what torch.func itself runs a custom Function with, and what upstream's fix of
  ``register_autograd`` uses (pytorch/pytorch#184974);
* ``OpOverload._schema``, the only way to read a defined op's arguments (torch.library's
  own functions read it too);
* ``forward_ad._current_level``, for host time only (``_may_carry_tangents``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.autograd import forward_ad
from torch.autograd.forward_ad import _set_fwd_grad_enabled

NAMESPACE = "pfl"
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

# qualified op name -> {device: name of the fast implementation meant for it}
FAST_PATHS: dict[str, dict[str, str]] = {}
# qualified op name -> its plain-PyTorch reference kernel (the default for every device
# without a kernel of its own; tests also run it on CPU in place of the C++ kernel)
REFERENCE_KERNELS: dict[str, Callable] = {}

try:  # the base class functorch runs autograd.Functions on inside a transform
    from torch._functorch.utils import enable_single_level_autograd_function
    from torch.autograd.function import _SingleLevelFunction
except ImportError:  # pragma: no cover  (a torch without it: no torch.func support, a clear error there)
    import contextlib

    _SingleLevelFunction = torch.autograd.Function
    enable_single_level_autograd_function = contextlib.nullcontext


def define_op(schema: str, reference, *, cpu: str = "cpp", cuda: Optional[str] = "triton") -> str:
    """Define ``pfl::<schema>`` with ``reference`` as the default kernel for every device.

    ``cpu`` / ``cuda`` name the fast implementations expected for those devices (they
    register themselves); ``backend_info()`` reports whether they did.  ``cuda=None``: the
    reference is the CUDA implementation by design.  An op that mutates
    an argument also gets ``_guard_mutation``'s kernels.
    """
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    # CompositeExplicitAutograd: used for any device that has no kernel of its own;
    # a CPU or CUDA registration takes precedence over it.
    LIB.impl(name, reference, "CompositeExplicitAutograd")
    qualname = f"{NAMESPACE}::{name}"
    FAST_PATHS[qualname] = {"cpu": cpu, "cuda": cuda or "reference"}
    REFERENCE_KERNELS[qualname] = reference
    op = op_overload(qualname)
    if op._schema.is_mutable:
        _guard_mutation(name, qualname, op)
    return qualname


def op_overload(qualname: str):
    """``torch.ops.pfl.<name>.<overload>`` for ``'pfl::<name>[.<overload>]'``."""
    name, _, overload = qualname.split("::", 1)[1].partition(".")
    return getattr(getattr(torch.ops.pfl, name), overload or "default")


def has_kernel(qualname: str, dispatch_key: str) -> bool:
    """Whether a kernel is registered for ``qualname`` under ``dispatch_key`` (e.g. 'CPU')."""
    return op_overload(qualname).has_kernel_for_dispatch_key(dispatch_key)


def _guard_mutation(name: str, qualname: str, op) -> None:
    """Make autograd see every write of ``op`` (an op whose schema mutates an argument).

    A kernel that writes through a raw pointer (C++, Triton) leaves the version counter of
    the tensor alone, so autograd would silently use the new values where it saved the old
    ones; the Autograd kernel bumps it for every written argument, whichever kernel runs
    below.  These ops have no derivative, so it also refuses inputs that need one, as
    torch's ``out=`` variants do, rather than leave a gradient that ignores the write.

    Private dispatcher API, as in torch's own autograd kernels: ``torch.library`` has no
    public way to do either for an op defined from a schema.  ``register_autograd`` refuses
    an op that mutates an argument, and ``custom_op``'s version bump comes only with an op
    whose default kernel is a Python function, which lets a leaf that requires grad be
    written without a word (tests/kernels/test_public_torch_limits.py).
    """
    written = [arg.name for arg in op._schema.arguments if arg.alias_info is not None and arg.alias_info.is_write]
    positional = [arg.name for arg in op._schema.arguments if not arg.kwarg_only]

    def autograd(keyset, *args, **kwargs):
        filled, keyword_only = _fill_defaults(op._schema, args, kwargs)
        values = dict(zip(positional, filled), **keyword_only)
        if torch.is_grad_enabled():
            needing = [n for n, t in values.items() if isinstance(t, torch.Tensor) and t.requires_grad]
            if needing:
                raise RuntimeError(
                    f"{qualname} writes {', '.join(written)} in place and has no "
                    f"derivative, but {', '.join(needing)} requires grad: call it under torch.no_grad()")
        torch.autograd.graph.increment_version([values[n] for n in written])
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    LIB.impl(name, autograd, "Autograd", with_keyset=True)


def _fill_defaults(schema, args, kwargs) -> tuple[tuple, dict]:
    """(positional, keyword-only) arguments of a call as the dispatcher passes them, which
    leaves out trailing arguments at their defaults, with those defaults filled back in."""
    positional = list(args)
    keyword_only = {}
    for i, arg in enumerate(schema.arguments):
        if arg.kwarg_only:
            keyword_only[arg.name] = kwargs[arg.name] if arg.name in kwargs else arg.default_value
        elif i >= len(positional):
            positional.append(arg.default_value)
    return tuple(positional), keyword_only


def _may_carry_tangents(args) -> bool:
    """Whether a tensor among ``args`` may carry a forward-mode tangent.

    Outside a dual level none can: torch's own ``forward_ad.unpack_dual`` reads the private
    ``forward_ad._current_level`` for that, and so does this, because asking each tensor
    through ``unpack_dual`` costs about 1 us a tensor on every op call (9.8 us against 0.1 us
    for factorized_weight_backward's five tensors under no_grad).  A torch without the
    attribute gets the per-tensor check.
    """
    level = getattr(forward_ad, "_current_level", None)
    if level is not None and level < 0:
        return False
    return any(isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args)


def sum_defined(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """a + b, where None stands for zero (None when both are): for autograd formulas whose
    terms may be absent."""
    return b if a is None else a if b is None else a + b


@dataclass
class _Call:
    """What the autograd kernel passes through the Function to the redispatch: the keys, the
    keyword-only arguments, and inside a torch.func transform the caller's (grad, forward
    grad) modes (see ``register_autograd``)."""

    keyset: Any  # the DispatchKeySet the autograd kernel was called with
    kwargs: dict
    transform_modes: Optional[tuple[bool, bool]]


def register_autograd(qualname: str, backward: Callable, setup_context: Callable,
                      jvp: Optional[Callable] = None) -> None:
    """Register ``backward`` (and ``jvp``, forward mode) as the autograd of ``qualname``.

    The contract is ``torch.library.register_autograd``'s: ``setup_context(ctx, inputs,
    keyword_only_inputs, output)`` (defaults filled in); ``backward(ctx, *grads)`` returns
    one gradient per positional input; ``jvp(ctx, *tangents)`` gets one tangent per
    positional input (None where there is none) and returns one per output.

    Unlike ``torch.library.register_autograd``, the formula also runs in forward mode and
    inside ``torch.func`` transforms (grad, jacrev, vmap of grad, jvp, hessian): torch wraps
    it in an ``autograd.Function`` that functorch refuses (pytorch/pytorch#168393) and that
    has no jvp.  Inside a transform it runs as a single-level Function, which is how
    functorch itself runs autograd there and what upstream's fix uses
    (pytorch/pytorch#184974): the kernel runs at the transform's level, like a built-in op's
    autograd kernel, and the redispatch below autograd reaches the levels underneath (a vmap
    rule, the kernels).  An ordinary Function with a ``setup_context``, the public way into
    torch.func, cannot be applied there: inside an autograd kernel functorch's
    ``custom_function_call`` finds no kernel for the Autograd key.  Elsewhere it is an
    ordinary Function (compiled autograd refuses a single-level one,
    tests/nn/test_compiled_autograd.py), and no Function at all when nothing needs a
    gradient or a tangent.
    """
    op = op_overload(qualname)
    name = qualname.split("::", 1)[1].split(".")[0]

    def redispatch(keyset, args, kwargs):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    def forward(ctx, *args):
        call = args[-1]
        args = args[:-1]
        if call.transform_modes is None:
            output = redispatch(call.keyset, args, call.kwargs)
        else:
            # A Function runs its forward with (forward-mode) grad off.  Below autograd that
            # changes nothing at this level, but a torch.func level underneath (grad of grad,
            # jacfwd of jacrev) would then record nothing and silently drop its derivatives:
            # it must see the caller's modes, as under a built-in op (functorch's own
            # custom_function_call sets them the same way; without the grad mode
            # tests/nn/test_functorch.py::test_nested_transforms fails, without the forward
            # one ::test_hessian_and_jvp).
            grad_enabled, fwd_grad_enabled = call.transform_modes
            with torch.set_grad_enabled(grad_enabled), _set_fwd_grad_enabled(fwd_grad_enabled):
                output = redispatch(call.keyset, args, call.kwargs)
        ctx.set_materialize_grads(False)
        inputs, keyword_only = _fill_defaults(op._schema, args, call.kwargs)
        setup_context(ctx, inputs, keyword_only, output)
        return output

    # The dispatcher leaves out trailing arguments at their defaults: the formulas see every
    # positional input (False / None for those), and return one gradient per input given.
    n_positional = sum(not arg.kwarg_only for arg in op._schema.arguments)

    def function_backward(ctx, *grads):
        previous = ctx.needs_input_grad
        given = len(previous) - 1
        if all(g is None for g in grads):  # grads are not materialized: nothing flows back
            return (None,) * (given + 1)
        try:
            ctx.needs_input_grad = previous[:-1] + (False,) * (n_positional - given)
            return (*tuple(backward(ctx, *grads))[:given], None)
        finally:
            ctx.needs_input_grad = previous

    def function_jvp(ctx, *tangents):
        if jvp is None:
            raise NotImplementedError(f"{qualname} has no forward-mode derivative (jvp)")
        given = tangents[:-1]
        return jvp(ctx, *given, *(None,) * (n_positional - len(given)))

    # The same formulas as an ordinary Function (what compiled autograd and the rest of torch
    # know best) and as a single-level one (what runs inside a torch.func transform).
    methods = {"forward": staticmethod(forward), "backward": staticmethod(function_backward),
               "jvp": staticmethod(function_jvp)}
    class_name = f"{name.title().replace('_', '')}Backward"
    function = type(class_name, (torch.autograd.Function,), methods)
    single_level_function = type(class_name, (_SingleLevelFunction,), methods)

    def autograd_kernel(keyset, *args, **kwargs):
        # No public API tells whether a torch.func transform is active.
        if not torch._C._are_functorch_transforms_active():
            if not _may_carry_tangents(args) and not (
                    torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
                return redispatch(keyset, args, kwargs)  # nothing to record: no Function
            return function.apply(*args, _Call(keyset, kwargs, None))
        call = _Call(keyset, kwargs, (torch.is_grad_enabled(), torch._C._is_fwd_grad_enabled()))
        with enable_single_level_autograd_function():
            return single_level_function.apply(*args, call)

    LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)

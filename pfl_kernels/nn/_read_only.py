"""Weights rebuilt from other parameters on every access, which refuse to be written.

A factorized or multi-branch layer's ``weight`` (and a multi-branch layer's ``bias``) is a
fresh tensor computed from the layer's parameters each time it is read.  Writing to it
(``nn.init.kaiming_normal_(layer.weight)``, ``layer.weight.zero_()``, ``layer.weight.data =
...``, ``layer.weight = ...``) would change a temporary and leave the layer as it was, so
every such write raises ``ReadOnlyWeightError`` with a message saying what to initialise
instead.

Only what users read goes through here: the layers' forward passes use the plain
reconstructed tensor, so training, ``torch.compile`` and ``torch.func`` never see the
subclass below.
"""
from __future__ import annotations

import torch
from torch import nn
# Private: torch has no public pytree module yet (pytorch/pytorch#65761, #175082;
# tests/kernels/test_public_torch_limits.py says when it has).
from torch.utils._pytree import tree_flatten, tree_map


class ReadOnlyWeightError(AttributeError, RuntimeError):
    """A write to a weight that is rebuilt from other parameters on every access.

    Both an AttributeError (what assigning a read-only attribute raises) and a
    RuntimeError (what torch raises for a forbidden in-place operation).
    """


# Tensor methods whose names end in "_" but change autograd flags or metadata, not values.
_FLAG_METHODS = frozenset({"requires_grad_", "share_memory_", "detach_", "rename_"})
# The in-place operators (their names do not end in "_").
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})
_DATA_SETTER = torch.Tensor.data.__set__


def _writes_by_name(func) -> bool:
    """Whether ``func`` is, by torch's naming convention, an in-place write to its first argument."""
    if func == _DATA_SETTER:
        return True
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_")
                                        and name not in _FLAG_METHODS)


def _shares_memory(result, t: torch.Tensor) -> bool:
    """Whether ``result`` shares ``t``'s (non-empty) memory: a write to it would write to ``t``."""
    if not isinstance(result, torch.Tensor) or result.layout != torch.strided or result.device != t.device:
        return False
    try:
        address = result.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass)
        return False
    return address != 0 and address == t.untyped_storage().data_ptr()


def _guards(t) -> bool:
    # A Parameter made from the weight (nn.Parameter(layer.weight)) is the user's own tensor.
    return isinstance(t, ReadOnlyTensor) and not getattr(t, "_is_param", False)


class ReadOnlyTensor(torch.Tensor):
    """A reconstructed weight: reads like any tensor, raises ``ReadOnlyWeightError`` on writes.

    Writes are caught two ways: by name before the call (in-place methods, ``x[i] = ...``,
    ``x.data = ...``, and ``x.set_(...)``, which torch does not dispatch, by an override);
    and after the call by the tensor's version counter, which every in-place kernel bumps
    (``out=``, ``F.relu(x, inplace=True)``, writes made inside a library function).  The
    temporary that was written is thrown away, so raising afterwards loses nothing.

    Everything that shares its memory (``.data``, ``detach()``, slices and views) is
    read-only too, as writing to it would write to the weight of a dense layer; every
    other result (``clone()``, arithmetic) is a plain tensor.  A Parameter made from it
    (``nn.Parameter(layer.weight)``) is an ordinary Parameter: writable, copied and saved
    as ``nn.Parameter``.  Read inside a compiled function, the weight is a plain tensor.
    Passed into one as an argument, it makes torch 2.13's inductor fail on the first call
    (pytorch/pytorch#193932, any tensor subclass; fixed upstream): pass
    ``layer.weight.as_subclass(torch.Tensor)`` there.
    """

    _write_error: str

    # Calls run under torch._C.DisableTorchFunctionSubclass, as in torch's own default
    # __torch_function__, which has no public equivalent (pytorch/pytorch#87990): the public
    # default (super().__torch_function__) would make every result read-only, clone() and
    # arithmetic too (tests/kernels/test_public_torch_limits.py), and reading the version
    # counter of a guarded tensor would call this method again.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Nothing in a compiled graph initialises a layer, and the checks below do not trace.
        guarded = [] if torch.compiler.is_compiling() else [t for t in tree_flatten((args, kwargs))[0] if _guards(t)]
        if not guarded:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        message = guarded[0]._write_error
        if args and _guards(args[0]) and _writes_by_name(func):
            raise ReadOnlyWeightError(message)
        with torch._C.DisableTorchFunctionSubclass():
            # Tensors made in inference mode have no version counter (and can only be
            # written inside inference mode); the check by name covers them.
            tracked = [t for t in guarded if not t.is_inference()]
            versions = [t._version for t in tracked]
            out = func(*args, **kwargs)
            if any(t._version != v for t, v in zip(tracked, versions)):
                raise ReadOnlyWeightError(message)

            def keep_read_only(result):
                if any(_shares_memory(result, t) for t in guarded):
                    return read_only(result, message)
                return result

            return tree_map(keep_read_only, out)

    def set_(self, *args, **kwargs):
        if not _guards(self):
            return super().set_(*args, **kwargs)
        raise ReadOnlyWeightError(self._write_error)  # Tensor.set_ does not dispatch __torch_function__

    def _plain(self) -> torch.Tensor:
        """The same tensor as a plain ``torch.Tensor`` (or a plain Parameter if it became one)."""
        with torch._C.DisableTorchFunctionSubclass():
            plain = self.as_subclass(torch.Tensor)
            return nn.Parameter(plain.detach(), self.requires_grad) if getattr(self, "_is_param", False) else plain

    def __reduce_ex__(self, protocol):
        # Saved as a plain tensor or Parameter: a loaded copy is the user's own, and a
        # weights_only load would refuse this class.
        return self._plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = self._plain().__deepcopy__({})
        return memo[id(self)]


def read_only(tensor: torch.Tensor, write_error: str) -> torch.Tensor:
    """``tensor`` (a fresh reconstruction) as a ``ReadOnlyTensor`` whose writes raise
    ``ReadOnlyWeightError(write_error)``; the same tensor, unwrapped, under ``torch.compile``
    or when it is a tensor subclass already (FakeTensor, ...), where the wrapper cannot go.

    The result shares ``tensor``'s memory and autograd history (gradients still reach the
    parameters it was computed from).
    """
    if torch.compiler.is_compiling() or type(tensor) is not torch.Tensor:
        return tensor
    wrapped = tensor.as_subclass(ReadOnlyTensor)  # a plain tensor's method: no __torch_function__
    wrapped._write_error = write_error
    return wrapped


class RebuiltAttributes:
    """Mixin for an ``nn.Module`` whose attributes named in ``_rebuilt_attributes`` are
    properties rebuilt from its parameters: assigning one raises ``ReadOnlyWeightError``
    with the message of ``_write_error(name)``, instead of torch's KeyError/AttributeError
    that do not say what to do."""

    _rebuilt_attributes: tuple[str, ...] = ()

    def _write_error(self, name: str) -> str:
        raise NotImplementedError

    def __setattr__(self, name: str, value) -> None:
        if name in self._rebuilt_attributes:
            raise ReadOnlyWeightError(self._write_error(name))
        super().__setattr__(name, value)

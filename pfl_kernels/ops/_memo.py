"""Host time per op call: the contract checks that read only sizes, strides, dtypes and devices
are made once per signature, not on every call (issue 30, item 1).

An op's launcher checks its arguments on every call, so that a direct ``torch.ops.pfl`` call
with bad input fails as clearly as the public wrapper's.  Those checks are a pure function
of the tensors' metadata and the scalar arguments, and cost 10-20 µs a call in Python (a
third of a small op's host time on a GPU).  ``metadata_cached`` remembers the result of each
signature that passed: a call with the same sizes, strides, dtypes, devices and scalars
skips the checks; any other call, and every call that fails, runs them.  Checks that read
tensor values (NaN, label ranges) must not be wrapped: they are not a function of the key.

Each op family decorates its checks where it defines them (``ops/<family>.py``, and
``_layout.layout_geometry``), so the Triton launchers, the reference kernels and the
wrappers share one cache per check.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_MAX_ENTRIES = 1024  # signatures per check; a full cache is cleared (shapes of a run repeat)


def tracing() -> bool:
    """Whether a call is being traced rather than run: under dynamo (torch.compile tracing
    Python) or with a torch dispatch mode active (make_fx's proxy mode, a FakeTensorMode,
    functionalization).  A kernel that runs as an op's kernel sees none of these in eager
    mode: the dispatcher calls it after every mode has had its turn.

    Private torch API: nothing public tells whether a dispatch mode is active (torch's own
    ``is_in_torch_dispatch_mode``, pytorch/pytorch#122339, is in the private
    ``torch.utils._python_dispatch``).  tests/kernels/test_launch_path_triton.py covers it:
    a FakeTensorMode call goes through wrap_triton, an eager one does not."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


class _Uncacheable(Exception):
    """An argument that no key may hold: a sparse tensor, whose strides cannot be read."""


def _metadata(arg):
    """The part of an argument a metadata check may read: a tensor's sizes, strides, dtype and
    device (never its values); a list or tuple as its items with their types; anything else
    with its type.  True, 1 and 1.0 are equal keys otherwise, and a check may tell them apart
    (a shape [6.0, 3] is not a shape [6, 3]).  A tensor that is not dense (strided) raises
    ``_Uncacheable``: a CSR tensor's ``stride()`` raised RuntimeError here, before the check
    could refuse it as a ValueError naming the argument."""
    if isinstance(arg, torch.Tensor):
        if arg.layout != torch.strided:
            raise _Uncacheable
        return (arg.shape, arg.stride(), arg.dtype, arg.device)
    if isinstance(arg, (list, tuple)):
        return (type(arg), tuple(arg), tuple(map(type, arg)))
    return (type(arg), arg)


def metadata_cached(check: F) -> F:
    """Wrap ``check(*args)``, a function of its arguments' metadata alone, so that it runs once
    per signature; later calls with that signature return the first call's result.

    Not cached: calls with keyword arguments, calls while tracing (symbolic sizes), calls
    whose key cannot be hashed (a SymInt), and calls with a sparse tensor (which the check
    refuses).  A check that raises caches nothing, so bad input fails on every call.  Callers
    must not mutate the result (it is shared).
    """
    cache: dict = {}

    @functools.wraps(check)
    def cached(*args, **kwargs):
        if kwargs or tracing():
            return check(*args, **kwargs)
        try:
            key = tuple([_metadata(a) for a in args])
            return cache[key]
        except KeyError:
            pass
        except (TypeError, _Uncacheable):  # unhashable (a SymInt outside a tracing context), sparse
            return check(*args)
        result = check(*args)
        if len(cache) >= _MAX_ENTRIES:
            cache.clear()
        cache[key] = result
        return result

    cached.cache = cache  # for tests
    return cached  # type: ignore[return-value]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, in plain Python: ``triton.cdiv`` is a constexpr function whose
    call costs about 2 µs of host time (an op's launch geometry takes several)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), as ``triton.next_power_of_2`` (see cdiv)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()

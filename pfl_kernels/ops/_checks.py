"""Argument checks shared by the op wrappers: clear errors that name the argument."""
from __future__ import annotations

import math
import numbers
import operator
from typing import Optional

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_is_tensor(name: str, t, *, or_none: bool = False) -> None:
    """TypeError unless ``t`` is a torch.Tensor; ValueError unless it is dense (strided): the
    kernels read memory by strides, and a sparse one failed deep inside with another type."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if or_none else ''}, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def check_tensor(name: str, t, *, dims: tuple[int, ...]) -> None:
    """Raise TypeError/ValueError unless ``t`` is a floating dense tensor with a dim in ``dims``."""
    check_is_tensor(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got {t.dtype}")
    if t.dim() not in dims:
        want = " or ".join(str(d) for d in dims)
        raise ValueError(f"{name} must have {want} dimensions, got shape {list(t.shape)}")


def check_same(ref_name: str, ref: torch.Tensor, name: str, t: Optional[torch.Tensor]) -> None:
    """Raise unless ``t`` (if given) has the dtype and device of ``ref``."""
    if t is None:
        return
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


def check_out(out, like_name: str, like: torch.Tensor, shape: list[int], shape_hint: str) -> None:
    """Raise unless ``out`` is a tensor of ``like``'s dtype and device with ``shape`` (the
    checks every ``out=`` takes; its layout is each op's own)."""
    check_is_tensor("out", out)
    if out.dtype != like.dtype:
        raise TypeError(f"out must have the dtype of {like_name} ({like.dtype}), got {out.dtype}")
    if list(out.shape) != shape:
        raise ValueError(f"out must have shape {shape} ({shape_hint}), got {list(out.shape)}")
    if out.device != like.device:
        raise ValueError(f"out must be on the device of {like_name} ({like.device}), got {out.device}")


def check_out_without_grad(op: str, *tensors: torch.Tensor) -> None:
    """``out=`` does not support autograd (as torch's out= variants): RuntimeError under grad
    mode when any of ``tensors`` (the inputs and out) requires grad."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{op}(out=...) does not support autograd: call it under "
                           "torch.no_grad() or without out=")


def has_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read here: not on meta tensors (they have none), fake
    tensors (FakeTensorMode, torch.compile's tracing) or while torch.compile traces (a read
    would be a graph break)."""
    from torch._subclasses.fake_tensor import is_fake

    # is_compiling first: dynamo may not trace into is_fake.
    return not torch.compiler.is_compiling() and t.device.type != "meta" and not is_fake(t)


def values_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite, in one reduction and one read: its largest
    magnitude (``vector_norm`` of order inf, NaN where any value is NaN) is finite exactly
    then.  ``bool(torch.isfinite(t).all())`` launched five kernels on a GPU, each a host round
    trip.  True for an empty tensor.  Detached: a check records no autograd node, and reading
    a tensor that requires grad would warn the caller."""
    return t.numel() == 0 or math.isfinite(torch.linalg.vector_norm(t.detach(), float("inf")))


def copy_into_when_compiling(out: torch.Tensor, compute) -> Optional[torch.Tensor]:
    """Under torch.compile, ``out.copy_(compute())`` and ``out``; else None (call the out= op).

    torch cannot functionalize a custom op whose output aliases an input (the out= overloads,
    ``-> Tensor(a!)``), so inside a compiled graph the wrappers call the allocating op and
    copy: the same result for any overlap of out with the inputs (the fresh result exists
    before out is written)."""
    if not torch.compiler.is_compiling():
        return None
    out.copy_(compute())
    return out


def client_count(named: dict[str, Optional[torch.Tensor]], base_dims: int) -> Optional[int]:
    """The client count K shared by tensors that carry a leading client dimension.

    Tensors with ``base_dims`` dimensions are shared by all clients; tensors with one more
    carry K.  Returns None when none carries K; raises when two disagree.
    """
    k, k_name = None, None
    for name, t in named.items():
        if t is not None and t.dim() == base_dims + 1:
            if k is not None and t.shape[0] != k:
                raise ValueError(f"{name} has {t.shape[0]} clients (dim 0) but {k_name} has {k}")
            k, k_name = t.shape[0], name
    return k


def is_positive_int(value) -> bool:
    """Whether ``value`` is an integer >= 1: a Python or numpy integer (anything with
    ``__index__``, as torch's size arguments take), not a bool."""
    try:
        return not isinstance(value, bool) and operator.index(value) >= 1
    except TypeError:
        return False


def integer(name: str, value) -> int:
    """``value`` as a Python int if it is an integer (anything with ``__index__``, as torch's
    size arguments take: a Python or numpy int, an integer 0-d tensor; not a bool), else
    TypeError naming ``name``: a float such as 3.0 is a wrong kind of argument, not a wrong
    value (the ops' contract, ``pfl_kernels.ops``)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def real_number(name: str, value) -> float:
    """``value`` as a finite Python float: TypeError naming ``name`` unless it is a real number
    (a Python or numpy int or float; not a bool, a str or a tensor, not even a 0-d one: a
    tensor argument would read its value, a host sync), ValueError unless it is finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    # Comparisons, not math.isfinite: torch.compile(dynamic=True) traces them on symbolic floats.
    if not -math.inf < value < math.inf:
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def positive_int(name: str, value) -> int:
    """``value`` as a Python int if it is an integer >= 1 (see ``is_positive_int``), else
    ValueError naming ``name``."""
    if not is_positive_int(value):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return operator.index(value)


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors (any dims and strides) may share a byte: their address ranges (from
    the lowest to the highest element each can address) intersect.  Compared by address, not
    by storage, so aliases made through another storage (``torch.from_numpy`` of the same
    array twice, DLPack) count too.  Conservative: interleaved tensors count as overlapping,
    which is what a kernel writing one while reading the other needs."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def extent(t):
        lo = hi = 0  # in elements from data_ptr: the lowest and the highest it can address
        for n, s in zip(t.shape, t.stride()):
            if s > 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        start, size = t.data_ptr(), t.element_size()
        return start + lo * size, start + (hi + 1) * size

    alo, ahi = extent(a)
    blo, bhi = extent(b)
    return alo < bhi and blo < ahi


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (e.g. an expanded dim, or strides such as
    [3, 6, 1] for [3, 2, 3]), exactly, from its sizes and strides alone (meta and fake tensors
    too).

    torch's own check answers "too hard" for many layouts (and ``copy_`` then writes them
    silently).  Here: a sufficient test first (each stride beyond the span of the smaller
    ones: plain arithmetic, which torch.compile traces), then, for the rare layouts it cannot
    settle, a count of distinct offsets (while torch.compile traces, where that count cannot
    run, such a layout counts as overlapping: a clear error, never a silent write).
    """
    # Dim i (of size > 1) is clear when its stride exceeds the span of the dims below it in
    # (stride, index) order; all clear: no overlap.  Pairs, not sorted(): torch.compile cannot
    # sort symbolic strides.
    dims = [(s, n) for n, s in zip(t.shape, t.stride()) if n > 1]
    if all(si > sum((nj - 1) * sj for j, (sj, nj) in enumerate(dims) if sj < si or (sj == si and j < i))
           for i, (si, ni) in enumerate(dims)):
        return False
    if torch.compiler.is_compiling():
        return True
    # numpy, not torch: this runs on shapes alone, also under FakeTensorMode.
    offsets = np.zeros((), dtype=np.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets[..., None] + np.arange(int(size), dtype=np.int64) * int(stride)
    return np.unique(offsets).size != offsets.size


def raise_flagged(check, *args) -> None:
    """A kernel flagged bad data: ``check(*args)``, the op's own PyTorch check, raises the
    ValueError (and message) that every backend of the op gives.  It must: a check that passes
    what the kernel flagged is a bug in one of the two (AssertionError)."""
    check(*args)
    raise AssertionError(f"a kernel flagged data that {check.__name__} accepts")


def check_no_internal_overlap(name: str, t: torch.Tensor) -> None:
    """ValueError when two elements of ``t`` (an out= tensor) share memory: writing it would
    leave whichever value came last (one message for every op and kernel)."""
    if has_internal_overlap(t):
        raise ValueError(f"{name} must not have elements that share memory, got strides {list(t.stride())}")

"""Eager calls past the dispatcher (issue 30, item 1: "do the per-call Python work once").

A call of ``torch.ops.pfl.<op>`` on CUDA tensors reaches its Triton launcher through two
Python kernels: the Autograd one (``_library.register_autograd``: it finds that nothing
needs a gradient and redispatches below autograd) and then the launcher.  That round trip
through the dispatcher, twice from Python into C++ and back, cost about 7 µs of the 30 µs
of host time a ``branch_aggregate`` call took on this project's 2-core CPUs
(``benchmarks/gpu_launch.py --host``), for no work at all when nothing is recorded.

``kernel_for(name, *tensors)`` returns the launcher itself where the dispatcher would do
nothing but route the call to it, else the op ``torch.ops.pfl.<name>``.  The launcher is
returned when:

* a launcher is registered for the tensors' device type (``register``: the CUDA launchers,
  and the CPU ones inside ``pfl_kernels.triton.launchers_on_cpu``).  For an op that writes an
  argument (``soft_threshold_``, ``project_simplex_``) what is returned bumps the written
  tensors' version counters first, as its Autograd kernel does (``_library._guard_mutation``):
  through the dispatcher its two Python kernels took about 12 of the 20 µs of host time a
  ``soft_threshold_`` call took on a 2-core Xeon, its launch stubbed;
* no tensor needs a gradient under grad mode, and none may carry a forward-mode tangent;
* nothing intercepts the call: not compiling (Dynamo traces the op), no torch-function mode
  (``with torch.device(...)`` is one), and the dispatcher's thread-local included keys as in
  plain eager mode (a dispatch mode, FakeTensorMode, ``make_fx``, vmap/grad and the other
  torch.func transforms all add theirs);
* every tensor is a plain one: of class Tensor or Parameter (others may override
  ``__torch_function__``), with the dispatch keys of a dense tensor on that device (a
  subclass with ``__torch_dispatch__``, a negative or zero view, sparse, nested, meta and
  functorch-wrapped tensors all carry other keys).

Under the profiler the launcher runs inside ``record_function("pfl::<op>")``, so the op
still shows in a trace.  ``PFL_KERNELS_DISPATCH_BYPASS=0`` (or ``ENABLED = False``) sends every
call through the dispatcher.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch.autograd import forward_ad

from ._library import op_overload

ENABLED = os.environ.get("PFL_KERNELS_DISPATCH_BYPASS", "1") not in ("", "0")

# (op name, device type) -> the launcher a plain eager call reaches through the dispatcher
KERNELS: dict[tuple[str, str], Callable] = {}
_PLAIN_CLASSES = (torch.Tensor, torch.nn.Parameter)
# The dispatcher's thread-local included keys in plain eager mode.  (The excluded ones need
# no look: autocast, inference mode and a guard below autograd change only what the
# dispatcher skips on its way to the same launcher.)
_PLAIN_INCLUDED = torch._C._dispatch_tls_local_include_set().raw_repr()
# The dispatch keys (raw) of a dense tensor per device type, read from one the first time.
_PLAIN_KEYS: dict[str, int] = {}


def register(name: str, device_type: str, kernel: Callable) -> None:
    """Record ``kernel`` as what an eager call of the op ``pfl::<name>`` on ``device_type``
    tensors reaches through the dispatcher; for an op that writes an argument, with the
    version bump the dispatcher would make (``_Writing``)."""
    schema = op_overload(f"pfl::{name}")._schema
    written = [(i, arg.name) for i, arg in enumerate(schema.arguments)
               if arg.alias_info is not None and arg.alias_info.is_write]
    KERNELS[(name, device_type)] = _Writing(kernel, written) if written else kernel


class _Writing:
    """The launcher of an op that writes arguments, called as its Autograd kernel calls it:
    the written tensors' version counters bumped first, so that autograd sees the write (the
    refusal of a tensor that requires grad needs no check here: such a call keeps the
    dispatcher, ``kernel_for``)."""

    def __init__(self, kernel: Callable, written: list[tuple[int, str]]):
        self.kernel, self.written = kernel, written

    def __call__(self, *args, **kwargs):
        torch.autograd.graph.increment_version([args[i] if i < len(args) else kwargs[name]
                                                for i, name in self.written])
        return self.kernel(*args, **kwargs)


def _plain_keys(device: torch.device) -> int:
    keys = torch._C._dispatch_keys(torch.empty(0, device=device)).raw_repr()
    _PLAIN_KEYS[device.type] = keys
    return keys


def kernel_for(name: str, first: torch.Tensor, *others: Optional[torch.Tensor]) -> Callable:
    """What to call for ``torch.ops.pfl.<name>`` with these tensor arguments (``first`` a
    tensor, None among ``others`` skipped): the launcher itself, or the op where the call
    must go through the dispatcher (see the module docstring).  A call on a device without a
    launcher here (a CPU call, outside ``launchers_on_cpu``) is told so first, in about
    0.3 µs; the rest takes about 2 µs for three tensors on a 2-core Xeon."""
    op = getattr(torch.ops.pfl, name)
    if not ENABLED:
        return op
    device_type = "cuda" if first.is_cuda else "cpu" if first.is_cpu else None
    kernel = KERNELS.get((name, device_type))
    if kernel is None:
        return op
    if (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or torch._C._dispatch_tls_local_include_set().raw_repr() != _PLAIN_INCLUDED):
        return op
    plain = _PLAIN_KEYS[device_type] if device_type in _PLAIN_KEYS else _plain_keys(first.device)
    grad = torch.is_grad_enabled()
    for t in (first, *others):
        if t is None:
            continue
        if (t.__class__ not in _PLAIN_CLASSES or (grad and t.requires_grad)
                or torch._C._dispatch_keys(t).raw_repr() != plain):
            return op
    if getattr(forward_ad, "_current_level", 0) >= 0:  # inside a dual level: tangents may flow
        return op
    if torch._C._autograd._profiler_enabled():
        return _Recorded(name, kernel)
    return kernel


class _Recorded:
    """A launcher called inside ``record_function("pfl::<name>")``: under the profiler."""

    def __init__(self, name: str, kernel: Callable):
        self.name, self.kernel = name, kernel

    def __call__(self, *args, **kwargs):
        with torch.autograd.profiler.record_function(f"pfl::{self.name}"):
            return self.kernel(*args, **kwargs)

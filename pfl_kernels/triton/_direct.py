"""Direct launches: a Triton kernel launched from its compiled form, without Triton's per-call
binding (issue 30, item 1).

``kernel[grid](*args, **meta)`` on a ``triton.JITFunction`` binds every argument, computes each
one's specialization (dtype, 16-byte alignment of pointers, the values of ints), hashes those
into a cache key and looks the compiled kernel up, on every call: 13 µs of Python for
``factorized_weight``'s launch on this project's 2-core CPUs (Triton 3.6 and 3.9 alike, the C
launcher stubbed: ``benchmarks/launch_python.py``), most of the 28 µs a whole bare launch
took on the host of the H200 that ran issue 30's check.  The compiled kernel's own launcher
(``compiled[grid](*args, stream=...)``) takes about 1 µs of that Python, a direct launch 6,
a planned one (``DirectLaunch.planned``: only the tensors keyed) 4.

``DirectLaunch(kernel)[grid](*args, **meta)`` makes the same launch.  Its first call for a
*signature* goes through ``kernel[grid]`` (Triton binds, compiles if needed, launches) and
keeps the compiled kernel it returns; later calls with that signature launch it directly on
the current stream.  A signature holds everything Triton specializes on, so it never maps to
a kernel compiled for other arguments:

* a tensor: its dtype and whether its data pointer is 16-byte aligned;
* an int: its value (Triton specializes on ==1, divisibility by 16 and the int type); an int
  parameter that the kernel does not specialize (``do_not_specialize``): its Triton type;
* a float: its type only (Triton passes floats as fp32 and never specializes them);
* a bool or None: its type and value; a keyword argument (a constexpr or a launch option):
  its value (this project's launchers pass each with one type, so True and 1 never meet);
* the current device.

Any other argument, a grid given as a function, a kernel with pre-run hooks, or a Triton whose
launch API differs from the one read here (3.6 to 3.9) takes Triton's path.  Not followed: a
Triton knob changed after a signature's first call (``TRITON_DEBUG``, instrumentation), and a
global that a kernel reads and that changes after compilation (Triton's own launch checks
both; this project's kernels read neither).

On by default (``PFL_KERNELS_DIRECT_LAUNCH=0`` turns it off, ``ENABLED`` is the switch) since
a GPU run checked it: on the H200 of issue 30 (b05605a, its fixes), every GPU test passed with
it on (1569 passed, ``benchmarks/results/gpu_tests_nvidia_h200_b05605a+fixes.log``),
``benchmarks/gpu_launch.py`` checked each op's direct launches against float64, and the kernel
benchmarks and executor jobs made 55,603 launches directly.  ``scripts/gpu_check.sh`` runs the
GPU tests with it on, and ``gpu_launch.py`` times every op both ways.
"""
from __future__ import annotations

import inspect
import os
from typing import Callable, Optional

import torch


def enabled_by(value: Optional[str]) -> bool:
    """Whether ``PFL_KERNELS_DIRECT_LAUNCH=value`` (``None``: unset) leaves direct launches on:
    every value but "0" (spaces aside) does; "0" takes Triton's own launcher."""
    return (value or "").strip() != "0"


ENABLED = enabled_by(os.environ.get("PFL_KERNELS_DIRECT_LAUNCH"))  # read once, at import

_MAX_SIGNATURES = 256  # per kernel; a full cache is cleared (a run's shapes repeat)
# Launches while switched on: [launched directly, through Triton (a signature's first call, or
# an argument this cache does not key)].  A benchmark records them with its figures, so a run
# shows that its launches were direct, not only that the switch was on (``counts``).
_COUNTS = [0, 0]
_FLOAT = ("float",)  # a float argument's key: its type only
_Tensor = torch.Tensor  # plain tensors keyed inline; subclasses (Parameter) through _key_of


# The Triton versions whose launch path was read for this module (JITFunction.run hands its
# compiled kernel every parameter in signature order, constexprs included).
_CHECKED_VERSIONS = ((3, 6), (3, 9))


def _supported(version: Optional[str] = None) -> Optional[str]:
    """None where this Triton's compiled kernels launch as read here, else why not."""
    try:
        import triton
        from triton.compiler.compiler import CompiledKernel
    except ImportError as exc:
        return f"no triton ({exc})"
    version = version or triton.__version__
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return f"triton {version}: an unparsed version"
    low, high = _CHECKED_VERSIONS
    if not low <= major_minor <= high:
        return f"triton {version}: its launch path is not the one checked here (triton 3.6 to 3.9)"
    if not hasattr(CompiledKernel, "__getitem__"):
        return f"triton {version}: CompiledKernel has no [grid] launcher"
    return None


REASON = _supported()


class DirectLaunch:
    """``kernel[grid](*args, **kwargs)`` with the per-call binding done once per signature
    (module docstring).  One instance per kernel (``direct``)."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = list(inspect.signature(kernel.fn).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        dns = {kp.num for kp in getattr(kernel, "params", []) if getattr(kp, "do_not_specialize", False)}
        self.unspecialized = frozenset(dns)  # positions of ints keyed by their Triton type
        self.signatures: dict = {}  # signature -> (compiled kernel, the arguments after the positional ones)
        self.planned_signatures: dict = {}  # (token id, tensor keys, device) -> (compiled, the rest, token)

    def _bypassed(self, grid) -> bool:
        """Whether a call takes Triton's path whatever its arguments (module docstring)."""
        return not ENABLED or callable(grid) or bool(getattr(self.kernel, "pre_run_hooks", None))

    def _trailing(self, n: int, kwargs: dict) -> tuple:
        """The parameters after the first ``n``, in signature order, as Triton's launcher gets
        them (``bound_args.values()``): keywords and defaults, launch options (num_warps) left
        out; the same for every call of a signature."""
        return tuple([kwargs[name] if name in kwargs else self.defaults[name] for name in self.names[n:]])

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def signature(self, args: tuple, kwargs: dict):
        """The key of a call (module docstring), or None where an argument is of a kind this
        cache does not key (the call then takes Triton's path).  Ints, most of a launch's
        arguments, go into the key as they are (a comprehension: this runs on every call)."""
        try:
            key = [a if a.__class__ is int else (a.dtype, not a.data_ptr() & 15) if a.__class__ is _Tensor
                   else _key_of(a) for a in args]
        except _Unkeyed:
            return None
        for i in self.unspecialized:
            if i < len(args) and args[i].__class__ is int:
                key[i] = _int_type(args[i])
        # keywords (constexprs, options) by name and value: this project's launchers pass each
        # one with a single type (True is 1 as a key); an unhashable one fails the lookup
        key += (tuple(kwargs.items()), torch._C._cuda_getDevice())
        return tuple(key)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if self._bypassed(grid):
            self.kernel[grid](*args, **kwargs)
            return
        key = self.signature(args, kwargs)
        try:
            entry = None if key is None else self.signatures.get(key)
        except TypeError:  # an unhashable keyword value
            key = entry = None
        if entry is None:
            _COUNTS[1] += 1
            compiled = self.kernel[grid](*args, **kwargs)  # binds, compiles if needed, launches
            if key is not None and compiled is not None:
                if len(self.signatures) >= _MAX_SIGNATURES:
                    self.signatures.clear()
                self.signatures[key] = (compiled, self._trailing(len(args), kwargs))
            return
        compiled, rest = entry
        _COUNTS[0] += 1
        compiled[_grid3(grid)](*args, *rest, stream=torch._C._cuda_getCurrentRawStream(key[-1]))  # key[-1]: the device


    def planned(self, grid, token, tensors: tuple, scalars: tuple, meta: dict) -> None:
        """``kernel[grid](*tensors, *scalars, **meta)``, where ``token`` is an object that
        describes ``scalars`` and ``meta`` for as long as it lives (a cached launch plan, which
        holds them).  Its identity stands for them in the signature, so a call keys only its
        tensors (dtype, alignment) and the device: about half of ``launch``'s work on a
        launch of 30 arguments.  The entry keeps ``token`` alive, so its id is never another
        object's while the entry exists."""
        if self._bypassed(grid):
            self.kernel[grid](*tensors, *scalars, **meta)
            return
        try:
            key = (id(token), *[(t.dtype, not t.data_ptr() & 15) if t.__class__ is _Tensor else _key_of(t)
                                for t in tensors], torch._C._cuda_getDevice())
        except _Unkeyed:
            _COUNTS[1] += 1
            self.kernel[grid](*tensors, *scalars, **meta)
            return
        entry = self.planned_signatures.get(key)
        if entry is None or entry[2] is not token:
            _COUNTS[1] += 1
            compiled = self.kernel[grid](*tensors, *scalars, **meta)  # binds, compiles if needed, launches
            if compiled is not None:
                if len(self.planned_signatures) >= _MAX_SIGNATURES:
                    self.planned_signatures.clear()
                rest = self._trailing(len(tensors) + len(scalars), meta)
                self.planned_signatures[key] = (compiled, scalars + rest, token)
            return
        _COUNTS[0] += 1
        entry[0][_grid3(grid)](*tensors, *entry[1], stream=torch._C._cuda_getCurrentRawStream(key[-1]))


def counts() -> dict:
    """The launches made while switched on since import: ``direct`` (the compiled kernel
    launched from the cache) and ``through_triton`` (``kernel[grid]``: a signature's first
    call, a full cache's refill, an argument of a kind the cache does not key)."""
    return {"direct": _COUNTS[0], "through_triton": _COUNTS[1]}


def _grid3(grid) -> tuple:
    """A grid as the three sizes a compiled kernel's launcher takes."""
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


class _Unkeyed(Exception):
    """An argument of a kind the signature does not key."""


def _key_of(a):
    """The key of a non-int argument (see the module docstring)."""
    c = a.__class__
    if c is float:
        return _FLOAT
    if c is bool or a is None:
        return (c, a)
    if isinstance(a, torch.Tensor):
        return (a.dtype, not a.data_ptr() & 15)
    raise _Unkeyed


def _int_type(x: int) -> str:
    """The Triton type of an int argument that the kernel does not specialize on."""
    if -2**31 <= x < 2**31:
        return "i32"
    if 2**63 <= x < 2**64:
        return "u64"
    return "i64"


_LAUNCHERS: dict = {}


def direct(kernel):
    """The ``DirectLaunch`` of ``kernel`` (one per kernel, so its signatures are shared by
    every call site), or ``kernel`` itself where direct launches do not apply: switched off,
    this Triton's launch API not the one read here, or an interpreted kernel
    (``TRITON_INTERPRET=1``: there is nothing compiled to launch)."""
    if not ENABLED or REASON is not None or not hasattr(kernel, "device_caches"):
        return kernel
    launcher = _LAUNCHERS.get(id(kernel))  # by id: the launcher holds the kernel, so the id stays its
    if launcher is None:
        launcher = _LAUNCHERS[id(kernel)] = DirectLaunch(kernel)
    return launcher

"""Triton kernels for CUDA devices.  Triton is optional: without it, CUDA tensors use the
plain-PyTorch reference and ``REASON`` says why.  ``PFL_KERNELS_DISABLE_TRITON=1`` skips them.

Each kernel module registers its launchers with ``register_cuda``, which also records them
in ``LAUNCHERS``; ``launchers_on_cpu`` runs them for CPU tensors instead, which is how the
Triton interpreter (``TRITON_INTERPRET=1``) exercises them without a GPU.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable, Iterator, Mapping, Optional

AVAILABLE = False
REASON = ""

# op name in the pfl namespace (e.g. "weighted_average.out") -> its Triton launcher
LAUNCHERS: dict[str, Callable] = {}

if os.environ.get("PFL_KERNELS_DISABLE_TRITON", "0") not in ("", "0"):
    REASON = "disabled by PFL_KERNELS_DISABLE_TRITON"
else:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401

        AVAILABLE = True
    except ImportError as exc:
        REASON = f"triton is not installed ({exc})"


def register_all() -> None:
    """Register every Triton kernel for the CUDA dispatch key (once, at import)."""
    if not AVAILABLE:
        return
    # Each module registers its kernels on import.
    from . import aggregate, branch, branch_aggregate, class_means, factorized, similarity  # noqa: F401


def emulate_good_flags(kernel) -> None:
    """Give ``kernel``, which writes data-check flags the op reads on the host into its
    ``flags_ptr`` argument, an ``emulate``: the plain-PyTorch stand-in that tools recording
    launches instead of making them call (``tests/kernels/test_triton_compiles.py``,
    ``benchmarks/gpu_launch.py --host``).  It zeroes the flags (their inputs are good data)
    and writes nothing else."""
    index = kernel.arg_names.index("flags_ptr")

    def emulate(*args, **meta):
        args[index].zero_()

    kernel.emulate = emulate


def register_cuda(op: str, launcher: Callable) -> None:
    """Register ``launcher`` as the CUDA kernel of ``pfl::<op>`` and record it in ``LAUNCHERS``."""
    from ..ops import _eager
    from ..ops._library import LIB

    LIB.impl(op, launcher, "CUDA")
    LAUNCHERS[op] = launcher
    _eager.register(op, "cuda", launcher)  # a plain eager call skips the dispatcher (ops/_eager.py)


@contextlib.contextmanager
def launchers_on_cpu(launchers: Optional[Mapping[str, Callable]] = None) -> Iterator[None]:
    """Within the block, ``pfl::<op>`` runs ``launchers[op]`` (default: every registered
    Triton launcher) for CPU tensors, through the ops' Python wrappers and autograd as on a
    GPU.  Meant for the Triton interpreter (``TRITON_INTERPRET=1``); registered in a scoped
    library, so the C++ CPU kernels are back at exit.  A plain eager call reaches them past
    the dispatcher, as on a GPU (``ops/_eager.py``), until then too."""
    import torch

    from ..ops import _eager

    if launchers is None:
        register_all()
        launchers = LAUNCHERS
    saved = dict(_eager.KERNELS)
    with torch.library._scoped_library("pfl", "IMPL") as lib:
        with warnings.catch_warnings():
            # Overriding the C++ CPU kernel is the point here, not a mistake to warn about.
            warnings.filterwarnings("ignore", "Warning only once", UserWarning)
            for op, launcher in launchers.items():
                lib.impl(op, launcher, "CPU")
        try:
            for op, launcher in launchers.items():
                _eager.register(op, "cpu", launcher)
            yield
        finally:
            _eager.KERNELS.clear()
            _eager.KERNELS.update(saved)

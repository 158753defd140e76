"""What the Triton kernel tests (``test_factorized_triton.py``, ``test_branch_triton.py``) share.

They run in the Triton interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before triton
is imported, so in their own process) or on a CUDA device, and are skipped otherwise.  A
test module applies ``MARKS`` as its ``pytestmark`` and imports its kernels under ``if
RUNNABLE:``; importing this module where ``RUNNABLE`` holds skips the importing test module
when triton is not installed.
"""
from __future__ import annotations

import itertools
import os
from typing import Callable, Mapping

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
RUNNABLE = INTERPRET or ON_GPU

MARKS = [
    pytest.mark.triton_interpret,
    pytest.mark.skipif(not RUNNABLE, reason="needs TRITON_INTERPRET=1 or a CUDA device"),
]

if RUNNABLE:
    pytest.importorskip("triton")
    from pfl_kernels.ops._library import has_kernel

DEVICE = "cuda" if ON_GPU else "cpu"
F64 = torch.float64

interpreter_only = pytest.mark.skipif(not INTERPRET, reason="interpreter only (on a GPU the CUDA tests cover it)")
# Real GPU only: the ops through the dispatcher, opcheck, autograd and half precision.
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (not the interpreter)")


def all_masks(n: int) -> list[tuple[bool, ...]]:
    """Every output_mask of ``n`` gradients."""
    return list(itertools.product([False, True], repeat=n))


def mask_id(mask) -> str:
    """A parametrization id for an output_mask: (True, False) -> '10'."""
    return "".join("1" if x else "0" for x in mask)


def assert_registered_for_cuda(ops) -> None:
    """Each ``pfl::<op>`` has a CUDA kernel (the Triton launcher)."""
    for op in ops:
        assert has_kernel(f"pfl::{op}", "CUDA"), op


def launchers_as_cpu_kernels(launchers: Mapping[str, Callable]):
    """Run each launcher as the CPU kernel of ``pfl::<op>`` (in a scoped library, undone at
    exit), so that the ops' Python wrappers and autograd call it in the interpreter."""
    from pfl_kernels.triton import launchers_on_cpu

    return launchers_on_cpu(launchers)


def assert_rejects_overlap(inplace_op, *args) -> None:
    """An in-place op refuses a tensor whose elements share memory (rows expanded)."""
    x = torch.randn(3, dtype=F64, device=DEVICE).expand(4, 3)
    with pytest.raises(ValueError, match="share memory"):
        inplace_op(x, *args)

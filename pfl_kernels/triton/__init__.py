"""Triton kernels for CUDA devices.  Triton is optional: without it, CUDA tensors use the
plain-PyTorch reference and ``REASON`` says why.  ``PFL_KERNELS_DISABLE_TRITON=1`` skips them.
"""
from __future__ import annotations

import os

AVAILABLE = False
REASON = ""

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

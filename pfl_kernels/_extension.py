"""Load the compiled extension ``pfl_kernels._C`` and remember why it did not load.

Importing ``_C`` runs its ``TORCH_LIBRARY_IMPL`` blocks, which register the C++ CPU
kernels for the ``pfl`` ops.  Set ``PFL_KERNELS_DISABLE_EXTENSION=1`` to run without it.
"""
from __future__ import annotations

import importlib.util
import os

import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

LOADED = False
REASON = ""

if os.environ.get("PFL_KERNELS_DISABLE_EXTENSION", "0") not in ("", "0"):
    REASON = "disabled by PFL_KERNELS_DISABLE_EXTENSION"
elif importlib.util.find_spec(f"{__package__}._C") is None:
    REASON = "extension pfl_kernels._C is not built (install with `pip install --no-build-isolation -e .`, " \
             "without PFL_KERNELS_SKIP_EXTENSION)"
else:
    try:
        from . import _C  # noqa: F401  (import registers the kernels)

        LOADED = True
    except ImportError as exc:  # not built, or built against another torch
        REASON = f"extension pfl_kernels._C not loaded ({exc}); build it with " \
                 "`pip install --no-build-isolation -e .`"

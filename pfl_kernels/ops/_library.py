"""The ``pfl`` operator namespace and the registry behind ``backend_info()``.

Schemas, fake kernels and autograd are defined in Python (``ops/<family>.py``); C++
kernels register per device with ``TORCH_LIBRARY_IMPL(pfl, CPU, m)``; Triton kernels
register for CUDA; the plain-PyTorch reference is the default for every other device.
"""
from __future__ import annotations

import torch

NAMESPACE = "pfl"
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

# qualified op name -> {device: name of the fast implementation meant for it}
FAST_PATHS: dict[str, dict[str, str]] = {}


def define_op(schema: str, reference, *, cpu: str = "cpp", cuda: str = "triton") -> str:
    """Define ``pfl::<schema>`` with ``reference`` as the default kernel for every device.

    ``cpu`` / ``cuda`` name the fast implementations expected for those devices (they
    register themselves); ``backend_info()`` reports whether they did.
    """
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    # CompositeExplicitAutograd: used for any device that has no kernel of its own;
    # a CPU or CUDA registration takes precedence over it.
    LIB.impl(name, reference, "CompositeExplicitAutograd")
    qualname = f"{NAMESPACE}::{name}"
    FAST_PATHS[qualname] = {"cpu": cpu, "cuda": cuda}
    return qualname


def has_kernel(qualname: str, dispatch_key: str) -> bool:
    """Whether a kernel is registered for ``qualname`` under ``dispatch_key`` (e.g. 'CPU')."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, dispatch_key)

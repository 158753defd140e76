"""``backend_info()``: which implementation of each op runs on which device, and why."""
from __future__ import annotations

import torch

from . import _extension
from . import triton as _triton
from .ops._library import FAST_PATHS, has_kernel

_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}


def _why_missing(device: str, impl: str) -> str:
    if impl == "cpp":
        return _extension.REASON or "the extension has no kernel for this op"
    if impl == "triton":
        return _triton.REASON or "no Triton kernel for this op"
    if impl == "reference":
        return "plain PyTorch by design"
    return f"no {impl} implementation"


def backend_info() -> dict[str, dict[str, dict[str, str]]]:
    """Per op and device: ``{'implementation': ..., 'reason': ...}``.

    ``implementation`` is 'cpp', 'triton' or 'reference' (plain PyTorch, the default for
    every device without a kernel of its own).  ``reason`` says why the faster
    implementation is not active ('' when it is).  A CUDA entry describes what would
    run on a CUDA tensor, also on a machine without a GPU.
    """
    info: dict[str, dict[str, dict[str, str]]] = {}
    for op, fast in sorted(FAST_PATHS.items()):
        info[op] = {}
        for device, impl in fast.items():
            if has_kernel(op, _DISPATCH_KEY[device]):
                info[op][device] = {"implementation": impl, "reason": ""}
            else:
                info[op][device] = {"implementation": "reference", "reason": _why_missing(device, impl)}
        info[op]["other"] = {"implementation": "reference", "reason": "plain PyTorch for other devices"}
    return info


def format_backend_info() -> str:
    """``backend_info()`` as a table for people.  Without a CUDA device the cuda rows say so:
    they tell what would run on a CUDA tensor, which this machine cannot have."""
    # Checked once: is_available() may initialize the driver.
    cuda_here = torch.cuda.is_available()
    lines = [f"{'op':<32} {'device':<6} {'implementation':<14} reason"]
    for op, devices in backend_info().items():
        for device, entry in devices.items():
            reason = entry["reason"]
            if device == "cuda" and not cuda_here:
                reason = f"{reason}; no CUDA device here" if reason else "no CUDA device here (what would run on one)"
            lines.append(f"{op:<32} {device:<6} {entry['implementation']:<14} {reason}".rstrip())
    return "\n".join(lines)


def main() -> None:
    """Console entry point ``pfl-kernels-info``."""
    print(format_backend_info())

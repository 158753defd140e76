"""Argument checks shared by the op wrappers: clear errors that name the argument."""
from __future__ import annotations

from typing import Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, t, *, dims: tuple[int, ...]) -> None:
    """Raise TypeError/ValueError unless ``t`` is a floating tensor with a dim in ``dims``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
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


def positive_int(name: str, value) -> int:
    """``value`` if it is an integer >= 1 (not a bool), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value

"""Argument checks shared by the augmentation steps and the pipeline: one clear error per bad
argument, raised when a spec is built (not at the first batch) and again by the step
functions, which can be called on their own."""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

import torch
from torch import Tensor


def check_probability(name: str, p) -> float:
    """``p`` as a float, or ValueError unless it is a number in [0, 1]."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
    return float(p)


def check_range(name: str, value, *, positive: bool) -> tuple[float, float]:
    """A (low, high) pair with low <= high, both > 0 (``positive``) or finite."""
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))
    if not ok or value[0] > value[1] or (positive and value[0] <= 0):
        need = "0 < low <= high" if positive else "low <= high"
        raise ValueError(f"{name} must be a pair (low, high) with {need}, got {value!r}")
    return float(value[0]), float(value[1])


def check_size(size) -> Optional[tuple[int, int]]:
    """None, an int or an (height, width) pair of positive ints -> None or (height, width)."""
    if size is None:
        return None
    pair = (size, size) if isinstance(size, int) and not isinstance(size, bool) else size
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in pair)):
        raise ValueError(f"size (image_size) must be a positive int or a (height, width) pair of them, got {size!r}")
    return int(pair[0]), int(pair[1])


def check_batch(x, *, name: str = "x") -> None:
    """TypeError/ValueError unless ``x`` is a floating-point batch of images [B, C, H, W]."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor [B, C, H, W], got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be a batch of images [B, C, H, W], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_colour_channels(x: Tensor, step: str) -> None:
    """ValueError unless the batch ``x`` holds grey (1-channel) or RGB (3-channel) images."""
    if x.shape[1] not in (1, 3):
        raise ValueError(f"{step} needs 1-channel (grey) or 3-channel (RGB) images, got {x.shape[1]} "
                         f"channels (x of shape {tuple(x.shape)})")


def check_generator(generator) -> None:
    """TypeError unless ``generator`` is a CPU ``torch.Generator`` (where every draw comes from)."""
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        got = f"a generator on {generator.device}" if isinstance(generator, torch.Generator) else repr(generator)
        raise TypeError(f"generator must be a CPU torch.Generator (every random draw comes from it, on the CPU, "
                        f"so runs reproduce on any device); got {got}")


def check_option_names(name: str, keys: Iterable[str], defaults: Mapping[str, object]) -> None:
    """ValueError naming the first of ``keys`` that augmentation ``name`` (whose options are
    ``defaults``) does not have, and listing the ones it has."""
    for key in keys:
        if key not in defaults:
            valid = ", ".join(defaults) or "none (a preset takes no options)"
            raise ValueError(f"unknown option {key!r} of augmentation {name!r}; its options: {valid}")

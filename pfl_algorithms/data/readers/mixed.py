"""A mixture of datasets side by side (e.g. MNIST, SVHN and CIFAR-10 clients in one federation).

Each part's raw pixels are brought to one shape: scaled to [0, 1] (uint8 / 255), grey images
repeated to 3 channels (``channels=3``) or colour images reduced to luma
(``channels=1``: 0.299 R + 0.587 G + 0.114 B, the ITU-R 601-2 weights PIL's "L" mode uses),
then resized where their size differs with
``torch.nn.functional.interpolate(mode="bilinear", antialias=True, align_corners=False)``.
The parts' classes are kept apart: part d's class c becomes ``offset_d + c`` where
``offset_d`` is the number of classes of the parts before it; class names become
``"<part>:<name>"``.  ``domains`` holds each sample's part index and ``domain_names`` the
parts' names; the official test samples stay marked (parts without a test split count as
train).  Per-part extras (CIFAR-100's coarse labels, FEMNIST's writers, PACS's domains) are
dropped.  Samples are ordered part by part, each part as its reader gives it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import RawData

LUMA = (0.299, 0.587, 0.114)
_CHUNK = 4096  # samples resized at once: bounds the temporaries of large parts


def to_shape(pixels: Tensor, image_size: int, channels: int, out: Optional[Tensor] = None) -> Tensor:
    """[N, C, H, W] pixels (uint8 or float in [0, 1]) as float32 [N, channels, image_size,
    image_size] in [0, 1], converted a chunk of samples at a time (each sample on its own),
    written into ``out`` when given."""
    if pixels.shape[1] not in (1, 3):
        raise ValueError(f"mixed: parts must have 1 or 3 channels, got {pixels.shape[1]}")
    if out is None:
        out = torch.empty(len(pixels), channels, image_size, image_size)
    for chunk, target in zip(pixels.split(_CHUNK), out.split(_CHUNK)):
        target.copy_(_chunk_to_shape(chunk, image_size, channels))
    return out


def _chunk_to_shape(pixels: Tensor, image_size: int, channels: int) -> Tensor:
    x = pixels.float() / 255.0 if pixels.dtype == torch.uint8 else pixels.float()
    if channels == 1 and x.shape[1] == 3:
        x = torch.einsum("nchw,c->nhw", x, torch.tensor(LUMA)).unsqueeze(1)
    if tuple(x.shape[2:]) != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", antialias=True, align_corners=False)
    return x.expand(-1, channels, -1, -1) if x.shape[1] != channels else x


def check_options(image_size: int, channels: int) -> None:
    """ValueError unless ``image_size`` is an integer >= 1 and ``channels`` is 1 or 3."""
    if isinstance(channels, bool) or channels not in (1, 3):
        raise ValueError(f"mixed: channels must be 1 or 3, got {channels!r}")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"mixed: image_size must be an integer >= 1, got {image_size!r}")


def mix(parts: dict[str, RawData], *, image_size: int = 32, channels: int = 3) -> RawData:
    """One RawData of the ``parts`` (name -> raw data, in order), as the module docstring says."""
    check_options(image_size, channels)
    if not parts:
        raise ValueError("mixed: needs at least one dataset")
    # One buffer for the whole mixture: the parts are converted straight into it.
    pixels = torch.empty(sum(len(raw) for raw in parts.values()), channels, image_size, image_size)
    labels, domains, masks, class_names = [], [], [], []
    offset = start = 0
    for index, (name, raw) in enumerate(parts.items()):
        to_shape(raw.pixels, image_size, channels, out=pixels[start:start + len(raw)])
        start += len(raw)
        labels.append(raw.labels + offset)
        domains.append(torch.full((len(raw),), index, dtype=torch.int64))
        masks.append(raw.test_mask if raw.test_mask is not None else torch.zeros(len(raw), dtype=torch.bool))
        names = raw.class_names or tuple(str(c) for c in range(raw.num_classes))
        class_names += [f"{name}:{c}" for c in names]
        offset += raw.num_classes
    return RawData(pixels, torch.cat(labels), offset, test_mask=torch.cat(masks),
                   class_names=tuple(class_names), domains=torch.cat(domains), domain_names=tuple(parts))

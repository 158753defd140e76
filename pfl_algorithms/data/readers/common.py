"""What every format reader shares: the data root, the torchvision switch, the raw dataset
they return (pixels before normalization) and the errors for missing or corrupt files.

Every reader returns a ``RawData``: pixels exactly as stored (uint8 0..255, or float32 in
[0, 1] where the format stores floats), labels as int64, train samples first and the official
test samples after them (``test_mask``).  Readers that can use torchvision's dataset classes
and those that parse the files themselves hand their numpy arrays to the same conversion
code, so both paths give identical tensors; ``datasets.py`` normalizes afterwards.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

ENV_DATA_ROOT = "PFL_DATA_ROOT"
ENV_NO_TORCHVISION = "PFL_NO_TORCHVISION"
DEFAULT_DATA_ROOT = "./data"
ROOT_HINT = f"(the data root is --data-root, else ${ENV_DATA_ROOT}, else {DEFAULT_DATA_ROOT})"


def data_root(root=None) -> Path:
    """The data directory every file-backed dataset reads below.

    The rule, in order: ``root`` when given (``--data-root`` on the command line); else the
    environment variable ``PFL_DATA_ROOT`` when it is set and not empty; else ``./data``
    relative to the working directory.  ``~`` is expanded; the directory need not exist
    (the reader then names the file it could not find).
    """
    if root is None or str(root) == "":
        root = os.environ.get(ENV_DATA_ROOT) or DEFAULT_DATA_ROOT
    return Path(root).expanduser()


@functools.lru_cache(maxsize=1)
def _import_torchvision_datasets():
    try:
        import torchvision.datasets
    except Exception:  # noqa: BLE001  a CPU build of torch can make the import fail with RuntimeError too
        return None
    return torchvision.datasets


def torchvision_datasets():
    """``torchvision.datasets`` where torchvision imports, else None.

    Setting the environment variable ``PFL_NO_TORCHVISION`` to anything but ``""`` or ``"0"``
    forces the direct readers even where torchvision imports (the tests compare the paths).
    """
    if os.environ.get(ENV_NO_TORCHVISION, "") not in ("", "0"):
        return None
    return _import_torchvision_datasets()


def check_download(download: bool, dataset: str, directory: Path, how_to_get: str, *, supported: bool = True):
    """Raise ValueError when ``download=True`` cannot be honoured: the dataset has no
    downloader (``supported=False``) or torchvision, which downloads, does not import."""
    if not download:
        return
    if not supported:
        raise ValueError(f"{dataset}: download=True is not available, there is no downloader for this "
                         f"dataset; put its files in {directory} yourself: {how_to_get}")
    if torchvision_datasets() is None:
        raise ValueError(f"{dataset}: download=True needs torchvision and a network, and torchvision does not "
                         f"import here (or {ENV_NO_TORCHVISION} is set); put the files in {directory} "
                         f"yourself: {how_to_get}")


def missing_file(path: Path, dataset: str, how_to_get: str, alternatives: Sequence[str] = ()) -> FileNotFoundError:
    """The error for a file (or directory) a reader needs and could not find: which file,
    the directory it was looked for in, and how to get it."""
    also = f" (nor {', '.join(repr(name) for name in alternatives)})" if alternatives else ""
    return FileNotFoundError(f"{dataset}: {path.name!r}{also} not found in {path.parent}; {how_to_get} {ROOT_HINT}")


def find_file(directory: Path, names: Sequence[str], dataset: str, how_to_get: str) -> Path:
    """The first of ``names`` that is a file in ``directory``; FileNotFoundError naming them otherwise."""
    for name in names:
        if (directory / name).is_file():
            return directory / name
    raise missing_file(directory / names[0], dataset, how_to_get, names[1:])


def name_list(value: Union[str, Sequence[str]]) -> tuple:
    """A tuple of names from a sequence or a comma-separated string (what ``--set`` and a
    config file give for a list option)."""
    return tuple(name.strip() for name in value.split(",")) if isinstance(value, str) else tuple(value)


def check_labels(labels: Tensor, num_classes: int, source) -> Tensor:
    """``labels`` as int64 after checking they lie in [0, num_classes) (ValueError naming ``source``)."""
    labels = labels.to(torch.int64)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"{source}: labels must lie in [0, {num_classes}), found "
                         f"{int(labels.min())}..{int(labels.max())}")
    return labels


def nchw_tensor(array, layout: str) -> Tensor:
    """A contiguous [N, C, H, W] tensor from a numpy array (or tensor) in ``layout``
    ("NHW", "NHWC", "NCHW" or "HWCN"), sharing nothing with the input."""
    array = np.asarray(array)
    order = {"NHW": None, "NHWC": (0, 3, 1, 2), "NCHW": (0, 1, 2, 3), "HWCN": (3, 2, 0, 1)}[layout]
    if array.ndim != len(layout):
        raise ValueError(f"expected a {layout} array, got shape {array.shape}")
    array = array[:, None] if order is None else array.transpose(order)
    return torch.from_numpy(np.array(array, order="C"))  # one copy, writable, C order


@dataclass
class RawData:
    """A dataset as read from its files, before normalization.

    Attributes:
        pixels: [N, C, H, W] uint8 (0..255) or float32 in [0, 1].
        labels: [N] int64 in [0, num_classes).
        num_classes: the number of classes.
        test_mask: [N] bool, True for the official test samples (None: no official test split).
        class_names, coarse_names, writer_names, domain_names: names in id order (or None).
        coarse_labels, writers, domains: [N] int64 per-sample ids (or None).
    """

    pixels: Tensor
    labels: Tensor
    num_classes: int
    test_mask: Optional[Tensor] = None
    class_names: Optional[tuple] = None
    coarse_labels: Optional[Tensor] = None
    coarse_names: Optional[tuple] = None
    writers: Optional[Tensor] = None
    writer_names: Optional[tuple] = None
    domains: Optional[Tensor] = None
    domain_names: Optional[tuple] = None

    def __post_init__(self):
        if self.pixels.dim() != 4 or self.pixels.dtype not in (torch.uint8, torch.float32):
            raise ValueError(f"pixels must be [N, C, H, W] uint8 or float32, got {self.pixels.dtype} "
                             f"{tuple(self.pixels.shape)}")
        for name in PER_SAMPLE:
            value = getattr(self, name)
            if value is not None and value.shape != (len(self.pixels),):
                raise ValueError(f"{name} must have shape ({len(self.pixels)},), got {tuple(value.shape)}")

    def __len__(self) -> int:
        """The number of samples N."""
        return int(self.pixels.shape[0])


PER_SAMPLE = ("labels", "test_mask", "coarse_labels", "writers", "domains")


def pool_splits(train: RawData, test: RawData, sources: Optional[Sequence] = None) -> RawData:
    """One RawData: ``train``'s samples then ``test``'s, with ``test_mask`` marking the latter.

    The names (class, coarse, writer, domain) are ``train``'s; the image shape and dtype must
    agree (else a ValueError naming ``sources``, the train and the test split's files), and a
    per-sample field must be given for both splits or for neither.
    """
    if train.pixels.shape[1:] != test.pixels.shape[1:] or train.pixels.dtype != test.pixels.dtype:
        names = sources if sources is not None else ("the train split", "the test split")
        raise ValueError(f"train and test images differ: {names[0]} holds {train.pixels.dtype} "
                         f"{tuple(train.pixels.shape[1:])}, {names[1]} holds {test.pixels.dtype} "
                         f"{tuple(test.pixels.shape[1:])}")
    per_sample = {}
    for name in PER_SAMPLE[2:]:
        a, b = getattr(train, name), getattr(test, name)
        if (a is None) != (b is None):
            raise ValueError(f"{name} is given for only one of the train and test splits")
        per_sample[name] = None if a is None else torch.cat([a, b])
    mask = torch.cat([torch.zeros(len(train), dtype=torch.bool), torch.ones(len(test), dtype=torch.bool)])
    return replace(train, pixels=torch.cat([train.pixels, test.pixels]), labels=torch.cat([train.labels, test.labels]),
                   test_mask=mask, **per_sample)

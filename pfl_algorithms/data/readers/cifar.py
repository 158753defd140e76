"""CIFAR-10 and CIFAR-100: the "python version" pickle batches, in torchvision's layout.

    <root>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
    <root>/cifar-100-python/{train, test, meta}

Each batch is a Python 2 pickle of a dict: ``data`` [n, 3072] uint8 (the red, green and blue
32x32 planes of each image), ``labels`` (CIFAR-10) or ``fine_labels`` and ``coarse_labels``
(CIFAR-100).  The meta files hold ``label_names`` (CIFAR-10) or ``fine_label_names`` and
``coarse_label_names``: exactly 10 names, or 100 fine and 20 coarse ones (another count is
refused).  Like torchvision they are unpickled with ``encoding="latin1"``; keys
written as bytes are accepted too.  The unpickler only builds numpy arrays, numpy scalars
(labels written as ``np.int64`` values) and plain Python values, so a tampered file cannot
run code; and a label column's type, length and items are checked before it is converted,
so a pickle of shared references (a few KB that ``np.asarray`` would expand to gigabytes) is
refused without being expanded.  CIFAR-100's coarse labels are read from the pickles on both
paths (torchvision's class ignores them).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .common import RawData, check_download, check_labels, find_file, nchw_tensor, pool_splits, torchvision_datasets

CIFAR10_HOW = ("download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and extract it in the data root, "
               "or pass download=True where torchvision is installed and a network is reachable")
CIFAR100_HOW = ("download https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz and extract it in the data root, "
                "or pass download=True where torchvision is installed and a network is reachable")

# The globals a CIFAR pickle needs: numpy's array and scalar reconstruction (under both
# module names numpy has used: numpy.core before 2.0, numpy._core since; ``_frombuffer`` is
# how protocol 5 writes arrays), the dtype objects they take, and the codec Python 3 uses for
# bytes in protocol-2 pickles.  None of them calls anything the file names: they only copy
# bytes into a value of the given dtype, and an object dtype's items must themselves be built
# from these globals.
_ALLOWED_GLOBALS = {(f"{package}.multiarray", name) for package in ("numpy.core", "numpy._core")
                    for name in ("_reconstruct", "scalar")}
_ALLOWED_GLOBALS |= {(f"{package}.numeric", "_frombuffer") for package in ("numpy.core", "numpy._core")}
_ALLOWED_GLOBALS |= {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load the global {module}.{name}")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):
            module = "numpy._core." + module[len("numpy.core."):]  # numpy 2 moved them; the old name warns
        return super().find_class(module, name)


def load_pickle(path: Path, keys) -> dict:
    """The dict pickled in ``path`` (str keys; bytes keys and bytes strings are decoded as
    latin-1), after checking it has every key of ``keys``.

    Raises:
        ValueError: naming the file, when it is not such a pickle or lacks a key.
    """
    try:
        with open(path, "rb") as f:
            entry = _ArrayUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise ValueError(f"{path}: not a CIFAR python pickle ({error})") from error
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: not a CIFAR python pickle (holds a {type(entry).__name__}, not a dict)")
    entry = {_text(k): v for k, v in entry.items()}
    missing = [k for k in keys if k not in entry]
    if missing:
        raise ValueError(f"{path}: no {', '.join(repr(k) for k in missing)} in the pickle (it has {sorted(entry)})")
    return entry


def _text(value):
    return value.decode("latin1") if isinstance(value, bytes) else value


def _batch(path: Path, label_keys) -> tuple[np.ndarray, list]:
    """(data [n, 3072] uint8, one list of n labels per key of ``label_keys``) of one batch."""
    entry = load_pickle(path, ("data", *label_keys))
    data = entry["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise ValueError(f"{path}: 'data' must be an [n, 3072] uint8 array, got {type(data).__name__} {shape}")
    return data, [_label_column(path, key, entry[key], len(data)) for key in label_keys]


def _label_column(path: Path, key: str, value, n: int) -> np.ndarray:
    """``value`` as n int64 labels, after checking its type, length and items without
    converting it: a list of lists built from shared references pickles in a few bytes but
    would make ``np.asarray`` allocate the product of their lengths.  An array must be 1-D (or
    an [n, 1] column) of integers; a list's items must be integers, not booleans."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise ValueError(f"{path}: {key!r} must hold integers, got an array of {value.dtype}")
        if value.ndim != 1 and not (value.ndim == 2 and value.shape[1] == 1):
            raise ValueError(f"{path}: {key!r} must be a 1-D array of integers (or an [n, 1] column), "
                             f"got shape {value.shape}")
        size = value.size
    elif isinstance(value, (list, tuple)):
        size = len(value)
    else:
        raise ValueError(f"{path}: {key!r} must be a list of integers, got {type(value).__name__}")
    if size != n:
        raise ValueError(f"{path}: {n} images but {size} {key!r}")
    if isinstance(value, np.ndarray):
        return value.reshape(-1).astype(np.int64)
    for i, item in enumerate(value):
        if not isinstance(item, (int, np.integer)) or isinstance(item, bool):
            raise ValueError(f"{path}: {key!r}[{i}] must be an integer, got {type(item).__name__}")
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError:
        raise ValueError(f"{path}: {key!r} holds an integer beyond int64") from None


def _names(path: Path, key: str, count: int) -> tuple:
    """The ``count`` class names listed under ``key`` in the meta file ``path``."""
    names = load_pickle(path, (key,))[key]
    if not isinstance(names, (list, tuple)):
        raise ValueError(f"{path}: {key!r} must be a list of strings, got {type(names).__name__}")
    for i, name in enumerate(names):
        if not isinstance(name, (str, bytes)):
            raise ValueError(f"{path}: {key!r}[{i}] must be a string, got {type(name).__name__}")
    return _check_count(tuple(_text(n) for n in names), count, path, key)


def _check_count(names: tuple, count: int, path: Path, key: str) -> tuple:
    if len(names) != count:
        raise ValueError(f"{path}: {key!r} must list {count} class names, got {len(names)}")
    return names


@dataclass(frozen=True)
class CifarLayout:
    """Where one CIFAR variant keeps its files and which keys its pickles use."""

    dataset: str
    folder: str
    train_files: tuple
    test_file: str
    meta: str
    names_key: str
    label_key: str
    torchvision_class: str
    how_to_get: str
    coarse: bool  # CIFAR-100's coarse labels and names are read too
    num_classes: int  # the number of names the meta file must list under names_key

    @property
    def files(self) -> tuple:
        """Every file the variant needs, the meta file last."""
        return (*self.train_files, self.test_file, self.meta)


CIFAR10 = CifarLayout("cifar10", "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch",
                      "batches.meta", "label_names", "labels", "CIFAR10", CIFAR10_HOW, coarse=False,
                      num_classes=10)
CIFAR100 = CifarLayout("cifar100", "cifar-100-python", ("train",), "test", "meta", "fine_label_names", "fine_labels",
                       "CIFAR100", CIFAR100_HOW, coarse=True, num_classes=100)


COARSE_CLASSES = 20  # CIFAR-100's superclasses


def _split_files(layout: CifarLayout) -> tuple:
    return layout.train_files, (layout.test_file,)


def _coarse(directory: Path, files) -> np.ndarray:
    return np.concatenate([_batch(directory / name, ("coarse_labels",))[1][0] for name in files])


def _via_torchvision(tv, root: Path, layout: CifarLayout, download: bool):
    """[(NCHW uint8 pixels, labels, coarse labels or None)] for train and test, and the class
    names; images and labels through torchvision, coarse labels from the pickles."""
    directory = Path(root) / layout.folder
    try:
        parts = [getattr(tv, layout.torchvision_class)(str(root), train=train, download=download)
                 for train in (True, False)]
    except RuntimeError as error:  # torchvision found no files, or files with other checksums
        if download:
            raise
        for name in layout.files:
            find_file(directory, (name,), layout.dataset, layout.how_to_get)
        raise ValueError(f"{layout.dataset}: torchvision refused the files in {directory} ({error}); "
                         f"set PFL_NO_TORCHVISION=1 to read them without its checksum test") from error
    splits = [(nchw_tensor(part.data, "NHWC"), np.asarray(part.targets, dtype=np.int64),
               _coarse(directory, files) if layout.coarse else None)
              for part, files in zip(parts, _split_files(layout))]
    return splits, tuple(parts[0].classes)


def _direct(directory: Path, layout: CifarLayout):
    """[(NCHW uint8 pixels, labels, coarse labels or None)] for train and test, and the class
    names, from the pickles."""
    for name in layout.files:
        find_file(directory, (name,), layout.dataset, layout.how_to_get)
    keys = (layout.label_key, "coarse_labels") if layout.coarse else (layout.label_key,)
    splits = []
    for files in _split_files(layout):
        batches = [_batch(directory / name, keys) for name in files]
        pixels = nchw_tensor(np.concatenate([data for data, _ in batches]).reshape(-1, 3, 32, 32), "NCHW")
        labels = [np.concatenate([columns[i] for _, columns in batches]) for i in range(len(keys))]
        splits.append((pixels, labels[0], labels[1] if layout.coarse else None))
    return splits, _names(directory / layout.meta, layout.names_key, layout.num_classes)


def read_cifar(root: Path, layout: CifarLayout, *, download: bool = False) -> RawData:
    """A CIFAR variant's train then test images [N, 3, 32, 32] uint8, through torchvision
    where it imports, else from the pickles (identical tensors).  The meta file must name
    exactly the variant's classes (10, or 100 fine and 20 coarse): ValueError otherwise."""
    directory = Path(root) / layout.folder
    check_download(download, layout.dataset, directory, layout.how_to_get)
    tv = torchvision_datasets()
    splits, class_names = _via_torchvision(tv, root, layout, download) if tv is not None else _direct(directory, layout)
    class_names = _check_count(class_names, layout.num_classes, directory / layout.meta, layout.names_key)
    coarse_names = _names(directory / layout.meta, "coarse_label_names", COARSE_CLASSES) if layout.coarse else None
    raw, sources = [], []
    for (pixels, labels, coarse), files in zip(splits, _split_files(layout)):
        source = directory / files[0] if len(files) == 1 else f"{directory}/{{{','.join(files)}}}"
        sources.append(source)
        extra = {}
        if coarse is not None:
            if len(coarse) != len(pixels):
                raise ValueError(f"{source}: {len(pixels)} images but {len(coarse)} coarse labels")
            extra = {"coarse_labels": check_labels(torch.from_numpy(coarse), COARSE_CLASSES, source),
                     "coarse_names": coarse_names}
        labels = check_labels(torch.from_numpy(labels), len(class_names), source)
        raw.append(RawData(pixels, labels, len(class_names), class_names=class_names, **extra))
    return pool_splits(*raw, sources=sources)


def read_cifar10(root: Path, *, download: bool = False) -> RawData:
    """CIFAR-10's 50,000 train and 10,000 test images: [60000, 3, 32, 32] uint8, 10 classes
    named by ``batches.meta``, test last.  ``root`` is the data root."""
    return read_cifar(root, CIFAR10, download=download)


def read_cifar100(root: Path, *, download: bool = False) -> RawData:
    """CIFAR-100's 50,000 train and 10,000 test images: [60000, 3, 32, 32] uint8, 100 fine
    classes (``fine_label_names``) and 20 superclasses (``coarse_labels``,
    ``coarse_label_names``), test last.  ``root`` is the data root."""
    return read_cifar(root, CIFAR100, download=download)

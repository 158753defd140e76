"""SVHN (cropped digits): the MATLAB files, in torchvision's layout.

    <root>/train_32x32.mat, <root>/test_32x32.mat (and <root>/extra_32x32.mat with extra=True)

Each file (MATLAB v5, read with ``scipy.io.loadmat``) holds ``X`` [32, 32, 3, N] uint8 and
``y`` [N, 1] with labels 1..10, where 10 stands for the digit 0; as torchvision does, 10 is
mapped to 0, so labels are the digits 0..9.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .common import RawData, check_download, check_labels, find_file, nchw_tensor, pool_splits, torchvision_datasets
from .matlab import declared_variables

SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"
SVHN_HOW = (f"download train_32x32.mat and test_32x32.mat (and extra_32x32.mat for extra=True) from {SVHN_URL} "
            f"into the data root, or pass download=True where torchvision is installed and a network is reachable")
SVHN_CLASSES = tuple(str(d) for d in range(10))


def read_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(X [32, 32, 3, N] uint8, y [N] int64: the labels 1..10 as stored) of one SVHN .mat file.

    Raises:
        ImportError: scipy is not installed.
        ValueError: naming the file, when it is not a MATLAB file or lacks or misshapes X or y
            (for a v5 file, from its variables' headers, before any array is read), or when y
            holds anything but whole numbers 1..10 (SVHN's files store them as doubles; a
            fraction, NaN or 0 is refused rather than truncated or read as the digit 0).
    """
    try:
        from scipy.io import loadmat
    except ImportError as error:
        raise ImportError("svhn: reading the .mat files needs scipy: pip install scipy") from error
    # What the file declares is checked before loadmat allocates it: a small compressed file
    # can declare gigabytes (the checks repeat on the arrays read, for files that are not v5).
    declared = declared_variables(path)
    if declared is not None:
        _check_arrays(path, {name: variable for name, variable in declared.items() if name in ("X", "y")},
                      sorted(declared))
    try:
        mat = loadmat(str(path), variable_names=("X", "y"))
    except Exception as error:  # noqa: BLE001  scipy raises several types for a damaged file
        raise ValueError(f"{path}: not a readable MATLAB file ({type(error).__name__}: {error})") from error
    _check_arrays(path, {key: (mat[key].dtype.name, mat[key].shape) for key in ("X", "y") if key in mat},
                  sorted(key for key in mat if not key.startswith("__")))
    return mat["X"], _stored_labels(path, mat["y"].reshape(-1))


def _stored_labels(path: Path, y: np.ndarray) -> np.ndarray:
    """``y`` as int64 after checking it holds whole numbers 1..10 (ValueError naming the file)."""
    if y.dtype.kind not in "iuf":
        raise ValueError(f"{path}: y must hold numbers (the labels 1..10), got {y.dtype}")
    if y.dtype.kind == "f":
        fractional = ~(np.floor(y) == y) & ~np.isinf(y)  # NaN is fractional; infinities fail the range test
        if fractional.any():
            raise ValueError(f"{path}: y must hold whole numbers (the labels 1..10), found {y[fractional][0]:g}")
    if y.size and (y.min() < 1 or y.max() > 10):
        raise ValueError(f"{path}: y must hold the labels 1..10 (10 for the digit 0), found {y.min():g}..{y.max():g}")
    return y.astype(np.int64)


def _check_arrays(path: Path, arrays: dict, present: list) -> None:
    """``arrays``: name -> (dtype name, shape) of X and y where present: X [32, 32, 3, N] uint8
    and N labels in y, else a ValueError naming the file (``present``: every variable's name)."""
    missing = [key for key in ("X", "y") if key not in arrays]
    if missing:
        raise ValueError(f"{path}: no {' and '.join(missing)} in the file (it has {present})")
    (dtype, shape), (_, label_shape) = arrays["X"], arrays["y"]
    if dtype != "uint8" or len(shape) != 4 or tuple(shape[:3]) != (32, 32, 3):
        raise ValueError(f"{path}: X must be [32, 32, 3, N] uint8, got {dtype} {list(shape)}")
    labels = int(np.prod(label_shape))
    if labels != shape[3]:
        raise ValueError(f"{path}: {shape[3]} images in X but {labels} labels in y")


def _raw_split(pixels: torch.Tensor, labels: np.ndarray, source) -> RawData:
    """The conversion both paths share: labels 10 -> 0, checked to be digits."""
    labels = torch.from_numpy(np.where(labels == 10, 0, labels).astype(np.int64))
    return RawData(pixels, check_labels(labels, 10, source), 10, class_names=SVHN_CLASSES)


def read_svhn(root: Path, *, extra: bool = False, download: bool = False) -> RawData:
    """SVHN's train (73,257 images; with ``extra``, then the 531,131 extra ones) and test
    (26,032) images: [N, 3, 32, 32] uint8, labels 0..9, test last.  ``root`` is the data root."""
    root = Path(root)
    check_download(download, "svhn", root, SVHN_HOW)
    tv = torchvision_datasets()
    names = ("train", "extra") if extra else ("train",)
    train = [_read_file(tv, root, name, download) for name in names]
    if len(train) > 1:
        train = [RawData(torch.cat([p.pixels for p in train]), torch.cat([p.labels for p in train]), 10,
                         class_names=SVHN_CLASSES)]
    train_source = root / "train_32x32.mat" if not extra else f"{root}/{{train,extra}}_32x32.mat"
    return pool_splits(train[0], _read_file(tv, root, "test", download),
                       sources=(train_source, root / "test_32x32.mat"))


def _read_file(tv, root: Path, name: str, download: bool) -> RawData:
    """``<root>/<name>_32x32.mat`` through torchvision (``tv`` not None) or scipy."""
    source = root / f"{name}_32x32.mat"
    if tv is None:
        images, labels = read_mat(find_file(root, (source.name,), "svhn", SVHN_HOW))
        return _raw_split(nchw_tensor(images, "HWCN"), labels, source)
    try:
        ds = tv.SVHN(str(root), split=name, download=download)
    except RuntimeError as error:  # torchvision found no file, or one with another checksum
        if download:
            raise
        find_file(root, (source.name,), "svhn", SVHN_HOW)
        raise ValueError(f"svhn: torchvision refused {source} ({error}); "
                         f"set PFL_NO_TORCHVISION=1 to read it without its checksum test") from error
    return _raw_split(nchw_tensor(ds.data, "NCHW"), np.asarray(ds.labels, dtype=np.int64).reshape(-1), source)

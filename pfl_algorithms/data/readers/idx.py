"""MNIST and EMNIST: the IDX files, in torchvision's layout.

    <root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte            (or the same + .gz)
    <root>/EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte   (or + .gz)
    <root>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte     (or + .gz)

IDX (LeCun's format): a big-endian header, the magic number (two zero bytes, a type code
(0x08 = uint8) and the number of dimensions), one uint32 per dimension, then the values
row-major.  Images are [N, 28, 28] uint8, labels [N] uint8.

EMNIST orientation: the EMNIST files store each character transposed (rows and columns
swapped with respect to an upright image), and torchvision's ``EMNIST.data`` returns them as
stored.  These readers do the same, so pixel [n, 0, i, j] is value (i, j) of image n in the
file whichever path read it; transpose the last two dims to see upright characters.
EMNIST ``letters`` labels are 1..26 in the files (torchvision keeps them, naming class 0
"N/A"); here they are shifted to 0..25 with class names ``a``..``z``.
"""
from __future__ import annotations

import gzip
import math
import string
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .common import RawData, check_download, check_labels, find_file, nchw_tensor, pool_splits, torchvision_datasets

_IDX_TYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
MNIST_HOW = (f"download train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and "
             f"t10k-labels-idx1-ubyte.gz from {MNIST_URL} (or http://yann.lecun.com/exdb/mnist/) into that "
             f"directory, or pass download=True where torchvision is installed and a network is reachable")
EMNIST_URL = "https://www.itl.nist.gov/iaui/vip/cs_links/EMNIST/gzip.zip"
EMNIST_HOW = (f"download {EMNIST_URL} and put the emnist-<split>-*.gz files of its gzip/ folder into that "
              f"directory, or pass download=True where torchvision is installed and a network is reachable")

_MERGED = set("cijklmopsuvwxyz")  # lowercase letters EMNIST merges with their uppercase form
EMNIST_CLASSES = {
    "byclass": tuple(sorted(string.digits + string.ascii_letters)),
    "bymerge": tuple(sorted(set(string.digits + string.ascii_letters) - _MERGED)),
    "balanced": tuple(sorted(set(string.digits + string.ascii_letters) - _MERGED)),
    "letters": tuple(string.ascii_lowercase),
    "digits": tuple(string.digits),
    "mnist": tuple(string.digits),
}
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_MNIST_HOW = (f"download train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz "
                     f"and t10k-labels-idx1-ubyte.gz from {FASHION_MNIST_URL} (or "
                     f"https://github.com/zalandoresearch/fashion-mnist) into that directory, or pass download=True "
                     f"where torchvision is installed and a network is reachable")
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")  # torchvision's names
MNIST_CLASSES = ("0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five", "6 - six", "7 - seven",
                 "8 - eight", "9 - nine")  # torchvision's names


# deflate's largest ratio is 1032:1 (a 258-byte match per 2 bits or so): a .gz of n bytes
# cannot hold more than this many times n.  A header declaring more is refused before anything
# is decompressed or allocated.
_GZIP_MAX_RATIO = 1032
_CHUNK = 1 << 20  # bytes decompressed at a time


def read_idx(path: Path, ndim: Optional[int] = None, dtype: Optional[np.dtype] = None) -> np.ndarray:
    """The array stored in the IDX file ``path`` (gzip-compressed when the name ends in .gz),
    in native byte order.

    The header is read first and the data size it declares (computed in Python integers, so
    no product of dimensions wraps) is checked before any data is read: against the file's
    size for a plain file, against the most a gzip stream of the file's size can expand to
    for a .gz (so a small hostile .gz cannot make the reader allocate gigabytes).  Then
    exactly the declared bytes are read, streamed into the array; fewer (truncated) or more
    (trailing bytes) is refused.  ``ndim``/``dtype``: what the caller expects, checked
    against the header before the data is read.

    Raises:
        ValueError: one line naming the file, for a bad magic number, a truncated header, a
            dimension or type other than expected, or a size that differs from what the
            header's dimensions need.
    """
    path = Path(path)
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as stream:
            return _read_idx_stream(path, stream, ndim, dtype)
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: not a readable gzip file ({error})" if path.suffix == ".gz"
                         else f"{path}: unreadable ({error})") from None


def _read_idx_stream(path: Path, stream, ndim: Optional[int], dtype: Optional[np.dtype]) -> np.ndarray:
    magic = stream.read(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_TYPES or magic[3] == 0:
        raise ValueError(f"{path}: not an IDX file: magic number {magic.hex() or 'missing'}, expected 0000 then "
                         f"a type code ({', '.join(f'{t:02x}' for t in _IDX_TYPES)}) and the number of dimensions")
    stored, dims_count = _IDX_TYPES[magic[2]], magic[3]
    header = 4 + 4 * dims_count
    raw_dims = stream.read(4 * dims_count)
    if len(raw_dims) < 4 * dims_count:
        raise ValueError(f"{path}: truncated IDX header ({4 + len(raw_dims)} bytes, {dims_count} dimensions need "
                         f"{header})")
    dims = struct.unpack(f">{dims_count}I", raw_dims)
    if (ndim is not None and dims_count != ndim) or (dtype is not None and stored.newbyteorder("=") != dtype):
        raise ValueError(f"{path}: expected {dims_count if ndim is None else ndim}-dimensional "
                         f"{np.dtype(dtype or stored.newbyteorder('='))} data, "
                         f"got {dims_count}-dimensional {stored.newbyteorder('=')}")
    count = math.prod(dims)  # Python integers: never wraps
    expected = header + count * stored.itemsize
    disk = path.stat().st_size
    if path.suffix == ".gz":
        if expected > _GZIP_MAX_RATIO * disk:
            raise ValueError(f"{path}: the header gives dimensions {list(dims)} ({expected} bytes) but a gzip file "
                             f"of {disk} bytes cannot hold more than {_GZIP_MAX_RATIO * disk}; refusing to read it")
    elif expected != disk:
        raise ValueError(f"{path}: the header gives dimensions {list(dims)} ({expected} bytes) but the file "
                         f"holds {disk} bytes")
    array = np.empty(count, dtype=stored)
    view = memoryview(array.view(np.uint8))
    filled = 0
    while filled < len(view):
        got = stream.readinto(view[filled:filled + _CHUNK])
        if not got:
            raise ValueError(f"{path}: the header gives dimensions {list(dims)} ({expected} bytes) but the file "
                             f"holds {header + filled} bytes (truncated)")
        filled += got
    if stream.read(1):
        raise ValueError(f"{path}: the header gives dimensions {list(dims)} ({expected} bytes) but the file "
                         f"holds more (trailing bytes)")
    if not stored.isnative:
        array = array.byteswap(inplace=True).view(stored.newbyteorder("="))
    return array.reshape(dims)


def _read_typed(path: Path, ndim: int) -> np.ndarray:
    return read_idx(path, ndim=ndim, dtype=np.dtype(np.uint8))


@dataclass(frozen=True)
class IdxLayout:
    """One IDX dataset: its registry name, its folder under the data root, the file prefixes
    of its train and test splits, torchvision's class (and keyword arguments) for it, where
    to get it, its class names and the shift that makes its labels start at 0."""

    dataset: str
    folder: str
    prefixes: tuple
    torchvision_class: str
    torchvision_kwargs: tuple  # (name, value) pairs
    how_to_get: str
    class_names: tuple
    label_shift: int = 0


def raw_split(layout: IdxLayout, images, labels, source: Path, labels_source: Optional[Path] = None) -> RawData:
    """The conversion every IDX-shaped reader shares (the IDX files, torchvision's copy, the MNIST
    CSVs of ``sources``): [N, H, W] uint8 images and [N] labels to RawData.  Errors name
    ``source``, the images' file, and ``labels_source``, the labels' file when it is another."""
    images, labels = np.asarray(images), np.asarray(labels).astype(np.int64) - layout.label_shift
    labels_source = source if labels_source is None else labels_source
    if len(images) != len(labels):
        also = "" if labels_source == source else f" in {labels_source}"
        raise ValueError(f"{source}: {len(images)} images but {len(labels)} labels{also}")
    labels = check_labels(torch.from_numpy(labels), len(layout.class_names), labels_source)
    return RawData(nchw_tensor(images, "NHW"), labels, len(layout.class_names), class_names=layout.class_names)


def _stems(layout: IdxLayout) -> list:
    return [(f"{p}-images-idx3-ubyte", f"{p}-labels-idx1-ubyte") for p in layout.prefixes]


def has_idx_files(directory: Path, layout: IdxLayout) -> bool:
    """Whether ``directory`` holds any of ``layout``'s IDX files (plain or .gz): then they are
    the dataset's source, and a missing or corrupt one is an error rather than a reason to
    look elsewhere."""
    return any((Path(directory) / (name + ext)).is_file()
               for pair in _stems(layout) for name in pair for ext in ("", ".gz"))


def read_idx_files(directory: Path, layout: IdxLayout, how_to_get: str = "") -> RawData:
    """Train then test of an IDX dataset parsed from the files in ``directory`` itself (plain
    or .gz, the plain file first), without torchvision.  ``how_to_get`` replaces the layout's
    advice in the error for a missing file."""
    directory, how_to_get = Path(directory), how_to_get or layout.how_to_get
    splits, sources = [], []
    for images_stem, labels_stem in _stems(layout):
        images_path = find_file(directory, (images_stem, images_stem + ".gz"), layout.dataset, how_to_get)
        labels_path = find_file(directory, (labels_stem, labels_stem + ".gz"), layout.dataset, how_to_get)
        images, labels = _read_typed(images_path, 3), _read_typed(labels_path, 1)
        splits.append(raw_split(layout, images, labels, images_path, labels_path))
        sources.append(images_path)
    return pool_splits(*splits, sources=sources)


def read_idx_dataset(root: Path, layout: IdxLayout, *, download: bool = False, how_to_get: str = "") -> RawData:
    """Train then test of an IDX dataset under the data root: through torchvision where it
    imports and either the uncompressed files are there or ``download`` is set; else by
    parsing the files (the .gz ones too, which torchvision only reads after downloading).
    ``how_to_get`` replaces the layout's advice in the error for a missing file."""
    directory = Path(root) / layout.folder
    check_download(download, layout.dataset, directory, layout.how_to_get)
    stems = _stems(layout)
    tv = torchvision_datasets()
    if tv is None or not (download or all((directory / n).is_file() for pair in stems for n in pair)):
        return read_idx_files(directory, layout, how_to_get)
    splits = []
    for train, (images_stem, labels_stem) in zip((True, False), stems):
        ds = getattr(tv, layout.torchvision_class)(str(root), train=train, download=download,
                                                   **dict(layout.torchvision_kwargs))
        splits.append(raw_split(layout, ds.data.numpy(), ds.targets.numpy(), directory / images_stem,
                                directory / labels_stem))
    return pool_splits(*splits, sources=[directory / images_stem for images_stem, _ in stems])


MNIST = IdxLayout("mnist", "MNIST/raw", ("train", "t10k"), "MNIST", (), MNIST_HOW, MNIST_CLASSES)
FASHION_MNIST = IdxLayout("fashion-mnist", "FashionMNIST/raw", ("train", "t10k"), "FashionMNIST", (),
                          FASHION_MNIST_HOW, FASHION_MNIST_CLASSES)


def read_emnist(root: Path, *, split: str = "balanced", download: bool = False) -> RawData:
    """One EMNIST split (byclass 62 classes, bymerge 47, balanced 47, letters 26, digits 10,
    mnist 10), train then test, images as stored (transposed; see the module docstring).
    ``letters`` labels are shifted from 1..26 to 0..25.  Files in ``<root>/EMNIST/raw``."""
    if split not in EMNIST_CLASSES:
        raise ValueError(f"emnist: unknown split {split!r}; valid splits: {', '.join(EMNIST_CLASSES)}")
    layout = IdxLayout("emnist", "EMNIST/raw", (f"emnist-{split}-train", f"emnist-{split}-test"), "EMNIST",
                       (("split", split),), EMNIST_HOW, EMNIST_CLASSES[split], 1 if split == "letters" else 0)
    return read_idx_dataset(root, layout, download=download)

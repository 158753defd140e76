"""SVHN read back from tiny MATLAB files (X [32, 32, 3, N], y [N, 1] with 10 for zero), its
errors, and the torchvision path."""
import struct

import numpy as np
import pytest
import torch

from pfl_algorithms.data import load_dataset
from tests.algorithms.fake_files import assert_normalized, assert_same_dataset, write_svhn

scipy_io = pytest.importorskip("scipy.io")


@pytest.fixture(autouse=True)
def direct_reader(monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")


def _expected(written, names):
    pixels = np.concatenate([written[n][0].transpose(3, 2, 0, 1) for n in names])
    labels = np.concatenate([written[n][1].reshape(-1) for n in names]).astype(np.int64) % 10
    return pixels, torch.from_numpy(labels)


@pytest.mark.parametrize("extra", [False, True])
def test_svhn(tmp_path, extra):
    written = write_svhn(tmp_path, {"train": 12, "test": 10, "extra": 3}, np.random.default_rng(0))
    data = load_dataset("svhn", root=tmp_path, extra=extra)
    names = ("train", "extra", "test") if extra else ("train", "test")
    pixels, labels = _expected(written, names)
    assert data.num_classes == 10 and data.input_shape == (3, 32, 32) and data.class_names == tuple("0123456789")
    assert_normalized(data, pixels)
    assert torch.equal(data.labels, labels)
    train = 15 if extra else 12
    assert data.test_mask.tolist() == [False] * train + [True] * 10


def test_ten_means_zero_and_layout(tmp_path):
    written = write_svhn(tmp_path, {"train": 10, "test": 10}, np.random.default_rng(1))
    data = load_dataset("svhn", root=tmp_path)
    y = written["train"][1].reshape(-1)
    assert int(data.labels[int(np.flatnonzero(y == 10)[0])]) == 0
    assert sorted(data.labels[:10].tolist()) == list(range(10))
    # X[h, w, c, n] is pixel (c, h, w) of image n
    pixels = data.to_pixels(data.inputs)
    assert abs(float(pixels[4, 2, 7, 30]) - written["train"][0][7, 30, 2, 4] / 255) < 1e-5


def test_missing_and_corrupt(tmp_path):
    write_svhn(tmp_path, {"train": 3}, np.random.default_rng(2))
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("svhn", root=tmp_path)
    for part in ("'test_32x32.mat'", str(tmp_path), "http://ufldl.stanford.edu/housenumbers/", "PFL_DATA_ROOT"):
        assert part in str(error.value)
    write_svhn(tmp_path, {"test": 3}, np.random.default_rng(2))
    with pytest.raises(FileNotFoundError, match="'extra_32x32.mat'"):
        load_dataset("svhn", root=tmp_path, extra=True)
    path = tmp_path / "test_32x32.mat"
    path.write_bytes(b"not a mat file")
    with pytest.raises(ValueError, match=f"{path}: not a readable MATLAB file"):
        load_dataset("svhn", root=tmp_path)
    scipy_io.savemat(str(path), {"X": np.zeros((32, 32, 3, 2), np.uint8)})
    with pytest.raises(ValueError, match=r"no y in the file \(it has \['X'\]\)"):
        load_dataset("svhn", root=tmp_path)
    scipy_io.savemat(str(path), {"X": np.zeros((28, 28, 3, 2), np.uint8), "y": np.ones((2, 1))})
    with pytest.raises(ValueError, match=r"X must be \[32, 32, 3, N\] uint8, got uint8 \[28, 28, 3, 2\]"):
        load_dataset("svhn", root=tmp_path)
    scipy_io.savemat(str(path), {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.ones((3, 1))})
    with pytest.raises(ValueError, match="2 images in X but 3 labels in y"):
        load_dataset("svhn", root=tmp_path)
    scipy_io.savemat(str(path), {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.array([[1], [11]])})
    with pytest.raises(ValueError, match=r"test_32x32.mat: y must hold the labels 1..10 \(10 for the digit 0\), found "
                                         r"1..11"):
        load_dataset("svhn", root=tmp_path)


@pytest.mark.parametrize("y, message", [
    ([[0.0], [1.0]], r"y must hold the labels 1..10 \(10 for the digit 0\), found 0..1"),  # 0 was read as the digit 0
    ([[2.7], [1.0]], r"y must hold whole numbers \(the labels 1..10\), found 2.7"),  # 2.7 was read as 2
    ([[float("nan")], [1.0]], r"y must hold whole numbers \(the labels 1..10\), found nan"),
    ([[float("inf")], [1.0]], r"y must hold the labels 1..10 \(10 for the digit 0\), found 1..inf"),
    (np.array([[1], [11]], np.uint8), r"y must hold the labels 1..10 \(10 for the digit 0\), found 1..11"),
    (np.array(["1", "2"]), "y must hold numbers \\(the labels 1..10\\), got <U1"),  # a MATLAB char array
])
def test_labels_must_be_whole_numbers_1_to_10_as_stored(tmp_path, y, message):
    write_svhn(tmp_path, {"train": 3}, np.random.default_rng(6))
    path = tmp_path / "test_32x32.mat"
    scipy_io.savemat(str(path), {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.asarray(y)})
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("svhn", root=tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_download_needs_torchvision(tmp_path):
    with pytest.raises(ValueError, match="download=True needs torchvision"):
        load_dataset("svhn", root=tmp_path, download=True)


def test_torchvision_gives_the_same_tensors(tmp_path, monkeypatch):
    torchvision = pytest.importorskip("torchvision")
    write_svhn(tmp_path, {"train": 12, "test": 10, "extra": 3}, np.random.default_rng(3))
    direct = load_dataset("svhn", root=tmp_path, extra=True)
    monkeypatch.delenv("PFL_NO_TORCHVISION")
    monkeypatch.setattr(torchvision.datasets.SVHN, "_check_integrity", lambda self: True)  # tiny files, other MD5s
    through = load_dataset("svhn", root=tmp_path, extra=True)
    assert_same_dataset(direct, through)


# ---------------------------------------------------------------- headers read before the arrays

def _v5_matrix(order: str, name: bytes, array: np.ndarray) -> bytes:
    """One uncompressed uint8 miMATRIX element of a MATLAB v5 file in byte order ``order``
    (scipy writes only the machine's order; this writes either)."""
    def element(kind: int, payload: bytes) -> bytes:
        return struct.pack(order + "II", kind, len(payload)) + payload + b"\0" * (-len(payload) % 8)

    body = (element(6, struct.pack(order + "II", 9, 0))  # miUINT32 array flags: mxUINT8_CLASS
            + element(5, struct.pack(order + f"{array.ndim}i", *array.shape))  # miINT32 dims
            + element(1, name)  # miINT8 name
            + element(2, array.tobytes(order="F")))  # miUINT8 data, column-major
    return struct.pack(order + "II", 14, len(body)) + body


def _v5_file(order: str, variables: dict) -> bytes:
    text = b"MATLAB 5.0 MAT-file, written by the tests".ljust(116, b" ")
    header = text + b"\0" * 8 + struct.pack(order + "H", 0x0100) + (b"IM" if order == "<" else b"MI")
    return header + b"".join(_v5_matrix(order, name.encode(), array) for name, array in variables.items())


@pytest.mark.parametrize("order", ["<", ">"])
def test_declared_variables_of_a_file_in_either_byte_order(tmp_path, order):
    from pfl_algorithms.data.readers.matlab import declared_variables

    rng = np.random.default_rng(4)
    x, y = rng.integers(0, 256, (32, 32, 3, 3), dtype=np.uint8), np.array([[1], [10], [4]], np.uint8)
    path = tmp_path / "train_32x32.mat"
    path.write_bytes(_v5_file(order, {"X": x, "y": y}))
    assert declared_variables(path) == {"X": ("uint8", (32, 32, 3, 3)), "y": ("uint8", (3, 1))}
    mat = scipy_io.loadmat(str(path))  # scipy agrees on what the hand-written file holds
    assert np.array_equal(mat["X"], x) and np.array_equal(mat["y"], y)
    from pfl_algorithms.data.readers.svhn import read_mat

    images, labels = read_mat(path)
    assert np.array_equal(images, x) and labels.tolist() == [1, 10, 4]


@pytest.mark.parametrize("compressed", [False, True])
def test_declared_variables_agree_with_scipy(tmp_path, compressed):
    from pfl_algorithms.data.readers.matlab import declared_variables

    path = tmp_path / "many.mat"
    scipy_io.savemat(str(path), {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.ones((2, 1)), "e": np.array([]),
                                 "name_of_sixty_three_characters_" + "x" * 32: np.arange(3.0), "s": "text",
                                 "i": np.arange(6, dtype=np.int16).reshape(2, 3)}, do_compression=compressed)
    declared = declared_variables(path)
    assert [(name, shape) for name, (_, shape) in declared.items()] == [
        (name, tuple(shape)) for name, shape, _ in scipy_io.whosmat(str(path), chars_as_strings=False)]
    assert {name: kind for name, (kind, _) in declared.items()} == {
        "X": "uint8", "y": "float64", "e": "float64", "name_of_sixty_three_characters_" + "x" * 32: "float64",
        "s": "char", "i": "int16"}
    scipy_io.savemat(str(tmp_path / "v4.mat"), {"X": np.zeros((2, 3))}, format="4")
    assert declared_variables(tmp_path / "v4.mat") is None  # not v5: left to loadmat


@pytest.mark.parametrize("variables,message", [
    ({"X": np.zeros((32, 32, 5, 4000), np.uint8), "y": np.ones((4000, 1))},
     r"X must be \[32, 32, 3, N\] uint8, got uint8 \[32, 32, 5, 4000\]"),
    ({"X": np.zeros((32, 32, 3, 4000), np.uint8), "y": np.ones((3, 1))}, "4000 images in X but 3 labels in y"),
    ({"x": np.zeros((32, 32, 3, 4000), np.uint8)}, r"no X and y in the file \(it has \['x'\]\)"),
])
def test_a_misshapen_file_is_refused_from_its_headers_before_any_array_is_read(tmp_path, monkeypatch, variables,
                                                                               message):
    """A compressed file of a few kilobytes declaring megabytes (gigabytes in the hostile case):
    refused from the declared shapes, loadmat never called."""
    path = tmp_path / "test_32x32.mat"
    scipy_io.savemat(str(path), variables, do_compression=True)
    assert path.stat().st_size < 100_000

    def loadmat(*args, **kwargs):
        raise AssertionError("loadmat read the arrays of a file its headers refuse")

    monkeypatch.setattr(scipy_io, "loadmat", loadmat)
    from pfl_algorithms.data.readers.svhn import read_mat

    with pytest.raises(ValueError, match=message):
        read_mat(path)


def test_truncated_and_garbled_v5_files_name_the_file(tmp_path):
    from pfl_algorithms.data.readers.svhn import read_mat

    path = tmp_path / "train_32x32.mat"
    for compressed in (False, True):
        scipy_io.savemat(str(path), {"X": np.ones((32, 32, 3, 50), np.uint8), "y": np.ones((50, 1))},
                         do_compression=compressed)
        whole = path.read_bytes()
        path.write_bytes(whole[:len(whole) // 2])
        with pytest.raises(ValueError, match=f"{path}: truncated MATLAB file"):
            read_mat(path)
    garbled = bytearray(whole)
    garbled[136:150] = b"\xff" * 14  # the first variable's zlib stream (after its 8-byte tag)
    path.write_bytes(bytes(garbled))
    with pytest.raises(ValueError, match=f"{path}: the variable at byte 128 is not valid compressed data"):
        read_mat(path)

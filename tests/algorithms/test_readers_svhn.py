"""SVHN read back from tiny MATLAB files (X [32, 32, 3, N], y [N, 1] with 10 for zero), its
errors, and the torchvision path."""
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
    with pytest.raises(ValueError, match=r"test_32x32.mat: labels must lie in \[0, 10\), found 1..11"):
        load_dataset("svhn", root=tmp_path)


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

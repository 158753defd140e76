"""CIFAR-10 and CIFAR-100 read back from tiny pickle batches (Python 2 style, as the real
files are, and Python 3 with bytes keys), their errors, and the torchvision path."""
import pickle

import numpy as np
import pytest
import torch

from pfl_algorithms.data import load_dataset
from tests.algorithms.fake_files import assert_normalized, assert_same_dataset, py2_pickle, write_cifar


@pytest.fixture(autouse=True)
def direct_reader(monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")


def _pooled(written, key=1):
    batches = written["train"] + written["test"]
    pixels = np.concatenate([b[0] for b in batches]).reshape(-1, 3, 32, 32)
    return pixels, torch.tensor([v for b in batches for v in b[key]])


@pytest.mark.parametrize("py2", [True, False])
def test_cifar10(tmp_path, py2):
    written = write_cifar(tmp_path, "cifar10", (3, 4), np.random.default_rng(0), py2=py2)
    data = load_dataset("cifar10", root=tmp_path)
    pixels, labels = _pooled(written)
    assert data.name == "cifar10" and data.num_classes == 10 and data.input_shape == (3, 32, 32) and len(data) == 19
    assert_normalized(data, pixels)
    assert torch.equal(data.labels, labels)
    assert data.test_mask.tolist() == [False] * 15 + [True] * 4
    assert data.class_names == tuple(written["names"])
    assert data.coarse_labels is None and data.coarse_names is None


def test_cifar10_plane_order(tmp_path):
    # data rows are the R, G and B planes of 32x32 pixels, row-major.
    written = write_cifar(tmp_path, "cifar10", (1, 1), np.random.default_rng(1))
    data = load_dataset("cifar10", root=tmp_path)
    row = written["train"][0][0][0]
    pixels = data.to_pixels(data.inputs[0])
    assert abs(float(pixels[1, 2, 3]) - row[1024 + 2 * 32 + 3] / 255) < 1e-5
    assert abs(float(pixels[2, 31, 0]) - row[2048 + 31 * 32] / 255) < 1e-5


@pytest.mark.parametrize("py2", [True, False])
def test_cifar100(tmp_path, py2):
    written = write_cifar(tmp_path, "cifar100", (6, 4), np.random.default_rng(2), py2=py2)
    data = load_dataset("cifar100", root=tmp_path)
    pixels, labels = _pooled(written)
    assert data.num_classes == 100 and len(data) == 10
    assert_normalized(data, pixels)
    assert torch.equal(data.labels, labels)
    assert torch.equal(data.coarse_labels, _pooled(written, key=2)[1])
    assert data.class_names == tuple(written["fine_names"]) and data.coarse_names == tuple(written["coarse_names"])
    assert data.test_mask.tolist() == [False] * 6 + [True] * 4


def test_missing_file(tmp_path):
    write_cifar(tmp_path, "cifar10", (2, 2), np.random.default_rng(3))
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("cifar10", root=tmp_path)
    for part in ("'data_batch_4'", str(tmp_path / "cifar-10-batches-py"), "cifar-10-python.tar.gz", "PFL_DATA_ROOT"):
        assert part in str(error.value)
    with pytest.raises(FileNotFoundError, match=r"'train' not found in .*cifar-100-python.*cifar-100-python.tar.gz"):
        load_dataset("cifar100", root=tmp_path)


ZEROS = np.zeros((2, 3072), np.uint8)


@pytest.mark.parametrize("file, content, message", [
    ("data_batch_2", py2_pickle({"data": ZEROS}), r"no 'labels' in the pickle \(it has \['data'\]\)"),
    ("test_batch", py2_pickle({"data": ZEROS[:, :100], "labels": [0, 1]}), r"'data' must be an \[n, 3072\] uint8"),
    ("test_batch", py2_pickle({"data": ZEROS, "labels": [0]}), "2 images but 1 'labels'"),
    ("test_batch", py2_pickle({"data": ZEROS, "labels": [0, 10]}), r"labels must lie in \[0, 10\)"),
    ("batches.meta", py2_pickle({"num_vis": 3072}), "no 'label_names'"),
    ("data_batch_1", b"garbage", "not a CIFAR python pickle"),
    ("data_batch_1", pickle.dumps([1, 2]), "holds a list, not a dict"),
    ("data_batch_1", pickle.dumps({"data": torch.nn.Identity()}), "refusing to load the global"),
])
def test_corrupt_files(tmp_path, file, content, message):
    write_cifar(tmp_path, "cifar10", (2, 2), np.random.default_rng(4))
    (tmp_path / "cifar-10-batches-py" / file).write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("cifar10", root=tmp_path)
    assert str(tmp_path / "cifar-10-batches-py") in str(error.value)


def test_cifar100_bad_coarse_labels(tmp_path):
    write_cifar(tmp_path, "cifar100", (2, 2), np.random.default_rng(5))
    entry = {"data": np.zeros((2, 3072), np.uint8), "fine_labels": [0, 1], "coarse_labels": [0, 20]}
    (tmp_path / "cifar-100-python" / "test").write_bytes(py2_pickle(entry))
    with pytest.raises(ValueError, match=r"cifar-100-python/test: labels must lie in \[0, 20\)"):
        load_dataset("cifar100", root=tmp_path)


def test_download_needs_torchvision(tmp_path):
    with pytest.raises(ValueError, match="download=True needs torchvision and a network.*cifar-10-python.tar.gz"):
        load_dataset("cifar10", root=tmp_path, download=True)


def test_torchvision_gives_the_same_tensors(tmp_path, monkeypatch):
    torchvision = pytest.importorskip("torchvision")
    rng = np.random.default_rng(6)
    write_cifar(tmp_path, "cifar10", (3, 4), rng)
    write_cifar(tmp_path, "cifar100", (6, 4), rng)
    direct = [load_dataset(name, root=tmp_path) for name in ("cifar10", "cifar100")]
    monkeypatch.delenv("PFL_NO_TORCHVISION")
    # torchvision checks the real files' MD5 sums; these tiny files have others.
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    through = [load_dataset(name, root=tmp_path) for name in ("cifar10", "cifar100")]
    for a, b in zip(direct, through):
        assert_same_dataset(a, b)


def _numpy_scalar_batch(protocol: int, old_numpy_name: bool = False) -> tuple[bytes, list]:
    """A CIFAR-10 batch whose labels are numpy scalars (as a script that writes
    ``labels=list(np.int64 array)`` makes), pickled with ``protocol``; optionally naming numpy's
    modules as numpy 1.x did (``numpy.core``)."""
    labels = [np.int64(3), np.int64(7)]
    content = pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": labels,
                            b"batch_label": np.str_("numpy text")}, protocol=protocol)
    if old_numpy_name:
        assert protocol == 2  # GLOBAL opcodes are text lines, so the name can be swapped in place
        content = content.replace(b"numpy._core.", b"numpy.core.")
    return content, [int(v) for v in labels]


@pytest.mark.parametrize("protocol, old_numpy_name", [(2, False), (2, True), (4, False), (5, False)])
def test_labels_written_as_numpy_scalars_load(tmp_path, protocol, old_numpy_name):
    write_cifar(tmp_path, "cifar10", (2, 2), np.random.default_rng(7))
    content, labels = _numpy_scalar_batch(protocol, old_numpy_name)
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(content)
    data = load_dataset("cifar10", root=tmp_path)
    assert data.labels[-2:].tolist() == labels


class _RunsAShellCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("payload", ["os.system", "builtins.eval", "numpy.load"])
def test_a_malicious_pickle_is_refused_and_nothing_runs(tmp_path, payload):
    write_cifar(tmp_path, "cifar10", (2, 2), np.random.default_rng(8))
    marker = tmp_path / "pwned"
    gadget = {"os.system": _RunsAShellCommand(marker),
              "builtins.eval": _Reduce(eval, (f"open({str(marker)!r}, 'w')",)),
              "numpy.load": _Reduce(np.load, (str(marker),))}[payload]
    content = pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "labels": [np.int64(0), gadget]}, protocol=2)
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(content)
    with pytest.raises(ValueError, match="refusing to load the global"):
        load_dataset("cifar10", root=tmp_path)
    assert not marker.exists()


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _shared_references(width: int, depth: int):
    """A list of ``width`` references to one list of ``width`` references to ... (``depth``
    levels) of a 0: pickled in a few KB (the memo shares every level), width**depth as an array."""
    value = 0
    for _ in range(depth):
        value = [value] * width
    return value


@pytest.mark.parametrize("labels", ["as_long_as_data", "nested_labels"])
def test_a_pickle_of_shared_references_is_refused_without_expanding_it(tmp_path, labels):
    """342**3 = 40M labels (320 MB as int64) from an 8 KB pickle: refused fast, peak far below."""
    import time
    import tracemalloc

    write_cifar(tmp_path, "cifar10", (2, 2), np.random.default_rng(9))
    bomb = _shared_references(342, 3)
    value = bomb if labels == "as_long_as_data" else [bomb[0], bomb[1]]  # 342 rows, or 2 rows of lists
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(pickle.dumps({"data": ZEROS, "labels": value}, protocol=2))
    assert path.stat().st_size < 10_000
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError) as error:
            load_dataset("cifar10", root=tmp_path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 200 << 20, f"peak {peak / 2**20:.0f} MiB"
    assert time.perf_counter() - start < 5
    message = str(error.value)
    assert str(path) in message and "\n" not in message
    assert ("2 images but 342 'labels'" if labels == "as_long_as_data" else
            "'labels'[0] must be an integer, got list") in message


@pytest.mark.parametrize("value, message", [
    ({"a": 1}, "'labels' must be a list of integers, got dict"),
    (np.zeros(2, dtype=object), "'labels' must hold integers, got an array of object"),
    (np.zeros(3, dtype=np.int64), "2 images but 3 'labels'"),
    ([0, 2**70], "'labels' holds an integer beyond int64"),
    ([0, "1"], r"'labels'\[1\] must be an integer, got str"),
])
def test_label_columns_are_checked_before_conversion(tmp_path, value, message):
    write_cifar(tmp_path, "cifar10", (2, 2), np.random.default_rng(10))
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(pickle.dumps({"data": ZEROS, "labels": value}, protocol=2))
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("cifar10", root=tmp_path)
    assert str(path) in str(error.value)


def test_label_arrays_and_names_lists(tmp_path):
    written = write_cifar(tmp_path, "cifar10", (2, 2), np.random.default_rng(11))
    folder = tmp_path / "cifar-10-batches-py"
    (folder / "test_batch").write_bytes(pickle.dumps({"data": ZEROS, "labels": np.array([[3], [7]], np.uint8)}))
    assert load_dataset("cifar10", root=tmp_path).labels[-2:].tolist() == [3, 7]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": written["names"][:9] + [[0] * 3]}))
    with pytest.raises(ValueError, match=r"batches.meta: 'label_names'\[9\] must be a string, got list"):
        load_dataset("cifar10", root=tmp_path)


@pytest.mark.parametrize("variant, file, meta, message", [
    ("cifar10", "batches.meta", {"label_names": [str(i) for i in range(11)]},
     "batches.meta: 'label_names' must list 10 class names, got 11"),
    ("cifar10", "batches.meta", {"label_names": [str(i) for i in range(9)]},
     "batches.meta: 'label_names' must list 10 class names, got 9"),
    ("cifar100", "meta", {"fine_label_names": [str(i) for i in range(99)],
                          "coarse_label_names": [str(i) for i in range(20)]},
     "meta: 'fine_label_names' must list 100 class names, got 99"),
    ("cifar100", "meta", {"fine_label_names": [str(i) for i in range(100)],
                          "coarse_label_names": [str(i) for i in range(21)]},
     "meta: 'coarse_label_names' must list 20 class names, got 21"),
    ("cifar100", "meta", {"fine_label_names": [str(i) for i in range(100)],
                          "coarse_label_names": [str(i) for i in range(19)]},
     "meta: 'coarse_label_names' must list 20 class names, got 19"),
])
def test_the_meta_file_must_name_the_variants_classes(tmp_path, variant, file, meta, message):
    write_cifar(tmp_path, variant, (2, 2), np.random.default_rng(12))
    path = tmp_path / ("cifar-10-batches-py" if variant == "cifar10" else "cifar-100-python") / file
    path.write_bytes(py2_pickle(meta))
    with pytest.raises(ValueError, match=message) as error:
        load_dataset(variant, root=tmp_path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("labels, message", [
    (np.array([[1, 2], [3, 4]]), r"'labels' must be a 1-D array of integers \(or an \[n, 1\] column\), got shape "
                                 r"\(2, 2\)"),
    (np.array([[1, 2, 3, 4]]), r"'labels' must be a 1-D array .*got shape \(1, 4\)"),
    ([True, False, True, 1], r"'labels'\[0\] must be an integer, got bool"),
])
def test_label_columns_of_another_shape_or_booleans_are_refused(tmp_path, labels, message):
    write_cifar(tmp_path, "cifar10", (2, 2), np.random.default_rng(13))
    path = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    path.write_bytes(pickle.dumps({"data": np.zeros((4, 3072), np.uint8), "labels": labels}, protocol=2))
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("cifar10", root=tmp_path)
    assert str(path) in str(error.value)

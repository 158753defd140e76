"""MNIST and EMNIST read back from tiny IDX files (plain and .gz), their errors, and the
torchvision path against the direct reader."""
import gzip

import numpy as np
import pytest
import torch

from tests.algorithms.fake_files import assert_normalized, assert_same_dataset, write_idx, write_idx_pairs
from pfl_algorithms.data import load_dataset
from pfl_algorithms.data.readers import read_idx


@pytest.fixture(autouse=True)
def direct_reader(monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")


def _pooled(written, prefixes):
    images = np.concatenate([written[p][0] for p in prefixes])
    labels = np.concatenate([written[p][1] for p in prefixes]).astype(np.int64)
    return images[:, None], labels


@pytest.mark.parametrize("gz", [False, True])
def test_mnist(tmp_path, gz):
    rng = np.random.default_rng(0)
    written = write_idx_pairs(tmp_path / "MNIST" / "raw", ("train", "t10k"), (7, 5), 10, rng, gz=gz)
    data = load_dataset("mnist", root=tmp_path)
    images, labels = _pooled(written, ("train", "t10k"))
    assert data.name == "mnist" and data.num_classes == 10 and data.input_shape == (1, 28, 28)
    assert_normalized(data, images)
    assert torch.equal(data.labels, torch.from_numpy(labels))
    assert data.test_mask.tolist() == [False] * 7 + [True] * 5
    assert data.class_names[0] == "0 - zero" and len(data.class_names) == 10
    assert data.domains is None and data.writers is None and data.coarse_labels is None


def test_plain_file_wins_over_gz(tmp_path):
    rng = np.random.default_rng(1)
    raw = tmp_path / "MNIST" / "raw"
    written = write_idx_pairs(raw, ("train", "t10k"), (4, 3), 10, rng)
    write_idx_pairs(raw, ("train", "t10k"), (6, 2), 10, rng, gz=True)  # stale archives next to the files
    data = load_dataset("mnist", root=tmp_path)
    assert_normalized(data, _pooled(written, ("train", "t10k"))[0])


@pytest.mark.parametrize("split, classes", [("byclass", 62), ("bymerge", 47), ("balanced", 47), ("letters", 26),
                                            ("digits", 10), ("mnist", 10)])
def test_emnist_splits(tmp_path, split, classes):
    rng = np.random.default_rng(2)
    offset = 1 if split == "letters" else 0
    prefixes = (f"emnist-{split}-train", f"emnist-{split}-test")
    written = write_idx_pairs(tmp_path / "EMNIST" / "raw", prefixes, (6, 4), classes, rng, gz=split == "digits",
                              label_offset=offset)
    data = load_dataset("emnist", root=tmp_path, split=split)
    images, labels = _pooled(written, prefixes)
    assert data.num_classes == classes and len(data.class_names) == classes
    assert_normalized(data, images)
    # letters: the files' 1..26 become 0..25
    assert torch.equal(data.labels, torch.from_numpy(labels - offset))
    assert data.test_mask.tolist() == [False] * 6 + [True] * 4


def test_emnist_class_names():
    from pfl_algorithms.data.readers.idx import EMNIST_CLASSES

    assert EMNIST_CLASSES["byclass"][:11] == tuple("0123456789A") and EMNIST_CLASSES["byclass"][-1] == "z"
    assert EMNIST_CLASSES["balanced"][36:] == tuple("abdefghnqrt")
    assert EMNIST_CLASSES["letters"] == tuple("abcdefghijklmnopqrstuvwxyz")


def test_emnist_images_stay_as_stored(tmp_path):
    # A stroke along the first row of the file: it stays in row 0 (torchvision's .data is
    # the stored, transposed image; no transpose on the way in).
    images = np.zeros((2, 28, 28), dtype=np.uint8)
    images[:, 0, :] = 255
    images[1, 5, 3] = 7
    raw = tmp_path / "EMNIST" / "raw"
    for part in ("train", "test"):
        write_idx(raw / f"emnist-digits-{part}-images-idx3-ubyte", images)
        write_idx(raw / f"emnist-digits-{part}-labels-idx1-ubyte", np.array([3, 4], dtype=np.uint8))
    data = load_dataset("emnist", root=tmp_path, split="digits")
    pixels = data.to_pixels(data.inputs)
    torch.testing.assert_close(pixels[:, 0, 0, :], torch.ones(4, 28), atol=1e-5, rtol=0)
    torch.testing.assert_close(pixels[:, 0, 1:, 0], torch.zeros(4, 27), atol=1e-5, rtol=0)
    assert abs(float(pixels[1, 0, 5, 3]) - 7 / 255) < 1e-5 and abs(float(pixels[1, 0, 3, 5])) < 1e-5


def test_read_idx_types_and_gz(tmp_path):
    array = np.random.default_rng(3).integers(0, 256, size=(3, 4, 5), dtype=np.uint8)
    assert np.array_equal(read_idx(write_idx(tmp_path / "a", array)), array)
    assert np.array_equal(read_idx(write_idx(tmp_path / "b", array, gz=True)), array)
    values = np.array([1, -2, 300], dtype=">i4")
    path = tmp_path / "c"
    path.write_bytes(bytes([0, 0, 0x0C, 1]) + (3).to_bytes(4, "big") + values.tobytes())
    read = read_idx(path)
    assert read.tolist() == [1, -2, 300] and read.dtype == np.int32 and read.dtype.isnative


def _write_mnist_with(tmp_path, name, content: bytes):
    raw = tmp_path / "MNIST" / "raw"
    write_idx_pairs(raw, ("train", "t10k"), (3, 2), 10, np.random.default_rng(4))
    (raw / name).write_bytes(content)
    return raw / name


@pytest.mark.parametrize("content, message", [
    (b"\x01\x02\x08\x03" + bytes(12), "not an IDX file: magic number 01020803"),
    (b"", "magic number missing"),
    (bytes([0, 0, 8, 3]) + (3).to_bytes(4, "big"), "truncated IDX header"),
    (bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (3, 28, 28)) + bytes(100),
     r"dimensions \[3, 28, 28\] \(2368 bytes\) but the file holds 116 bytes"),
    (bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + bytes(3), "expected 3-dimensional uint8 data, got 1-dimensional"),
])
def test_corrupt_idx(tmp_path, content, message):
    path = _write_mnist_with(tmp_path, "train-images-idx3-ubyte", content)
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("mnist", root=tmp_path)
    assert str(path) in str(error.value)


def test_corrupt_gz_and_counts_and_labels(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    write_idx_pairs(raw, ("train", "t10k"), (3, 2), 10, np.random.default_rng(5))
    (raw / "t10k-labels-idx1-ubyte").unlink()
    (raw / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz: not a readable gzip file"):
        load_dataset("mnist", root=tmp_path)
    write_idx(raw / "t10k-labels-idx1-ubyte", np.array([1, 2, 3], dtype=np.uint8), gz=True)
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte: 2 images but 3 labels"):
        load_dataset("mnist", root=tmp_path)
    write_idx(raw / "t10k-labels-idx1-ubyte", np.array([1, 10], dtype=np.uint8), gz=True)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\), found 1..10"):
        load_dataset("mnist", root=tmp_path)
    assert gzip.decompress((raw / "t10k-labels-idx1-ubyte.gz").read_bytes())[:4] == bytes([0, 0, 8, 1])



@pytest.mark.parametrize("gz", [False, True])
def test_errors_name_the_file_at_fault(tmp_path, gz):
    raw = tmp_path / "MNIST" / "raw"
    write_idx_pairs(raw, ("train", "t10k"), (3, 2), 10, np.random.default_rng(6), gz=gz)
    ext = ".gz" if gz else ""
    write_idx(raw / "t10k-labels-idx1-ubyte", np.array([1, 12], dtype=np.uint8), gz=gz)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\), found 1..12") as error:
        load_dataset("mnist", root=tmp_path)
    assert str(error.value).startswith(f"{raw / 't10k-labels-idx1-ubyte'}{ext}: ")
    write_idx(raw / "t10k-labels-idx1-ubyte", np.array([1, 2, 3], dtype=np.uint8), gz=gz)
    with pytest.raises(ValueError, match="2 images but 3 labels in ") as error:
        load_dataset("mnist", root=tmp_path)
    assert str(raw / f"t10k-labels-idx1-ubyte{ext}") in str(error.value)
    write_idx(raw / "t10k-labels-idx1-ubyte", np.array([1, 2], dtype=np.uint8), gz=gz)
    write_idx(raw / "train-images-idx3-ubyte", np.zeros((3, 28, 27), np.uint8), gz=gz)
    with pytest.raises(ValueError, match="train and test images differ") as error:
        load_dataset("mnist", root=tmp_path)
    for name in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte"):
        assert f"{raw / name}{ext} holds " in str(error.value)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("mnist", root=tmp_path)
    message = str(error.value)
    for part in ("'train-images-idx3-ubyte'", "'train-images-idx3-ubyte.gz'", str(tmp_path / "MNIST" / "raw"),
                 "https://ossci-datasets.s3.amazonaws.com/mnist/", "download=True", "PFL_DATA_ROOT", "--data-root"):
        assert part in message
    with pytest.raises(FileNotFoundError, match=r"'emnist-letters-train-images-idx3-ubyte'.*gzip.zip"):
        load_dataset("emnist", root=tmp_path, split="letters")


def test_bad_options(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'words'; valid splits: byclass, bymerge"):
        load_dataset("emnist", root=tmp_path, split="words")
    with pytest.raises(ValueError, match=r"download=True needs torchvision and a network.*MNIST/raw"):
        load_dataset("mnist", root=tmp_path, download=True)


@pytest.mark.parametrize("gz", [False, True])
def test_torchvision_gives_the_same_tensors(tmp_path, monkeypatch, gz):
    pytest.importorskip("torchvision")
    rng = np.random.default_rng(6)
    write_idx_pairs(tmp_path / "MNIST" / "raw", ("train", "t10k"), (7, 5), 10, rng, gz=gz)
    write_idx_pairs(tmp_path / "EMNIST" / "raw", ("emnist-letters-train", "emnist-letters-test"), (6, 4), 26, rng,
                    gz=gz, label_offset=1)
    direct = [load_dataset("mnist", root=tmp_path), load_dataset("emnist", root=tmp_path, split="letters")]
    monkeypatch.delenv("PFL_NO_TORCHVISION")
    from pfl_algorithms.data.readers import torchvision_datasets

    assert torchvision_datasets() is not None
    through = [load_dataset("mnist", root=tmp_path), load_dataset("emnist", root=tmp_path, split="letters")]
    for a, b in zip(direct, through):
        assert_same_dataset(a, b)


# ---- hostile files: memory bombs and sizes that wrap ---------------------------------------

def _peak_bytes(function) -> tuple[int, Exception]:
    """(peak bytes Python and numpy allocated while ``function`` ran, what it raised)."""
    import tracemalloc

    tracemalloc.start()
    try:
        function()
    except Exception as error:  # noqa: BLE001  returned for the test to check
        raised = error
    else:
        raised = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, raised


def _gzip_bomb(path, header: bytes, zeros: int):
    """A .gz of ``header`` then ``zeros`` zero bytes, written a MiB at a time (about 1 KB per MB)."""
    import zlib

    deflate, chunk = zlib.compressobj(9, zlib.DEFLATED, 31), bytes(1 << 20)
    with open(path, "wb") as f:
        f.write(deflate.compress(header))
        for _ in range(zeros >> 20):
            f.write(deflate.compress(chunk))
        f.write(deflate.flush())
    return path


def test_a_gzip_bomb_is_refused_before_it_is_decompressed(tmp_path):
    """A 250 KB .gz whose header declares 2**31 28x28 images (and whose stream expands to
    256 MB) is refused from its header: peak memory stays far below the stream's size."""
    raw = tmp_path / "MNIST" / "raw"
    write_idx_pairs(raw, ("train", "t10k"), (3, 2), 10, np.random.default_rng(7), gz=True)
    path = raw / "train-images-idx3-ubyte.gz"
    header = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (2**31, 28, 28))
    _gzip_bomb(path, header, 256 << 20)
    assert path.stat().st_size < 300_000
    peak, error = _peak_bytes(lambda: load_dataset("mnist", root=tmp_path))
    assert peak < 200 << 20, f"peak {peak / 2**20:.0f} MiB"
    assert isinstance(error, ValueError) and "\n" not in str(error), error
    assert str(path) in str(error) and "cannot hold more than" in str(error)


def test_gzip_streams_of_the_wrong_length_are_refused(tmp_path):
    header = bytes([0, 0, 8, 1]) + (1000).to_bytes(4, "big")
    short = tmp_path / "short.gz"
    short.write_bytes(gzip.compress(header + bytes(999)))
    with pytest.raises(ValueError, match=r"short.gz: the header gives dimensions \[1000\] \(1008 bytes\) but the "
                                         r"file holds 1007 bytes \(truncated\)"):
        read_idx(short)
    long = tmp_path / "long.gz"
    long.write_bytes(gzip.compress(header + bytes(1001)))
    with pytest.raises(ValueError, match=r"long.gz: .* \(1008 bytes\) but the file holds more \(trailing bytes\)"):
        read_idx(long)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(gzip.compress(header + bytes(1000))[:-12])
    with pytest.raises(ValueError, match="cut.gz: not a readable gzip file"):
        read_idx(cut)
    exact = tmp_path / "exact.gz"
    exact.write_bytes(gzip.compress(header + bytes(range(250)) * 4))
    assert read_idx(exact).tolist() == list(range(250)) * 4


@pytest.mark.parametrize("gz", [False, True])
def test_dimensions_whose_product_wraps_int64_are_refused_naming_the_file(tmp_path, gz):
    """2**22 * 2**21 * 2**21 = 2**64 is 0 in int64: the header alone would pass a wrapped size check."""
    raw = tmp_path / "MNIST" / "raw"
    write_idx_pairs(raw, ("train", "t10k"), (3, 2), 10, np.random.default_rng(8))
    header = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (2**22, 2**21, 2**21))
    path = raw / "train-images-idx3-ubyte"
    if gz:
        path.unlink()
        path = raw / "train-images-idx3-ubyte.gz"
        path.write_bytes(gzip.compress(header))
    else:
        path.write_bytes(header)
    with pytest.raises(ValueError, match=r"dimensions \[4194304, 2097152, 2097152\] \(18446744073709551632 bytes\)") \
            as error:
        load_dataset("mnist", root=tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="18446744073709551632 bytes"):
        read_idx(path)


def test_big_endian_types_are_swapped_to_native(tmp_path):
    values = np.array([[1.5, -2.25], [1e300, -0.0]], dtype=">f8")
    path = tmp_path / "d"
    path.write_bytes(bytes([0, 0, 0x0E, 2]) + b"".join(n.to_bytes(4, "big") for n in (2, 2)) + values.tobytes())
    read = read_idx(path)
    assert read.dtype == np.float64 and read.dtype.isnative and read.tolist() == values.tolist()
    with pytest.raises(ValueError, match="d: expected 3-dimensional uint8 data, got 2-dimensional float64"):
        read_idx(path, ndim=3, dtype=np.dtype(np.uint8))

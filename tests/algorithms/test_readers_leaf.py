"""FEMNIST read back from tiny LEAF JSON files: writers, order, max_writers, errors."""
import json

import numpy as np
import pytest

from pfl_algorithms.data import load_dataset
from tests.algorithms.fake_files import assert_normalized, assert_same_dataset, write_leaf

# Two train files and one test file; writer f0003 appears in both train files, and file
# names sort differently from the writers.
FILES = {
    "train/b_part.json": {"f0003": 2, "f0001": 3},
    "train/a_part.json": {"f0003": 1, "f0002": 2},
    "test/all.json": {"f0002": 1, "f0001": 2, "f0003": 1},
}


def _expected(written, writers):
    pixels, labels, writer_ids, mask = [], [], [], []
    for is_test, split in enumerate(("train", "test")):
        for index, name in enumerate(writers):
            for x, y in written.get((split, name), []):
                pixels += x
                labels += y
                writer_ids += [index] * len(y)
                mask += [bool(is_test)] * len(y)
    return np.array(pixels).reshape(-1, 1, 28, 28), labels, writer_ids, mask


def test_femnist(tmp_path):
    written = write_leaf(tmp_path, FILES, np.random.default_rng(0))
    data = load_dataset("femnist", root=tmp_path)
    writers = ("f0001", "f0002", "f0003")
    pixels, labels, writer_ids, mask = _expected(written, writers)
    assert data.num_classes == 62 and data.input_shape == (1, 28, 28) and len(data) == 12
    assert data.writer_names == writers and data.writers.tolist() == writer_ids
    assert data.labels.tolist() == labels and data.test_mask.tolist() == mask
    assert_normalized(data, pixels)
    assert data.class_names[:11] == tuple("0123456789A") and data.class_names[36] == "a"
    # f0003's train samples: a_part.json's sample before b_part.json's two
    first = written[("train", "f0003")]
    assert [len(x) for x, _ in first] == [1, 2]


def test_upright_row_major(tmp_path):
    image = np.zeros(784)
    image[2 * 28 + 5] = 1.0  # row 2, column 5
    content = {"users": ["w"], "num_samples": [2],
               "user_data": {"w": {"x": [image.tolist(), [0.5] * 784], "y": [1, 2]}}}
    for split in ("train", "test"):
        folder = tmp_path / "femnist" / "data" / split
        folder.mkdir(parents=True)
        (folder / "x.json").write_text(json.dumps(content))
    data = load_dataset("femnist", root=tmp_path)
    pixels = data.to_pixels(data.inputs)
    assert abs(float(pixels[0, 0, 2, 5]) - 1) < 1e-5 and abs(float(pixels[0, 0, 5, 2])) < 1e-5


def test_max_writers(tmp_path):
    written = write_leaf(tmp_path, FILES, np.random.default_rng(1))
    data = load_dataset("femnist", root=tmp_path, max_writers=2)
    pixels, labels, writer_ids, mask = _expected(written, ("f0001", "f0002"))
    assert data.writer_names == ("f0001", "f0002") and data.writers.tolist() == writer_ids
    assert data.labels.tolist() == labels and data.test_mask.tolist() == mask
    assert_normalized(data, pixels)
    assert load_dataset("femnist", root=tmp_path, max_writers=10).writer_names == ("f0001", "f0002", "f0003")
    with pytest.raises(ValueError, match="max_writers must be None or an integer >= 1, got 0"):
        load_dataset("femnist", root=tmp_path, max_writers=0)


def test_missing(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("femnist", root=tmp_path)
    for part in ("'*.json'", str(tmp_path / "femnist" / "data" / "train"), "github.com/TalwalkarLab/leaf",
                 "PFL_DATA_ROOT"):
        assert part in str(error.value)
    write_leaf(tmp_path, {"train/a.json": {"w": 1}}, np.random.default_rng(2))
    with pytest.raises(FileNotFoundError, match="not found in .*femnist/data/test"):
        load_dataset("femnist", root=tmp_path)
    with pytest.raises(ValueError, match="download=True is not available, there is no downloader"):
        load_dataset("femnist", root=tmp_path, download=True)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a LEAF JSON file"),
    ({"users": ["w"]}, "needs the keys 'users' and 'user_data'"),
    ({"users": ["w"], "num_samples": [1, 2], "user_data": {}}, "1 users but 2 num_samples"),
    ({"users": ["w"], "user_data": {}}, "user 'w' has no x and y"),
    ({"users": ["w"], "user_data": {"w": {"x": [[0.5] * 783], "y": [1]}}}, r"rows of 784 values, got shape \[1, 783\]"),
    ({"users": ["w"], "user_data": {"w": {"x": [[0.5] * 784, [0.1]], "y": [1, 2]}}}, "x must be rows of 784 numbers"),
    ({"users": ["w"], "num_samples": [2], "user_data": {"w": {"x": [[0.5] * 784], "y": [1]}}}, "num_samples 2"),
    ({"users": ["w"], "user_data": {"w": {"x": [[2.0] * 784], "y": [1]}}}, r"values must lie in \[0, 1\]"),
    ({"users": ["w"], "user_data": {"w": {"x": [[0.5] * 784], "y": [62]}}}, r"labels must lie in \[0, 62\)"),
])
def test_corrupt(tmp_path, content, message):
    write_leaf(tmp_path, {"train/a.json": {"w": 1}, "test/a.json": {"w": 1}}, np.random.default_rng(3))
    path = tmp_path / "femnist" / "data" / "test" / "a.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("femnist", root=tmp_path)
    assert str(path) in str(error.value)


NAN_ROW = [0.5] * 783 + [float("nan")]


@pytest.mark.parametrize("content, message", [
    ({"users": ["w"], "user_data": {"w": {"x": [NAN_ROW], "y": [1]}}}, r"user 'w': x values must lie in \[0, 1\]"),
    ({"users": ["w"], "user_data": {"w": {"x": [[float("inf")] * 784], "y": [1]}}}, r"x values must lie in \[0, 1\]"),
    ({"users": 5, "user_data": {}}, "'users' must be a list of user names, got int"),
    ({"users": [7], "user_data": {"7": {"x": [], "y": []}}}, r"'users'\[0\] must be a string, got int"),
    ({"users": ["w"], "num_samples": 5, "user_data": {}}, "'num_samples' must be a list of counts, got int"),
    ({"users": ["w"], "user_data": ["w"]}, "'user_data' must be an object mapping users to their data, got list"),
    ({"users": ["w"], "user_data": {"w": [[0.5] * 784]}}, "user 'w': its user_data must be an object with the lists "
                                                          "x and y, got list"),
    ({"users": ["w"], "user_data": {"w": {"x": 5, "y": [1]}}}, "user 'w': x and y must be lists, got int and list"),
    ({"users": ["w"], "user_data": {"w": {"x": [[0.5] * 784], "y": 1}}}, "user 'w': x and y must be lists, got list "
                                                                        "and int"),
    ({"users": ["w"], "user_data": {"w": {"x": [[0.5] * 784], "y": [3.7]}}},
     r"user 'w': y\[0\] must be an integer label, got 3.7"),
    ({"users": ["w"], "user_data": {"w": {"x": [[0.5] * 784], "y": [True]}}},
     r"user 'w': y\[0\] must be an integer label, got True"),
])
def test_malformed_values_and_types_are_one_line_errors_naming_the_file(tmp_path, content, message):
    write_leaf(tmp_path, {"train/a.json": {"w": 1}, "test/a.json": {"w": 1}}, np.random.default_rng(3))
    path = tmp_path / "femnist" / "data" / "test" / "a.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("femnist", root=tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_same_tensors_whatever_the_listing_order(tmp_path, monkeypatch):
    write_leaf(tmp_path, FILES, np.random.default_rng(4))
    data = load_dataset("femnist", root=tmp_path)
    from pathlib import Path

    original = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: reversed(list(original(self, pattern))))
    again = load_dataset("femnist", root=tmp_path)
    assert_same_dataset(data, again)

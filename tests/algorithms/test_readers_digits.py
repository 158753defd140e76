"""The digits reader: scikit-learn's own file, read without importing scikit-learn, gives
exactly ``load_digits``'s arrays; where the file is elsewhere ``load_digits`` serves; without
scikit-learn the error names the package."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pfl_algorithms.data import load_dataset
from pfl_algorithms.data.readers import digits, read_digits

sklearn_datasets = pytest.importorskip("sklearn.datasets")


def _assert_load_digits_arrays(images, target):
    bunch = sklearn_datasets.load_digits()
    assert images.dtype == bunch.images.dtype and images.shape == (1797, 8, 8)
    assert np.array_equal(images, bunch.images) and np.array_equal(target, bunch.target)
    assert target.dtype.kind == bunch.target.dtype.kind == "i"


def test_the_file_read_directly_is_load_digits_without_importing_scikit_learn(monkeypatch):
    # an import of sklearn.datasets would fail now: the arrays come from the CSV alone
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert digits._sklearn_csv() is not None
    images, target = digits.digits_arrays()
    monkeypatch.undo()
    _assert_load_digits_arrays(images, target)


def test_another_layout_falls_back_to_load_digits(monkeypatch):
    monkeypatch.setattr(digits, "_CSV", Path("nowhere") / "digits.csv.gz")
    assert digits._sklearn_csv() is None
    _assert_load_digits_arrays(*digits.digits_arrays())


def test_raw_data_and_the_dataset_are_the_scaled_and_normalized_images():
    raw = read_digits()
    bunch = sklearn_datasets.load_digits()
    assert torch.equal(raw.pixels, torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0)
    assert raw.labels.dtype == torch.int64 and raw.num_classes == 10 and raw.test_mask is None
    data = load_dataset("digits")
    mean, std = raw.pixels.mean(), raw.pixels.std()
    torch.testing.assert_close(data.inputs, (raw.pixels - mean) / std, rtol=0, atol=1e-6)
    assert torch.equal(data.labels, raw.labels)


def test_without_scikit_learn_the_error_names_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else find_spec(name, *a))
    with pytest.raises(ImportError, match="dataset 'digits' needs scikit-learn: pip install scikit-learn"):
        load_dataset("digits")

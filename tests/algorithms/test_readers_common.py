"""What the readers share: the data-root rule, the torchvision switch, RawData and pooling,
and the chunked normalization."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pfl_algorithms.data import load_dataset
from pfl_algorithms.data.datasets import normalize_images
from pfl_algorithms.data.readers import RawData, data_root, torchvision_datasets
from pfl_algorithms.data.readers.common import pool_splits
from tests.algorithms.fake_files import assert_normalized, write_idx_pairs


def test_data_root_rule(tmp_path, monkeypatch):
    monkeypatch.delenv("PFL_DATA_ROOT", raising=False)
    assert data_root() == Path("data") and data_root("") == Path("data")
    monkeypatch.setenv("PFL_DATA_ROOT", "")
    assert data_root() == Path("data")
    monkeypatch.setenv("PFL_DATA_ROOT", str(tmp_path))
    assert data_root() == tmp_path and data_root("elsewhere") == Path("elsewhere")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert data_root("~/sets") == tmp_path / "sets"


def test_loaders_follow_the_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")
    write_idx_pairs(tmp_path / "env" / "MNIST" / "raw", ("train", "t10k"), (3, 2), 10, np.random.default_rng(0))
    write_idx_pairs(tmp_path / "data" / "MNIST" / "raw", ("train", "t10k"), (6, 1), 10, np.random.default_rng(1))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PFL_DATA_ROOT", str(tmp_path / "env"))
    assert len(load_dataset("mnist")) == 5  # $PFL_DATA_ROOT
    assert len(load_dataset("mnist", root=tmp_path / "data")) == 7  # root wins
    monkeypatch.delenv("PFL_DATA_ROOT")
    assert len(load_dataset("mnist")) == 7  # ./data
    with pytest.raises(FileNotFoundError, match=f"not found in {tmp_path / 'nowhere' / 'MNIST' / 'raw'}"):
        load_dataset("mnist", root=tmp_path / "nowhere")


def test_torchvision_switch(monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")
    assert torchvision_datasets() is None
    monkeypatch.setenv("PFL_NO_TORCHVISION", "0")
    try:
        import torchvision.datasets  # noqa: F401
        importable = True
    except Exception:  # noqa: BLE001  a CPU build of torch may fail the import with RuntimeError
        importable = False
    assert (torchvision_datasets() is not None) == importable


def _raw(n, test=False, **kwargs):
    return RawData(torch.full((n, 1, 2, 2), 7 if test else 3, dtype=torch.uint8), torch.arange(n) % 2, 2,
                   class_names=("a", "b"), **kwargs)


def test_pool_splits():
    pooled = pool_splits(_raw(3, writers=torch.zeros(3, dtype=torch.int64)),
                         _raw(2, True, writers=torch.ones(2, dtype=torch.int64)))
    assert pooled.test_mask.tolist() == [False] * 3 + [True] * 2 and pooled.writers.tolist() == [0, 0, 0, 1, 1]
    assert pooled.pixels[:, 0, 0, 0].tolist() == [3, 3, 3, 7, 7] and pooled.class_names == ("a", "b")
    with pytest.raises(ValueError, match="writers is given for only one"):
        pool_splits(_raw(3, writers=torch.zeros(3, dtype=torch.int64)), _raw(2))
    with pytest.raises(ValueError, match="train and test images differ"):
        pool_splits(_raw(3), RawData(torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), 2))
    with pytest.raises(ValueError, match=r"pixels must be \[N, C, H, W\] uint8 or float32"):
        RawData(torch.zeros(2, 2, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"domains must have shape \(2,\)"):
        RawData(torch.zeros(2, 1, 2, 2), torch.zeros(2, dtype=torch.int64), 2, domains=torch.zeros(3))



def test_pool_splits_names_both_sources_when_the_images_differ():
    test = RawData(torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"train and test images differ: a/train holds torch.uint8 \(1, 2, 2\), b/test "
                                         r"holds torch.uint8 \(3, 2, 2\)$"):
        pool_splits(_raw(3), test, sources=("a/train", "b/test"))
    with pytest.raises(ValueError, match=r"differ: the train split holds torch.uint8 \(1, 2, 2\), the test split "
                                         r"holds torch.uint8 \(3, 2, 2\)$"):
        pool_splits(_raw(3), test)

@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_normalize_images_over_chunks(dtype):
    gen = torch.Generator().manual_seed(0)
    n = 2 * 2048 + 5  # more than one chunk, a ragged last one
    pixels = torch.randint(0, 256, (n, 3, 3, 2), generator=gen, dtype=torch.uint8)
    if dtype == torch.float32:
        pixels = pixels.float() / 255
    before = pixels.clone()
    inputs, mean, std = normalize_images(pixels)
    expected = pixels.numpy() if dtype == torch.uint8 else pixels.double().numpy()
    assert_normalized(SimpleNamespace(inputs=inputs, mean=mean, std=std), expected)
    assert torch.equal(pixels, before) and inputs.data_ptr() != pixels.data_ptr()
    with pytest.raises(ValueError, match=r"images must be \[N, C, H, W\]"):
        normalize_images(torch.zeros(3, 4, 4))

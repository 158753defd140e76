"""The ``mixed`` dataset: parts read raw, brought to one shape, classes offset, one domain
per part, normalized once."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pfl_algorithms.data import load_dataset
from pfl_algorithms.data.readers import PACS
from tests.algorithms.fake_files import assert_normalized, write_cifar, write_idx_pairs, write_image_folder, write_svhn

pytest.importorskip("scipy.io")


@pytest.fixture(autouse=True)
def direct_reader(monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")


@pytest.fixture
def parts(tmp_path):
    rng = np.random.default_rng(0)
    mnist = write_idx_pairs(tmp_path / "MNIST" / "raw", ("train", "t10k"), (7, 5), 10, rng)
    svhn = write_svhn(tmp_path, {"train": 6, "test": 4}, rng)
    cifar = write_cifar(tmp_path, "cifar10", (2, 3), rng)
    unit = {
        "mnist": np.concatenate([mnist["train"][0], mnist["t10k"][0]])[:, None] / 255.0,
        "svhn": np.concatenate([svhn[n][0].transpose(3, 2, 0, 1) for n in ("train", "test")]) / 255.0,
        "cifar10": np.concatenate([b[0] for b in cifar["train"] + cifar["test"]]).reshape(-1, 3, 32, 32) / 255.0,
    }
    labels = {
        "mnist": np.concatenate([mnist["train"][1], mnist["t10k"][1]]).astype(np.int64),
        "svhn": np.concatenate([svhn[n][1].reshape(-1) for n in ("train", "test")]).astype(np.int64) % 10,
        "cifar10": np.array([v for b in cifar["train"] + cifar["test"] for v in b[1]]),
    }
    masks = {"mnist": [False] * 7 + [True] * 5, "svhn": [False] * 6 + [True] * 4, "cifar10": [False] * 10 + [True] * 3}
    return tmp_path, unit, labels, masks


def _shape(unit, size, channels):
    x = torch.from_numpy(unit)  # float64
    if channels == 1 and x.shape[1] == 3:
        x = (x * torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64).reshape(3, 1, 1)).sum(1, keepdim=True)
    if x.shape[-1] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x.expand(-1, channels, -1, -1).numpy()


@pytest.mark.parametrize("size, channels", [(32, 3), (16, 1)])
def test_mixed(parts, size, channels):
    root, unit, labels, masks = parts
    names = ("mnist", "svhn", "cifar10")
    data = load_dataset("mixed", root=root, image_size=size, channels=channels)
    assert data.name == "mixed" and data.input_shape == (channels, size, size) and data.num_classes == 30
    assert data.domain_names == names
    assert data.domains.tolist() == [0] * 12 + [1] * 10 + [2] * 13
    expected_labels = np.concatenate([labels["mnist"], labels["svhn"] + 10, labels["cifar10"] + 20])
    assert data.labels.tolist() == expected_labels.tolist()
    assert data.test_mask.tolist() == masks["mnist"] + masks["svhn"] + masks["cifar10"]
    assert data.class_names[0] == "mnist:0 - zero" and data.class_names[10] == "svhn:0"
    assert data.class_names[20] == "cifar10:airplane" and len(data.class_names) == 30
    assert_normalized(data, np.concatenate([_shape(unit[n], size, channels) for n in names]))


def test_order_string_option_and_parts_without_test(parts):
    root, unit, labels, masks = parts
    write_image_folder(root, "PACS", PACS.domains, ("dog", "horse"), 1, np.random.default_rng(1))
    data = load_dataset("mixed", root=root, datasets="pacs, mnist", image_size=20)
    assert data.domain_names == ("pacs", "mnist") and data.num_classes == 12
    assert data.domains.tolist() == [0] * 8 + [1] * 12
    assert data.labels[8:].tolist() == (labels["mnist"] + 2).tolist()
    assert data.test_mask.tolist() == [False] * 8 + masks["mnist"]
    assert data.class_names[:3] == ("pacs:dog", "pacs:horse", "mnist:0 - zero")


def test_errors(parts):
    root = parts[0]
    with pytest.raises(ValueError, match=r"datasets must be distinct names among \['cifar10', 'cifar100'"):
        load_dataset("mixed", root=root, datasets=["mnist", "imagenet"])
    with pytest.raises(ValueError, match="datasets must be distinct"):
        load_dataset("mixed", root=root, datasets=["mnist", "mnist"])
    with pytest.raises(ValueError, match="channels must be 1 or 3, got 2"):
        load_dataset("mixed", root=root, channels=2)
    with pytest.raises(FileNotFoundError, match="cifar-100-python"):
        load_dataset("mixed", root=root, datasets=["mnist", "cifar100"])

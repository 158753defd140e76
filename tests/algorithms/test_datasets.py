"""Built-in datasets: shapes, normalization, determinism, the registry and its errors.
The file-backed readers have their own tests (test_readers_*.py)."""
import pytest
import torch

from pfl_algorithms.data import DATASETS, ArrayDataset, load_dataset

BUILT_IN = {"digits", "gaussian-mixture", "synthetic-cifar"}
FILE_BACKED = {"mnist", "fashion-mnist", "emnist", "femnist", "cifar10", "cifar100", "svhn", "pacs", "vlcs", "office-caltech", "mixed"}


def test_registry_lists_every_name():
    assert set(DATASETS) == BUILT_IN | FILE_BACKED
    assert all(s.description and "\n" not in s.description for s in DATASETS.values())


def test_file_backed_options():
    assert {name: DATASETS[name].defaults for name in sorted(FILE_BACKED)} == {
        "cifar10": {"download": False},
        "cifar100": {"download": False},
        "emnist": {"split": "balanced", "download": False},
        "fashion-mnist": {"download": False},
        "femnist": {"max_writers": None, "download": False},
        "mixed": {"datasets": ("mnist", "svhn", "cifar10"), "image_size": 32, "channels": 3, "download": False},
        "mnist": {"download": False},
        "office-caltech": {"domains": None, "image_size": 64, "download": False},
        "pacs": {"domains": None, "image_size": 64, "download": False},
        "svhn": {"extra": False, "download": False},
        "vlcs": {"domains": None, "image_size": 64, "download": False},
    }


@pytest.mark.parametrize("name", sorted(FILE_BACKED))
def test_file_backed_names_say_which_file_is_missing(name, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"not found in {tmp_path}.*PFL_DATA_ROOT"):
        load_dataset(name, root=tmp_path)


def test_digits():
    pytest.importorskip("sklearn")
    data = load_dataset("digits")
    assert len(data) == 1797 and data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert data.inputs.dtype == torch.float32 and data.labels.dtype == torch.int64
    assert abs(float(data.inputs.mean())) < 1e-4 and abs(float(data.inputs.std()) - 1) < 1e-4
    assert torch.bincount(data.labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert data.domains is None


def test_gaussian_mixture():
    data = load_dataset("gaussian-mixture", seed=3)
    assert data.inputs.shape == (1000, 2) and data.input_shape == (2,) and data.num_classes == 4
    assert torch.bincount(data.labels).tolist() == [250] * 4
    # Class means sit on a circle of radius 2 at angles 0, 90, 180, 270 degrees.
    means = torch.stack([data.inputs[data.labels == k].mean(0) for k in range(4)])
    torch.testing.assert_close(means, torch.tensor([[2.0, 0], [0, 2], [-2, 0], [0, -2]]), atol=0.15, rtol=0)
    again = load_dataset("gaussian-mixture", seed=3)
    assert torch.equal(again.inputs, data.inputs) and torch.equal(again.labels, data.labels)
    assert not torch.equal(load_dataset("gaussian-mixture", seed=4).inputs, data.inputs)
    wide = load_dataset("gaussian-mixture", num_classes=6, dim=5, samples=61)
    assert wide.inputs.shape == (61, 5) and wide.num_classes == 6 and int(wide.labels.max()) == 5


def test_synthetic_cifar():
    data = load_dataset("synthetic-cifar", seed=1, samples=16)
    assert data.inputs.shape == (16, 3, 32, 32) and data.labels.shape == (16,) and data.num_classes == 10
    assert int(data.labels.min()) >= 0 and int(data.labels.max()) < 10
    again = load_dataset("synthetic-cifar", seed=1, samples=16)
    assert torch.equal(again.inputs, data.inputs) and torch.equal(again.labels, data.labels)
    assert not torch.equal(load_dataset("synthetic-cifar", seed=2, samples=16).inputs, data.inputs)


def test_loaders_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    load_dataset("gaussian-mixture", seed=5)
    load_dataset("synthetic-cifar", seed=5, samples=4)
    assert torch.equal(torch.get_rng_state(), state)


def test_array_dataset_to_and_checks():
    data = load_dataset("synthetic-cifar", samples=4)
    moved = data.to("cpu")
    assert moved.name == data.name and torch.equal(moved.inputs, data.inputs) and len(moved) == 4
    with pytest.raises(ValueError, match="labels"):
        ArrayDataset("x", torch.zeros(3, 2), torch.zeros(2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="domains"):
        ArrayDataset("x", torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), 2, torch.zeros(4, dtype=torch.int64))
    labels = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="coarse_labels has id 2 but coarse_names names only 2"):
        ArrayDataset("x", torch.zeros(3, 2), labels, 2, coarse_labels=torch.tensor([0, 1, 2]), coarse_names=("a", "b"))
    with pytest.raises(ValueError, match="class_names names 3 classes but num_classes is 2"):
        ArrayDataset("x", torch.zeros(3, 2), labels, 2, class_names=("a", "b", "c"))
    coarse = ArrayDataset("x", torch.zeros(3, 2), labels, 2, coarse_labels=torch.tensor([0, 1, 1]),
                          coarse_names=("a", "b"))
    assert coarse.select(torch.tensor([2])).coarse_labels.tolist() == [1] and coarse.coarse_names == ("a", "b")


def test_errors():
    with pytest.raises(ValueError, match="valid datasets"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match=r"valid options: \['dim', 'num_classes', 'radius', 'samples', 'std'\]"):
        load_dataset("gaussian-mixture", classes=3)
    with pytest.raises(ValueError, match="num_classes >= 2"):
        load_dataset("gaussian-mixture", num_classes=1)

"""The digits feature-shift multi-domain and fda scenarios, end to end through ``pfl run`` with
the core's baselines; and the clear errors of the data settings."""
from __future__ import annotations

import json

import pytest
import torch

from pfl_algorithms.cli import main
from pfl_algorithms.data import Partition, load_dataset

pytest.importorskip("sklearn")  # the digits ship inside scikit-learn

SMALL = ["--dataset", "digits", "--model", "digits-cnn", "--rounds", "2", "--batch-size", "16", "--quiet"]


@pytest.mark.parametrize("algorithm", ["local", "fedavg", "fedprox", "fedper", "fedavg-ft"])
def test_feature_shift_multi_domain_runs(algorithm, tmp_path):
    out = tmp_path / algorithm
    assert main(["run", algorithm, *SMALL, "--scenario", "multi-domain", "--clients", "5",
                 "--samples-per-client", "40", "--set", "domains=feature-shift", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and 0.0 <= summary["final_mean_accuracy"] <= 1.0
    partition = Partition.load(out / "partition.json")
    assert [c.domain for c in partition.clients] == [0, 1, 2, 3, 4]
    assert [t["shift"] for t in partition.transforms] == ["rotate-90", "invert", "blur-0.6", "noise-0.3"]
    config = json.loads((out / "config.json").read_text())
    assert config["scenario_options"] == {"domains": "feature-shift"}


@pytest.mark.parametrize("algorithm", ["local", "fedavg", "fedprox", "fedavg-ft"])
def test_fda_runs_and_reports_the_target(algorithm, tmp_path):
    out = tmp_path / algorithm
    assert main(["run", algorithm, *SMALL, "--scenario", "fda", "--clients", "5", "--set", "noise=0.3",
                 "--set", "target_fraction=0.5", "--set", "scenario.min_samples=5", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_client"] == 4
    final = summary["final_client_accuracy"]["4"]
    assert summary["target_final_accuracy"] == final and summary["target_best_accuracy"] >= final
    partition = Partition.load(out / "partition.json")
    assert partition.info["target_client"] == 4 and partition.transforms[0]["shift"] == "noise-0.3"


def test_compare_shows_the_fda_target(tmp_path, capsys):
    out = tmp_path / "fedavg"
    assert main(["run", "fedavg", *SMALL, "--scenario", "fda", "--clients", "4", "--set", "scenario.min_samples=5",
                 "--out", str(out)]) == 0
    best = json.loads((out / "summary.json").read_text())["target_best_accuracy"]
    capsys.readouterr()
    assert main(["compare", str(out)]) == 0
    table = capsys.readouterr().out
    assert "target best (%)" in table and f" {100 * best:.2f} " in table and "± 0.00" not in table  # one seed


def test_the_run_trains_on_the_shifted_inputs(tmp_path):
    """The federation sees the partition's transformed inputs, not the raw ones."""
    from pfl_algorithms.config import RunConfig, check
    from pfl_algorithms.runner import build

    config = check(RunConfig(algorithm="local", dataset="digits", scenario="multi-domain", clients=5,
                             scenario_options={"domains": "feature-shift"}, samples_per_client=20))
    fed, _, partition = build(config)
    digits = load_dataset("digits")
    assert torch.equal(fed.inputs, partition.apply_transforms(digits).inputs)
    assert not torch.equal(fed.inputs, digits.inputs)


@pytest.mark.parametrize("argv, message", [
    (["--scenario", "multi-domain"], "needs a dataset with domains"),
    (["--scenario", "multi-domain", "--set", "domains=feature-shift", "--set", "shifts=['warp']"], "unknown shift"),
    (["--scenario", "fda", "--set", "target_fraction=2"], "target_fraction"),
    (["--scenario", "natural"], "needs a dataset with writers"),
    (["--scenario", "iid", "--set", "architectures=['digits-cnn','resnet10']"], "unknown model 'resnet10'"),
    (["--scenario", "iid", "--set", "architectures=['digits-cnn','mlp']"], "same embedding size"),
    (["--dataset", "mnist", "--data-root", "/nonexistent-pfl-root"], "nonexistent-pfl-root"),
])
def test_clear_errors(argv, message, capsys, tmp_path):
    base = ["run", "local", "--dataset", "digits", "--clients", "5", "--rounds", "1", "--quiet",
            "--out", str(tmp_path / "r")]
    assert main([*base, *argv]) == 2
    assert message in capsys.readouterr().err


def test_augmentation_is_applied_and_reproducible(tmp_path):
    """--augment changes training, and two runs with it give the same numbers (the draws come
    from each client's seeded generator)."""
    args = ["run", "local", *SMALL, "--scenario", "iid", "--clients", "3", "--samples-per-client", "30"]
    for name, extra in (("a", ["--augment", "crop(padding=2),flip"]), ("b", ["--augment", "crop(padding=2),flip"]),
                        ("plain", [])):
        assert main([*args, *extra, "--out", str(tmp_path / name)]) == 0
    loss = lambda name: [json.loads(line)["train_loss"] for line in (tmp_path / name / "metrics.jsonl").open()]
    assert loss("a") == loss("b") and loss("a") != loss("plain")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["augment"] == "crop(padding=2),flip"


def test_bad_augmentation_is_a_clear_error(tmp_path, capsys):
    assert main(["run", "local", *SMALL, "--augment", "crop,spin", "--out", str(tmp_path / "r")]) == 2
    assert "spin" in capsys.readouterr().err


# ------------------------------------------------------------------ real formats, end to end

def test_femnist_natural_split_with_partial_participation(tmp_path):
    import numpy as np

    from tests.algorithms.fake_files import write_leaf

    rng = np.random.default_rng(0)
    users = {f"f{u:04d}_{u:02d}": 16 for u in range(6)}
    write_leaf(tmp_path / "data", {"train/part_0.json": users,
                                   "test/part_0.json": {u: 4 for u in users}}, rng)
    out = tmp_path / "run"
    assert main(["run", "fedavg", "--dataset", "femnist", "--data-root", str(tmp_path / "data"), "--scenario",
                 "natural", "--model", "fedgen-cnn", "--clients", "4", "--sample", "0.5", "--rounds", "3",
                 "--set", "min_samples=5", "--batch-size", "8", "--quiet", "--out", str(out)]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert all(len(m["clients"]) == 2 for m in metrics)  # half of the clients each round
    partition = Partition.load(out / "partition.json")
    assert len(partition.info["writers"]) == 4 and all(c.test.numel() == 4 for c in partition.clients)


def test_mixed_datasets_multi_domain(tmp_path):
    import numpy as np

    from tests.algorithms.fake_files import write_cifar, write_idx_pairs, write_svhn

    rng = np.random.default_rng(1)
    write_idx_pairs(tmp_path / "MNIST" / "raw", ("train", "t10k"), (20, 10), 10, rng)
    write_svhn(tmp_path, {"train": 20, "test": 10}, rng)
    write_cifar(tmp_path, "cifar10", (4, 10), rng)
    out = tmp_path / "run"
    assert main(["run", "fedavg", "--dataset", "mixed", "--data-root", str(tmp_path), "--scenario", "multi-domain",
                 "--model", "digits-cnn", "--clients", "3", "--rounds", "1", "--batch-size", "8", "--quiet",
                 "--out", str(out)]) == 0
    partition = Partition.load(out / "partition.json")
    assert partition.domain_names == ["mnist", "svhn", "cifar10"] and partition.output_classes == 10
    assert [c.domain for c in partition.clients] == [0, 1, 2]


def test_pacs_real_shift_fda(tmp_path):
    import numpy as np

    from tests.algorithms.fake_files import write_image_folder

    domains = ("art_painting", "cartoon", "photo", "sketch")
    write_image_folder(tmp_path, "PACS", domains, ("dog", "horse"), 4, np.random.default_rng(2))
    out = tmp_path / "run"
    assert main(["run", "local", "--dataset", "pacs", "--data-root", str(tmp_path), "--scenario", "fda",
                 "--set", "target_domain=sketch", "--set", "image_size=16", "--model", "digits-cnn",
                 "--clients", "4", "--rounds", "1", "--batch-size", "4", "--quiet", "--out", str(out)]) == 0
    partition = Partition.load(out / "partition.json")
    assert [c.domain for c in partition.clients] == [0, 1, 2, 3] and partition.info["target_client"] == 3
    assert (partition.clients[3].train.numel(), partition.clients[3].test.numel()) == (2, 6)

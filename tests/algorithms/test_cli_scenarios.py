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
    (["--scenario", "iid", "--set", "architectures=['digits-cnn','mlp(hidden=(64,))']"], "one architecture for all"),
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

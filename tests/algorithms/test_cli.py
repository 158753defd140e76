"""The ``pfl`` command and the runner: run directories, resume, compare, errors."""
from __future__ import annotations

import json

import pytest
import torch

from pfl_algorithms.cli import main
from pfl_algorithms.config import RunConfig, apply_sets, check
from pfl_algorithms.engine.checkpoint import read_checkpoint
from tests.algorithms.state_checks import assert_same
from pfl_algorithms.runner import run

TINY = ["--dataset", "gaussian-mixture", "--model", "mlp", "--scenario", "dirichlet", "--clients", "4",
        "--rounds", "4", "--batch-size", "16", "--lr", "0.1", "--set", "samples=240", "--set", "min_samples=5",
        "--quiet"]


def tiny_config(**overrides) -> RunConfig:
    config = RunConfig(algorithm="fedavg", dataset="gaussian-mixture", model="mlp", scenario="dirichlet",
                       clients=4, rounds=4, batch_size=16, lr=0.1)
    apply_sets(config, ["samples=240", "min_samples=5"])
    for k, v in overrides.items():
        setattr(config, k, v)
    return check(config)


def test_run_writes_the_run_directory(tmp_path, capsys):
    assert main(["run", "fedprox", *TINY, "--set", "mu=0.1", "--out", str(tmp_path / "r")]) == 0
    run_dir = tmp_path / "r"
    for name in ("config.json", "partition.json", "metrics.jsonl", "summary.json", "checkpoint.pt"):
        assert (run_dir / name).exists(), name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algorithm_settings"] == {"mu": 0.1} and config["dataset_options"] == {"samples": 240}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2, 3]
    assert all(m["bits_up"] > 0 and "eval" in m for m in lines)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["final_mean_accuracy"] <= 1.0
    assert summary["comm_gb"]["up"] == pytest.approx(sum(m["bits_up"] for m in lines) / 1e9)
    assert "final mean accuracy" in capsys.readouterr().out


def test_resume_reaches_the_same_final_state_bitwise(tmp_path):
    config = tiny_config(rounds=5, checkpoint_every=1, momentum=0.9, optimizer_state="keep")
    whole = run(config, tmp_path / "whole", progress=False)
    run(config, tmp_path / "killed", progress=False, stop_after=2)
    # A kill after a checkpoint may leave a metrics line of a round the checkpoint lacks.
    with (tmp_path / "killed" / "metrics.jsonl").open("a") as f:
        f.write('{"round": 2, "partial": tr')
    resumed = run(config, tmp_path / "killed", resume=True, progress=False)
    assert resumed["final_mean_accuracy"] == whole["final_mean_accuracy"]
    a = read_checkpoint(tmp_path / "whole" / "checkpoint.pt")
    b = read_checkpoint(tmp_path / "killed" / "checkpoint.pt")
    assert_same(a["federation"], b["federation"])  # every bank, the kept optimizer state, the ledger
    assert_same(a["algorithm"], b["algorithm"])
    rounds = [json.loads(line)["round"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3, 4]


def test_resume_with_more_rounds_continues_to_a_run_made_with_them_bitwise(tmp_path, capsys):
    """`pfl run --resume --rounds N`: a finished (or stopped) run goes on to N rounds and ends
    where a run started with N rounds ends; killed on the way, a plain --resume finishes it."""
    config = tiny_config(rounds=4, checkpoint_every=1, momentum=0.9, optimizer_state="keep")
    run(config, tmp_path / "whole", progress=False)
    out = tmp_path / "grown"
    run(tiny_config(rounds=2, checkpoint_every=1, momentum=0.9, optimizer_state="keep"), out, progress=False)
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    # Killed after one of the extra rounds: no summary (the run is not finished), config.json says 4.
    run(config, out, resume=True, progress=False, stop_after=1)
    assert not (out / "summary.json").exists() and json.loads((out / "config.json").read_text())["rounds"] == 4
    assert "2 rounds done, continuing to 4" in capsys.readouterr().err
    assert main(["run", "fedavg", "--out", str(out), "--resume", "--quiet"]) == 0  # the saved config: 4 rounds
    a, b = (read_checkpoint(tmp_path / name / "checkpoint.pt") for name in ("whole", "grown"))
    assert_same(a["federation"], b["federation"])
    assert_same(a["algorithm"], b["algorithm"])
    lines = lambda name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines("grown")] == [0, 1, 2, 3]
    assert [m["train_loss"] for m in lines("grown")] == [m["train_loss"] for m in lines("whole")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4
    assert summary["final_mean_accuracy"] == json.loads((tmp_path / "whole" / "summary.json").read_text())[
        "final_mean_accuracy"]
    # Fewer rounds than it has run would undo them: refused, the run as it was.
    assert main(["run", "fedavg", "--out", str(out), "--resume", "--rounds", "3", "--quiet"]) == 2
    assert "has run 4 rounds already; rounds must be at least 4, got 3" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text()) == summary


def test_a_campaign_continues_a_finished_run_to_more_rounds_and_refuses_fewer(tmp_path):
    """run_or_keep (pfl demo, pfl reproduce): the same settings keep the run, more rounds
    continue it, fewer rounds or another setting are refused."""
    from pfl_algorithms.runner import run_or_keep

    out = tmp_path / "r"
    assert run_or_keep(tiny_config(rounds=2), out, progress=False) is False
    assert run_or_keep(tiny_config(rounds=2), out, progress=False) is True
    assert run_or_keep(tiny_config(rounds=3), out, progress=False) is False
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"holds a finished run with other settings: rounds \(now 2, then 3\)"):
        run_or_keep(tiny_config(rounds=2), out, progress=False)
    with pytest.raises(ValueError, match=r"other settings: lr \(now 0.2, then 0.1\), rounds"):
        run_or_keep(tiny_config(rounds=4, lr=0.2), out, progress=False)


def test_existing_run_is_not_overwritten(tmp_path):
    config = tiny_config(rounds=1)
    run(config, tmp_path / "r", progress=False)
    with pytest.raises(ValueError, match="--resume"):
        run(config, tmp_path / "r", progress=False)


def test_compare_prints_mean_and_std_over_seeds(tmp_path, capsys):
    for seed in (0, 1):
        run(tiny_config(rounds=2, seed=seed), tmp_path / f"s{seed}", progress=False)
    assert main(["compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "±" in out and " 2 " in out


def test_list_names_everything(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("fedavg", "fedavg-ft", "permuted-iid", "digits", "synthetic-cifar", "resnet9", "fedgen-cnn"):
        assert name in out


@pytest.mark.parametrize("argv,message", [
    (["run", "fedsgd"], "unknown algorithm 'fedsgd'; valid: "),
    (["run", "fedavg", "--scenario", "nope"], "unknown scenario"),
    (["run", "fedavg", "--set", "tau=0.5"], "no setting of that name"),
    (["run", "fedavg", "--set", "scenario.beta=1"], "has no setting 'beta'"),
    (["run", "fedavg", "--clients", "4", "--set", "clients_per_round=8"], "only clients=4"),
    (["run", "fedper", "--set", "keep_head_local=false"], "conflicts"),
    (["run", "fedavg", "--local-steps", "3", "--local-epochs", "2"], "conflict"),
])
def test_bad_settings_are_clear_errors(argv, message, capsys):
    assert main(argv + ["--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_config_file_then_flags_then_sets(tmp_path):
    """Precedence: the TOML file < command-line flags < --set."""
    toml = tmp_path / "run.toml"
    toml.write_text('dataset = "gaussian-mixture"\nmodel = "mlp"\nscenario = "iid"\nclients = 3\nrounds = 1\n'
                    'lr = 0.3\n[dataset_options]\nsamples = 90\n[algorithm_settings]\nmu = 0.5\n')
    out = tmp_path / "r"
    assert main(["run", "fedprox", "--config", str(toml), "--lr", "0.2", "--set", "mu=0.25", "--quiet",
                 "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["clients"] == 3 and config["lr"] == 0.2 and config["algorithm_settings"] == {"mu": 0.25}
    assert config["dataset_options"] == {"samples": 90}


def test_the_default_lr_is_the_datasets_and_config_json_records_it():
    """No lr given: the dataset's default_lr, made explicit by check (so config.json, resumes and
    `pfl compare` see the number); an lr given wins.  At digits' 0.05 MNIST's clients, hundreds
    of steps a round, stayed at chance for good (data.datasets); the help says which is which."""
    from pfl_algorithms.cli import _default_text
    from pfl_algorithms.data import DATASETS

    assert RunConfig.lr is None
    for name, spec in DATASETS.items():
        assert RunConfig(dataset=name).client_lr() == spec.default_lr
    assert check(RunConfig(dataset="digits")).lr == 0.05 and DATASETS["mnist"].default_lr == 0.01
    assert check(RunConfig(dataset="digits", lr=0.2)).lr == 0.2
    assert check(RunConfig(dataset="digits")).optimizer_settings().lr == 0.05
    fast = sorted(name for name, spec in DATASETS.items() if spec.default_lr == 0.05)
    others = {spec.default_lr for spec in DATASETS.values()} - {0.05}
    assert others == {0.01}
    assert _default_text("lr") == f"the dataset's: 0.05 on {', '.join(fast[:-1])} and {fast[-1]}, else 0.01"


def test_config_files_read_with_tomli_where_python_has_no_tomllib(tmp_path, monkeypatch):
    """Python 3.10 (the oldest declared) has no tomllib: the backport tomli, a dependency there,
    reads the file (here the stdlib module stands in for it; on 3.10 every --config test reads
    with tomli itself)."""
    import sys

    tomllib = pytest.importorskip("tomllib")
    from pfl_algorithms.config import load_config_file

    toml = tmp_path / "run.toml"
    toml.write_text('rounds = 2\n[algorithm_settings]\nmu = 0.5\n')
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` fails as on 3.10
    monkeypatch.setitem(sys.modules, "tomli", tomllib)
    assert load_config_file(toml) == {"rounds": 2, "algorithm_settings": {"mu": 0.5}}


def test_pfl_flower_on_python_3_10_says_flower_needs_3_11(tmp_path, capsys, monkeypatch):
    """flwr >= 1.42 needs Python >= 3.11 (the extra installs nothing on 3.10): one line says so."""
    import sys

    monkeypatch.setattr(sys, "version_info", (3, 10, 13, "final", 0))
    assert main(["flower", "fedavg", "--out", str(tmp_path / "app")]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Flower needs Python >= 3.11" in err and "Python 3.10" in err
    assert not (tmp_path / "app").exists()


def test_unknown_config_key_is_reported(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text("roundz = 3\n")
    assert main(["run", "fedavg", "--config", str(toml), "--quiet"]) == 2
    assert "roundz" in capsys.readouterr().err


def test_a_diverged_client_is_logged_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """A client whose update is NaN is reported on stderr and in metrics.jsonl; others go on."""
    from pfl_algorithms.engine import rounds

    original = rounds.run_train_task

    def diverge_client_1(fed, algorithm, task):
        if task.client == 1 and task.round == 1:
            fed.inputs[fed.clients[1].train] = float("nan")
        return original(fed, algorithm, task)

    monkeypatch.setattr(rounds, "run_train_task", diverge_client_1)
    summary = run(tiny_config(rounds=3, workers=1), tmp_path / "r", progress=False)
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines[1]["skipped_non_finite"] == [1] and lines[0]["skipped_non_finite"] == []
    assert "client 1's update holds NaN or Inf" in capsys.readouterr().err
    assert summary["rounds"] == 3


@pytest.mark.parametrize("clients, sample, count", [(3, 0.5, 2), (5, 0.5, 3), (7, 0.5, 4), (9, 0.5, 5),
                                                    (10, 0.25, 3), (10, 0.1, 1), (9, 0.1, 1), (4, 0.1, 1)])
def test_a_sample_fraction_rounds_half_up_to_a_client_count(clients, sample, count):
    """As the splits round (scenarios.split_sizes); Python's round gave 2 of 5 and 4 of 9 at 0.5."""
    from types import SimpleNamespace

    from pfl_algorithms.engine.federation import EngineSettings, Federation

    fed = SimpleNamespace(settings=EngineSettings(sample=sample), num_clients=clients)
    fed.generator = lambda *args: Federation.generator(fed, *args)
    drawn = Federation.sample_clients(fed, 0)
    assert drawn.numel() == count and drawn.unique().numel() == count


@pytest.mark.parametrize("argv, message", [
    (["--sample", "0.5", "--clients-per-round", "2"], "sample and clients_per_round conflict: give one of them"),
    # values equal to the defaults are given all the same: they were accepted, recorded and ignored
    (["--sample", "1", "--clients-per-round", "2"], "sample and clients_per_round conflict: give one of them"),
    (["--local-epochs", "1", "--local-steps", "2"], "local_steps and local_epochs conflict: give one of them"),
    (["--executor", "sequential", "--workers", "2"], "workers=2 has no effect with executor='sequential'"),
    (["--executor", "threaded", "--chunk-clients", "2"], "chunk_clients=2 has no effect with executor='threaded'"),
    (["--executor", "sequential", "--set", "batched_conv=gemm"],
     "batched_conv=gemm has no effect with executor='sequential'"),
])
def test_options_that_would_be_recorded_and_ignored_are_refused(argv, message, capsys, tmp_path):
    from pfl_algorithms.cli import main

    assert main(["run", "fedavg", "--clients", "4", "--rounds", "1", *argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("how", ["flag", "set", "toml"])
def test_sample_1_means_every_client_on_every_path(tmp_path, how):
    """``sample`` is a fraction wherever it is given (1 and 1.0: every client); a count of
    clients is ``clients_per_round``."""
    from pfl_algorithms.cli import _parser, config_from_args

    toml = tmp_path / "run.toml"
    toml.write_text("sample = 1\n")
    extra = {"flag": ["--sample", "1"], "set": ["--set", "sample=1"], "toml": ["--config", str(toml)]}[how]
    config = config_from_args(_parser().parse_args(["run", "fedavg", "--clients", "5", *extra]))
    assert config.sample == 1.0 and isinstance(config.sample, float) and config.clients_per_round is None
    counted = config_from_args(_parser().parse_args(["run", "fedavg", "--clients", "5", "--clients-per-round", "1"]))
    assert counted.clients_per_round == 1 and counted.sample is None

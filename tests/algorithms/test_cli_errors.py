"""Every bad value given to ``pfl`` is one line ``pfl: error: ...`` naming the key and what
was expected, with exit status 2; none is accepted silently; ``pfl run --help`` shows every
flag with its RunConfig default and the algorithms."""
from __future__ import annotations

import dataclasses
import json
import sys
import math
import re

import pytest

from pfl_algorithms.algorithms import ALGORITHMS, make_algorithm
from pfl_algorithms.cli import FLAGS, main
from pfl_algorithms.config import OPTION_TABLES, RunConfig, option_hints
from pfl_algorithms.data import DATASETS, SCENARIOS
from pfl_algorithms.models import MODELS
from pfl_algorithms.option_types import check_value, field_hints


def one_line_error(capsys, argv) -> str:
    """The stderr of ``pfl argv`` after checking it failed with status 2 in one line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pfl: error: "), err
    return lines[0]


RUN = ["run", "fedavg", "--quiet", "--rounds", "1"]


@pytest.mark.parametrize("argv, expected", [
    (["--set", "lr=abc"], "lr must be a finite number > 0, or none, got 'abc'"),
    (["--set", "seed=abc"], "seed must be an integer in [0, 18446744073709551616), got 'abc'"),
    (["--set", "split=abc"], "scenario.split must be a list of 3 finite numbers in [0, 1], got 'abc'"),
    (["--scenario", "dirichlet", "--set", "alpha=nan"], "scenario.alpha must be a finite number > 0, got nan"),
    (["--scenario", "dirichlet", "--set", "alpha=inf"], "scenario.alpha must be a finite number > 0, got inf"),
    (["--set", "keep_head_local=maybe"], "keep_head_local must be true or false, or none, got 'maybe'"),
    (["--set", "seed=1.5"], "seed must be an integer in [0, 18446744073709551616), got 1.5"),
    (["--local-epochs", "0"], "local_epochs must be an integer >= 1, or none, got 0"),
    (["--lr", "nan"], "lr must be a finite number > 0, or none, got nan"),
    (["--sample", "1.5"], "sample must be a finite number in (0, 1], or none, got 1.5"),
    (["--sample", "5"], "sample must be a finite number in (0, 1], or none, got 5"),
    (["--clients-per-round", "0"], "clients_per_round must be an integer >= 1, or none, got 0"),
    (["--workers", "0"], "workers must be an integer >= 1, or none, got 0"),
    (["--finetune-epochs", "-1"], "finetune_epochs must be an integer >= 0, or none, got -1"),
    (["--optimizer", "sgdx"], "optimizer must be one of 'sgd', 'adam', 'adamw', got 'sgdx'"),
    (["--set", "momentum=-1"], "momentum must be a finite number >= 0, or none, got -1"),
    (["--set", "clients=true"], "clients must be an integer >= 1, got True"),
    (["--set", "split=[0.8, 0.1]"], "scenario.split must be a list of 3"),
    (["--set", "split=[0.8, 0.1, 0.2]"], "scenario.split must be 3 fractions >= 0 (train, val, test) summing to 1"),
    (["--set", "embedding_dim=0"], "model.embedding_dim must be an integer >= 1, got 0"),
    (["--dataset", "emnist", "--set", "dataset.split=nope"], "dataset.split must be one of 'byclass'"),
    (["--keep-head-local", "maybe"], "argument --keep-head-local: expected true or false, got 'maybe'"),
    (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    (["--samples-per-client", "1"], "--samples-per-client 1 is too small: scenario.split (0.8, 0.1, 0.1) leaves "
                                    "each client's validation and test split empty (no test samples: no accuracy to "
                                    "measure); the minimum is 3"),
    (["--scenario", "multi-domain", "--set", "domains=feature-shift", "--set", "min_samples=4"],
     "scenario 'multi-domain': min_samples has no effect without alpha"),
    (["--scenario", "fda", "--dataset", "pacs", "--set", "target_domain=photo", "--set", "alpha=0.1"],
     "scenario 'fda': alpha has no effect with target_domain='photo'"),
    (["--samples-per-client", "1", "--set", "split=[0.5, 0, 0.5]"],
     "--samples-per-client 1 is too small: scenario.split (0.5, 0.0, 0.5) leaves each client's train split empty; "
     "the minimum is 2"),
])
def test_bad_values_are_one_line_naming_the_key(argv, expected, capsys, tmp_path):
    line = one_line_error(capsys, [*RUN, *argv, "--out", str(tmp_path / "r")])
    assert expected in line
    assert not (tmp_path / "r").exists()  # refused before anything ran


@pytest.mark.parametrize("algorithm, setting, expected", [
    ("fedprox", "mu=abc", "algorithm.mu must be a finite number >= 0, got 'abc'"),
    ("fedprox", "mu=-1", "algorithm.mu must be a finite number >= 0, got -1"),
    ("fedprox", "mu=inf", "algorithm.mu must be a finite number >= 0, got inf"),
])
def test_bad_algorithm_settings(algorithm, setting, expected, capsys, tmp_path):
    assert expected in one_line_error(capsys, ["run", algorithm, "--set", setting, "--out", str(tmp_path / "r")])


def test_algorithm_settings_are_checked_from_python_too():
    with pytest.raises(ValueError, match=r"fedprox\.mu must be a finite number >= 0, got nan"):
        make_algorithm("fedprox", mu=float("nan"))


@pytest.mark.parametrize("toml, expected", [
    ("algorithm_settings = 5\n", "algorithm_settings must be a table (key = value), got 5"),
    ('lr = "fast"\n', "lr must be a finite number > 0, or none, got 'fast'"),
    ('scenario = ["iid"]\n', "scenario must be a string, got ['iid']"),
    ("rounds = 2.0\n", "rounds must be an integer >= 0, got 2.0"),
    ("lr = nan\n", "lr must be a finite number > 0, or none, got nan"),
    ('dataset = "synthetic-cifar"\n[dataset_options]\nsamples = -3\n',
     "dataset.samples must be an integer >= 1, got -3"),
    ("rounds = [\n", "is not valid TOML"),
])
def test_bad_config_files(toml, expected, capsys, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    line = one_line_error(capsys, ["run", "fedavg", "--config", str(path), "--out", str(tmp_path / "r")])
    assert expected in line
    if "TOML" in expected:
        assert str(path) in line


def test_a_config_json_that_is_not_json_names_the_file(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert str(path) in one_line_error(capsys, ["run", "fedavg", "--config", str(path)])


def _owners():
    """(table prefix, owner name, command-line arguments choosing it, option hints) of every
    algorithm, scenario, dataset and model."""
    for name in ALGORITHMS:
        yield "algorithm", name, ["run", name], option_hints("algorithm", name)
    for name in SCENARIOS:
        yield "scenario", name, ["run", "fedavg", "--scenario", name], option_hints("scenario", name)
    for name in DATASETS:
        yield "dataset", name, ["run", "fedavg", "--dataset", name], option_hints("dataset", name)
    for name in MODELS:
        yield "model", name, ["run", "fedavg", "--model", name], option_hints("model", name)


OPTIONS = [(table, owner, argv, key, hints[key]) for table, owner, argv, hints in _owners() for key in hints
           if key != "samples_per_client"]  # a RunConfig field (--samples-per-client), not a --set option


@pytest.mark.parametrize("table, owner, argv, key, hint", OPTIONS, ids=[f"{o[1]}.{o[3]}" for o in OPTIONS])
def test_every_option_is_declared_and_checked(table, owner, argv, key, hint, capsys, tmp_path):
    """Every option of every registry has a declared type that its default satisfies, and a
    value of the wrong kind (a table) or, for numbers, NaN is refused naming the key."""
    declared = {"algorithm": lambda: {f.name: f.default for f in dataclasses.fields(ALGORITHMS[owner].Settings)},
                "scenario": lambda: SCENARIOS[owner].defaults, "dataset": lambda: DATASETS[owner].defaults,
                "model": lambda: MODELS[owner].defaults}[table]()
    check_value(f"{table}.{key}", declared[key], hint)  # the default is valid
    out = ["--out", str(tmp_path / "r"), "--quiet"]
    line = one_line_error(capsys, [*argv, "--set", f"{table}.{key}={{'x': 1}}", *out])
    assert f"{table}.{key} must be " in line
    try:
        check_value(key, 0.5, hint)
    except ValueError:
        return  # not a float option
    assert f"{table}.{key} must be " in one_line_error(capsys, [*argv, "--set", f"{table}.{key}=nan", *out])


def test_every_run_config_field_is_checked():
    """Each RunConfig field refuses a value of the wrong kind and, where it takes floats, NaN."""
    for name, hint in field_hints(RunConfig).items():
        with pytest.raises(ValueError, match=f"^{name} must be "):
            check_value(name, {"x": 1} if name not in OPTION_TABLES else 5, hint)
        try:
            check_value(name, 0.5, hint)
        except ValueError:
            continue
        with pytest.raises(ValueError, match=f"^{name} must be .*got nan"):
            check_value(name, math.nan, hint)


def test_demo_needs_at_least_one_seed(capsys, tmp_path):
    assert "argument --seeds: expected an integer >= 1, got '0'" in one_line_error(
        capsys, ["demo", "--seeds", "0", "--out", str(tmp_path)])


def test_demo_refuses_a_data_root_that_is_not_a_directory(capsys, tmp_path):
    # Not taken to mean "no MNIST here": the demo would quietly fall back to digits.
    line = one_line_error(capsys, ["demo", "--data-root", str(tmp_path / "typo"), "--out", str(tmp_path / "d")])
    assert f"--data-root {tmp_path / 'typo'} is not a directory" in line
    assert not (tmp_path / "d").exists()


def test_compare_names_the_file_and_the_key(capsys, tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"final_mean_accuracy": 0.5}))
    line = one_line_error(capsys, ["compare", str(run_dir)])
    assert str(run_dir / "summary.json") in line and "'best_mean_accuracy'" in line
    (run_dir / "summary.json").write_text("{truncated")
    assert str(run_dir / "summary.json") in one_line_error(capsys, ["compare", str(run_dir)])


def test_run_help_shows_every_flag_with_its_default_and_the_algorithms(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping within a flag's help
    assert main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    lines = {}  # flag -> its entry (argparse may put the help on the line below the flag)
    for line in text.splitlines():
        if line.strip().startswith("--"):
            flag = line.split()[0]
            lines[flag] = line
        elif line.startswith("      ") and lines:
            lines[flag] += " " + line.strip()
    for field in dataclasses.fields(RunConfig):
        if field.name == "algorithm" or field.name in OPTION_TABLES:
            continue
        flag = "--" + field.name.replace("_", "-")
        assert field.name in FLAGS and flag in lines, field.name
        assert "(default: " in lines[flag] and "(default: None)" not in lines[flag], lines[flag]
        if field.default is not None:
            assert f"(default: {field.default})" in lines[flag]
    for flag in ("--config", "--out", "--resume", "--set", "--quiet"):
        assert "(default: " in lines[flag]
    for name, cls in ALGORITHMS.items():
        assert name in text and cls.description in text


class _ClosedPipe:
    """A stdout whose reader has gone (`pfl list | head` once head exits)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_a_closed_pipe_stops_quietly(monkeypatch, capsys):
    # `pfl list | head -3` printed a BrokenPipeError traceback.
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["list"]) == 141  # 128 + SIGPIPE, as a shell reports a tool the signal ended
    # Python 3.11's argparse drops a help text it cannot write (0); 3.10's raises the
    # BrokenPipeError, which stops quietly as above.
    assert main(["run", "--help"]) == (0 if sys.version_info >= (3, 11) else 141)
    assert capsys.readouterr().err == ""


def test_a_folder_that_cannot_be_written_is_one_line(capsys, tmp_path, monkeypatch):
    """A read-only or forbidden --out gave a traceback in pfl demo, reproduce and flower."""
    import pathlib

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    for argv in (["demo", "--algorithms", "fedavg", "--dataset", "digits", "--out", str(tmp_path / "d")],
                 ["reproduce", "simfed", "--quick", "--out", str(tmp_path / "r")]):
        assert f"{tmp_path}/{argv[-1][-1]}: Permission denied" in one_line_error(capsys, argv)


def test_ctrl_c_stops_with_one_line(capsys, monkeypatch):
    import pfl_algorithms.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_list", interrupted)
    assert main(["list"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pfl: interrupted; `pfl run` continues a run")


def test_demo_refuses_an_algorithm_named_twice(capsys, tmp_path):
    line = one_line_error(capsys, ["demo", "--algorithms", "fedavg,local,fedavg", "--out", str(tmp_path / "d")])
    assert "algorithm(s) named more than once: fedavg" in line


def test_demo_refuses_a_pfl_data_root_that_is_not_a_directory(capsys, tmp_path, monkeypatch):
    # $PFL_DATA_ROOT mistyped: the demo quietly fell back from MNIST to digits.
    monkeypatch.setenv("PFL_DATA_ROOT", str(tmp_path / "typo"))
    line = one_line_error(capsys, ["demo", "--out", str(tmp_path / "d")])
    assert f"$PFL_DATA_ROOT {tmp_path / 'typo'} is not a directory" in line


@pytest.mark.parametrize("argv, message", [
    (["--seed", str(2**64)], r"seed must be an integer in \[0, 18446744073709551616\), got 18446744073709551616"),
    (["--clients", "100000000"], "clients=100000000 but digits has 1797 samples: some client would get no samples"),
])
def test_sizes_beyond_what_can_run_are_refused_at_once(argv, message, capsys, tmp_path):
    """A seed past 2^64 failed in torch ("Overflow when unpacking long long"); 10^8 clients hung
    while their sample lists were built."""
    line = one_line_error(capsys, ["run", "fedavg", "--dataset", "digits", "--rounds", "1", *argv,
                                   "--out", str(tmp_path / "r")])
    assert re.search(message, line), line


def test_resume_without_out_takes_the_saved_settings(capsys, tmp_path, monkeypatch):
    """--resume without --out resumes the default run directory with its saved config.json (the
    message said so; before, the flags' defaults were compared with it and refused)."""
    monkeypatch.chdir(tmp_path)
    small = ["--dataset", "digits", "--clients", "3", "--local-steps", "1", "--quiet"]
    assert main(["run", "fedavg", "--rounds", "1", *small]) == 0
    assert main(["run", "fedavg", "--resume", "--rounds", "2", "--quiet"]) == 0, capsys.readouterr().err
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["rounds"] == 2
    assert json.loads((run / "config.json").read_text())["clients"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--set", "algorithm=fedprox"], "--set algorithm=fedprox contradicts the algorithm 'fedavg'"),  # ran fedprox
    (["--optimizer", "adam", "--momentum", "0.5"], "momentum is SGD's; optimizer 'adam' does not take it"),  # ignored
    # a value equal to SGD's default is given all the same: it was accepted, recorded and ignored
    (["--optimizer", "adam", "--momentum", "0.9"], "momentum is SGD's; optimizer 'adam' does not take it"),
    (["--optimizer", "adamw", "--set", "momentum=0.9"], "momentum is SGD's; optimizer 'adamw' does not take it"),
    (["--data-root", "/nonexistent-pfl-root"], "data_root /nonexistent-pfl-root is not a directory"),  # digits ran
])
def test_settings_that_would_be_ignored_are_refused(argv, message, capsys, tmp_path):
    line = one_line_error(capsys, ["run", "fedavg", "--dataset", "digits", "--rounds", "1", *argv,
                                   "--out", str(tmp_path / "r")])
    assert message in line
    assert not (tmp_path / "r").exists()


def test_a_config_file_naming_another_algorithm_is_refused(capsys, tmp_path):
    """The positional algorithm silently replaced the file's."""
    toml = tmp_path / "run.toml"
    toml.write_text('algorithm = "fedprox"\nrounds = 1\n')
    line = one_line_error(capsys, ["run", "fedavg", "--config", str(toml), "--out", str(tmp_path / "r")])
    assert f"--config {toml} names the algorithm 'fedprox', the command 'fedavg'" in line

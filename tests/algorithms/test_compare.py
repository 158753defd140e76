"""``pfl compare`` pools only runs of the same experiment (the whole resolved config but the
seed), names what tells rows apart, and never counts a run twice."""
from __future__ import annotations

import json
import re

import pytest

from pfl_algorithms.cli import main
from pfl_algorithms.compare import DuplicateSeedWarning, comparison_rows, find_summaries
from pfl_algorithms.config import RunConfig, check


def write_run(path, accuracy=0.5, **fields):
    """A finished run's summary.json (as ``runner.summarize`` writes it) for ``RunConfig(**fields)``."""
    config = check(RunConfig(**fields))
    path.mkdir(parents=True)
    summary = {"algorithm": config.algorithm, "scenario": config.scenario, "dataset": config.dataset,
               "model": config.model, "seed": config.seed, "clients": config.clients, "rounds": config.rounds,
               "final_mean_accuracy": accuracy, "best_mean_accuracy": accuracy, "final_client_accuracy": {},
               "comm_gb": {"up": 0.5, "down": 0.25}, "wall_s_this_run": 1.0, "train_wall_s_total": 2.0,
               "config": config.as_dict()}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def rows_of(*paths):
    return comparison_rows(find_summaries([str(p) for p in paths]))


def test_unrelated_seed_0_runs_are_not_pooled(tmp_path, capsys):
    write_run(tmp_path / "a", 0.4, clients=4, rounds=5, lr=0.1)
    write_run(tmp_path / "b", 0.8, clients=8, rounds=3, lr=0.2)
    rows = rows_of(tmp_path)
    assert [r["seeds"] for r in rows] == [[0], [0]]
    assert [r["settings"] for r in rows] == [{"clients": 4, "lr": 0.1, "rounds": 5},
                                            {"clients": 8, "lr": 0.2, "rounds": 3}]
    assert main(["compare", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "settings" in table[0]
    # One seed: the mean alone, no "± 0.00" (issue 32 item 7).
    assert "clients=4, lr=0.1, rounds=5" in table[2] and " 40.00 " in table[2]
    assert "clients=8, lr=0.2, rounds=3" in table[3] and " 80.00 " in table[3]
    assert not any("±" in line for line in table)
    assert rows[0]["final_accuracy"] == (40.0, None)


def test_options_and_algorithm_settings_tell_rows_apart(tmp_path):
    write_run(tmp_path / "a", algorithm="fedprox", scenario="dirichlet", algorithm_settings={"mu": 0.1})
    write_run(tmp_path / "b", algorithm="fedprox", scenario="dirichlet", scenario_options={"alpha": 0.1})
    rows = rows_of(tmp_path)
    assert [r["settings"] for r in rows] == [{"algorithm.mu": 0.01, "scenario.alpha": 0.1},
                                            {"algorithm.mu": 0.1, "scenario.alpha": 0.5}]


def test_seeds_of_one_experiment_are_pooled(tmp_path):
    for seed, accuracy in ((0, 0.4), (1, 0.6), (2, 0.8)):
        # workers, data_root and checkpoint_every cannot change the numbers; an option set to
        # its default is the same experiment as one left at it.  (A data root must exist.)
        (tmp_path / f"data{seed}").mkdir()
        write_run(tmp_path / "runs" / f"s{seed}", accuracy, seed=seed, workers=seed + 1, checkpoint_every=seed + 1,
                  data_root=str(tmp_path / f"data{seed}"), algorithm="fedprox",
                  algorithm_settings={"mu": 0.01} if seed else {})
    [row] = rows_of(tmp_path / "runs")
    assert row["seeds"] == [0, 1, 2] and row["settings"] == {}
    assert row["final_accuracy"] == pytest.approx((60.0, 20.0))


def test_one_run_is_counted_once(tmp_path):
    run = write_run(tmp_path / "runs" / "a", 0.4)
    write_run(tmp_path / "runs" / "b", 0.6, seed=1)
    [row] = rows_of(run, run, run, tmp_path / "runs", tmp_path / "runs" / ".." / "runs" / "a")
    assert row["seeds"] == [0, 1]
    assert row["final_accuracy"] == pytest.approx((50.0, 2 ** 0.5 * 10))


def test_a_copied_run_is_counted_once_with_a_warning(tmp_path):
    write_run(tmp_path / "a", 0.4)
    write_run(tmp_path / "copy-of-a", 0.4)
    with pytest.warns(DuplicateSeedWarning, match="copy-of-a repeats the run"):
        [row] = rows_of(tmp_path)
    assert row["seeds"] == [0]


def test_compare_of_real_runs(tmp_path, capsys):
    """End to end: two tiny runs that differ in lr and rounds are two rows."""
    base = ["run", "fedavg", "--dataset", "gaussian-mixture", "--model", "mlp", "--scenario", "iid", "--clients", "2",
            "--set", "samples=60", "--quiet"]
    assert main([*base, "--lr", "0.1", "--rounds", "1", "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--lr", "0.2", "--rounds", "2", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path), str(tmp_path / "a")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 4 and "lr=0.1, rounds=1" in table[2] and "lr=0.2, rounds=2" in table[3]


def test_runs_are_found_at_any_depth_but_not_inside_a_run(tmp_path):
    """``pfl compare runs`` finds runs/demo/*: a folder with a summary.json is a run at any depth,
    and a run's own subfolders (here a stray summary.json under plots/) are not searched."""
    write_run(tmp_path / "runs" / "a", 0.4)
    write_run(tmp_path / "runs" / "demo" / "b", 0.6, seed=1)
    write_run(tmp_path / "runs" / "demo" / "deeper" / "c", 0.8, seed=2)
    write_run(tmp_path / "runs" / "a" / "plots" / "not-a-run", 0.0, seed=3)
    (tmp_path / "runs" / "unfinished" / "plots").mkdir(parents=True)
    summaries = find_summaries([str(tmp_path / "runs"), str(tmp_path / "runs" / "demo" / "b")])
    assert [s["_path"] for s in summaries] == [str(tmp_path / "runs" / p) for p in ("a", "demo/b", "demo/deeper/c")]
    [row] = comparison_rows(summaries)
    assert row["seeds"] == [0, 1, 2]


def test_a_folder_without_runs_is_an_error_naming_it(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ValueError, match="empty holds no finished run"):
        find_summaries([str(tmp_path / "empty")])


def test_a_run_without_a_final_accuracy_is_counted_not_scored(tmp_path, capsys):
    """A diverged run (final accuracy null) is left out of the mean, and the table says of how
    many runs the mean is; all diverged: n/a."""
    write_run(tmp_path / "a" / "s0", 0.4)
    write_run(tmp_path / "a" / "s1", None, seed=1)
    write_run(tmp_path / "b" / "s0", None, lr=0.5)
    assert main(["compare", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert " 40.00 (1/2 runs) " in table[2] and " n/a (0/1 runs) " in table[3]


def test_a_truncated_summary_is_named(tmp_path):
    write_run(tmp_path / "a", 0.4)
    text = (tmp_path / "a" / "summary.json").read_text()
    (tmp_path / "a" / "summary.json").write_text(text[:40])
    with pytest.raises(ValueError, match=f"{tmp_path / 'a' / 'summary.json'}: not a readable summary.json"):
        find_summaries([str(tmp_path)])


def edit_summary(run, dotted, value):
    """Set the key ``dotted`` (``"config.seed"``) of the run's summary.json to ``value``."""
    summary = json.loads((run / "summary.json").read_text())
    *outer, last = dotted.split(".")
    table = summary
    for part in outer:
        table = table[part]
    table[last] = value
    (run / "summary.json").write_text(json.dumps(summary))


def test_a_setting_at_its_default_is_the_same_experiment(tmp_path):
    """A None that stands for a default equals that default set explicitly: finetune_epochs
    (the algorithm's own), augment ("none" and "" are no augmentation; a step's options at
    their defaults are the step)."""
    write_run(tmp_path / "ft" / "s0", 0.4)
    write_run(tmp_path / "ft" / "s1", 0.6, seed=1, finetune_epochs=0)
    write_run(tmp_path / "aug" / "s0", 0.4, augment="none", scenario="iid")
    write_run(tmp_path / "aug" / "s1", 0.6, seed=1, augment="", scenario="iid")
    write_run(tmp_path / "aug" / "s2", 0.8, seed=2, scenario="iid")
    write_run(tmp_path / "crop" / "s0", 0.4, augment="crop,flip", scenario="dirichlet")
    write_run(tmp_path / "crop" / "s1", 0.6, seed=1, augment="crop(padding=4), flip(p=0.5)", scenario="dirichlet")
    write_run(tmp_path / "fedavg-ft" / "s0", 0.4, algorithm="fedavg-ft", scenario="iid", keep_head_local=True)
    write_run(tmp_path / "fedavg-ft" / "s1", 0.6, seed=1, algorithm="fedavg-ft", scenario="iid",
              keep_head_local=True, finetune_epochs=1)
    for folder, seeds in (("ft", [0, 1]), ("aug", [0, 1, 2]), ("crop", [0, 1]), ("fedavg-ft", [0, 1])):
        [row] = rows_of(tmp_path / folder)
        assert row["seeds"] == seeds, folder


def test_a_default_that_differs_still_tells_rows_apart(tmp_path):
    """fedavg-ft fine-tunes 1 epoch by default: 0 set explicitly is another experiment, and
    so is an augmentation against none."""
    write_run(tmp_path / "a", 0.4, algorithm="fedavg-ft", scenario="iid", keep_head_local=True)
    write_run(tmp_path / "b", 0.6, algorithm="fedavg-ft", scenario="iid", keep_head_local=True, finetune_epochs=0)
    write_run(tmp_path / "c", 0.6, algorithm="fedavg-ft", scenario="iid", keep_head_local=True, augment="flip")
    settings = {json.dumps(r["settings"], sort_keys=True) for r in rows_of(tmp_path)}
    assert settings == {json.dumps(s, sort_keys=True) for s in ({"augment": None, "finetune_epochs": 0},
                                                                {"augment": None, "finetune_epochs": 1},
                                                                {"augment": "flip(p=0.5)", "finetune_epochs": 1})}


def test_real_runs_with_options_at_their_defaults_are_one_experiment(tmp_path, capsys):
    """End to end (the reported case): --finetune-epochs 0 and --augment none are fedavg's
    defaults, so the second run repeats the first."""
    base = ["run", "fedavg", "--dataset", "gaussian-mixture", "--model", "mlp", "--scenario", "iid", "--clients", "2",
            "--rounds", "1", "--local-steps", "1", "--set", "samples=60", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--finetune-epochs", "0", "--augment", "none", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    with pytest.warns(DuplicateSeedWarning, match="repeats the run"):
        [row] = rows_of(tmp_path / "a", tmp_path / "b")
    assert row["seeds"] == [0]


# (key, the value it is corrupted to, what the error says)
CORRUPTIONS = [
    ("config.seed", "a", "config.seed must be an integer"),
    ("config.seed", 1.5, "config.seed must be an integer"),
    ("config.algorithm_settings", [1, 2], r"config.algorithm_settings must be a table \(key = value\), got \[1, 2\]"),
    ("config.scenario_options", "abc", r"config.scenario_options must be a table \(key = value\), got 'abc'"),
    ("config.algorithm", 5, "config.algorithm must be a string, got 5"),
    ("config.scenario", ["x"], r"config.scenario must be a string, got \['x'\]"),
    ("config.keep_head_local", "yes", "config.keep_head_local must be true or false"),
    ("config.finetune_epochs", -1, "config.finetune_epochs must be an integer >= 0"),
    ("final_mean_accuracy", 10 ** 400, r"key 'final_mean_accuracy' must be a number in \[0, 1\] or null, got 1000"),
    ("best_mean_accuracy", 1.5, r"key 'best_mean_accuracy' must be a number in \[0, 1\] or null, got 1.5"),
    ("final_mean_accuracy", True, r"key 'final_mean_accuracy' must be a number in \[0, 1\] or null, got True"),
    ("target_best_accuracy", "high", r"key 'target_best_accuracy' must be a number in \[0, 1\] or null"),
    ("comm_gb.up", -1, "key 'comm_gb.up' must be a finite number >= 0, got -1"),
    ("train_wall_s_total", 10 ** 400, "key 'train_wall_s_total' must be a finite number >= 0"),
]


@pytest.mark.parametrize("key, value, message", CORRUPTIONS,
                         ids=[f"{key}={value!r}"[:48] for key, value, _ in CORRUPTIONS])
def test_a_corrupt_summary_is_one_line_naming_the_file_and_key(tmp_path, capsys, key, value, message):
    """A summary.json edited by hand (or by a bug) stops ``pfl compare`` with one line naming
    the file, the key and what was expected, never a traceback."""
    write_run(tmp_path / "good", 0.4)
    bad = write_run(tmp_path / "bad", 0.6, seed=1)
    edit_summary(bad, key, value)
    assert main(["compare", str(tmp_path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pfl: error: {bad / 'summary.json'}: ")
    assert re.search(message, line), line


def test_huge_but_finite_costs_do_not_overflow_the_mean(tmp_path):
    """Costs near the largest float are valid numbers: their mean is taken exactly, not
    through a float sum that overflows."""
    for seed in (0, 1):
        edit_summary(write_run(tmp_path / f"s{seed}", 0.5, seed=seed), "train_wall_s_total", 1.5e308)
    [row] = rows_of(tmp_path)
    assert row["wall_s"] == (1.5e308, 0.0)

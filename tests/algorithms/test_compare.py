"""``pfl compare`` pools only runs of the same experiment (the whole resolved config but the
seed), names what tells rows apart, and never counts a run twice."""
from __future__ import annotations

import json

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
        # its default is the same experiment as one left at it.
        write_run(tmp_path / f"s{seed}", accuracy, seed=seed, workers=seed + 1, checkpoint_every=seed + 1,
                  data_root=f"/data{seed}", algorithm="fedprox",
                  algorithm_settings={"mu": 0.01} if seed else {})
    [row] = rows_of(tmp_path)
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

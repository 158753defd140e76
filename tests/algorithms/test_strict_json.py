"""Every JSON file a run writes is strict JSON: a NaN or infinite number (a diverged train
loss, a client with nothing to evaluate) is written as null, never as a bare ``NaN``, and the
readers (resume, ``pfl compare``, plots, the reproduce report) take the nulls."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from pfl_algorithms.atomic_io import finite_json, json_text
from pfl_algorithms.cli import main
from pfl_algorithms.config import RunConfig, apply_sets, check
from pfl_algorithms.reproduce.report import _history
from pfl_algorithms.runner import run


def _refuse(constant: str):
    raise ValueError(f"not strict JSON: bare {constant}")


def strict_loads(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as strict parsers do."""
    return json.loads(text, parse_constant=_refuse)


def diverging_config(**overrides) -> RunConfig:
    """A tiny run whose every client's train loss is NaN (lr 1e30 overflows the first step)."""
    config = RunConfig(algorithm="fedavg", dataset="gaussian-mixture", model="mlp", scenario="dirichlet", clients=4,
                       rounds=3, batch_size=16, lr=1e30, workers=1, **overrides)
    apply_sets(config, ["samples=240", "min_samples=5"])
    return check(config)


def run_files(out) -> dict:
    """Every JSON file of the run directory ``out`` as text: name -> text (one per metrics line)."""
    files = {p.name: p.read_text() for p in out.glob("*.json")}
    files.update({f"metrics.jsonl:{i}": line for i, line in enumerate((out / "metrics.jsonl").read_text().splitlines())})
    return files


def test_a_diverged_run_writes_strict_json_and_every_reader_takes_it(tmp_path, capsys):
    out = tmp_path / "diverged"
    summary = run(diverging_config(), out, progress=False)
    files = run_files(out)
    assert {"config.json", "summary.json", "run.json", "partition.json", "metrics.jsonl:2"} <= set(files)
    parsed = {name: strict_loads(text) for name, text in files.items()}  # raises on a bare NaN
    line = parsed["metrics.jsonl:0"]
    assert line["skipped_non_finite"] == [0, 1, 2, 3]
    assert line["train_loss"] == {"0": None, "1": None, "2": None, "3": None}
    assert summary["final_mean_accuracy"] is not None and "accuracy_vs_round" in summary["plots"]

    # pfl compare reads the summary; the reproduce report reads metrics.jsonl.
    assert main(["compare", str(tmp_path)]) == 0
    assert "fedavg" in capsys.readouterr().out
    assert len(_history(SimpleNamespace(out=out))) == 3


def test_a_resumed_diverged_run_matches_one_run_through(tmp_path):
    """Resume reads the nulls back into the history; the files equal those of an unbroken run."""
    run(diverging_config(), tmp_path / "through", progress=False)
    run(diverging_config(), tmp_path / "killed", progress=False, stop_after=1)
    run(diverging_config(), tmp_path / "killed", progress=False, resume=True)
    through, resumed = (strict_loads((tmp_path / r / "summary.json").read_text()) for r in ("through", "killed"))
    for key in ("final_mean_accuracy", "best_mean_accuracy", "final_client_accuracy", "comm_gb"):
        assert resumed[key] == through[key], key
    lines = [[{k: v for k, v in strict_loads(line).items() if k != "wall_s"}
              for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("through", "killed")]
    assert lines[0] == lines[1]


def test_readers_take_a_null_accuracy(tmp_path):
    """An evaluation with nothing to evaluate (accuracy null): the summary's best skips it, the
    plots and the report show a gap."""
    from pfl_algorithms.engine.rundir import RunDirectory
    from pfl_algorithms.plots import write_plots
    from pfl_algorithms.runner import _best

    assert _best([None, 0.5, float("nan"), 0.25]) == 0.5 and _best([None]) is None
    history = [{"round": r, "comm_gb": {"up": 0.1, "down": 0.1}, "wall_s": 1.0,
                "eval": {"mean_accuracy": acc, "accuracy": {"0": acc, "1": 0.5}}} for r, acc in enumerate((None, 0.5))]
    pytest.importorskip("matplotlib")
    plots = write_plots(RunDirectory(tmp_path), history)
    assert set(plots) == {"accuracy_vs_round", "accuracy_vs_bits", "client_accuracy"}
    (tmp_path / "metrics.jsonl").write_text("".join(json_text(h) + "\n" for h in history))
    rows = _history(SimpleNamespace(out=tmp_path))
    assert math.isnan(rows[0][1]) and rows[1][1] == 50.0


def test_non_finite_numbers_become_null_and_a_slip_raises(monkeypatch):
    value = {"a": [1.0, float("nan"), (float("inf"), -float("inf"))], "b": {"c": 2, "d": "NaN"}}
    assert finite_json(value) == {"a": [1.0, None, [None, None]], "b": {"c": 2, "d": "NaN"}}
    assert strict_loads(json_text(value)) == finite_json(value)
    # The guard behind the conversion: were it to miss a NaN, writing raises instead of a bare NaN.
    monkeypatch.setattr("pfl_algorithms.atomic_io.finite_json", lambda v: v)
    with pytest.raises(ValueError, match="Out of range float"):
        json_text(value)

"""Issue 32, items 6 and 7: a diverged model is never scored (NaN accuracy, counted in the
round's ``eval.diverged``, the summary's ``final_diverged_clients`` and a warning line; 0 in
the mean of the clients that did score, and no mean where none did), the
tables print a mean alone where one seed gives no spread, a truncated JSON file of a reproduce
folder is one line naming it, and a --samples-per-client that leaves a split empty is refused."""
from __future__ import annotations

import json
import math

import pytest

from pfl_algorithms.cli import main
from pfl_algorithms.engine.client import EvalResult
from pfl_algorithms.engine.rounds import evaluation_summary

DIVERGING = ["--dataset", "digits", "--clients", "4", "--rounds", "2", "--samples-per-client", "40", "--lr", "1e6",
             "--quiet"]


def _eval_lines(out) -> list[dict]:
    return [json.loads(line)["eval"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "eval" in json.loads(line)]


@pytest.mark.parametrize("executor", ["sequential", "batched"])
def test_a_diverged_model_is_not_scored(executor, tmp_path, capsys):
    """lr 1e6: every evaluation loss is NaN; the run used to print "final mean accuracy
    12.50%" (the argmax of NaN logits).  Now: NaN accuracy, the clients listed as diverged."""
    out = tmp_path / "r"
    assert main(["run", "fedavg", *DIVERGING, "--executor", executor, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    final = _eval_lines(out)[-1]
    assert final["diverged"] == [0, 1, 2, 3] and final["mean_accuracy"] is None
    assert all(a is None for a in final["accuracy"].values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_mean_accuracy"] is None and summary["final_diverged_clients"] == [0, 1, 2, 3]
    assert "final mean accuracy n/a" in captured.out and "12.50%" not in captured.out
    warning = [line for line in captured.err.splitlines() if line.startswith("pfl: warning:")]
    assert len(warning) == 1 and "diverged for 4 of 4 client(s)" in warning[0]
    assert "there is no mean accuracy" in warning[0]


def test_a_diverged_pfedmb_with_projected_alpha_is_reported_not_an_error(tmp_path, capsys):
    """pFedMB's projection of α (simplex=projection) used the wrapper that refuses NaN: a
    diverging client stopped the run with "x must be finite to be projected onto the simplex".
    Now its α row turns NaN, and the run reports the diverged clients as any other does."""
    out = tmp_path / "r"
    assert main(["run", "pfedmb", *DIVERGING, "--set", "simplex=projection", "--set", "alpha_lr=1e6",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "must be finite" not in err and "diverged for 4 of 4 client(s)" in err
    assert json.loads((out / "summary.json").read_text())["final_diverged_clients"] == [0, 1, 2, 3]


def test_a_diverged_target_is_not_scored(tmp_path, capsys):
    """FedGP's target trained at target_lr 1e7 (the fda scenario): the same, and the target's
    final accuracy is null."""
    out = tmp_path / "r"
    assert main(["run", "fedgp", "--scenario", "fda", "--dataset", "digits", "--clients", "4", "--rounds", "2",
                 "--samples-per-client", "40", "--set", "target_lr=1e7", "--quiet", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_final_accuracy"] is None and summary["final_mean_accuracy"] is None
    assert summary["target_client"] in summary["final_diverged_clients"]
    assert "diverged" in capsys.readouterr().err


def test_evaluation_summary_marks_a_non_finite_loss_diverged():
    """A client's NaN or infinite loss is diverged (its accuracy NaN, 0 in the mean: the mean
    was over the survivors alone, so 9 of 10 clients diverged with the tenth at 95% read 95%);
    a client with nothing to evaluate (0 samples) is not diverged, just not evaluated."""
    nan = math.nan
    summary = evaluation_summary([EvalResult(0, 0.5, 1.0, 10), EvalResult(1, 0.125, nan, 10),
                                  EvalResult(2, 0.25, math.inf, 10), EvalResult(3, nan, nan, 0)])
    assert summary["diverged"] == [1, 2]
    assert summary["mean_accuracy"] == pytest.approx(0.5 / 3)
    nine = evaluation_summary([EvalResult(0, 0.95, 0.1, 10), *(EvalResult(c, 0.1, nan, 10) for c in range(1, 10))])
    assert nine["mean_accuracy"] == pytest.approx(0.095)
    none = evaluation_summary([EvalResult(0, 0.3, nan, 10), EvalResult(1, nan, nan, 0)])
    assert none["diverged"] == [0] and math.isnan(none["mean_accuracy"])  # no client scored: no mean
    assert math.isnan(summary["accuracy"][1]) and math.isnan(summary["accuracy"][2])

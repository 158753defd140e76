"""A diverged seed is never left out quietly: a paper's claim with a finished seed that has no
accuracy on either side is inconclusive (it printed "holds" over the seeds the unstable method
survived), and the plots draw a curve's mean only where every seed scored, in the report's
own communication unit (GB), with the legend saying how many seeds end without accuracy."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from pfl_algorithms.plots import seeds_curve_label
from pfl_algorithms.reproduce import PAPERS
from pfl_algorithms.reproduce import report
from pfl_algorithms.reproduce.campaign import settings_of


def _cell(per_seed: dict, seeds: int) -> dict:
    values = list(per_seed.values())
    return {"accuracy": report._mean_std(values), "gb": (0.1, None), "seeds": seeds, "per_seed": per_seed}


def _claim_and_setting():
    paper = PAPERS["pfedmb"]
    claim = paper.claims[0]
    setting = next(s for s in settings_of(paper, "cpu") if claim.setting_contains in s.label)
    return paper, claim, setting


def _row(paper, claim, setting, cells):
    rows = [r for r in report.claim_results(paper, "cpu", cells)
            if r["setting"] == setting.label and r["method"] == claim.method and r["other"] == claim.other]
    return rows[0]


def test_a_claim_with_a_seed_without_accuracy_is_inconclusive():
    paper, claim, setting = _claim_and_setting()
    better = {">": 10.0, ">=": 10.0, "<": -10.0}[claim.relation]
    other = {s: 80.0 + s for s in range(5)}
    mine = {s: other[s] + better for s in range(3)}  # seeds 3 and 4 finished without an accuracy
    everyone = {s: other[s] + better for s in range(5)}
    complete = _row(paper, claim, setting, {(claim.method, setting.label): _cell(everyone, 5),
                                            (claim.other, setting.label): _cell(other, 5)})
    assert complete["verdict"] == "holds" and complete["without_accuracy"] == {}
    row = _row(paper, claim, setting, {(claim.method, setting.label): _cell(mine, 5),
                                       (claim.other, setting.label): _cell(other, 5)})
    assert row["verdict"] == "inconclusive" and row["without_accuracy"] == {claim.method: 2}
    assert row["seeds"] == [0, 1, 2]  # the paired difference is still shown, over the pairs
    line = next(l for l in report.claim_lines(paper, "cpu", {(claim.method, setting.label): _cell(mine, 5),
                                                               (claim.other, setting.label): _cell(other, 5)})
                if l.startswith(f"- {setting.label}: {claim.method} ") and claim.other in l)
    assert "**inconclusive**" in line and f"2 seed(s) of {claim.method} without an accuracy" in line


def test_a_method_without_accuracy_on_every_seed_is_inconclusive_not_unmeasured():
    """It was run: "not measured" hid that; no seed pair, so no difference either."""
    paper, claim, setting = _claim_and_setting()
    cells = {(claim.method, setting.label): _cell({}, 3), (claim.other, setting.label): _cell({0: 1.0, 1: 2.0}, 3)}
    row = _row(paper, claim, setting, cells)
    assert row["verdict"] == "inconclusive" and row["without_accuracy"] == {claim.method: 3, claim.other: 1}
    line = next(l for l in report.claim_lines(paper, "cpu", cells)
                if l.startswith(f"- {setting.label}: {claim.method} ") and claim.other in l)
    assert "no seed pair" in line and "not measured" not in line
    assert _row(paper, claim, setting, {})["verdict"] == "not measured"


def test_the_legend_counts_seeds_that_end_without_accuracy():
    assert seeds_curve_label("FedAvg", [80.0, 81.0]) == "FedAvg"
    assert seeds_curve_label("pFedMB", [80.0, math.nan, math.nan]) == "pFedMB (2/3 seeds end without accuracy)"


def test_the_communication_plot_is_in_the_reports_gigabytes(monkeypatch, tmp_path):
    """The table gives GB (the papers' "Gb"); the plot's axis said Gb and plotted gigabits, 8x."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    paper = PAPERS["pfedmb"]
    setting = settings_of(paper, "cpu")[0]
    method = next(m for m in paper.methods if setting.runs(m))
    history = {0: [(1, 50.0, 8.0), (2, 60.0, 16.0)], 1: [(1, 52.0, 8.0), (2, math.nan, 16.0)]}
    runs = [SimpleNamespace(method=method, setting=setting, seed=s) for s in history]
    monkeypatch.setattr(report, "_history", lambda run, metric: history[run.seed])
    drawn, labels = [], []
    original_plot, original_set = Axes.plot, Axes.set
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **k: drawn.append((a, k)) or original_plot(ax, *a, **k))
    monkeypatch.setattr(Axes, "set", lambda ax, **k: labels.append(k.get("xlabel")) or original_set(ax, **k))
    report.write_plots(paper, "cpu", runs, tmp_path / "plots")
    by_round, by_bits = drawn[0], drawn[1]
    assert list(by_round[0][0]) == [1, 2] and list(by_bits[0][0]) == [1.0, 2.0]  # 8 and 16 gigabits
    assert by_bits[0][1][0] == 51.0 and math.isnan(by_bits[0][1][1])  # a gap where a seed has none
    assert by_bits[1]["label"] == f"{method.label} (1/2 seeds end without accuracy)"
    assert "communicated (GB = 10⁹ bytes, up + down)" in labels


def test_a_claim_the_papers_table_contradicts_carries_its_note_beside_the_verdict():
    paper = PAPERS["factorized-fl"]
    claim = next(c for c in paper.claims if c.note)
    setting = next(s for s in settings_of(paper, "cpu") if claim.setting_contains in s.label)
    cells = {(claim.method, setting.label): _cell({0: 1.0, 1: 2.0}, 2),
             (claim.other, setting.label): _cell({0: 3.0, 1: 5.0}, 2)}
    row = _row(paper, claim, setting, cells)
    assert row["note"] == claim.note
    line = next(l for l in report.claim_lines(paper, "cpu", cells)
                if l.startswith(f"- {setting.label}: {claim.method} {claim.text} {claim.other}:"))
    assert line.endswith(f"(note: {claim.note})")


def test_mean_over_seeds_stops_at_the_shortest_seed_and_leaves_gaps():
    """The demo's and the reports' curves: a round some seed did not score is a gap (NaN), the
    curve ends with the shortest seed, and a seed without any evaluation leaves no curve."""
    from pfl_algorithms.plots import mean_over_seeds

    a = [(1, 50.0, 2.0), (2, 60.0, 4.0), (3, 70.0, 6.0)]
    b = [(1, 40.0, 2.0), (2, math.nan, 4.0)]
    rounds, (accuracy, bits), label = mean_over_seeds("FedAvg", [a, b], columns=2)
    assert rounds == [1, 2] and accuracy[0] == 45.0 and math.isnan(accuracy[1]) and bits == [2.0, 4.0]
    assert label == "FedAvg (1/2 seeds end without accuracy)"
    assert mean_over_seeds("Local", [a, []]) == ([], [[]], "Local (1/2 seeds end without accuracy)")

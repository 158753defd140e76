"""benchmarks/paired_rounds.py: the ratio and its bootstrap interval on hand-checkable times,
and a dry run of a round suite end to end (as CI runs every benchmark script)."""
from __future__ import annotations

import json

import pytest

from benchmarks import paired_rounds


def test_ratio_of_medians_is_baseline_over_ours():
    assert paired_rounds.ratio_of_medians([1.0, 3.0, 2.0], [4.0, 5.0, 6.0]) == 2.5


def test_constant_pairs_give_a_point_interval():
    assert paired_rounds.bootstrap_interval([0.5] * 7, [1.0] * 7) == (2.0, 2.0)


def test_interval_brackets_the_ratio_and_is_seeded():
    ours = [0.25, 0.27, 0.24, 0.30, 0.26, 0.25, 0.28, 0.23]
    baseline = [0.52, 0.50, 0.55, 0.49, 0.60, 0.51, 0.53, 0.50]
    low, high = paired_rounds.bootstrap_interval(ours, baseline)
    assert low <= paired_rounds.ratio_of_medians(ours, baseline) <= high
    assert low < high
    assert paired_rounds.bootstrap_interval(ours, baseline) == (low, high)
    # the interval can only come from ratios of medians of resampled pairs
    assert min(baseline) / max(ours) <= low and high <= max(baseline) / min(ours)


@pytest.mark.parametrize("ours, baseline", [([], []), ([1.0], [1.0, 2.0])])
def test_interval_refuses_unpaired_times(ours, baseline):
    with pytest.raises(ValueError, match="as many times per side"):
        paired_rounds.bootstrap_interval(ours, baseline)


def test_bad_pairs_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        paired_rounds.main(["fedavg_round", "--pairs", "0"])
    assert exit_.value.code == 2
    assert "--pairs must be >= 1" in capsys.readouterr().err


def test_json_in_a_missing_folder_is_refused_before_measuring(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        paired_rounds.main(["factorized_fl_round", "--json", str(tmp_path / "absent" / "out.json")])
    assert exit_.value.code == 2
    assert "--json: the folder of" in capsys.readouterr().err


@pytest.mark.slow  # a whole round suite, both sides, end to end
def test_dry_run_measures_both_sides_and_writes_json(tmp_path, capsys):
    path = tmp_path / "paired.json"
    assert paired_rounds.main(["factorized_fl_round", "--dry-run", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["suite"] == "factorized_fl_round" and result["dry_run"] is True and result["pairs"] == 2
    assert [len(result["times_s"][side]) for side in ("ours", "baseline")] == [2, 2]
    assert all(t > 0 for side in ("ours", "baseline") for t in result["times_s"][side])
    low, high = result["ratio_95"]
    assert low <= result["ratio"] <= high
    assert "interleaved pairs" in capsys.readouterr().out

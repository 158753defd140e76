"""benchmarks/bf16_accuracy.py: a dry run pairs a float32 and a bf16 run of the same seed and
writes their difference; bad arguments are usage errors before anything runs."""
from __future__ import annotations

import json

import pytest

from benchmarks import bf16_accuracy


def test_dry_run_pairs_both_modes_per_seed_and_writes_json(tmp_path):
    path = tmp_path / "bf16.json"
    assert bf16_accuracy.main(["--dry-run", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["suite"] == "bf16_accuracy" and result["dry_run"] is True
    assert [(r["row"], r["seed"], r["autocast"]) for r in result["runs"]] == [("fedavg", 0, None),
                                                                               ("fedavg", 0, "bf16")]
    (row,) = result["rows"]
    by_mode = {r["autocast"]: r["accuracy"] for r in result["runs"]}
    assert 0 <= by_mode[None] <= 100 and 0 <= by_mode["bf16"] <= 100
    assert row["float32"] == by_mode[None] and row["bf16"] == by_mode["bf16"]
    diff = row["bf16_minus_float32"]
    assert diff["differences"] == [pytest.approx(by_mode["bf16"] - by_mode[None])]
    assert diff["interval"] is None  # one seed pair gives no interval


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--rounds", "-1"], "--rounds must be >= 1"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--json", "/nonexistent-folder/x.json"], "--json: the folder of"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bf16_accuracy.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit) as exit_:
        bf16_accuracy.main(["--device", "cuda", "--dry-run"])
    assert exit_.value.code == 2
    assert "no CUDA device here" in capsys.readouterr().err

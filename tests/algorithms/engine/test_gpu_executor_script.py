"""benchmarks/gpu_executor.py runs from end to end on a CPU (``--dry-run``) before a GPU is spent
on it, and refuses a run without CUDA in one line."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_executor


def test_dry_run_measures_every_job_and_writes_its_json(tmp_path, capsys):
    path = tmp_path / "executor.json"
    assert gpu_executor.main(["--dry-run", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert {(r["job"], r["executor"]) for r in result["rows"]} == {
        ("lenet5", "sequential"), ("lenet5", "batched"), ("lenet5", "batched+bf16"),
        ("resnet9-factorized", "sequential"), ("resnet9-factorized", "batched")}
    assert all(r["round_s"] > 0 for r in result["rows"])
    assert set(result["bf16_accuracy"]) == {"float32", "bf16"}
    assert result["table1"]["rounds"] == 1 and result["machine"]["dry_run"] is True
    assert "factorized-fl-table1 end to end" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert gpu_executor.main([]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0

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
        *((job, executor) for job in ("lenet5", "resnet9-factorized")
          for executor in ("sequential", "sequential-eager", "batched", "batched-eager")),
        ("lenet5", "batched+bf16")}
    assert all(r["round_s"] > 0 for r in result["rows"])
    # On a CPU nothing is captured; the batched executor's plain steps run as static steps.
    assert all(r["steps"]["captured"] == 0 for r in result["rows"])
    assert all(r["steps"]["eager"] > 0 for r in result["rows"] if r["executor"].startswith("batched"))
    assert set(result["bf16_accuracy"]) == {"float32", "bf16"}
    assert result["table1"]["rounds"] == 1 and result["machine"]["dry_run"] is True
    assert "factorized-fl-table1 end to end" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert gpu_executor.main([]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_the_table1_job_projects_the_papers_rounds_from_the_rounds_it_ran(tmp_path):
    sizes = dict(gpu_executor.DRY, table1=dict(gpu_executor.DRY["table1"], rounds=5))
    row = gpu_executor.table1_job(sizes, "cpu", tmp_path, rounds=3)
    assert (row["rounds_run"], row["paper_rounds"], row["rounds"]) == (3, 5, 3)
    assert row["projected_s"] > 0 and row["wall_s"] > 0 and row["met"] == (row["projected_s"] <= 300.0)

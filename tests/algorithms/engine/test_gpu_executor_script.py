"""benchmarks/gpu_executor.py runs from end to end on a CPU (``--dry-run``) before a GPU is spent
on it, and refuses a run without CUDA in one line."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_executor

pytestmark = pytest.mark.heavy(seconds=35)  # scheduled first under xdist (tests/conftest.py)


def test_dry_run_measures_every_job_and_writes_its_json(tmp_path, capsys):
    path = tmp_path / "executor.json"
    assert gpu_executor.main(["--dry-run", "--profile", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    common = ("sequential", "sequential-eager", "batched", "batched-eager", "batched+bf16", "batched+nhwc",
              "batched+bf16+nhwc", "batched+per-client", "batched+bf16+per-client", "one-model", "one-model+bf16")
    assert {(r["job"], r["executor"]) for r in result["rows"]} == {
        *(("lenet5", executor) for executor in (*common, "batched+gemm-conv")),
        *(("resnet9-factorized", executor) for executor in common)}
    assert all(r["round_s"] > 0 for r in result["rows"])
    # every job's target rows first (a stage cut at its cap loses only reported ones)
    assert [(r["job"], r["executor"]) for r in result["rows"][:4]] == [
        ("lenet5", "sequential"), ("lenet5", "batched"), ("resnet9-factorized", "sequential"),
        ("resnet9-factorized", "batched")]
    # the bound: one model on all the clients' samples, at the clients' batch times their number
    batches = {"lenet5": 64, "resnet9-factorized": 8}
    clients = gpu_executor.DRY["clients"]
    for r in result["rows"]:
        assert r["batch"] == batches[r["job"]] * (clients if r["executor"].startswith("one-model") else 1)
    # On a CPU nothing is captured; the batched executor's plain steps run as static steps.
    assert all(r["steps"]["captured"] == 0 for r in result["rows"])
    assert all(r["steps"]["eager"] > 0 for r in result["rows"] if r["executor"].startswith("batched"))
    assert set(result["bf16_accuracy"]) == {"float32", "bf16"}
    assert result["table1"]["rounds"] == 1 and result["machine"]["dry_run"] is True and result["complete"] is True
    assert isinstance(result["machine"]["direct_launch"], bool)  # the launch mode of its figures, and what it did
    assert set(result["machine"]["direct_launches"]) == {"direct", "through_triton"}
    out = capsys.readouterr().out
    assert "factorized-fl-table1 end to end" in out
    # --profile: LeNet-5's host functions and kernels, then ResNet-9's kernels alone, batched in
    # float32 and under bf16, and sequential
    lenet, *resnet = out.split("== profile of one batched LeNet-5 round")[1].split(
        "== device kernels of one factorized ResNet-9 round")
    assert "tottime" in lenet and lenet.count("Self CPU time total") == 2
    assert [part.split(")")[0] for part in resnet] == [" (batched", " (batched, bf16 autocast", " (sequential"]
    assert all("tottime" not in part and part.count("Self CPU time total") == 1 for part in resnet)


def test_a_run_cut_short_keeps_the_jobs_that_finished(tmp_path, monkeypatch):
    """gpu_check.sh kills a stage at its timeout: the JSON written so far must hold every job that
    ended (here the jobs are stand-ins, and Table 1, after the targets' rows, dies instead of
    being killed)."""
    def rows(name, *args, variants, rows, on_row, **kwargs):
        rows.append({"job": name, "executor": "+".join(v[0] for v in variants), "round_s": 1.0})
        on_row()

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_executor, "speed_job", rows)
    monkeypatch.setattr(gpu_executor, "table1_job", dies)
    path = tmp_path / "executor.json"
    with pytest.raises(KeyboardInterrupt):
        gpu_executor.main(["--dry-run", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["complete"] is False and result["table1"] is None and result["bf16_accuracy"] is None
    assert [(r["job"], r["executor"]) for r in result["rows"]] == [("lenet5", "sequential+batched"),
                                                                   ("resnet9-factorized", "sequential+batched")]


def test_a_failing_variant_leaves_its_error_and_the_others_run(monkeypatch):
    """A variant that raises (the H100's bf16 ResNet-9) is a row with its error; the variants after
    it still run, each row is saved as it ends, and the speed-ups are over the sequential rows."""
    made, saved = [], []
    real_federation = gpu_executor.federation

    def federation(model, **kwargs):
        made.append(kwargs["autocast"])
        if kwargs["autocast"] == "bf16":
            raise RuntimeError("Expected running_mean to have type BFloat16 but got Float")
        return real_federation(model, **kwargs)

    monkeypatch.setattr(gpu_executor, "federation", federation)
    rows = []
    variants = gpu_executor.target_variants() + gpu_executor.reported_variants(bf16=True, gemm=False)
    gpu_executor.speed_job("lenet5", "lenet5", False, 8, 4, 10.0, gpu_executor.DRY, "cpu", variants=variants,
                           seconds={}, rows=rows, on_row=lambda: saved.append(len(rows)))
    assert saved == list(range(1, 12)) and made.count("bf16") == 4
    failed = [r for r in rows if "error" in r]
    assert [r["executor"] for r in failed] == ["batched+bf16", "batched+bf16+nhwc", "batched+bf16+per-client",
                                               "one-model+bf16"]
    assert "BFloat16" in failed[0]["error"]
    timed = [r for r in rows if "error" not in r]
    assert [r["executor"] for r in timed] == ["sequential", "batched", "sequential-eager", "batched-eager",
                                              "batched+nhwc", "batched+per-client", "one-model"]
    assert all(r["speedup_vs_sequential"] > 0 for r in timed)
    sequential = next(r for r in timed if r["executor"] == "sequential")
    assert sequential["speedup_vs_sequential"] == 1.0 and sequential["target"] is None
    assert next(r for r in timed if r["executor"] == "batched")["target"] == 10.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert gpu_executor.main([]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_the_table1_job_projects_the_papers_rounds_from_the_rounds_it_ran(tmp_path):
    sizes = dict(gpu_executor.DRY, table1=dict(gpu_executor.DRY["table1"], rounds=5))
    row = gpu_executor.table1_job(sizes, "cpu", tmp_path, rounds=3)
    assert (row["rounds_run"], row["paper_rounds"], row["rounds"]) == (3, 5, 3)
    assert row["projected_s"] > 0 and row["wall_s"] > 0 and row["met"] == (row["projected_s"] <= 300.0)

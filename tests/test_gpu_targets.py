"""benchmarks/gpu_targets.py: issue 30's verdict from a GPU run's JSON (no device needed).

Each target is checked on both sides of its bound with rows written here in the suites'
formats, and the script is run on the committed results of every device that has them."""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from benchmarks import gpu_targets as gt

SLUG = "test_gpu"


def launch_row(op, public, bare, direct=float("nan"), via="op"):
    return {"op": op, "shape": "s", "path": "triton (1 launch)", "public_host_us": public, "bare_host_us": bare,
            "direct_host_us": direct, "via": via}


def kernel_row(fused, eager, copy=None, **shape):
    return {"fused_ms": fused, "eager_ms": eager, "copy_ms": copy if copy is not None else fused,
            "speedup_vs_eager": eager / fused, "bytes": 100, **shape}


def suites(**over) -> dict:
    """Results in which every target is met; ``over`` replaces whole suites (None: absent)."""
    data = {
        "launch": {"rows": [launch_row("factorized_weight", 40.0, 20.0, 22.0),
                            launch_row("factorized_weight backward", 400.0, 20.0, via="autograd")]},
        "factorized": {"rows": [kernel_row(1.0, 2.0, 0.8, direction="forward", shape=[8, 8]),
                                kernel_row(1.0, 1.0, 0.7, direction="backward", shape=[8, 8])]},
        "branch": {"rows": [kernel_row(1.0, 1.5, 0.9, direction="forward"),
                            kernel_row(1.0, 1.5, 0.75, direction="backward")]},
        "similarity": {"rows": [kernel_row(1.0, 1.1, op="cosine")]},
        "aggregate": {"rows": [
            {"clients": 20, "params": 10 ** 7, "density": 1.0, "targeted": True, "fused_ms": 1.2, "eager_ms": 1.0,
             "speedup_vs_mm": 1.0},
            {"clients": 100, "params": 10 ** 7, "density": 0.05, "targeted": False, "fused_ms": 1.0, "eager_ms": 3.0,
             "speedup_vs_mm": 3.0}]},
        "branch_aggregate": {"rows": [kernel_row(1.0, 1.0, op="aggregate")]},
        "executor": {"rows": [
            {"job": "lenet5", "executor": "batched", "round_s": 0.01, "speedup_vs_sequential": 10.0},
            {"job": "lenet5", "executor": "batched+bf16", "round_s": 0.005, "speedup_vs_sequential": 20.0},
            {"job": "resnet9-factorized", "executor": "batched", "round_s": 0.1, "speedup_vs_sequential": 3.0}],
            "bf16_accuracy": {"float32": 0.86, "bf16": 0.85},
            "table1": {"rounds_run": 3, "paper_rounds": 50, "projected_s": 300.0}},
    }
    for suite, value in over.items():
        if value is None:
            data.pop(suite)
        else:
            data[suite] = value
    return data


def verdicts(data) -> dict:
    return {t.name: t for t in gt.all_targets(data)}


def test_every_target_met_at_its_bounds():
    targets = gt.all_targets(suites())
    assert all(t.met is True for t in targets), [t for t in targets if t.met is not True]
    names = [t.name for t in targets]
    assert len(names) == len(set(names)) == 14  # launch twice (as is, direct), 5 call suites, 2+2+3
    assert any("(direct launches)" in n for n in names)


@pytest.mark.parametrize("suite,rows,name", [
    ("launch", [launch_row("x", 45.1, 20.0, 30.0)], "launch: public op host time - bare launch <= 25 us"),
    ("similarity", [kernel_row(1.0, 0.99, op="cosine")], "calls: similarity >= 1x eager at every shape"),
    ("branch", [kernel_row(1.0, 1.5, 0.69, direction="forward")], "branch: largest case >= 70% of copy bandwidth"),
])
def test_just_past_a_bound_is_missed(suite, rows, name):
    target = verdicts(suites(**{suite: {"rows": rows}}))[name]
    assert target.met is False and target.verdict == "MISSED"


def test_the_aggregate_and_executor_bounds():
    data = suites()
    data["aggregate"]["rows"][0]["fused_ms"] = 1.21  # 1.21x torch.mm
    data["aggregate"]["rows"][1]["eager_ms"] = 2.99  # 2.99x faster than dense mm
    data["executor"]["rows"][0]["speedup_vs_sequential"] = 9.99
    data["executor"]["table1"]["projected_s"] = 300.5
    missed = {t.name for t in gt.all_targets(data) if t.met is False}
    assert missed == {"weighted_average dense <= 1.2x torch.mm (P = 10^7)",
                      "weighted_average sparse 0.05 >= 3x dense mm (K = 100, P = 10^7)",
                      "executor: lenet5 batched >= 10x sequential",
                      "executor: Factorized-FL Table 1 cell <= 300 s (50 rounds)"}


def test_autograd_rows_are_counted_apart_and_the_worst_is_named():
    data = suites(launch={"rows": [launch_row("a", 30.0, 20.0), launch_row("b", 50.0, 20.0, via="op"),
                                   launch_row("c", 900.0, 20.0, via="autograd")]})
    target = verdicts(data)["launch: public op host time - bare launch <= 25 us"]
    assert target.met is False and target.figure.startswith("1/2 within; worst 30.0 us (b s)")
    assert "1 autograd rows apart" in target.figure
    assert not any("direct" in n for n in verdicts(data))  # not measured with direct launches: no line


def test_an_absent_suite_leaves_its_targets_not_measured():
    targets = verdicts(suites(executor=None, aggregate=None))
    gone = [t for t in targets.values() if t.met is None]
    assert {t.name for t in gone} == {
        "executor: lenet5 batched >= 10x sequential", "executor: resnet9-factorized batched >= 3x sequential",
        "executor: Factorized-FL Table 1 cell <= 300 s (50 rounds)", "calls: aggregate >= 1x eager at every shape",
        "weighted_average dense <= 1.2x torch.mm (P = 10^7)",
        "weighted_average sparse 0.05 >= 3x dense mm (K = 100, P = 10^7)"}
    assert all(t.verdict == "not measured" for t in gone)


LOG = """== stage build (timeout 110s): bash -c build
== stage tests (timeout 150s): python3 -m pytest tests/kernels/test_branch_triton.py
....F...
=========================== short test summary info ============================
FAILED tests/kernels/test_branch_triton.py::test_gpu_opcheck[None-torch.float64] - AssertionError: x
ERROR tests/algorithms/engine/test_conv_gemm.py::test_e2e[cuda] - RuntimeError: y
SKIPPED [12] tests/kernels/test_cuda_paths_triton.py:101: interpreter only
=========== 1 failed, 1200 passed, 30 skipped, 2 errors in 140.1s ===========
== stage gpu_factorized (timeout 40s): python3 benchmarks/gpu_factorized.py --quick
"""
FIXED_FAILED = ("FAILED tests/kernels/test_out_aliasing_triton.py::test_branch_aggregate_out_overlapping_inputs[3] "
                "- ValueError: alpha must be on branch_params' device cuda:0, got cpu\n")
# a log from before the 10 joined the test stage: a stage of their own
OLD_LOG = """== stage tests_fixed (timeout 60s): python3 -m pytest tests/kernels/test_aggregate_triton.py::x
..........
10 passed in 12.50s
""" + LOG


def test_the_gpu_tests_of_a_gpu_check_log():
    assert gt.stage_results(LOG) == {"build": {}, "tests": {"failed": 1, "passed": 1200, "skipped": 30, "error": 2},
                                     "gpu_factorized": {}}
    assert gt.stage_failures(LOG, "tests") == [
        "tests/kernels/test_branch_triton.py::test_gpu_opcheck[None-torch.float64]",
        "tests/algorithms/engine/test_conv_gemm.py::test_e2e[cuda]"]
    fixed, tests = gt.test_targets(LOG)
    assert (fixed.met, fixed.figure) == (True, "none failed in the test stage")  # others failed: not theirs
    assert tests.met is False and tests.figure == "1 failed, 1200 passed, 30 skipped, 2 error"
    assert gt.test_targets(LOG.replace("1 failed, ", "").replace(", 2 errors", ""))[1].met is True
    # one of the 10 named as failed
    fixed = gt.test_targets(LOG.replace("SKIPPED [12]", FIXED_FAILED + "SKIPPED [12]"))[0]
    assert fixed.met is False and fixed.figure.startswith("1 failed in the test stage: tests/kernels/test_out_aliasing")
    # a stage cut off before its summary, and one not run
    cut = LOG.split("=========================== short")[0]
    fixed, tests = gt.test_targets(cut)
    assert (fixed.met, fixed.figure) == (None, "none failed before the test stage stopped")
    assert (tests.met, tests.figure) == (None, "no pytest summary (timed out or crashed)")
    fixed, tests = gt.test_targets(cut.replace("== stage tests ", "== stage other "))
    assert (fixed.met, fixed.figure) == (None, "not run") and (tests.met, tests.figure) == (None, "not run")


def test_the_fixed_tests_of_an_older_log_come_from_their_own_stage():
    assert gt.stage_results(OLD_LOG)["tests_fixed"] == {"passed": 10}
    fixed = gt.test_targets(OLD_LOG)[0]
    assert (fixed.met, fixed.figure) == (True, "10 passed")
    assert gt.test_targets(OLD_LOG.replace("10 passed", "9 passed"))[0].met is False  # one of the 10 not run
    assert gt.test_targets(OLD_LOG.replace("10 passed", "1 failed, 9 passed"))[0].met is False


INTERRUPTED = """== stage tests (timeout 96s): python3 -m pytest tests/kernels/test_branch_triton.py
.....
============================= slowest 15 durations ==============================
31.02s call     tests/kernels/test_factorized_triton.py::test_gradgradcheck
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
/opt/venv/lib/python3.12/site-packages/xdist/dsession.py:161: KeyboardInterrupt
(to show a full traceback on KeyboardInterrupt use --full-trace)
900 passed, 12 skipped in 95.87s
== stage gpu_factorized (timeout 40s): python3 benchmarks/gpu_factorized.py --quick
"""


def test_a_test_stage_stopped_at_its_cap_is_not_read_as_passing():
    """gpu_check.sh stops a stage with SIGINT at its cap, and pytest prints its counts so far:
    no failure among them is not a pass (not measured); a failure among them is a miss."""
    assert gt.stage_results(INTERRUPTED)["tests"] == {"passed": 900, "skipped": 12, "interrupted": 1}
    tests = gt.test_targets(INTERRUPTED)[1]
    assert (tests.met, tests.figure) == (None, "stopped at its cap after 900 passed, 12 skipped")
    tests = gt.test_targets(INTERRUPTED.replace("900 passed", "2 failed, 898 passed"))[1]
    assert tests.met is False and tests.verdict == "MISSED"
    # the interrupt belongs to its stage only
    assert gt.stage_results(LOG + INTERRUPTED.replace("== stage tests ", "== stage more "))["tests"] == {
        "failed": 1, "passed": 1200, "skipped": 30, "error": 2}


def test_reported_bf16_and_variants():
    lines = gt.reported(suites())
    assert lines == ["lenet5 batched+bf16: 5.0 ms a round against batched's 10.0 ms (2.00x)",
                     "bf16 autocast, LeNet-5 train accuracy: float32 0.8600, bf16 0.8500"]


def test_reported_bound_of_batching():
    """The one-model rows say whether a batched executor on the same kernels can reach the target."""
    data = suites()
    data["executor"]["rows"] += [
        {"job": "lenet5", "executor": "one-model", "round_s": 0.004, "batch": 1280, "speedup_vs_sequential": 12.5},
        {"job": "resnet9-factorized", "executor": "one-model", "round_s": 0.2, "batch": 2560,
         "speedup_vs_sequential": 1.4},
        {"job": "resnet9-factorized", "executor": "one-model+bf16", "error": "RuntimeError: out of memory"}]
    lines = gt.reported(data)
    assert ("lenet5 one-model (one model, batch 1280, the round's samples): 4.0 ms a round, 12.50x sequential: "
            "a batched executor on these kernels can reach 10x") in lines
    assert ("resnet9-factorized one-model (one model, batch 2560, the round's samples): 200.0 ms a round, 1.40x "
            "sequential: a batched executor on these kernels cannot reach 3x") in lines
    assert not any("one-model+bf16" in line for line in lines)  # a failed bound says nothing


def test_reported_similarity_paths():
    """gpu_similarity.py times float32 shapes on both CUDA paths: which one wins is reported
    (rows without the other path, or where it was not timed, are not)."""
    data = suites()
    gemm = dict(kernel_row(0.4, 0.1, op="cosine"), clients=20, dim=65536, path="gemm", alt_path="triton",
                alt_ms=0.08)
    slow = dict(gemm, op="sqdist", alt_ms=0.5)
    untimed = dict(gemm, op="sqdist", dim=1000000, alt_ms=float("nan"))
    data["similarity"]["rows"] = [gemm, slow, untimed, kernel_row(1.0, 1.1, op="cosine")]
    lines = gt.reported(data)
    assert lines[:2] == [
        "similarity cosine K=20 D=65536: gemm 400.0 us, triton 80.0 us, eager 100.0 us "
        "(triton faster; 1.25x eager at best)",
        "similarity sqdist K=20 D=65536: gemm 400.0 us, triton 500.0 us, eager 100.0 us "
        "(gemm faster; 0.25x eager at best)"]
    assert lines[2].startswith("lenet5 batched+bf16")


def test_reported_aggregate_paths():
    """gpu_aggregate.py times the 3xTF32 dense kernel beside every case (and the sparse kernel's
    other step beside sparse ones): which one wins is reported, untimed ones are not."""
    data = suites(executor=None)
    dense = {"clients": 20, "params": 10**7, "density": 1.0, "fused_ms": 0.9, "eager_ms": 0.8,
             "dense_kernel_ms": 0.45, "blocked_ms": None}
    sparse = dict(dense, density=0.05, fused_ms=3.0, eager_ms=7.0, dense_kernel_ms=float("nan"), blocked_ms=4.0)
    data["aggregate"] = {"rows": [dense, sparse]}
    assert gt.reported(data) == [
        "aggregate K=20 P=10000000 density=1: served 900.0 us, 3xTF32 dense kernel 450.0 us, torch.mm 800.0 us "
        "(3xTF32 dense kernel faster; 1.78x torch.mm at best)",
        "aggregate K=20 P=10000000 density=0.05: served 3000.0 us, sparse kernel, 8 rows a step 4000.0 us, "
        "torch.mm 7000.0 us (the path that served faster; 2.33x torch.mm at best)"]


def test_reported_class_means_paths():
    data = suites(executor=None)
    data["aggregate"] = {"rows": []}
    data["branch_aggregate"] = {"rows": [
        {"op": "class_means", "shape": [100000, 256, 10], "fused_ms": 0.27, "eager_ms": 0.32, "segment_ms": 0.08},
        {"op": "class_means", "shape": [100000, 256, 100], "fused_ms": 0.41, "eager_ms": 0.32, "segment_ms": None},
        {"op": "aggregate", "shape": [20, 5, 10**6], "fused_ms": 0.2, "eager_ms": 0.15}]}
    assert gt.reported(data) == [
        "class_means N=100000 D=256 C=10: served 270.0 us, segment kernel 80.0 us, eager 320.0 us "
        "(the segment kernel faster; 4.00x eager at best)"]


def write(folder, data, slug=SLUG):
    for suite, payload in data.items():
        (folder / f"{suite}_gpu_{slug}.json").write_text(json.dumps(payload))


def test_main_reads_only_files_newer_than_the_stamp(tmp_path, capsys):
    """gpu_check.sh passes its stamp: a suite whose stage failed this run is not measured, not
    an older run's figures."""
    write(tmp_path, suites())
    stamp = tmp_path / "stamp"
    stamp.write_text("")
    old = time.time() - 100
    os.utime(stamp, (old, old))
    os.utime(tmp_path / f"executor_gpu_{SLUG}.json", (old - 10, old - 10))
    out = tmp_path / "targets.json"
    log = tmp_path / "gpu_check_quick.log"
    log.write_text(LOG)
    assert gt.main(["--results", str(tmp_path), "--device", SLUG, "--newer-than", str(stamp),
                    "--json", str(out), "--log", str(log)]) == 0
    text = capsys.readouterr().out
    assert f"== issue 30 targets on {SLUG} (12 of 16 met)" in text
    payload = json.loads(out.read_text())
    assert [t["verdict"] for t in payload["targets"]].count("not measured") == 3
    assert [t["verdict"] for t in payload["targets"][:2]] == ["met", "MISSED"]
    assert payload["dry_runs"] == [] and payload["reported"] == []


def test_launch_modes_say_which_suites_launched_directly():
    data = suites()
    assert gt.launch_modes(data) == ""  # no suite recorded it (results from before it was)
    data["factorized"]["machine"] = {"direct_launch": True}
    data["executor"]["machine"] = {"direct_launch": True}
    data["branch"]["machine"] = {"direct_launch": False}
    data["launch"]["machine"] = {"direct_launch": False}  # times both paths itself: left out
    assert gt.launch_modes(data) == "direct launches: on in executor, factorized; off in branch"
    data["branch"]["machine"]["direct_launch"] = True
    assert gt.launch_modes(data) == "direct launches: on in branch, executor, factorized"
    # the counts of the suites that recorded them, summed: whether the switch took effect
    data["factorized"]["machine"]["direct_launches"] = {"direct": 90, "through_triton": 10}
    data["executor"]["machine"]["direct_launches"] = {"direct": 0, "through_triton": 3}
    assert gt.launch_modes(data) == ("direct launches: on in branch, executor, factorized "
                                     "(90 launches direct, 13 through Triton)")


def test_main_prints_the_launch_modes(tmp_path, capsys):
    data = suites()
    for suite in ("factorized", "executor"):
        data[suite]["machine"] = {"direct_launch": True}
    write(tmp_path, data)
    out = tmp_path / "targets.json"
    assert gt.main(["--results", str(tmp_path), "--device", SLUG, "--json", str(out)]) == 0
    assert "   direct launches: on in executor, factorized\n" in capsys.readouterr().out
    assert json.loads(out.read_text())["launch_modes"] == "direct launches: on in executor, factorized"


def test_main_says_when_the_figures_are_a_dry_run(tmp_path, capsys):
    data = suites()
    data["launch"]["machine"] = {"dry_run": True}
    write(tmp_path, data)
    assert gt.main(["--results", str(tmp_path)]) == 0  # the one device there
    assert "dry runs (launch): tiny shapes on a CPU, their figures mean nothing" in capsys.readouterr().out
    data["executor"]["complete"] = False
    data["executor"].pop("table1")
    write(tmp_path, data)
    assert gt.main(["--results", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "incomplete (executor): the stage ended before its last job" in text
    assert re.search(r"Table 1 cell <= 300 s \(50 rounds\)\s+not measured", text)


def test_several_devices_take_each_suite_from_the_first_that_has_it(tmp_path):
    write(tmp_path, suites(executor=None), "kernels_dev")
    write(tmp_path, {"executor": suites()["executor"]}, "executor_dev")
    data = gt.load(tmp_path, ["kernels_dev", "executor_dev"])
    assert set(data) == set(gt.SUITES)


@pytest.mark.parametrize("args,message", [
    (["--results", "/nonexistent/folder"], "--results must be a folder"),
    (["--device", "nope"], "--device nope: no <suite>_gpu_<device>.json of it"),
    (["--newer-than", "/nonexistent/stamp", "--device", SLUG], "--newer-than must name an existing file"),
    (["--log", "/nonexistent/log", "--device", SLUG], "--log must name a gpu_check.sh log file"),
])
def test_bad_arguments_get_one_line(tmp_path, capsys, args, message):
    write(tmp_path, suites())
    if "--results" not in args:
        args = [*args, "--results", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        gt.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_two_devices_without_device_named_are_refused(tmp_path, capsys, monkeypatch):
    write(tmp_path, suites(), "one")
    write(tmp_path, suites(), "two")
    monkeypatch.setattr(gt, "_cuda_slug", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        gt.main(["--results", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--device must name one of the devices with results in {tmp_path}: one, two" in capsys.readouterr().err


def test_the_shared_branch_results_are_not_a_device(tmp_path):
    write(tmp_path, suites())
    (tmp_path / f"branch_gpu_shared_{SLUG}.json").write_text("{}")
    (tmp_path / "notes_gpu_x.json").write_text("{}")
    assert gt.result_slugs(tmp_path) == [SLUG]


@pytest.mark.parametrize("slug", gt.result_slugs(gt.RESULTS))
def test_the_committed_results_of_each_device(slug, capsys):
    """Every committed GPU run reads: each target gets a verdict and a figure where measured."""
    assert gt.main(["--device", slug]) == 0
    targets = gt.all_targets(gt.load(gt.RESULTS, [slug]))
    assert all(t.figure != "-" for t in targets if t.met is not None)
    assert sum(t.met is not None for t in targets) >= 1
    for log in gt.RESULTS.glob(f"gpu_check_quick_{slug}_*.log"):  # the logs of its runs read too
        assert len(gt.test_targets(log.read_text(errors="replace"))) == 2


def test_a_failed_executor_row_is_missed_with_its_error():
    """A batched row that failed (or whose sequential row failed: no speed-up) is a miss naming
    why, and a failed variant is reported as failed, not as a time."""
    data = suites()
    data["executor"]["rows"][2] = {"job": "resnet9-factorized", "executor": "batched",
                                   "error": "RuntimeError: Expected running_mean to have type BFloat16"}
    data["executor"]["rows"][0]["speedup_vs_sequential"] = None
    data["executor"]["rows"].append({"job": "lenet5", "executor": "batched+gemm-conv", "error": "OutOfMemoryError: x"})
    targets = verdicts(data)
    resnet = targets["executor: resnet9-factorized batched >= 3x sequential"]
    assert resnet.met is False and "Expected running_mean" in resnet.figure
    lenet = targets["executor: lenet5 batched >= 10x sequential"]
    assert lenet.met is False and "sequential executor's row failed" in lenet.figure
    assert "lenet5 batched+gemm-conv: failed: OutOfMemoryError: x" in gt.reported(data)

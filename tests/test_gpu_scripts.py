"""The GPU session's scripts work before a GPU is spent on them (issue 30, items 1 and 5):

* ``benchmarks/gpu_launch.py --dry-run`` (Triton interpreter): every case is built, checked
  against float64, and its recorded launches replay bare with the same effect;
* ``scripts/gpu_check.sh quick``: its stages, flags, timeouts, budget and files under $OUT,
  with a stand-in python that records what it is asked to run (seconds, no GPU);
* ``scripts/gpu_check.sh dry-run``: its stages and their dry-run forms, with the stand-in.

Each dry-run command that ``gpu_check.sh dry-run`` chains also runs for real in CI on its own:
``tests/kernels/test_gpu_benchmarks.py`` (the five kernel benchmarks and ``gpu_branch
--shared``), ``tests/algorithms/engine/test_gpu_executor_script.py``, ``test_launch_dry_run``
here, and the suite's collection in every pytest phase; so CI does not run the chain a second
time (73 s on 2 cores: ``bash scripts/gpu_check.sh dry-run`` before a GPU session).

    TRITON_INTERPRET=1 python -m pytest tests/test_gpu_scripts.py -q
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.heavy(seconds=15)  # scheduled first under xdist (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
KERNEL_BENCHMARKS = ["gpu_factorized", "gpu_branch", "gpu_similarity", "gpu_aggregate", "gpu_branch_aggregate"]


# ---------------------------------------------------------------- gpu_launch.py

@pytest.mark.triton_interpret
@pytest.mark.skipif(not INTERPRET, reason="--dry-run runs in the Triton interpreter (TRITON_INTERPRET=1)")
def test_launch_dry_run(tmp_path, capsys):
    pytest.importorskip("triton")
    from benchmarks import gpu_launch

    path = tmp_path / "launch.json"
    assert gpu_launch.main(["--dry-run", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out and "cases within 25 us" in out
    payload = json.loads(path.read_text())
    assert payload["suite"] == "benchmarks/gpu_launch.py" and payload["machine"]["dry_run"] is True
    rows = payload["rows"]
    ops = {r["op"] for r in rows}
    assert {"factorized_weight", "factorized_weight backward", "soft_threshold_", "branch_combine",
            "branch_combine backward", "project_simplex_", "weighted_average", "pairwise_cosine",
            "pairwise_sqdist", "similarity_weights", "branch_aggregate", "class_means"} <= ops
    for r in rows:
        assert r["max_abs_err"] < 1e-1 and r["public_host_us"] > 0 and r["bare_host_us"] > 0
        assert r["direct_host_us"] > 0 and "within_target_direct" in r  # timed again with direct launches on
        assert r["path"].startswith(("triton (", "library (torch.mm)")), r
    # the routed paths: dense weighted_average and long float32 rows take cuBLAS, the rest Triton
    paths = {(r["op"], r["shape"]): r["path"] for r in rows}
    # (with the counting launches of its checks: the weights', then the product's row 0)
    assert paths[("weighted_average", "K=20 P=257 dense")] == "library (torch.mm) + triton (2 launches)"
    # the backward ops called as ops carry the target; through autograd.grad they are counted apart
    via = {r["op"]: r["via"] for r in rows}
    assert via["factorized_weight_backward"] == via["branch_combine_backward"] == "op"
    assert via["factorized_weight backward"] == via["branch_combine backward"] == "autograd"
    assert payload["summary"]["by_via"]["autograd"]["cases"] == 2
    # the compaction (with the weights' stats), then the gather
    assert paths[("weighted_average", "K=20 P=257 density~0.05")] == "triton (2 launches)"
    # the GEMM form: cuBLAS's product, then its epilogue
    assert paths[("pairwise_cosine", "K=20 D=65536")] == "library (torch.mm) + triton (1 launch)"
    assert paths[("pairwise_cosine", "K=20 D=33")] == "triton (3 launches)"
    assert payload["summary"]["cases"] == len(rows)
    # the routing and the launch patches are undone
    from pfl_kernels.triton import aggregate as ta, factorized as tf
    assert ta._GEMM_DEVICES == ("cuda",) and tf._launch.__module__ == "pfl_kernels.triton.factorized"


def test_launch_host_mode_times_every_op_with_launches_skipped(tmp_path, capsys):
    """``--host`` (a CPU, no interpreter): every op not served by a library GEMM gets a host
    time, and the stubs, routing and CPU registrations are undone after."""
    pytest.importorskip("triton")
    from benchmarks import gpu_launch

    from pfl_kernels.ops import _eager

    path = tmp_path / "host.json"
    threads, bypass = torch.get_num_threads(), _eager.ENABLED
    assert gpu_launch.main(["--host", "--dry-run", "--json", str(path)]) == 0
    assert torch.get_num_threads() == threads  # the process's setting is left as it was
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} >= {"factorized_weight", "factorized_weight backward", "factorized_weight_backward",
                                       "soft_threshold_", "branch_combine", "branch_combine_backward",
                                       "project_simplex_", "similarity_weights"}
    assert all(r["host_us"] > 0 and r["through_dispatcher_us"] > 0 and r["emulated_us"] >= 0 for r in rows)
    assert _eager.ENABLED == bypass and not any(device == "cpu" for _, device in _eager.KERNELS)  # undone after
    # the sparse weighted_average reads its compaction kernel's counts: that stand-in is timed apart
    assert [r["emulated_us"] > 0 for r in rows if r["op"] == "weighted_average"] == [True]
    assert "skipped: served by a library GEMM" in capsys.readouterr().out
    from pfl_kernels.ops import factorized_weight
    from pfl_kernels.triton import aggregate as ta, factorized as tf
    assert ta._GEMM_DEVICES == ("cuda",) and tf._launch.__module__ == "pfl_kernels.triton.factorized"
    u, v = torch.randn(4, 1), torch.randn(1, 6)
    assert torch.allclose(factorized_weight(u, v, shape=[6, 4], layout="linear"), (u @ v).t())


def test_launch_refuses_without_a_device(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is there")
    from benchmarks import gpu_launch

    assert gpu_launch.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


# ---------------------------------------------------------------- gpu_check.sh, with a stand-in python

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$* | TRITON_INTERPRET=${TRITON_INTERPRET:-} | SKIP=${PFL_KERNELS_SKIP_EXTENSION:-} |" \
  "DIRECT=${PFL_KERNELS_DIRECT_LAUNCH:-}" >> "$FAKE_LOG"
if [ -n "${FAKE_TORCH:-}" ] && [[ "$*" == *"torch.__version__"* ]]; then echo "$FAKE_TORCH"; fi
if [ -n "${FAKE_SLOW:-}" ] && [[ "$*" == *"$FAKE_SLOW"* ]]; then sleep 20; fi
if [ -n "${FAKE_PYTEST_CUT:-}" ] && [[ "$*" == *"$FAKE_PYTEST_CUT"* ]]; then  # as pytest does on SIGINT
  # the sleep is killed with it: left behind, it would hold the stage's pipe (tee) open for 20 s
  trap 'kill $!; echo "!!!!!! KeyboardInterrupt !!!!!!"; echo "3 passed, 1 skipped in 1.00s"; exit 2' INT
  sleep 20 & wait
fi
if [ -n "${FAKE_FAIL:-}" ] && [[ "$*" == *"$FAKE_FAIL"* ]]; then exit 3; fi
exit 0
"""


def run_check(tmp_path, stage, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    calls = tmp_path / "calls.log"
    calls.write_text("")
    full_env = {**os.environ, "PYTHON": str(fake), "OUT": str(out), "FAKE_LOG": str(calls),
                "TRITON_INTERPRET": "", "GPU_CHECK_PREBUILT": str(tmp_path / "no-prebuilt"), **env}
    proc = subprocess.run(["bash", str(SCRIPT), stage], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=120)
    return proc, calls.read_text().splitlines(), out


def test_quick_runs_every_stage_in_order(tmp_path):
    proc, calls, out = run_check(tmp_path, "quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any("-m pip install -q --no-build-isolation --no-deps -e ." in c for c in calls)
    tests = [c for c in calls if c.startswith("-m pytest")]
    # one test stage: the GPU test files with xdist, the 10 tests that failed on the H200 among
    # them, every failure named in its summary (gpu_targets.py reads their verdict there)
    assert len(tests) == 1 and " -n " in tests[0] and '-m not slow' in tests[0] and " -rfEs " in tests[0]
    assert "tests/kernels/test_aggregate_triton.py" in tests[0] and "tests/kernels/test_aggregate.py" not in tests[0]
    assert "tests/kernels/test_out_aliasing_triton.py" in tests[0]
    # the tests and, once gpu_launch (which times both paths itself) has passed, the benchmarks
    # run with direct launches on (the default, set explicitly), so the tests check the path
    # that is timed
    assert tests[0].endswith("| DIRECT=1") and "tests/kernels/test_direct_launch.py" in tests[0]
    by_script = {c.split()[0]: c for c in calls if c.startswith("benchmarks/")}
    assert all(by_script[f"benchmarks/{s}.py"].endswith("| DIRECT=1") for s in [*KERNEL_BENCHMARKS, "gpu_executor"])
    assert by_script["benchmarks/gpu_launch.py"].endswith("| DIRECT=")
    scripts = [c.split()[0] for c in calls if c.startswith("benchmarks/")]
    assert scripts == ["benchmarks/gpu_launch.py"] + [f"benchmarks/{s}.py" for s in KERNEL_BENCHMARKS] + [
        "benchmarks/gpu_executor.py", "benchmarks/gpu_targets.py"]
    # the test stage last (on what the measurements left), then the verdict
    order = [i for i, c in enumerate(calls) if c.startswith(("-m pytest", "benchmarks/"))]
    kinds = [calls[i].split()[0] if calls[i].startswith("benchmarks/") else "pytest" for i in order]
    assert kinds[-2:] == ["pytest", "benchmarks/gpu_targets.py"] and kinds.count("pytest") == 1
    measuring, verdict = [c for c in calls if c.startswith("benchmarks/")][:-1], calls[-1]
    assert all("--quick" in c and "--dry-run" not in c for c in measuring)
    # the verdict reads this run's JSON only (not an older run's, where a stage failed)
    assert verdict.startswith("benchmarks/gpu_targets.py --newer-than ") and "--log " in verdict
    log = (out / "gpu_check_quick.log").read_text()
    for name in ["build", "tests", *KERNEL_BENCHMARKS, "gpu_launch", "gpu_executor"]:
        assert f"== stage {name} (timeout " in log and f"   {name}: ok" in log
    assert "   gpu_targets: ok" in log
    assert len(list(out.iterdir())) <= 8


def _prebuilt(tmp_path, torch_version):
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    (folder / "_C.abi3.so").write_bytes(b"stand-in")
    sources = subprocess.run(["bash", str(ROOT / "scripts/extension_hash.sh")], capture_output=True, text=True,
                             check=True).stdout.strip()
    (folder / "stamp").write_text(f"{sources} {torch_version}\n")
    return folder


def test_a_prebuilt_extension_of_these_sources_and_this_torch_is_installed_not_compiled(tmp_path):
    """gpu_prebuild.sh's extension, carried to the GPU machine: copied into the package, which
    pip installs without compiling (the H100's compile took 64 s of the 6 minutes)."""
    folder = _prebuilt(tmp_path, "2.11.0+cu130")
    proc, calls, out = run_check(tmp_path, "quick", GPU_CHECK_PREBUILT=str(folder), FAKE_TORCH="2.11.0+cu130")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [copy] = [c for c in calls if "shutil.copy2" in c]
    assert f"{folder}/_C.abi3.so pfl_kernels/_C.abi3.so" in copy
    [install] = [c for c in calls if "pip install" in c]
    assert "| SKIP=1 |" in install and calls.index(copy) < calls.index(install)
    log = (out / "gpu_check_quick.log").read_text()
    assert f"build: not compiled: {folder}/_C.abi3.so was built from these sources against torch 2.11.0+cu130" in log
    assert "   build: ok" in log


@pytest.mark.parametrize("change", ["torch", "sources"])
def test_a_prebuilt_extension_of_another_torch_or_other_sources_is_not_used(tmp_path, change):
    folder = _prebuilt(tmp_path, "2.11.0+cu130")
    if change == "sources":
        stamp = (folder / "stamp").read_text()
        (folder / "stamp").write_text("0" * 64 + stamp[64:])
    machine_torch = "2.13.0+cu130" if change == "torch" else "2.11.0+cu130"
    proc, calls, out = run_check(tmp_path, "quick", GPU_CHECK_PREBUILT=str(folder), FAKE_TORCH=machine_torch)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any("shutil.copy2" in c for c in calls)
    [install] = [c for c in calls if "pip install" in c]
    assert "| SKIP= |" in install  # compiled, as without a prebuilt extension


def test_gpu_tests_runs_quicks_test_stage_alone(tmp_path):
    """The second GPU call where quick's test stage was cut: the C++ CPU kernels' test files
    that crashed on the H100 image in one process (faulthandler, first failure), with the
    machine's compiler and CPU in the log, then the GPU test files as quick runs them (xdist,
    direct launches on), nothing else."""
    proc, calls, out = run_check(tmp_path, "gpu-tests", PFL_KERNELS_DIRECT_LAUNCH="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any("pip install" in c for c in calls)  # the extension imports: no rebuild
    assert not any(c.startswith("benchmarks/") for c in calls)
    [crash] = [c for c in calls if c.startswith("-X faulthandler -m pytest")]
    assert "tests/kernels/test_similarity.py" in crash and "-p no:xdist -x" in crash and " -n " not in crash
    [tests] = [c for c in calls if c.startswith("-m pytest")]
    assert calls.index(crash) < calls.index(tests)
    assert " -n " in tests and "-m not slow" in tests and "--durations=15" in tests and tests.endswith("| DIRECT=1")
    assert "tests/kernels/test_direct_launch.py" in tests
    log = (out / "gpu_check_gpu-tests.log").read_text()
    assert "   cpu_kernels: ok" in log and "cores " in log
    assert "tests_fixed" not in log and "   tests: ok" in log and re.search(r"== stage tests \(timeout 2\d\ds\)", log)


def test_a_stage_that_hangs_or_fails_is_reported_and_the_rest_still_runs(tmp_path):
    proc, calls, out = run_check(tmp_path, "quick", FAKE_SLOW="gpu_launch.py", FAKE_FAIL="gpu_similarity.py",
                                 GPU_CHECK_CAP_LAUNCH="1")
    assert proc.returncode == 1
    log = (out / "gpu_check_quick.log").read_text()
    assert "gpu_launch: TIMED OUT after 1s" in log and "gpu_similarity: FAILED (exit 3" in log
    assert "gpu_executor: ok" in log and any(c.startswith("benchmarks/gpu_executor.py") for c in calls)


def test_the_benchmarks_launch_directly_only_after_gpu_launch_passed(tmp_path):
    """gpu_launch checks every op's direct launches against float64: where it fails, the
    benchmarks keep Triton's path (no figure lost to a direct launch that breaks on this GPU);
    the test stage checks direct launches whatever it said."""
    proc, calls, out = run_check(tmp_path, "quick", FAKE_FAIL="gpu_launch.py", PFL_KERNELS_DIRECT_LAUNCH="1")
    assert proc.returncode == 1
    by_script = {c.split()[0]: c for c in calls if c.startswith("benchmarks/")}
    assert all(by_script[f"benchmarks/{s}.py"].endswith("| DIRECT=0") for s in [*KERNEL_BENCHMARKS, "gpu_executor"])
    assert [c for c in calls if c.startswith("-m pytest")][-1].endswith("| DIRECT=1")
    log = (out / "gpu_check_quick.log").read_text()
    assert "direct launches stay off for the benchmarks: gpu_launch did not pass" in log
    assert "   gpu_launch: FAILED (exit 3" in log and "   gpu_executor: ok" in log


def test_a_test_stage_at_its_cap_is_interrupted_and_reports_what_ran(tmp_path):
    """At its cap a stage gets SIGINT (pytest then prints its counts so far), not TERM."""
    proc, calls, out = run_check(tmp_path, "quick", FAKE_PYTEST_CUT="-m not slow", GPU_CHECK_CAP_TESTS="1")
    assert proc.returncode == 1
    log = (out / "gpu_check_quick.log").read_text()
    assert "3 passed, 1 skipped in 1.00s" in log and "   tests: TIMED OUT after 1s" in log
    assert "   gpu_executor: ok" in log


NO_FLOORS = {f"GPU_CHECK_FLOOR_{stage}": "0" for stage in ("BUILD", "TESTS", "BENCH", "LAUNCH", "EXECUTOR")}


def test_the_budget_caps_every_stage(tmp_path):
    """A 6 s budget and no floors: the slow build stage takes it all, and what is left is skipped."""
    proc, calls, out = run_check(tmp_path, "quick", FAKE_SLOW="pip install", GPU_CHECK_BUDGET_S="6", **NO_FLOORS)
    assert proc.returncode == 1
    log = (out / "gpu_check_quick.log").read_text()
    assert "build: TIMED OUT after 6s" in log and "gpu_executor: skipped (budget spent)" in log
    assert "gpu_targets: ok" in log  # it reads files only: it runs when the budget is spent


def test_a_slow_stage_leaves_the_later_stages_their_floors(tmp_path):
    """A 14 s budget with 8 s held back for the later stages (7 s of it the executor's, 1 s the
    tests'): the slow build is cut at 6 s, the stages left less than 5 s are skipped, the
    executor still runs, and the test stage, last, gets what the executor left."""
    floors = dict(NO_FLOORS, GPU_CHECK_FLOOR_BUILD="1", GPU_CHECK_FLOOR_TESTS="1", GPU_CHECK_FLOOR_EXECUTOR="7")
    proc, calls, out = run_check(tmp_path, "quick", FAKE_SLOW="pip install", GPU_CHECK_BUDGET_S="14", **floors)
    assert proc.returncode == 1
    log = (out / "gpu_check_quick.log").read_text()
    assert "build: TIMED OUT after 6s" in log and "gpu_launch: skipped (budget spent)" in log
    assert "gpu_executor: ok" in log and any(c.startswith("benchmarks/gpu_executor.py") for c in calls)
    assert re.search(r"== stage tests \(timeout [5-8]s\)", log) and "   tests: ok" in log


def test_floors_beyond_the_budget_are_refused(tmp_path):
    proc, calls, out = run_check(tmp_path, "quick", GPU_CHECK_BUDGET_S="100")
    assert proc.returncode == 2 and "GPU_CHECK_BUDGET_S=100" in proc.stderr and calls == []


def test_dry_run_runs_every_stage_in_its_dry_run_form(tmp_path):
    proc, calls, out = run_check(tmp_path, "dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any("pip install" in c for c in calls)
    assert any(c.startswith("-m pytest tests") and "--collect-only" in c and "-p xdist" in c for c in calls)
    bench = [c for c in calls if c.startswith("benchmarks/")]
    assert [c.split()[0] for c in bench] == [f"benchmarks/{s}.py" for s in KERNEL_BENCHMARKS] + [
        "benchmarks/gpu_branch.py", "benchmarks/gpu_launch.py", "benchmarks/gpu_executor.py",
        "benchmarks/gpu_targets.py"]
    assert all("--dry-run" in c and "| TRITON_INTERPRET=1 |" in c for c in bench[:-1])
    assert "pfl_gpu_dry_run --device dry_run_triton_interpreter_on_cpu,dry_run_cpu" in bench[-1]


@pytest.mark.parametrize("breaks,stage", [("gpu_launch.py", "gpu_launch"), ("import setuptools", "build"),
                                          ("--collect-only", "tests")])
def test_dry_run_fails_when_a_stage_would_break(tmp_path, breaks, stage):
    proc, _, out = run_check(tmp_path, "dry-run", FAKE_FAIL=breaks)
    assert proc.returncode == 1
    assert f"   {stage}: FAILED" in (out / "gpu_check_dry-run.log").read_text()


def test_quick_reports_a_failed_build(tmp_path):
    proc, calls, out = run_check(tmp_path, "quick", FAKE_FAIL="import pfl_kernels._C")
    assert proc.returncode == 1
    assert "   build: FAILED" in (out / "gpu_check_quick.log").read_text()
    assert any(c.startswith("benchmarks/gpu_executor.py") for c in calls)  # the rest still ran


def test_unknown_stage():
    proc = subprocess.run(["bash", str(SCRIPT), "nope"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "quick" in proc.stderr


def test_launch_host_dry_run_never_writes_the_committed_results(monkeypatch, tmp_path):
    """A dry run's figures (2 calls) mean nothing: without --json it writes to the dry-run
    folder, not over benchmarks/results/launch_host_cpu.json."""
    pytest.importorskip("triton")
    from benchmarks import _gpu_common as common, gpu_launch

    monkeypatch.setattr(common, "DRY_RUN_RESULTS", tmp_path)
    committed = common.RESULTS / "launch_host_cpu.json"
    before = committed.read_bytes() if committed.exists() else None
    assert gpu_launch.main(["--host", "--dry-run"]) == 0
    assert (tmp_path / "launch_host_cpu.json").exists()
    assert (committed.read_bytes() if committed.exists() else None) == before


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="measures compiled launches")
def test_launch_python_times_both_launch_paths_and_restores_everything(tmp_path):
    """``benchmarks/launch_python.py``: each recorded launch timed through Triton's path and
    directly, with a stand-in driver that is gone afterwards (no GPU touched)."""
    pytest.importorskip("triton")
    from benchmarks import launch_python
    from pfl_kernels.triton import _direct
    from pfl_kernels.triton import factorized as tf

    before = (_direct.ENABLED, _direct.REASON, dict(_direct._LAUNCHERS), torch.get_num_threads(),
              getattr(torch._C, "_cuda_getDevice", None))
    path = tmp_path / "lp.json"
    assert launch_python.main(["--calls", "5", "--repeats", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["launch"] for r in rows} >= {"factorized_weight", "factorized_weight_backward", "branch_combine"}
    assert all(r["triton_path_us"] > 0 and r["direct_us"] > 0 for r in rows)
    after = (_direct.ENABLED, _direct.REASON, dict(_direct._LAUNCHERS), torch.get_num_threads(),
             getattr(torch._C, "_cuda_getDevice", None))
    assert after == before
    assert not tf._factorized_weight_kernel.device_caches and "_do_compile" not in vars(tf._factorized_weight_kernel)


def test_launch_python_refuses_bad_counts(capsys):
    from benchmarks import launch_python

    with pytest.raises(SystemExit):
        launch_python.main(["--calls", "0"])
    assert "--calls must be >= 1, got 0" in capsys.readouterr().err


def _bash_array(script: str, name: str) -> list[str]:
    """The words of ``NAME=(...)`` in a script (comments dropped)."""
    import re

    body = re.search(rf"^{name}=\((.*?)\)", script, re.S | re.M).group(1)
    return [w for line in body.splitlines() for w in line.split("#")[0].split()]


def test_floor_phase_runs_every_file_the_gpu_check_runs():
    """The GPU machines' torch is 2.11, the floor's: each file of gpu_check.sh's GPU_TESTS is in
    the floor phase (its kernel files through tests/kernels), so a break on 2.11 shows on a CPU."""
    gpu = _bash_array((ROOT / "scripts/gpu_check.sh").read_text(), "GPU_TESTS")
    floor = _bash_array((ROOT / "scripts/test_floor.sh").read_text(), "FLOOR_TESTS")
    assert "tests/kernels/*_triton.py" in gpu and len(gpu) > 3
    covered = [f for f in gpu if f in floor or any(f.startswith(d + "/") for d in floor)]
    assert covered == gpu
    assert all((ROOT / f).exists() for f in floor)


def test_a_failing_other_path_costs_a_gpu_run_one_figure_not_its_suite(capsys):
    """time_patched's check raised out of the script, which writes its JSON at the end: one
    untried kernel failing on the GPU lost every figure of its suite.  On a GPU it is now one
    printed line and NaN (not timed); a dry run still raises, so CI sees the path fail."""
    from types import SimpleNamespace

    from benchmarks import _gpu_common as common

    module = SimpleNamespace(PATH="default")
    rt = common.Runtime.__new__(common.Runtime)
    rt.time = lambda fn: 1.5

    def wrong():
        raise AssertionError("max error 0.5 > 1e-05")

    for dry_run in (False, True):
        rt.dry_run = dry_run
        if dry_run:
            with pytest.raises(AssertionError, match="max error"):
                rt.time_patched(lambda: None, wrong, module, PATH="dense")
        else:
            assert math.isnan(rt.time_patched(lambda: None, wrong, module, PATH="dense"))
            out = capsys.readouterr().out
            assert "the other path (PATH='dense') failed, not timed: AssertionError: max error 0.5" in out
        assert module.PATH == "default"  # restored either way
    rt.dry_run = False
    assert rt.time_patched(lambda: None, lambda: None, module, PATH="dense") == 1.5

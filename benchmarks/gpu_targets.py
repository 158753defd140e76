"""Issue 30's GPU targets, each met or not, from one device's benchmark results.

    python benchmarks/gpu_targets.py [--device SLUG[,SLUG...]] [--results DIR] [--newer-than FILE]
                                     [--log GPU_CHECK_LOG] [--json PATH]

Reads ``<suite>_gpu_<SLUG>.json`` from ``benchmarks/results`` (``SLUG``: the device's name as
the GPU scripts write it, e.g. ``nvidia_h200``; default: the CUDA device here, else the only
one with results; given several, each suite's first found, as the dry runs' executor job
names its device apart; ``--newer-than``: only files written after FILE) and prints one
table: each target of issue 30 with its figure, whether it is met, and the suite it comes
from, then the figures it asks to be reported (bf16 autocast's speed and accuracy effect,
the GEMM convolutions).  ``scripts/gpu_check.sh quick`` runs it last, on that run's files, so
its log ends with the verdict; on a CPU it reads committed results.

A suite without results (not run, or its stage failed) leaves its targets "not measured".
Nothing is measured here: every figure is the suites' own, read from their rows.

Targets (issue 30):

* tests (from ``--log``, a ``gpu_check.sh quick`` log): the 10 GPU tests that failed on the
  H200 pass, and every test of the GPU test stage passes (run with direct launches on).
* launch: each public op's host time per call within 25 µs of the bare Triton launches of the
  same kernels (``gpu_launch.py``; rows called through autograd are counted apart, since the
  autograd engine's own time is in them); with direct launches too, where measured.
* calls: every op at least as fast as its eager composition, at every shape of the kernel
  suites (fused ÷ eager time ≥ 1.0; dense ``weighted_average`` against ``torch.mm``).
* dense ``weighted_average`` within 1.2× of ``torch.mm`` at the suite's targeted size
  (P = 10^7); sparse (density 0.05) at least 3× faster than dense mm at K = 100, P = 10^7.
* the largest factorized and branch cases at 70% or more of a device copy's bandwidth.
* the batched executor: LeNet-5 ≥ 10× the sequential executor, factorized ResNet-9 ≥ 3×,
  Factorized-FL's Table 1 cell ≤ 300 s for 50 rounds (projected by ``--quick``).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
SUITES = ("launch", "factorized", "branch", "similarity", "aggregate", "branch_aggregate", "executor")
LAUNCH_US = 25.0
CALL_SPEEDUP = 1.0
DENSE_OVER_MM = 1.2
SPARSE_SPEEDUP = 3.0
COPY_SHARE = 0.7
EXECUTOR_SPEEDUP = {"lenet5": 10.0, "resnet9-factorized": 3.0}
TABLE1_S = 300.0


@dataclass
class Target:
    name: str
    figure: str
    met: Optional[bool]  # None: not measured
    source: str

    @property
    def verdict(self) -> str:
        return "not measured" if self.met is None else ("met" if self.met else "MISSED")


def load(results: Path, slugs: Sequence[str], newer_than: Optional[float] = None) -> dict:
    """Each suite's JSON for the first device of ``slugs`` that has it (absent suites left out);
    ``newer_than`` (a time stamp): only files written after it (one run's, not older ones')."""
    found = {}
    for suite in SUITES:
        for slug in slugs:
            path = results / f"{suite}_gpu_{slug}.json"
            if path.is_file() and (newer_than is None or path.stat().st_mtime > newer_than):
                found[suite] = json.loads(path.read_text())
                break
    return found


def _shape(row: dict) -> str:
    keys = ("op", "shape", "clients", "branches", "dim", "params", "density", "direction", "layout", "via")
    return " ".join(f"{k}={row[k]}" if k not in ("op", "direction", "layout", "via") else str(row[k])
                    for k in keys if row.get(k) not in (None, ""))


def _missing(name: str, suite: str) -> Target:
    return Target(name, "-", None, f"{suite}_gpu (absent)")


def launch_targets(data: dict) -> list[Target]:
    """Host time per call of each public op, less its bare launches', against 25 µs."""
    name = f"launch: public op host time - bare launch <= {LAUNCH_US:g} us"
    if "launch" not in data:
        return [_missing(name, "launch")]
    rows = [r for r in data["launch"]["rows"] if r.get("via", "op") != "autograd"]
    autograd = [r for r in data["launch"]["rows"] if r.get("via") == "autograd"]
    targets = []
    for label, key in (("", "public_host_us"), (" (direct launches)", "direct_host_us")):
        measured = [r for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if not measured:
            if key == "public_host_us":
                targets.append(_missing(name, "launch"))
            continue
        over = {(r["op"], r["shape"]): r[key] - r["bare_host_us"] for r in measured}
        worst = max(over, key=over.get)
        within = sum(v <= LAUNCH_US for v in over.values())
        figure = f"{within}/{len(over)} within; worst {over[worst]:.1f} us ({' '.join(worst)})"
        if autograd and key == "public_host_us":
            figure += f"; {len(autograd)} autograd rows apart"
        targets.append(Target(name + label, figure, within == len(over), "launch_gpu"))
    return targets


def _speedup(row: dict) -> Optional[float]:
    value = row.get("speedup_vs_eager", row.get("speedup_vs_mm"))
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def call_targets(data: dict) -> list[Target]:
    """Every op >= 1.0x its eager composition at every shape, one line per kernel suite."""
    targets = []
    for suite in ("factorized", "branch", "similarity", "aggregate", "branch_aggregate"):
        name = f"calls: {suite} >= {CALL_SPEEDUP:g}x eager at every shape"
        if suite not in data:
            targets.append(_missing(name, suite))
            continue
        rows = [(r, _speedup(r)) for r in data[suite]["rows"]]
        rows = [(r, s) for r, s in rows if s is not None]
        if not rows:
            targets.append(_missing(name, suite))
            continue
        worst, speed = min(rows, key=lambda rs: rs[1])
        within = sum(s >= CALL_SPEEDUP for _, s in rows)
        targets.append(Target(name, f"{within}/{len(rows)}; worst {speed:.2f}x ({_shape(worst)})",
                              within == len(rows), f"{suite}_gpu"))
    return targets


def aggregate_targets(data: dict) -> list[Target]:
    """Dense weighted_average against torch.mm, and sparse against dense mm."""
    dense_name = f"weighted_average dense <= {DENSE_OVER_MM:g}x torch.mm (P = 10^7)"
    sparse_name = f"weighted_average sparse 0.05 >= {SPARSE_SPEEDUP:g}x dense mm (K = 100, P = 10^7)"
    if "aggregate" not in data:
        return [_missing(dense_name, "aggregate"), _missing(sparse_name, "aggregate")]
    rows = data["aggregate"]["rows"]
    targets = []
    dense = [r for r in rows if r.get("density") == 1.0 and r.get("targeted")]
    if dense:
        worst = max(dense, key=lambda r: r["fused_ms"] / r["eager_ms"])
        ratio = worst["fused_ms"] / worst["eager_ms"]
        targets.append(Target(dense_name, f"worst {ratio:.2f}x ({_shape(worst)})", ratio <= DENSE_OVER_MM,
                              "aggregate_gpu"))
    else:
        targets.append(_missing(dense_name, "aggregate"))
    sparse = [r for r in rows if r.get("density") == 0.05 and r.get("clients") == 100 and r.get("params") == 10 ** 7]
    if sparse:
        speed = sparse[0]["eager_ms"] / sparse[0]["fused_ms"]
        targets.append(Target(sparse_name, f"{speed:.2f}x", speed >= SPARSE_SPEEDUP, "aggregate_gpu"))
    else:
        targets.append(_missing(sparse_name, "aggregate"))
    return targets


def bandwidth_targets(data: dict) -> list[Target]:
    """The largest factorized and branch cases' share of a device copy's bandwidth."""
    targets = []
    for suite in ("factorized", "branch"):
        name = f"{suite}: largest case >= {COPY_SHARE:.0%} of copy bandwidth"
        if suite not in data:
            targets.append(_missing(name, suite))
            continue
        shares = {}
        for direction in ("forward", "backward"):
            rows = [r for r in data[suite]["rows"] if r.get("direction") == direction and r.get("fused_ms")]
            if rows:
                largest = max(rows, key=lambda r: r["bytes"])
                shares[direction] = (largest["copy_ms"] / largest["fused_ms"], largest)
        if not shares:
            targets.append(_missing(name, suite))
            continue
        figure = "; ".join(f"{d} {s:.0%} ({_shape(r)})" for d, (s, r) in shares.items())
        targets.append(Target(name, figure, all(s >= COPY_SHARE for s, _ in shares.values()), f"{suite}_gpu"))
    return targets


def executor_targets(data: dict) -> list[Target]:
    """The batched executor against the sequential one (both as a user runs them), and Table 1."""
    names = {job: f"executor: {job} batched >= {x:g}x sequential" for job, x in EXECUTOR_SPEEDUP.items()}
    table1_name = f"executor: Factorized-FL Table 1 cell <= {TABLE1_S:g} s (50 rounds)"
    if "executor" not in data:
        return [*(_missing(n, "executor") for n in names.values()), _missing(table1_name, "executor")]
    rows = data["executor"]["rows"]
    targets = []
    for job, goal in EXECUTOR_SPEEDUP.items():
        row = next((r for r in rows if r["job"] == job and r["executor"] == "batched"), None)
        if row is None:
            targets.append(_missing(names[job], "executor"))
            continue
        speed = row.get("speedup_vs_sequential")
        if "error" in row or speed is None:  # the batched row, or the sequential one it is against, failed
            why = row.get("error") or "the sequential executor's row failed"
            targets.append(Target(names[job], f"failed: {why[:120]}", False, "executor_gpu"))
            continue
        targets.append(Target(names[job], f"{speed:.2f}x ({row['round_s'] * 1e3:.1f} ms a round)", speed >= goal,
                              "executor_gpu"))
    table1 = data["executor"].get("table1")
    if table1:
        how = "projected from " if table1["rounds_run"] < table1["paper_rounds"] else ""
        targets.append(Target(table1_name, f"{table1['projected_s']:.0f} s ({how}{table1['rounds_run']} rounds)",
                              table1["projected_s"] <= TABLE1_S, "executor_gpu"))
    else:
        targets.append(_missing(table1_name, "executor"))
    return targets


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def reported(data: dict) -> list[str]:
    """What the issue asks to report besides its targets: each pairwise similarity shape's
    other CUDA path (the fused kernel or the GEMM form) against the one that served and eager,
    which says where ``cuda_pairwise_path`` should route; each weighted_average case's 3xTF32
    dense kernel (and the sparse kernel's other step) against the path that served and
    torch.mm, which says where ``ops.aggregate.cuda_path`` should route, and the same of each
    class_means case's segment kernel (``ops.class_means.cuda_path``); bf16 autocast's speed
    and accuracy, and each other batched variant against the plain batched executor."""
    lines = []
    for row in data.get("similarity", {}).get("rows", []):
        if row.get("alt_path") and row.get("alt_ms") == row.get("alt_ms"):  # NaN: not timed
            faster = row["alt_path"] if row["alt_ms"] < row["fused_ms"] else row["path"]
            lines.append(f"similarity {row['op']} K={row['clients']} D={row['dim']}: {row['path']} "
                         f"{row['fused_ms'] * 1e3:.1f} us, {row['alt_path']} {row['alt_ms'] * 1e3:.1f} us, eager "
                         f"{row['eager_ms'] * 1e3:.1f} us ({faster} faster; "
                         f"{row['eager_ms'] / min(row['fused_ms'], row['alt_ms']):.2f}x eager at best)")
    for row in data.get("aggregate", {}).get("rows", []):
        for key, name in (("dense_kernel_ms", "3xTF32 dense kernel"), ("blocked_ms", "sparse kernel, 8 rows a step")):
            alt = row.get(key)
            if alt is None or alt != alt:  # not timed (NaN or absent)
                continue
            faster = name if alt < row["fused_ms"] else "the path that served"
            lines.append(f"aggregate K={row['clients']} P={row['params']} density={row['density']:g}: served "
                         f"{row['fused_ms'] * 1e3:.1f} us, {name} {alt * 1e3:.1f} us, torch.mm "
                         f"{row['eager_ms'] * 1e3:.1f} us ({faster} faster; "
                         f"{row['eager_ms'] / min(row['fused_ms'], alt):.2f}x torch.mm at best)")
    for row in data.get("branch_aggregate", {}).get("rows", []):
        alt = row.get("segment_ms")
        if row.get("op") != "class_means" or alt is None or alt != alt:
            continue
        n, d, c = row["shape"]
        faster = "the segment kernel" if alt < row["fused_ms"] else "the path that served"
        lines.append(f"class_means N={n} D={d} C={c}: served {row['fused_ms'] * 1e3:.1f} us, segment kernel "
                     f"{alt * 1e3:.1f} us, eager {row['eager_ms'] * 1e3:.1f} us ({faster} faster; "
                     f"{row['eager_ms'] / min(row['fused_ms'], alt):.2f}x eager at best)")
    if "executor" not in data:
        return lines
    rows = data["executor"]["rows"]
    for job, target in EXECUTOR_SPEEDUP.items():
        base = next((r for r in rows if r["job"] == job and r["executor"] == "batched"), None)
        for row in rows:  # the bound of batching with the same kernels (gpu_executor.speed_job)
            if row["job"] == job and row["executor"].startswith("one-model") and "error" not in row:
                speedup = row.get("speedup_vs_sequential")
                lines.append(f"{job} {row['executor']} (one model, batch {row['batch']}, the round's samples): "
                             f"{row['round_s'] * 1e3:.1f} ms a round, {_ratio(speedup)}x sequential: a batched "
                             f"executor on these kernels {'can' if speedup and speedup >= target else 'cannot'} "
                             f"reach {target:g}x")
        for row in rows:
            if base and row["job"] == job and row["executor"].startswith("batched+"):
                if "error" in row or "error" in base:
                    lines.append(f"{job} {row['executor']}: failed: {(row.get('error') or base['error'])[:160]}")
                    continue
                lines.append(f"{job} {row['executor']}: {row['round_s'] * 1e3:.1f} ms a round against batched's "
                             f"{base['round_s'] * 1e3:.1f} ms ({base['round_s'] / row['round_s']:.2f}x)")
    accuracy = data["executor"].get("bf16_accuracy")
    if accuracy:
        lines.append(f"bf16 autocast, LeNet-5 train accuracy: float32 {accuracy['float32']:.4f}, "
                     f"bf16 {accuracy['bf16']:.4f}")
    return lines


FIXED_TESTS = 10  # the GPU tests that failed on the H200: one test and the 9 cases of another
FIXED_TEST_IDS = ("tests/kernels/test_aggregate_triton.py::test_gpu_opcheck_and_gradcheck",
                  "tests/kernels/test_out_aliasing_triton.py::test_branch_aggregate_out_overlapping_inputs")
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped)")


def stage_results(log: str) -> dict:
    """Each stage of a ``gpu_check.sh`` log -> the counts of its last pytest summary line
    ({'passed': n, 'failed': n, ...}; empty when it printed none: it crashed or was killed),
    with 'interrupted': 1 where pytest was stopped at the stage's cap (gpu_check.sh sends it
    SIGINT, and it prints the counts of the tests it ran by then)."""
    stages, name, interrupted = {}, None, set()
    for line in log.splitlines():
        if line.startswith("== stage "):
            name = line[len("== stage "):].split(" ", 1)[0].rstrip(":")
            stages[name] = {}
        elif name and "KeyboardInterrupt" in line and line.startswith("!"):
            interrupted.add(name)
        elif name and re.match(r"^=*\s*\d+ (passed|failed|errors?)", line):
            stages[name] = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
                            for n, kind in _PYTEST_COUNT.findall(line)}
    for name in interrupted:
        stages[name]["interrupted"] = 1
    return stages


def stage_failures(log: str, stage: str) -> list[str]:
    """The test ids a stage's short summary names as FAILED or ERROR (pytest's ``-rfE``)."""
    ids, name = [], None
    for line in log.splitlines():
        if line.startswith("== stage "):
            name = line[len("== stage "):].split(" ", 1)[0].rstrip(":")
        elif name == stage and line.startswith(("FAILED ", "ERROR ")):
            ids.append(line.split(" ", 1)[1].split(" - ", 1)[0].strip())
    return ids


def _fixed_tests_target(log: str, stages: dict) -> Target:
    """The 10 tests that failed on the H200.  Logs before they joined the test stage ran them in
    a stage of their own (``tests_fixed``): all 10 passed there.  Since, in the test stage: met
    when it ran to its summary with none of them named as failed or in error (it names every
    failure: ``-rfE``), missed when one is, not measured when it stopped first."""
    name = f"tests: the {FIXED_TESTS} that failed on the H200 pass"
    if "tests_fixed" in stages:
        counts = stages["tests_fixed"]
        if not counts or counts.get("interrupted"):
            return Target(name, "no pytest summary (timed out or crashed)", None, "gpu_check log")
        bad = counts.get("failed", 0) + counts.get("error", 0)
        figure = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        return Target(name, figure, bad == 0 and counts.get("passed", 0) >= FIXED_TESTS, "gpu_check log")
    counts = stages.get("tests")
    if counts is None:
        return Target(name, "not run", None, "gpu_check log")
    failed = [t for t in stage_failures(log, "tests") if t.startswith(FIXED_TEST_IDS)]
    if failed:
        return Target(name, f"{len(failed)} failed in the test stage: {failed[0]}", False, "gpu_check log")
    if not counts or counts.get("interrupted"):
        return Target(name, "none failed before the test stage stopped", None, "gpu_check log")
    return Target(name, "none failed in the test stage", True, "gpu_check log")


def test_targets(log: str) -> list[Target]:
    """The GPU tests of a ``gpu_check.sh quick`` log: the 10 that failed on the H200 pass, and
    the whole GPU test stage passes (with direct launches on, as that stage runs them)."""
    stages = stage_results(log)
    targets = [_fixed_tests_target(log, stages)]
    name = "tests: every GPU test passes (direct launches on)"
    counts = stages.get("tests")
    if not counts:
        why = "not run" if counts is None else "no pytest summary (timed out or crashed)"
        return [*targets, Target(name, why, None, "gpu_check log")]
    bad = counts.get("failed", 0) + counts.get("error", 0)
    figure = ", ".join(f"{n} {kind}" for kind, n in counts.items() if kind != "interrupted")
    if counts.get("interrupted"):
        # a failure among the tests that ran is a miss; no failure yet says nothing of the rest
        return [*targets, Target(name, f"stopped at its cap after {figure}", False if bad else None, "gpu_check log")]
    return [*targets, Target(name, figure, bad == 0 and counts.get("passed", 0) >= 1, "gpu_check log")]


def all_targets(data: dict, log: Optional[str] = None) -> list[Target]:
    """Every target from the suites' JSON (``data``) and, given a gpu_check log, its tests."""
    return [*(test_targets(log) if log is not None else []), *launch_targets(data), *call_targets(data),
            *aggregate_targets(data), *bandwidth_targets(data), *executor_targets(data)]


def result_slugs(results: Path) -> list[str]:
    """The devices with results of any suite in ``results`` (``gpu_branch.py --shared``'s
    ``branch_gpu_shared_<device>.json`` is not a suite here)."""
    return sorted({path.stem.split("_gpu_", 1)[1] for path in results.glob("*_gpu_*.json")
                   if path.stem.split("_gpu_", 1)[0] in SUITES and not path.stem.startswith("branch_gpu_shared_")})


def _cuda_slug() -> Optional[str]:
    """The CUDA device's name as the GPU scripts write it, None without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from benchmarks._gpu_common import sanitize

    return sanitize(torch.cuda.get_device_name())


def device_slugs(results: Path, given: Optional[str]) -> list[str]:
    """``given`` (comma-separated), else the CUDA device's, else the one device with results
    in ``results`` (ValueError when there are several or none)."""
    if given:
        return [slug.strip() for slug in given.split(",") if slug.strip()]
    cuda = _cuda_slug()
    if cuda:
        return [cuda]
    slugs = result_slugs(results)
    if len(slugs) != 1:
        raise ValueError(f"--device must name one of the devices with results in {results}: "
                         f"{', '.join(slugs) or 'none'}")
    return slugs


def launch_modes(data: dict) -> str:
    """Which suites' ops launched their Triton kernels directly (``machine.direct_launch``, the
    path that is the default and ``PFL_KERNELS_DIRECT_LAUNCH=0`` turns off) and which did not: a suite
    run before it was recorded is left out; empty where no suite says.  ``launch`` times both
    paths itself.  Where the suites counted their launches (``machine.direct_launches``), the
    sums say whether the switch took effect: launches made directly, and through Triton (each
    signature's first call)."""
    machines = {suite: d.get("machine", {}) for suite, d in data.items() if suite != "launch"}
    on = sorted(s for s, m in machines.items() if m.get("direct_launch") is True)
    off = sorted(s for s, m in machines.items() if m.get("direct_launch") is False)
    if not on and not off:
        return ""
    parts = ([f"on in {', '.join(on)}"] if on else []) + ([f"off in {', '.join(off)}"] if off else [])
    counted = [machines[s]["direct_launches"] for s in on if isinstance(machines[s].get("direct_launches"), dict)]
    if counted:  # what the switch did: launches made directly, and through Triton (first calls)
        direct = sum(c.get("direct", 0) for c in counted)
        through = sum(c.get("through_triton", 0) for c in counted)
        parts[0] += f" ({direct} launches direct, {through} through Triton)"
    return "direct launches: " + "; ".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", help="the device's name as in the results' file names (e.g. nvidia_h200)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the *_gpu_<device>.json files")
    parser.add_argument("--json", type=Path, help="also write the table here as JSON")
    parser.add_argument("--log", type=Path, help="a gpu_check.sh log: also its GPU tests' targets")
    parser.add_argument("--newer-than", type=Path, metavar="FILE",
                        help="read only results written after FILE was (gpu_check.sh: this run's, so a suite whose "
                             "stage failed is 'not measured', not an older run's figures)")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"--results must be a folder, got {args.results}")
    if args.log is not None and not args.log.is_file():
        parser.error(f"--log must name a gpu_check.sh log file, got {args.log}")
    if args.newer_than is not None and not args.newer_than.exists():
        parser.error(f"--newer-than must name an existing file, got {args.newer_than}")
    try:
        slugs = device_slugs(args.results, args.device)
    except ValueError as error:
        parser.error(str(error))
    data = load(args.results, slugs, args.newer_than.stat().st_mtime if args.newer_than else None)
    slug = ",".join(slugs)
    if not data:
        parser.error(f"--device {slug}: no <suite>_gpu_<device>.json of it in {args.results}")
    targets = all_targets(data, args.log.read_text(errors="replace") if args.log else None)
    width = max(len(t.name) for t in targets)
    dry = sorted(suite for suite, d in data.items() if d.get("machine", {}).get("dry_run"))
    print(f"== issue 30 targets on {slug} ({sum(t.met is True for t in targets)} of {len(targets)} met)")
    if dry:
        print(f"   dry runs ({', '.join(dry)}): tiny shapes on a CPU, their figures mean nothing")
    direct = launch_modes(data)
    if direct:
        print(f"   {direct}")
    cut = sorted(suite for suite, d in data.items() if d.get("complete") is False)
    if cut:
        print(f"   incomplete ({', '.join(cut)}): the stage ended before its last job; what it did not "
              f"write is not measured")
    for t in targets:
        print(f"{t.name:<{width}}  {t.verdict:<12}  {t.figure}  [{t.source}]")
    notes = reported(data)
    if notes:
        print("== reported")
        print("\n".join(notes))
    if args.json:
        args.json.write_text(json.dumps({"device": slug, "dry_runs": dry, "launch_modes": direct, "targets": [asdict(t) | {"verdict": t.verdict}
                                                                       for t in targets],
                                         "reported": notes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

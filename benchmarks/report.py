"""Run the CPU benchmarks of the factorized ops and layers and print their ratios.

    python benchmarks/report.py [--quick] [--json PATH] [--benchmark-json PATH]

Runs ``benchmarks/bench_factorized.py`` under pytest-benchmark in a child process (with
OMP_WAIT_POLICY=PASSIVE, so idle OpenMP threads do not spin on the 2 cores the pairs
share), pairs each measurement with its baseline and prints, per case and shape, the
two medians, their ratio and whether the target is met:

* reconstruct forward / backward: ratio = eager time / fused time (speed-up), target >= 2.0;
* layer fwd+bwd: ratio = factorized layer time / dense layer time (cost), target <= 1.10.

The table is also saved as JSON (default ``benchmarks/results/factorized_cpu.json``, or
``factorized_cpu_quick.json`` with --quick, which git ignores) with
the machine and the implementations that were active (``pfl_kernels.backend_info()`` of
the measuring process).  A missed target is reported, not an error: the exit status is 0
unless the benchmarks themselves fail.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
BENCH_FILE = "benchmarks/bench_factorized.py"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "factorized_cpu.json"
# Quick runs (the demo) go elsewhere, untracked, so they never overwrite the recorded full run.
QUICK_JSON = ROOT / "benchmarks" / "results" / "factorized_cpu_quick.json"


@dataclass(frozen=True)
class Case:
    """How the two sides of a case are compared."""

    title: str
    speedup: bool  # ratio = baseline / ours (higher is better); else ours / baseline (lower is better)
    target: float

    @property
    def ratio_definition(self) -> str:
        return "baseline / ours (speed-up)" if self.speedup else "ours / baseline (cost)"

    @property
    def target_text(self) -> str:
        return f"{'>=' if self.speedup else '<='} {self.target:.2f}"

    def ratio(self, ours_s: float, baseline_s: float) -> float:
        return baseline_s / ours_s if self.speedup else ours_s / baseline_s

    def met(self, ratio: float) -> bool:
        return ratio >= self.target if self.speedup else ratio <= self.target


# Keys are the ``case`` names of bench_factorized.py, in the order of the table.
CASES = {
    "reconstruct_forward": Case("reconstruct fwd", speedup=True, target=2.0),
    "reconstruct_backward": Case("reconstruct bwd", speedup=True, target=2.0),
    "layer_train_step": Case("layer fwd+bwd", speedup=False, target=1.10),
}


def run_benchmarks(raw_json: Path, quick: bool, storage: Path) -> int:
    """Run the benchmark file in a child pytest, writing pytest-benchmark's JSON to ``raw_json``.

    ``storage`` is a scratch folder for pytest-benchmark's run storage (nothing is saved
    there, but the plugin creates it, by default as .benchmarks/ in the repository).
    """
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PFL_BENCH_QUICK", None)
    if quick:
        env["PFL_BENCH_QUICK"] = "1"
    cmd = [sys.executable, "-m", "pytest", BENCH_FILE, "-q", "-p", "no:cacheprovider",
           "--benchmark-enable", "--benchmark-quiet", f"--benchmark-json={raw_json}",
           f"--benchmark-storage=file://{storage}"]
    print(f"$ {'PFL_BENCH_QUICK=1 ' if quick else ''}OMP_WAIT_POLICY=PASSIVE {' '.join(cmd[2:-2])}",
          flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _side(measurements: list[dict]) -> dict:
    """One side of a pair over its repeats: median of the per-repeat medians, worst spread."""
    stats = [m["stats"] for m in measurements]
    return {"impl": measurements[0]["extra_info"]["impl"],
            "median_s": _median([st["median"] for st in stats]),
            "medians_s": [st["median"] for st in stats],
            "max_rel_iqr": max(st["iqr"] / st["median"] for st in stats),
            "rounds": [st["rounds"] for st in stats],
            "iterations": [st["iterations"] for st in stats]}


def build_rows(raw: dict) -> list[dict]:
    """Pair the 'ours' and 'baseline' benchmarks of each (case, shape), in the suite's order.

    A side measured several times (repeats, spread over the run) counts the median of its
    per-repeat medians, so a burst of load from elsewhere that spoiled one repeat is
    outvoted; the ratio is that of the two sides' medians.  The per-repeat ratios (each
    of two measurements taken back to back) are kept to show how stable the ratio is.
    """
    found: dict[tuple[str, str], dict] = {}
    for bench in raw["benchmarks"]:
        info = bench["extra_info"]
        if info.get("case") not in CASES:
            continue
        entry = found.setdefault((info["case"], info["shape"]), {"info": info, "repeats": {}})
        entry["repeats"].setdefault(info.get("repeat", 0), {})[info["side"]] = bench
    rows = []
    # The table's order: by case as in CASES, then by shape as the suite ran them.
    for (name, shape), entry in sorted(found.items(), key=lambda kv: list(CASES).index(kv[0][0])):
        case, info = CASES[name], entry["info"]
        repeats = [r for _, r in sorted(entry["repeats"].items())]
        row = {"case": name, "shape": shape, "weight_shape": info["weight_shape"],
               "layout": info["layout"]}
        for side in ("ours", "baseline"):
            if any(side in r for r in repeats):
                row[side] = _side([r[side] for r in repeats if side in r])
        ratio = (case.ratio(row["ours"]["median_s"], row["baseline"]["median_s"])
                 if "ours" in row and "baseline" in row else None)
        per_repeat = [case.ratio(r["ours"]["stats"]["median"], r["baseline"]["stats"]["median"])
                      for r in repeats if "ours" in r and "baseline" in r]
        row.update(ratio=ratio, ratios_per_repeat=per_repeat,
                   ratio_definition=case.ratio_definition,
                   target={"op": ">=" if case.speedup else "<=", "value": case.target},
                   met=None if ratio is None else case.met(ratio))
        rows.append(row)
    return rows


def _fmt_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "n/a"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} us"


def _spread(row: dict) -> str:
    """The larger relative IQR of the two sides: how far a ratio can be trusted."""
    sides = [row[s] for s in ("ours", "baseline") if s in row]
    return f"{max(s['max_rel_iqr'] for s in sides):.0%}" if sides else "n/a"


def format_table(rows: list[dict]) -> str:
    repeated = any(len(row["ratios_per_repeat"]) > 1 for row in rows)
    header = ("case", "shape", "weight", "ours", "median", "baseline", "median", "ratio",
              "target", "met", "iqr") + (("per repeat",) if repeated else ())
    lines = []
    for row in rows:
        case = CASES[row["case"]]
        ours, base = row.get("ours", {}), row.get("baseline", {})
        lines.append((
            case.title, row["shape"], "x".join(map(str, row["weight_shape"])),
            ours.get("impl", "?"), _fmt_time(ours.get("median_s")),
            base.get("impl", "?"), _fmt_time(base.get("median_s")),
            "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}", case.target_text,
            {True: "yes", False: "NO", None: "n/a"}[row["met"]], _spread(row))
            + ((" ".join(f"{r:.2f}" for r in row["ratios_per_repeat"]),) if repeated else ()))
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *lines]]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_backends(backend_info: dict) -> str:
    """The CPU rows of ``backend_info()``: which implementation each op ran with."""
    lines = []
    for op, devices in backend_info.items():
        entry = devices.get("cpu", {})
        reason = f"  ({entry['reason']})" if entry.get("reason") else ""
        lines.append(f"  {op:<34} {entry.get('implementation', '?')}{reason}")
    return "\n".join(lines)


def machine_summary(raw: dict) -> dict:
    """The machine and setup of the measuring process (from pytest-benchmark's JSON)."""
    info = raw["machine_info"]
    pfl = info.get("pfl", {})
    return {
        "mode": "quick" if pfl.get("quick") else "full",
        "date": raw.get("datetime"),
        "platform": platform.platform(),
        "cpu": info.get("cpu", {}).get("brand_raw", info.get("processor", "")),
        "cpu_count": pfl.get("cpu_count"),
        "torch_version": pfl.get("torch_version"),
        "torch_num_threads": pfl.get("torch_num_threads"),
        "omp_wait_policy": pfl.get("omp_wait_policy"),
        "python_version": info.get("python_version"),
        "pytest_benchmark_version": raw.get("version"),
        "backend_info": pfl.get("backend_info", {}),
    }


def print_report(machine: dict, rows: list[dict]) -> None:
    print()
    print(f"pfl-kernels CPU benchmarks ({machine['mode']} mode), {machine['date']}")
    print(f"torch {machine['torch_version']}, {machine['torch_num_threads']} threads, "
          f"{machine['cpu_count']} CPUs ({machine['cpu']}), {machine['platform']}, "
          f"OMP_WAIT_POLICY={machine['omp_wait_policy']}")
    print("\nImplementations on CPU (pfl_kernels.backend_info() in the measuring process):")
    print(format_backends(machine["backend_info"]))
    if any(d.get("cpu", {}).get("implementation") == "reference"
           for op, d in machine["backend_info"].items() if "factorized_weight" in op):
        print("NOTE: the factorized ops ran the plain-PyTorch reference on CPU, so the fused "
              "side is the eager code behind a custom op: expect reconstruct ratios near 1.")
    print()
    print(format_table(rows))
    print("\nours / baseline: fused / eager for the reconstruction ops, factorized / dense for "
          "the layers (batch 32, 32x32 inputs, rank 1).\nratio: eager/fused (speed-up, higher "
          "is better) for reconstruct, factorized/dense (cost, lower is better) for layers.\n"
          "Times are medians over rounds (and over repeats, when measured more than once); iqr ="
          " the largest interquartile range of the pair's measurements, relative to its median.")
    measured = [r for r in rows if r["met"] is not None]
    print(f"\nTargets met: {sum(r['met'] for r in measured)} of {len(rows)}"
          + (f" ({len(rows) - len(measured)} not measured)" if len(measured) < len(rows) else ""))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer rounds per measurement (same shapes): under a minute")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"where to save the ratio table (default {DEFAULT_JSON.relative_to(ROOT)}, "
                             f"or {QUICK_JSON.relative_to(ROOT)} with --quick)")
    parser.add_argument("--benchmark-json", type=Path, default=None,
                        help="also keep pytest-benchmark's raw JSON (every timing) at this path")
    args = parser.parse_args(argv)
    if args.json is None:
        args.json = QUICK_JSON if args.quick else DEFAULT_JSON

    with tempfile.TemporaryDirectory() as tmp:
        raw_path = args.benchmark_json.resolve() if args.benchmark_json else Path(tmp) / "raw.json"
        status = run_benchmarks(raw_path, args.quick, Path(tmp) / "storage")
        if not raw_path.exists():
            print(f"error: the benchmarks did not run (pytest exit status {status})", file=sys.stderr)
            return status or 1
        raw = json.loads(raw_path.read_text())

    machine = machine_summary(raw)
    rows = build_rows(raw)
    print_report(machine, rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "suite": BENCH_FILE, "machine": machine, "rows": rows,
        "targets_met": sum(bool(r["met"]) for r in rows), "rows_total": len(rows)}, indent=2) + "\n")
    print(f"Saved {args.json}")
    if status != 0:
        print(f"error: some benchmarks failed (pytest exit status {status})", file=sys.stderr)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())

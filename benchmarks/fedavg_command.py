"""Wall time of the whole 10-round FedAvg command against the plain loop's script.

Both are timed from outside, interpreter start-up included, alternating, ``--repeats`` times:

* ours: ``python -m pfl_algorithms run fedavg`` on the common small job (synthetic-cifar, 20
  clients x 250 samples, LeNet-5, batch 64, SGD lr 0.01 without momentum, 1 local epoch,
  IID, 10 rounds; evaluation and checkpoint only after the last round, as the plain script
  has none in between; the run directory, summary and plots are written as always);
* baseline: ``python benchmarks/plain_fedavg_loop.py --rounds 10``.

Target on CPU: ours no slower than the baseline (ratio baseline / ours >= 1.0).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fedavg_command.py [--repeats 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 10


def commands(out_dir: str) -> dict:
    pfl = [sys.executable, "-m", "pfl_algorithms", "run", "fedavg", "--dataset", "synthetic-cifar", "--model",
           "lenet5", "--scenario", "iid", "--clients", "20", "--samples-per-client", "250", "--set",
           "split=(1.0, 0.0, 0.0)", "--batch-size", "64", "--lr", "0.01", "--set",
           "momentum=0.0", "--local-epochs", "1", "--rounds", str(ROUNDS), "--eval-every", str(ROUNDS),
           "--checkpoint-every", str(ROUNDS), "--quiet", "--out", out_dir]
    plain = [sys.executable, str(ROOT / "benchmarks" / "plain_fedavg_loop.py"), "--rounds", str(ROUNDS)]
    return {"ours": pfl, "baseline": plain}


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fedavg_command_cpu.json"))
    args = parser.parse_args()
    times = {"ours": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for side in ("ours", "baseline"):
                cmd = commands(os.path.join(tmp, f"run{repeat}"))[side]
                times[side].append(timed(cmd))
                print(f"repeat {repeat} {side}: {times[side][-1]:.2f} s", flush=True)
    medians = {side: statistics.median(v) for side, v in times.items()}
    ratio = medians["baseline"] / medians["ours"]
    print(f"\n10-round command, wall time with start-up (median of {args.repeats}): ours {medians['ours']:.2f} s, "
          f"plain loop {medians['baseline']:.2f} s, ratio baseline/ours {ratio:.2f} (target >= 1.00: "
          f"{'met' if ratio >= 1.0 else 'missed'})")
    result = {"times_s": times, "median_s": medians, "ratio_baseline_over_ours": ratio, "target": ">= 1.0",
              "met": ratio >= 1.0, "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "commands": commands("<out>")}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"Saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

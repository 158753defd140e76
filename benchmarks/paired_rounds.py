"""A round suite's two sides measured in pairs, interleaved in one process.

    python benchmarks/paired_rounds.py factorized_fl_round [--pairs 40] [--json PATH]

The suite's ``engine_round()`` (ours) and ``loop_round()`` (the plain loop) are built once and
warmed up; then ``--pairs`` pairs of rounds run, one round of each side per pair, the side that
goes first alternating.  Both sides thus share the machine's drift (on the 2-core machines it
moves timings by ±5% over minutes, which the report's separate 3-second windows per side do
not cancel).  Printed: each side's median round, the ratio of the medians (baseline / ours, the
suite's speed-up) and a 95% bootstrap interval of that ratio (2000 resamples of whole pairs,
seeded: the same times give the same interval).

OpenMP runs with its default wait policy, as the report runs the round suites (the plain loops'
fastest setting): an ``OMP_WAIT_POLICY`` in the environment is dropped before torch loads.
Run it on an otherwise idle machine.  ``--dry-run``: one warm-up round and two pairs (a check
that the suite runs, for CI; its ratio means nothing).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = ("fedavg_round", "factorized_fl_round", "pfedmb_round")
RESAMPLES = 2000


def ratio_of_medians(ours: list[float], baseline: list[float]) -> float:
    """median(baseline) / median(ours): the suite's speed-up."""
    return statistics.median(baseline) / statistics.median(ours)


def bootstrap_interval(ours: list[float], baseline: list[float], *, resamples: int = RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of :func:`ratio_of_medians` over ``resamples`` draws of
    the pairs with replacement (pair i is (ours[i], baseline[i]); a pair stays together)."""
    if len(ours) != len(baseline) or not ours:
        raise ValueError(f"need as many times per side, at least one: got {len(ours)} and {len(baseline)}")
    rng = random.Random(seed)
    n = len(ours)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(ratio_of_medians([ours[i] for i in picks], [baseline[i] for i in picks]))
    ratios.sort()
    return ratios[int(0.025 * (resamples - 1))], ratios[int(0.975 * (resamples - 1))]


def measure(suite: str, pairs: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per round of each side over ``pairs`` interleaved pairs, after ``warmup`` rounds each."""
    module = importlib.import_module(f"benchmarks.bench_{suite}")
    sides = {"ours": module.engine_round(), "baseline": module.loop_round()}
    for fn in sides.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    for pair in range(pairs):
        order = ("ours", "baseline") if pair % 2 == 0 else ("baseline", "ours")
        for side in order:
            start = time.perf_counter()
            sides[side]()
            times[side].append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the times and the ratio here")
    parser.add_argument("--dry-run", action="store_true", help="1 warm-up round, 2 pairs: checks the suite runs")
    args = parser.parse_args(argv)
    pairs, warmup = (2, 1) if args.dry_run else (args.pairs, args.warmup)
    if pairs < 1 or warmup < 0:
        parser.error(f"--pairs must be >= 1 and --warmup >= 0, got {pairs} and {warmup}")
    if args.json and not Path(args.json).resolve().parent.is_dir():  # before minutes of measuring
        parser.error(f"--json: the folder of {args.json!r} does not exist")
    if "torch" not in sys.modules:  # OpenMP reads its wait policy once, when torch loads
        os.environ.pop("OMP_WAIT_POLICY", None)
    sys.path.insert(0, str(ROOT))
    import torch

    times = measure(args.suite, pairs, warmup)
    ratio = ratio_of_medians(times["ours"], times["baseline"])
    low, high = bootstrap_interval(times["ours"], times["baseline"])
    result = {"suite": args.suite, "pairs": pairs, "warmup": warmup, "dry_run": args.dry_run,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
              "torch_version": torch.__version__, "median_s": {s: statistics.median(v) for s, v in times.items()},
              "ratio": ratio, "ratio_95": [low, high], "times_s": times}
    print(f"{args.suite}: ours {result['median_s']['ours'] * 1e3:.1f} ms, baseline "
          f"{result['median_s']['baseline'] * 1e3:.1f} ms, ratio {ratio:.3f} (95% bootstrap interval "
          f"{low:.3f}-{high:.3f}), {pairs} interleaved pairs, {result['cpu_capability']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a CPU-scale reproduce run costs with each candidate model: LeNet-5 with BatchNorm
(the CPU scale's model) against the papers' ResNet-9 narrowed by its ``width`` option.

Each side is one whole ``runner.run`` of a Factorized-FL CPU-scale cell (Fashion-MNIST,
permuted labels, 10 clients of 300 samples, ``--rounds`` rounds of 10 local steps of 32, seed
0), for FedAvg and Factorized-FL β, in one process on one intra-op thread.  The sides
alternate, ``--repeats`` times; printed: each side's median wall time and its ratio to
LeNet-5's.  It says whether the paper's model fits the CPU scale's 20-minute budget (the
reports' notes quote it).  Needs Fashion-MNIST (``bash scripts/setup.sh --data``).

    python benchmarks/reproduce_model_cost.py [--rounds 3] [--repeats 2] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from pfl_algorithms.reproduce.campaign import run_config  # noqa: E402
from pfl_algorithms.reproduce.papers import FACTORIZED_FL, Setting  # noqa: E402
from pfl_algorithms.runner import run  # noqa: E402

MODELS = {"lenet5-bn": dict(model="lenet5", model_options={"norm": "batch"}),
          "resnet9-w8": dict(model="resnet9", model_options={"width": 8}),
          "resnet9-w4": dict(model="resnet9", model_options={"width": 4})}
METHODS = ("FedAvg", "Factorized-FL β")


def main(argv=None) -> dict:
    """Time every (method, model) side, interleaved; print and return the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    column = FACTORIZED_FL.settings["cpu"][0]
    methods = {m.label: m for m in FACTORIZED_FL.methods}
    seconds: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for label in METHODS:
            for name, model in MODELS.items():
                setting = Setting(column.label, {**column.config, **model, "rounds": args.rounds,
                                                 "eval_every": args.rounds}, column.algorithm_settings)
                config = run_config(FACTORIZED_FL, "cpu", methods[label], setting, seed=0)
                with tempfile.TemporaryDirectory() as folder:
                    start = time.perf_counter()
                    run(config, Path(folder) / "run", progress=False)
                    seconds.setdefault(f"{label} / {name}", []).append(time.perf_counter() - start)
    result = {"rounds": args.rounds, "repeats": args.repeats, "median_s": {}, "ratio_to_lenet5": {}}
    for label in METHODS:
        base = statistics.median(seconds[f"{label} / lenet5-bn"])
        for name in MODELS:
            median = statistics.median(seconds[f"{label} / {name}"])
            result["median_s"][f"{label} / {name}"] = round(median, 3)
            result["ratio_to_lenet5"][f"{label} / {name}"] = round(median / base, 2)
            print(f"{label:18s} {name:11s} {median:7.2f} s  {median / base:5.2f}x LeNet-5")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

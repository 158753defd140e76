"""bfloat16 autocast's effect on accuracy (issue 30, item 3), paired by seed on the demo's testbed.

    python benchmarks/bf16_accuracy.py [--rounds 20] [--seeds 5] [--device cpu|cuda]
    python benchmarks/bf16_accuracy.py --dry-run      # digits, 1 round, 1 seed: a check for CI

Every method that trains through the library's layers (FedAvg on plain convolutions,
Factorized-FL and SimFed on ``FactorizedConv2d`` with both inits, pFedMB on
``MultiBranchConv2d``) runs on ``pfl demo``'s personalization testbed (permuted labels; MNIST
with LeNet-5 where installed, else digits; the same clients, data, steps and optimizer
settings) twice per seed: float32, and with the training forward under bfloat16 autocast
(``--autocast bf16``: convolutions and matmuls in bfloat16, float32 accumulation, the loss in
float32).  Within a seed the two runs share the partition, the initialization and every batch,
so the difference of their final mean test accuracy is bf16's effect alone; over the seeds,
its mean and paired Student-t 95% interval (``pfl_algorithms.reproduce.report``).

Accuracy depends on bfloat16's rounding of the operands, which is the same on every device
(oneDNN on a CPU and cuDNN/cuBLAS on a GPU both accumulate in float32), so a CPU run measures
the effect the GPU's autocast has.  The wall time per run is printed too, but on a CPU
without bfloat16 units it says nothing about a GPU's speed: that is ``gpu_executor.py``'s
``batched+bf16`` row.  Writes ``benchmarks/results/bf16_accuracy_<device>.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

ALGORITHMS = ("fedavg", "factorized-fl-beta", "simfed", "pfedmb")
MODES = (None, "bf16")


def measure(*, rounds: int, seeds: int, dataset: str, device: str, algorithms: Sequence[str], out: Path,
            data_root: Optional[str]) -> dict:
    """Run every (row, seed, mode); returns {"testbed", "runs": [...], "rows": [...]}."""
    from pfl_algorithms.data.datasets import reuse_loaded_datasets
    from pfl_algorithms.demo import choose_testbed, demo_config, rows_of
    from pfl_algorithms.reproduce.report import paired_difference
    from pfl_algorithms.runner import run

    runs, rows = [], []
    with reuse_loaded_datasets():
        testbed = choose_testbed(dataset, data_root)
        for algorithm in algorithms:
            for row in rows_of(algorithm):
                accuracy = {mode: {} for mode in MODES}
                for seed in range(seeds):
                    for mode in MODES:
                        config = demo_config(testbed, row.algorithm, "permuted", rounds=rounds, seed=seed,
                                             data_root=data_root, algorithm_settings=row.settings)
                        config = dataclasses.replace(config, autocast=mode, device=device)
                        start = time.perf_counter()
                        summary = run(config, out / f"{row.folder}-{mode or 'float32'}-seed{seed}", overwrite=True,
                                      progress=False)
                        wall = time.perf_counter() - start
                        acc = 100 * summary["final_mean_accuracy"]
                        accuracy[mode][seed] = acc
                        runs.append({"row": row.label, "seed": seed, "autocast": mode, "accuracy": acc, "wall_s": wall})
                        print(f"{row.label:32} seed {seed}  {mode or 'float32':8} {acc:6.2f}%  {wall:6.1f} s", flush=True)
                diff = paired_difference(accuracy["bf16"], accuracy[None])
                walls = {mode: statistics.median(r["wall_s"] for r in runs if r["row"] == row.label
                                                 and r["autocast"] == mode) for mode in MODES}
                rows.append({"row": row.label, "float32": statistics.fmean(accuracy[None].values()),
                             "bf16": statistics.fmean(accuracy["bf16"].values()), "bf16_minus_float32": diff,
                             "median_wall_s": {"float32": walls[None], "bf16": walls["bf16"]}})
    return {"testbed": testbed.describe() + f"; {testbed.dataset}, permuted labels, {rounds} rounds", "runs": runs,
            "rows": rows}


def format_table(rows: list[dict]) -> str:
    head = f"{'method':32} {'float32 %':>10} {'bf16 %':>8} {'bf16 - float32 (95% interval)':>32} {'wall f32/bf16 s':>16}"
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r["bf16_minus_float32"]
        interval = "" if d["interval"] is None else f" [{d['interval'][0]:+.2f}, {d['interval'][1]:+.2f}]"
        walls = r["median_wall_s"]
        lines.append(f"{r['row']:32} {r['float32']:10.2f} {r['bf16']:8.2f} {d['mean']:+14.2f}{interval:>18} "
                     f"{walls['float32']:7.1f}/{walls['bf16']:.1f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--dataset", choices=("auto", "mnist", "digits"), default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--json", type=Path, default=None, help="where the results go")
    parser.add_argument("--dry-run", action="store_true", help="digits, 1 round, 1 seed, FedAvg: a check")
    args = parser.parse_args(argv)
    for name in ("rounds", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: the folder of {args.json} does not exist")
    if args.dry_run:
        args.rounds, args.seeds, args.dataset, args.algorithms = 1, 1, "digits", ["fedavg"]

    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")

    with tempfile.TemporaryDirectory(prefix="pfl-bf16-") as tmp:
        result = measure(rounds=args.rounds, seeds=args.seeds, dataset=args.dataset, device=args.device,
                         algorithms=args.algorithms, out=Path(tmp), data_root=args.data_root)
    print("\n" + format_table(result["rows"]))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    path = args.json or (Path(tempfile.gettempdir()) / "pfl_bf16_dry_run.json" if args.dry_run
                         else ROOT / "benchmarks" / "results" / f"bf16_accuracy_{slug}.json")
    path.write_text(json.dumps({
        "suite": "bf16_accuracy", "script": "benchmarks/bf16_accuracy.py", "dry_run": args.dry_run,
        "machine": {"device": name, "torch": torch.__version__, "threads": torch.get_num_threads()},
        "config": {"rounds": args.rounds, "seeds": args.seeds, "testbed": result["testbed"],
                   "metric": "final mean test accuracy of the clients, %",
                   "difference": "bf16 - float32 per seed, paired Student-t 95% interval over seeds"},
        "rows": result["rows"], "runs": result["runs"]}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

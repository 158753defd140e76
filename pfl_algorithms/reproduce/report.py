"""``report.md`` and ``report.json`` of a reproduction: the paper's table from our runs (mean ±
std over seeds, communication), the paper's own numbers beside ours where legible, the budget,
each claim checked by the paired difference over seeds with its 95% interval, and plots of
accuracy against round and against bits per setting.

Claims (``claim_results``): every method of a setting runs the same seeds, so a claim "A is
above B" is judged on the per-seed differences d_s = acc_A(s) − acc_B(s) over the seeds both
finished: mean d̄, sample std s_d, and the two-sided 95% Student-t interval d̄ ± t(0.975, n−1)·
s_d/√n over the n seed pairs (a paired t-interval).  The verdict is "holds", "does not hold"
or "inconclusive" by where that interval lies (``Claim.verdict``); one seed pair gives no
interval and is inconclusive.  A seed that finished without an accuracy for either method
(every client it scores diverged) makes the verdict inconclusive: the seeds left would judge
an unstable method on the seeds it survived alone."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Optional

from ..atomic_io import atomic_write_bytes
from ..compare import mean_std
from ..plots import mean_over_seeds, series_style
from .campaign import PlannedRun, budget_lines, settings_of, slug
from .folder import claim_files
from .papers import Claim, Paper

INTERVAL_METHOD = "paired Student-t, 95%, two-sided, n-1 degrees of freedom over seed pairs"
# t(0.975, df) for df = 1..30 (beyond: Cornish-Fisher's first two terms, within 1e-3 of exact).
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
         2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
         2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def paired_difference(a: dict, b: dict) -> dict:
    """The paired difference a − b over the seeds both hold ({seed: accuracy %}): the seeds,
    the differences, their mean and std and the 95% t-interval (None under two pairs)."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    result = {"seeds": seeds, "differences": diffs, "mean": statistics.fmean(diffs) if diffs else None,
              "std": statistics.stdev(diffs) if len(diffs) > 1 else None, "interval": None,
              "interval_method": INTERVAL_METHOD}
    if len(diffs) > 1:
        half = t_quantile_975(len(diffs) - 1) * result["std"] / math.sqrt(len(diffs))
        result["interval"] = (result["mean"] - half, result["mean"] + half)
    return result


def judge(claim: Claim, a: dict, b: dict) -> dict:
    """The claim's paired difference over seeds (``paired_difference``) and its verdict."""
    result = paired_difference(a, b)
    result["verdict"] = claim.verdict(result["interval"])
    return result


PLOT_NAMES = ("accuracy_vs_round", "accuracy_vs_bits")  # per setting: plots/<setting>_<name>.png
METRIC_TEXT = {"final_mean_accuracy": "final-round mean personalized test accuracy over clients",
               "target_best_accuracy": "the target client's best test accuracy over rounds"}


def _mean_std(values: list[float]) -> Optional[tuple[float, Optional[float]]]:
    """(mean, sample std) over seeds (``compare.mean_std``), None for no seed."""
    return mean_std(values) if values else None


def _unreadable(run: PlannedRun, path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path}: not readable ({type(error).__name__}: {error}); delete the run folder {run.out} to "
                      f"run it again")


def _summary(run: PlannedRun, *keys: str) -> dict:
    """A finished run's summary.json, with ``keys``; one line naming the file otherwise."""
    path = run.out / "summary.json"
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise ValueError(f"a JSON object expected, got {type(summary).__name__}")
        missing = [k for k in keys if k not in summary]
        if missing:
            raise ValueError(f"no key {missing[0]!r}")
    except (OSError, ValueError) as error:
        raise _unreadable(run, path, error) from None
    return summary


def _metrics(run: PlannedRun) -> list[dict]:
    """A finished run's metrics.jsonl, one record per line; one line naming the file and the
    line otherwise."""
    path = run.out / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except (OSError, ValueError) as error:
        raise _unreadable(run, path, error) from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON object expected, got {type(record).__name__}")
        except ValueError as error:
            raise _unreadable(run, path, ValueError(f"line {number}: {error}")) from None
        records.append(record)
    return records


def _history(run: PlannedRun, metric: str = "final_mean_accuracy") -> list[dict]:
    """The evaluated rounds of a finished run: (round, accuracy %, gigabits so far); the accuracy is
    the clients' mean, or the target client's for a paper that reports the target's."""
    target = None
    if metric.startswith("target_"):
        target = str(_summary(run, "target_client")["target_client"])
    rows = []
    for record in _metrics(run):
        if "eval" in record:
            try:
                accuracy = record["eval"]["mean_accuracy"] if target is None else record["eval"]["accuracy"][target]
                # null: every client diverged or nothing was evaluated (NaN, a gap in the plot)
                percent = math.nan if accuracy is None else 100 * accuracy
                rows.append((record["round"] + 1, percent, record["comm_gb"]["up"] + record["comm_gb"]["down"]))
            except (KeyError, TypeError) as error:
                raise _unreadable(run, run.out / "metrics.jsonl",
                                  ValueError(f"round {record.get('round')!r}: no {error}")) from None
    return rows


def _gigabytes(gigabits: float) -> float:
    """The report's unit of communication: the ledger counts gigabits; the papers' "Gb" are
    gigabytes (pfl_algorithms/reproduce/costs.py)."""
    return gigabits / 8


def cell_results(runs: list[PlannedRun], metric: str = "final_mean_accuracy") -> dict:
    """{(method label, setting label): {"accuracy": (mean, std), "gb": (mean, std), "seeds": n}}
    from the finished runs' summaries (their ``metric``, in %: the final-round mean personalized
    accuracy, or the target's best; "gb":
    gigabytes sent up and down, the unit of the papers' cost columns)."""
    cells: dict = {}
    for run in runs:
        summary = _summary(run, metric, "comm_gb")
        cell = cells.setdefault((run.method.label, run.setting.label), {"accuracy": [], "gb": [], "per_seed": {}})
        if summary[metric] is not None:
            cell["accuracy"].append(100 * summary[metric])
            cell["per_seed"][run.seed] = 100 * summary[metric]
        cell["gb"].append(_gigabytes(summary["comm_gb"]["up"] + summary["comm_gb"]["down"]))
    return {key: {"accuracy": _mean_std(c["accuracy"]), "gb": _mean_std(c["gb"]), "seeds": len(c["gb"]),
                  "per_seed": c["per_seed"]}
            for key, c in cells.items()}


def _pm(pair, digits=2) -> str:
    if pair is None:
        return "-"
    mean, std = pair
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def claim_results(paper: Paper, scale: str, cells: dict, quick: bool = False) -> list[dict]:
    """Each claim on each setting it names: the two cells' mean ± std and the paired
    difference over seeds with its interval and verdict ("not measured" without a finished run
    in both cells; "inconclusive" where a finished seed of either has no accuracy, which
    ``without_accuracy`` counts per method)."""
    results = []
    for claim in paper.claims:
        for setting in settings_of(paper, scale, quick):
            if claim.setting_contains not in setting.label:
                continue
            a = cells.get((claim.method, setting.label), {})
            b = cells.get((claim.other, setting.label), {})
            row = {"setting": setting.label, "method": claim.method, "relation": claim.relation,
                   "other": claim.other, "claim": f"{claim.method} {claim.text} {claim.other}",
                   "accuracy": a.get("accuracy"), "other_accuracy": b.get("accuracy"), "note": claim.note}
            if not a.get("seeds") or not b.get("seeds"):
                row.update(verdict="not measured", seeds=[], differences=[], mean=None, std=None, interval=None,
                           interval_method=INTERVAL_METHOD, without_accuracy={})
            else:
                row.update(judge(claim, a["per_seed"], b["per_seed"]))
                row["without_accuracy"] = {label: cell["seeds"] - len(cell["per_seed"])
                                           for label, cell in ((claim.method, a), (claim.other, b))
                                           if cell["seeds"] > len(cell["per_seed"])}
                if row["without_accuracy"]:
                    row["verdict"] = "inconclusive"
            results.append(row)
    return results


def claim_lines(paper: Paper, scale: str, cells: dict, quick: bool = False) -> list[str]:
    """Each claim on each setting it names: our numbers, the paired difference with its 95%
    interval, and the verdict."""
    lines = []
    for r in claim_results(paper, scale, cells, quick):
        # Where the paper's own table contradicts the claim, the note says so beside the verdict.
        note = f" (note: {r['note']})" if r["note"] else ""
        if r["verdict"] == "not measured":
            lines.append(f"- {r['setting']}: {r['claim']}: not measured{note}")
            continue
        n = len(r["seeds"])
        interval = (f"95% CI [{r['interval'][0]:+.2f}, {r['interval'][1]:+.2f}]" if r["interval"] is not None
                    else "no interval (one seed pair)")
        difference = ("no seed pair" if r["mean"] is None
                      else f"paired difference {r['mean']:+.2f} points over {n} seed(s), {interval}")
        missing = "".join(f"; {k} seed(s) of {label} without an accuracy (every client diverged)"
                          for label, k in r["without_accuracy"].items())
        lines.append(f"- {r['setting']}: {r['claim']}: **{r['verdict']}** ({_pm(r['accuracy'])} vs "
                     f"{_pm(r['other_accuracy'])}; {difference}{missing}){note}")
    return lines


def write_plots(paper: Paper, scale: str, runs: list[PlannedRun], folder: Path, quick: bool = False) -> list[str]:
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
    for setting in settings_of(paper, scale, quick):
        figures = {name: plt.subplots(figsize=(6, 4)) for name in PLOT_NAMES}
        for index, method in enumerate(paper.methods):
            histories = [_history(r, paper.metric) for r in runs if r.method is method and r.setting is setting]
            rounds, (accuracy, bits), label = mean_over_seeds(method.label, histories, columns=2)
            if not rounds:
                continue
            gigabytes = [_gigabytes(b) for b in bits]  # the cost table's unit
            figures["accuracy_vs_round"][1].plot(rounds, accuracy, label=label, **series_style(index))
            figures["accuracy_vs_bits"][1].plot(gigabytes, accuracy, label=label, **series_style(index))
        for name, (fig, ax) in figures.items():
            ax.set(xlabel="round" if name.endswith("round") else "communicated (GB = 10⁹ bytes, up + down)",
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


def write_report(paper: Paper, scale: str, seeds: int, runs: list[PlannedRun], out: Path, command: str,
                 quick: bool = False) -> Path:
    """Write ``out/report.md``, ``out/report.json`` (and ``out/plots/``) from the finished runs;
    returns the report's path."""
    cells = cell_results(runs, paper.metric)
    settings = settings_of(paper, scale, quick)
    beside = scale == "paper" and bool(paper.paper_numbers)
    budget = budget_lines(runs)
    lines = [f"# {paper.title}", "",
             f"Reproduced with `{command}`: scale `{scale}`{' (quick)' if quick else ''}, {seeds} seed(s) per cell "
             f"(seeds 0-{seeds - 1}, the same for every method), {len(runs)} runs.",
             f"The paper's {paper.table}. Accuracy: " + METRIC_TEXT.get(paper.metric, paper.metric)
             + " (%), mean ± std over seeds" + (" (one seed: the mean alone, no spread)" if seeds == 1 else "")
             + "." + (" In brackets: the paper's number, where its text is legible." if beside else ""), ""]
    header = ["Method", *(s.label for s in settings)]
    # The rows with a cell at this scale (Fed-CMA's pFedHN rows belong to a paper-scale table).
    methods = [m for m in paper.methods if any(s.runs(m) for s in settings)]
    rows, short = [], False
    for method in methods:
        row = [method.label]
        for setting in settings:
            if not setting.runs(method):
                row.append("·")
                continue
            cell = cells.get((method.label, setting.label), {})
            text = _pm(cell.get("accuracy"))
            if len(cell.get("per_seed", {})) < cell.get("seeds", 0):  # some diverged or had nothing to evaluate
                short = True
                text = (text if cell.get("accuracy") else "n/a") + f" ({len(cell['per_seed'])}/{cell['seeds']} seeds)"
            theirs = paper.paper_numbers.get((method.label, setting.label))
            if beside and theirs is not None:
                text += f" ({_pm(theirs)})"
            row.append(text)
        rows.append(row)
    partial = any(not s.runs(m) for s in settings for m in methods)
    lines += ["## Accuracy (%)", "", *(["`·`: the column's table has no such row."] if partial else []),
              *(["`(k/n seeds)`: the mean is over the k seeds with an accuracy; in the others every client "
                 "scored diverged (a non-finite loss: never scored) or none had anything to evaluate."]
                if short else []),
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
    lines += ["## Budget", "", *(f"- {line}" for line in budget), ""]
    claims = claim_lines(paper, scale, cells, quick)
    if claims:
        lines += ["## The paper's claims at this scale", "",
                  f"Each claim is judged on the per-seed differences (same seeds) by their 95% interval "
                  f"({INTERVAL_METHOD}): holds when the interval lies on the claimed side of 0, does not hold when "
                  "it lies on the other, inconclusive when it straddles 0 or there is one seed pair.", "",
                  *claims, ""]
    if paper.notes:
        lines += ["## Notes", "", *(f"- {note}" for note in paper.notes), ""]
    # Every file of the report is listed in reproduce.json before it is written; one there that
    # this command did not write is refused, never replaced (folder.py).
    claim_files(out, [out / "report.md", out / "report.json",
                      *(out / "plots" / f"{slug(s.label)}_{name}.png" for s in settings for name in PLOT_NAMES)])
    plots = write_plots(paper, scale, runs, out / "plots", quick)
    lines += ["## Plots", "", *(f"![{p}]({p})" if p.endswith(".png") else p for p in plots), ""]
    lines += ["## Runs", "", "Every run directory is kept: `pfl compare` reads them, `--resume` continues them.", "",
              *(f"- `{run.out.relative_to(out)}`: {run.method.label}, {run.setting.label}, seed {run.seed}"
                for run in runs), ""]
    report = out / "report.md"
    atomic_write_bytes(report, "\n".join(lines).encode())
    document = {
        "paper": paper.name, "scale": scale, "quick": quick, "command": command, "seeds": list(range(seeds)),
        "metric": paper.metric, "budget": budget,
        "cells": [{"method": m, "setting": st, "accuracy_per_seed": {str(k): v for k, v in c["per_seed"].items()},
                   "accuracy_mean": None if c["accuracy"] is None else c["accuracy"][0],
                   "accuracy_std": None if c["accuracy"] is None else c["accuracy"][1],
                   "gb_mean": c["gb"][0] if c["gb"] else None}
                  for (m, st), c in cells.items()],
        "claims": [{**r, "interval": None if r["interval"] is None else list(r["interval"])}
                   for r in claim_results(paper, scale, cells, quick)],
    }
    atomic_write_bytes(out / "report.json", (json.dumps(document, indent=1, allow_nan=True) + "\n").encode())
    return report

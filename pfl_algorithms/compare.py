"""``pfl compare``: a table like the papers' over run directories, mean ± std over seeds."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)


def find_summaries(paths: list[str]) -> list[dict]:
    """The summary.json of each run directory in ``paths`` (a folder of runs is searched too)."""
    summaries = []
    for path in map(Path, paths):
        files = [path / "summary.json"] if (path / "summary.json").exists() else sorted(path.glob("*/summary.json"))
        if not files:
            raise ValueError(f"{path} holds no finished run (no summary.json there or one level below)")
        for f in files:
            summary = json.loads(f.read_text())
            summary["_path"] = str(f.parent)
            summaries.append(summary)
    return summaries


def comparison_rows(summaries: list[dict]) -> list[dict]:
    """One row per (algorithm, scenario, dataset, model): accuracy mean ± std over seeds, Gb;
    in the fda scenario also the target client's best accuracy over rounds (FedDAF's metric)."""
    groups = defaultdict(list)
    for s in summaries:
        groups[(s["algorithm"], s["scenario"], s["dataset"], s["model"])].append(s)
    rows = []
    for (algorithm, scenario, dataset, model), runs in sorted(groups.items()):
        final = [100 * r["final_mean_accuracy"] for r in runs if r["final_mean_accuracy"] is not None]
        best = [100 * r["best_mean_accuracy"] for r in runs if r["best_mean_accuracy"] is not None]
        comm = [r["comm_gb"]["up"] + r["comm_gb"]["down"] for r in runs]
        rows.append({
            "algorithm": algorithm, "scenario": scenario, "dataset": dataset, "model": model,
            "seeds": sorted(r["seed"] for r in runs),
            "final_accuracy": _mean_std(final) if final else None,
            "best_accuracy": _mean_std(best) if best else None,
            "target_best_accuracy": _mean_std(target) if (target := [
                100 * r["target_best_accuracy"] for r in runs if r.get("target_best_accuracy") is not None]) else None,
            "comm_gb": _mean_std(comm),
            "wall_s": _mean_std([r["train_wall_s_total"] for r in runs]),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table."""
    def pm(pair, digits=2):
        return "-" if pair is None else f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"

    with_target = any(r.get("target_best_accuracy") is not None for r in rows)
    header = ["algorithm", "scenario", "dataset", "model", "seeds", "final acc (%)", "best acc (%)",
              *(["target best (%)"] if with_target else []), "comm (Gb)", "train time (s)"]
    body = [[r["algorithm"], r["scenario"], r["dataset"], r["model"], str(len(r["seeds"])),
             pm(r["final_accuracy"]), pm(r["best_accuracy"]),
             *([pm(r.get("target_best_accuracy"))] if with_target else []), pm(r["comm_gb"], 4), pm(r["wall_s"], 1)]
            for r in rows]
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

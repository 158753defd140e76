"""The plots of a run: mean accuracy vs round and vs communicated bits, per-client accuracy.

matplotlib is optional (``pip install matplotlib``): without it no plot is written and the
summary says so.
"""
from __future__ import annotations

import math
import statistics

from .engine.rundir import RunDirectory


def series_style(index: int) -> dict:
    """matplotlib line settings that tell ``index``'s line apart from every other of a figure
    with up to 40 lines: matplotlib's 10 colours, then again with another marker for each
    further ten (its default cycle repeats colours after 10, and the tables have up to 27 rows)."""
    return {"color": f"C{index % 10}", "marker": ("", "o", "s", "^")[(index // 10) % 4], "markersize": 3}


def seeds_curve_label(label: str, last_accuracies: list[float]) -> str:
    """The legend label of a mean-over-seeds curve, given each seed's last accuracy: ``label``,
    and how many seeds end without one (NaN: every client diverged, or nothing was evaluated)
    where some do.  The mean is drawn only at rounds every seed scored, so the label says why a
    curve stops or is missing."""
    ended = sum(1 for a in last_accuracies if a != a)
    return label if not ended else f"{label} ({ended}/{len(last_accuracies)} seeds end without accuracy)"


def mean_over_seeds(label: str, histories: list[list[tuple]], columns: int = 1) -> tuple[list, list[list[float]], str]:
    """One method's mean-over-seeds curve: (rounds, the mean per round of each of the
    ``columns`` values after the round, legend label) of its seeds' ``histories``, each a list
    of ``(round, accuracy, ...)`` tuples.  The curve goes to the shortest history; at a round
    some seed did not score (NaN) the mean is NaN, a gap, never a mean over the seeds left
    (``seeds_curve_label`` says why)."""
    length = min((len(h) for h in histories), default=0)
    rounds = [histories[0][i][0] for i in range(length)]
    means = [[statistics.fmean(h[i][k] for h in histories) for i in range(length)] for k in range(1, columns + 1)]
    return rounds, means, seeds_curve_label(label, [h[-1][1] if h else math.nan for h in histories])


def _percent(accuracy) -> float:
    """An accuracy in %; NaN (a gap in the plot) for one with no value (null in metrics.jsonl)."""
    return float("nan") if accuracy is None else 100 * accuracy


def write_plots(rundir: RunDirectory, history: list[dict]) -> dict:
    """Write the run's PNGs under ``rundir.plots``; returns {name: path} or {'skipped': why}."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return {"skipped": f"matplotlib is not installed ({exc})"}
    evals = [m for m in history if "eval" in m]
    if not evals:
        return {"skipped": "no evaluated round"}
    rundir.plots.mkdir(parents=True, exist_ok=True)
    rounds = [m["round"] + 1 for m in evals]
    accuracy = [_percent(m["eval"]["mean_accuracy"]) for m in evals]
    gigabits = [m["comm_gb"]["up"] + m["comm_gb"]["down"] for m in evals]
    paths = {}

    def save(fig, name):
        path = rundir.plots / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths[name] = str(path)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(rounds, accuracy, marker="o", markersize=3)
    ax.set(xlabel="round", ylabel="mean personalized accuracy (%)", title="accuracy vs round")
    ax.grid(alpha=0.3)
    save(fig, "accuracy_vs_round")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(gigabits, accuracy, marker="o", markersize=3)
    ax.set(xlabel="communicated (Gb, up + down)", ylabel="mean personalized accuracy (%)",
           title="accuracy vs communication")
    ax.grid(alpha=0.3)
    save(fig, "accuracy_vs_bits")

    final = evals[-1]["eval"]["accuracy"]
    clients = sorted(final, key=int)
    fig, ax = plt.subplots(figsize=(max(5, 0.3 * len(clients)), 3.5))
    ax.bar([str(c) for c in clients], [_percent(final[c]) for c in clients])
    ax.set(xlabel="client", ylabel="accuracy (%)", title=f"per-client accuracy, round {rounds[-1]}")
    save(fig, "client_accuracy")
    return paths

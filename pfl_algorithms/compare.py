"""``pfl compare``: a table like the papers' over run directories, mean ± std over seeds.

A row pools the runs of one experiment: runs whose resolved configs (``summary.json``'s
``config``, every setting at its effective value: option tables completed with their
defaults, a None that stands for a default resolved) agree in everything but the fields of
``config.NOT_IN_IDENTITY`` (the seed, and what cannot change the numbers).  Where several
rows share algorithm, scenario, dataset and model, a ``settings`` column names what tells
them apart (``lr=0.1, rounds=5``).  A run directory is counted once however often it is
reached (given twice, or as ``runs/`` and ``runs/a``), and a second run of the same
experiment with the same seed is left out with a warning.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Optional

from .algorithms import ALGORITHMS
from .config import NOT_IN_IDENTITY, RunConfig, with_defaults
from .data import DATASETS, SCENARIOS
from .data.augment import parse_augmentation_spec
from .models import MODELS
from .option_types import check_value, field_hints

NAMES = ("algorithm", "scenario", "dataset", "model")
# Keys every summary.json has (``pfl compare`` refuses a file without one, naming it):
# accuracies are fractions in [0, 1] (null: the run diverged), costs finite numbers >= 0.
_NUMBER_OR_NULL = ("final_mean_accuracy", "best_mean_accuracy")
_NUMBER = ("comm_gb.up", "comm_gb.down", "train_wall_s_total")
_TABLE_PREFIX = {"algorithm_settings": "algorithm", "scenario_options": "scenario", "dataset_options": "dataset",
                 "model_options": "model"}


class DuplicateSeedWarning(UserWarning):
    """Two run directories hold the same experiment with the same seed."""


def mean_std(values: list[float]) -> tuple[float, Optional[float]]:
    """(mean, sample std) of at least one value; the std is None for one value (one seed has
    no spread, not 0).  The tables of compare, reproduce and the demo all use it."""
    try:
        mean = statistics.fmean(values)
    except OverflowError:  # fmean's float sum overflowed (values near the largest float): sum exactly
        mean = float(statistics.mean(values))
    return mean, statistics.stdev(values) if len(values) > 1 else None


def find_summaries(paths: list[str]) -> list[dict]:
    """The summary.json of each run directory in or below ``paths`` (at any depth, e.g.
    ``runs/`` finds ``runs/demo/fedavg-seed0``), each directory once (by resolved path), with
    ``_path`` set to it.

    Raises:
        ValueError: a path with no finished run, or a summary that is not valid JSON or lacks
            a key (the message names the file and the key).
    """
    summaries, seen = [], set()
    for path in map(Path, paths):
        files = _summary_files(path)
        if not files:
            raise ValueError(f"{path} holds no finished run (no summary.json in it or in any folder below it)")
        for file in files:
            where = file.parent.resolve()
            if where in seen:
                continue
            seen.add(where)
            summary = read_summary(file)
            summary["_path"] = str(file.parent)
            summaries.append(summary)
    return summaries


def _summary_files(path: Path) -> list[Path]:
    """The summary.json of every run at or below ``path``, in sorted order.  A folder that
    holds a summary.json is a run: its own subfolders (plots/, checkpoints) are not searched.
    Symlinked folders are followed, each real folder once, so a link loop ends."""
    files, visited, stack = [], set(), [path]
    while stack:
        folder = stack.pop()
        real = folder.resolve()
        if real in visited:
            continue
        visited.add(real)
        if (folder / "summary.json").is_file():
            files.append(folder / "summary.json")
            continue
        try:
            children = sorted((child for child in folder.iterdir() if child.is_dir()), reverse=True)
        except OSError:  # not a folder, or one we may not read: nothing of it to compare
            continue
        stack.extend(children)  # reversed onto the stack, so folders are visited in sorted order
    return files


def read_summary(file: Path) -> dict:
    """A run's summary.json after checking it has every key ``pfl compare`` reads, of the type
    it reads it as: accuracies finite fractions in [0, 1] or null, costs finite numbers >= 0,
    and every ``config`` field of the type ``RunConfig`` declares for it (names strings, the
    seed an integer, option tables tables; see ``option_types``).  Fields this version does
    not know are kept as they are.

    Raises:
        ValueError: one line naming the file and the key, e.g. ``"runs/a/summary.json:
            config.algorithm must be a string, got 5"``.
    """
    try:
        summary = json.loads(Path(file).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{file}: not a readable summary.json ({error})") from error
    if not isinstance(summary, dict):
        raise ValueError(f"{file}: a summary must be a JSON object, not {type(summary).__name__}")
    for key in _NUMBER_OR_NULL + _NUMBER:
        _check_number(file, key, _lookup(file, summary, key), accuracy=key in _NUMBER_OR_NULL)
    if "target_best_accuracy" in summary:  # fda runs only
        _check_number(file, "target_best_accuracy", summary["target_best_accuracy"], accuracy=True)
    config = _lookup(file, summary, "config")
    if not isinstance(config, dict):
        raise ValueError(f"{file}: key 'config' must be the run's resolved config (an object), got {config!r}")
    for key in (*NAMES, "seed"):
        _lookup(file, summary, f"config.{key}")
    for key, hint in field_hints(RunConfig).items():
        if key not in config:  # a summary from before the field existed: its default applies
            continue
        try:  # the same check as `pfl run`'s (``config.check``), so the same message
            config[key] = check_value(f"config.{key}", config[key], hint)
        except ValueError as error:
            raise ValueError(f"{file}: {error}") from None
    return summary


def _check_number(file, key: str, value, accuracy: bool) -> None:
    """Refuse ``value`` unless it is a finite number (an accuracy: in [0, 1], or null; else >= 0)."""
    if accuracy and value is None:
        return
    if not _finite(value) or not (0 <= value <= 1 if accuracy else value >= 0):
        expected = "a number in [0, 1] or null" if accuracy else "a finite number >= 0"
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise ValueError(f"{file}: key {key!r} must be {expected}, got {shown}")


def _finite(value) -> bool:
    """Whether ``value`` is a finite int or float (not a bool, which JSON keeps apart)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # JSON integers parse as Python ints of any size, past any float
        return False


def _lookup(file, summary: dict, dotted: str):
    value = summary
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{file}: no key {dotted!r} (is it a summary.json written by `pfl run`?)")
        value = value[part]
    return value


def experiment(config: dict) -> dict:
    """The identity of a run's experiment: its resolved config without ``NOT_IN_IDENTITY``,
    every setting at its effective value, as JSON values.  An option or field left at its
    default and one set to the same value are the same experiment: the option tables are
    completed by their declared defaults, and the fields whose None stands for a default
    resolved (``keep_head_local``, ``finetune_epochs``, ``augment``)."""
    identity = {k: v for k, v in with_defaults(config).items() if k not in NOT_IN_IDENTITY}
    for table, prefix in _TABLE_PREFIX.items():
        identity[table] = {**_option_defaults(prefix, config.get(prefix)), **dict(identity.get(table) or {})}
    identity["keep_head_local"] = RunConfig(scenario=config.get("scenario"),
                                            keep_head_local=config.get("keep_head_local")).head_local()
    if identity["finetune_epochs"] is None and identity["algorithm"] in ALGORITHMS:
        identity["finetune_epochs"] = RunConfig(algorithm=identity["algorithm"]).finetune()
    identity["augment"] = _augmentation(identity["augment"])
    return json.loads(json.dumps(identity, sort_keys=True))


def _augmentation(spec):
    """The augmentation ``spec`` runs, as one canonical spec: every step with all its options
    (``"crop,flip"`` and ``"crop(padding=4), flip"`` alike), presets expanded; None for no
    augmentation (None, ``""`` and ``"none"`` alike).  A spec this version cannot parse (a
    step added later) is kept as it is."""
    try:
        steps = parse_augmentation_spec(spec)
    except (ValueError, TypeError):
        return spec
    return ", ".join(f"{name}({', '.join(f'{k}={v!r}' for k, v in options.items())})"
                     for name, options in steps) or None


def _option_defaults(prefix: str, owner) -> dict:
    """The declared defaults of ``owner``'s options (none for a name this version lacks)."""
    registry = {"algorithm": ALGORITHMS, "scenario": SCENARIOS, "dataset": DATASETS, "model": MODELS}[prefix]
    if not isinstance(owner, str) or owner not in registry:
        return {}
    if prefix == "algorithm":
        return {f.name: f.default for f in dataclasses.fields(registry[owner].Settings)
                if f.default is not dataclasses.MISSING}
    defaults = dict(registry[owner].defaults)
    defaults.pop("samples_per_client", None)  # a RunConfig field, not a scenario option
    return defaults


def _flat(identity: dict) -> dict:
    """``{"lr": 0.1, "scenario.alpha": 0.3, ...}``: the identity's settings by display name."""
    flat = {}
    for key, value in identity.items():
        if key in _TABLE_PREFIX:
            flat.update({f"{_TABLE_PREFIX[key]}.{name}": v for name, v in value.items()})
        elif key not in NAMES:
            flat[key] = value
    return flat


def comparison_rows(summaries: list[dict]) -> list[dict]:
    """One row per experiment (see the module docstring): accuracy mean ± std over seeds (the
    std None for one seed), Gb;
    in the fda scenario also the target client's best accuracy over rounds (FedDAF's metric).
    ``settings`` holds what tells a row apart from rows of the same algorithm, scenario,
    dataset and model (empty when no other row shares them)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    identities = {}
    for s in summaries:
        identity = experiment(s["config"])
        key = json.dumps(identity, sort_keys=True)
        identities[key] = identity
        twin = next((r for r in groups[key] if r["config"]["seed"] == s["config"]["seed"]), None)
        if twin is not None:
            warnings.warn(f"{s['_path']} repeats the run {twin['_path']} (same settings, seed "
                          f"{s['config']['seed']}); it is counted once", DuplicateSeedWarning, stacklevel=2)
            continue
        groups[key].append(s)
    settings = _distinguishing_settings(identities)
    rows = []
    for key, runs in groups.items():
        identity = identities[key]
        final = [100 * r["final_mean_accuracy"] for r in runs if r["final_mean_accuracy"] is not None]
        best = [100 * r["best_mean_accuracy"] for r in runs if r["best_mean_accuracy"] is not None]
        target = [100 * r["target_best_accuracy"] for r in runs if r.get("target_best_accuracy") is not None]
        rows.append({
            **{name: identity[name] for name in NAMES},
            "settings": settings[key],
            "seeds": sorted(r["config"]["seed"] for r in runs),
            "runs": [r["_path"] for r in runs],
            # How many runs have no final accuracy (diverged, or nothing to evaluate): not in the mean.
            "final_missing": len(runs) - len(final),
            "final_accuracy": mean_std(final) if final else None,
            "best_accuracy": mean_std(best) if best else None,
            "target_best_accuracy": mean_std(target) if target else None,
            "comm_gb": mean_std([r["comm_gb"]["up"] + r["comm_gb"]["down"] for r in runs]),
            "wall_s": mean_std([r["train_wall_s_total"] for r in runs]),
        })
    rows.sort(key=lambda r: (*(str(r[n]) for n in NAMES), format_settings(r["settings"])))
    return rows


def _distinguishing_settings(identities: dict) -> dict:
    """For each experiment, the settings whose values differ among the experiments that
    share its algorithm, scenario, dataset and model ({} when it is alone)."""
    by_names = defaultdict(list)
    for key, identity in identities.items():
        by_names[tuple(json.dumps(identity[n]) for n in NAMES)].append(key)
    result = {}
    for keys in by_names.values():
        flats = {key: _flat(identities[key]) for key in keys}
        names = sorted({name for flat in flats.values() for name in flat})
        differing = [n for n in names if len({json.dumps(f.get(n, "-"), sort_keys=True) for f in flats.values()}) > 1]
        for key in keys:
            result[key] = {n: flats[key].get(n, "-") for n in differing}
    return result


def format_settings(settings: dict) -> str:
    """``{"lr": 0.1, "rounds": 5}`` as ``"lr=0.1, rounds=5"``."""
    return ", ".join(f"{name}={json.dumps(value) if isinstance(value, (dict, str)) else value}"
                     for name, value in settings.items())


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table (a ``settings`` column where rows need one)."""
    def pm(pair, digits=2):  # a mean alone where one run gives no spread
        if pair is None:
            return "-"
        return f"{pair[0]:.{digits}f}" if pair[1] is None else f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"

    def final(row):  # with how many runs, where some have no final accuracy (diverged)
        missing = row.get("final_missing", 0)
        text = "n/a" if row["final_accuracy"] is None and missing else pm(row["final_accuracy"])
        return text + (f" ({len(row['seeds']) - missing}/{len(row['seeds'])} runs)" if missing else "")

    with_target = any(r.get("target_best_accuracy") is not None for r in rows)
    with_settings = any(r.get("settings") for r in rows)
    header = ["algorithm", "scenario", "dataset", "model", *(["settings"] if with_settings else []), "seeds",
              "final acc (%)", "best acc (%)", *(["target best (%)"] if with_target else []), "comm (Gb)",
              "train time (s)"]
    body = [[r["algorithm"], r["scenario"], r["dataset"], r["model"],
             *([format_settings(r.get("settings") or {}) or "-"] if with_settings else []), str(len(r["seeds"])),
             final(r), pm(r["best_accuracy"]),
             *([pm(r.get("target_best_accuracy"))] if with_target else []), pm(r["comm_gb"], 4), pm(r["wall_s"], 1)]
            for r in rows]
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

"""The runs of a paper's comparison: every method × setting × seed, each in its own run
directory ``<out>/<setting>/<algorithm>/seed<S>``, resumable (a finished run is kept, a
stopped one resumes)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config import RunConfig, check, config_from
from .papers import Method, Paper, Setting


@dataclass(frozen=True)
class PlannedRun:
    """One run of the comparison: its row, column, seed, checked config and directory."""

    method: Method
    setting: Setting
    seed: int
    config: RunConfig
    out: Path


def slug(label: str) -> str:
    """A setting's label as a directory name: ``"CIFAR-10 Permuted IID"`` -> ``cifar-10-permuted-iid``."""
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def run_config(paper: Paper, scale: str, method: Method, setting: Setting, seed: int, *,
               data_root: Optional[str] = None, device: str = "cpu") -> RunConfig:
    """The checked RunConfig of one cell and seed: the scale's base, then the setting, then the
    method's algorithm settings (the method's own, then those the setting ties to it)."""
    values = {**paper.base[scale], **setting.config, "algorithm": method.algorithm, "seed": seed, "device": device,
              "algorithm_settings": {**method.settings, **setting.algorithm_settings.get(method.algorithm, {})}}
    if data_root is not None:
        values["data_root"] = data_root
    try:
        return check(config_from(values))
    except ValueError as error:
        raise ValueError(f"{paper.name} {setting.label!r}, {method.label}: {error}") from None


def method_folder(paper: Paper, method: Method) -> str:
    """A row's folder: its algorithm, and its own settings where two rows share the algorithm
    (pFedMB with and without α-weighting: ``pfedmb``, ``pfedmb-weighting-uniform``)."""
    if sum(m.algorithm == method.algorithm for m in paper.methods) == 1 or not method.settings:
        return method.algorithm
    return slug("-".join([method.algorithm, *(f"{k}-{v}" for k, v in sorted(method.settings.items()))]))


def plan(paper: Paper, scale: str, seeds: int, out: Path, *, data_root: Optional[str] = None,
         device: str = "cpu") -> list[PlannedRun]:
    """Every run of the comparison, in the order they run (setting by setting, seed by seed;
    a setting runs the rows it names, all by default), each config checked before anything
    trains."""
    return [PlannedRun(method, setting, seed,
                       run_config(paper, scale, method, setting, seed, data_root=data_root, device=device),
                       out / slug(setting.label) / method_folder(paper, method) / f"seed{seed}")
            for setting in paper.settings[scale] for seed in range(seeds) for method in paper.methods
            if setting.runs(method)]


def describe(paper: Paper, scale: str, seeds: int, out: Path, runs: list[PlannedRun]) -> str:
    """The plan as text (``--dry-run``): one line per setting, with its methods and run count."""
    settings = paper.settings[scale]
    lines = [f"{paper.name} at scale {scale}: {len(runs)} runs ({len(paper.methods)} methods, {len(settings)} "
             f"settings, {seeds} seeds); every config checked"]
    for setting in settings:
        config = next(r.config for r in runs if r.setting is setting)
        local = f"{config.local_steps} steps" if config.local_steps is not None else f"{config.local_epochs} epochs"
        lines.append(f"  {setting.label}: {config.dataset}/{config.scenario}, model {config.model}, "
                     f"{config.clients} clients, {config.rounds} rounds × {local} "
                     f"-> {out / slug(setting.label)}/"
                     + ("" if setting.methods is None else f" ({', '.join(setting.methods)})"))
    lines.append("  methods: " + ", ".join(f"{m.label} ({m.algorithm})" for m in paper.methods))
    return "\n".join(lines)

"""The runs of a paper's comparison: every method × setting × seed, each in its own run
directory ``<out>/<setting>/<algorithm>/seed<S>``, resumable (a finished run is kept, a
stopped one resumes)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config import RunConfig, check, config_from
from .papers import QUICK, Method, Paper, Setting, optimizer_steps, split_budget


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


def settings_of(paper: Paper, scale: str, quick: bool = False) -> tuple[Setting, ...]:
    """The columns a run of ``scale`` covers: all, or with ``quick`` (CPU scale only) the
    paper's ``quick`` columns (default: the first)."""
    settings = paper.settings[scale]
    if not quick:
        return settings
    if scale != "cpu":
        raise ValueError("--quick is a variant of --scale cpu")
    chosen = tuple(s for s in settings if s.label in paper.quick) if paper.quick else settings[:1]
    if paper.quick and len(chosen) != len(paper.quick):
        raise ValueError(f"{paper.name}: quick names settings the CPU scale lacks: {paper.quick}")
    return chosen


def run_config(paper: Paper, scale: str, method: Method, setting: Setting, seed: int, *,
               data_root: Optional[str] = None, device: str = "cpu", quick: bool = False) -> RunConfig:
    """The checked RunConfig of one cell and seed: the scale's base (with ``quick``, at
    ``QUICK``'s rounds), then the setting, then the method's algorithm settings (the method's
    own, then those the setting ties to it).  A budget of ``local_steps`` is split over the
    phases of a method that trains in several (``papers.split_budget``)."""
    values = {**paper.base[scale], **(QUICK if quick else {}), **setting.config, "algorithm": method.algorithm,
              "seed": seed, "device": device,
              "algorithm_settings": {**method.settings, **setting.algorithm_settings.get(method.algorithm, {})}}
    if values.get("local_steps") is not None:
        try:
            values["local_steps"], split = split_budget(method.algorithm, values["local_steps"])
        except ValueError as error:
            raise ValueError(f"{paper.name} {setting.label!r}, {method.label}: {error}") from None
        values["algorithm_settings"] = {**split, **values["algorithm_settings"]}
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
         device: str = "cpu", quick: bool = False) -> list[PlannedRun]:
    """Every run of the comparison, in the order they run (setting by setting, seed by seed;
    a setting runs the rows it names, all by default), each config checked before anything
    trains.  Every method of a setting runs the same seeds 0..seeds-1."""
    return [PlannedRun(method, setting, seed,
                       run_config(paper, scale, method, setting, seed, data_root=data_root, device=device,
                                  quick=quick),
                       out / slug(setting.label) / method_folder(paper, method) / f"seed{seed}")
            for setting in settings_of(paper, scale, quick) for seed in range(seeds) for method in paper.methods
            if setting.runs(method)]


def run_steps(run: PlannedRun) -> Optional[int]:
    """Optimizer steps per client and round of a planned run (None: a budget in epochs)."""
    return optimizer_steps(run.config.algorithm, run.config.local_steps, run.config.algorithm_settings)


# The roles a scenario's clients take, whose training a budget line gives apart (FedDAF's
# sources and target: the target of feddaf, fedgp, feddwa and target-only trains by their
# target_* settings, target-only's sources not at all).
ROLE_SCENARIOS = ("fda",)


def role_plans(run: PlannedRun) -> dict[str, tuple]:
    """A source's and the target's phases of a round of an ``fda`` run, from the algorithm's own
    ``plan`` without data: the fda algorithms keep their target client in ``target`` (set by
    ``setup`` through ``target_only.the_target``), set here to client 1, client 0 a source."""
    from ..algorithms import ALGORITHMS

    algorithm = ALGORITHMS[run.config.algorithm](**run.config.algorithm_settings)
    algorithm.target = 1
    return {"source": tuple(algorithm.plan(0)), "target": tuple(algorithm.plan(1))}


def _phase_text(phase, config: RunConfig) -> tuple[Optional[int], str, str]:
    """(optimizer steps or None for epochs, what it trains, its lr where not the run's: ", lr X"
    or "") of one phase of a run's round."""
    batch = phase.batch_size if phase.batch_size is not None else config.batch_size
    lr = "" if phase.lr is None or phase.lr == config.lr else f", lr {phase.lr:g}"
    if phase.steps is not None:
        return phase.steps, f"{phase.steps} steps", lr
    epochs = phase.epochs if phase.epochs is not None else config.epochs()
    if epochs is None:
        return config.local_steps, f"{config.local_steps} steps", lr
    return None, f"{epochs} epoch{'s' if epochs != 1 else ''} of its training data at batch {batch}", lr


def role_text(run: PlannedRun, phases: tuple) -> str:
    """A role's round in words: "10 optimizer steps", "1 epoch of its training data at batch 16,
    lr 0.001", "10 + 10 optimizer steps" or "2 passes of ..." (two phases), "nothing" (no step)."""
    parts = [part for part in (_phase_text(phase, run.config) for phase in phases) if part[0] != 0]
    if not parts:
        return "nothing"
    if all(steps is not None for steps, _, _ in parts) and len({lr for _, _, lr in parts}) == 1:
        return " + ".join(str(steps) for steps, _, _ in parts) + " optimizer steps" + parts[0][2]
    texts = [what + lr for _, what, lr in parts]
    if len(set(texts)) == 1 and len(texts) > 1:
        return f"{len(texts)} passes of {texts[0]}"
    return " + ".join(texts)


def _role_line(label: str, cell: list[PlannedRun]) -> str:
    """A setting with roles: what a source and what the target train per round, by method."""
    plans = [(r, role_plans(r)) for r in cell if r.seed == cell[0].seed]  # one run per method: seeds train alike
    parts = []
    for role, name in (("source", "a source"), ("target", "the target")):
        by_text: dict[str, list[str]] = {}
        for run, phases in plans:
            by_text.setdefault(role_text(run, phases[role]), []).append(run.method.label)
        parts.append(f"{name} trains " + (next(iter(by_text)) + " (every method)" if len(by_text) == 1 else
                                          ", ".join(f"{text} ({', '.join(methods)})"
                                                    for text, methods in by_text.items())))
    return f"{label}: per round, " + "; ".join(parts)


def budget_lines(runs: list[PlannedRun]) -> list[str]:
    """Each setting's budget per client and round, and which methods split it over phases; in a
    scenario with roles (``fda``), a source's and the target's apart, by method."""
    lines = []
    for label in dict.fromkeys(r.setting.label for r in runs):
        cell = [r for r in runs if r.setting.label == label]
        if cell[0].config.scenario in ROLE_SCENARIOS:
            lines.append(_role_line(label, cell))
            continue
        steps = {run_steps(r) for r in cell}
        if None in steps:
            epochs = sorted({r.config.epochs() for r in cell})
            lines.append(f"{label}: {', '.join(map(str, epochs))} local epoch(s) per client and round "
                         "(a budget in epochs: not equal in steps where methods take several batches a step)")
            continue
        split = sorted({f"{r.method.label} ({_split_text(r)})" for r in cell if r.config.local_steps != run_steps(r)})
        lines.append(f"{label}: {'/'.join(map(str, sorted(steps)))} optimizer steps per client and round for every "
                     "method" + (f"; split over phases: {', '.join(split)}" if split else ""))
    return lines


def _split_text(run: PlannedRun) -> str:
    """How a run splits its budget: the run's local_steps for each phase (pFedMB: '5 per
    phase'), or those and the settings the split gave it (FedRep: 'local_steps 1, head_steps 9')."""
    split = split_budget(run.config.algorithm, run_steps(run))[1]
    if not split:
        return f"{run.config.local_steps} per phase"
    return ", ".join([f"local_steps {run.config.local_steps}",
                      *(f"{name} {run.config.algorithm_settings[name]}" for name in split)])


def describe(paper: Paper, scale: str, seeds: int, out: Path, runs: list[PlannedRun], quick: bool = False) -> str:
    """The plan as text (``--dry-run``): one line per setting, with its methods and run count."""
    settings = settings_of(paper, scale, quick)
    lines = [f"{paper.name} at scale {scale}: {len(runs)} runs ({len(paper.methods)} methods, {len(settings)} "
             f"settings, {seeds} seeds); every config checked"]
    for setting in settings:
        config = next(r.config for r in runs if r.setting is setting)
        local = f"{config.local_steps} steps" if config.local_steps is not None else f"{config.epochs()} epochs"
        lines.append(f"  {setting.label}: {config.dataset}/{config.scenario}, model {config.model}, "
                     f"{config.clients} clients, {config.rounds} rounds × {local} "
                     f"-> {out / slug(setting.label)}/"
                     + ("" if setting.methods is None else f" ({', '.join(setting.methods)})"))
    lines.append("  methods: " + ", ".join(f"{m.label} ({m.algorithm})" for m in paper.methods))
    lines += [f"  budget: {line}" for line in budget_lines(runs)]
    return "\n".join(lines)

"""Run an algorithm from a :class:`RunConfig`: build the federation, loop over rounds, write
the run directory, resume from a checkpoint."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from .algorithms import make_algorithm
from .config import NOT_IN_IDENTITY, RunConfig, check, load_config_file, with_defaults
from .data.run_data import load_run_data
from .engine.distributed import broadcast_from_leader, process_group, world
from .engine.executors import choose_executor
from .engine.federation import EngineSettings, Federation
from .engine.rounds import federation_for, run_round
from .engine.local import LocalSchedule
from .atomic_io import atomic_write_json, finite_json
from .engine.rundir import RunDirectory
from .models import build_client_models, build_model


def default_run_name(config: RunConfig) -> str:
    return f"{config.algorithm}-{config.scenario}-{config.dataset}-seed{config.seed}"


def build(config: RunConfig):
    """(federation, algorithm, partition) for ``config`` (checked first)."""
    check(config)
    dataset, partition = load_run_data(config.dataset, config.scenario, config.clients, seed=config.seed,
                                       root=config.data_root, dataset_options=config.dataset_options,
                                       scenario_options=config.scenario_options,
                                       samples_per_client=config.samples_per_client)
    dataset = partition.apply_transforms(dataset)  # feature-shifted domains, fda's noisy target
    algorithm = make_algorithm(config.algorithm, **config.algorithm_settings)
    torch.manual_seed(config.seed)  # the models' initialization; the same for every client of a cohort
    architectures = partition.architectures
    if architectures is not None:
        models = build_client_models(architectures, input_shape=dataset.input_shape,
                                     num_classes=partition.classes_seen, options=config.model_options)
    else:
        models = build_model(config.model, input_shape=dataset.input_shape, num_classes=partition.classes_seen,
                             **config.model_options)
    epochs = {} if config.local_steps is not None else {"epochs": config.epochs()}
    schedule = LocalSchedule(batch_size=config.batch_size, steps=config.local_steps, **epochs)
    parameters = max(sum(p.numel() for p in m.parameters())
                     for m in (models.values() if isinstance(models, dict) else [models]))
    executor, why = choose_executor(config.executor, device=config.device, parameters=parameters)
    settings = EngineSettings(rounds=config.rounds, sample=config.sample_fraction(), clients_per_round=config.clients_per_round,
                              schedule=schedule, optimizer=config.optimizer_settings(), eval_every=config.eval_every,
                              eval_role=config.eval_role,
                              seed=config.seed, optimizer_state=config.optimizer_state, executor=executor,
                              workers=config.workers, finetune_epochs=config.finetune(),
                              chunk_clients=config.chunk_clients, autocast=config.autocast, cuda_graphs=config.cuda_graphs,
                              batched_conv=config.batched_conv,
                              threaded_hooks=config.executor == "auto" and torch.device(config.device).type == "cpu")
    augment = None
    if config.augment is not None:
        from .data.augment import make_augmentation

        augment = make_augmentation(config.augment, mean=dataset.mean, std=dataset.std)
    fed = federation_for(algorithm, models, dataset.inputs, dataset.labels, partition.clients, settings,
                         keep_head_local=config.head_local(), architectures=architectures, device=config.device,
                         augment=augment, roles=partition.roles)
    fed.executor_choice = {"asked": config.executor, "executor": executor, "why": why}
    return fed, algorithm, partition


class Progress:
    """One status line per run on stderr: round, mean accuracy, elapsed and remaining time."""

    def __init__(self, total: int, label: str, stream=sys.stderr):
        self.total, self.label, self.stream = total, label, stream
        self.start = time.perf_counter()
        self.tty = getattr(stream, "isatty", lambda: False)()

    def update(self, done: int, first: int, accuracy: Optional[float]) -> None:
        elapsed = time.perf_counter() - self.start
        per_round = elapsed / max(done - first, 1)
        remaining = per_round * (self.total - done)
        acc = "-" if accuracy is None else f"{100 * accuracy:.1f}%"
        width = 20
        filled = int(width * done / max(self.total, 1))
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] round {done}/{self.total} "
                f"acc {acc} {elapsed:.1f}s elapsed ~{remaining:.1f}s left")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def run(config: RunConfig, out: Path, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
        stop_after: Optional[int] = None, on_round: Optional[Callable[[dict], None]] = None) -> dict:
    """Run ``config`` into the run directory ``out``; returns the summary.

    ``out`` must be new, empty or one of our runs (see :class:`RunDirectory`); it is locked
    for the whole run, and checked before any data loads.  ``resume``: continue from
    ``out/checkpoint.pt``, which must belong to this directory's run and hold ``config``
    (and the same settings as ``config.json``); a run that stopped before its first
    checkpoint restarts from round 0, said on stderr, and must still hold config.json's
    settings (the round count alone may change either way).  ``overwrite``: replace the run in
    ``out`` (never a directory that is not a run; files in it the run did not write are kept).
    ``stop_after``: stop after that many rounds of this call (tests use it to simulate a kill).

    With ``executor='distributed'`` under torchrun, every rank calls this: rank 0 alone
    touches ``out`` (it checks the directory, reads the checkpoint and sends its config and
    state to the others) and prints; the other ranks run the same rounds silently and return
    the summary of the rounds they ran (``engine.distributed``).
    """
    if resume and overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
    with process_group(config.executor, config.device):
        if world()[0] != 0:
            return _follow(stop_after=stop_after)
        return _lead(config, out, resume=resume, overwrite=overwrite, progress=progress, stop_after=stop_after,
                     on_round=on_round)


def _lead(config: RunConfig, out: Path, *, resume, overwrite, progress, stop_after, on_round) -> dict:
    """:func:`run` on rank 0 (the only process of a run on any other executor)."""
    rundir = RunDirectory(out)
    started = False  # whether the other ranks (if any) got the start message
    try:
        with rundir.claimed():
            identity = rundir.identity()
            if resume and identity is None:
                raise ValueError(f"--resume: {out} holds no run to resume")
            if not resume and identity is not None and not overwrite:
                raise ValueError(f"{out} already holds a run; pass --resume to continue it, --overwrite to replace "
                                 f"it, or choose another --out")
            state = None
            if resume and rundir.checkpoint.exists():
                state = rundir.load_checkpoint()
                saved = _check_resumable(rundir, state, identity["run_id"], config)
            elif resume:
                # Nothing to load, but the settings are checked as a checkpoint's would be: a
                # restart must not take other settings and rewrite config.json with them.
                if rundir.config.exists():  # absent: killed before begin() wrote it, nothing to hold to
                    _check_same_settings(config, _saved_config(rundir))
                print(f"pfl: {out} has no checkpoint (the run stopped before its first one): restarting it from "
                      f"round 0", file=sys.stderr, flush=True)
            # The other ranks build from rank 0's config and load its checkpoint: they never read --out.
            broadcast_from_leader({"config": config, "state": state})
            started = True
            fed, algorithm, partition = build(config)
            if config.executor == "distributed":
                fed.executor_choice["world_size"] = world()[1]
            atomic_write_json(rundir.executor, fed.executor_choice)
            history: list[dict] = []
            if state is not None:
                _load_state(rundir, fed, algorithm, state)
                run_id = identity["run_id"]
                history = rundir.resume_metrics(fed.round)
                _record_resumed_settings(rundir, config, fed.round, saved)
            else:
                if resume:
                    rundir.resume_metrics(0)  # a restart sets the lines of the stopped attempt aside
                run_id = rundir.begin()
                atomic_write_json(rundir.config, config.as_dict())
                partition.save(rundir.partition)
            try:
                return _run_rounds(config, rundir, run_id, fed, algorithm, partition, history, progress=progress,
                                   stop_after=stop_after, on_round=on_round)
            finally:
                fed.close()  # the executor's worker threads
    except Exception as error:
        if not started:  # the other ranks wait for the start: tell them why it will not come
            broadcast_from_leader({"error": str(error)})
        raise


def _follow(*, stop_after) -> dict:
    """:func:`run` on a rank other than 0: rank 0's config and checkpoint, the same rounds, silently."""
    start = broadcast_from_leader()
    if "error" in start:
        raise ValueError(f"rank 0 could not start the run: {start['error']}")
    config, state = start["config"], start["state"]
    fed, algorithm, partition = build(config)
    if state is not None:
        _load_state(None, fed, algorithm, state)
    try:
        return _run_rounds(config, None, None, fed, algorithm, partition, [], progress=False, stop_after=stop_after,
                           on_round=None)
    finally:
        fed.close()


def _load_state(rundir: Optional[RunDirectory], fed: Federation, algorithm, state: dict) -> None:
    try:
        fed.load_state_dict(state["federation"])
        algorithm.load_state_dict(state["algorithm"])
    except (KeyError, TypeError, AttributeError, RuntimeError, ValueError) as error:
        where = rundir.checkpoint if rundir is not None else "the checkpoint"
        raise ValueError(f"--resume: {where} does not fit this run's model and algorithm "
                         f"({type(error).__name__}: {error})") from None


def run_or_keep(config: RunConfig, out: Path, *, progress: bool = True) -> bool:
    """Make sure ``out`` holds ``config``'s finished run: keep a finished run made with the same
    settings (True), resume a stopped one (from round 0 if it has no checkpoint), or start it
    (False).  A finished run with fewer rounds and otherwise the same settings is continued to
    ``config.rounds`` (bitwise a run started with them, ``_record_resumed_settings``).  A finished run with
    other settings is refused: a campaign (``pfl demo``, ``pfl reproduce``) never mixes settings
    into one directory; where and how it ran (``NOT_IN_IDENTITY``: the executor, workers, ...)
    are not settings of the experiment, and a field the saved config lacks (added since) counts
    at its default."""
    previous = RunDirectory(out)
    if previous.is_run() and previous.summary.exists():
        # load_config_file: a missing or truncated config.json is one line naming it
        now, then = json_value(config.as_dict()), with_defaults(load_config_file(previous.config))
        identity = [_but_where(c) for c in (now, then)]
        differences = setting_differences(*identity, ("now", "then"))
        more_rounds = not setting_differences(*map(_but_rounds, identity), ("now", "then")) \
            and now["rounds"] > then["rounds"]
        if differences and not more_rounds:
            raise ValueError(f"{out} holds a finished run with other settings: {', '.join(differences)}; "
                             f"choose another --out")
        if not more_rounds:
            return True
    run(config, out, resume=previous.is_run(), progress=progress)
    return False


def _run_rounds(config, rundir, run_id, fed, algorithm, partition, history, *, progress, stop_after, on_round):
    """The rounds from ``fed.round`` on (metrics, checkpoints, progress), then the summary.
    ``rundir`` None: a distributed run's rank other than 0, which writes and prints nothing."""
    first = fed.round
    bar = Progress(config.rounds, config.algorithm) if progress else None
    wall_start = time.perf_counter()
    try:
        for round_ in range(first, config.rounds):
            if stop_after is not None and round_ - first >= stop_after:
                break
            record = run_round(fed, algorithm, round_).as_dict()
            record["comm_gb"] = fed.comm.gigabits()
            # As metrics.jsonl holds it (NaN and Inf as None), so that the history of a resumed run,
            # read back from that file, is the same as the one kept in memory here.
            record = finite_json(record)
            history.append(record)
            checkpoint = (round_ + 1) % config.checkpoint_every == 0 or round_ + 1 == config.rounds
            if checkpoint:
                fed.executor.sync_state(fed)  # a collective on a distributed run: every rank, before rank 0 saves
            if rundir is None:
                continue
            for client in record["skipped_non_finite"]:
                print(f"{config.algorithm}: round {round_}: client {client}'s update holds NaN or Inf; it is not "
                      f"aggregated and the client keeps its previous state", file=sys.stderr)
            rundir.append_metrics(record)
            if on_round is not None:
                on_round(record)
            if checkpoint:
                # Plain values only (see engine/checkpoint.py); the run id and config let a
                # resume refuse another run's checkpoint or a config.json edited since.
                rundir.save_checkpoint({"run_id": run_id, "config": json_value(config.as_dict()),
                                        "federation": fed.state_dict(), "algorithm": algorithm.state_dict()})
            if bar is not None:
                bar.update(round_ + 1, first, record.get("eval", {}).get("mean_accuracy"))
    finally:
        if rundir is not None:
            _checkpoint_written(rundir, failing=sys.exc_info()[1])
    if bar is not None:
        bar.close()
    summary = summarize(config, history, fed, time.perf_counter() - wall_start, partition.info)
    if fed.round == config.rounds and rundir is not None:
        from .plots import write_plots

        summary["plots"] = write_plots(rundir, history)
        atomic_write_json(rundir.summary, summary)
    return summary


def _checkpoint_written(rundir: RunDirectory, failing: Optional[BaseException]) -> None:
    """Wait for the checkpoint written in the background.  Its write's error is raised, unless
    the run is already stopping on another error (``failing``), which then keeps its place and
    the write's error is said on stderr."""
    if failing is None:
        rundir.wait_for_checkpoint()
        return
    try:
        rundir.wait_for_checkpoint()
    except Exception as error:
        print(f"pfl: the last checkpoint could not be written either ({type(error).__name__}: {error}); "
              f"{rundir.checkpoint} is as it was before that write", file=sys.stderr, flush=True)


def json_value(value):
    """``value`` as it reads back from JSON (tuples become lists), for comparisons."""
    return json.loads(json.dumps(value))


def setting_differences(a: dict, b: dict, names: tuple[str, str], prefix: str = "") -> list[str]:
    """The (dotted) keys whose values differ between two resolved configs, each with both
    values labelled by ``names``: ``lr (given 0.2, saved 0.1)``."""
    differences = []
    for key in sorted(set(a) | set(b), key=str):
        x, y = a.get(key, "<missing>"), b.get(key, "<missing>")
        if isinstance(x, dict) and isinstance(y, dict):
            differences += setting_differences(x, y, names, f"{prefix}{key}.")
        elif x != y:
            differences.append(f"{prefix}{key} ({names[0]} {x!r}, {names[1]} {y!r})")
    return differences


def _check_resumable(rundir: RunDirectory, state: dict, run_id: str, config: RunConfig) -> int:
    """Refuse a checkpoint of another run, a config.json edited since it was written, settings
    other than the checkpoint's (naming what differs), and fewer rounds than it has run.  The
    round count may change, the run then continuing to the new count, and where it runs
    (``_record_resumed_settings``).  Returns config.json's settings (with defaults)."""
    missing = sorted({"run_id", "config", "federation", "algorithm"} - set(state))
    if missing:
        raise ValueError(f"--resume: {rundir.checkpoint} is not a checkpoint of a pfl run (no {missing})")
    if state["run_id"] != run_id:
        raise ValueError(f"--resume: {rundir.checkpoint} belongs to another run (run id {state['run_id']}), not to "
                         f"the run in {rundir.root} (run id {run_id} in {rundir.marker.name}); put back this run's "
                         f"checkpoint, or start over with --overwrite")
    saved, in_checkpoint = _saved_config(rundir), with_defaults(state["config"])
    # rounds and where the run runs may change on --resume (_record_resumed_settings): config.json
    # then names them before the next checkpoint is written.
    edited = setting_differences(_fixed_on_resume(saved), _fixed_on_resume(in_checkpoint),
                                 ("config.json", "checkpoint"))
    if edited:
        raise ValueError(f"--resume: {rundir.config} differs from the settings saved in {rundir.checkpoint} in "
                         f"{', '.join(edited)}; it was changed after the run started: restore it, or start over "
                         f"with --overwrite")
    _check_same_settings(config, in_checkpoint)
    try:
        done = int(state["federation"]["round"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"--resume: {rundir.checkpoint} does not fit this run's model and algorithm (its federation "
                         f"state has no round count)") from None
    if config.rounds < done:
        raise ValueError(f"--resume: {rundir.root} has run {done} rounds already; rounds must be at least {done}, "
                         f"got {config.rounds}")
    return saved


def _saved_config(rundir: RunDirectory) -> dict:
    """The run's ``config.json``, with the fields it lacks at their defaults (``with_defaults``);
    a missing or unreadable one is a one-line ValueError naming it."""
    try:
        return with_defaults(json.loads(rundir.config.read_text()))
    except (OSError, ValueError, TypeError) as error:  # TypeError: JSON that is not an object
        raise ValueError(f"--resume: cannot read {rundir.config} ({error})") from None


def _check_same_settings(config: RunConfig, saved: dict) -> None:
    """Refuse to resume with ``config`` when a setting of the experiment other than the round
    count differs from ``saved`` (a saved config, with defaults), naming each difference.
    Where and how it runs (``NOT_IN_IDENTITY`` but the seed: the data root, the executor, its
    workers, ...) may change, as ``run_or_keep`` keeps a finished run whatever they were."""
    changed = setting_differences(_fixed_on_resume(json_value(config.as_dict())), _fixed_on_resume(saved),
                                  ("given", "saved"))
    if changed:
        raise ValueError(f"--resume: the settings differ from the saved run in {', '.join(changed)}; resume with "
                         f"the same settings (or none: the saved config is used; --rounds may change)")


def _fixed_on_resume(config: dict) -> dict:
    """``config`` without what ``--resume`` may change: the round count and where the run runs."""
    return _but_where(_but_rounds(config))


def _but_rounds(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "rounds"}


def _but_where(config: dict) -> dict:
    """``config`` without where and how the run runs (``NOT_IN_IDENTITY``), its seed kept."""
    return {k: v for k, v in config.items() if k not in NOT_IN_IDENTITY or k == "seed"}


def _record_resumed_settings(rundir: RunDirectory, config: RunConfig, done: int, saved: dict) -> None:
    """config.json takes a resumed run's settings where they changed: a round count (``--resume
    --rounds N``, N at least the rounds done), whose finished run's summary.json then goes until
    it finishes again (a campaign keeps a run with a summary as finished), or where it runs (the
    data root, the executor, ...).  ``saved``: config.json as ``_check_resumable`` read it."""
    if json_value(config.as_dict()) == saved:
        return
    atomic_write_json(rundir.config, config.as_dict())
    if saved["rounds"] != config.rounds:
        rundir.summary.unlink(missing_ok=True)
        print(f"pfl: {rundir.root}: {done} rounds done, continuing to {config.rounds}", file=sys.stderr, flush=True)


def _best(accuracies) -> Optional[float]:
    """The highest of the accuracies that are numbers (an accuracy is None, or NaN before it is
    written, where there was nothing to evaluate); None if there is none."""
    return max((a for a in accuracies if a is not None and math.isfinite(a)), default=None)


def summarize(config: RunConfig, history: list[dict], fed: Federation, wall_s: float,
              scenario_info: Optional[dict] = None) -> dict:
    """Final and best mean personalized accuracy, per-client final accuracy, communication;
    in the fda scenario also the target client's final and best accuracy (FedDAF reports
    the best over rounds)."""
    evals = [(m["round"], m["eval"]) for m in history if "eval" in m]
    final = evals[-1][1] if evals else None
    best = _best(e["mean_accuracy"] for _, e in evals)
    target = {}
    if scenario_info and "target_client" in scenario_info:
        client = scenario_info["target_client"]
        # JSON turns int keys into strings: accept both (a resumed run reads metrics back).
        of = lambda e: e["accuracy"].get(client, e["accuracy"].get(str(client)))
        target = {"target_client": client, "target_final_accuracy": of(final) if final else None,
                  "target_best_accuracy": _best(of(e) for _, e in evals)}
    return {
        "algorithm": config.algorithm, "scenario": config.scenario, "dataset": config.dataset,
        "model": config.model, "seed": config.seed, "clients": config.clients, "rounds": fed.round,
        "final_mean_accuracy": final["mean_accuracy"] if final else None,
        "best_mean_accuracy": best,
        "final_client_accuracy": final["accuracy"] if final else None,
        # The clients whose evaluation diverged in the final round (a non-finite loss): their
        # accuracy is NaN, counted as 0 in the mean.
        "final_diverged_clients": list(final.get("diverged", [])) if final else [],
        "comm_gb": fed.comm.gigabits(),
        "wall_s_this_run": wall_s,
        "train_wall_s_total": sum(m["wall_s"] for m in history),
        **target,
        "config": dataclasses.asdict(config),
    }

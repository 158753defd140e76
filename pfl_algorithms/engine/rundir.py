"""The run directory: what a run writes, each file written so that a kill never corrupts it.

    run.json         the run's identity, written first: format, run id, creation time
    run.lock         locked (flock) while a run writes here, so a second one is refused
    config.json      the resolved configuration
    partition.json   the scenario's manifest (which indices and label map each client got)
    executor.json    the executor this run (or its latest resume) used, and why (``--executor auto``)
    metrics.jsonl    one JSON line per round
    summary.json     final and best mean accuracy, communication in Gb, wall time
    checkpoint.pt    banks, optimizer state and server state after the last checkpointed round,
                     with the run id and the config (see ``checkpoint.py``: checksummed, and
                     read without unpickling anything but tensors and plain values)
    plots/           accuracy vs round, accuracy vs communicated bits, per-client accuracy
                     (``PLOT_FILES``; any other file there is the user's and is kept)
    metrics.jsonl.unused-<time>   lines a resume could not use, set aside (never deleted)

A directory is one of our runs when it holds a valid ``run.json``; any other non-empty
directory is refused, so a run never writes over a user's files.  JSON and checkpoints are
written to a temporary file in the same folder and moved over the old one with
``os.replace`` (atomic on POSIX), so a killed run leaves the previous version; the temporary
file a kill left is removed by the next run that holds the directory's lock.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from ..atomic_io import atomic_write_bytes, atomic_write_json, is_temporary, json_text
from .checkpoint import read_checkpoint
from .checkpoint_writer import CheckpointWriter

RUN_FORMAT = "pfl-run"
RUN_FORMAT_VERSION = 1
# What a run writes, removed when a new run replaces it (the set-aside metrics are kept).
_RUN_FILES = ("config.json", "partition.json", "metrics.jsonl", "summary.json", "checkpoint.pt")
# The PNGs ``plots.write_plots`` writes into plots/, removed likewise: a user's file put there is
# not the run's to delete.
PLOT_FILES = ("accuracy_vs_round.png", "accuracy_vs_bits.png", "client_accuracy.png")


def warn(message: str) -> None:
    """A warning line on stderr."""
    print(f"pfl: warning: {message}", file=sys.stderr, flush=True)


def _metrics_line(record: dict) -> str:
    """One line of metrics.jsonl: strict JSON, a NaN or infinite number (a diverged loss) as null."""
    return json_text(record, sort_keys=True) + "\n"


class RunDirectory:
    """Paths and writers of one run's directory."""

    def __init__(self, root):
        self.root = Path(root)
        self.marker = self.root / "run.json"
        self.lock = self.root / "run.lock"
        self.config = self.root / "config.json"
        self.partition = self.root / "partition.json"
        self.metrics = self.root / "metrics.jsonl"
        self.summary = self.root / "summary.json"
        self.executor = self.root / "executor.json"
        self.checkpoint = self.root / "checkpoint.pt"
        self.plots = self.root / "plots"
        self._writer: Optional[CheckpointWriter] = None

    # ------------------------------------------------------------------ identity and lock

    def identity(self) -> Optional[dict]:
        """The run's ``run.json`` (format, run_id, created); None when the directory is
        missing or empty (a lone lock file aside).

        Raises:
            ValueError: when the path is a file, or a non-empty directory that is not a run
                (no valid ``run.json``): its files are not ours to write over.
        """
        if not self.root.exists():
            return None
        if not self.root.is_dir():
            raise ValueError(f"run directory {self.root} is a file, not a directory; choose another --out")
        if not self.marker.exists():
            entries = sorted(p.name for p in self.root.iterdir() if p != self.lock)
            if not entries:
                return None
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ValueError(f"run directory {self.root} is not empty ({shown}) and is not a pfl run (it has no "
                             f"run.json); refusing to write over its files: choose a new or empty --out")
        try:
            identity = json.loads(self.marker.read_text())
            if identity.get("format") != RUN_FORMAT or not isinstance(identity.get("run_id"), str):
                raise ValueError("no 'format': 'pfl-run' and 'run_id'")
        except (ValueError, AttributeError, UnicodeDecodeError) as error:
            raise ValueError(f"{self.marker}: not a pfl run marker ({error}); refusing to use {self.root}: choose "
                             f"another --out") from None
        return identity

    def is_run(self) -> bool:
        """Whether the directory holds one of our runs (a valid ``run.json``)."""
        try:
            return self.identity() is not None
        except ValueError:
            return False

    @contextlib.contextmanager
    def claimed(self):
        """Create the directory if needed and hold its lock for the ``with`` block.

        Checked before anything is loaded, each a one-line ValueError naming the directory:
        a path that is a file, a non-empty directory that is not a run, a directory that
        cannot be written, and one another run holds (the lock is taken without waiting).
        When the block ends before a run was started here (no ``run.json``), what this made
        is removed again, so a failed start leaves nothing behind.
        """
        self.identity()  # refuse a file or someone else's directory before touching it
        created = not self.root.exists()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as error:
            raise ValueError(f"run directory {self.root} cannot be written ({error.strerror}); choose another "
                             f"--out") from None
        held = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # A lock file unlinked (by a failed start) after we opened it locks nothing.
                held = os.fstat(fd).st_ino == os.stat(self.lock).st_ino
            except (BlockingIOError, FileNotFoundError):
                held = False
            if not held:
                raise ValueError(f"run directory {self.root} is in use by another pfl run (it holds "
                                 f"{self.lock.name}); wait for that run to end or choose another --out")
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise ValueError(f"run directory {self.root} cannot be written (permission denied); choose "
                                 f"another --out")
            if self.marker.exists():
                self._remove_temporaries()
            yield self
        finally:
            if held and not self.marker.exists():
                with contextlib.suppress(OSError):
                    self.lock.unlink()
                    if created:
                        self.root.rmdir()
            os.close(fd)

    def begin(self) -> str:
        """Make the directory a new run: a new ``run.json`` (written first, so that a kill
        from here on leaves a directory recognized as ours), then the files of a run it
        replaces removed (its temporary files went when the lock was taken: :meth:`claimed`,
        under which every run begins).  Only the files a run writes go: any other file in the
        directory or in plots/ is kept, and plots/ itself only goes when that leaves it empty.
        Returns the new run id."""
        identity = {"format": RUN_FORMAT, "version": RUN_FORMAT_VERSION, "run_id": uuid.uuid4().hex,
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        atomic_write_json(self.marker, identity)
        for name in _RUN_FILES:
            with contextlib.suppress(FileNotFoundError):
                (self.root / name).unlink()
        for name in PLOT_FILES:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # no plots/, or a file so named
                (self.plots / name).unlink()
        with contextlib.suppress(OSError):  # not empty (a user's file) or absent: left as it is
            self.plots.rmdir()
        return identity["run_id"]

    def _remove_temporaries(self) -> None:
        """Remove the temporary files of atomic writes a kill cut short (a checkpoint's is as
        large as the checkpoint): with the lock held, no writer of ours is alive to finish one.
        Only files named as ``atomic_file`` names them are touched."""
        for tmp in self.root.glob(".*.tmp"):
            if is_temporary(tmp.name):
                tmp.unlink(missing_ok=True)

    # ------------------------------------------------------------------ metrics

    def append_metrics(self, record: dict) -> None:
        """Append one round's line (flushed and synced, so a kill loses at most that line)."""
        with self.metrics.open("a") as f:
            f.write(_metrics_line(record))
            f.flush()
            os.fsync(f.fileno())

    def resume_metrics(self, rounds: int) -> list[dict]:
        """The lines of rounds < ``rounds`` (those the checkpoint covers), one per round in
        order; ``metrics.jsonl`` is rewritten with them.  Every other line (unreadable, of a
        round the checkpoint lacks, or a repeated round) is moved to
        ``metrics.jsonl.unused-<time>``, with a warning, never deleted."""
        if not self.metrics.exists():
            return []
        kept: dict[int, dict] = {}
        unused: list[bytes] = []
        reasons = {"unreadable": 0, "of a round the checkpoint lacks": 0, "repeating a round": 0}
        for line in self.metrics.read_bytes().splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                round_ = record["round"]
                if not isinstance(round_, int) or isinstance(round_, bool):
                    raise TypeError("round is not an integer")
            except (ValueError, KeyError, TypeError):
                reason = "unreadable"
            else:
                reason = ("of a round the checkpoint lacks" if not 0 <= round_ < rounds
                          else "repeating a round" if round_ in kept else None)
                if reason is None:
                    kept[round_] = record
                    continue
            reasons[reason] += 1
            unused.append(line)
        if unused:
            aside = self._unused_metrics_path()
            atomic_write_bytes(aside, b"".join(line + b"\n" for line in unused))
            counts = ", ".join(f"{n} {why}" for why, n in reasons.items() if n)
            warn(f"{self.metrics}: {len(unused)} line(s) resuming from round {rounds} cannot use ({counts}) were "
                 f"moved to {aside}")
        missing = sorted(set(range(rounds)) - set(kept))
        if missing:
            warn(f"{self.metrics}: no readable line for round(s) {missing}; the summary is computed without them")
        history = [kept[r] for r in sorted(kept)]
        atomic_write_bytes(self.metrics, "".join(map(_metrics_line, history)).encode())
        return history

    def _unused_metrics_path(self) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        path, n = self.root / f"{self.metrics.name}.unused-{stamp}", 1
        while path.exists():
            path, n = self.root / f"{self.metrics.name}.unused-{stamp}-{n}", n + 1
        return path

    # ------------------------------------------------------------------ checkpoint

    def save_checkpoint(self, state: dict) -> None:
        """Write ``state`` (plain values and tensors) as the checkpoint, atomically, on a
        background thread (``checkpoint_writer.py``): :meth:`wait_for_checkpoint` before the
        file is read or the run ends."""
        if self._writer is None:
            self._writer = CheckpointWriter()
        self._writer.save(self.checkpoint, state)

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written is on disk; raise its write's error."""
        if self._writer is not None:
            self._writer.wait()

    def load_checkpoint(self) -> dict:
        """The checkpoint's state, verified (see :func:`read_checkpoint`)."""
        self.wait_for_checkpoint()
        if not self.checkpoint.exists():
            raise ValueError(f"--resume: no checkpoint at {self.checkpoint}")
        return read_checkpoint(self.checkpoint)

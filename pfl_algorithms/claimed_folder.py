"""An output folder a campaign command (``pfl reproduce``, ``pfl demo``) makes its own, or refuses.

A marker file (``reproduce.json``, ``demo.json``) is written first, before any run starts: it
names the command and what the folder holds (``identity``), and lists every report file the
command may replace (``written``).  A later call continues the folder only for the same
identity; a non-empty folder without the marker is not ours and is refused (one line naming
it), so a user's ``report.md`` or ``plots/`` is never written over.  Before a report is
written, each of its files is added to ``written`` (marker first, then the file: a kill in
between leaves a name listed that may not exist, which is harmless); an existing file not
listed there was not written by the command and is refused, never replaced.

A folder an older version made before its command had a marker is adopted only where the
command recognises every entry in it (``adopt``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from .atomic_io import atomic_write_json

SEED_FOLDER = re.compile(r"seed\d+")  # a campaign's run folder per seed: seed0, seed1, ...


@dataclass(frozen=True)
class FolderKind:
    """Whose folder: the marker's file name and format, and the command as messages name it."""

    marker: str  # e.g. "reproduce.json"
    format: str  # the marker's "format" value, e.g. "pfl-reproduce"
    command: str  # e.g. "pfl reproduce"
    version: int = 1


def read_marker(kind: FolderKind, out: Path) -> Optional[dict]:
    """The folder's marker (None without one).

    Raises:
        ValueError: naming the file, when it is not a marker this command wrote.
    """
    marker = out / kind.marker
    if not marker.exists():
        return None
    try:
        value = json.loads(marker.read_text())
        if not isinstance(value, dict) or value.get("format") != kind.format or not isinstance(value.get("written"), list):
            raise ValueError(f"no 'format': {kind.format!r} and 'written' list")
    except (OSError, ValueError) as error:
        raise ValueError(f"{marker}: not a {kind.command} marker ({error}); refusing to write into {out}: choose "
                         f"another --out") from None
    return value


def only_runs(folder: Path, is_run_path: Callable[[tuple], bool]) -> bool:
    """Whether every file below ``folder`` lies in a run directory of the command's layout.
    ``is_run_path(parts)`` gets a file's path parts (relative to ``folder``) and returns how
    many leading parts name its run directory, 0 when the path is not in the layout.  That
    directory must hold ``run.json``, or the file must be a lone ``run.lock`` left by a kill."""
    for path in folder.rglob("*"):
        if path.is_dir():
            continue
        parts = path.relative_to(folder).parts
        depth = is_run_path(parts)
        if not depth or len(parts) <= depth:
            return False
        run = folder.joinpath(*parts[:depth])
        if not (run / "run.json").is_file() and parts[depth:] != ("run.lock",):
            return False
    return True


def claim_folder(kind: FolderKind, out: Path, identity: dict, what: Callable[[dict], str],
                 adopt: Callable[[list], Optional[list]], *, write: bool = True) -> None:
    """Check that ``out`` may hold the command's output for ``identity`` (missing, empty, or
    its folder for the same identity) and, with ``write``, make it ours: the marker first.
    ``what(identity)`` names a command line in messages; ``adopt(entries)`` gives the report
    files of a folder an older version made (listed as ours), or None when the folder is not one.

    Raises:
        ValueError: one line naming the folder, when it is a file, someone else's non-empty
            folder, or the command's folder for another identity.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
    marker = read_marker(kind, out) if out.exists() else None
    if marker is not None:
        theirs = {k: marker.get(k) for k in identity}
        if theirs != identity:
            raise ValueError(f"--out {out} is the folder of {what(theirs)}, not of {what(identity)}; "
                             f"choose another --out")
        return
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    written: list = []
    if entries:
        adopted = adopt(entries)
        if adopted is None:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ValueError(f"--out {out} is not empty ({shown}) and is not a folder of {what(identity)} "
                             f"(it has no {kind.marker}); refusing to write into it: choose a new or empty --out")
        written = list(adopted)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / kind.marker, {"format": kind.format, "version": kind.version, **identity,
                                              "written": written})


def claim_files(kind: FolderKind, out: Path, files: Iterable[Path]) -> None:
    """Before the command writes ``files`` (in ``out``): refuse any that exists and was not
    written by the command (not in the marker's ``written``), then list them all there.

    Raises:
        ValueError: one line naming the first such file.
    """
    marker = read_marker(kind, out)
    if marker is None:
        raise ValueError(f"{out} has no {kind.marker}: the report is written only into a folder `{kind.command}` made")
    written = list(marker["written"])
    names = [str(Path(f).relative_to(out)) for f in files]
    for name in names:
        if name not in written and (out / name).exists():
            raise ValueError(f"{out / name} was not written by `{kind.command}`; refusing to replace it: move it "
                             f"away and run the command again")
    new = [n for n in names if n not in written]
    if new:
        atomic_write_json(out / kind.marker, {**marker, "written": written + new})


def remove_written(kind: FolderKind, out: Path, files: Iterable[Path]) -> None:
    """Delete those of ``files`` (in ``out``) that the command wrote (listed in the marker's
    ``written``); a file not listed there is not the command's and is left as it is."""
    written = set(read_marker(kind, out)["written"])
    for path in files:
        if str(Path(path).relative_to(out)) in written:
            Path(path).unlink(missing_ok=True)


def plots_of(out: Path) -> list:
    """The ``plots/*.png`` of an adopted folder, as names relative to it."""
    return sorted(str(p.relative_to(out)) for p in (out / "plots").glob("*.png"))


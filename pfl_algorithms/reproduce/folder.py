"""The folder of a reproduction (``pfl reproduce --out``): ours, or refused.

``reproduce.json`` is written first, before any run starts: it says which paper, scale and
variant the folder reproduces, and lists every file of the report this command may replace
(``written``).  A later call resumes the folder only for the same paper, scale and variant;
a non-empty folder without the marker is not ours and is refused (one line naming it), so a
user's ``report.md`` or ``plots/`` is never written over.  Before the report is written,
each of its files is added to ``written`` (marker first, then the file: a kill in between
leaves a name listed that may not exist, which is harmless); an existing file not listed
there was not written by us and is refused, never replaced.

A folder made before the marker existed (its runs, and a report whose ``report.json`` names
the same paper and scale) is recognised by its contents and adopted.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Optional

from ..atomic_io import atomic_write_json
from .campaign import method_folder, settings_of, slug
from .papers import Paper

MARKER = "reproduce.json"
FORMAT = "pfl-reproduce"
VERSION = 1
REPORT_FILES = ("report.md", "report.json")


def _what(paper: str, scale: str, quick: bool) -> str:
    return f"`pfl reproduce {paper} --scale {scale}{' --quick' if quick else ''}`"


def _identity(paper: Paper, scale: str, quick: bool) -> dict:
    return {"paper": paper.name, "scale": scale, "quick": bool(quick)}


def read_marker(out: Path) -> Optional[dict]:
    """The folder's ``reproduce.json`` (None without one).

    Raises:
        ValueError: naming the file, when it is not a marker this command wrote.
    """
    marker = out / MARKER
    if not marker.exists():
        return None
    try:
        value = json.loads(marker.read_text())
        if not isinstance(value, dict) or value.get("format") != FORMAT or not isinstance(value.get("written"), list):
            raise ValueError(f"no 'format': {FORMAT!r} and 'written' list")
    except (OSError, ValueError) as error:
        raise ValueError(f"{marker}: not a pfl reproduce marker ({error}); refusing to write into {out}: choose "
                         f"another --out") from None
    return value


def _legacy_report(out: Path, identity: dict) -> bool:
    """Whether ``out``'s report.json is one this command wrote for ``identity`` (a folder made
    before the marker existed)."""
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        return False
    # quick: absent from the oldest reports, which had no --quick
    return isinstance(report, dict) and {k: report.get(k, False if k == "quick" else None)
                                         for k in identity} == identity


def _only_runs(folder: Path, methods: set) -> bool:
    """Whether every file below a setting's folder lies in a run directory of the campaign's
    layout (``<method>/seed<S>/`` holding ``run.json``, or a lone ``run.lock`` left by a kill)."""
    for path in folder.rglob("*"):
        if path.is_dir():
            continue
        parts = path.relative_to(folder).parts
        if len(parts) < 3 or parts[0] not in methods or not re.fullmatch(r"seed\d+", parts[1]):
            return False
        run = folder / parts[0] / parts[1]
        if not (run / "run.json").is_file() and parts[2:] != ("run.lock",):
            return False
    return True


def claim_folder(paper: Paper, scale: str, out: Path, *, quick: bool = False, write: bool = True) -> None:
    """Check that ``out`` may hold this reproduction (missing, empty, or ours for the same
    paper, scale and variant) and, with ``write``, make it ours: ``reproduce.json`` first.

    Raises:
        ValueError: one line naming the folder, when it is a file, someone else's non-empty
            folder, or the folder of another reproduction.
    """
    identity = _identity(paper, scale, quick)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
    marker = read_marker(out) if out.exists() else None
    if marker is not None:
        theirs = {k: marker.get(k) for k in identity}
        if theirs != identity:
            raise ValueError(f"--out {out} is the folder of {_what(theirs['paper'], theirs['scale'], theirs['quick'])}, "
                             f"not of {_what(paper.name, scale, quick)}; choose another --out")
        return
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    written: list[str] = []
    if entries:
        settings = {slug(s.label) for s in settings_of(paper, scale, quick)}
        methods = {method_folder(paper, m) for m in paper.methods}
        report = [e for e in entries if e in (*REPORT_FILES, "plots")]
        runs = [e for e in entries if e in settings and (out / e).is_dir()]
        ours = (len(report) + len(runs) == len(entries) and all(_only_runs(out / e, methods) for e in runs)
                and (not report or _legacy_report(out, identity)))
        if not ours:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ValueError(f"--out {out} is not empty ({shown}) and is not a folder of "
                             f"{_what(paper.name, scale, quick)} (it has no {MARKER}); refusing to write into it: "
                             f"choose a new or empty --out")
        # An older version's folder: its report files are ours (report.json says so).
        written = [e for e in report if e in REPORT_FILES]
        if "plots" in report:
            written += sorted(str(p.relative_to(out)) for p in (out / "plots").glob("*.png"))
    if write:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / MARKER, {"format": FORMAT, "version": VERSION, **identity, "written": written})


def claim_files(out: Path, files: Iterable[Path]) -> None:
    """Before the report writes ``files`` (in ``out``): refuse any that exists and was not
    written by this command (not in the marker's ``written``), then list them all there.

    Raises:
        ValueError: one line naming the first such file.
    """
    marker = read_marker(out)
    if marker is None:
        raise ValueError(f"{out} has no {MARKER}: the report is written only into a folder `pfl reproduce` made")
    written = list(marker["written"])
    names = [str(Path(f).relative_to(out)) for f in files]
    for name in names:
        if name not in written and (out / name).exists():
            raise ValueError(f"{out / name} was not written by `pfl reproduce`; refusing to replace it: move it "
                             f"away and run the command again")
    new = [n for n in names if n not in written]
    if new:
        atomic_write_json(out / MARKER, {**marker, "written": written + new})

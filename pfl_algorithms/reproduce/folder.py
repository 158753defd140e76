"""The folder of a reproduction (``pfl reproduce --out``): ours, or refused (the rules are
``claimed_folder.py``'s, shared with ``pfl demo``).

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
from pathlib import Path
from typing import Iterable, Optional

from .. import claimed_folder as claimed
from .campaign import method_folder, settings_of, slug
from .papers import Paper

MARKER = "reproduce.json"
KIND = claimed.FolderKind(marker=MARKER, format="pfl-reproduce", command="pfl reproduce")
REPORT_FILES = ("report.md", "report.json")


def _what(identity: dict) -> str:
    return f"`pfl reproduce {identity['paper']} --scale {identity['scale']}{' --quick' if identity['quick'] else ''}`"


def _identity(paper: Paper, scale: str, quick: bool) -> dict:
    return {"paper": paper.name, "scale": scale, "quick": bool(quick)}


def read_marker(out: Path) -> Optional[dict]:
    """The folder's ``reproduce.json`` (None without one).

    Raises:
        ValueError: naming the file, when it is not a marker this command wrote.
    """
    return claimed.read_marker(KIND, out)


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


def _adopt(paper: Paper, scale: str, quick: bool, out: Path, entries: list) -> Optional[list]:
    """The report files of a folder an older version made for this reproduction (its runs in
    the campaign's layout ``<setting>/<method>/seed<S>/``, and a report whose report.json names
    the same paper, scale and variant), or None when the folder is not one."""
    settings = {slug(s.label) for s in settings_of(paper, scale, quick)}
    methods = {method_folder(paper, m) for m in paper.methods}

    def run_depth(parts: tuple) -> int:
        return 2 if len(parts) >= 3 and parts[0] in methods and claimed.SEED_FOLDER.fullmatch(parts[1]) else 0

    report = [e for e in entries if e in (*REPORT_FILES, "plots")]
    runs = [e for e in entries if e in settings and (out / e).is_dir()]
    ours = (len(report) + len(runs) == len(entries) and all(claimed.only_runs(out / e, run_depth) for e in runs)
            and (not report or _legacy_report(out, _identity(paper, scale, quick))))
    if not ours:
        return None
    # Its report files are ours (report.json says so).
    return [e for e in report if e in REPORT_FILES] + (claimed.plots_of(out) if "plots" in report else [])


def claim_folder(paper: Paper, scale: str, out: Path, *, quick: bool = False, write: bool = True) -> None:
    """Check that ``out`` may hold this reproduction (missing, empty, or ours for the same
    paper, scale and variant) and, with ``write``, make it ours: ``reproduce.json`` first.

    Raises:
        ValueError: one line naming the folder, when it is a file, someone else's non-empty
            folder, or the folder of another reproduction.
    """
    claimed.claim_folder(KIND, out, _identity(paper, scale, quick), _what,
                         lambda entries: _adopt(paper, scale, quick, out, entries), write=write)


def claim_files(out: Path, files: Iterable[Path]) -> None:
    """Before the report writes ``files`` (in ``out``): refuse any that exists and was not
    written by this command (not in the marker's ``written``), then list them all there.

    Raises:
        ValueError: one line naming the first such file.
    """
    claimed.claim_files(KIND, out, files)

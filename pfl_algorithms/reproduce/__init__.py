"""``pfl reproduce <paper>``: regenerate a paper's table (``papers.py`` says what runs,
``campaign.py`` runs it resumably, ``report.py`` writes ``report.md`` and its plots)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional, Union

from .papers import PAPERS, SCALES, Paper

__all__ = ["PAPERS", "SCALES", "Paper", "reproduce"]


def reproduce(paper: str, *, scale: str = "cpu", seeds: Optional[int] = None, out: Optional[Union[str, Path]] = None,
              data_root: Optional[str] = None, device: str = "cpu", dry_run: bool = False,
              progress: bool = True, quick: bool = False) -> Union[Path, str]:
    """Run every method of ``paper``'s table over every setting of ``scale`` for ``seeds``
    seeds (default 5; ``quick``: 3), the same seeds 0..seeds-1 for every method, into ``out``
    (default ``runs/reproduce-<paper>-<scale>[-quick]``), keeping finished runs and resuming
    stopped ones, then write ``out/report.md`` and ``out/report.json``; returns the report's
    path.  ``out`` must be new, empty or this reproduction's own folder (``folder.py``: its
    ``reproduce.json`` names the paper, scale and variant): anything else is refused, and the
    report never replaces a file this command did not write.  ``quick``: the CPU scale's quick columns at 10 rounds.  ``dry_run``: check every
    run's config and return the plan as text, training nothing."""
    from ..data.datasets import reuse_loaded_datasets
    from ..runner import run_or_keep
    from .campaign import describe, plan
    from .folder import claim_folder
    from .papers import DEFAULT_SEEDS, QUICK_SEEDS
    from .report import write_report

    if paper not in PAPERS:
        raise ValueError(f"paper must be one of {', '.join(PAPERS)}, got {paper!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    if seeds is None:
        seeds = QUICK_SEEDS if quick else DEFAULT_SEEDS
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be a positive integer, got {seeds!r}")
    spec = PAPERS[paper]
    out = Path(out) if out is not None else Path("runs") / f"reproduce-{paper}-{scale}{'-quick' if quick else ''}"
    runs = plan(spec, scale, seeds, out, data_root=data_root, device=device, quick=quick)
    # A non-empty --out must be this reproduction's own folder; reproduce.json marks it, first.
    claim_folder(spec, scale, out, quick=quick, write=not dry_run)
    if dry_run:
        return describe(spec, scale, seeds, out, runs, quick=quick)
    with reuse_loaded_datasets():  # each dataset read once per campaign, not once per run
        for index, run in enumerate(runs, 1):
            if progress:
                print(f"[{index}/{len(runs)}] {run.setting.label}, {run.method.label}, seed {run.seed}",
                      file=sys.stderr, flush=True)
            run_or_keep(run.config, run.out, progress=progress)
    command = shlex.join(["pfl", "reproduce", paper, "--scale", scale, "--seeds", str(seeds),
                          *(["--quick"] if quick else [])])
    return write_report(spec, scale, seeds, runs, out, command, quick=quick)

"""What ``pfl list`` and the ``--help`` pages say about the registries, without importing torch.

The registries (algorithms, scenarios, datasets, models, augmentations) fill as their modules
are imported, and those modules import torch: about 1.5 s of CPU that ``pfl list`` and ``pfl
run --help`` would spend before printing a line.  So the names and one-line descriptions, and
RunConfig's defaults (``config`` imports every registry), are cached in
``__pycache__/pfl-catalog.json`` beside this file, under a fingerprint of the size and
modification time of every source file of the package.  An edit anywhere changes the
fingerprint and the next call rebuilds the cache from the registries themselves, so it never
describes other code than what would run.  A process that has imported ``config`` already
(the other commands, tests) reads the registries directly, and so does one that cannot write
the cache.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CACHE = PACKAGE / "__pycache__" / "pfl-catalog.json"
_FORMAT = 1  # bump when the catalog's layout changes, so an old cache is rebuilt
_from_cache = None  # this process's catalog read from (or written to) the cache


def catalog() -> dict:
    """``{"algorithms": {name: description}, "scenarios": ..., "datasets": ..., "models": ...,
    "augmentations": ..., "run_defaults": {RunConfig field: default}}``, in registry order."""
    if "pfl_algorithms.config" in sys.modules:  # torch and the registries are loaded anyway
        return _live()
    return _cached()


def _cached() -> dict:
    """The catalog from the cache if its fingerprint is the sources' own, else from the
    registries (then written to the cache); read once per process."""
    global _from_cache
    if _from_cache is None:
        fingerprint = _fingerprint()
        try:
            cached = json.loads(CACHE.read_text())
            if cached["fingerprint"] == fingerprint:
                _from_cache = cached["catalog"]
                return _from_cache
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: rebuild it
            pass
        _from_cache = _live()
        _write_cache({"fingerprint": fingerprint, "catalog": _from_cache})
    return _from_cache


def _live() -> dict:
    """The catalog read from the registries themselves (imports torch)."""
    import dataclasses

    from .algorithms import ALGORITHMS
    from .config import RunConfig
    from .data import AUGMENTATIONS, DATASETS, SCENARIOS
    from .models import MODELS

    def described(registry):
        return {name: entry.description for name, entry in registry.items()}

    return {"algorithms": described(ALGORITHMS), "scenarios": described(SCENARIOS), "datasets": described(DATASETS),
            "models": described(MODELS), "augmentations": described(AUGMENTATIONS),
            # Read back from JSON, as the cache gives them (floats stay floats: 1.0 prints 1.0).
            "run_defaults": json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(RunConfig)
                                                   if f.default is not dataclasses.MISSING}))}


def _fingerprint() -> list:
    """[format, python version, then (path, size, mtime in ns) of every .py file of the package]."""
    files = []

    def walk(folder: str) -> None:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        walk(entry.path)
                elif entry.name.endswith(".py"):
                    stat = entry.stat()
                    files.append([os.path.relpath(entry.path, PACKAGE), stat.st_size, stat.st_mtime_ns])

    walk(str(PACKAGE))
    return [_FORMAT, list(sys.version_info[:2]), *sorted(files)]


def _write_cache(content: dict) -> None:
    """Write the cache atomically (concurrent commands each write a whole file); a package
    folder we may not write to (a system-wide install) just goes without one."""
    from .atomic_io import atomic_write_bytes

    try:
        atomic_write_bytes(CACHE, json.dumps(content).encode())
    except OSError:
        pass

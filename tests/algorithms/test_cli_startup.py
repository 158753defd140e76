"""``pfl list`` and the ``--help`` pages answer without importing torch (it cost 1.5 s of CPU
before the first line), from ``catalog``'s cache, which always says what the registries say."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pfl_algorithms import catalog as catalog_module
from pfl_algorithms.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout


@pytest.mark.parametrize("argv", [["list"], ["run", "--help"], ["--help"]])
def test_list_and_help_import_no_torch(argv):
    code = ("import io, contextlib, sys\nfrom pfl_algorithms.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n    code = main({argv!r})\n"
            "print(code, sorted(m for m in ('torch', 'numpy', 'pfl_algorithms.config', 'pfl_kernels') if m in sys.modules))")
    # The first call may build the cache (after any edit of the package's sources); a file edited
    # by someone else between two calls rebuilds it again, hence a few tries.
    for _ in range(3):
        out = _python(code)
        if out.strip() == "0 []":
            break
    assert out.strip() == "0 []", f"pfl {' '.join(argv)} imported {out}"


def test_the_cache_says_what_the_registries_say():
    from_cache = json.loads(_python("import json\nfrom pfl_algorithms.catalog import catalog\n"
                                    "print(json.dumps(catalog()))"))
    live = catalog_module._live()
    assert from_cache == live
    assert list(from_cache["algorithms"]) == list(live["algorithms"])  # the order `pfl list` prints
    assert live["run_defaults"]["lr"] == RunConfig.lr and live["run_defaults"]["executor"] is None


def test_an_edited_source_rebuilds_the_cache(tmp_path, monkeypatch):
    package = tmp_path / "package"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(catalog_module, "PACKAGE", package)
    monkeypatch.setattr(catalog_module, "CACHE", package / "__pycache__" / "pfl-catalog.json")
    monkeypatch.setattr(catalog_module, "_from_cache", None)
    monkeypatch.setattr(catalog_module, "_live", lambda: {"algorithms": {"a": "built"}})
    before = catalog_module._fingerprint()
    assert catalog_module._cached() == {"algorithms": {"a": "built"}}
    assert json.loads(catalog_module.CACHE.read_text())["fingerprint"] == before

    # A cache whose fingerprint is the sources' own is read, not rebuilt.
    monkeypatch.setattr(catalog_module, "_from_cache", None)
    catalog_module.CACHE.write_text(json.dumps({"fingerprint": before, "catalog": {"algorithms": {"a": "cached"}}}))
    assert catalog_module._cached() == {"algorithms": {"a": "cached"}}

    # An edit (a new modification time) changes the fingerprint: the cache is rebuilt.
    stat = (package / "sub" / "a.py").stat()
    os.utime(package / "sub" / "a.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert catalog_module._fingerprint() != before
    monkeypatch.setattr(catalog_module, "_from_cache", None)
    assert catalog_module._cached() == {"algorithms": {"a": "built"}}

    # So does a corrupt cache file.
    monkeypatch.setattr(catalog_module, "_from_cache", None)
    catalog_module.CACHE.write_text("{not json")
    assert catalog_module._cached() == {"algorithms": {"a": "built"}}


def test_help_never_says_default_none_beside_its_own_default():
    """An option whose help states its default (``--seeds``: 5, or 3 with --quick) does not also
    get argparse's '(default: None)'."""
    from pfl_algorithms.cli import _parser

    for command in ("reproduce", "demo"):
        text = _parser()._subparsers._group_actions[0].choices[command].format_help()
        assert "(default: None)" not in " ".join(text.split()), command

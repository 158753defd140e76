"""setup.py's build options, read from what it hands setuptools (nothing is compiled)."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[1]


def _setup_arguments(monkeypatch, **env):
    """The keyword arguments setup.py passes to setuptools.setup under the environment ``env``."""
    for name in ("PFL_KERNELS_SKIP_EXTENSION", "PFL_KERNELS_CUDA", "PFL_KERNELS_OPT_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    monkeypatch.chdir(ROOT)  # setup.py globs csrc/ relative to the working folder
    runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
    return seen


@pytest.mark.parametrize("level,flag", [(None, "-O3"), ("", "-O3"), ("1", "-O1"), ("0", "-O0")])
def test_opt_level_sets_the_compilers_flag(monkeypatch, level, flag):
    env = {} if level is None else {"PFL_KERNELS_OPT_LEVEL": level}
    (extension,) = _setup_arguments(monkeypatch, PFL_KERNELS_CUDA="0", **env)["ext_modules"]
    cxx = extension.extra_compile_args["cxx"]
    assert [f for f in cxx if f.startswith("-O")] == [flag]
    assert extension.sources and all(Path(ROOT, s).exists() for s in extension.sources)


@pytest.mark.parametrize("level", ["4", " 1"])
def test_a_bad_opt_level_is_refused_in_one_line(level):
    proc = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--version"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PFL_KERNELS_OPT_LEVEL": level})
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"PFL_KERNELS_OPT_LEVEL must be 0, 1, 2 or 3, got {level!r}"

"""setup.py's build options, read from what it hands setuptools (nothing is compiled)."""
from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[1]


def _setup_arguments(monkeypatch, tmp_path, **env):
    """The keyword arguments setup.py passes to setuptools.setup under the environment ``env``,
    run in a copy of setup.py and csrc/ (a unity build writes its units under the working folder)."""
    return _run_setup(monkeypatch, tmp_path, **env)[0]


def _run_setup(monkeypatch, tmp_path, **env):
    """(setuptools.setup's keyword arguments, setup.py's globals) of a run of setup.py as
    _setup_arguments runs it."""
    for name in ("PFL_KERNELS_SKIP_EXTENSION", "PFL_KERNELS_CUDA", "PFL_KERNELS_OPT_LEVEL", "PFL_KERNELS_UNITY",
                 "MAX_JOBS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if not (tmp_path / "csrc").exists():
        shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
        shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    monkeypatch.chdir(tmp_path)  # setup.py globs csrc/ relative to the working folder
    names = runpy.run_path(str(tmp_path / "setup.py"), run_name="setup")
    return seen, names


def _cpp_sources() -> list[str]:
    """Every C++ source of the extension, as setup.py names them (relative, sorted)."""
    return sorted(str(p.relative_to(ROOT)) for folder in ("csrc", "csrc/autograd", "csrc/cpu")
                  for p in (ROOT / folder).glob("*.cpp"))


@pytest.mark.parametrize("level,flag", [(None, "-O3"), ("", "-O3"), ("1", "-O1"), ("0", "-O0")])
def test_opt_level_sets_the_compilers_flag(monkeypatch, tmp_path, level, flag):
    env = {} if level is None else {"PFL_KERNELS_OPT_LEVEL": level}
    (extension,) = _setup_arguments(monkeypatch, tmp_path, PFL_KERNELS_CUDA="0", **env)["ext_modules"]
    cxx = extension.extra_compile_args["cxx"]
    assert [f for f in cxx if f.startswith("-O")] == [flag]
    assert extension.sources and all(Path(tmp_path, s).exists() for s in extension.sources)


def _unit_members(path: Path) -> list[str]:
    """The sources a unity unit #includes, relative to the root it was written under."""
    root = path.parents[2]
    return [str((path.parent / m).resolve().relative_to(root.resolve()))
            for m in re.findall(r'^#include "(.*)"$', path.read_text(), flags=re.M)]


@pytest.mark.parametrize("env,unity", [({"PFL_KERNELS_UNITY": "1"}, True), ({"PFL_KERNELS_UNITY": "0"}, False),
                                       ({"MAX_JOBS": "2"}, True), ({"MAX_JOBS": "3"}, True),
                                       ({"MAX_JOBS": "4"}, False), ({"MAX_JOBS": "16"}, False),
                                       ({"MAX_JOBS": "16", "PFL_KERNELS_UNITY": "1"}, True)])
def test_the_unity_build_compiles_every_source_once_in_two_units(monkeypatch, tmp_path, env, unity):
    """On fewer than 4 jobs (or asked) the sources compile as two units that include every
    C++ file exactly once, the listed second unit's files there; else file by file."""
    arguments, names = _run_setup(monkeypatch, tmp_path, PFL_KERNELS_CUDA="0", **env)
    (extension,) = arguments["ext_modules"]
    if not unity:
        assert extension.sources == _cpp_sources()
        return
    assert extension.sources == ["build/pfl-unity/unit1.cpp", "build/pfl-unity/unit2.cpp"]
    first, second = (_unit_members(tmp_path / s) for s in extension.sources)
    assert sorted(first + second) == _cpp_sources() and len(set(first + second)) == len(first + second)
    assert second == sorted(names["UNITY_SECOND"])


def test_an_unchanged_unit_is_not_rewritten(monkeypatch, tmp_path):
    """ninja recompiles by time stamps: a second run of setup.py leaves the units' times alone."""
    _setup_arguments(monkeypatch, tmp_path, PFL_KERNELS_CUDA="0", PFL_KERNELS_UNITY="1")
    units = sorted((tmp_path / "build" / "pfl-unity").glob("unit*.cpp"))
    for unit in units:
        os.utime(unit, (1_000_000, 1_000_000))
    _setup_arguments(monkeypatch, tmp_path, PFL_KERNELS_CUDA="0", PFL_KERNELS_UNITY="1")
    assert [u.stat().st_mtime for u in units] == [1_000_000] * 2


@pytest.mark.parametrize("level", ["4", " 1"])
def test_a_bad_opt_level_is_refused_in_one_line(level):
    proc = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--version"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PFL_KERNELS_OPT_LEVEL": level})
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"PFL_KERNELS_OPT_LEVEL must be 0, 1, 2 or 3, got {level!r}"


@pytest.mark.parametrize("name", ["PFL_KERNELS_SKIP_EXTENSION", "PFL_KERNELS_CUDA", "PFL_KERNELS_UNITY"])
@pytest.mark.parametrize("value", ["2", "ture", " 1", "enabled"])
def test_a_switch_with_a_value_that_is_not_yes_or_no_is_refused_in_one_line(name, value):
    """A typo must not turn a switch on (the old reading: anything but 0/false/no was on)."""
    proc = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--version"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, name: value})
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"{name} must be 1 or 0 (or true/false, yes/no, on/off), got {value!r}"


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_max_jobs_that_is_not_a_positive_number_is_refused_in_one_line(monkeypatch, tmp_path, value):
    with pytest.raises(SystemExit, match=f"^MAX_JOBS must be a positive whole number, got {value!r}$"):
        _setup_arguments(monkeypatch, tmp_path, PFL_KERNELS_CUDA="0", MAX_JOBS=value)


@pytest.mark.parametrize("spelling,unity", [("TRUE", True), ("yes", True), ("On", True),
                                            ("False", False), ("no", False), ("OFF", False)])
def test_a_switch_reads_every_spelling_of_yes_and_no(monkeypatch, tmp_path, spelling, unity):
    (extension,) = _setup_arguments(monkeypatch, tmp_path, PFL_KERNELS_CUDA="0", MAX_JOBS="16",
                                    PFL_KERNELS_UNITY=spelling)["ext_modules"]
    assert (extension.sources == ["build/pfl-unity/unit1.cpp", "build/pfl-unity/unit2.cpp"]) == unity

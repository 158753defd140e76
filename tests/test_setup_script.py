"""scripts/setup.sh against a fake environment: a venv whose python sees only a fake site folder
(a torch, no numpy) and whose pip only records what it is asked and fakes the build's output.
The script's own logic runs: what it installs, in which order, what it prints."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRESENT = ("triton", "pytest", "pytest_benchmark", "xdist", "ninja", "setuptools", "expecttest", "sklearn",
           "matplotlib", "scipy", "PIL")

# The fake venv's python: pip records its arguments (and the constraint file's content), fails
# as pip does when asked for $FAKE_PIP_FAIL, and
# "installs" numpy or, for -e ., a pfl_kernels with _C after printing a build as pip -v shows
# it; anything else runs the real python without site-packages (-S) or the working folder (-P),
# so it sees the fake site folder alone.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "pip ${*:3}" >> "$FAKE_LOG"
  for arg in "${@:3}"; do
    if [ -n "$FAKE_PIP_FAIL" ] && [ "$arg" = "$FAKE_PIP_FAIL" ]; then
      echo "ERROR: No matching distribution found for $arg"; exit 1
    fi
  done
  previous=""
  for arg in "${@:3}"; do
    [ "$previous" = "-c" ] && echo "constraint $(cat "$arg")" >> "$FAKE_LOG"
    case "$arg" in
      numpy) mkdir -p "$FAKE_SITE/numpy" && touch "$FAKE_SITE/numpy/__init__.py" ;;
      .) mkdir -p "$FAKE_SITE/pfl_kernels" && touch "$FAKE_SITE/pfl_kernels/__init__.py" "$FAKE_SITE/pfl_kernels/_C.py"
         echo "  Running command Building editable for pfl-kernels"
         if [ -n "$FAKE_UNITY" ]; then  # setup.py's unity build: a unit file that includes two sources
           mkdir -p "$FAKE_UNITY/build/pfl-unity"
           printf '// Generated\n#include "../../csrc/cpu/aggregate.cpp"\n#include "../../csrc/module.cpp"\n' \
             > "$FAKE_UNITY/build/pfl-unity/unit1.cpp"
           echo "  [1/1] c++ -MMD -MF /tmp/b/u.o.d -O3 -c -c $FAKE_UNITY/build/pfl-unity/unit1.cpp -o /tmp/b/u.o"
         else
           echo "  [1/2] c++ -MMD -MF /tmp/b/a.o.d -O3 -c -c $PWD/csrc/cpu/aggregate.cpp -o /tmp/b/a.o"
           echo "  warning: something the compiler says"
           echo "  [2/2] c++ -MMD -MF /tmp/b/m.o.d -O3 -c -c $PWD/csrc/module.cpp -o /tmp/b/m.o"
         fi
         echo "  g++ -O3 -shared /tmp/b/a.o /tmp/b/m.o -o build/lib/pfl_kernels/_C.abi3.so" ;;
    esac
    previous=$arg
  done
  exit 0
fi
exec "$REAL_PYTHON" -S -P "$@"
"""

FAKE_TORCH = """import importlib.util, os
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(f"import torch (numpy {'installed' if importlib.util.find_spec('numpy') else 'missing'})\\n")
__version__ = "2.13.0+cpu"
"""


@pytest.fixture
def fake_venv(tmp_path):
    if sys.version_info < (3, 11):
        pytest.skip("the fake python needs -P (Python 3.11)")
    venv, site = tmp_path / "venv", tmp_path / "site"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (site / "torch-2.13.0+cpu.dist-info").mkdir()
    (site / "torch-2.13.0+cpu.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\n"
                                                                 "Version: 2.13.0+cpu\n")
    for module in PRESENT:
        (site / module).mkdir()
        (site / module / "__init__.py").touch()
    env = {**os.environ, "PFL_VENV": str(venv), "FAKE_LOG": str(tmp_path / "log"), "FAKE_SITE": str(site),
           "REAL_PYTHON": sys.executable, "PYTHONPATH": str(site), "MAX_JOBS": "2"}
    env.pop("PFL_WITH_FLOWER", None)
    return env, tmp_path / "log"


def _setup(env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=120)


def test_setup_installs_numpy_before_torch_is_imported_and_shows_the_build(fake_venv):
    env, log = fake_venv
    result = _setup(env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = log.read_text().splitlines()
    pip = [line for line in lines if line.startswith("pip ")]
    # torch is there already: never installed again; the others are installed against it.
    assert not any(" torch" in line for line in pip), pip
    assert any(line.endswith(" numpy") for line in pip) and "constraint torch==2.13.0+cpu" in lines
    # Nothing imported torch while numpy was missing ("Failed to initialize NumPy").
    assert not any(line == "import torch (numpy missing)" for line in lines), lines
    out = result.stdout.splitlines()
    assert out[0] == "setup: installing numpy"
    assert "about 1-2 minutes on 2 cores" in out[1] and "pfl-build.log" in out[1]
    assert out[2:] == ["  [1/2] csrc/cpu/aggregate.cpp", "  [2/2] csrc/module.cpp", "  linking pfl_kernels._C"]
    assert "warning: something the compiler says" in (Path(env["PFL_VENV"]) / "pfl-build.log").read_text()

    # Idempotent: a second run finds everything in place, installs and prints nothing.
    log.write_text("")
    again = _setup(env)
    assert again.returncode == 0 and again.stdout == ""
    assert not [line for line in log.read_text().splitlines() if line.startswith("pip ")]


def test_a_unity_unit_is_shown_with_the_sources_it_includes(fake_venv, tmp_path):
    """setup.py's unity build compiles build/pfl-unity/unitN.cpp files: each progress line
    names the unit and the csrc files in it."""
    env, _ = fake_venv
    env["FAKE_UNITY"] = str(tmp_path / "checkout")
    result = _setup(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "  [1/1] unit1.cpp (csrc/cpu/aggregate.cpp csrc/module.cpp)" in result.stdout.splitlines()


@pytest.mark.parametrize("prefix", [None, "pycache"])
def test_pip_skips_the_byte_compile_only_where_python_reads_bytecode_from_a_prefix(fake_venv, prefix):
    """Under PYTHONPYCACHEPREFIX (scripts/test.sh sets one) Python never reads the __pycache__
    folders pip would fill, so the installs run with --no-compile; without one pip compiles."""
    env, log = fake_venv
    env.pop("PYTHONPYCACHEPREFIX", None)
    if prefix:
        env["PYTHONPYCACHEPREFIX"] = str(log.parent / prefix)
    result = _setup(env)
    assert result.returncode == 0, result.stdout + result.stderr
    installs = [line for line in log.read_text().splitlines() if line.startswith("pip install") and " -e ." not in line]
    assert installs and all(("--no-compile" in line.split()) == bool(prefix) for line in installs), installs


def test_a_failed_install_stops_the_setup_and_says_which(fake_venv):
    """pip's failure is not swallowed: the setup stops there, non-zero, with a line naming what
    did not install under pip's own error, and builds nothing."""
    env, log = fake_venv
    env["FAKE_PIP_FAIL"] = "numpy"
    result = _setup(env)
    assert result.returncode != 0
    assert "ERROR: No matching distribution found for numpy" in result.stdout
    assert "setup: pip could not install" in result.stderr and "numpy (exit status 1; its error is above)" in result.stderr
    assert not any(" -e ." in line for line in log.read_text().splitlines()), "built after a failed install"


OLD_PYTHON = r"""#!/usr/bin/env bash
# Python 3.9 as setup.sh sees it: the version check fails, the version prints as 3.9.18.
case "$2" in
  *version_info*) exit 1 ;;
  *python_version*) echo 3.9.18 ;;
  *) echo "called with $*" >> "$FAKE_LOG" ;;
esac
"""


def test_an_older_python_is_refused_before_anything_is_installed(tmp_path):
    """pyproject's requires-python: pip's only words on 3.9 were "Cannot install torch==2.13.0
    because these package versions have conflicting dependencies"."""
    python = tmp_path / "python3.9"
    python.write_text(OLD_PYTHON)
    python.chmod(0o755)
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHON": str(python), "PFL_VENV": str(venv), "FAKE_LOG": str(tmp_path / "log")}
    result = _setup(env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"setup: {python} is Python 3.9.18; pfl-kernels needs Python >= 3.10: run with "
                                     f"PYTHON=/path/to/python3.10 (or newer)")
    assert not venv.exists() and not (tmp_path / "log").exists()
    # A venv made with it already: named, with what to do.
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(OLD_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    result = _setup({**env, "PYTHON": sys.executable})
    assert result.returncode == 2 and result.stderr.strip().endswith(f"(or newer) after removing {venv}"), result.stderr
    assert not (tmp_path / "log").exists()

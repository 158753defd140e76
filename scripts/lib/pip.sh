# Sourced by scripts/setup.sh and scripts/test_floor.sh: installing into a venv's python.
# The caller sets PY (the venv's python) and PIP_WHO (the prefix of this file's messages).

# pip byte-compiles every module it installs into __pycache__ folders, which Python never reads
# while PYTHONPYCACHEPREFIX is set: bytecode is then read and written under that prefix only.
# scripts/test.sh sets one, so there pip skips the compile (torch, the test tools and Flower:
# 131 s of installs took 65 s without it on 2 cores).  Without a prefix pip compiles as usual.
NO_COMPILE=""
[ -z "${PYTHONPYCACHEPREFIX:-}" ] || NO_COMPILE=--no-compile

# pip_install ARGS...: `pip install -q ARGS` into $PY, without the find-links location warnings
# this machine's pip configuration prints.  A failed install says so in one line (pip's own
# error is above it) and returns pip's status, so `set -e` stops the caller there.
pip_install() {
  local status=0
  # `|| status=$?`, not PIPESTATUS afterwards: under the callers' `set -e -o pipefail` a failed
  # pipeline would end the script here, before the line below.  The filter always succeeds, so
  # the status is pip's.
  "$PY" -m pip install -q --disable-pip-version-check $NO_COMPILE "$@" 2>&1 | { grep -v '^WARNING: Location' || true; } \
    || status=$?
  if [ "$status" -ne 0 ]; then
    echo "$PIP_WHO: pip could not install $* (exit status $status; its error is above)" >&2
  fi
  return "$status"
}

# missing_packages MODULE:PACKAGE...: the packages (space-separated) whose module $PY does not
# find; nothing is imported (importing torch before numpy is installed logs "Failed to
# initialize NumPy", and an import takes seconds).
missing_packages() {
  "$PY" - "$@" <<'PYTHON'
import importlib.util
import sys

print(" ".join(package for module, package in (pair.split(":") for pair in sys.argv[1:])
               if importlib.util.find_spec(module) is None))
PYTHON
}

#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite (what CI runs):
# the tests, the Triton kernels in the interpreter, and a smoke run of the benchmarks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
PY=${PFL_VENV:-.venv}/bin/python

"$PY" -m pfl_kernels
"$PY" -m pytest tests -q -p no:cacheprovider "$@"
# The fallback without the extension (reference kernels, autograd registered from Python).
PFL_KERNELS_DISABLE_EXTENSION=1 "$PY" -m pytest tests/kernels tests/nn -q -p no:cacheprovider "$@"
# Triton kernels on the CPU: TRITON_INTERPRET must be set before triton is imported.
TRITON_INTERPRET=1 "$PY" -m pytest tests -q -p no:cacheprovider -m triton_interpret "$@"
# Benchmarks are never timed in CI; run each benchmarked function once, at the quick-mode
# shapes (the server-side suites' full shapes take gigabytes), so they stay working.
PFL_BENCH_QUICK=1 OMP_WAIT_POLICY=PASSIVE "$PY" -m pytest benchmarks/bench_*.py -q -p no:cacheprovider --benchmark-disable

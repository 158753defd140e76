#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite (what CI runs):
# the tests, the Triton kernels in the interpreter, and a smoke run of the benchmarks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PFL_WITH_FLOWER=1 bash scripts/setup.sh  # the Flower extra too: CI runs its tests
PY=${PFL_VENV:-.venv}/bin/python
# Test files run in parallel (pytest-xdist), one worker per core up to 4 (each file whole on
# one worker, so a file's fixtures are built once); PFL_TEST_WORKERS=0 runs in this process.
cores=$(nproc 2>/dev/null || echo 2)
WORKERS=${PFL_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
PARALLEL=(-n "$WORKERS" --dist loadfile)

"$PY" -m pfl_kernels
"$PY" -m pytest tests -q -p no:cacheprovider "${PARALLEL[@]}" "$@"
# The fallback without the extension (reference kernels, autograd registered from Python).
PFL_KERNELS_DISABLE_EXTENSION=1 "$PY" -m pytest tests/kernels tests/nn -q -p no:cacheprovider "${PARALLEL[@]}" "$@"
# Triton kernels on the CPU: TRITON_INTERPRET must be set before triton is imported.
TRITON_INTERPRET=1 "$PY" -m pytest tests -q -p no:cacheprovider -m triton_interpret "${PARALLEL[@]}" "$@"
# Benchmarks are never timed in CI; run each benchmarked function once, at the quick-mode
# shapes (the server-side suites' full shapes take gigabytes), so they stay working.
PFL_BENCH_QUICK=1 OMP_WAIT_POLICY=PASSIVE "$PY" -m pytest benchmarks/bench_*.py -q -p no:cacheprovider --benchmark-disable

#!/usr/bin/env bash
# Set up the environment if needed, then run the main job.  Until the simulation engine
# lands, that is the benchmark suite in quick mode: the fused kernels against the eager
# PyTorch they replace, as a table of ratios.  Pass --full for the full-length run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
PY=${PFL_VENV:-.venv}/bin/python
mode=--quick
if [ "${1:-}" = "--full" ]; then mode=; fi
OMP_WAIT_POLICY=PASSIVE "$PY" benchmarks/report.py $mode

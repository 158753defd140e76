#!/usr/bin/env bash
# Set up the environment if needed, then run the CPU kernel benchmarks as ratio tables
# (quick mode by default; --full for the recorded length, --suite NAME for one suite).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
PY=${PFL_VENV:-.venv}/bin/python
args=(--quick)
if [ "${1:-}" = "--full" ]; then args=(); shift; fi
OMP_WAIT_POLICY=PASSIVE "$PY" benchmarks/report.py "${args[@]}" "$@"

#!/usr/bin/env bash
# Set up the environment if needed, then run the main job: `pfl demo`, every algorithm on one
# testbed (MNIST where installed, else digits; 10 clients), a ranked table and a plot per scenario.
# Extra arguments go to `pfl demo` (e.g. --rounds 20 --seeds 3 --out runs/demo).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
PY=${PFL_VENV:-.venv}/bin/python
# Passive OpenMP waits: the small per-client ops would otherwise spin idle threads on 2 cores.
OMP_WAIT_POLICY=PASSIVE "$PY" -m pfl_algorithms demo "$@"

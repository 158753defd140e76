#!/usr/bin/env bash
# On a CUDA machine: build the package against the machine's torch, then run what a CPU
# machine cannot: the test suite with its CUDA tests (Triton kernels on the GPU, CUDA
# augmentation, torchvision comparisons), and the GPU benchmarks, whose JSON lands in
# benchmarks/results/<suite>_gpu_<device>.json.
#
#   bash scripts/gpu_check.sh tests        # pytest tests (CUDA tests included)
#   bash scripts/gpu_check.sh bench        # every benchmarks/gpu_*.py, full grids
#   bash scripts/gpu_check.sh bench-quick  # the same with --quick
#   bash scripts/gpu_check.sh dry-run      # the benchmarks' --dry-run (CPU, Triton interpreter)
#
# Uses the machine's python3 (PYTHON to override), which must hold torch, triton and
# pytest; nothing is downloaded.  The log goes to $OUT where it is set (the device tool),
# else to /tmp; the bench stages copy the newest JSON of each suite to $OUT too.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
stage=${1:-}
case "$stage" in
  tests|bench|bench-quick|dry-run) ;;
  *) echo "usage: bash scripts/gpu_check.sh tests|bench|bench-quick|dry-run" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
log_dir=${OUT:-${TMPDIR:-/tmp}}
mkdir -p "$log_dir"
log="$log_dir/gpu_check_$stage.log"

# Build once per machine: the C++ extension must match the installed torch.
if ! "$PY" -c "import pfl_kernels._C" 2>/dev/null; then
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5
fi

{
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  "$PY" -m pfl_kernels
} 2>&1 | tee "$log"

run_benchmarks() {  # extra flags for every script
  local status=0 script
  for script in gpu_factorized gpu_branch gpu_similarity gpu_aggregate gpu_branch_aggregate gpu_executor; do
    echo "== $script $*"
    "$PY" "benchmarks/$script.py" "$@" || status=1
  done
  echo "== gpu_branch --shared $*"
  "$PY" benchmarks/gpu_branch.py --shared "$@" || status=1
  return $status
}

status=0
case "$stage" in
  tests) "$PY" -m pytest tests -q -p no:cacheprovider -rs 2>&1 | tee -a "$log" || status=1 ;;
  bench) run_benchmarks 2>&1 | tee -a "$log" || status=1 ;;
  bench-quick) run_benchmarks --quick 2>&1 | tee -a "$log" || status=1 ;;
  dry-run) TRITON_INTERPRET=1 run_benchmarks --dry-run 2>&1 | tee -a "$log" || status=1 ;;
esac
echo "log: $log"
if [ -n "${OUT:-}" ] && [ "$stage" = bench -o "$stage" = bench-quick ]; then
  # at most 8 files come back from $OUT: the log and the newest JSON of each suite
  ls -t benchmarks/results/*_gpu_*.json 2>/dev/null | head -7 | xargs -r cp -t "$OUT"
fi
exit $status

#!/usr/bin/env bash
# On a CUDA machine: build the package against the machine's torch, then run what a CPU
# machine cannot: the test suite with its CUDA tests (Triton kernels on the GPU, CUDA
# augmentation, torchvision comparisons), and the GPU benchmarks, whose JSON lands in
# benchmarks/results/<suite>_gpu_<device>.json.
#
#   bash scripts/gpu_prebuild.sh           # before a GPU call, on a CPU machine: the extension built
#                                          #   against the GPU image's torch (carry build/gpu-prebuilt)
#   bash scripts/gpu_check.sh quick        # the one short GPU check (issue 30), about 6 minutes:
#                                          #   build, launch benchmark, kernel benchmarks --quick,
#                                          #   executor jobs --quick, GPU tests (xdist)
#   bash scripts/gpu_check.sh gpu-tests    # quick's test stage alone (a second call, when quick's
#                                          #   last stage was cut), within 4.5 minutes, after a check
#                                          #   of the C++ CPU kernels that crashed on the H100 image
#   bash scripts/gpu_check.sh tests        # pytest tests (CUDA tests included)
#   bash scripts/gpu_check.sh bench        # every benchmarks/gpu_*.py, full grids
#   bash scripts/gpu_check.sh bench-quick  # the same with --quick
#   bash scripts/gpu_check.sh dry-run      # every stage of quick in its dry-run form, on a CPU
#
# quick: each stage runs under its own `timeout`, capped by what is left of a 6-minute budget
# (GPU_CHECK_BUDGET_S, default 360) less the floors of the stages still to come, so the whole
# check ends in time even when a stage hangs, and a stage that runs long cannot starve the
# later ones; a stage that fails or times out is reported and the next one still runs.  The
# whole GPU test stage runs last, on what the measurements left (twice on the H200 it ran
# first, ran out of its share and took no figure with it).  The 10 tests that failed there are
# among its tests: gpu_targets.py reads their verdict from its summary (they had a stage of
# their own, which passed on an H100 and cost 27 s of the 6 minutes).  The test stage runs
# with direct launches on (PFL_KERNELS_DIRECT_LAUNCH=1, the default), and so do the kernel
# benchmarks and the executor jobs once gpu_launch (which times both paths itself, third) has
# checked every op's direct launches against float64 on this GPU: the tests check the path
# the benchmarks time, the ResNet-9 target is against a sequential path that launches
# directly, and a direct launch that fails here costs no figure (the benchmarks then run with
# PFL_KERNELS_DIRECT_LAUNCH=0).  Each suite's JSON records its mode (machine.direct_launch).
# Its log and the JSON of the 7 benchmark suites it ran (8 files) go to $OUT where it is set; the JSON also
# stays in benchmarks/results/ under the device's name.  Then benchmarks/gpu_targets.py prints
# issue 30's targets, each met or not, from this run's JSON; the closing lines list each
# stage's status and time.
#
# dry-run: the same stages as quick, each in its dry-run form, so that a CPU machine finds what
# would break before a GPU is spent (CI runs each of these commands in its own test, listed in
# tests/test_gpu_scripts.py): build -> the build
# tools and the package import; tests -> pytest collects the suite with xdist loaded;
# benchmarks, launch and executor -> their --dry-run (Triton interpreter, tiny shapes).
# Fails if any stage fails.
#
# Uses the machine's python3 (PYTHON to override), which must hold torch, triton, pytest and
# pytest-xdist; nothing is downloaded.  The log goes to $OUT where it is set (the device tool),
# else to /tmp.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
stage=${1:-}
case "$stage" in
  quick|gpu-tests|tests|bench|bench-quick|dry-run) ;;
  *) echo "usage: bash scripts/gpu_check.sh quick|gpu-tests|tests|bench|bench-quick|dry-run" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
log_dir=${OUT:-${TMPDIR:-/tmp}}
mkdir -p "$log_dir"
log="$log_dir/gpu_check_$stage.log"
: >"$log"

# The kernel benchmarks of quick and bench-quick (gpu_branch --shared is in bench only).
KERNEL_BENCHMARKS=(gpu_factorized gpu_branch gpu_similarity gpu_aggregate gpu_branch_aggregate)
# The test files with CUDA tests (quick; `tests` runs the whole suite): the Triton kernels'
# (on the GPU, not the interpreter), the executors, captured steps, GEMM convolutions and augmentation on
# CUDA, background checkpoints of CUDA state, the package.
# The C++ CPU kernels' test files that crashed on the H100 image (gpu-tests' crash check).
CPU_CRASH_TESTS=(tests/kernels/test_similarity.py tests/kernels/test_error_types.py)
GPU_TESTS=(tests/kernels/*_triton.py tests/algorithms/engine/test_executors.py
           tests/algorithms/engine/test_step_graphs.py tests/algorithms/engine/test_batched_eval.py
           tests/algorithms/engine/test_conv_gemm.py tests/algorithms/engine/test_conv_nhwc.py
           tests/algorithms/engine/test_conv_per_client.py
           tests/algorithms/engine/test_mixed_batch_norm.py tests/algorithms/engine/test_folded_channels.py
           tests/algorithms/engine/test_checkpoint_writer.py
           tests/algorithms/test_augment.py tests/test_package.py)
# Stage caps and floors in seconds (quick).  A stage runs for at most its cap, and never into
# the floors of the stages after it: their sum is held back from the budget until they run.
# Time a stage leaves unused goes to the later ones.  The caps sum to more than the budget on
# purpose (an early stage that ends fast hands its time on); the floors sum to well under it.
# quick's whole run stays within 6 minutes: the stages' 325 s, a stage's 10 s grace before it is
# killed, and the copy and gpu_targets after them (at most 20 s; both runs so far went 10 s over
# a 360 s stage budget).
BUDGET_S=${GPU_CHECK_BUDGET_S:-325}
[ "$stage" != dry-run ] || BUDGET_S=${GPU_CHECK_BUDGET_S:-3600}  # the interpreter on a CPU is slow
CAP_BUILD=${GPU_CHECK_CAP_BUILD:-120};       FLOOR_BUILD=${GPU_CHECK_FLOOR_BUILD:-30}
CAP_TESTS=${GPU_CHECK_CAP_TESTS:-240};       FLOOR_TESTS=${GPU_CHECK_FLOOR_TESTS:-60}  # last: what is left
CAP_CPU_CRASH=${GPU_CHECK_CAP_CPU_CRASH:-45}; FLOOR_CPU_CRASH=${GPU_CHECK_FLOOR_CPU_CRASH:-10}  # gpu-tests only
CAP_BENCH=${GPU_CHECK_CAP_BENCH:-40};        FLOOR_BENCH=${GPU_CHECK_FLOOR_BENCH:-20}  # each kernel benchmark
CAP_LAUNCH=${GPU_CHECK_CAP_LAUNCH:-40};      FLOOR_LAUNCH=${GPU_CHECK_FLOOR_LAUNCH:-20}
# the targets' rows and Table 1's 3 rounds first, then the reported rows (bf16, nhwc, per-client,
# one-model, uncaptured; about 130 s in all by the H100's round times) and the kernel profile;
# the tests after it keep their floor, and `gpu-tests` runs them whole
CAP_EXECUTOR=${GPU_CHECK_CAP_EXECUTOR:-160}; FLOOR_EXECUTOR=${GPU_CHECK_FLOOR_EXECUTOR:-70}
# One worker per core (16 on the H100/H200 machines): at 8, the tests ran past 120 s there.
XDIST_WORKERS=${GPU_CHECK_WORKERS:-$(nproc)}

# An extension built elsewhere against this machine's torch (scripts/gpu_prebuild.sh, carried
# here): installed instead of compiled where its stamp names these sources and this torch (the
# H100's compile took 64 s of quick's 6 minutes).  The copy goes through $PY (tests stand it in).
PREBUILT=${GPU_CHECK_PREBUILT:-build/gpu-prebuilt}

build() {  # the C++ extension must match the installed torch
  local want skip=
  want="$(bash scripts/extension_hash.sh) $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
  if [ -f "$PREBUILT/_C.abi3.so" ] && [ "$(cat "$PREBUILT/stamp" 2>/dev/null || true)" = "$want" ]; then
    echo "build: not compiled: $PREBUILT/_C.abi3.so was built from these sources against torch ${want#* }"
    "$PY" -c "import shutil, sys; shutil.copy2(sys.argv[1], sys.argv[2])" "$PREBUILT/_C.abi3.so" \
      pfl_kernels/_C.abi3.so
    skip=1  # the package and its entry points, without compiling
  fi
  PFL_KERNELS_SKIP_EXTENSION=$skip MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5
  "$PY" -c "import pfl_kernels._C"
}

dry_build() {  # what the build needs is there, and the package imports (its ops listed)
  "$PY" -c "import setuptools, torch.utils.cpp_extension, triton"
  "$PY" -m pip --version
  "$PY" -m pfl_kernels >/dev/null
}

build_if_needed() {
  if ! "$PY" -c "import pfl_kernels._C" 2>/dev/null; then build; fi
}

header() {
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  "$PY" -m pfl_kernels
}

export PY PREBUILT
export -f build build_if_needed dry_build header  # run under timeout, in a bash of their own

run_benchmarks() {  # extra flags for every script
  local status=0 script
  for script in "${KERNEL_BENCHMARKS[@]}" gpu_executor; do
    echo "== $script $*"
    "$PY" "benchmarks/$script.py" "$@" || status=1
  done
  echo "== gpu_branch --shared $*"
  "$PY" benchmarks/gpu_branch.py --shared "$@" || status=1
  return $status
}

# The whole GPU test stage's pytest arguments (quick's last stage, and gpu-tests); --durations:
# which tests set the stage's time (the next run's cap and worker count); -rfEs: each failure,
# error and skip named in the summary (gpu_targets.py looks there for the 10 tests that failed
# on the H200; with -rs alone the H100's 16 failures went unnamed).
GPU_TEST_STAGE=("${GPU_TESTS[@]}" tests/kernels/test_direct_launch.py -q -p no:cacheprovider -rfEs -m "not slow"
                --durations=15)

# The test stage's environment: one CPU thread per xdist worker.  The stage runs one worker per
# core, and with torch's default of a thread per core as well, the CPU tests among the GPU files
# (float64 runs of a small CNN that take 0.7 s on a 2-core CPU) ran past their 60 s timeout on
# the H200's 16 cores: six of them failed so.
TEST_ENV=(env OMP_NUM_THREADS="${GPU_CHECK_TEST_THREADS:-1}")

# parallel_pytest_args: xdist (one worker per core) and a per-test timeout, where installed, into
# the array xdist.  worksteal, not loadfile: twice on the H200 the stage stopped at 94% with one
# long file left on one worker (8 and then 16 workers, 120 s).  A test that runs past 60 s fails
# with its stack (pytest-timeout) instead of taking the stage's whole cap and its report.
parallel_pytest_args() {
  xdist=(-n "$XDIST_WORKERS" --dist worksteal)
  if ! "$PY" -c "import xdist" 2>/dev/null; then
    echo "pytest-xdist is not installed here: the tests run in one process" | tee -a "$log"
    xdist=()
  fi
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    xdist+=(--timeout="${GPU_CHECK_TEST_TIMEOUT:-60}")
  fi
}

# ---------------------------------------------------------------- staged runs (quick, dry-run)
start_s=$SECONDS
summary=()
failed=0

# The floors of the stages not yet run (quick); run_stage takes each stage's own off as it starts.
held_back=0
last_status=0  # the exit status of the last stage run_stage ran (125: skipped)
# run_stage NAME CAP FLOOR COMMAND...: COMMAND under `timeout` (CAP, or what is left of the
# budget after the later stages' floors), its output into the log; records its status and time.
run_stage() {
  local name=$1 cap=$2 floor=$3 left status t0=$SECONDS
  shift 3
  held_back=$((held_back - floor))
  left=$((BUDGET_S - (SECONDS - start_s) - held_back))
  if [ "$left" -lt 5 ]; then
    echo "== stage $name: skipped, the ${BUDGET_S}s budget is spent" | tee -a "$log"
    summary+=("$name: skipped (budget spent)"); failed=1; last_status=125
    return 0
  fi
  [ "$cap" -le "$left" ] || cap=$left
  echo "== stage $name (timeout ${cap}s): $*" | tee -a "$log"
  set +e
  # SIGINT, not TERM, at the cap: pytest then prints what it has (the failures, --durations, the
  # counts so far) before it exits, so a test stage that runs out of time still says which tests
  # set its pace (twice on the H200 it was killed with no report); KILL 10 s later if it hangs.
  timeout --signal=INT --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
  last_status=$status
  set -e
  case "$status" in
    0) summary+=("$name: ok ($((SECONDS - t0))s)") ;;
    124|137) summary+=("$name: TIMED OUT after ${cap}s"); failed=1 ;;
    *) summary+=("$name: FAILED (exit $status, $((SECONDS - t0))s)"); failed=1 ;;
  esac
}

# targets ARGS...: issue 30's targets met or not, from the JSON the stages wrote (gpu_targets.py:
# reads files, runs nothing on the device, so it is outside the budget and runs even when it is
# spent; it reads a few files: 20 s is plenty).
targets() {
  local status
  set +e
  timeout 20 "$PY" benchmarks/gpu_targets.py "$@" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -eq 0 ]; then summary+=("gpu_targets: ok"); else summary+=("gpu_targets: FAILED (exit $status)"); failed=1; fi
}

finish() {
  {
    echo "== gpu_check $stage: $((SECONDS - start_s))s"
    printf '   %s\n' "${summary[@]}"
  } | tee -a "$log"
  echo "log: $log"
}

if [ "$stage" = quick ]; then
  unset PFL_KERNELS_DIRECT_LAUNCH  # set below, stage by stage, never inherited from the caller
  stamp=$(mktemp)  # the JSON written after it is this run's
  held_back=$((FLOOR_BUILD + FLOOR_TESTS + ${#KERNEL_BENCHMARKS[@]} * FLOOR_BENCH + FLOOR_LAUNCH
                + FLOOR_EXECUTOR))
  if [ "$held_back" -gt "$BUDGET_S" ]; then
    echo "gpu_check: the stages' floors ($held_back s) exceed the budget GPU_CHECK_BUDGET_S=$BUDGET_S" >&2; exit 2
  fi
  run_stage build "$CAP_BUILD" "$FLOOR_BUILD" bash -c "set -eo pipefail; build"
  timeout 120 bash -c header 2>&1 | tee -a "$log" || true
  parallel_pytest_args
  # gpu_launch times each op as the default leaves it and with direct launches (switching
  # itself), checking both results against float64: the benchmarks after it launch directly
  # only where it passed, so a direct launch that fails on this GPU costs no figure.
  run_stage gpu_launch "$CAP_LAUNCH" "$FLOOR_LAUNCH" "$PY" benchmarks/gpu_launch.py --quick
  if [ "$last_status" -eq 0 ]; then
    export PFL_KERNELS_DIRECT_LAUNCH=1
  else
    export PFL_KERNELS_DIRECT_LAUNCH=0  # the default is direct: Triton's own launcher instead
    echo "== direct launches stay off for the benchmarks: gpu_launch did not pass" | tee -a "$log"
  fi
  for script in "${KERNEL_BENCHMARKS[@]}"; do
    run_stage "$script" "$CAP_BENCH" "$FLOOR_BENCH" "$PY" "benchmarks/$script.py" --quick
  done
  run_stage gpu_executor "$CAP_EXECUTOR" "$FLOOR_EXECUTOR" "$PY" benchmarks/gpu_executor.py --quick --profile
  export PFL_KERNELS_DIRECT_LAUNCH=1  # the tests check them whatever gpu_launch said
  run_stage tests "$CAP_TESTS" "$FLOOR_TESTS" "${TEST_ENV[@]}" "$PY" -m pytest "${GPU_TEST_STAGE[@]}" "${xdist[@]}"
  if [ -n "${OUT:-}" ]; then
    # at most 8 files come back from $OUT: the log and this run's JSON (one per suite), copied
    # before the verdict, so a command cut there still brings every figure back
    find benchmarks/results -maxdepth 1 -name '*_gpu_*.json' -newer "$stamp" | head -7 | xargs -r cp -t "$OUT"
  fi
  targets --newer-than "$stamp" --log "$log"
  finish
  rm -f "$stamp"
  exit $failed
fi

if [ "$stage" = dry-run ]; then
  export TRITON_INTERPRET=1  # before triton is imported: the launchers run on CPU tensors
  stamp=$(mktemp)  # the JSON written after it is this run's
  run_stage build 120 0 bash -c "set -eo pipefail; dry_build"
  run_stage tests 300 0 "$PY" -m pytest "${GPU_TESTS[@]}" -qq -p no:cacheprovider -m "not slow" --collect-only \
    -p xdist -n 0
  for script in "${KERNEL_BENCHMARKS[@]}"; do
    run_stage "$script" 300 0 "$PY" "benchmarks/$script.py" --dry-run
  done
  run_stage gpu_branch_shared 300 0 "$PY" benchmarks/gpu_branch.py --shared --dry-run
  run_stage gpu_launch 300 0 "$PY" benchmarks/gpu_launch.py --dry-run
  run_stage gpu_executor 300 0 "$PY" benchmarks/gpu_executor.py --dry-run --profile
  # the dry runs' JSON: in tempfile.gettempdir()/pfl_gpu_dry_run (benchmarks/_gpu_common.py)
  targets --newer-than "$stamp" --results "${TMPDIR:-/tmp}/pfl_gpu_dry_run" \
    --device dry_run_triton_interpreter_on_cpu,dry_run_cpu
  rm -f "$stamp"
  finish
  exit $failed
fi

# ---------------------------------------------------------------- single stages
if [ "$stage" = gpu-tests ]; then
  # quick's test stage alone, for a second GPU call when quick's last stage was cut: the GPU
  # test files with direct launches on, within GPU_CHECK_BUDGET_S (default 270 s, build
  # included: what a session's 15 device minutes leave after two machine starts and quick's 6
  # minutes).
  BUDGET_S=${GPU_CHECK_BUDGET_S:-270}
  held_back=$((FLOOR_BUILD + FLOOR_CPU_CRASH + FLOOR_TESTS))
  unset PFL_KERNELS_DIRECT_LAUNCH
  run_stage build "$CAP_BUILD" "$FLOOR_BUILD" bash -c "set -eo pipefail; build_if_needed"
  timeout 120 bash -c header 2>&1 | tee -a "$log" || true
  parallel_pytest_args
  # On the H100 image the C++ CPU kernels' test files crashed xdist workers (SIGSEGV, first in
  # test_similarity.py::test_errors_weights, a C++ ValueError path), which pass here and under
  # ASan/UBSan: one process, stopping at the first failure, with faulthandler's trace, and the
  # machine's compiler and CPU (the extension is the image's build, or gpu_prebuild.sh's from
  # GCC 12 when carried: the build stage says which).
  { gcc --version 2>&1 | head -1; grep -m1 "model name" /proc/cpuinfo; echo "cores $(nproc);" \
      "avx512f: $(grep -c -m1 avx512f /proc/cpuinfo)"; } 2>&1 | tee -a "$log" || true
  # One intra-op thread: on the H200 85 of these 828 tests took 29 s in one process with the
  # machine's 16 threads per op (the stage's cap is 45 s); on a 2-core EPYC with one thread all
  # 828 took 13 s.
  run_stage cpu_kernels "$CAP_CPU_CRASH" "$FLOOR_CPU_CRASH" env OMP_NUM_THREADS=1 "$PY" -X faulthandler -m pytest \
    "${CPU_CRASH_TESTS[@]}" -q -p no:cacheprovider -p no:xdist -x -rfE
  run_stage tests "$BUDGET_S" "$FLOOR_TESTS" "${TEST_ENV[@]}" PFL_KERNELS_DIRECT_LAUNCH=1 "$PY" -m pytest "${GPU_TEST_STAGE[@]}" \
    "${xdist[@]}"
  finish  # the log is in $OUT where it is set
  exit $failed
fi
build_if_needed
header 2>&1 | tee -a "$log"
status=0
case "$stage" in
  tests) "$PY" -m pytest tests -q -p no:cacheprovider -rs 2>&1 | tee -a "$log" || status=1 ;;
  bench) run_benchmarks 2>&1 | tee -a "$log" || status=1 ;;
  bench-quick) run_benchmarks --quick 2>&1 | tee -a "$log" || status=1 ;;
esac
echo "log: $log"
if [ -n "${OUT:-}" ] && [ "$stage" = bench -o "$stage" = bench-quick ]; then
  # at most 8 files come back from $OUT: the log and the newest JSON of each suite
  ls -t benchmarks/results/*_gpu_*.json 2>/dev/null | head -7 | xargs -r cp -t "$OUT"
fi
exit $status

#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite (what CI runs), in phases:
#
#   info          `python -m pfl_kernels`: which implementation of each op runs here
#   main          every test not marked slow (the default suite; PFL_TEST_WORKERS workers)
#   slow          end-to-end runs: kill -9 and resume, executor agreement over whole runs
#                 (with main, one pytest run: the phase main+slow)
#   no-extension  tests/kernels and tests/nn on the reference kernels (no C++ extension)
#   triton        the Triton kernels in the interpreter (TRITON_INTERPRET=1, tiny shapes)
#   benchmarks    each benchmarked function once at its quick shapes (never timed)
#   floor         tests/kernels, tests/nn and the GPU check's other files built against torch 2.11, the declared floor
#
# Every phase runs and reports even when an earlier one failed; the script exits non-zero at
# the end if any phase failed, after a summary line per phase and a total.
# PFL_TEST_PHASES="main slow" runs only those phases; extra arguments go to every pytest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
# Each module is compiled once per run, not once per process: its bytecode, pytest's rewritten
# test modules included, goes to a temporary folder removed at the end, nothing into the checkout,
# also where PYTHONDONTWRITEBYTECODE is set.  Machines here set it, and every phase's workers then
# compiled and rewrote every test module again (collecting the main phase: 16 s, against 9 s from
# the cache).  A prefix set by the caller is kept, with the caller's PYTHONDONTWRITEBYTECODE.
# Set before the setup, whose pip installs then skip the byte-compile nothing would read.
if [ -z "${PYTHONPYCACHEPREFIX:-}" ]; then
  export PYTHONPYCACHEPREFIX="$LOGS/pycache"
  unset PYTHONDONTWRITEBYTECODE
fi
PFL_WITH_FLOWER=1 bash scripts/setup.sh || { echo "test.sh: setup failed (see above)"; exit 1; }
PY=${PFL_VENV:-.venv}/bin/python
# Idle OpenMP threads sleep instead of spinning: each worker's torch uses every core, so with one
# worker per core a spinning worker takes the cores the others need for their many small ops
# (the main phase on 2 cores: 351 s with OpenMP's default, 270 s passive; one run each, the same
# 4674 tests).  A value set by the caller is kept.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# Test files run in parallel (pytest-xdist), one worker per core up to 4 (each file whole on
# one worker, so a file's fixtures are built once); PFL_TEST_WORKERS=0 runs in this process.
# Files go out in collection order, the ones marked heavy first (tests/conftest.py), not in
# xdist's default order (most tests first), which left the long few-test files for last.
cores=$(nproc 2>/dev/null || echo 2)
WORKERS=${PFL_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadfile --no-loadscope-reorder)
PHASES=${PFL_TEST_PHASES:-info main slow no-extension triton benchmarks floor}
declare -a SUMMARY=()
FAILED=0

# selected NAME...: whether every phase NAME is in PHASES.
selected() {
  local name
  for name in "$@"; do case " $PHASES " in *" $name "*) ;; *) return 1 ;; esac; done
}

# phase NAME COMMAND...: run one phase (NAME: a phase or several joined by '+', each selected),
# its output shown as it comes and kept for the summary.
phase() {
  local name=$1; shift
  selected ${name//+/ } || return 0
  echo; echo "=== phase $name: $*"
  local start=$SECONDS rc
  "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  # pytest's closing line ("12 passed, 1 skipped in 3.0s"), else the phase's last line.
  local last
  last=$(grep -E '^=*\s*[0-9]+ (passed|failed|errors?|skipped|deselected)' "$LOGS/$name.log" | tail -1 | tr -d '=')
  [ -n "$last" ] || last=$(tail -1 "$LOGS/$name.log")
  if [ "$rc" -eq 5 ]; then rc=0; fi  # pytest's "no tests collected" (a -k that selects none here)
  local bad
  bad=$(( $(count failed "$last") + $(count error "$last") + $(count errors "$last") ))
  PASSED=$((PASSED + $(count passed "$last"))); SKIPPED=$((SKIPPED + $(count skipped "$last")))
  if [ "$rc" -ne 0 ]; then
    FAILED=1
    [ "$bad" -gt 0 ] || bad=1  # a phase that failed without a pytest count (a crash) counts once
  fi
  BAD=$((BAD + bad))
  SUMMARY+=("$(printf '%-13s %-6s %4ss  %s' "$name" "$([ "$rc" -eq 0 ] && echo ok || echo FAILED)" \
                "$((SECONDS - start))" "$(echo "$last" | sed 's/^ *//')")")
}

# count KIND LINE: the number before KIND in a pytest closing line (0 if none).
count() { local n; n=$(echo "$2" | grep -oE "[0-9]+ $1\b" | grep -oE '^[0-9]+' | head -1); echo "${n:-0}"; }
PASSED=0; SKIPPED=0; BAD=0

phase info "$PY" -m pfl_kernels
# main and slow share one environment: where both are asked (CI) one pytest run serves them, one
# start and collection of the workers and one tail where the other worker waits, instead of two.
if selected main slow; then
  phase main+slow "${PYTEST[@]}" tests "$@"
else
  phase main "${PYTEST[@]}" tests -m "not slow" "$@"
  phase slow "${PYTEST[@]}" tests -m slow "$@"
fi
# The fallback without the extension (reference kernels, autograd registered from Python).  Here
# and in the floor phase gradcheck projects each Jacobian (PFL_TEST_GRADCHECK=fast,
# tests/kernels/autograd_checks.py); the main phase checks every entry.
phase no-extension env PFL_KERNELS_DISABLE_EXTENSION=1 PFL_TEST_GRADCHECK=fast \
  "${PYTEST[@]}" tests/kernels tests/nn -m "not slow" "$@"
# Triton kernels on the CPU: TRITON_INTERPRET must be set before triton is imported.
phase triton env TRITON_INTERPRET=1 "${PYTEST[@]}" tests -m triton_interpret "$@"
# Benchmarks are never timed in CI; run each benchmarked function once, at the quick-mode
# shapes (the server-side suites' full shapes take gigabytes), so they stay working.
phase benchmarks env PFL_BENCH_QUICK=1 "${PYTEST[@]}" benchmarks/bench_*.py --benchmark-disable "$@"
if [ -f scripts/test_floor.sh ]; then
  phase floor env PFL_TEST_GRADCHECK=fast bash scripts/test_floor.sh "$@"
fi

echo; echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
# One closing line over every phase, in the form CI reads.
echo "total: $PASSED passed, $BAD failed, $SKIPPED skipped"
exit $FAILED

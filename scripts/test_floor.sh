#!/usr/bin/env bash
# The floor phase of CI: build pfl-kernels against torch 2.11.0, the oldest torch pyproject.toml
# declares, and run tests/kernels, tests/nn and the other test files gpu_check.sh runs on it.  Arguments go to pytest.
#
# - The venv is .venv-floor (PFL_FLOOR_VENV), with torch==$PFL_FLOOR_TORCH (default 2.11.0)
#   and only what these tests need (Triton only where torch's wheel brings it: its tests skip
#   without TRITON_INTERPRET=1 here).
#   torch's CPU wheel comes from $PFL_FLOOR_TORCH_INDEX (PyTorch's CPU index by default; set it
#   empty to skip); where that index cannot be reached, PyPI's wheel is installed, which is a
#   CUDA build that cannot be imported without its nvidia-* packages, so those come too (the venv
#   is then 4.7 GB; torch runs on the CPU as the CPU wheel does).
# - The extension is compiled in a copy of the sources ($VENV/src): building in this checkout
#   would write pfl_kernels/_C*.so, the .venv's build for its own torch, into the source tree.
#   The copy is refreshed on every run; the extension, kept in $VENV/build-O<level>, is rebuilt
#   only when setup.py, pyproject.toml or csrc/ change (ninja then recompiles only the changed files).
# - It is built at -O$PFL_FLOOR_OPT_LEVEL (default 1, setup.py's PFL_KERNELS_OPT_LEVEL): this
#   build checks that the sources compile on torch 2.11 and agree with the reference there, not
#   their speed; -O1 takes 50 s less than -O3 on 2 cores, and the tests run as fast on it.
# Quick when everything is in place already: the copy, a hash and the tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
VENV=${PFL_FLOOR_VENV:-.venv-floor}
TORCH_VERSION=${PFL_FLOOR_TORCH:-2.11.0}
TORCH_INDEX=${PFL_FLOOR_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
OPT_LEVEL=${PFL_FLOOR_OPT_LEVEL:-1}
case $VENV in /*) ;; *) VENV=$PWD/$VENV ;; esac  # the tests run from another folder
SRC="$VENV/src"      # the copy the extension is built in and the tests run from
BUILD="$VENV/build-O$OPT_LEVEL"  # its compiled objects and library, kept between runs, one folder
                                 # per -O level (gpu_prebuild.sh's -O3 and the floor's -O1 then
                                 # never rebuild each other's)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP_WHO=floor
source scripts/lib/pip.sh  # pip_install, missing_packages (no byte-compiling under PYTHONPYCACHEPREFIX)
# The installed torch's version, read without importing it (an import takes seconds).
torch_version() {
  "$PY" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true
}

if [[ "$(torch_version)" != "$TORCH_VERSION"* ]]; then
  echo "floor: installing torch==$TORCH_VERSION into $VENV"
  if [ -z "$TORCH_INDEX" ] ||
     ! "$PY" -m pip install -q --disable-pip-version-check $NO_COMPILE --retries 0 --timeout 20 \
         --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" 2>/dev/null; then
    echo "floor: ${TORCH_INDEX:-no CPU index given}: no CPU wheel there; installing PyPI's torch==$TORCH_VERSION" \
         "with the nvidia-* packages it needs to import"
    pip_install "torch==$TORCH_VERSION"
  fi
  [[ "$(torch_version)" == "$TORCH_VERSION"* ]] || { echo "floor: torch==$TORCH_VERSION did not install"; exit 1; }
  echo "floor: torch $(torch_version) installed (${SECONDS}s so far)"
fi
# module:package pairs; a module counts as installed when Python finds it (nothing is imported).
missing=($(missing_packages numpy:numpy pytest:pytest xdist:pytest-xdist expecttest:expecttest \
                            ninja:ninja setuptools:setuptools))
if [ ${#missing[@]} -gt 0 ]; then
  echo "floor: installing ${missing[*]}"
  # The constraint keeps pip from replacing this venv's torch while resolving these.
  pip_install -c <(echo "torch==$(torch_version)") "${missing[@]}"
fi

# A fresh copy of what the build and the tests read; built files and caches stay behind.
rm -rf "$SRC"
mkdir -p "$SRC" "$BUILD"
tar -cf - --exclude=__pycache__ --exclude='*.so' --exclude='*.egg-info' \
    setup.py pyproject.toml README.md csrc pfl_kernels pfl_algorithms tests benchmarks scripts | tar -xf - -C "$SRC"

stamp="$BUILD/.pfl-build-stamp"
want="$(bash scripts/extension_hash.sh) -O$OPT_LEVEL"
if [ "$want" != "$(cat "$stamp" 2>/dev/null || true)" ] || ! ls "$BUILD"/lib/pfl_kernels/_C*.so >/dev/null 2>&1; then
  log="$VENV/pfl-build.log"
  echo "floor: building the C++ extension at -O$OPT_LEVEL against torch $(torch_version) (about 2 minutes on 2 cores); log in $log"
  rm -f "$stamp"
  # --force: setuptools compares only the .cpp files' times with the library's, not the
  # headers'; ninja still recompiles only what changed.
  if ! (cd "$SRC" && MAX_JOBS=${MAX_JOBS:-$(nproc)} PFL_KERNELS_CUDA=0 PFL_KERNELS_OPT_LEVEL=$OPT_LEVEL "$PY" setup.py -q build_ext --force \
          --build-lib "$BUILD/lib" --build-temp "$BUILD/temp") >"$log" 2>&1; then
    echo "floor: the C++ extension did not build against torch $(torch_version); the end of $log:"
    tail -n 40 "$log"
    exit 1
  fi
  echo "$want" > "$stamp"
  echo "floor: built (${SECONDS}s so far)"
fi
cp "$BUILD"/lib/pfl_kernels/_C*.so "$SRC/pfl_kernels/"

cd "$SRC"
# The tests must run on the extension: without it they would pass on the reference kernels.
"$PY" -c "import pfl_kernels._C, torch; print('floor: pfl_kernels._C built against torch', torch.__version__)"
cores=$(nproc 2>/dev/null || echo 2)
WORKERS=${PFL_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
# Besides tests/kernels and tests/nn: the CPU side of every other file that gpu_check.sh runs on
# the GPU machines (its GPU_TESTS), whose torch is 2.11 too (executors, captured steps, batched
# evaluation, GEMM convolutions, augmentation, the package; about 10 s), so a torch-2.11 break
# there shows here before a GPU is spent on it (tests/test_gpu_scripts.py keeps the lists in step).
FLOOR_TESTS=(tests/kernels tests/nn
             tests/algorithms/engine/test_executors.py tests/algorithms/engine/test_step_graphs.py
             tests/algorithms/engine/test_batched_eval.py tests/algorithms/engine/test_conv_gemm.py
             tests/algorithms/engine/test_conv_nhwc.py
             tests/algorithms/engine/test_conv_per_client.py
             tests/algorithms/engine/test_mixed_batch_norm.py tests/algorithms/engine/test_folded_channels.py
             tests/algorithms/engine/test_checkpoint_writer.py
             tests/algorithms/engine/test_autocast_convolutions.py
             tests/algorithms/test_augment.py tests/test_package.py)
exec "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadfile "${FLOOR_TESTS[@]}" "$@"

#!/usr/bin/env bash
# Before a GPU call, on this machine: the C++ extension built against the GPU image's torch, into
# build/gpu-prebuilt/ (_C.abi3.so and its stamp: the sources' hash and the torch version).  Carry
# that folder to the GPU machine (the device tool's `carry: ["build/gpu-prebuilt"]`): there
# `gpu_check.sh` installs it instead of compiling (64 s of quick's 6 minutes on an H100) where
# the stamp names that machine's torch and these sources, and compiles as before where not.
#
# The build is test_floor.sh's (its venv .venv-floor holds the floor torch, 2.11.0: the GPU
# image's torch is 2.11.0+cu130, which PyPI's wheel is; the CPU index's +cpu wheel would not
# match it and the GPU machine would compile).  The extension is abi3, so any Python >= 3.10
# loads it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${PFL_FLOOR_VENV:-.venv-floor}
OUT_DIR=build/gpu-prebuilt
# Builds (or reuses, by the same stamp) $VENV/build-O3 against the venv's torch; collecting the
# floor tests is the cheapest run of the script that gets there.  At -O3, as every build users
# run: the floor phase's own -O1 build, which only checks the sources, has its own folder.
PFL_FLOOR_OPT_LEVEL=3 bash scripts/test_floor.sh --collect-only -q >/dev/null
mkdir -p "$OUT_DIR"
cp "$VENV"/build-O3/lib/pfl_kernels/_C.abi3.so "$OUT_DIR/"
torch_version=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
echo "$(bash scripts/extension_hash.sh) $torch_version" > "$OUT_DIR/stamp"
echo "gpu_prebuild: $OUT_DIR/_C.abi3.so built against torch $torch_version; carry $OUT_DIR"

#!/usr/bin/env bash
# The hash of what the C++ extension is built from (setup.py, pyproject.toml, csrc/), the first
# half of a build's stamp: test_floor.sh's kept build and gpu_prebuild.sh's prebuilt extension
# are reused only where it is unchanged.  The files in C-locale order, so that every machine
# hashes them alike.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cat setup.py pyproject.toml $(find csrc -type f | LC_ALL=C sort) | sha256sum | cut -d' ' -f1

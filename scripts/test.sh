#!/usr/bin/env bash
# The test command: installs what is missing, configures, builds everything (tests, examples, every
# header on its own, every CUDA translation unit where nvcc exists) and runs ctest.
# Extra arguments go to ctest, e.g. `scripts/test.sh -R layout`.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
cmake --preset default
cmake --build --preset default
ctest --preset default "$@"

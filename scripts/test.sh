#!/usr/bin/env bash
# The test command: installs what is missing, configures, builds everything (tests, examples, every
# header on its own, every CUDA translation unit where nvcc exists) and runs ctest.
# Extra arguments go to ctest, e.g. `scripts/test.sh -R layout`.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
cmake --preset default
cmake --build --preset default
# A failing test is run once more before it counts (--repeat until-pass:2): a rare gloo connect race
# ("connecting the group failed: ... Connection closed by peer", seen once in ~8 full runs, in a test that
# creates meshes in several run_ranks calls in one process) is under investigation. A test that fails
# twice fails the run; ctest's output still lists every failed attempt.
ctest --preset default --repeat until-pass:2 "$@"

#!/usr/bin/env bash
# The test command: installs what is missing (the build's Debian packages and python3-torch, the other side
# of the interop tests), configures with every test dependency required (a missing one is a configure
# error, never a silently skipped test), builds everything but the programs nvcc compiles (tests, examples,
# benchmarks' smoke runs; the device kernels run on the host through the emulated CUDA tests) and runs ctest.
# CI's next phases: every header compiled on its own (`cmake --build --preset headers`), then the nvcc programs
# and their tests (`cmake --build --preset cuda && ctest --preset cuda`). Prints the time of each phase at the end,
# in seconds and in calibration units (scripts/lib/ci.sh).
# Extra arguments go to ctest, e.g. `scripts/test.sh -R layout` or `scripts/test.sh -L compile_fail`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/phases.sh
source scripts/lib/ci.sh
phases_begin

status=0
phase "test: install missing packages" scripts/deps.sh --tests
calibrate # the unit every phase is also printed in (scripts/lib/ci.sh), once the compiler is installed
phase "test: configure" cmake --preset default -DDTENSOR_REQUIRE_TEST_DEPS=ON
phase "test: build" cmake --build --preset default
phase "test: ctest" ctest --preset default "$@" || status=$?
if [[ ${phases_owner:-0} == 1 ]]; then
  print_phases "scripts/test.sh phases"
fi
exit $status

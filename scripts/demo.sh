#!/usr/bin/env bash
# The demo command: installs what is missing, builds the redistribution tour and the launcher, and runs
# the tour as 4 CPU ranks (4 processes over gloo on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
cmake --preset default >/dev/null
cmake --build build -j2 --target dtensor-run example_03_redistribution_tour
./build/tools/dtensor-run/dtensor-run --standalone --nproc-per-node 4 --local-ranks-filter 0 \
  ./build/examples/example_03_redistribution_tour

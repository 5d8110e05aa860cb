#!/usr/bin/env bash
# The demo command: installs what is missing, builds the training example and the launcher (Release, in
# build-release/: the demo prints step times; the test build is -Og), and trains
# the small model of examples/06_train.cpp for 50 steps as 4 CPU ranks (4 processes over gloo on this
# machine), FSDP x TP on (dp=2, tp=2). Arguments go to the example (e.g. --layout hsdp --steps 20).
# `scripts/demo.sh tour` runs the redistribution tour (examples/03_redistribution_tour.cpp) instead.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
cmake --preset release >/dev/null
example=example_06_train
if [[ "${1:-}" == tour ]]; then
  example=example_03_redistribution_tour
  shift
fi
cmake --build build-release -j2 --target dtensor-run "$example"
./build-release/tools/dtensor-run/dtensor-run --standalone --nproc-per-node 4 --local-ranks-filter 0 \
  "./build-release/examples/$example" "$@"

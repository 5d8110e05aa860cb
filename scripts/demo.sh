#!/usr/bin/env bash
# The demo command: installs what is missing, builds the demo and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
cmake --preset default >/dev/null
cmake --build build -j2 --target example_00_layout_table
./build/examples/example_00_layout_table

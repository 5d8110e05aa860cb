#!/usr/bin/env bash
# The demo command: installs what is missing, builds the GPT example and the launcher (Release, in
# build-release/: the demo prints tokens/s; the test build is -O0), and trains the character-level GPT of
# examples/09_gpt.cpp on the fortunes text as 4 CPU ranks (4 processes on this machine over MPI, which
# dtensor-run starts through mpirun where the example links it, else over gloo), FSDP x tensor + sequence
# parallel on (dp=2, cp=1, tp=2), about a minute of training; then writes the loss curves as
# build-release/demo/gpt_loss.csv and gpt_loss.png (gnuplot). Arguments go to the example (e.g. --layout
# cp_ring --steps 100). `scripts/demo.sh train` runs examples/06_train.cpp instead, `scripts/demo.sh tour`
# the redistribution tour (examples/03_redistribution_tour.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
cmake --preset release >/dev/null
example=example_09_gpt
case "${1:-}" in
tour) example=example_03_redistribution_tour && shift ;;
train) example=example_06_train && shift ;;
esac
cmake --build build-release -j2 --target dtensor-run "$example"
args=("$@")
out=build-release/demo
if [[ $example == example_09_gpt ]]; then
  mkdir -p "$out"
  rm -f "$out/gpt_loss.csv" "$out/gpt_loss.png"
  args=(--csv "$out/gpt_loss.csv" "$@")
fi
# --tee 0: the output as the ranks print it (rank 0 prints the run; any rank its errors)
OPENBLAS_NUM_THREADS=1 ./build-release/tools/dtensor-run/dtensor-run --standalone --nproc-per-node 4 --tee 0 \
  "./build-release/examples/$example" "${args[@]}"
if [[ -s $out/gpt_loss.csv && $example == example_09_gpt ]]; then
  gnuplot -e "csv='$out/gpt_loss.csv'; png='$out/gpt_loss.png'" scripts/plot_loss.gp
  echo "loss curves: $out/gpt_loss.csv and $out/gpt_loss.png"
fi

#!/usr/bin/env bash
# The TP MLP row, ours (bench_mlp) next to torch 1.13 (torch_mlp.py) in one run: K passes, each one launch
# of each side on N processes, the order alternating (ours first in odd passes, torch first in even ones)
# so a drift of the machine hits both; then bench/mlp/join.py prints one table and writes
# bench/results/mlp_vs_torch_n<N>.json (_gelu / _none appended for those activations). Without
# python3-torch, ours runs alone (no ratio).
#
# usage: bench/mlp/mlp_vs_torch.sh [--passes K] [--nproc N] [--threads T] [--scale S] [--act relu|gelu|none]
#                                  [--sizes TxHxF,...] [--markdown] [--out DIR]
#   defaults: 3 passes, 4 processes, 1 thread, relu, DIR bench/results. Threads: OPENBLAS_NUM_THREADS=T and
#   OMP_NUM_THREADS=T for both sides, torch.set_num_threads(T) for torch. BUILD_DIR (default build-bench) is
#   configured as scripts/bench.sh does if needed, and bench_mlp and dtensor-run are built in it.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-bench}
passes=3
nproc=4
threads=1
out=bench/results
common=()
join_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
  --passes) passes=$2; shift 2 ;;
  --nproc) nproc=$2; shift 2 ;;
  --threads) threads=$2; shift 2 ;;
  --scale | --act | --sizes) common+=("$1" "$2"); shift 2 ;;
  --markdown) join_args+=(--markdown); shift ;;
  --out) out=$2; shift 2 ;;
  *) echo "mlp_vs_torch.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [[ ! -f "$build/build.ninja" && ! -f "$build/Makefile" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTENSOR_ENABLE_CUDA=OFF
fi
cmake --build "$build" -j2 --target dtensor-run bench_mlp
run="$build/tools/dtensor-run/dtensor-run --standalone --tee 0 --nproc-per-node $nproc"
export OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads

torch_py=/usr/bin/python3
have_torch=0
if "$torch_py" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
  have_torch=1
else
  echo "(python3-torch not installed: ours only; apt-get install -y python3-torch)"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ours() { $run "$build/bench/bench_mlp" "${common[@]}" --out "$1"; }
theirs() { $run --rank0-store "$torch_py" bench/mlp/torch_mlp.py "${common[@]}" --threads "$threads" --out "$1"; }
dirs=()
for ((p = 1; p <= passes; ++p)); do
  d="$tmp/pass$p"
  mkdir -p "$d"
  dirs+=("$d")
  echo "== pass $p of $passes ($nproc processes, $threads thread(s) each)"
  if [[ $have_torch == 1 && $((p % 2)) == 0 ]]; then
    theirs "$d"
    ours "$d"
  else
    ours "$d"
    if [[ $have_torch == 1 ]]; then
      theirs "$d"
    fi
  fi
done
mkdir -p "$out"
"$torch_py" bench/mlp/join.py --ranks "$nproc" --out "$out" "${join_args[@]}" "${dirs[@]}"

#!/usr/bin/env bash
# MoE dispatch + combine at 4 ranks, ours (bench_moe) next to torch 1.13 (torch_moe.py) in one run: 3 passes,
# the order alternating, then one table of the medians over the passes (each pass: the slowest rank's
# median) and bench/results/moe_vs_torch_n4.json. Without python3-torch, ours alone.
#
# usage: bench/moe/moe_vs_torch.sh [--passes K] [--smoke]     (BUILD_DIR: default build-bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-bench}
passes=3
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
  --passes) passes=$2; shift 2 ;;
  --smoke) extra+=(--smoke); passes=1; shift ;;
  *) echo "moe_vs_torch.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [[ ! -f "$build/build.ninja" && ! -f "$build/Makefile" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTENSOR_ENABLE_CUDA=OFF
fi
cmake --build "$build" -j2 --target dtensor-run bench_moe
run="$build/tools/dtensor-run/dtensor-run --standalone --tee 0 --nproc-per-node 4"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
have_torch=0
/usr/bin/python3 -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null && have_torch=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for ((p = 1; p <= passes; ++p)); do
  mkdir -p "$tmp/$p"
  if [[ $have_torch == 1 && $((p % 2)) == 0 ]]; then
    $run --rank0-store /usr/bin/python3 bench/moe/torch_moe.py "${extra[@]}" --out "$tmp/$p"
  fi
  $run "$build/bench/bench_moe" "${extra[@]}" --out "$tmp/$p" >/dev/null
  if [[ $have_torch == 1 && $((p % 2)) == 1 ]]; then
    $run --rank0-store /usr/bin/python3 bench/moe/torch_moe.py "${extra[@]}" --out "$tmp/$p"
  fi
done
/usr/bin/python3 - "$tmp" "$passes" <<'PY'
import json, os, statistics, sys
tmp, passes = sys.argv[1], int(sys.argv[2])
ours = [json.load(open(os.path.join(tmp, str(p), "moe_n4.json"))) for p in range(1, passes + 1)]
theirs = [json.load(open(f)) for f in (os.path.join(tmp, str(p), "torch_moe_n4.json") for p in range(1, passes + 1)) if os.path.exists(f)]
rows = []
print(f"{'rows/peer x hidden':<22}{'ours exchange us':>18}{'torch exchange us':>19}{'ratio':>8}{'our MoE forward us':>20}")
for i, r in enumerate(ours[0]):
    o = statistics.median(p[i]["exchange_us"] for p in ours)
    m = statistics.median(p[i]["moe_forward_us"] for p in ours)
    t = statistics.median(p[i]["exchange_us"] for p in theirs) if theirs else float("nan")
    rows.append({"size": r["size"], "ours_exchange_us": o, "torch_exchange_us": t, "ratio": o / t if theirs else None,
                 "moe_forward_us": m})
    print(f"{r['size']:<22}{o:>18.1f}{t:>19.1f}{(o / t if theirs else float('nan')):>8.2f}{m:>20.1f}")
os.makedirs("bench/results", exist_ok=True)
json.dump(rows, open("bench/results/moe_vs_torch_n4.json", "w"), indent=1)
print("wrote bench/results/moe_vs_torch_n4.json")
PY

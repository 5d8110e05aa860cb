#!/usr/bin/env bash
# What each nn::Recompute costs and saves: bench_train --model gpt --layout tp (the GPT of
# examples/09_gpt.cpp under tensor + sequence parallelism, N processes on gloo) with every block at
# --recompute selective (the bound, the default), none (every op keeps its inputs) and full (only the
# block's input), and with --before BIN a bench_train built from an earlier commit (e.g. before the blocks
# kept the bound), K passes in rotation so that a drift of the machine hits all. Prints per variant the
# medians of the step, of the time blocked in the tensor-parallel all_gathers, and the heap peak per rank,
# and each variant's step against selective's pass by pass; writes bench/results/train_recompute_gpt_n<N>.json.
#
# usage: bench/train/recompute.sh [--before BENCH_TRAIN] [--passes K] [--nproc N] [--tokens T] [--out DIR]
#   defaults: 5 passes, 4 processes, 2048 tokens (hidden 256, ffn 768, vocab 2048, 8 steps), DIR
#   bench/results. BUILD_DIR (default build-bench) is configured as scripts/bench.sh does if needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
before=
passes=5
nproc=4
tokens=2048
out=bench/results
while [[ $# -gt 0 ]]; do
  case "$1" in
  --before) before=$2; shift 2 ;;
  --passes) passes=$2; shift 2 ;;
  --nproc) nproc=$2; shift 2 ;;
  --tokens) tokens=$2; shift 2 ;;
  --out) out=$2; shift 2 ;;
  *) echo "recompute.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
source bench/common/release_build.sh bench_train
run="$build/tools/dtensor-run/dtensor-run --standalone --nproc-per-node $nproc"
args="--model gpt --layout tp --steps 8 --tokens $tokens --hidden 256 --ffn 768 --vocab 2048 --no-check"
variants=(selective none full)
[[ -n $before ]] && variants+=(before)
for ((p = 1; p <= passes; ++p)); do
  echo "== pass $p of $passes"
  for v in "${variants[@]}"; do
    if [[ $v == before ]]; then
      $run "$before" $args --json "$tmp/$v.$p.json" > "$tmp/$v.$p.log" 2>&1
    else
      $run "$build/bench/bench_train" $args --recompute "$v" --json "$tmp/$v.$p.json" > "$tmp/$v.$p.log" 2>&1
    fi
    # the blocked time in all_gather(tp), which the JSON does not carry: from rank 0's printout
    grep -o 'all_gather(tp) [0-9.]*' "$tmp/$v.$p.log" | head -1 | awk '{print $2}' > "$tmp/$v.$p.ag"
  done
done
mkdir -p "$out"
python3 - "$tmp" "$passes" "$out/train_recompute_gpt_n$nproc.json" "${variants[@]}" <<'EOF'
import json, statistics, sys
tmp, passes, dest, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
runs = {v: [] for v in variants}
for v in variants:
    for p in range(1, passes + 1):
        r = json.load(open(f"{tmp}/{v}.{p}.json"))
        ag = open(f"{tmp}/{v}.{p}.ag").read().strip()
        runs[v].append({"step_ms": r["step_ms"], "all_gather_tp_ms": float(ag or 0),
                        "heap_peak_mb": r["heap_peak_bytes"] / 1e6})
rows = []
print("| variant | step ms (median) | step / selective (paired median) | blocked in all_gather(tp) ms | heap peak MB |")
print("|---|---|---|---|---|")
for v in variants:
    med = lambda k: statistics.median(x[k] for x in runs[v])
    paired = statistics.median(a["step_ms"] / b["step_ms"] for a, b in zip(runs[v], runs["selective"]))
    rows.append({"variant": v, "step_ms": med("step_ms"), "step_vs_selective": paired,
                 "all_gather_tp_ms": med("all_gather_tp_ms"), "heap_peak_mb": med("heap_peak_mb")})
    print(f"| {v} | {med('step_ms'):.1f} | {paired:.3f} | {med('all_gather_tp_ms'):.1f} | {med('heap_peak_mb'):.1f} |")
json.dump({"suite": "train_recompute", "model": "gpt", "layout": "tp", "passes": passes, "rows": rows,
           "runs": runs}, open(dest, "w"), indent=1)
print("wrote", dest)
EOF

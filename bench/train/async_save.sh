#!/usr/bin/env bash
# What saving the training state costs the steps: bench_train --model gpt (the GPT of examples/09_gpt.cpp,
# N processes on gloo) with no save, a synchronous save (the step waits for the disk: files fsynced, index,
# rename) and an asynchronous one (the step waits for the host copy; a thread writes and publishes) every K
# steps into a CheckpointFolder, K passes in rotation so that a drift of the machine hits all. Prints per
# variant the medians of the mean step (the save call counted in its step), of a save call, and of the wait
# for the last save after the steps, and each variant's step against no save pass by pass; writes
# bench/results/train_async_save_gpt_n<N>.json.
#
# usage: bench/train/async_save.sh [--passes K] [--nproc N] [--layout L] [--every K] [--out DIR]
#   defaults: 5 passes, 4 processes, fsdp_tp (2048 tokens, hidden 256, ffn 768, vocab 2048, 12 steps), a
#   save every 2 steps, DIR bench/results. BUILD_DIR (default build-bench) is configured as scripts/bench.sh
#   does if needed. The states go to a temporary folder on the file system of TMPDIR.
set -euo pipefail
cd "$(dirname "$0")/../.."
passes=5
nproc=4
layout=fsdp_tp
every=2
out=bench/results
while [[ $# -gt 0 ]]; do
  case "$1" in
  --passes) passes=$2; shift 2 ;;
  --nproc) nproc=$2; shift 2 ;;
  --layout) layout=$2; shift 2 ;;
  --every) every=$2; shift 2 ;;
  --out) out=$2; shift 2 ;;
  *) echo "async_save.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
source bench/common/release_build.sh bench_train
run="$build/tools/dtensor-run/dtensor-run --standalone --nproc-per-node $nproc"
args="--model gpt --layout $layout --steps 12 --tokens 2048 --hidden 256 --ffn 768 --vocab 2048 --no-check"
variants=(none sync async)
for ((p = 1; p <= passes; ++p)); do
  echo "== pass $p of $passes"
  for v in "${variants[@]}"; do
    save=()
    [[ $v != none ]] && save=(--save-every "$every" --save "$v" --save-dir "$tmp/state")
    $run "$build/bench/bench_train" $args "${save[@]}" --json "$tmp/$v.$p.json" > "$tmp/$v.$p.log" 2>&1 ||
      { cat "$tmp/$v.$p.log"; exit 1; }
    rm -rf "$tmp/state"
  done
done
mkdir -p "$out"
python3 - "$tmp" "$passes" "$out/train_async_save_gpt_n$nproc.json" "$layout" "$every" "${variants[@]}" <<'EOF'
import json, statistics, sys
tmp, passes, dest, layout, every, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], \
    int(sys.argv[5]), sys.argv[6:]
runs = {v: [] for v in variants}
for v in variants:
    for p in range(1, passes + 1):
        r = json.load(open(f"{tmp}/{v}.{p}.json"))
        runs[v].append({"step_ms": r["step_ms"], "save_call_ms": r["save_call_ms"],
                        "final_wait_ms": r["final_wait_ms"], "saves": r["saves"],
                        "state_mb": r["state_bytes"] / 1e6})
rows = []
print(f"| save every {every} steps | step ms (median) | step / no save (paired median) | save call ms | "
      "wait for the last save ms |")
print("|---|---|---|---|---|")
for v in variants:
    med = lambda k: statistics.median(x[k] for x in runs[v])
    paired = statistics.median(a["step_ms"] / b["step_ms"] for a, b in zip(runs[v], runs["none"]))
    rows.append({"variant": v, "step_ms": med("step_ms"), "step_vs_none": paired,
                 "save_call_ms": med("save_call_ms"), "final_wait_ms": med("final_wait_ms")})
    print(f"| {v} | {med('step_ms'):.1f} | {paired:.3f} | {med('save_call_ms'):.1f} | "
          f"{med('final_wait_ms'):.1f} |")
json.dump({"suite": "train_async_save", "model": "gpt", "layout": layout, "save_every": every,
           "passes": passes, "state_mb_per_rank": runs["none"][0]["state_mb"], "rows": rows, "runs": runs},
          open(dest, "w"), indent=1)
print("wrote", dest)
EOF

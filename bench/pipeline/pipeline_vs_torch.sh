#!/usr/bin/env bash
# A 1F1B step at 4 processes, ours (bench_pipeline_p2p: run_pipeline on DTensors) next to torch 1.13
# (torch_pipeline.py: the same step hand-written over dist.recv / dist.isend) in one run: 3 passes, the
# order alternating, then one table of the medians over the passes (each pass: the slowest rank's median
# step), the step with free transfers (the schedule's timeline) and each side's exposed communication, and
# bench/results/pipeline_vs_torch_n4.json. Without python3-torch, ours alone.
#
# usage: bench/pipeline/pipeline_vs_torch.sh [--passes K] [--smoke]     (BUILD_DIR: default build-bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
source bench/common/paired_runs.sh pipeline_vs_torch.sh bench_pipeline_p2p bench/pipeline/torch_pipeline.py "$@"
/usr/bin/python3 - "$tmp" "$passes" <<'PY'
import json, os, statistics, sys
tmp, passes = sys.argv[1], int(sys.argv[2])
ours = [json.load(open(os.path.join(tmp, str(p), "pipeline_p2p_n4.json"))) for p in range(1, passes + 1)]
theirs = [json.load(open(f)) for f in (os.path.join(tmp, str(p), "torch_pipeline_n4.json") for p in range(1, passes + 1)) if os.path.exists(f)]
nan = float("nan")
rows = []
print(f"{'rows x hidden':<15}{'m':>4}{'free-transfer ms':>18}{'ours ms':>10}{'torch ms':>10}{'ratio':>8}"
      f"{'ours exposed':>14}{'torch exposed':>15}")
for i, r in enumerate(ours[0]):
    o = statistics.median(p[i]["step_ms"] for p in ours)
    t = statistics.median(p[i]["step_ms"] for p in theirs) if theirs else nan
    ideal = r["ideal_ms"]
    rows.append({"size": r["size"], "microbatches": r["microbatches"], "ideal_ms": ideal, "ours_ms": o,
                 "torch_ms": t if theirs else None, "ratio": o / t if theirs else None,
                 "ours_exposed_ms": o - ideal, "torch_exposed_ms": t - ideal if theirs else None})
    print(f"{r['size']:<15}{r['microbatches']:>4}{ideal:>18.1f}{o:>10.1f}{t:>10.1f}{(o / t if theirs else nan):>8.2f}"
          f"{o - ideal:>14.1f}{t - ideal:>15.1f}")
os.makedirs("bench/results", exist_ok=True)
json.dump(rows, open("bench/results/pipeline_vs_torch_n4.json", "w"), indent=1)
print("wrote bench/results/pipeline_vs_torch_n4.json")
PY

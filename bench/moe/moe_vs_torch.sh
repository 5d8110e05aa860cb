#!/usr/bin/env bash
# MoE dispatch + combine at 4 ranks, ours (bench_moe) next to torch 1.13 (torch_moe.py) in one run: 3 passes,
# the order alternating, then one table of the medians over the passes (each pass: the slowest rank's
# median) and bench/results/moe_vs_torch_n4.json. Without python3-torch, ours alone.
#
# usage: bench/moe/moe_vs_torch.sh [--passes K] [--smoke]     (BUILD_DIR: default build-bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
source bench/common/paired_runs.sh moe_vs_torch.sh bench_moe bench/moe/torch_moe.py "$@"
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

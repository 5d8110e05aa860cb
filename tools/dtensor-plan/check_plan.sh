#!/bin/sh
# dtensor-plan's test: the tiny model on 2 nodes of 4 GPUs. Every layout it lists dry-runs (no "cannot
# run"), pipelines among them (1F1B, interleaved, ZB-H1 and ZB-V, each with two representative ranks and a
# bubble; ZB-H1's no larger than 1F1B's) and
# HSDP, at least one fits in 1 GiB and none in 1 KiB, the best is listed first, and the JSON parses and
# holds every layout with its dry runs (HSDP and DDP among them); a mixture of experts plans with its experts
# sharded over ep; float compute gathers twice the bytes of bfloat16; no dry run has an op over an axis of
# size 1.
# usage: check_plan.sh DTENSOR_PLAN DIR
set -u
plan=$1 dir=$2
rm -rf "$dir" && mkdir -p "$dir" || exit 1
fail() { echo "check_plan: $*"; exit 1; }
"$plan" --model tiny --nodes 2 --gpus-per-node 4 --gpu-memory 1GiB --replicas 1,2,8 --zero-bubble --json "$dir/plan.json" >"$dir/out" 2>&1 ||
  { cat "$dir/out"; fail "dtensor-plan failed"; }
cat "$dir/out"
grep -q "cannot run" "$dir/out" && fail "a layout did not dry-run"
rows=$(awk '$1 ~ /^[0-9]+$/' "$dir/out" | wc -l)
[ "$rows" -ge 4 ] || fail "$rows layouts listed, want at least 4"
awk '$1 ~ /^[0-9]+$/ { print $13; exit }' "$dir/out" | grep -qx yes || fail "the first layout does not fit 1 GiB"
python3 - "$dir/plan.json" "$rows" <<'PY' || fail "the JSON"
import json, sys
p = json.load(open(sys.argv[1]))
assert p["world_size"] == 8, p["world_size"]
ls = p["layouts"]
assert len(ls) >= int(sys.argv[2]), len(ls)
for l in ls:
    assert l["dp"] * l["pp"] * l["cp"] * l["tp"] == 8, l
    runs = l["dry_runs"]
    assert len(runs) == (1 if l["pp"] == 1 else 2), l
    # the first and the last stage's rank at the last cp coordinate (the most causal attention)
    assert [d["rank"] for d in runs] == [(s * l["cp"] + l["cp"] - 1) * l["tp"] for s in sorted({0, l["pp"] - 1})], l
    for d in runs:
        assert d["world_size"] == 8 and d["peak_bytes"] > 0 and d["flops"] > 0 and d["step_seconds"] > 0, d
        assert sum(d["at_peak"].values()) == d["peak_bytes"], d
        assert sum(c["bytes"] for c in d["comm"]) == d["bytes_nvlink"] + d["bytes_network"], d
        assert sum(c["count"] for c in d["comm"]) == d["ops"], d
        # an axis of size 1 costs nothing: no op over it (tp = 1, cp = 1, ... layouts)
        sizes = {"pp": l["pp"], "cp": l["cp"], "tp": l["tp"], "ep": l["ep"], "rep": l["replicas"]}
        for c in d["comm"]:
            assert all(sizes.get(a, 2) > 1 for a in c["axes"].split("*")), (l, c)
    # the step: the slowest representative's timeline plus its pipeline idle (none without a pipeline)
    assert (l["bubble_seconds"] > 0) == (l["pp"] > 1), l
    assert l["recompute"] == (l["pp"] == 1), l  # a pipeline recomputes only where it does not fit
    assert l["step_seconds"] >= max(d["step_seconds"] for d in runs), l
pipes = {l["chunks"] for l in ls if l["pp"] > 1}
assert pipes >= {1, 2}, pipes
# --zero-bubble: each pipeline also under ZB-H1 and ZB-V, whose bubble is at most 1F1B's on the same layout
assert {l["schedule"] for l in ls if l["pp"] > 1} == {"1F1B", "i1F1B", "ZB-H1", "ZB-V"}, ls
assert all(l["schedule"] == "-" for l in ls if l["pp"] == 1), ls
key = lambda l: (l["dp"], l["replicas"], l["pp"], l["cp"], l["tp"], l["micro_batch"], l["recompute"])
one = {key(l): l for l in ls if l["schedule"] == "1F1B"}
zb = [l for l in ls if l["schedule"] == "ZB-H1" and key(l) in one]
assert zb, ls
for l in zb:
    assert l["bubble_seconds"] <= one[key(l)]["bubble_seconds"] * (1 + 1e-9), (l, one[key(l)])
# HSDP: 2 replicas of FSDP over dp / 2, with and without a pipeline; DDP: replicas = dp
assert {l["pp"] > 1 for l in ls if l["replicas"] == 2} == {False, True}, ls
assert any(l["replicas"] == l["dp"] == 8 for l in ls), ls
PY
# A mixture of experts: expert parallel layouts (ep 1, 2, 4) with and without a pipeline, all of them run
"$plan" --model tiny-moe --nodes 2 --gpus-per-node 4 --gpu-memory 1GiB --tp 1,2 --json "$dir/moe.json" \
  >"$dir/moe" 2>&1 || { cat "$dir/moe"; fail "the MoE plan failed"; }
grep -q "cannot run" "$dir/moe" && { cat "$dir/moe"; fail "a MoE layout did not dry-run"; }
python3 - "$dir/moe.json" <<'PY' || fail "the MoE JSON"
import json, sys
ls = json.load(open(sys.argv[1]))["layouts"]
assert {l["ep"] for l in ls} == {1, 2, 4}, {l["ep"] for l in ls}
assert {l["pp"] > 1 for l in ls if l["ep"] > 1} == {False, True}, ls
assert all(l["cp"] == 1 for l in ls), ls  # nn::Moe takes no context parallelism
for l in ls:
    assert l["dp"] % (l["replicas"] * l["ep"]) == 0 and l["dp"] * l["pp"] * l["tp"] == 8, l
    # the experts' exchange: all_to_alls over ep exactly when the experts are sharded
    a2a = [c for d in l["dry_runs"] for c in d["comm"] if c["op"] == "all_to_all" and c["axes"] == "ep"]
    assert bool(a2a) == (l["ep"] > 1), (l, a2a)
PY
# float compute: the same layout gathers its FSDP shards in 4 bytes instead of 2 (the gradients are reduced
# in float either way)
for t in bf16 fp32; do
  "$plan" --model tiny --nodes 2 --gpus-per-node 4 --tp 1 --cp 1 --pp 1 --micro-batch 2 --dtype $t \
    --json "$dir/$t.json" >"$dir/$t" 2>&1 || { cat "$dir/$t"; fail "the $t plan failed"; }
done
python3 - "$dir/bf16.json" "$dir/fp32.json" <<'PY' || fail "bf16 against fp32"
import json, sys
def rows(f):
    d = json.load(open(f))["layouts"][0]["dry_runs"][0]
    return {(c["op"], c["axes"]): c["bytes"] for c in d["comm"]}
b, f = rows(sys.argv[1]), rows(sys.argv[2])
assert f[("all_gather", "dp")] == 2 * b[("all_gather", "dp")] > 0, (b, f)
assert f[("reduce_scatter", "dp")] == b[("reduce_scatter", "dp")] > 0, (b, f)
PY
"$plan" --model tiny --nodes 2 --gpus-per-node 4 --gpu-memory 0.000001GiB --cp 1 --pp 1,2 --micro-batch 4 \
  >"$dir/small" 2>&1 || fail "1 KiB run"
awk '$1 ~ /^[0-9]+$/' "$dir/small" | grep -q . || fail "the 1 KiB run lists no layout"
# a pipeline that does not fit is planned again recomputing (rc); FSDP always recomputes
awk '$1 ~ /^[0-9]+$/ && $4 > 1' "$dir/small" | grep -q . || fail "the 1 KiB run lists no pipeline"
awk '$1 ~ /^[0-9]+$/ && $11 != "yes"' "$dir/small" | grep -q . && fail "a layout of the 1 KiB run does not recompute"
awk '$1 ~ /^[0-9]+$/ && $13 == "yes"' "$dir/small" | grep -q . && fail "a layout fits 1 KiB"
rm -rf "$dir"
echo "check_plan: OK"

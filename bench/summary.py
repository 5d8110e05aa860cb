#!/usr/bin/env python3
"""BENCHMARKS.md's generated tables, computed from bench/results/*.json.

    python3 bench/summary.py            # rewrites every generated table in BENCHMARKS.md
    python3 bench/summary.py --check    # exits 1 naming each row that differs from what the JSON gives
    (--file PATH: another copy of BENCHMARKS.md instead)

A generated table sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in BENCHMARKS.md. NAME is one of
the TABLES below: the summary at the top, and the section tables whose figures come straight from one results
file (host overhead, uneven sizes, redistribution, attention). Every figure of a summary row comes from the
files named in its "data" column; a row whose figures no results file holds says "quoted" and where from.
To change a row, change this script (or rerun the benchmark that writes the JSON), then run it.
Python 3 standard library only; ctest runs `--check` (`bench/summary_current`).
"""
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"


def load(name):
    with open(RESULTS / name) as f:
        return json.load(f)


def f2(x):
    return f"{x:.2f}"


def rng(values, fmt=f2):
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def med(values):
    return statistics.median(values)


def us(x):
    """A time in µs the way the tables print it: no exponent, about three figures."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def data(*names):
    """The results files a row reads, `x_n2.json` and `x_n4.json` written as `x_n{2,4}.json`."""
    groups = {}
    for n in names:
        m = re.fullmatch(r"(.*_n)(\d+)(\.json)", n)
        key = (m.group(1), m.group(3)) if m else (n, "")
        groups.setdefault(key, []).append(m.group(2) if m else "")
    out = []
    for (head, tail), counts in groups.items():
        out.append(f"`{head}{counts[0]}{tail}`" if len(counts) == 1 else f"`{head}{{{','.join(counts)}}}{tail}`")
    return ", ".join(out)


def quoted(where):
    return f"quoted: {where} (no results file)"


def pretty(transition):
    return transition.replace("->", "→").replace("P(sum)", "P")


# ---- the summary ---------------------------------------------------------------------------------------------


def collectives_gloo():
    rows = []
    big, small = {}, {}
    for n in (2, 4):
        d = load(f"collectives_gloo_n{n}.json")
        big[n] = [r for r in d if r["bytes"] >= 65536]
        first = {}
        for r in d:
            if r["name"] != "barrier" and (r["name"] not in first or r["bytes"] < first[r["name"]]["bytes"]):
                first[r["name"]] = r
        small[n] = first
    m = {n: med(r["ratio"] for r in big[n]) for n in big}
    p = {n: med(r["paired_ratio"] for r in big[n]) for n in big}
    above = {n: sum(r["ratio"] > 1.05 for r in big[n]) for n in big}
    met = "met" if all(p[n] <= 1.05 for n in p) else "missed"
    rows.append((
        "[collectives, gloo](#collectives-on-gloo)", "ours/raw gloo ≤ 1.05 from 64 KiB",
        f"{met} on the paired median: {f2(p[2])} (2 proc.), {f2(p[4])} (4); medians {f2(m[2])}, {f2(m[4])}; "
        f"not row by row ({above[2]} and {above[4]} of {len(big[4])} rows above 1.05)",
        data("collectives_gloo_n2.json", "collectives_gloo_n4.json")))
    over = {n: [f"{k} {f2(r['ratio'])}" for k, r in small[n].items() if round(r["ratio"], 2) > 1.2] for n in small}
    rows.append((
        "", "ours/raw ≤ 1.2 at the smallest size (4-16 B)",
        f"above 1.2: {', '.join(over[2]) or 'none'} (2 proc.); {', '.join(over[4]) or 'none'} (4)",
        data("collectives_gloo_n2.json", "collectives_gloo_n4.json")))
    t = {n: [r for r in load(f"collectives_vs_torch_n{n}.json") if r.get("ratio") is not None] for n in (2, 4)}
    missed = {n: sum(r["ratio"] > 1.0 for r in t[n]) for n in t}
    rows.append((
        "", "ours/torch 1.13 ≤ 1.0 at every size",
        f"missed in {missed[2]} of {len(t[2])} rows (2 proc.), {missed[4]} of {len(t[4])} (4); "
        f"median {f2(med(r['ratio'] for r in t[2]))} / {f2(med(r['ratio'] for r in t[4]))}",
        data("collectives_vs_torch_n2.json", "collectives_vs_torch_n4.json")))
    return rows


def collectives_mpi():
    big = {n: [r for r in load(f"collectives_mpi_n{n}.json") if r["bytes"] >= 65536] for n in (2, 4)}
    m = {n: med(r["ratio"] for r in big[n]) for n in big}
    p = {n: med(r["paired_ratio"] for r in big[n]) for n in big}
    verdict = {n: "met" if m[n] <= 1.05 else "missed" for n in big}
    g = {n: med(r["gloo_over_ours"] for r in big[n]) for n in big}
    files = data("collectives_mpi_n2.json", "collectives_mpi_n4.json")
    return [
        ("[collectives, MPI](#mpi-collectives-against-raw-mpi-and-gloo)", "ours/raw MPI ≤ 1.05 from 64 KiB",
         f"{verdict[4]} at 4 processes (median {f2(m[4])}, paired {f2(p[4])}), {verdict[2]} at 2 "
         f"({f2(m[2])}, paired {f2(p[2])})", files),
        ("", "MPI vs gloo on one machine: report",
         f"gloo takes a median {g[4]:.1f}× (4 proc.) and {g[2]:.1f}× (2) as long from 64 KiB", files),
    ]


def redistribution_rows():
    rows = []
    for n in (2, 4, 8):
        for r in load(f"redistribution_n{n}.json"):
            # The dynamic/static pair repeats one case with a mesh axis static or not (the section's prose).
            if r.get("plan_bytes") is not None and not r["name"].endswith(("dynamic", "static")):
                rows.append(r)
    return rows


def redistribution():
    rows = redistribution_rows()
    files = data("redistribution_n2.json", "redistribution_n4.json", "redistribution_n8.json")
    one_axis = [r for r in rows if "x" not in str(r["mesh"])]
    at_bound = sum(r["plan_bytes"] == r["lower_bound_bytes"] == r["moved_bytes"] for r in one_axis)
    le_torch = sum(r["plan_bytes"] <= r["torch_bytes"] for r in rows)
    moved = sum(r["plan_bytes"] == r["moved_bytes"] for r in rows)
    only_s = re.compile(r"^\[S\(\d\)(,S\(\d\))*\]->\[S\(\d\)(,S\(\d\))*\]")
    s_to_s = [r for r in rows if "x" in str(r["mesh"]) and only_s.match(r["name"])]
    factors = [r["torch_bytes"] / r["plan_bytes"] for r in s_to_s]
    equal_at_bound = all(r["plan_bytes"] == r["lower_bound_bytes"] for r in s_to_s
                         if r["torch_bytes"] == r["plan_bytes"])
    mem = sum(r["peak_extra_bytes"] <= r["max_in_out_bytes"] for r in rows)
    return [
        ("[redistribution](#redistribution)", "plan bytes = lower bound, single axis",
         f"{'met' if at_bound == len(one_axis) else 'missed'}: plan B = moved B = bound in {at_bound} of "
         f"{len(one_axis)} one-axis rows", files),
        ("", "plan bytes ≤ PyTorch's greedy plan; less for S→S",
         f"{'met' if le_torch == len(rows) else 'missed'} in {le_torch} of {len(rows)} rows (plan B = moved B in "
         f"{moved}); multi-axis S→S: torch moves {rng(factors, lambda x: f'{x:.1f}')}× ours"
         + (" (equal only where ours is at the bound)" if equal_at_bound and min(factors) <= 1.0 else ""),
         files),
        ("", "peak extra memory ≤ max(in, out)", f"met in {mem} of {len(rows)} rows", files),
    ]


def uneven_rows(n):
    return [r for r in load(f"redistribution_n{n}.json") if r.get("ref_name") == "padded"]


def uneven():
    r2, r4 = uneven_rows(2), uneven_rows(4)
    slower = sum(r["ratio"] > 1.0 for r in r2 + r4)
    return [("[uneven sizes](#uneven-sizes-variable-size-collectives-vs-padding)",
             "variable sizes no slower than padding",
             f"var/pad {rng([r['ratio'] for r in r2])} (2 proc.), {rng([r['ratio'] for r in r4])} (4); above 1.0 "
             f"in {slower} of {len(r2) + len(r4)} rows",
             data("redistribution_n2.json", "redistribution_n4.json"))]


def overhead_rows(kind):
    return [r for r in load("overhead.json") if r.get("kind") == kind]


def overhead():
    sync = [r for r in overhead_rows("collective") if "async" not in r["name"]]
    redist = overhead_rows("redistribute")
    worst = max(r["ns_per_call"] for r in sync + redist)
    ns = lambda x: f"{x:.0f}"  # noqa: E731
    return [
        ("[host overhead](#host-overhead-per-call)", "< 2 µs per call",
         f"{'met' if worst < 2000 else 'missed'}: {rng([r['ns_per_call'] for r in sync], ns)} ns per synchronous "
         f"collective, {rng([r['ns_per_call'] for r in redist], ns)} ns per redistribution", data("overhead.json")),
        ("[host cost of an op](#host-cost-of-an-op-on-dtensors)", "< 1 µs per op",
         "13-139 ns over the local kernel", quoted("that section's run of 2026-12-01 02:50 UTC")),
    ]


def gemm():
    d = load("gemm.json")
    p = [r["paired_ratio"] for r in d]
    return [("[local GEMM](#local-gemm)", "matmul / cblas_sgemm ≤ 1.05",
             f"{'met' if max(p) <= 1.05 else 'missed'}: paired {rng(p, lambda x: f'{x:.3f}')}", data("gemm.json"))]


def mlp():
    relu = [r["paired_ratio"] for r in load("mlp_vs_torch_n4.json")]
    gelu = [r["paired_ratio"] for r in load("mlp_vs_torch_n4_gelu.json")]
    return [("[TP MLP forward](#tp-mlp-forward-ours-vs-torch-113)", "level with torch",
             f"paired {rng(relu)} (relu), {rng(gelu)} (gelu)",
             data("mlp_vs_torch_n4.json", "mlp_vs_torch_n4_gelu.json"))]


def by_name(rows):
    return {r["name"]: r for r in rows}


def training():
    d = by_name(load("train_vs_torch_n4.json"))
    keys = [f"{t}x256x1024x2048 {l}" for t in (512, 2048) for l in ("tp", "ddp")]
    paired = [d[k]["paired_ratio"] for k in keys]
    met = sum(x <= 1.0 for x in paired)
    big = {l: d[f"2048x256x1024x2048 {l}"] for l in ("fsdp", "fsdp_tp")}
    exposed = ", ".join(f"{l} {r['exposed_pct']:.0f} % ({'met' if r['exposed_pct'] <= 10 else 'missed'})"
                        for l, r in big.items())
    state = d["512x256x1024x2048 fsdp"]["state_bytes"] / d["512x256x1024x2048 ddp"]["state_bytes"]
    heap = [d[f"{t}x256x1024x2048 fsdp"]["heap_peak_bytes"] / d[f"{t}x256x1024x2048 ddp"]["heap_peak_bytes"]
            for t in (512, 2048)]
    files = data("train_vs_torch_n4.json")
    return [
        ("[training step](#training-step-per-layout-ours-vs-torch-113)", "≤ 1.0× torch 1.13",
         f"met in {met} of 4 rows: paired {', '.join(f2(x) for x in paired)} (tp, ddp at 512, then 2048 tokens)",
         files),
        ("", "FSDP exposed comm. ≤ 10 % when compute ≥ comm.", f"at 2048 tokens: {exposed}", files),
        ("", "FSDP memory ≈ DDP's state / n + one group",
         f"state {state:.3f}× DDP's; peak heap {rng(heap)}× DDP's", files),
    ]


def backends():
    v = [r["vs_gloo_paired_ratio"] for r in load("train_backends_n4.json") if r.get("vs_gloo_paired_ratio")]
    faster = [x for x in v if x < 1.0]
    slower = [x for x in v if x >= 1.0]
    link = [r["paired_ratio"] for r in load("train_mpi_link_probe.json")]
    return [("[backend on CPUs](#which-backend-on-cpus-mpi-vs-gloo-in-the-training-step)",
             "decide the default from measurements",
             f"MPI / gloo paired {rng(faster)} in {len(faster)} of {len(v)} rows"
             + (f", {', '.join(f2(x) for x in slower)} in {len(slower)}" if slower else "")
             + f"; gloo with MPI linked / not linked {rng(link)}: MPI is the default where built",
             data("train_backends_n4.json", "train_mpi_link_probe.json"))]


def gpt():
    d = by_name(load("train_vs_torch_gpt_n4.json"))
    pr = lambda l: " / ".join(f2(d[f"{t}x256x768x2048 {l}"]["paired_ratio"]) for t in (512, 2048))  # noqa: E731
    allp = [d[f"{t}x256x768x2048 {l}"]["paired_ratio"] for t in (512, 2048) for l in ("tp", "ddp")]
    ex = {l: d[f"2048x256x768x2048 {l}"]["exposed_pct"] for l in ("fsdp", "fsdp_tp")}
    heap = d["2048x256x768x2048 fsdp"]["heap_peak_bytes"] / d["2048x256x768x2048 ddp"]["heap_peak_bytes"]
    files = data("train_vs_torch_gpt_n4.json")
    return [
        ("[GPT training step](#gpt-training-step-and-memory-per-rank-ours-vs-torch-113)",
         "≤ 1.0× torch 1.13 (Megatron-style GPT)",
         f"{'met' if max(allp) <= 1.0 else 'missed'}: paired {pr('tp')} (tp), {pr('ddp')} (ddp) at 512 / 2048 "
         "tokens", files),
        ("", "FSDP exposed comm. ≤ 10 % when compute ≥ comm.",
         f"{'met' if max(ex.values()) <= 10 else 'missed'} at 2048 tokens: {ex['fsdp']:.0f} % (fsdp), "
         f"{ex['fsdp_tp']:.0f} % (fsdp_tp)", files),
        ("", "memory per rank: report", f"FSDP's peak heap {heap:.2f}× DDP's at 2048 tokens", files),
        ("", "memory per rank: report",
         "mixed precision −25 %, checkpointing −17 % (ddp) / −31 % (tp); peaks 8-23 % above the estimates",
         quoted("that section's table (c), `bench_train --model gpt`, 2026-12-04 19:40 UTC")),
        ("", "our GPT on MPI: report", "MPI / gloo paired 0.48-1.06",
         quoted("that section's table (d), 2026-12-04 20:08 UTC")),
    ]


def attention_pairs():
    torch = {(r["seq"], bool(r["causal"])): r for r in load("attention_torch.json")}
    return [(r, torch[(r["seq"], "causal" in r["name"])]) for r in load("attention.json")]


def attention():
    pairs = attention_pairs()
    med_ratio = [r["ours_us"] / 1000 / t["torch_ms"] for r, t in pairs]
    min_ratio = [r["ours_us"] / 1000 / t["torch_min_ms"] for r, t in pairs]
    big = max(pairs, key=lambda p: (p[0]["seq"], -p[0]["ours_peak_mib"]))
    r, t = big
    return [("[attention, local](#attention-local-kernel-vs-the-materialised-softmax)",
             "≤ 1.0× torch 1.13; memory O(seq)",
             f"{'met' if max(min_ratio) <= 1.0 else 'missed'}: {rng(med_ratio)} of torch's median, ≤ "
             f"{f2(max(min_ratio))} of its fastest sample; extra memory {r['ours_peak_mib']:.1f} MiB vs torch's "
             f"{t['torch_peak_mib']:.0f} MiB at {r['seq']}",
             data("attention.json", "attention_torch.json"))]


def cp():
    out = {}
    for name, f in (("gloo", "cp_n4.json"), ("MPI", "cp_mpi_n4.json")):
        d = load(f)
        out[name] = (all(r["fwd_bytes"] == r["bound_bytes"] for r in d),
                     [r["bwd_bytes"] / r["bound_bytes"] for r in d if r["name"].startswith("ring ")],
                     [r["exposed"] * 100 for r in d if r["name"].startswith("ring zigzag")])
    at_bound = all(v[0] for v in out.values())
    ring = rng([x for v in out.values() for x in v[1]])
    pct = lambda xs: f"{min(xs):.0f}-{max(xs):.0f} %"  # noqa: E731
    return [("[context parallelism](#context-parallelism-all-gather-kv-ulysses-ring-ring-zigzag)",
             "bytes at the lower bound; ring's exposed comm. ≤ 20 %",
             f"forward bytes at the bound in {'every' if at_bound else 'not every'} row (ring backward {ring}×: it "
             f"re-sends k/v); exposed on the zigzag layout {pct(out['gloo'][2])} (gloo), {pct(out['MPI'][2])} (MPI)",
             data("cp_n4.json", "cp_mpi_n4.json"))]


def loss():
    d = load("loss_parallel.json")
    per_row = sorted({r["bytes_per_rank"] / int(r["name"].split(" x ")[0]) for r in d})
    fast = [1 / r["paired_ratio"] for r in d if r["paired_ratio"] < 1.0]
    return [("[loss_parallel](#transformer-ops-loss_parallel-vs-gather-then-local-loss)",
             "fewer bytes than gathering the logits",
             f"{'/'.join(f'{x:g}' for x in per_row)} B received per row; paired {rng(fast, lambda x: f'{x:.1f}')}× "
             f"faster in {len(fast)} of {len(d)} sizes", data("loss_parallel.json"))]


def activation_memory():
    row = {r["variant"]: r for r in load("train_recompute_gpt_n4.json")["rows"]}
    sel, before = row["selective"], row["before"]
    gathers = sel["all_gather_tp_ms"] - before["all_gather_tp_ms"]
    growth = before["step_ms"] * (1 / before["step_vs_selective"] - 1)
    return [("[activation memory](#activation-memory-step-time-and-heap-before-and-after)",
             "the step grows by no more than the backward's extra all_gathers",
             f"{'met' if growth <= gathers else 'not met'}: heap peak {before['heap_peak_mb']:.1f} → {sel['heap_peak_mb']:.1f} MB per rank, the step "
             f"{100 * (1 / before['step_vs_selective'] - 1):+.1f} % (paired), the all_gathers "
             f"{100 * gathers / before['step_ms']:+.0f} % of it (gpt tp, 4 processes)",
             data("train_recompute_gpt_n4.json"))]


def async_save():
    row = {r["variant"]: r for r in load("train_async_save_gpt_n4.json")["rows"]}
    sync, asy = row["sync"], row["async"]
    return [("[training-state saves](#saving-the-training-state-synchronous-and-asynchronous)",
             "measure async against sync",
             f"a save every 2 steps costs the step {100 * (sync['step_vs_none'] - 1):+.1f} % sync, "
             f"{100 * (asy['step_vs_none'] - 1):+.1f} % async (the call {sync['save_call_ms']:.0f} → "
             f"{asy['save_call_ms']:.0f} ms; gpt fsdp_tp, 4 processes)",
             data("train_async_save_gpt_n4.json"))]


def checkpoint():
    d = load("checkpoint.json")
    save = [r["paired_ratio"] for r in d if r["name"].startswith("save")]
    ld = [r["paired_ratio"] for r in d if r["name"].startswith("load")]
    one = lambda x: f"{x:.1f}"  # noqa: E731
    return [("[checkpoints](#checkpoints-save-and-load-vs-plain-file-io)", "report against plain file I/O",
             f"saves {rng(save, one)}×, loads {rng(ld, one)}× plain I/O's time (paired)", data("checkpoint.json"))]


def pipeline():
    d = load("pipeline.json")
    same = all(abs(r["simulated"] - r["formula"]) < 5e-4 for r in d if "formula" in r)
    classic = [r for r in d if not r["name"].startswith("ZB")]
    plain = [r["bubble"] - r["formula"] for r in classic if not r["name"].startswith("interleaved")]
    inter = [r["bubble"] - r["formula"] for r in classic if r["name"].startswith("interleaved")]
    at = {r["name"]: r["bubble"] for r in d}
    one, h1 = at["1F1B v=1 m=8"], at["ZB-H1 v=1 m=8"]
    procs = load("pipeline_p2p_zb_n4.json")
    by = {(r["schedule"], r["size"]): r["bubble"] for r in procs}
    sizes = sorted({r["size"] for r in procs}, key=lambda z: int(z.split(" x ")[0]))
    zb_verdict = ", ".join(
        f"{'met' if by[('ZB-H1', z)] <= by[('1F1B', z)] / 3 + 0.05 else 'not met'} at {z} "
        f"({by[('ZB-H1', z)]:.3f} against {by[('1F1B', z)]:.3f})" for z in sizes)
    t = load("pipeline_vs_torch_n4.json")
    small = [r["ratio"] for r in t if r["size"] == "8 x 256"]
    large = [r["ratio"] for r in t if r["size"] != "8 x 256"]
    return [
        ("[pipeline bubble](#pipeline-bubble)", "the formula (p-1)/(vm+p-1)",
         f"simulated {'=' if same else '≠'} formula; measured {rng(plain)} above it (1F1B, GPipe), "
         f"{rng(inter)} interleaved: the exchanges", data("pipeline.json")),
        ("", "ZB-H1 ≤ 1F1B's / 3 + 0.05 (p 4, m 8)",
         f"{'met' if h1 <= one / 3 + 0.05 else 'not met'}: {h1:.3f} against 1F1B's {one:.3f} (rank threads); "
         f"over processes {zb_verdict}", data("pipeline.json", "pipeline_p2p_zb_n4.json")),
        ("[1F1B vs torch](#1f1b-over-processes-ours-vs-torch-113-hand-written)", "level with torch's hand-written 1F1B",
         f"{rng(small)}× at 8 KiB (two messages per crossing), {rng(large)}× from 256 KiB",
         data("pipeline_vs_torch_n4.json")),
    ]


def moe():
    r = [x["ratio"] for x in load("moe_vs_torch_n4.json")]
    return [("[MoE exchange](#moe-exchange-ours-vs-torch-113-all_to_all_single)", "level with torch",
             f"{rng(r)}× torch's exchange", data("moe_vs_torch_n4.json"))]


def compile_cost():
    d = by_name(load("compile_time.json"))
    ops = d["ops_20"]["seconds"]
    u = d["umbrella_header"]
    return [("[compile cost](#compile-cost)", "20 ops in one TU < 10 s",
             f"{'met' if ops < 10 else 'missed'}: {ops:.2f} s; the umbrella header {u['seconds']:.2f} s (its standard "
             f"headers {u['ref_seconds']:.2f} s)", data("compile_time.json"))]


def store():
    s = load("store_flood.json")
    return [
        ("[store](#store-and-failure-latency)", "report", "16-23 k ops/s with 5000 idle connections",
         quoted("that section's table, 2026-12-01")),
        ("", "ranks get in under a flood of strangers",
         f"{s['flood']['joins_per_s']:.0f} ranks/s (slowest {s['flood']['slowest_ms']:.1f} ms) against "
         f"{s['flood']['strangers_per_s']:,.0f} strangers/s; {s['quiet']['joins_per_s']:.0f}/s without",
         data("store_flood.json")),
    ]


def quoted_rows():
    return [
        ("[reliability checks](#what-the-reliability-checks-cost)", "report",
         "fingerprints 9-11 ns, flight recorder ≈ 40 ns per op", quoted("that section, 2026-12-01")),
        ("[dry run at scale](#dry-run-at-scale-dtensor-plan)", "a 70B step as one rank of 16,384 < 1 min",
         "met: 0.65 s at 16,384 ranks, 0.44 s at 64 (two steps each)", quoted("that section's table, 2026-12-06")),
        ("[published runs](#against-published-runs)", "dtensor-plan's estimate within ±25 %",
         "met in all four: Llama 3 405B +6 % and −10 % (its published layouts now fit without recomputation, "
         "as Meta ran them), GPT-3 175B +20 % and +15 % (throughput)",
         quoted("that section's table, 2026-12-07 dtensor-plan runs")),
    ]


SUMMARY_ROWS = [collectives_gloo, collectives_mpi, redistribution, uneven, overhead, gemm, mlp, training, backends,
                gpt, activation_memory, attention, cp, loss, checkpoint, async_save, pipeline, moe, compile_cost, store, quoted_rows]


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def summary():
    rows = [row for make in SUMMARY_ROWS for row in make()]
    return table(("benchmark", "goal", "latest result", "data"), rows)


# ---- section tables ------------------------------------------------------------------------------------------


def overhead_table():
    rows = []
    for kind in ("collective", "redistribute"):
        for r in overhead_rows(kind):
            name = r["name"] if kind == "collective" else "redistribute " + pretty(r["name"])
            ns = f"{r['ns_per_call']:.0f} [{r['ns_min']:.0f}-{r['ns_max']:.0f}]"
            if r.get("ref_ns_per_call"):
                ns += f"; {r['ref_name']}: {r['ref_ns_per_call']:.0f}"
            rows.append((name, ns, r.get("allocations_per_call", "-")))
    return table(("call", "ns (median [min-max])", "allocations"), rows)


def uneven_table():
    rows = []
    for n in (2, 4):
        for r in uneven_rows(n):
            rows.append((r["name"], n, r["shape"], us(r["ours_us"]), us(r["ref_us"]), f2(r["ratio"])))
    return table(("op", "ranks", "shape", "variable µs", "padded µs", "var/pad"), rows)


def redistribution_table():
    rows = []
    at4 = {r["name"]: r for r in load("redistribution_n4.json")}
    ratio = lambda r: r["peak_extra_bytes"] / r["max_in_out_bytes"]  # noqa: E731
    for r in redistribution_rows():
        # The 2-process rows only where the memory figure differs from the 4-process row's.
        if r["ranks"] == 2 and r["name"] in at4 and abs(ratio(r) - ratio(at4[r["name"]])) <= 0.05:
            continue
        bound = f"{r['lower_bound_bytes']}" + ("*" if r["lower_bound_bytes"] < r["plan_bytes"] else "")
        rows.append((r["mesh"], pretty(r["name"]), r["shape"], r["plan"], r["plan_bytes"], r["moved_bytes"], bound,
                     r["torch_bytes"], us(r["ours_us"]), r["peak_extra_bytes"], r["max_in_out_bytes"],
                     f2(ratio(r))))
    return table(("mesh", "transition", "shape", "plan steps", "plan B", "moved B", "lower bd B", "torch B",
                  "time µs", "extra mem B", "max(in,out) B", "extra/max"), rows)


def attention_table():
    rows = []
    for r, t in attention_pairs():
        rows.append((r["seq"], "yes" if t["causal"] else "no",
                     f"{r['ours_us'] / 1000:.1f} [{r['ours_min_us'] / 1000:.1f}-{r['ours_max_us'] / 1000:.1f}]",
                     f"{t['torch_ms']:.1f} [{t['torch_min_ms']:.1f}-{t['torch_max_ms']:.1f}]",
                     f"**{f2(r['ours_us'] / 1000 / t['torch_ms'])}**", f2(r["ours_us"] / 1000 / t["torch_min_ms"]),
                     f"{r['ref_us'] / 1000:.1f}", f2(r["paired_ratio"]), f"{r['fwd_bwd_us'] / 1000:.1f}",
                     f2(r["ours_peak_mib"]), f"{t['torch_peak_mib']:.1f}"))
    return table(("seq", "causal", "ours fwd ms [min-max]", "torch 1.13 ms [min-max]", "ours / torch",
                  "ours / torch's fastest sample", "materialised (C++) ms", "ours / materialised (paired)",
                  "ours fwd+bwd ms", "ours peak MiB", "torch peak MiB"), rows)


TABLES = {"summary": summary, "overhead": overhead_table, "uneven": uneven_table,
          "redistribution": redistribution_table, "attention": attention_table}


# ---- BENCHMARKS.md -------------------------------------------------------------------------------------------


def blocks(text):
    """{name: (first line index inside the block, end marker's line index)} for every marker pair in text."""
    lines = text.split("\n")
    found = {}
    for name in TABLES:
        begin = [i for i, l in enumerate(lines) if l.strip() == f"<!-- {name}:begin -->"]
        end = [i for i, l in enumerate(lines) if l.strip() == f"<!-- {name}:end -->"]
        if len(begin) != 1 or len(end) != 1 or begin[0] > end[0]:
            raise SystemExit(f"expected one <!-- {name}:begin --> before one <!-- {name}:end -->")
        found[name] = (begin[0] + 1, end[0])
    return lines, found


def main(argv):
    args = argv[1:]
    check = "--check" in args
    path = BENCHMARKS
    if "--file" in args and args.index("--file") + 1 < len(args):  # another copy of BENCHMARKS.md (tests)
        path = Path(args.pop(args.index("--file") + 1))
        args.remove("--file")
    if set(args) - {"--check"}:
        raise SystemExit(__doc__)
    text = path.read_text()
    lines, found = blocks(text)
    stale = []
    # From the last block up, so that earlier indices stay valid while blocks are replaced.
    for name, (first, end) in sorted(found.items(), key=lambda kv: -kv[1][0]):
        want = TABLES[name]()
        have = lines[first:end]
        if have != want:
            for i in range(max(len(have), len(want))):
                h = have[i] if i < len(have) else "(missing)"
                w = want[i] if i < len(want) else "(none: remove this row)"
                if h != w:
                    row = "header" if i < 2 else f"row {i - 1}"
                    stale.append((first + i + 1, f"{path.name}:{first + i + 1}: table '{name}', {row}:\n"
                                                 f"  in {path.name}: {h}\n  from the JSON:    {w}"))
            lines[first:end] = want
    if check:
        if stale:
            print("\n".join(message for _, message in sorted(stale)))
            print(f"{len(stale)} stale row(s): run `python3 bench/summary.py` to rewrite them from bench/results/*.json")
            return 1
        print(f"{path.name}: {len(found)} generated tables match bench/results/*.json")
        return 0
    if stale:
        path.write_text("\n".join(lines))
    print(f"{path.name}: {len(stale)} row(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

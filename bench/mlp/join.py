#!/usr/bin/python3
"""Joins passes of bench_mlp (mlp_n<N>.json) and torch_mlp.py (torch_mlp_n<N>.json) into one table.

    bench/mlp/join.py [--out bench/results] [--markdown] --ranks N PASS_DIR [PASS_DIR ...]

Each PASS_DIR holds one run of each side (bench/mlp/mlp_vs_torch.sh alternates them, pass by pass). Per
row: ours_us / ref_us = the median of the pass medians (each the slowest rank's median), min and max over
all passes, gemm/act/comm the median of the pass values, ratio = ours_us / ref_us, paired_ratio = the
median over passes of ours / torch of that pass (the two ran minutes apart at most, back to back).
Correctness: every pass of both sides must have passed its own reference check, and ours and torch's
checksums of y must be equal (exact for relu/none; for gelu within 1e-5 of sum |y|). A failure is printed and
makes the exit status 1. Writes OUT/mlp_vs_torch_n<N>.json in the harness schema (suite "mlp_tp"), or
mlp_vs_torch_n<N>_<act>.json for another activation than relu.
"""
import argparse
import json
import os
import statistics
import sys


def fmt_us(v):
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def load(path):
    if not os.path.exists(path):
        return {}
    return {r["name"]: r for r in json.load(open(path))}


def checksums_agree(a, b, act):
    """Exact for relu/none (integer-valued y); for gelu within 1e-5 of sum |y| (times the largest weight, 6,
    for the weighted sum): sums of many rounded terms in another order differ in their last bits."""
    if act == "gelu":
        scale = 1e-5 * max(1.0, a["checksum_abs"], b["checksum_abs"])
        return abs(a["checksum"] - b["checksum"]) <= scale and \
            abs(a["checksum_weighted"] - b["checksum_weighted"]) <= 6 * scale
    return a["checksum"] == b["checksum"] and a["checksum_weighted"] == b["checksum_weighted"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("passes", nargs="+")
    args = ap.parse_args()
    n = args.ranks
    ours_p = [load(os.path.join(d, f"mlp_n{n}.json")) for d in args.passes]
    torch_p = [load(os.path.join(d, f"torch_mlp_n{n}.json")) for d in args.passes]
    if not any(ours_p):
        print(f"join: no mlp_n{n}.json in {args.passes}", file=sys.stderr)
        return 1
    names = [name for name in ours_p[0]]
    med = statistics.median
    out, problems = [], []
    for name in names:
        o = [p[name] for p in ours_p if name in p]
        t = [p[name] for p in torch_p if name in p]
        for r in o + t:
            if r["check"] == "FAILED":
                problems.append(f'{name}: {r["suite"]} failed its reference check')
        if t and not all(checksums_agree(a, b, o[0]["act"]) for a in o for b in t):
            problems.append(f"{name}: ours and torch's y differ (checksums {o[0]['checksum']}, "
                            f"{o[0]['checksum_weighted']} vs {t[0]['checksum']}, {t[0]['checksum_weighted']})")
        rec = {"suite": "mlp_tp", "name": name, "backend": "gloo", "ranks": n, "bytes": o[0]["bytes"],
               "ours_us": med(r["ours_us"] for r in o), "ours_min_us": min(r["ours_min_us"] for r in o),
               "ours_max_us": max(r["ours_max_us"] for r in o),
               "ref_name": f'torch {t[0]["torch_version"]} gloo (torch.mm, dist.all_reduce)' if t else None,
               "ref_us": med(r["torch_us"] for r in t) if t else None,
               "ref_min_us": min(r["torch_min_us"] for r in t) if t else None,
               "ref_max_us": max(r["torch_max_us"] for r in t) if t else None}
        rec["ratio"] = rec["ours_us"] / rec["ref_us"] if t else None
        pairs = [ours_p[i][name]["ours_us"] / torch_p[i][name]["torch_us"] for i in range(len(args.passes))
                 if name in ours_p[i] and name in torch_p[i]]
        rec["paired_ratio"] = med(pairs) if pairs else None
        rec["samples"] = sum(r["samples"] for r in o)
        rec["date"], rec["host"] = o[0].get("date"), o[0].get("host")
        for k in ("tokens", "hidden", "ffn", "act", "placements", "blas_threads"):
            rec[k] = o[0][k]
        for k in ("gemm_us", "act_us", "comm_us", "gflops_per_rank", "page_faults_per_iter",
                  "voluntary_switches_per_iter", "involuntary_switches_per_iter", "cpu_us_per_iter"):
            rec[k] = med(r[k] for r in o)
            rec["ref_" + k] = med(r[k] for r in t) if t else None
        rec["ref_blas_threads"] = t[0]["blas_threads"] if t else None
        rec["ref_torch_threads"] = t[0]["torch_threads"] if t else None
        rec["passes"] = len(o)
        rec["pass_ours_us"] = [r["ours_us"] for r in o]
        rec["pass_ref_us"] = [r["torch_us"] for r in t]
        failed = any(p.startswith(name + ":") for p in problems)
        rec["check"] = "FAILED" if failed else (
            "ok: both sides equal their single-process reference" + (" and each other (checksums of y)" if t else ""))
        out.append(rec)
    acts = {x["act"] for x in out}
    suffix = "" if acts == {"relu"} else "_" + "_".join(sorted(acts))  # relu, the default, has no suffix
    if args.out:
        path = os.path.join(args.out, f"mlp_vs_torch_n{n}{suffix}.json")
        with open(path, "w") as f:
            f.write("[\n" + ",\n".join("  " + json.dumps(x) for x in out) + "\n]\n")
    head = ["tokens x hidden x ffn", "act", "ours µs [min-max]", "torch µs [min-max]", "ours/torch", "paired",
            "ours gemm / act / comm", "torch gemm / act / comm", "check"]
    rows = []
    for x in out:
        rng = lambda m, lo, hi: f"{fmt_us(m)} [{fmt_us(lo)}-{fmt_us(hi)}]" if m is not None else "-"
        rows.append([f'{x["tokens"]} x {x["hidden"]} x {x["ffn"]}', x["act"],
                     rng(x["ours_us"], x["ours_min_us"], x["ours_max_us"]),
                     rng(x["ref_us"], x["ref_min_us"], x["ref_max_us"]),
                     f'{x["ratio"]:.2f}' if x["ratio"] else "-",
                     f'{x["paired_ratio"]:.2f}' if x["paired_ratio"] else "-",
                     " / ".join(fmt_us(x[k]) for k in ("gemm_us", "act_us", "comm_us")),
                     " / ".join(fmt_us(x["ref_" + k]) for k in ("gemm_us", "act_us", "comm_us"))
                     if x["ref_us"] else "-", "ok" if x["check"].startswith("ok") else "FAILED"])
    print(f"\nTP MLP forward, gloo, {n} processes, float32 (µs: medians of the slowest rank, median over "
          f"{len(args.passes)} passes, ours and torch alternating)")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
        for r in rows:
            print("  ".join(str(c).rjust(w[i]) if 1 < i < 8 else str(c).ljust(w[i]) for i, c in enumerate(r)))
    # Where the time goes besides the parts: first touches of fresh memory, context switches, CPU per forward
    # (all threads of the process; on an oversubscribed machine the CPU a forward needs sets its pace).
    print("per forward, the largest over ranks: page faults, context switches (voluntary+involuntary), CPU µs")
    diag = [["tokens x hidden x ffn", "faults ours", "faults torch", "switches ours", "switches torch",
             "CPU µs ours", "CPU µs torch"]]
    for x in out:
        sw = lambda p: (f'{x[p + "voluntary_switches_per_iter"]:.1f}+{x[p + "involuntary_switches_per_iter"]:.1f}'
                        if x[p + "voluntary_switches_per_iter"] is not None else "-")
        f0 = lambda v: "-" if v is None else f"{v:.0f}"
        diag.append([f'{x["tokens"]} x {x["hidden"]} x {x["ffn"]}', f0(x["page_faults_per_iter"]),
                     f0(x["ref_page_faults_per_iter"]), sw(""), sw("ref_"), f0(x["cpu_us_per_iter"]),
                     f0(x["ref_cpu_us_per_iter"])])
    if args.markdown:
        for i, r in enumerate(diag):
            print("| " + " | ".join(r) + " |")
            if i == 0:
                print("|" + "---|" * len(r))
    else:
        w = [max(len(r[i]) for r in diag) for i in range(len(diag[0]))]
        for r in diag:
            print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))
    for p in problems:
        print("join: " + p, file=sys.stderr)
    if args.out:
        print(f"wrote {path}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

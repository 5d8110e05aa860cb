#!/usr/bin/python3
"""Joins the dtensor sweep (collectives_gloo_n<N>.json) with the torch one (torch_collectives_n<N>.json).

    bench/collectives/join.py [--dir bench/results] [--markdown] N [N ...]

Writes DIR/collectives_vs_torch_n<N>.json: one record per (op, bytes) in the harness schema with
ref_name "torch.distributed <version> gloo", ref_us = torch's median and ratio = ours / torch, plus the raw
gloo figures (raw_us, ratio_raw). Prints a table (--markdown: as a Markdown table for BENCHMARKS.md).
"""
import argparse
import json
import os
import sys


def fmt_us(v):
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def size(b):
    if b >= 1 << 20 and b % (1 << 20) == 0:
        return f"{b >> 20} MiB"
    if b >= 1024 and b % 1024 == 0:
        return f"{b >> 10} KiB"
    return f"{b} B"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="bench/results")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("ranks", nargs="+", type=int)
    args = ap.parse_args()
    for n in args.ranks:
        ours_path = os.path.join(args.dir, f"collectives_gloo_n{n}.json")
        torch_path = os.path.join(args.dir, f"torch_collectives_n{n}.json")
        ours = json.load(open(ours_path))
        torch_rows = {(r["name"], r["bytes"]): r for r in json.load(open(torch_path))} \
            if os.path.exists(torch_path) else {}
        out = []
        for r in ours:
            t = torch_rows.get((r["name"], r["bytes"]))
            rec = {k: r[k] for k in ("suite", "name", "backend", "ranks", "bytes", "ours_us", "ours_min_us",
                                     "ours_max_us")}
            rec["suite"] = "collectives_vs_torch"
            rec["ref_name"] = f'torch.distributed {t["torch_version"]} gloo' if t else None
            tu = t["torch_us"] if t else None
            rec.update(ref_us=tu, ref_min_us=t["torch_min_us"] if t else None,
                       ref_max_us=t["torch_max_us"] if t else None,
                       ratio=(r["ours_us"] / tu) if (tu and r["ours_us"]) else None,
                       samples=r["samples"], torch_call=t["torch_call"] if t else None,
                       torch_unsupported=t["unsupported"] if t else "not measured",
                       raw_us=r["ref_us"], ratio_raw=r["ratio"], busbw_GBps=r.get("busbw_GBps"),
                       date=r.get("date"), host=r.get("host"))
            out.append(rec)
        path = os.path.join(args.dir, f"collectives_vs_torch_n{n}.json")
        with open(path, "w") as f:
            f.write("[\n" + ",\n".join("  " + json.dumps(x) for x in out) + "\n]\n")
        head = ["op", "bytes", "ours us", "raw gloo us", "ours/raw", "torch us", "ours/torch", "busbw GB/s"]
        rows = []
        for x in out:
            rows.append([x["name"], size(x["bytes"]), fmt_us(x["ours_us"]), fmt_us(x["raw_us"]),
                         f'{x["ratio_raw"]:.2f}' if x["ratio_raw"] else "-", fmt_us(x["ref_us"]),
                         f'{x["ratio"]:.2f}' if x["ratio"] else ("n/a" if x["torch_unsupported"] else "-"),
                         f'{x["busbw_GBps"]:.3f}' if x.get("busbw_GBps") else "-"])
        print(f"\ncollectives, gloo, {n} processes: medians (us) of rank 0; ours vs raw gloo interleaved in one "
              f"run, torch from its own run")
        if args.markdown:
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            for r in rows:
                print("| " + " | ".join(r) + " |")
        else:
            w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
            print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
            for r in rows:
                print("  ".join(str(c).rjust(w[i]) if i > 0 else str(c).ljust(w[i]) for i, c in enumerate(r)))
        missing = sorted({x["name"] for x in out if x["torch_unsupported"]})
        for m in missing:
            why = next(x["torch_unsupported"] for x in out if x["name"] == m)
            print(f"torch lacks {m}: {why}")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

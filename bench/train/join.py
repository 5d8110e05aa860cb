#!/usr/bin/python3
"""Joins the passes of bench/train/train_vs_torch.sh into one table and bench/results/train_vs_torch_n<N>.json.

    bench/train/join.py [--out bench/results] [--name train_vs_torch] [--markdown] --ranks N PASS_DIR [PASS_DIR ...]

Each PASS_DIR holds ours_<size>_<layout>.json (bench_train --json on gloo), mpi_<size>_<layout>.json (the same on
MPI, where it ran) and, for tp and ddp, torch_<size>_<layout>.json (torch_train.py --json). Per (size, layout,
backend): ours_ms / ref_ms = the median over passes of rank 0's mean step
(steps run with overlap on), min and max over passes; ratio = ours_ms / ref_ms; paired_ratio = the median over
passes of ours / torch of that pass (launched back to back); vs_gloo_paired_ratio (MPI rows) = the median over passes
of ours on MPI / ours on gloo; the split (compute, exposed communication, the
whole communication measured in the steps with overlap off) as medians over passes; exposed_pct =
exposed / step (prefetch and asynchronous reduction on), serial_exposed_pct = communication / step in the
steps with overlap off (every collective waited for at once: no prefetch); blocked_pct = the training thread's
time blocked in any communication, tensor-parallel included (CommWaitTimer), over the step; rank 0's minor
page faults per step;
the heap per rank (bench_train's
counter, the largest rank): the peak over the steps and the parameters + gradients + AdamW state.
A pass whose run failed its own check (collective pins; torch's one-process check) makes the exit status 1.
"""
import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import time

LAYOUTS = ["tp", "tp_cm", "ddp", "fsdp", "hsdp", "fsdp_tp"]
# (file prefix, backend): ours under dtensor-run on gloo, ours under mpirun on MPI
BACKENDS = [("ours", "gloo"), ("mpi", "mpi")]
# tp_cm (tp with nn::CollectiveMatmul) is the same model as tp: torch's tp runs are its reference too.
REF = {"tp_cm": "tp"}


def load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.loads(f.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--name", default="train_vs_torch", help="the results file: <out>/<name>_n<N>.json")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("passes", nargs="+")
    args = ap.parse_args()
    med = statistics.median
    sizes = []
    for name in sorted(os.listdir(args.passes[0])):
        if name.startswith(("ours_", "mpi_")):
            size = name.split("_")[1]  # ours_<size>_<layout>.json; a size has no '_'
            if size not in sizes:
                sizes.append(size)
    sizes.sort(key=lambda s: [int(x) for x in s.split("x")])
    out, problems = [], []
    for size in sizes:
        for layout, (prefix, backend) in itertools.product(LAYOUTS, BACKENDS):
            o = [load(os.path.join(d, f"{prefix}_{size}_{layout}.json")) for d in args.passes]
            ref = REF.get(layout, layout)
            t = [load(os.path.join(d, f"torch_{size}_{ref}.json")) for d in args.passes]
            o = [x for x in o if x]
            pairs = [(a["step_ms"] / b["step_ms"]) for a, b in zip(
                [load(os.path.join(d, f"{prefix}_{size}_{layout}.json")) for d in args.passes],
                [load(os.path.join(d, f"torch_{size}_{ref}.json")) for d in args.passes]) if a and b]
            t = [x for x in t if x]
            if not o:
                continue
            name = f"{size} {layout}" + ("" if backend == "gloo" else f" {backend}")
            for x in o + t:
                if x["check"] == "FAILED":
                    problems.append(f"{name}: a run failed its check ({x['suite']})")
            m = lambda key, rows: med(r[key] for r in rows)
            rec = {"suite": "train", "name": name, "model": o[0].get("model", "mlp"),
                   "layout": layout, "backend": o[0].get("backend", "gloo"), "ranks": args.ranks, "dtype": "float32",
                   "mesh": o[0]["mesh"], "blocks": o[0]["blocks"],
                   "tokens": o[0]["tokens"], "hidden": o[0]["hidden"], "ffn": o[0]["ffn"], "vocab": o[0]["vocab"],
                   "steps": o[0]["steps"], "passes": len(o),
                   "ours_ms": m("step_ms", o), "ours_min_ms": min(r["step_ms"] for r in o),
                   "ours_max_ms": max(r["step_ms"] for r in o),
                   "compute_ms": m("compute_ms", o), "exposed_ms": m("exposed_ms", o), "comm_ms": m("comm_ms", o),
                   "serial_step_ms": m("serial_step_ms", o),
                   "exposed_pct": med(100 * r["exposed_ms"] / r["step_ms"] for r in o),
                   "serial_exposed_pct": med(100 * r["comm_ms"] / r["serial_step_ms"] for r in o),
                   # every collective, tensor-parallel included (CommWaitTimer), over the step
                   "blocked_ms": m("blocked_ms", o) if "blocked_ms" in o[0] else None,
                   "blocked_pct": med(100 * r["blocked_ms"] / r["step_ms"] for r in o) if "blocked_ms" in o[0] else None,
                   "minor_faults_per_step": m("minor_faults_per_step", o) if "minor_faults_per_step" in o[0] else None,
                   "heap_peak_bytes": m("heap_peak_bytes", o), "heap_end_bytes": m("heap_end_bytes", o),
                   "state_bytes": m("state_bytes", o),
                   "pass_ours_ms": [r["step_ms"] for r in o]}
            if t:
                rec.update({"ref_name": f"torch {t[0]['torch_version']} gloo "
                                        + ("(hand-written Megatron TP + SP)" if ref == "tp" else "(DDP)"),
                            "ref_ms": m("step_ms", t), "ref_min_ms": min(r["step_ms"] for r in t),
                            "ref_max_ms": max(r["step_ms"] for r in t),
                            "ref_comm_ms": m("comm_ms", t) if t[0]["comm_ms"] is not None else None,
                            "ref_max_rss_bytes": m("max_rss_bytes", t),
                            "ref_minor_faults_per_step": m("minor_faults_per_step", t)
                            if "minor_faults_per_step" in t[0] else None, "ref_all_gather": t[0]["all_gather"],
                            "pass_ref_ms": [r["step_ms"] for r in t]})
                rec["ratio"] = rec["ours_ms"] / rec["ref_ms"]
                rec["paired_ratio"] = med(pairs) if pairs else None
            if layout == "tp_cm":  # overlap on / off, paired pass by pass
                on_off = [a["step_ms"] / b["step_ms"] for a, b in zip(
                    [load(os.path.join(d, f"{prefix}_{size}_tp_cm.json")) for d in args.passes],
                    [load(os.path.join(d, f"{prefix}_{size}_tp.json")) for d in args.passes]) if a and b]
                rec["vs_tp_paired_ratio"] = med(on_off) if on_off else None
            if backend != "gloo":  # this backend / gloo, paired pass by pass
                vs_gloo = [a["step_ms"] / b["step_ms"] for a, b in zip(
                    [load(os.path.join(d, f"{prefix}_{size}_{layout}.json")) for d in args.passes],
                    [load(os.path.join(d, f"ours_{size}_{layout}.json")) for d in args.passes]) if a and b]
                rec["vs_gloo_paired_ratio"] = med(vs_gloo) if vs_gloo else None
            rec["date"], rec["host"] = time.strftime("%Y-%m-%d", time.gmtime()), socket.gethostname()
            rec["check"] = "FAILED" if any(p.startswith(f"{name}:") for p in problems) else \
                "ok: numerics and collectives pinned by tests/train/test_trainer" + ("; torch equal to one process" if t else "")
            out.append(rec)
    if args.out:
        path = os.path.join(args.out, f"{args.name}_n{args.ranks}.json")
        with open(path, "w") as f:
            f.write("[\n" + ",\n".join("  " + json.dumps(x) for x in out) + "\n]\n")
        print(f"wrote {path} ({len(out)} rows)")
    f1 = lambda v: "-" if v is None else f"{v:.1f}"
    f0 = lambda v: "-" if v is None else f"{v:.0f}"
    head = ["tokens x hidden x ffn x vocab", "layout", "backend", "ours ms [min-max]", "torch ms [min-max]", "ours/torch",
            "paired", "ours / ours on gloo (paired)", "compute / exposed / comm ms", "exposed % (prefetch on / off)", "all comm blocked %",
            "torch comm ms",
            "faults/step ours / torch", "heap peak MB", "state MB"]
    rows = []
    for x in out:
        rows.append([x["name"].split()[0], x["layout"], x["backend"],
                     f"{f1(x['ours_ms'])} [{f1(x['ours_min_ms'])}-{f1(x['ours_max_ms'])}]",
                     f"{f1(x['ref_ms'])} [{f1(x['ref_min_ms'])}-{f1(x['ref_max_ms'])}]" if "ref_ms" in x else "-",
                     f"{x['ratio']:.2f}" if "ratio" in x else "-",
                     f"{x['paired_ratio']:.2f}" if x.get("paired_ratio") else "-",
                     f"{x['vs_gloo_paired_ratio']:.2f}" if x.get("vs_gloo_paired_ratio") else "-",
                     f"{f1(x['compute_ms'])} / {f1(x['exposed_ms'])} / {f1(x['comm_ms'])}",
                     f"{x['exposed_pct']:.0f} / {x['serial_exposed_pct']:.0f}",
                     f0(x.get("blocked_pct")),
                     f1(x.get("ref_comm_ms")), f"{f0(x['minor_faults_per_step'])} / {f0(x.get('ref_minor_faults_per_step'))}",
                     f"{x['heap_peak_bytes'] / 1e6:.1f}", f"{x['state_bytes'] / 1e6:.1f}"])
    what = "09_gpt's GPT" if args.name.endswith("_gpt") else "06_train's model"
    print(f"\nTraining step ({what}), {args.ranks} processes of 1 thread, float32 (ms: rank 0's mean "
          f"step, median over {len(args.passes)} passes, the launches rotated pass by pass; torch on gloo)")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
        for r in rows:
            print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
    for x in out:
        if x.get("vs_tp_paired_ratio"):
            print(f"{x['name']}: collective matmul on / off (tp_cm / tp), paired: {x['vs_tp_paired_ratio']:.2f}")
    for p in problems:
        print("FAILED: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""The collectives sweep of bench_collectives, through torch.distributed on gloo (the PyTorch reference).

    dtensor-run --standalone --rank0-store --nproc-per-node 4 /usr/bin/python3 bench/collectives/torch_sweep.py \
        [--scale S] [--smoke] [--out DIR] [--passes K]

Same sizes, element type (float32), buffers and sample plan as bench_collectives (warm-up batch, then
samples of back-to-back calls; median and min-max of rank 0's times; with --passes K the sweep runs K
times and a row is the median of its pass medians). Ops torch's gloo backend lacks are
recorded with "unsupported" and the error message. Writes DIR/torch_collectives_n<ranks>.json;
bench/collectives/join.py joins it with collectives_gloo_n<ranks>.json.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist


def plan_for(args, nbytes):
    warmup = 0 if args.smoke else 1
    samples = 1 if args.smoke else max(1, round((5 if nbytes >= (4 << 20) else 15 if nbytes <= (4 << 10) else 9) * args.scale))
    batch = 1 if args.smoke else (20 if nbytes <= (64 << 10) else 4 if nbytes <= (1 << 20) else 1)
    return warmup, samples, batch


def measure(plan, fn):
    warmup, samples, batch = plan
    for _ in range(warmup):
        for _ in range(batch):
            fn()
    v = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        v.append((time.perf_counter() - t0) * 1e6 / batch)
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": len(v)}


def combine(passes):
    """One row over several passes: the median of the pass medians, the overall min and max."""
    return {"median": statistics.median(p["median"] for p in passes), "min": min(p["min"] for p in passes),
            "max": max(p["max"] for p in passes), "samples": sum(p["samples"] for p in passes)}


def sweep(args, ops, sizes, rank, n, nxt, prv, measured):
    """One pass over every op and size; appends each row's stats to measured[(op, nominal)]."""
    for op in ops:
        if op == "sendrecv" and n < 2:
            continue
        for nominal in sizes:
            total = nominal // 4
            block = max(1, total // n)
            blocked = op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
            elems = block * n if blocked else max(1, total)
            big = torch.ones(elems)
            big2 = torch.ones(elems)
            small = torch.ones(block)
            lst = [torch.ones(block) for _ in range(n)]
            variant = op
            candidates = []
            if op == "all_reduce":
                candidates = [("all_reduce", lambda: dist.all_reduce(big))]
            elif op == "reduce":
                candidates = [("reduce", lambda: dist.reduce(big, dst=0))]
            elif op == "broadcast":
                candidates = [("broadcast", lambda: dist.broadcast(big, src=0))]
            elif op == "all_gather":
                candidates = [("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(big, small)),
                              ("all_gather(list)", lambda: dist.all_gather(lst, small))]
            elif op == "reduce_scatter":
                candidates = [("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(small, big)),
                              ("reduce_scatter(list)", lambda: dist.reduce_scatter(small, lst))]
            elif op == "all_to_all":
                candidates = [("all_to_all_single", lambda: dist.all_to_all_single(big2, big))]
            elif op == "gather":
                candidates = [("gather", lambda: dist.gather(small, lst if rank == 0 else None, dst=0))]
            elif op == "scatter":
                candidates = [("scatter", lambda: dist.scatter(small, lst if rank == 0 else None, src=0))]
            elif op == "sendrecv":
                def sendrecv():
                    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, big2, prv),
                                                   dist.P2POp(dist.isend, big, nxt)])
                    for r in reqs:
                        r.wait()
                candidates = [("batch_isend_irecv", sendrecv)]
            stats, errors = None, []
            for name, fn in candidates:
                try:
                    fn()  # every rank fails the same way for an unsupported op (checked before communicating)
                except Exception as e:  # noqa: BLE001 - torch raises RuntimeError or ValueError
                    errors.append(f"{name}: {str(e).splitlines()[0]}")
                    continue
                variant = name
                stats = measure(plan_for(args, elems * 4), fn)
                break
            entry = measured.setdefault((op, nominal), (elems * 4, variant, [], errors))
            if stats:
                entry[2].append(stats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    ap.add_argument("--passes", type=int, default=1)
    args = ap.parse_args()
    passes = 1 if args.smoke else max(1, args.passes)

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    nxt, prv = (rank + 1) % n, (rank - 1 + n) % n
    sizes = []
    b = 4
    while b <= (1024 if args.smoke else args.max_bytes):
        sizes.append(b)
        b *= 4
    ops = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather",
           "scatter", "sendrecv"]
    measured = {}  # (op, nominal) -> (bytes, torch call, [stats of each pass], errors)
    for _ in range(passes):
        sweep(args, ops, sizes, rank, n, nxt, prv, measured)
    rows = []
    for (op, nominal), (nbytes, variant, passes_stats, errors) in measured.items():
        stats = combine(passes_stats) if passes_stats else None
        rows.append({"suite": "collectives_torch", "name": op, "backend": "gloo", "ranks": n,
                     "bytes": nbytes, "nominal_bytes": nominal, "torch_call": variant,
                     "torch_us": stats["median"] if stats else None,
                     "torch_min_us": stats["min"] if stats else None,
                     "torch_max_us": stats["max"] if stats else None,
                     "samples": stats["samples"] if stats else 0,
                     "unsupported": None if stats else "; ".join(errors),
                     "passes": passes, "torch_version": torch.__version__})
    def barrier():
        dist.barrier()
    st = combine([measure(plan_for(args, 0), barrier) for _ in range(passes)])
    rows.append({"suite": "collectives_torch", "name": "barrier", "backend": "gloo", "ranks": n, "bytes": 0,
                 "nominal_bytes": 0, "torch_call": "barrier", "torch_us": st["median"], "torch_min_us": st["min"],
                 "torch_max_us": st["max"], "samples": st["samples"], "unsupported": None,
                 "torch_version": torch.__version__})
    if rank == 0:
        print(f"torch.distributed {torch.__version__} on gloo, {n} processes (float32, rank 0's times)")
        for r in rows:
            t = "unsupported: " + r["unsupported"] if r["unsupported"] else \
                f'{r["torch_us"]:.1f} [{r["torch_min_us"]:.1f}-{r["torch_max_us"]:.1f}] us ({r["torch_call"]})'
            print(f'{r["name"]:<16}{r["bytes"]:>10} B  {t}')
        if args.out:
            date, host = time.strftime("%Y-%m-%d", time.gmtime()), socket.gethostname()
            path = os.path.join(args.out, f"torch_collectives_n{n}.json")
            with open(path, "w") as f:
                f.write("[\n" + ",\n".join("  " + json.dumps(dict(r, date=date, host=host)) for r in rows)
                        + "\n]\n")
            print(f"wrote {path} ({len(rows)} rows)")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

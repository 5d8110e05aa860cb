#!/usr/bin/python3
"""The TP MLP forward of bench_mlp, through torch (the PyTorch reference): torch.mm and torch.distributed.

    dtensor-run --standalone --rank0-store --nproc-per-node 4 /usr/bin/python3 bench/mlp/torch_mlp.py \
        [--act relu|gelu|none] [--scale S] [--smoke] [--out DIR] [--sizes TxHxF,...] [--threads T]

Each rank holds x (tokens, hidden) whole, its column shard of W1 (hidden, ffn/n) and its row shard of W2
(ffn/n, hidden), and runs h = torch.mm(x, w1); h = torch.relu(h) (or gelu, or nothing); y = torch.mm(h, w2);
dist.all_reduce(y): the same computation, data (filled from the global index), sizes, sample plan, timing
(per iteration, clock reads between the steps) and statistics (the slowest rank's medians) as
bench/mlp/mlp_bench.cpp, whose header has the details. Threads: torch.set_num_threads(T) and
set_num_interop_threads(1) (T = --threads, default 1); OpenBLAS (which torch.mm calls for float32 on Debian's torch) follows
OPENBLAS_NUM_THREADS, as ours does. Correctness: rank 0 compares y with the single-process product of the
full operands (exact for relu/none, 1e-5 of the largest |y| for gelu) and every rank writes the same
checksums as bench_mlp, which bench/mlp/join.py compares. Writes DIR/torch_mlp_n<ranks>.json.
"""
import argparse
import ctypes
import json
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

# (tokens, hidden, ffn, samples, warmup): bench_mlp's defaults; keep the two lists equal.
SIZES = [(8, 64, 256, 500, 20), (64, 256, 1024, 200, 20), (128, 512, 2048, 80, 5), (256, 1024, 4096, 30, 3)]
SMOKE_SIZES = [(8, 64, 256, 1, 0), (16, 32, 64, 1, 0)]


def parse_sizes(s):
    """ "64x256x1024,8x64x256" -> sizes, samples and warm-up chosen as bench_mlp's parse_sizes does."""
    out = []
    for item in s.split(","):
        t, h, f = (int(v) for v in item.split("x"))
        work = float(t) * h * f
        samples = 500 if work <= 1e6 else 200 if work <= 1e8 else 80 if work <= 1e9 else 30
        out.append((t, h, f, samples, 20 if work <= 1e8 else 5 if work <= 1e9 else 3))
    return out


def fill_block(r0, rows, c0, cols, ld, seed):
    """Rows [r0, r0+rows), columns [c0, c0+cols) of the (.., ld) global operand `seed` (bench_mlp's fill)."""
    i = (torch.arange(r0, r0 + rows, dtype=torch.int64)[:, None] * ld
         + torch.arange(c0, c0 + cols, dtype=torch.int64)[None, :])
    return (((i * 2654435761 + seed * 97) >> 13) % 3 - 1).to(torch.float32).contiguous()


def activation(name):
    if name == "relu":
        return torch.relu
    if name == "gelu":
        return torch.nn.functional.gelu
    return None


def checksums(y):
    yd = y.reshape(-1).to(torch.float64)
    w = (torch.arange(yd.numel(), dtype=torch.int64) % 13 - 6).to(torch.float64)
    return float(yd.sum()), float((yd * w).sum()), float(yd.abs().sum())


def world_max(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def blas_threads():
    try:
        return ctypes.CDLL("libopenblas.so.0").openblas_get_num_threads()
    except (OSError, AttributeError):
        return -1


def run_size(args, size, rank, n):
    tokens, hidden, ffn, samples, warmup = size
    if ffn % n:
        raise SystemExit(f"torch_mlp: ffn {ffn} is not a multiple of the {n} ranks")
    f = ffn // n
    x = fill_block(0, tokens, 0, hidden, hidden, 1)
    w1 = fill_block(0, hidden, rank * f, f, ffn, 2)  # (hidden, ffn/n)
    w2 = fill_block(rank * f, f, 0, hidden, hidden, 3)  # (ffn/n, hidden)
    act = activation(args.act)
    samples = 1 if args.smoke else max(1, round(samples * args.scale))
    warmup = 0 if args.smoke else warmup
    total, gemm, actt, comm = [], [], [], []
    clock = time.perf_counter
    y = None
    def usage():  # page faults, voluntary and involuntary context switches, CPU us of this process (bench_mlp's)
        u = resource.getrusage(resource.RUSAGE_SELF)
        return [u.ru_minflt, u.ru_nvcsw, u.ru_nivcsw, (u.ru_utime + u.ru_stime) * 1e6]
    use = [0, 0, 0, 0]
    dist.barrier()
    for it in range(warmup + samples):
        if it == warmup:
            use = usage()
        t0 = clock()
        h = torch.mm(x, w1)
        t1 = clock()
        if act is not None:
            h = act(h)
        t2 = clock()
        y = torch.mm(h, w2)
        t3 = clock()
        dist.all_reduce(y)
        t4 = clock()
        if it >= warmup:
            total.append((t4 - t0) * 1e6)
            gemm.append((t1 - t0 + t3 - t2) * 1e6)
            actt.append((t2 - t1) * 1e6)
            comm.append((t4 - t3) * 1e6)
    use = [(b - a) / samples for a, b in zip(use, usage())]
    med = statistics.median
    m = world_max([med(total), med(gemm), med(actt), med(comm), -min(total), max(total)] + use)

    ok, max_err = True, 0.0
    if rank == 0:
        ref_h = torch.mm(fill_block(0, tokens, 0, hidden, hidden, 1), fill_block(0, hidden, 0, ffn, ffn, 2))
        if act is not None:
            ref_h = act(ref_h)
        ref = torch.mm(ref_h, fill_block(0, ffn, 0, hidden, hidden, 3))
        max_err = float((ref - y).abs().max()) if ref.shape == y.shape else float("inf")
        tol = 1e-5 * max(1.0, float(ref.abs().max())) if args.act == "gelu" else 0.0
        ok = max_err <= tol
    s, ws, abs_sum = checksums(y)
    lo = world_max([-s, -ws, 0.0 if ok else 1.0])
    hi = world_max([s, ws])
    ok = lo[2] == 0 and -lo[0] == hi[0] and -lo[1] == hi[1]
    if not ok and rank == 0:
        print(f"torch_mlp: {tokens}x{hidden}x{ffn} {args.act}: the forward differs from the single-process "
              f"reference (rank 0's max |error| {max_err}) or between ranks (checksums)", file=sys.stderr)
    flops_rank = 4.0 * tokens * hidden * f
    return {"suite": "mlp_tp_torch", "name": f"{tokens}x{hidden}x{ffn} {args.act}", "backend": "gloo",
            "ranks": n, "bytes": tokens * hidden * 4, "torch_us": m[0], "torch_min_us": -m[4],
            "torch_max_us": m[5], "samples": samples, "tokens": tokens, "hidden": hidden, "ffn": ffn,
            "act": args.act, "gemm_us": m[1], "act_us": m[2], "comm_us": m[3],
            "gflops_per_rank": flops_rank / (m[1] * 1e3), "page_faults_per_iter": m[6],
            "voluntary_switches_per_iter": m[7], "involuntary_switches_per_iter": m[8],
            "cpu_us_per_iter": m[9], "torch_threads": torch.get_num_threads(),
            "blas_threads": blas_threads(),
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "checksum": s, "checksum_weighted": ws,
            "checksum_abs": abs_sum,
            "check": ("reference, 1e-5 of max |y|" if args.act == "gelu" else "reference, exact") if ok
            else "FAILED", "torch_version": torch.__version__}, ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--act", choices=["relu", "gelu", "none"], default="relu")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sizes", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    sizes = SMOKE_SIZES if args.smoke else (parse_sizes(args.sizes) if args.sizes else SIZES)

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows, all_ok = [], True
    for size in sizes:
        row, ok = run_size(args, size, rank, n)
        rows.append(row)
        all_ok = all_ok and ok
    if rank == 0:
        print(f"TP MLP forward through torch {torch.__version__} (torch.mm, dist.all_reduce) on gloo, {n} processes, "
              f"float32, torch threads {torch.get_num_threads()}, OpenBLAS threads {blas_threads()} (medians of the "
              f"slowest rank, us)")
        print(f'{"size":<20}{"act":<6}{"forward us [min-max]":>28}{"gemm":>10}{"act":>9}{"comm":>10}{"faults":>8}{"switches":>14}{"CPU us":>9}  check')
        for r in rows:
            print(f'{r["name"].split()[0]:<20}{r["act"]:<6}'
                  f'{r["torch_us"]:>10.0f} [{r["torch_min_us"]:.0f}-{r["torch_max_us"]:.0f}]'.ljust(54)
                  + f'{r["gemm_us"]:>10.1f}{r["act_us"]:>9.1f}{r["comm_us"]:>10.0f}{r["page_faults_per_iter"]:>8.0f}'
                  + f'{r["voluntary_switches_per_iter"]:>8.1f}+{r["involuntary_switches_per_iter"]:<5.1f}'
                  + f'{r["cpu_us_per_iter"]:>9.0f}  {r["check"]}')
        if args.out and not args.smoke:
            date, host = time.strftime("%Y-%m-%d", time.gmtime()), socket.gethostname()
            path = os.path.join(args.out, f"torch_mlp_n{n}.json")
            with open(path, "w") as f:
                f.write("[\n" + ",\n".join("  " + json.dumps(dict(r, date=date, host=host)) for r in rows)
                        + "\n]\n")
            print(f"wrote {path} ({len(rows)} rows)")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

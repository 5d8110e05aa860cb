#!/usr/bin/python3
"""bench_moe's exchange through torch 1.13: the per-peer counts by dist.all_to_all_single of int64, the rows
by dist.all_to_all_single with variable splits, the rows back with the splits swapped; the same splits,
sizes, sample counts and statistics (the slowest rank's median) as bench/moe/moe_bench.cpp.

    dtensor-run --standalone --rank0-store --nproc-per-node 4 /usr/bin/python3 bench/moe/torch_moe.py [--smoke] [--out DIR]

Writes DIR/torch_moe_n<ranks>.json (rank 0).
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    sizes = [(4, 16, 2)] if a.smoke else [(16, 256, 200), (128, 1024, 60), (512, 1024, 20)]
    rows = []
    for base, hidden, samples in sizes:
        send = [base * (1 + (3 * r + 5 * j) % 4) for j in range(n)]
        recv = [base * (1 + (3 * j + 5 * r) % 4) for j in range(n)]
        x = (torch.arange(sum(send) * hidden, dtype=torch.float32) % 7).reshape(sum(send), hidden)
        y = torch.empty(sum(recv), hidden)
        back = torch.empty(sum(send), hidden)
        counts = torch.tensor(send, dtype=torch.int64)
        got = torch.empty(n, dtype=torch.int64)

        def exchange():
            dist.all_to_all_single(got, counts)
            dist.all_to_all_single(y, x, recv, send)
            dist.all_to_all_single(back, y, send, recv)

        exchange()
        assert torch.equal(back, x), "the exchange did not return the rows"
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            exchange()
            times.append((time.perf_counter() - t0) * 1e6)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        rows.append({"size": f"{base} x {hidden}", "exchange_us": med.item()})
    if r == 0:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"torch_moe_n{n}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

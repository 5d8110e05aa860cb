#!/usr/bin/python3
"""bench_pipeline_p2p's 1F1B step hand-written over torch 1.13's point-to-point calls (gloo): one stage per
process; a forward receives the activation from the previous stage (dist.recv), sleeps 2 ms and sends its
output to the next (dist.isend); a backward receives the gradient from the next stage, sleeps 4 ms and sends
the input gradient back; the sends are waited for at the end of the step. The order is 1F1B's (min(p - r - 1,
m) warm-up forwards, then one forward and one backward, then the remaining backwards: torch's Schedule1F1B,
Megatron's). The same sizes, micro-batch counts, samples and statistics (a barrier before each step, the
slowest rank's median) as bench/pipeline/pipeline_p2p_bench.cpp.

    dtensor-run --standalone --rank0-store --nproc-per-node 4 /usr/bin/python3 bench/pipeline/torch_pipeline.py [--smoke] [--out DIR]

Writes DIR/torch_pipeline_n<ranks>.json (rank 0).
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
    p, r = dist.get_world_size(), dist.get_rank()
    f_s = 0.0002 if a.smoke else 0.002
    b_s = 2 * f_s
    sizes = [(2, 8)] if a.smoke else [(8, 256), (64, 1024), (256, 1024)]
    ms = [2] if a.smoke else [4, 8, 16]
    samples, warm = (1, 0) if a.smoke else (15, 2)
    rows = []
    for n_rows, hidden in sizes:
        for m in ms:
            def step():
                sends = []

                def forward():
                    if r > 0:
                        x = torch.empty(n_rows, hidden)
                        dist.recv(x, r - 1)
                    time.sleep(f_s)
                    y = torch.zeros(n_rows, hidden)
                    if r < p - 1:
                        sends.append(dist.isend(y, r + 1))

                def backward():
                    if r < p - 1:
                        g = torch.empty(n_rows, hidden)
                        dist.recv(g, r + 1)
                    time.sleep(b_s)
                    dx = torch.zeros(n_rows, hidden)
                    if r > 0:
                        sends.append(dist.isend(dx, r - 1))

                warmup = min(p - r - 1, m)
                for _ in range(warmup):
                    forward()
                for _ in range(m - warmup):
                    forward()
                    backward()
                for _ in range(warmup):
                    backward()
                for w in sends:
                    w.wait()

            times = []
            for s in range(samples + warm):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                if s >= warm:
                    times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            med = torch.tensor([times[len(times) // 2]], dtype=torch.float64)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            rows.append({"size": f"{n_rows} x {hidden}", "microbatches": m, "step_ms": med.item()})
    if r == 0:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"torch_pipeline_n{p}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

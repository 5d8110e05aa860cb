"""torch 1.13's attention on CPUs at bench_attention's shapes, for the torch column of BENCHMARKS.md's
"Attention" section: softmax(q k^T * scale [+ causal mask]) v, float, batch 1, 8 heads, head_dim 64, seq 512,
2048 and 8192, one thread (torch 1.13 has no fused scaled_dot_product_attention). Each (seq, causal) runs in
a fresh process, so its peak resident memory beyond the inputs is its own (ru_maxrss after one call minus
before it). Prints a table and writes DIR/attention_torch.json.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/ops/torch_attention.py [--out DIR] [--samples N] [--smoke]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def one(seq, causal, samples):
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, seq, 64) for _ in range(3))
    mask = torch.full((seq, seq), float("-inf")).triu(1) if causal else None
    scale = 64 ** -0.5

    def attention():
        s = (q @ k.transpose(-1, -2)) * scale
        if mask is not None:
            s = s + mask
        return torch.softmax(s, -1) @ v

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    attention()  # also the warm-up
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        attention()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"seq": seq, "causal": causal, "torch_ms": statistics.median(times), "torch_min_ms": min(times),
            "torch_max_ms": max(times), "samples": samples, "torch_peak_mib": peak_mib,
            "torch_version": torch.__version__}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--samples", type=int, default=0, help="default: 7 up to seq 2048, 3 at 8192")
    ap.add_argument("--smoke", action="store_true", help="seq 512 only, one sample, nothing written")
    ap.add_argument("--one", nargs=2, metavar=("SEQ", "CAUSAL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(int(a.one[0]), a.one[1] == "1", a.samples)))
        return
    rows = []
    for seq in [512] if a.smoke else [512, 2048, 8192]:
        for causal in (False, True):
            samples = 1 if a.smoke else (a.samples or (3 if seq >= 8192 else 7))
            out = subprocess.run([sys.executable, __file__, "--one", str(seq), "1" if causal else "0",
                                  "--samples", str(samples)], check=True, capture_output=True, text=True,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("torch %s attention, softmax(q k^T * scale) v, float, batch 1, 8 heads, head_dim 64, 1 thread"
          % rows[0]["torch_version"])
    print("%-6s %-7s %-24s %s" % ("seq", "causal", "torch ms [min-max]", "peak MiB beyond inputs"))
    for r in rows:
        print("%-6d %-7s %-24s %.1f" % (r["seq"], "yes" if r["causal"] else "no",
                                        "%.1f [%.1f-%.1f]" % (r["torch_ms"], r["torch_min_ms"], r["torch_max_ms"]),
                                        r["torch_peak_mib"]))
    if not a.smoke:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "attention_torch.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()

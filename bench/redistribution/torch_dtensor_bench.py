#!/usr/bin/env python3
"""The redistribution suite of bench_redistribution_cuda through torch.distributed.tensor (PyTorch 2.x
DTensor) on CUDA tensors over NCCL: the side-by-side reference for dtensor's device mode.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/redistribution/torch_dtensor_bench.py [--scale S] [--smoke] [--out DIR] [--ours FILE]
    python3 bench/redistribution/torch_dtensor_bench.py --check      # 0: can run; 77: why not (printed)

Several ranks on one GPU: set DTENSOR_TEST_HOSTID_PER_RANK=1 (each rank gets its own NCCL_HOSTID, as
dtensor's benchmarks do), NCCL_IB_DISABLE=1 and NCCL_SOCKET_IFNAME=lo. Exits 77 when torch, its DTensor
module, CUDA or NCCL is missing.

The cases are those of bench/redistribution/redistribution_bench.cpp for the same number of ranks (kept in
step by hand: CASES_1D, CASES_2D, CASES_3D below), with the same names, meshes and shapes (float32), so the
rows join on (mesh, name, shape). Method, the same as dtensor's device mode:
  - source: distribute_tensor of the full tensor (arange % 1000) on the mesh; Partial sources are
    DTensor.from_local of the Replicate/Shard layout with Partial() in place (every rank's local tensor
    is an addend);
  - time: warm-up batch, then samples of back-to-back `x.redistribute(mesh, dst)` calls (synchronous:
    async_op=False, the default), each batch ending with torch.cuda.synchronize(), divided by the batch;
    sample plan as bench_redistribution's (9 samples x --scale, batch 10 up to 64 KiB, 3 up to 1 MiB);
  - host time: one call per sample, torch.cuda.synchronize() before it outside the timed region, the
    result dropped inside it (15 samples x --scale): what the call costs the host;
  - each of median, min and max is the largest over ranks. Tensors do not require grad; default grad mode.
Writes DIR/redistribution_vs_torch_dtensor_n<ranks>.json (rank 0): one row per case in the bench schema,
suite "redistribution_vs_torch_dtensor", ref_name "torch_dtensor", ref_us = torch's time and ours_us =
dtensor's (from --ours, default DIR/redistribution_cuda_n<ranks>.json; null when that file or row is
missing), ratio = ours / torch; host times as ours_host_us / ref_host_us and host_ratio; torch's
collective counts per call (CommDebugMode) when available; torch_error when torch rejects a case.
"""
import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

SKIP = 77

# (source, target, shape kind, name suffix); placements: "R", "P" (Partial sum), "S0", "S1".
CASES_1D = [
    (["S0"], ["R"], "even", ""),
    (["R"], ["S0"], "even", ""),
    (["S0"], ["S1"], "even", ""),
    (["P"], ["R"], "even", ""),
    (["P"], ["S0"], "even", ""),
    (["R"], ["P"], "even", ""),
    ("chain", None, "even", ""),  # [R]->[P(sum)]->[R], two redistributes per call
    (["S0"], ["R"], "uneven", " uneven"),
    (["S0"], ["S1"], "uneven", " uneven"),
    (["P"], ["S1"], "uneven", " uneven"),
    (["S1"], ["S0"], "few_rows", " rows<ranks"),
]
CASES_2D = [
    (["S0", "S1"], ["S1", "S0"], "even", ""),
    (["S0", "S0"], ["R", "S1"], "even", ""),
    (["S0", "R"], ["R", "S1"], "even", ""),
    (["S0", "S0"], ["S1", "S1"], "even", ""),
    (["S0", "S1"], ["S0", "S0"], "even", ""),
    (["R", "S1"], ["S1", "S0"], "even", ""),
    (["S0", "S1"], ["R", "R"], "even", ""),
    (["P", "P"], ["R", "S1"], "even", ""),
    (["P", "P"], ["S0", "S1"], "even", ""),
    (["P", "S0"], ["S0", "R"], "even", ""),
    (["S0", "S1"], ["S1", "S0"], "uneven", " uneven"),
    (["S0", "S0"], ["R", "S1"], "uneven", " uneven"),
]
CASES_3D = [
    (["S0", "S1", "R"], ["S1", "S0", "R"], "even", ""),
    (["S0", "S0", "S0"], ["S1", "S1", "S1"], "even", ""),
    (["S0", "S1", "S0"], ["R", "R", "R"], "even", ""),
    (["P", "S0", "S1"], ["S1", "S0", "R"], "even", ""),
    (["S0", "S0", "R"], ["R", "S1", "S1"], "even", ""),
    (["S0", "R", "S1"], ["S1", "S0", "R"], "uneven", " uneven"),
]


def placement_name(p):
    return {"R": "R", "P": "P(sum)", "S0": "S(0)", "S1": "S(1)"}[p]


def case_name(src, dst, suffix):
    if src == "chain":
        return "[R]->[P(sum)]->[R]"
    return ("[" + ",".join(map(placement_name, src)) + "]->[" + ",".join(map(placement_name, dst)) + "]" +
            suffix)


def meshes_for(w):
    """(mesh sizes, dim names, cases) as bench_redistribution_cuda runs them for w ranks."""
    out = []
    if w <= 4:
        out.append(((w,), ("x",), CASES_1D))
    if w == 4:
        out.append(((2, 2), ("dp", "tp"), CASES_2D))
    if w == 8:
        out.append(((2, 2, 2), ("pp", "dp", "tp"), CASES_3D))
    if w < 4:  # one GPU: the multi-axis lists on (1, w) and (1, 1, w)
        out.append(((1, w), ("dp", "tp"), CASES_2D))
        out.append(((1, 1, w), ("pp", "dp", "tp"), CASES_3D))
    return out


def scaled(args, n):
    return 1 if args.smoke else max(1, int(math.floor(n * args.scale + 0.5)))


def plan_for(args, nbytes):
    warmup = 0 if args.smoke else 1
    batch = 1 if args.smoke else (10 if nbytes <= (64 << 10) else 3 if nbytes <= (1 << 20) else 1)
    return warmup, scaled(args, 9), batch


def stats(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": len(v)}


def check_environment():
    """None when the benchmark can run here, else why not."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means: skip
        return "torch is not importable (%s)" % e
    try:
        dtensor_api()  # torch.distributed.tensor (PyTorch >= 2.4; 2.2 - 2.3: _tensor) and DeviceMesh
    except Exception as e:  # noqa: BLE001
        return "torch %s has no usable torch.distributed.tensor / device_mesh (DTensor needs PyTorch 2.2+): %s" % (
            torch.__version__, e)
    import torch.distributed as dist
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "torch %s sees no CUDA device" % torch.__version__
    if not dist.is_available() or not dist.is_nccl_available():
        return "torch %s has no NCCL backend" % torch.__version__
    return None


def dtensor_api():
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    except ImportError:  # PyTorch 2.2 - 2.3
        from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor
        try:
            from torch.distributed._tensor import Partial
        except ImportError:
            from torch.distributed._tensor.placement_types import _Partial as Partial
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:
        try:
            from torch.distributed._tensor.debug import CommDebugMode
        except ImportError:
            CommDebugMode = None
    return DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh, CommDebugMode


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--ours", default=None, help="dtensor's rows (default OUT/redistribution_cuda_n<ranks>.json)")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("DTENSOR_TIMEOUT", "120")))
    ap.add_argument("--check", action="store_true", help="only say whether this machine can run it")
    args = ap.parse_args()
    if os.environ.get("DTENSOR_GPU_CHECK_VALIDATE", "0") not in ("", "0"):
        # gpu_check.sh --dry-run: the flags and the launch (torchrun's variables, if launched by it), nothing run
        print("torch_dtensor_bench: valid: %s, rank %s of %s" % (
            "--check" if args.check else "--scale %g --out %s" % (args.scale, args.out),
            os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")), flush=True)
        return 0

    why = check_environment()
    if why is not None:
        print("torch_dtensor_bench: skipping: " + why, flush=True)
        return SKIP
    import torch
    import torch.distributed as dist
    if args.check:
        nccl = torch.cuda.nccl.version()
        print("torch_dtensor_bench: torch %s, CUDA %s, %d device(s), NCCL %s: can run" % (
            torch.__version__, torch.version.cuda, torch.cuda.device_count(),
            ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl), flush=True)
        return 0
    (DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh,
     CommDebugMode) = dtensor_api()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if os.environ.get("DTENSOR_TEST_HOSTID_PER_RANK") == "1":
        # Several ranks on one GPU: NCCL must see them as different hosts (socket transport over loopback).
        os.environ["NCCL_HOSTID"] = "torch-bench-rank-%d" % rank
    dev = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    device = torch.device("cuda", dev)
    dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout))
    w = dist.get_world_size()

    def sync():
        torch.cuda.synchronize(device)

    def world_max(s):
        t = torch.tensor([s["median"], s["min"], s["max"]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        m = t.tolist()
        return {"median": m[0], "min": m[1], "max": m[2], "samples": s["samples"]}

    def timed(plan, fn):
        warmup, samples, batch = plan
        for _ in range(warmup):
            for _ in range(batch):
                fn()
            sync()
        v = []
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            sync()
            v.append((time.perf_counter() - t0) * 1e6 / batch)
        return stats(v)

    def host_time(fn):
        v = []
        for _ in range(scaled(args, 15)):
            sync()
            t0 = time.perf_counter()
            fn()
            v.append((time.perf_counter() - t0) * 1e6)
        sync()
        return stats(v)

    def to_placement(p):
        return Replicate() if p == "R" else Partial() if p == "P" else Shard(int(p[1]))

    def make_source(mesh, src, rows, cols):
        full = (torch.arange(rows * cols, device=device, dtype=torch.float32) % 1000).reshape(rows, cols)
        base = distribute_tensor(full, mesh, [Replicate() if p == "P" else to_placement(p) for p in src])
        if "P" not in src:
            return base
        return DTensor.from_local(base.to_local(), mesh, [to_placement(p) for p in src], run_check=False,
                                  shape=full.shape, stride=full.stride())

    def done(y):
        lt = getattr(y, "_local_tensor", None)
        wait = getattr(lt, "wait", None)  # an AsyncCollectiveTensor on a torch that returns one
        if callable(wait):
            wait()

    smoke = args.smoke
    shapes = {"even": (16, 8) if smoke else (512, 256), "uneven": (13, 7) if smoke else (509, 251)}
    shapes["few_rows"] = (3, shapes["uneven"][1])

    ours_path = args.ours or os.path.join(args.out, "redistribution_cuda_n%d.json" % w)
    ours = {}
    if rank == 0 and os.path.exists(ours_path):
        for r in json.load(open(ours_path)):
            if r.get("suite") == "redistribution":
                ours[(r.get("mesh"), r["name"], r.get("shape"))] = r

    rows = []
    for sizes, names, cases in meshes_for(w):
        mesh = init_device_mesh("cuda", sizes, mesh_dim_names=names)
        label = "x".join(map(str, sizes))
        for src, dst, kind, suffix in cases:
            nrows, ncols = shapes[kind]
            name = case_name(src, dst, suffix)
            nbytes = nrows * ncols * 4
            rec = {"mesh": label, "name": name, "shape": "%dx%d" % (nrows, ncols), "bytes": nbytes,
                   "time": None, "host": None, "comm": None, "error": None}
            try:
                if src == "chain":
                    x = make_source(mesh, ["R"], nrows, ncols)
                    p_pl, r_pl = [Partial()], [Replicate()]

                    def call():
                        y = x.redistribute(mesh, p_pl).redistribute(mesh, r_pl)
                        done(y)
                else:
                    x = make_source(mesh, src, nrows, ncols)
                    dst_pl = [to_placement(p) for p in dst]

                    def call():
                        y = x.redistribute(mesh, dst_pl)
                        done(y)
                sync()
                rec["time"] = world_max(timed(plan_for(args, nbytes), call))
                rec["host"] = world_max(host_time(call))
                if CommDebugMode is not None:
                    try:
                        cm = CommDebugMode()
                        with cm:
                            call()
                        sync()
                        rec["comm"] = {str(getattr(k, "__name__", k)): v for k, v in cm.get_comm_counts().items()}
                    except Exception as e:  # noqa: BLE001 - counts are optional
                        rec["comm"] = {"unavailable": str(e)[:120]}
            except Exception as e:  # noqa: BLE001 - torch rejects a case on every rank alike
                rec["error"] = ("%s: %s" % (type(e).__name__, e))[:300]
                sync()
            rows.append(rec)

    if rank == 0:
        out = []
        host = socket.gethostname()
        date = time.strftime("%Y-%m-%d", time.gmtime())
        print("redistribution through torch.distributed.tensor %s on NCCL, CUDA tensors, %d process(es) "
              "(float32; us; the slowest rank's median; time ends each batch with a device sync; host: the "
              "call alone, device idle before it); ours from %s" % (torch.__version__, w, ours_path))
        head = "%-6s %-36s %-8s %11s %11s %7s %11s %11s %7s" % (
            "mesh", "transition", "shape", "ours us", "torch us", "o/t", "ours host", "torch host", "o/t")
        print(head)
        print("-" * len(head))
        for r in rows:
            o = ours.get((r["mesh"], r["name"], r["shape"]))
            t, h = r["time"], r["host"]
            ours_us = o.get("ours_us") if o else None
            ours_host = o.get("host_us") if o else None
            ref_us = t["median"] if t else None
            ref_host = h["median"] if h else None
            ratio = ours_us / ref_us if (ours_us and ref_us) else None
            host_ratio = ours_host / ref_host if (ours_host and ref_host) else None
            out.append({
                "suite": "redistribution_vs_torch_dtensor", "name": r["name"], "backend": "nccl", "ranks": w,
                "bytes": r["bytes"], "ours_us": ours_us,
                "ours_min_us": o.get("ours_min_us") if o else None,
                "ours_max_us": o.get("ours_max_us") if o else None,
                "ref_name": "torch_dtensor", "ref_us": ref_us, "ref_min_us": t["min"] if t else None,
                "ref_max_us": t["max"] if t else None, "ratio": ratio,
                "samples": t["samples"] if t else 0,
                "mesh": r["mesh"], "shape": r["shape"], "device": "cuda",
                "ours_host_us": ours_host,
                "ours_host_min_us": o.get("host_min_us") if o else None,
                "ours_host_max_us": o.get("host_max_us") if o else None,
                "ref_host_us": ref_host, "ref_host_min_us": h["min"] if h else None,
                "ref_host_max_us": h["max"] if h else None, "ref_host_samples": h["samples"] if h else 0,
                "host_ratio": host_ratio, "ours_plan": o.get("plan") if o else None,
                "torch_comm_counts": r["comm"], "torch_error": r["error"],
                "torch_version": torch.__version__, "date": date, "host": host,
            })

            def f(v):
                return "-" if v is None else ("%.0f" % v if v >= 100 else "%.1f" % v)

            def g(v):
                return "-" if v is None else "%.2f" % v
            print("%-6s %-36s %-8s %11s %11s %7s %11s %11s %7s%s" % (
                r["mesh"], r["name"], r["shape"], f(ours_us), f(ref_us), g(ratio), f(ours_host), f(ref_host),
                g(host_ratio), ("  torch: " + r["error"][:60]) if r["error"] else ""))
        if args.out:
            path = os.path.join(args.out, "redistribution_vs_torch_dtensor_n%d.json" % w)
            with open(path, "w") as fh:
                fh.write("[\n" + ",\n".join("  " + json.dumps(x) for x in out) + "\n]\n")
            print("wrote %s (%d rows)" % (path, len(out)))
        sys.stdout.flush()
    # A barrier on the NCCL group without guessing the device, then a clean shutdown.
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    sync()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""bench_train's models trained through torch 1.13 (the reference of bench/train/train_vs_torch.sh).

    dtensor-run --standalone --rank0-store --nproc-per-node 4 /usr/bin/python3 bench/train/torch_train.py \
        --layout tp|ddp [--model mlp|gpt] [--steps N] [--tokens T --hidden H --ffn F --vocab V] \
        [--heads N --kv-heads N] [--check-steps K] [--threads 1] [--json FILE]

--model gpt: the GPT of examples/09_gpt.cpp as bench_train --model gpt builds it: per block h + attention(
rms_norm(h)) then h + W_down(silu(W_gate x) * W_up x) with x = rms_norm(h); causal attention with grouped-query
heads (--heads sharing --kv-heads, 8 and 4 by default), RoPE (base 10000) on q and k, softmax(Q K^T / sqrt(d)) V
materialised (torch 1.13 has no fused attention); the tokens 8 sequences of T / 8, laid out (S, B) as Megatron
does. Its tp layout adds to the one below: q, k, v column-parallel (the heads over the ranks), the output
projection row-parallel, a sequence all_gather before and a reduce_scatter after each of attention and the MLP.
The default, --model mlp:

The model, as bench_train builds it (nn::LanguageModel of nn::MlpBlock): a vocab-parallel embedding (V, H), 3 blocks of h + W2 gelu(W1 rms_norm(h))
with rms_norm gains (H), W1 (F, H), W2 (H, F), a final rms_norm and a head W_out (V, H); cross entropy, the mean
over the step's tokens (ids from the same formula as bench_train's tokens(), over the flattened (8, T/8) batch); gradients clipped to a global norm
of 0.5, torch.optim.AdamW(lr 1e-2, weight_decay 0.01); float32; initial values drawn with torch's own RNG
from the same distributions (normal for the embedding, kaiming_uniform(a=sqrt 5) for the matrices, ones for
the gains), so the losses are not ours, the work is.

Layouts (the world is the one mesh axis):
  tp   Megatron-style tensor + sequence parallel, written by hand: the tokens sharded between the TP regions;
       before W1 and before the head an all_gather of the sequence, after W2 and after the embedding a
       reduce_scatter (its backward the dual); the embedding and the head sharded on the vocabulary, the loss
       vocab-parallel (an all_reduce of the row max, one of the sums of exponentials and target logits); the
       gains' gradients all-reduced after the backward; the clip norm completed by one all_reduce. torch 1.13's
       gloo has no reduce_scatter: it is an all_to_all_single then a local sum (the same bytes a ring
       reduce_scatter moves); the all_gather is dist.all_gather_into_tensor where gloo has it, else
       dist.all_gather into views of one buffer.
  ddp  torch.nn.parallel.DistributedDataParallel (bucket_cap_mb = 4 KiB as bench_train's DDPReducer), the
       tokens split over the ranks as torch.chunk splits them; each rank's loss the mean of its own tokens
       (DDP averages the gradients: the global mean when the ranks' shares are equal, as in the bench).

Timing, as bench_train: the mean over steps 2..N of the step (perf_counter around forward, backward, clip,
optimizer step) and of rank 0's minor page faults in it (getrusage); for tp also the time blocked in the sequence-parallel collectives and the gains' all_reduce
("comm"; the loss's and the clip's small all_reduces count as compute; bench_train counts every TP collective as compute). DDP's all_reduces run
inside backward(): no split. Check: rank 0 trains the same weights on one process (no collectives) for K steps
(--check-steps, default 2) and compares the losses (1e-4 relative): the exit status is 1 on a mismatch.
"""
import argparse
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

BLOCKS = 3
LR, MAX_NORM, EPS = 1e-2, 0.5, 1e-6
MASK64 = (1 << 64) - 1


def batch(step, tokens, vocab):
    """bench_train's tokens(): ids and targets of step `step` (all the tokens)."""
    ids = []
    for i in range(tokens):
        z = ((step * 1000003 + i * 7919) * 2654435761) & MASK64
        ids.append((z >> 16) % vocab)
    ids = torch.tensor(ids, dtype=torch.int64)
    return ids, (3 * ids + 1) % vocab


def init_full(args):
    """The full parameters: emb, (g, w1, w2) per block, gf, out."""
    torch.manual_seed(2024)
    h, f, v = args.hidden, args.ffn, args.vocab

    def kaiming(rows, cols):
        w = torch.empty(rows, cols)
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        return w

    p = [torch.randn(v, h)]
    for _ in range(BLOCKS):
        p += [torch.ones(h), kaiming(f, h), kaiming(h, f)]
    return p + [torch.ones(h), kaiming(v, h)]


def init_full_gpt(args):
    """The GPT's full parameters: emb, (g1, wq, wk, wv, wo, g2, w_gate, w_up, w_down) per block, gf, out."""
    torch.manual_seed(2024)
    h, f, v, kvd = args.hidden, args.ffn, args.vocab, args.hidden // args.heads * args.kv_heads

    def kaiming(rows, cols):
        w = torch.empty(rows, cols)
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        return w

    p = [torch.randn(v, h) * 0.1]
    for _ in range(BLOCKS):
        p += [torch.ones(h), kaiming(h, h), kaiming(kvd, h), kaiming(kvd, h), kaiming(h, h), torch.ones(h),
              kaiming(f, h), kaiming(f, h), kaiming(h, f)]
    return p + [torch.ones(h), kaiming(v, h)]


def rope(x):
    """Rotary position embedding of x (S, B, heads, hd) over its first dimension (positions 0 .. S-1), base
    10000, the pairs (2i, 2i + 1) rotated."""
    s, hd = x.shape[0], x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]  # (S, hd/2)
    c, sn = ang.cos()[:, None, None, :], ang.sin()[:, None, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * sn, x0 * sn + x1 * c], -1).flatten(-2)


def attention(x, wq, wk, wv, wo, hd):
    """Causal softmax(Q K^T / sqrt(hd)) V with grouped-query heads, materialised as torch 1.13 does it (no fused
    kernel before torch 2.0). x (S, B, H); the weights are this rank's heads (all of them on one rank); the
    output (S, B, H) is this rank's partial sum (its heads' share of wo)."""
    s, b = x.shape[0], x.shape[1]
    q = rope(F.linear(x, wq).view(s, b, -1, hd))
    k = rope(F.linear(x, wk).view(s, b, -1, hd))
    v = F.linear(x, wv).view(s, b, -1, hd)
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (B, heads, S, hd)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    o = torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v  # (B, heads, S, hd)
    return F.linear(o.permute(2, 0, 1, 3).reshape(s, b, -1), wo)


def rms_norm(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g


class Comm:
    """The tensor-parallel collectives over the world, timed (seconds blocked in them)."""

    def __init__(self, n):
        self.n, self.blocked = n, 0.0
        self.gather_into = hasattr(dist, "all_gather_into_tensor")
        if self.gather_into:  # probe: torch 1.13's gloo may not implement it
            try:
                dist.all_gather_into_tensor(torch.empty(n), torch.ones(1))
            except (RuntimeError, ValueError):
                self.gather_into = False

    def timed(self, f):
        t0 = time.perf_counter()
        out = f()
        self.blocked += time.perf_counter() - t0
        return out

    def all_gather0(self, x):
        out = torch.empty((x.shape[0] * self.n,) + tuple(x.shape[1:]))
        if self.gather_into:
            self.timed(lambda: dist.all_gather_into_tensor(out, x.contiguous()))
        else:
            self.timed(lambda: dist.all_gather(list(out.chunk(self.n)), x.contiguous()))
        return out

    def reduce_scatter0(self, x):
        out = torch.empty_like(x)
        self.timed(lambda: dist.all_to_all_single(out, x.contiguous()))
        return out.view(self.n, x.shape[0] // self.n, *x.shape[1:]).sum(0)

    def all_reduce(self, x, op=dist.ReduceOp.SUM, timed=True):
        if timed:
            self.timed(lambda: dist.all_reduce(x, op=op))
        else:
            dist.all_reduce(x, op=op)
        return x


def sp_functions(comm):
    class Gather(torch.autograd.Function):  # sequence all_gather; backward reduce_scatter
        @staticmethod
        def forward(ctx, x):
            return comm.all_gather0(x)

        @staticmethod
        def backward(ctx, g):
            return comm.reduce_scatter0(g)

    class Scatter(torch.autograd.Function):  # reduce_scatter of a partial sum; backward all_gather
        @staticmethod
        def forward(ctx, x):
            return comm.reduce_scatter0(x)

        @staticmethod
        def backward(ctx, g):
            return comm.all_gather0(g)

    class VocabCE(torch.autograd.Function):  # Megatron's vocab-parallel cross entropy
        @staticmethod
        def forward(ctx, logits, target, lo):
            m = logits.max(1).values
            comm.all_reduce(m, dist.ReduceOp.MAX, timed=False)
            e = torch.exp(logits - m[:, None])
            inside = (target >= lo) & (target < lo + logits.shape[1])
            local = torch.where(inside, target - lo, torch.zeros_like(target))
            picked = logits.gather(1, local[:, None])[:, 0] * inside
            stats = torch.stack([e.sum(1), picked], 1)
            comm.all_reduce(stats, timed=False)
            loss = (torch.log(stats[:, 0]) + m - stats[:, 1]).mean()
            ctx.save_for_backward(e, stats[:, 0].clone(), local, inside)
            return loss

        @staticmethod
        def backward(ctx, g):
            e, total, local, inside = ctx.saved_tensors
            d = e / total[:, None]
            d[torch.arange(d.shape[0]), local] -= inside.to(d.dtype)
            return d * (g / d.shape[0]), None, None

    return Gather.apply, Scatter.apply, VocabCE.apply


def forward_tp(p, ids, targets, r, n, comm, fns):
    """Loss of the tensor + sequence parallel model; p = this rank's shards."""
    gather, scatter, vocab_ce = fns
    emb = p[0]
    vn = emb.shape[0]
    lo = r * vn
    inside = (ids >= lo) & (ids < lo + vn)
    e = F.embedding(torch.where(inside, ids - lo, torch.zeros_like(ids)), emb) * inside[:, None]
    h = scatter(e)  # (T/n, H)
    for b in range(BLOCKS):
        g, w1, w2 = p[1 + 3 * b: 4 + 3 * b]
        x = gather(rms_norm(h, g))
        h = h + scatter(F.linear(F.gelu(F.linear(x, w1)), w2))
    x = gather(rms_norm(h, p[-2]))
    return vocab_ce(F.linear(x, p[-1]), targets, lo)


def forward_tp_gpt(p, ids, targets, r, n, comm, fns, hd):
    """Loss of the tensor + sequence parallel GPT: ids, targets (S, B); the sequence sharded between the TP
    regions, the heads and the MLP's hidden units over the ranks."""
    gather, scatter, vocab_ce = fns
    emb = p[0]
    vn = emb.shape[0]
    lo = r * vn
    inside = (ids >= lo) & (ids < lo + vn)
    e = F.embedding(torch.where(inside, ids - lo, torch.zeros_like(ids)), emb) * inside[..., None]
    h = scatter(e)  # (S/n, B, H)
    for b in range(BLOCKS):
        g1, wq, wk, wv, wo, g2, wg, wu, wd = p[1 + 9 * b: 10 + 9 * b]
        h = h + scatter(attention(gather(rms_norm(h, g1)), wq, wk, wv, wo, hd))
        x = gather(rms_norm(h, g2))
        h = h + scatter(F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd))
    x = gather(rms_norm(h, p[-2]))
    return vocab_ce(F.linear(x, p[-1]).flatten(0, 1), targets.flatten(), lo)


def forward_full_gpt(p, ids, targets, hd):
    """The GPT on one process: ids, targets (S, B)."""
    h = F.embedding(ids, p[0])
    for b in range(BLOCKS):
        g1, wq, wk, wv, wo, g2, wg, wu, wd = p[1 + 9 * b: 10 + 9 * b]
        h = h + attention(rms_norm(h, g1), wq, wk, wv, wo, hd)
        x = rms_norm(h, g2)
        h = h + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    return F.cross_entropy(F.linear(rms_norm(h, p[-2]), p[-1]).flatten(0, 1), targets.flatten())


def forward_full(p, ids, targets):
    h = F.embedding(ids, p[0])
    for b in range(BLOCKS):
        g, w1, w2 = p[1 + 3 * b: 4 + 3 * b]
        h = h + F.linear(F.gelu(F.linear(rms_norm(h, g), w1)), w2)
    return F.cross_entropy(F.linear(rms_norm(h, p[-2]), p[-1]), targets)


class Full(torch.nn.Module):
    def __init__(self, full, forward):
        super().__init__()
        self.p = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in full])
        self.f = forward

    def forward(self, ids, targets):
        return self.f(list(self.p), ids, targets)


def clip(params, replicated, comm):
    """Global 2-norm clip; `replicated[i]`: parameter i's gradient is the same on every rank."""
    sq = torch.zeros(1, dtype=torch.float64)
    for q, rep in zip(params, replicated):
        if not rep or comm is None or dist.get_rank() == 0:
            sq += q.grad.double().pow(2).sum()
    if comm is not None:
        comm.all_reduce(sq, timed=False)
    norm = float(sq.sqrt())
    coef = MAX_NORM / (norm + 1e-6)
    if coef < 1:
        for q in params:
            q.grad.mul_(coef)
    return norm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["tp", "ddp"], required=True)
    ap.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--check-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    for name in ("tokens", "ffn", "vocab"):
        if getattr(args, name) % n:
            raise SystemExit(f"torch_train: --{name} {getattr(args, name)} is not a multiple of the {n} ranks")
    gpt = args.model == "gpt"
    if gpt and (args.heads % n or args.kv_heads % n or args.hidden % args.heads or args.tokens % 8):
        raise SystemExit(f"torch_train: --heads {args.heads} and --kv-heads {args.kv_heads} must be multiples of the "
                         f"{n} ranks, --hidden of --heads, --tokens of 8")
    hd = args.hidden // args.heads
    seq = args.tokens // 8
    # The GPT's ids as bench_train's: 8 sequences of T / 8, here (S, B) as Megatron lays them out.
    shaped = (lambda t: t.view(8, seq).t().contiguous()) if gpt else (lambda t: t)
    full_forward = (lambda q, i, tg: forward_full_gpt(q, i, tg, hd)) if gpt else forward_full
    full = init_full_gpt(args) if gpt else init_full(args)
    comm = Comm(n)
    if args.layout == "tp" and gpt:
        shard = lambda t, dim: t.chunk(n, dim)[r].clone()
        p = [shard(full[0], 0)]
        for b in range(BLOCKS):
            g1, wq, wk, wv, wo, g2, wg, wu, wd = full[1 + 9 * b: 10 + 9 * b]
            p += [g1.clone(), shard(wq, 0), shard(wk, 0), shard(wv, 0), shard(wo, 1), g2.clone(), shard(wg, 0),
                  shard(wu, 0), shard(wd, 1)]
        p += [full[-2].clone(), shard(full[-1], 0)]
        p = [torch.nn.Parameter(t) for t in p]
        gains = [1 + 9 * b for b in range(BLOCKS)] + [6 + 9 * b for b in range(BLOCKS)] + [len(p) - 2]
        fns = sp_functions(comm)
        run = lambda ids, tg: forward_tp_gpt(p, ids, tg, r, n, comm, fns, hd)
        params, replicated = p, [i in gains for i in range(len(p))]
    elif args.layout == "tp":
        shard = lambda t, dim: t.chunk(n, dim)[r].clone()
        p = [shard(full[0], 0)]
        for b in range(BLOCKS):
            p += [full[1 + 3 * b].clone(), shard(full[2 + 3 * b], 0), shard(full[3 + 3 * b], 1)]
        p += [full[-2].clone(), shard(full[-1], 0)]
        p = [torch.nn.Parameter(t) for t in p]
        gains = [1 + 3 * b for b in range(BLOCKS)] + [len(p) - 2]
        fns = sp_functions(comm)
        run = lambda ids, tg: forward_tp(p, ids, tg, r, n, comm, fns)
        params, replicated = p, [i in gains for i in range(len(p))]
    else:
        model = torch.nn.parallel.DistributedDataParallel(Full(full, full_forward), bucket_cap_mb=4096 / 2**20)
        params = list(model.parameters())
        replicated = [True] * len(params)
        gains = []
        split = 1 if gpt else 0  # the GPT's batch is its second dimension
        run = lambda ids, tg: model(ids.chunk(n, split)[r], tg.chunk(n, split)[r])
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    losses, step_s, comm_s, faults = [], [], [], []
    dist.barrier()
    for step in range(args.steps):
        ids, targets = (shaped(t) for t in batch(step, args.tokens, args.vocab))
        comm.blocked = 0.0
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = run(ids, targets)
        loss.backward()
        for i in gains:  # sequence parallel: each rank's rows' share of the gains' gradient
            comm.all_reduce(params[i].grad)
        clip(params, replicated, comm if args.layout == "tp" else None)
        opt.step()
        t1 = time.perf_counter()
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        lv = loss.detach().clone()
        if args.layout == "ddp":  # the global mean, for the printout and the check (outside the timing)
            dist.all_reduce(lv)
            lv /= n
        losses.append(float(lv))
        if step >= 1:
            step_s.append(t1 - t0)
            comm_s.append(comm.blocked)
            faults.append(f1 - f0)
    ok = True
    if r == 0 and args.check_steps > 0:
        ref = [torch.nn.Parameter(t.clone()) for t in full]
        ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.01)
        for step in range(min(args.check_steps, args.steps)):
            ids, targets = (shaped(t) for t in batch(step, args.tokens, args.vocab))
            ref_opt.zero_grad(set_to_none=True)
            loss = full_forward(ref, ids, targets)
            loss.backward()
            clip(ref, [True] * len(ref), None)
            ref_opt.step()
            if abs(float(loss) - losses[step]) > 1e-4 * abs(float(loss)):
                print(f"torch_train: step {step + 1}: loss {losses[step]} where one process gives {float(loss)}",
                      file=sys.stderr)
                ok = False
    mean = lambda v: sum(v) / max(1, len(v))
    t = torch.tensor([mean(step_s), mean(comm_s), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0],
                     dtype=torch.float64)
    t0 = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if r == 0:
        rec = {"suite": "train_torch", "model": args.model, "layout": args.layout, "dtype": "float32", "ranks": n,
               "blocks": BLOCKS, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "vocab": args.vocab,
               "heads": args.heads if gpt else 0, "kv_heads": args.kv_heads if gpt else 0,
               "steps": args.steps, "step_ms": float(t0[0]) * 1e3, "slowest_rank_step_ms": float(t[0]) * 1e3,
               "comm_ms": float(t0[1]) * 1e3 if args.layout == "tp" else None,
               "max_rss_bytes": float(t[2]), "minor_faults_per_step": mean(faults), "torch_version": torch.__version__,
               "torch_threads": torch.get_num_threads(), "all_gather": "all_gather_into_tensor" if comm.gather_into
               else "all_gather(list)", "losses": losses,
               "check": (f"one process, {min(args.check_steps, args.steps)} steps" if args.check_steps else "none")
               if ok else "FAILED"}
        print(f"torch {torch.__version__} {args.layout} on {n} ranks: {rec['step_ms']:.2f} ms a step (rank 0)"
              + (f", communication {rec['comm_ms']:.2f} ms" if rec["comm_ms"] is not None else "")
              + f"; losses {losses[0]:.4f} .. {losses[-1]:.4f}; check {rec['check']}")
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(rec) + "\n")
    # The all_reduce above was every rank's last collective. No barrier / destroy_process_group: after a DDP
    # run at the bench sizes torch 1.13's gloo spins in them for minutes here; exit at once instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()

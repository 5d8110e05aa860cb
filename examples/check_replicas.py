#!/usr/bin/env python3
"""The fault suite of replicas (train/replicas.hpp): 12_replicas under dtensor-run --replica-size K, a rank
SIGKILLed from outside (never simulated inside the library) while the others train, against the same
training in one process.

  check_replicas.py DTENSOR_RUN PROGRAM WORKDIR [--seeds S,S,...] [--nproc N] [--replica-size K]
                    [--max-restarts R] [--steps N] [--pace-ms M]

Per seed, a random rank is killed after a random step. The checks:
  - the launcher stopped and restarted the victim's replica only (with --max-restarts 0: it stays out, the
    others finish and the launcher exits with the victim's status);
  - the survivors were never restarted, and redid at most one step per failure;
  - every replica that finished holds the same parameters, bit for bit, and they match one process's
    training on the whole batch of every step to rounding (1e-12): no sample was lost or counted twice;
  - a restarted replica copied the state from a survivor and finished with the others.

Prints one line per injected failure (seed, rank, step, what the quorum did) and exits 1 at the first
failed check.
"""
import argparse
import array
import os
import random
import re
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_restarts import Job, fail, rank_pids  # noqa: E402


def parameters(path):
    with open(path, "rb") as f:
        return array.array("d", f.read())


def summary(path):
    with open(path + ".txt") as f:
        words = f.read().split()
    return {words[i]: int(words[i + 1]) for i in range(0, len(words) - 1, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("launcher")
    ap.add_argument("program")
    ap.add_argument("workdir")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--replica-size", type=int, default=1)
    ap.add_argument("--max-restarts", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pace-ms", type=int, default=40)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    os.chdir(a.workdir)
    replicas = a.nproc // a.replica_size
    log = open(f"replicas_{a.replica_size}_{a.max_restarts}.log", "w")

    if subprocess.run([a.program, "--reference", "--steps", str(a.steps), "--out", "reference"],
                      stdout=log, stderr=log).returncode != 0:
        fail("the reference run failed (see " + log.name + ")")
    reference = parameters("reference")

    for seed in [int(s) for s in a.seeds.split(",")]:
        rng = random.Random(seed)
        out = os.path.abspath(f"run_{seed}")
        for r in range(replicas):
            for f in (f"{out}.replica{r}", f"{out}.replica{r}.txt"):
                if os.path.exists(f):
                    os.remove(f)
        victim = rng.randrange(a.nproc)
        kill_at = rng.randrange(2, a.steps // 2)
        job = Job([a.launcher, "--standalone", "--stop-timeout", "5", "--nproc-per-node", str(a.nproc),
                   "--replica-size", str(a.replica_size), "--max-restarts", str(a.max_restarts), a.program,
                   "--steps", str(a.steps), "--pace-ms", str(a.pace_ms), "--out", out], log)
        killed = None
        deadline = time.monotonic() + 120
        while job.proc.poll() is None and time.monotonic() < deadline:
            with job.lock:
                step = job.step
            if step >= kill_at:
                pid = rank_pids(job.proc.pid, a.program).get(victim)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = step
                    break
            time.sleep(0.002)
        # How long the survivors took to commit a step after the kill (the failure seen, the quorum decided
        # without the victim or with its restart, the step redone).
        recovered_ms = None
        begin = time.monotonic()
        while killed is not None and recovered_ms is None and time.monotonic() < begin + 120:
            with job.lock:
                lines = list(job.lines)
            for line in lines:
                m = re.match(r"\[rank(\d+)\]: step (\d+)/", line)
                if m and int(m.group(1)) // a.replica_size != victim // a.replica_size and int(m.group(2)) > killed + 1:
                    recovered_ms = (time.monotonic() - begin) * 1000
                    break
            time.sleep(0.002)
        rc = job.wait(300)
        if killed is None:
            fail(f"seed {seed}: the run ended before the kill (rank {victim} after step {kill_at})")
        replica = victim // a.replica_size
        text = "".join(job.lines)
        restarts = re.findall(r"replica (\d+): restart (\d+) of", text)
        if a.max_restarts > 0:
            if rc != 0:
                fail(f"seed {seed}: the run did not survive the kill of rank {victim} (exit {rc}; see {log.name})")
            if restarts != [(str(replica), "1")]:
                fail(f"seed {seed}: expected replica {replica} restarted once and no other, saw {restarts}")
            if not re.search(r"\[rank%d\]: step \d+/\d+ .*state copied from a member" % (replica * a.replica_size),
                             text):
                fail(f"seed {seed}: the restarted replica {replica} did not copy the state from a survivor")
        else:
            if rc != 128 + signal.SIGKILL:
                fail(f"seed {seed}: with no restart the launcher should exit {128 + signal.SIGKILL}, got {rc}")
            if restarts or "the other replicas go on without it" not in text:
                fail(f"seed {seed}: the victim's replica should have stayed out ({restarts})")
        finished = [r for r in range(replicas) if os.path.exists(f"{out}.replica{r}")]
        expected = list(range(replicas)) if a.max_restarts > 0 else [r for r in range(replicas) if r != replica]
        if finished != expected:
            fail(f"seed {seed}: replicas {finished} finished, expected {expected}")
        aborted = {}
        for r in finished:
            s = summary(f"{out}.replica{r}")
            if s["steps"] != a.steps:
                fail(f"seed {seed}: replica {r} stopped at step {s['steps']} of {a.steps}")
            if r != replica and s["start"] != 0:
                fail(f"seed {seed}: surviving replica {r} was restarted (start {s['start']})")
            if r == replica and s["start"] != 1:
                fail(f"seed {seed}: replica {r} finished in start {s['start']}, expected its restart")
            if r != replica and s["aborted"] > 1:
                fail(f"seed {seed}: replica {r} redid {s['aborted']} steps for one failure")
            aborted[r] = s["aborted"]
            p = parameters(f"{out}.replica{r}")
            if p != parameters(f"{out}.replica{finished[0]}"):
                fail(f"seed {seed}: replicas {finished[0]} and {r} hold different parameters")
            err = max(abs(x - y) for x, y in zip(p, reference))
            if len(p) != len(reference) or err > 1e-12:
                fail(f"seed {seed}: replica {r}'s parameters differ from one process's by {err:.3g}")
        smallest = min(int(n) for n in re.findall(r"quorum \d+ at step \d+: (\d+) replica", text) or [replicas])
        print(f"seed {seed}: rank {victim} (replica {replica}) killed by SIGKILL after step {killed}; "
              f"the others went on (smallest quorum: {smallest} of {replicas} replicas, steps redone: "
              f"{max(aborted.values())}; a step committed {recovered_ms:.0f} ms after the kill); replica {replica} "
              f"{'restarted and rejoined with the state copied' if a.max_restarts > 0 else 'stayed out'}; "
              f"every replica's parameters equal, and one process's to {err:.1g}", flush=True)
    print("replicas: all checks passed", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The fault suite of restarts: 09_gpt under dtensor-run --max-restarts, with ranks killed by SIGKILL from
outside (never simulated inside the library), against the same run uninterrupted.

  check_restarts.py DTENSOR_RUN GPT WORKDIR MODE [--seeds S,S,...] [--nproc N] [--every K] [--steps N]
                    [--backend gloo|mpi] -- GPT_ARGS...

MODE
  kill_step  per seed: a random rank killed after a random step of the first start; the run must finish,
             its final parameters and optimizer state bit-identical to the uninterrupted run's (the files of
             --save compared byte for byte), resumed from the latest complete state, at most K steps lost
  kill_save  per seed: a random rank killed while a save is in flight (a step-<N>.tmp in the folder); the
             same checks, and the partial state is never read (the restart resumes before N)
  elastic    a random rank killed under --nproc-per-node N-1:N: the restart resumes on N-1 ranks, and
             --check (given in GPT_ARGS) compares every step with one rank within its tolerance

Prints one line per injected failure (seed, rank, step killed at, save in flight, step resumed at, steps
lost) and exits 1 at the first failed check.
"""
import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time


def fail(msg):
    print("FAILED: " + msg, flush=True)
    sys.exit(1)


def rank_pids(launcher_pid, program):
    """{rank: pid} of the launcher's descendants running `program` (its children; under mpirun, mpirun's):
    the rank from RANK, or OMPI_COMM_WORLD_RANK."""
    out = {}
    todo = [launcher_pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                children = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in children:
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if os.path.basename(program).encode() not in f.read().split(b"\0")[0]:
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                out[int(env.get(b"RANK", env.get(b"OMPI_COMM_WORLD_RANK", b"")))] = pid
            except (OSError, ValueError):
                continue
    return out


def complete_steps(folder):
    steps = []
    try:
        for name in os.listdir(folder):
            m = re.fullmatch(r"step-(\d+)", name)
            if m and (os.path.exists(os.path.join(folder, name, "index.json")) or
                      os.path.exists(os.path.join(folder, name, "parts.json"))):
                steps.append(int(m.group(1)))
    except OSError:
        pass
    return sorted(steps)


def saves_in_flight(folder):
    try:
        return [int(m.group(1)) for m in (re.fullmatch(r"step-(\d+)\.tmp", n) for n in os.listdir(folder)) if m]
    except OSError:
        return []


def same_tree(a, b):
    """The relative paths whose bytes differ (or exist on one side only)."""
    def files(root):
        out = {}
        for d, _, names in os.walk(root):
            for n in names:
                p = os.path.join(d, n)
                out[os.path.relpath(p, root)] = p
        return out
    fa, fb = files(a), files(b)
    diff = sorted(set(fa) ^ set(fb))
    for rel in set(fa) & set(fb):
        with open(fa[rel], "rb") as x, open(fb[rel], "rb") as y:
            if x.read() != y.read():
                diff.append(rel)
    return diff


class Job:
    """dtensor-run with its output read on a thread: the steps rank 0 reports, the starts, the resumes."""

    def __init__(self, argv, log):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self.step = 0        # the last "step N/M" of rank 0 in the current start
        self.start = 0       # the current start (0: the first)
        self.resumed = {}    # start -> step it resumed at
        self.log = log
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.write(line)
            with self.lock:
                self.lines.append(line)
                m = re.search(r"\[rank0\]: step +(\d+)/", line)
                if m:
                    self.step = int(m.group(1))
                m = re.search(r"\[rank0\]: checkpoint folder .*: (?:resumed at step (\d+)|no state yet).*"
                              r"\(start (\d+)\)", line)
                if m:
                    self.start = int(m.group(2))
                    self.resumed[self.start] = int(m.group(1) or 0)
                    self.step = self.resumed[self.start]

    def wait(self, limit):
        try:
            rc = self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail(f"the job did not finish within {limit} s")
        self.reader.join(timeout=10)
        return rc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("launcher")
    ap.add_argument("program")
    ap.add_argument("workdir")
    ap.add_argument("mode", choices=["kill_step", "kill_save", "elastic"])
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    gpt = argv[cut + 1:]
    os.makedirs(a.workdir, exist_ok=True)
    os.chdir(a.workdir)
    base = [a.launcher, "--stop-timeout", "5", "--backend", a.backend] + (["--standalone"] if a.backend == "gloo" else [])
    common = [a.program, "--steps", str(a.steps), "--eval-every", "1"] + gpt
    log = open(f"{a.mode}.log", "w")

    reference = os.path.abspath(f"{a.mode}_reference")
    if a.mode != "elastic":
        subprocess.run(["rm", "-rf", reference])
        ref = Job(base + ["--nproc-per-node", str(a.nproc)] + common + ["--save", reference], log)
        if ref.wait(300) != 0:
            fail("the uninterrupted run failed (see " + log.name + ")")

    for seed in [int(s) for s in a.seeds.split(",")]:
        rng = random.Random(seed)
        folder = os.path.abspath(f"{a.mode}_{seed}_folder")
        final = os.path.abspath(f"{a.mode}_{seed}_final")
        subprocess.run(["rm", "-rf", folder, final])
        victim = rng.randrange(a.nproc)
        kill_at = rng.randrange(1, a.steps - 1)  # the step after which (kill_step) or from which (kill_save)
        size = [f"{a.nproc - 1}:{a.nproc}" if a.mode == "elastic" else str(a.nproc)]
        job = Job(base + ["--nproc-per-node"] + size + ["--max-restarts", "3"] + common +
                  ["--checkpoint-dir", folder, "--save-every", str(a.every)] +
                  ([] if a.mode == "elastic" else ["--save", final]), log)
        killed = None
        deadline = time.monotonic() + 120
        while killed is None and job.proc.poll() is None and time.monotonic() < deadline:
            with job.lock:
                step, start = job.step, job.start
            in_flight = [n for n in saves_in_flight(folder) if n > 0]
            ready = start == 0 and (step >= kill_at if a.mode != "kill_save" else
                                    step >= kill_at and in_flight)
            if ready:
                pid = rank_pids(job.proc.pid, a.program).get(victim)
                if pid is not None:
                    done_before = complete_steps(folder)
                    os.kill(pid, signal.SIGKILL)
                    with job.lock:
                        step = job.step
                    killed = (step, in_flight, done_before[-1] if done_before else 0)
                    break
            time.sleep(0.0002 if a.mode == "kill_save" else 0.002)
        rc = job.wait(300)
        if killed is None:
            fail(f"seed {seed}: the run ended before the kill (rank {victim} after step {kill_at})")
        step, in_flight, latest = killed
        if rc != 0:
            fail(f"seed {seed}: the run did not survive the kill of rank {victim} (exit {rc}; see {log.name})")
        if 1 not in job.resumed:
            fail(f"seed {seed}: no restart resumed from the folder")
        resumed = job.resumed[1]
        lost = step - resumed
        print(f"seed {seed}: rank {victim} killed by SIGKILL after step {step} (save in flight: "
              f"{'step ' + str(in_flight[0]) if in_flight else 'none'}; latest complete state: step {latest}); "
              f"restarted, resumed at step {resumed}: {lost} step(s) lost", flush=True)
        if resumed < latest:
            fail(f"seed {seed}: resumed at step {resumed}, not the latest complete state (step {latest})")
        if in_flight and resumed >= in_flight[0] and in_flight[0] not in complete_steps(folder):
            fail(f"seed {seed}: resumed from the partial save of step {in_flight[0]}")
        if lost > a.every * (2 if in_flight else 1):
            fail(f"seed {seed}: {lost} steps lost with a save every {a.every}")
        if a.mode == "elastic":
            if not any("against one rank" in l for l in job.lines):
                fail(f"seed {seed}: no comparison with one rank in the resumed run (give --check)")
            if not any(re.search(r"restart 1 of 3: starting %d rank" % (a.nproc - 1), l) for l in job.lines):
                fail(f"seed {seed}: the restart did not run on {a.nproc - 1} ranks")
            continue
        diff = same_tree(reference, final)
        if diff:
            fail(f"seed {seed}: the final state differs from the uninterrupted run's in {', '.join(diff[:5])}")
        print(f"seed {seed}: the final parameters and optimizer state are bit-identical to the "
              f"uninterrupted run's", flush=True)
    print(f"{a.mode}: all checks passed", flush=True)


if __name__ == "__main__":
    main()

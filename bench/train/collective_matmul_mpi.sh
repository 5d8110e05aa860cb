#!/usr/bin/env bash
# Collective matmul on MPI: bench_train's tp and tp_cm layouts under mpirun (init_process_group picks MPI
# there), alternating pass by pass, at 2 and 4 processes and two sizes; prints the medians and writes
# bench/results/collective_matmul_train_mpi.json (step, the share of the step rank 0's training thread was
# blocked in any communication (CommWaitTimer), tp_cm / tp paired pass by pass). BENCHMARKS.md, "Collective
# matmul". The gloo rows: bench/train/train_vs_torch.sh --layouts tp,tp_cm.
#
# usage: bench/train/collective_matmul_mpi.sh [--passes K] [--out DIR]   (BUILD_DIR: default build-bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-bench}
passes=3
out=bench/results
while [[ $# -gt 0 ]]; do
  case "$1" in
  --passes) passes=$2; shift 2 ;;
  --out) out=$2; shift 2 ;;
  *) echo "collective_matmul_mpi.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTENSOR_ENABLE_CUDA=OFF
fi
cmake --build "$build" -j2 --target bench_train
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for np in 2 4; do
  for tokens in 512 2048; do
    for ((p = 1; p <= passes; ++p)); do
      order="tp tp_cm"
      ((p % 2)) || order="tp_cm tp"
      for layout in $order; do
        mpirun --oversubscribe --bind-to none -np "$np" "$build/bench/bench_train" --layout "$layout" --no-check \
          --steps 12 --tokens "$tokens" --hidden 256 --ffn 1024 --vocab 2048 \
          --json "$tmp/n${np}_${tokens}_${layout}_p$p.json" >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
      done
    done
  done
done
python3 - "$tmp" "$out" <<'PY'
import glob, json, os, statistics as st, sys, time
tmp, out = sys.argv[1], sys.argv[2]
rows = []
print("processes  tokens  tp ms   tp_cm ms  tp_cm / tp (paired)  blocked % tp / tp_cm")
for np in (2, 4):
    for tokens in (512, 2048):
        runs = {l: [json.load(open(f)) for f in sorted(glob.glob(f"{tmp}/n{np}_{tokens}_{l}_p*.json"))]
                for l in ("tp", "tp_cm")}
        med = lambda l, f: st.median(f(r) for r in runs[l])
        row = {"suite": "train", "name": f"{tokens}x256x1024x2048 tp_cm mpi", "backend": runs["tp"][0]["backend"],
               "ranks": np, "tokens": tokens, "passes": len(runs["tp"]),
               "tp_ms": med("tp", lambda r: r["step_ms"]), "tp_cm_ms": med("tp_cm", lambda r: r["step_ms"]),
               "tp_blocked_pct": med("tp", lambda r: 100 * r["blocked_ms"] / r["step_ms"]),
               "tp_cm_blocked_pct": med("tp_cm", lambda r: 100 * r["blocked_ms"] / r["step_ms"]),
               "vs_tp_paired_ratio": st.median(a["step_ms"] / b["step_ms"] for a, b in zip(runs["tp_cm"], runs["tp"])),
               "date": time.strftime("%Y-%m-%d", time.gmtime())}
        rows.append(row)
        print(f"{np:9d}  {tokens:6d}  {row['tp_ms']:6.1f}  {row['tp_cm_ms']:8.1f}  {row['vs_tp_paired_ratio']:19.2f}"
              f"  {row['tp_blocked_pct']:.0f} / {row['tp_cm_blocked_pct']:.0f}")
path = os.path.join(out, "collective_matmul_train_mpi.json")
with open(path, "w") as f:
    f.write("[\n" + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]\n")
print(f"wrote {path}")
PY

#!/usr/bin/env bash
# Does linking MPI slow a gloo run? bench_train built twice from the same sources, with MPI linked (BUILD_DIR,
# as CMake does where libopenmpi-dev is installed) and without (BUILD_DIR-nompi, configured with
# -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON), both run on gloo under dtensor-run, alternating pass by pass (the
# linked one first in odd passes). Prints the medians and the paired ratio linked / not linked per layout and
# size, and writes bench/results/train_mpi_link_probe.json. BENCHMARKS.md, "Which backend on CPUs".
#
# usage: bench/train/mpi_link_probe.sh [--passes K] [--nproc N] [--layouts L,...] [--sizes TxHxFxV,...] [--out DIR]
#   defaults: 5 passes, 4 processes, layouts tp,ddp, sizes 512x256x1024x2048,2048x256x1024x2048
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-bench}
passes=5
nproc=4
layouts=tp,ddp
sizes=512x256x1024x2048,2048x256x1024x2048
out=bench/results
while [[ $# -gt 0 ]]; do
  case "$1" in
  --passes) passes=$2; shift 2 ;;
  --nproc) nproc=$2; shift 2 ;;
  --layouts) layouts=$2; shift 2 ;;
  --sizes) sizes=$2; shift 2 ;;
  --out) out=$2; shift 2 ;;
  *) echo "mpi_link_probe.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for b in "$build" "$build-nompi"; do
  if [[ ! -f "$b/build.ninja" ]]; then
    extra=()
    [[ $b == *-nompi ]] && extra=(-DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
    cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTENSOR_ENABLE_CUDA=OFF "${extra[@]}"
  fi
  cmake --build "$b" -j2 --target dtensor-run bench_train
done
readelf -d "$build/bench/bench_train" | grep -q 'NEEDED.*libmpi' ||
  { echo "mpi_link_probe.sh: $build/bench/bench_train does not link MPI (install libopenmpi-dev)" >&2; exit 2; }
if readelf -d "$build-nompi/bench/bench_train" | grep -q 'NEEDED.*libmpi'; then
  echo "mpi_link_probe.sh: $build-nompi/bench/bench_train links MPI" >&2
  exit 2
fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
run="$build/tools/dtensor-run/dtensor-run --standalone --tee 0 --nproc-per-node $nproc"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for ((p = 1; p <= passes; ++p)); do
  echo "== pass $p of $passes"
  for size in ${sizes//,/ }; do
    IFS=x read -r t h f v <<<"$size"
    for layout in ${layouts//,/ }; do
      order="linked unlinked"
      ((p % 2)) || order="unlinked linked"
      for which in $order; do
        dir=$build
        [[ $which == unlinked ]] && dir=$build-nompi
        $run "$dir/bench/bench_train" --layout "$layout" --no-check --steps 12 --tokens "$t" --hidden "$h" \
          --ffn "$f" --vocab "$v" --json "$tmp/${which}_${size}_${layout}_p$p.json" >"$tmp/log" 2>&1 ||
          { cat "$tmp/log"; exit 1; }
      done
    done
  done
done
python3 - "$tmp" "$out" "$nproc" "$layouts" "$sizes" <<'PY'
import glob, json, os, statistics as st, sys, time
tmp, out, nproc, layouts, sizes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
rows = []
print(f"gloo, {nproc} processes: bench_train with MPI linked vs the same sources without (ms: rank 0's mean step)")
print("size                  layout  linked ms  not linked ms  linked / not linked (paired)  [min-max]")
for size in sizes.split(","):
    for layout in layouts.split(","):
        runs = {w: [json.load(open(f)) for f in sorted(glob.glob(f"{tmp}/{w}_{size}_{layout}_p*.json"))]
                for w in ("linked", "unlinked")}
        assert all(r["backend"] == "gloo" for w in runs for r in runs[w])
        ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(runs["linked"], runs["unlinked"])]
        row = {"suite": "train", "name": f"{size} {layout} gloo, MPI linked / not linked", "layout": layout,
               "backend": "gloo", "ranks": nproc, "passes": len(ratios),
               "linked_ms": st.median(r["step_ms"] for r in runs["linked"]),
               "unlinked_ms": st.median(r["step_ms"] for r in runs["unlinked"]),
               "paired_ratio": st.median(ratios), "paired_ratio_min": min(ratios), "paired_ratio_max": max(ratios),
               "date": time.strftime("%Y-%m-%d", time.gmtime())}
        rows.append(row)
        print(f"{size:20s}  {layout:6s}  {row['linked_ms']:9.1f}  {row['unlinked_ms']:13.1f}  "
              f"{row['paired_ratio']:28.3f}  [{min(ratios):.3f}-{max(ratios):.3f}]")
path = os.path.join(out, "train_mpi_link_probe.json")
with open(path, "w") as f:
    f.write("[\n" + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]\n")
print(f"wrote {path}")
PY

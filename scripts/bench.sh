#!/usr/bin/env bash
# Runs the CPU benchmarks (BENCHMARKS.md) and writes their JSON under bench/results/:
#   1. collectives sweep on gloo, 2 and 4 processes (ours vs raw gloo), then the same sweep through
#      torch.distributed (Debian's python3-torch, if installed) and the join (ours/torch);
#   1b. collectives sweep on MPI, 2 and 4 processes under mpirun (ours vs raw MPI blocking and non-blocking
#      calls vs dtensor's gloo backend, in the same processes), when the MPI backend is built;
#   2. redistribution suite at 2, 4 (1-D, 2-D, uneven variable vs padded) and 8 processes (3-D); on MPI at
#      4 processes;
#   3. TP MLP forward on 4 processes, ours vs torch.mm + dist.all_reduce (bench/mlp/mlp_vs_torch.sh; ours
#      alone without python3-torch);
#   3b. the training step of examples/06_train.cpp per layout on 4 processes, ours vs torch (hand-written
#      Megatron TP + SP, DDP), with the time split, FSDP's prefetch on vs off and the heap per rank
#      (bench/train/train_vs_torch.sh);
#   4. host overhead per call (one process);
#   5. transformer ops, the pipeline bubble, local GEMM and attention (one process); 5b. context parallelism
#      at 4 processes on gloo and MPI (all-gather k/v, Ulysses, ring, ring zigzag; about 5 minutes each);
#   6. compile cost (bench/compile/compile_time.sh).
# About 27-30 minutes on the 2-core dev machine (3b takes about 9, 5b about 10).
#
# usage: scripts/bench.sh [--quick]     (--quick: half the samples, sweeps up to 1 MiB, one pass, 1 compile rep)
#   BUILD_DIR (default build-bench) is configured and built here if needed (Release, no CUDA language).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-bench}
scale=1
max_bytes=$((16 << 20))
compile_reps=3
passes=3 # the collectives sweeps run 3 times over; a row is the median of its 3 pass medians
if [[ "${1:-}" == "--quick" ]]; then
  scale=0.5
  max_bytes=$((1 << 20))
  compile_reps=1
  passes=1
fi

if [[ ! -f "$build/build.ninja" && ! -f "$build/Makefile" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTENSOR_ENABLE_CUDA=OFF
fi
cmake --build "$build" -j2 --target dtensor-run bench_collectives bench_redistribution bench_overhead bench_mlp bench_train bench_loss bench_pipeline bench_gemm bench_attention bench_cp
have_mpi=0
if cmake --build "$build" -j2 --target bench_collectives_mpi >/dev/null 2>&1 && command -v mpirun >/dev/null; then
  have_mpi=1
fi
# OpenMPI refuses root without these, and more processes than cores without oversubscription.
mpirun=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 mpirun)
run="$build/tools/dtensor-run/dtensor-run --standalone --tee 0"
mkdir -p bench/results
common=(--scale "$scale" --out bench/results)
start=$SECONDS

echo "== machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(uname -r), $(date -u +%Y-%m-%dT%H:%MZ)"
torch_py=/usr/bin/python3
have_torch=0
if "$torch_py" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
  have_torch=1
else
  echo "(python3-torch not installed: skipping the torch.distributed sweep; apt-get install -y python3-torch)"
fi

echo "== 1. collectives (gloo)"
for n in 2 4; do
  $run --nproc-per-node "$n" "$build/bench/bench_collectives" "${common[@]}" --max-bytes "$max_bytes" \
    --passes "$passes"
  if [[ $have_torch == 1 ]]; then
    $run --rank0-store --nproc-per-node "$n" "$torch_py" bench/collectives/torch_sweep.py \
      --scale "$scale" --out bench/results --max-bytes "$max_bytes" --passes "$passes" 2>&1 | grep -v Warning || true
  fi
done
if [[ $have_torch == 1 ]]; then
  "$torch_py" bench/collectives/join.py --dir bench/results 2 4
fi

echo "== 1b. collectives (MPI)"
if [[ $have_mpi == 1 ]]; then
  for n in 2 4; do
    "${mpirun[@]}" -np "$n" "$build/bench/bench_collectives_mpi" "${common[@]}" --max-bytes "$max_bytes" \
      --passes "$passes"
  done
else
  echo "(the MPI backend is not built: skipping; apt-get install -y libopenmpi-dev openmpi-bin)"
fi

echo "== 2. redistribution (gloo; MPI)"
for n in 2 4 8; do
  $run --nproc-per-node "$n" "$build/bench/bench_redistribution" "${common[@]}"
done
if [[ $have_mpi == 1 ]]; then
  "${mpirun[@]}" -np 4 "$build/bench/bench_redistribution" "${common[@]}" --backend mpi
fi

echo "== 3. TP MLP forward (gloo, 4 processes, 1 thread each), ours vs torch"
BUILD_DIR="$build" bench/mlp/mlp_vs_torch.sh --passes "$passes" --scale "$scale"

echo "== 3b. training step per layout (gloo, 4 processes, 1 thread each), ours vs torch"
if [[ "${1:-}" == "--quick" ]]; then
  BUILD_DIR="$build" bench/train/train_vs_torch.sh --passes 1 --sizes 512x256x1024x2048
else
  BUILD_DIR="$build" bench/train/train_vs_torch.sh --passes "$passes"
fi

echo "== 4. host overhead"
env -u RANK -u WORLD_SIZE -u LOCAL_RANK "$build/bench/bench_overhead" "${common[@]}"

echo "== 5. transformer and parallel layers: loss_parallel vs gather + local loss, the pipeline bubble, local GEMM, attention"
env -u RANK -u WORLD_SIZE -u LOCAL_RANK "$build/bench/bench_loss" "${common[@]}"
env -u RANK -u WORLD_SIZE -u LOCAL_RANK "$build/bench/bench_pipeline" "${common[@]}"
env -u RANK -u WORLD_SIZE -u LOCAL_RANK "$build/bench/bench_gemm" "${common[@]}"
OPENBLAS_NUM_THREADS=1 env -u RANK -u WORLD_SIZE -u LOCAL_RANK "$build/bench/bench_attention" "${common[@]}"
if [[ $have_torch == 1 ]]; then # torch 1.13's own softmax(q k^T) v at the same shapes
  OPENBLAS_NUM_THREADS=1 "$torch_py" bench/ops/torch_attention.py --out bench/results 2>&1 | grep -v Warning || true
fi

echo "== 5b. context parallelism (causal attention, 4 processes, 1 thread each: gloo, then MPI)"
OPENBLAS_NUM_THREADS=1 $run --nproc-per-node 4 "$build/bench/bench_cp" "${common[@]}"
if [[ $have_mpi == 1 ]]; then
  OPENBLAS_NUM_THREADS=1 "${mpirun[@]}" -np 4 "$build/bench/bench_cp" "${common[@]}" --backend mpi
fi

echo "== 6. compile cost"
bench/compile/compile_time.sh "$compile_reps"

echo "== done in $((SECONDS - start)) s; results in bench/results/"

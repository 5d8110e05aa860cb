#!/usr/bin/env bash
# The training step of examples/06_train.cpp's model per layout, ours (bench_train: the library's trainers, heap counted)
# next to torch 1.13 training the same model (bench/train/torch_train.py: hand-written Megatron TP + SP, and
# torch DDP), fp32, N processes of 1 thread. K passes; in each, for every size and layout, one launch of ours
# per backend and, for tp and ddp, one of torch, the order rotated pass by pass (each launch goes first in
# turn) so a drift of the machine hits all. bench/train/join.py prints the table and writes
# bench/results/train_vs_torch_n<N>.json.
# Without python3-torch, ours runs alone (no ratio).
#
# usage: bench/train/train_vs_torch.sh [--model mlp|gpt] [--passes K] [--nproc N] [--steps S]
#                                      [--sizes TxHxFxV,...] [--layouts L,...] [--backends B,...]
#                                      [--markdown] [--out DIR]
#   --backends: ours on gloo (under dtensor-run) and/or MPI (under mpirun, where bench_train links MPI:
#   init_process_group's "auto" picks it there); the default: both where MPI exists, else gloo. Each is a
#   launch of its own in every pass, in the rotation with torch's.
#   --model gpt: the GPT of examples/09_gpt.cpp (bench_train --model gpt, torch_train.py --model gpt: causal
#   GQA attention with RoPE, SwiGLU), results in train_vs_torch_gpt_n<N>.json.
#   --layouts: a subset of tp,tp_cm,ddp,fsdp,hsdp,fsdp_tp (the default: all; tp_cm is tp with
#   nn::CollectiveMatmul, compared with tp and with torch's tp run of the same pass).
#   defaults: 3 passes, 4 processes, 12 steps (step 1 warms up; steps 2, 7, 12 run with overlap off and
#   measure the whole communication; the others the step and its exposed part), sizes
#   512x256x1024x2048,2048x256x1024x2048 (tokens x hidden x ffn x vocab; the second has 4x the compute of the
#   first for the same parameters), DIR bench/results. BUILD_DIR (default build-bench) is configured as
#   scripts/bench.sh does if needed, and bench_train and dtensor-run are built in it.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-bench}
passes=3
nproc=4
steps=12
sizes=512x256x1024x2048,2048x256x1024x2048
out=bench/results
join_args=()
model=mlp
layouts=tp,tp_cm,ddp,fsdp,hsdp,fsdp_tp
backends=
while [[ $# -gt 0 ]]; do
  case "$1" in
  --model) model=$2; shift 2 ;;
  --passes) passes=$2; shift 2 ;;
  --nproc) nproc=$2; shift 2 ;;
  --steps) steps=$2; shift 2 ;;
  --sizes) sizes=$2; shift 2 ;;
  --layouts) layouts=$2; shift 2 ;;
  --backends) backends=$2; shift 2 ;;
  --markdown) join_args+=(--markdown); shift ;;
  --out) out=$2; shift 2 ;;
  *) echo "train_vs_torch.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [[ ! -f "$build/build.ninja" && ! -f "$build/Makefile" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTENSOR_ENABLE_CUDA=OFF
fi
cmake --build "$build" -j2 --target dtensor-run bench_train
run="$build/tools/dtensor-run/dtensor-run --standalone --tee 0 --nproc-per-node $nproc"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
have_mpi=0
if command -v mpirun >/dev/null && readelf -d "$build/bench/bench_train" | grep -q 'NEEDED.*libmpi'; then
  have_mpi=1
fi
if [[ -z $backends ]]; then
  backends=gloo
  ((have_mpi)) && backends=gloo,mpi
fi
if [[ ,$backends, == *,mpi,* ]] && ((!have_mpi)); then
  echo "train_vs_torch.sh: --backends mpi needs mpirun and bench_train built with MPI (libopenmpi-dev)" >&2
  exit 2
fi
# Open MPI as root (containers), and more processes than cores without asking
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mpi_run="mpirun --bind-to none -np $nproc"

torch_py=/usr/bin/python3
have_torch=0
if "$torch_py" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
  have_torch=1
else
  echo "(python3-torch not installed: ours only; apt-get install -y python3-torch)"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dirs=()
for ((p = 1; p <= passes; ++p)); do
  d="$tmp/pass$p"
  mkdir -p "$d"
  dirs+=("$d")
  echo "== pass $p of $passes ($nproc processes, 1 thread each)"
  for size in ${sizes//,/ }; do
    IFS=x read -r t h f v <<<"$size"
    flags=(--model "$model" --steps "$steps" --tokens "$t" --hidden "$h" --ffn "$f" --vocab "$v")
    for layout in ${layouts//,/ }; do
      # ours on one backend: gloo under dtensor-run, MPI under mpirun (results ours_* and mpi_*)
      ours() {
        local launch=$run file=ours
        [[ $1 == mpi ]] && launch=$mpi_run file=mpi
        $launch "$build/bench/bench_train" --layout "$layout" --no-check "${flags[@]}" \
          --json "$d/${file}_${size}_${layout}.json" | grep -E "time per step|page faults|heap|MISMATCH"
      }
      theirs() {
        $run --rank0-store "$torch_py" bench/train/torch_train.py --layout "$layout" "${flags[@]}" \
          --json "$d/torch_${size}_${layout}.json"
      }
      echo "-- $size $layout"
      # the launches of this pass, rotated by one each pass so that each goes first in turn
      runs=()
      for b in ${backends//,/ }; do runs+=("ours $b"); done
      [[ $have_torch == 1 && ($layout == tp || $layout == ddp) ]] && runs+=(theirs)
      for ((i = 0; i < ${#runs[@]}; ++i)); do
        echo "   ${runs[(i + p - 1) % ${#runs[@]}]}"
        ${runs[(i + p - 1) % ${#runs[@]}]}
      done
    done
  done
done
mkdir -p "$out"
name=train_vs_torch
[[ $model == mlp ]] || name=train_vs_torch_$model
"$torch_py" bench/train/join.py --ranks "$nproc" --out "$out" --name "$name" "${join_args[@]}" "${dirs[@]}"

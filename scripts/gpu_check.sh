#!/usr/bin/env bash
# gpu_check.sh: on a machine with a GPU (the H200 test machine: CUDA 13, NCCL from the nvidia-nccl-cu13
# Python package, CMake, ninja; no gloo, no Catch2, no apt, no network), configure and build dtensor with
# CUDA + NCCL, run every NCCL test on one-rank communicators and every CUDA test binary, then the
# collective suite as 2 and 4 processes on the one GPU (each process its own NCCL_HOSTID, NCCL_IB_DISABLE=1,
# NCCL_SOCKET_IFNAME=lo); then examples/06_train.cpp's CUDA build (example_06_train_cuda: the model trained
# on device tensors with cuBLAS, the library's kernels and NCCL) in each of its five layouts as 2 processes,
# 3 steps in float, each checked against one rank and its collectives pinned; then the GPU benchmarks
# (BENCHMARKS.md, "GPU"), small sizes and few samples: the NCCL sweep (ours vs raw NCCL calls in the same
# run) on a one-rank communicator and as 2 processes, the redistribution suite on CUDA tensors as 1 and 2
# processes, and the same suite through torch.distributed.tensor (skipped with a note when torch or its
# DTensor module is missing); and print a pass/fail table last. Finishes in under 6 minutes: steps that would start past the budget are reported
# as "not run", and no step's timeout reaches past the budget.
#
#   scripts/gpu_prepare.sh                  # first, on a CPU machine: gathers build-gpu-deps/
#   scripts/gpu_check.sh [DEPS_DIR]         # then, on the GPU machine, from the repository root
#
# Environment: DTENSOR_GPU_DEPS (the deps folder, default build-gpu-deps), DTENSOR_GPU_BUILD (build folder,
# default build-gpu), NCCL_ROOT (NCCL's prefix; default: the nvidia.nccl Python package, else
# /usr/local/cuda), CUDACXX (nvcc), DTENSOR_GPU_BUDGET_S (default 330), DTENSOR_GPU_PYTHON (the Python with
# torch, default python3). When $OUT is set (the device tool), three files are copied there: the table
# (gpu_check_table.txt), a tarball of the logs (gpu_check_logs.tar.gz) and one of the benchmarks' JSON
# results in the bench/results schema (gpu_check_bench.tar.gz). Exit status: 0 when nothing failed. On a
# machine where nvidia-smi lists a GPU, a GPU step that exits 77 (skipped) counts as a failure: there it
# must run. `scripts/gpu_check.sh --self-test` checks that policy and the step bookkeeping (no GPU needed).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
start=$(date +%s)
budget=${DTENSOR_GPU_BUDGET_S:-330}
deps=${1:-${DTENSOR_GPU_DEPS:-build-gpu-deps}}
case "$deps" in /*) ;; *) deps="$root/$deps" ;; esac
build=${DTENSOR_GPU_BUILD:-build-gpu}
case "$build" in /*) ;; *) build="$root/$build" ;; esac
logs="$build/gpu_check_logs"
results="$build/gpu_check_results" # the benchmarks' JSON (their --out)
rm -rf "$logs" "$results"
mkdir -p "$logs" "$results"
jobs=$(nproc 2>/dev/null || echo 4)

# A GPU is there when nvidia-smi lists one (DTENSOR_GPU_CHECK_ASSUME_GPU=0/1 overrides, for the self-test).
gpu_present=0
if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  gpu_present=1
fi
gpu_present=${DTENSOR_GPU_CHECK_ASSUME_GPU:-$gpu_present}

names=()
states=()
times=()
notes=()
failed=0

elapsed() { echo $(( $(date +%s) - start )); }
record() { # name state seconds note
  names+=("$1"); states+=("$2"); times+=("$3"); notes+=("$4")
  [ "$2" = FAIL ] && failed=1
  printf 'gpu_check: %-44s %-8s %4ss  %s\n' "$1" "$2" "$3" "$4"
}

# step NAME TIMEOUT_S NEEDED_S command...: runs the command with a timeout, logs to $logs/NAME.log.
# Exit 77 counts as SKIP. Not started when fewer than NEEDED_S seconds of the budget are left; the timeout
# is cut to what is left of the budget, so the script ends within the budget (+10 s of kill grace).
step() {
  local name=$1 limit=$2 needed=$3
  shift 3
  local file="$logs/$(printf '%s' "$name" | tr -c 'A-Za-z0-9_.-' '_').log"
  step_log=$file
  local left=$(( budget - $(elapsed) ))
  if [ "$left" -lt "$needed" ]; then
    record "$name" "NOT RUN" 0 "time budget (${budget}s) used up"
    return 1
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$file" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local hint=""
  if grep -q "Duplicate GPU" "$file" 2>/dev/null; then
    hint="; several ranks on one GPU need NCCL_HOSTID set per process"
  fi
  case $rc in
    0) record "$name" PASS "$dt" "" ;;
    77) if [ "$gpu_present" = 1 ]; then
          record "$name" FAIL "$dt" "skipped on a machine with a GPU: $(grep -m1 -i 'skip' "$file" | cut -c1-60)"
        else
          record "$name" SKIP "$dt" "$(grep -m1 -i 'skip' "$file" | cut -c1-60)"
        fi ;;
    124|137) record "$name" FAIL "$dt" "timed out after ${limit}s (log: ${file#$root/})$hint"
             tail -n 25 "$file" | sed 's/^/    | /' ;;
    *) record "$name" FAIL "$dt" "exit $rc (log: ${file#$root/})$hint"
       tail -n 25 "$file" | sed 's/^/    | /' ;;
  esac
  return $rc
}

print_table() {
  echo
  echo "==================================== gpu_check ===================================="
  printf '%-46s %-8s %6s  %s\n' "step" "result" "time" "note"
  printf '%-46s %-8s %6s  %s\n' "----" "------" "----" "----"
  local i
  for i in "${!names[@]}"; do
    printf '%-46s %-8s %5ss  %s\n' "${names[$i]}" "${states[$i]}" "${times[$i]}" "${notes[$i]}"
  done
  echo "-----------------------------------------------------------------------------------"
  echo "total $(elapsed)s; $( [ $failed = 0 ] && echo 'no failures' || echo 'FAILURES (logs in '"${logs#$root/}"')')"
}

have_results() { ls "$results"/*.json >/dev/null 2>&1; }

# One line per benchmark result file (the rows are in the bench tarball), printed before the table.
bench_summary() {
  timeout 10 "${DTENSOR_GPU_PYTHON:-python3}" - "$results" <<'PY' 2>&1 | head -n 20 | tee "$logs/bench_summary.txt"
import glob, json, os, statistics, sys

def med(v):
    v = [x for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return "%.3g" % statistics.median(v) if v else "-"

for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    name = os.path.basename(path)
    try:
        rows = json.load(open(path))
    except Exception as e:
        print("%s: unreadable (%s)" % (name, e))
        continue
    if name.startswith("collectives_nccl"):
        top = max((r["bytes"] for r in rows), default=0)
        print("%s: %d rows; ours/raw NCCL median %s (%s at the largest size)" % (
            name, len(rows), med([r.get("ratio") for r in rows]),
            med([r.get("ratio") for r in rows if r["bytes"] == top])))
    elif name.startswith("redistribution_vs_torch"):
        print("%s: %d cases, %d rejected by torch; median ours/torch: time %s, host %s (host us: ours %s, "
              "torch %s)" % (name, len(rows), sum(1 for r in rows if r.get("torch_error")),
                             med([r.get("ratio") for r in rows]), med([r.get("host_ratio") for r in rows]),
                             med([r.get("ours_host_us") for r in rows]), med([r.get("ref_host_us") for r in rows])))
    else:
        red = [r for r in rows if r.get("suite") == "redistribution"]
        print("%s: %d rows; redistribution median time %s us, host %s us; uneven variable/padded median %s" % (
            name, len(rows), med([r.get("ours_us") for r in red]), med([r.get("host_us") for r in red]),
            med([r.get("ratio") for r in rows if r.get("suite") == "uneven"])))
PY
}

finish() {
  local table
  if have_results; then
    echo
    echo "benchmarks (JSON in ${results#$root/}):"
    bench_summary
  fi
  table=$(print_table)
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    echo "$table" >"$OUT/gpu_check_table.txt"
    tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$build" gpu_check_logs 2>/dev/null || true
    if have_results; then
      tar -czf "$OUT/gpu_check_bench.tar.gz" -C "$build" gpu_check_results 2>/dev/null || true
    fi
  fi
  echo "$table"
  exit $failed
}

# ---- self-test: the step policy, without a GPU ------------------------------------------------------
if [ "${1:-}" = "--self-test" ]; then
  expect() { # expect NAME STATE
    local i=$(( ${#names[@]} - 1 ))
    if [ "${states[$i]}" != "$2" ]; then
      echo "gpu_check self-test: $1 gave ${states[$i]}, expected $2"
      exit 1
    fi
  }
  gpu_present=1
  step "skip with a GPU" 10 0 bash -c 'echo skipped; exit 77'; expect "exit 77 with a GPU" FAIL
  gpu_present=0
  step "skip without a GPU" 10 0 bash -c 'echo skipped; exit 77'; expect "exit 77 without a GPU" SKIP
  step "pass" 10 0 true; expect "exit 0" PASS
  step "fail" 10 0 bash -c 'echo "NCCL WARN Duplicate GPU detected"; exit 1'; expect "exit 1" FAIL
  case "${notes[$(( ${#notes[@]} - 1 ))]}" in *NCCL_HOSTID*) ;; *) echo "gpu_check self-test: no NCCL_HOSTID hint"; exit 1 ;; esac
  step "time out" 1 0 sleep 5; expect "a step past its limit" FAIL
  budget=0
  step "past the budget" 10 5 true; expect "a step past the budget" "NOT RUN"
  echo "gpu_check self-test: passed"
  exit 0
fi

# ---- 0. the machine ---------------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
  nvidia-smi --query-gpu=index,name,compute_mode,mig.mode.current,memory.used --format=csv 2>&1 || true
  echo "GPU present: $gpu_present (a skipped GPU step counts as a failure when 1)"
  echo "c++: $(c++ --version 2>&1 | head -1)"
  echo "cmake: $(cmake --version | head -1); ninja: $(ninja --version 2>&1)"
} | tee "$logs/machine.log"

nvcc=${CUDACXX:-}
[ -z "$nvcc" ] && nvcc=$(command -v nvcc || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc" ]; then
  record "find nvcc" FAIL 0 "no nvcc (set CUDACXX)"
  finish
fi
echo "nvcc: $nvcc ($("$nvcc" --version | tail -1))" | tee -a "$logs/machine.log"

nccl=${NCCL_ROOT:-}
if [ -z "$nccl" ]; then
  nccl=$(python3 -c 'import nvidia.nccl as m, os; print(list(m.__path__)[0])' 2>/dev/null || true)
fi
if [ -z "$nccl" ] || [ ! -f "$nccl/include/nccl.h" ]; then
  found=$(python3 - <<'EOF' 2>/dev/null
import site, glob
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for h in glob.glob(d + "/nvidia/**/include/nccl.h", recursive=True):
        print(h.rsplit("/include/", 1)[0]); raise SystemExit
EOF
)
  [ -n "$found" ] && nccl=$found
fi
[ -z "$nccl" ] || [ ! -f "$nccl/include/nccl.h" ] && nccl=/usr/local/cuda
if [ ! -f "$nccl/include/nccl.h" ]; then
  record "find NCCL" FAIL 0 "no nccl.h (pip nvidia-nccl-cu13, or set NCCL_ROOT)"
  finish
fi
ncclver=$(grep -E '^#define NCCL_(MAJOR|MINOR|PATCH) ' "$nccl/include/nccl.h" | awk '{print $3}' | paste -sd.)
ncclib=$(ls "$nccl"/lib/libnccl.so* 2>/dev/null | head -1)
if [ -n "$ncclib" ] && [ ! -e "$nccl/lib/libnccl.so" ]; then
  # The wheel ships only libnccl.so.2; give the linker the unversioned name in our build folder.
  mkdir -p "$build/nccl-link/lib" "$build/nccl-link/include"
  ln -sf "$ncclib" "$build/nccl-link/lib/libnccl.so"
  ln -sf "$nccl/include/nccl.h" "$build/nccl-link/include/nccl.h"
  [ -f "$nccl/include/nccl_net.h" ] && ln -sf "$nccl/include/nccl_net.h" "$build/nccl-link/include/"
  nccl_cmake_root="$build/nccl-link"
else
  nccl_cmake_root="$nccl"
fi
export LD_LIBRARY_PATH="$nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "NCCL $ncclver at $nccl" | tee -a "$logs/machine.log"

# ---- 1. what the deps folder brings -------------------------------------------------------------------
cmake_args=()
if [ -f "$deps/catch2/src/catch_main.cpp" ]; then
  if [ ! -f "$deps/catch2/lib/libCatch2WithMain.a" ]; then
    step "compile Catch2's main" 120 60 bash -c "
      c++ -std=c++17 -O1 -I'$deps/catch2/include' -c '$deps/catch2/src/catch_main.cpp' -o '$build/catch_main.o' &&
      ar rcs '$deps/catch2/lib/libCatch2WithMain.a' '$build/catch_main.o'"
  fi
  cmake_args+=("-DCatch2_DIR=$deps/catch2/lib/cmake/Catch2")
elif ! ls /usr/lib/cmake/Catch2/Catch2Config.cmake /usr/local/lib/cmake/Catch2/Catch2Config.cmake >/dev/null 2>&1; then
  record "deps folder" FAIL 0 "no $deps: run scripts/gpu_prepare.sh on a CPU machine, copy it here"
  finish
fi
if [ -f "$deps/gloo/probe.cpp" ] &&
   step "gloo probe (optional)" 60 30 bash -c "
     c++ -std=c++17 '$deps/gloo/probe.cpp' -I'$deps/gloo/include' -L'$deps/gloo/lib' -lgloo \
         -Wl,-rpath,'$deps/gloo/lib' -Wl,-rpath-link,'$deps/gloo/lib' -pthread -o '$build/gloo_probe' &&
     '$build/gloo_probe'"; then
  cmake_args+=("-DGloo_DIR=$deps/gloo/lib/cmake/Gloo")
else
  cmake_args+=("-DCMAKE_DISABLE_FIND_PACKAGE_Gloo=ON")
fi
# OpenBLAS: the host GEMMs of dtensor::blas, which example_06_train_cuda links (its host GEMMs are compiled
# next to the cuBLAS ones). Used when the folder brings it and a probe links and runs here; its libraries
# (libgfortran: found through LD_LIBRARY_PATH by CMake's link checks and by the programs) join the path.
blas_lib="$deps/openblas/lib"
if [ -f "$deps/openblas/probe.cpp" ] &&
   step "OpenBLAS probe (optional)" 60 20 env LD_LIBRARY_PATH="$blas_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
     bash -c "c++ -std=c++17 '$deps/openblas/probe.cpp' -I'$deps/openblas/include' -L'$blas_lib' -lopenblas \
                  -Wl,-rpath-link,'$blas_lib' -o '$build/openblas_probe' && '$build/openblas_probe'"; then
  export LD_LIBRARY_PATH="$blas_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  cmake_args+=("-DBLAS_openblas_LIBRARY=$blas_lib/libopenblas.so" "-DCBLAS_INCLUDE_DIR=$deps/openblas/include")
fi

if [ -f "$deps/random123/include/Random123/philox.h" ]; then # rand, randn, dropout (tests/ops/test_random*)
  cmake_args+=("-DDTENSOR_RANDOM123_INCLUDE_DIR=$deps/random123/include")
fi
if [ -f "$deps/dlpack/include/dlpack/dlpack.h" ]; then # to_dlpack, from_dlpack (tests/core/test_dlpack*)
  cmake_args+=("-DDTENSOR_DLPACK_INCLUDE_DIR=$deps/dlpack/include")
fi

# ---- 2. configure and build -------------------------------------------------------------------------
step "configure (CUDA + NCCL)" 120 60 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 -DNCCL_ROOT="$nccl_cmake_root" \
  -DDTENSOR_BUILD_EXAMPLES=ON -DDTENSOR_BUILD_BENCH=ON "${cmake_args[@]}" || finish
if ! grep -q "NCCL ON" "$logs/configure__CUDA___NCCL_.log"; then
  record "NCCL found by CMake" FAIL 0 "$(grep -m1 'dtensor: CUDA' "$logs/configure__CUDA___NCCL_.log")"
  finish
fi
# Every CUDA translation unit's test target (tests/*/*.cu), plus the launcher, the NCCL suite, the CUDA
# build of the training example (example_06_train_cuda) and the GPU benchmarks (bench_nccl,
# bench_redistribution_cuda), in one build.
all_targets=$(ninja -C "$build" -t targets all 2>/dev/null)
cuda_targets=$(echo "$all_targets" | grep -o 'CMakeFiles/[A-Za-z0-9_.-]*\.dir/[^:]*\.cu\.o' |
               sed 's|CMakeFiles/\([^/]*\)\.dir/.*|\1|' | grep -Ev '^(bench|example)_' | sort -u)
bench_targets=""
for t in bench_nccl bench_redistribution_cuda; do
  echo "$all_targets" | grep -q "^$t: phony" && bench_targets="$bench_targets $t"
done
example_targets=""
echo "$all_targets" | grep -q "^example_06_train_cuda: phony" && example_targets="example_06_train_cuda"
# -k 0: a benchmark or example that fails to compile costs only its own steps ("not built"); the tests
# still run.
step "build ($(echo $cuda_targets | wc -w) CUDA tests, dtensor-run, $(echo $example_targets $bench_targets | wc -w) examples+benches)" \
  270 120 cmake --build "$build" -j "$jobs" --target dtensor-run $cuda_targets $example_targets $bench_targets -- -k 0
build_rc=$?
build_log=$step_log
if [ "$build_rc" != 0 ]; then
  # Go on only when the build ran to its end and every failed output is a benchmark's or an example's.
  case $build_rc in 1) ;; *) finish ;; esac
  grep -q '^FAILED: ' "$build_log" || finish
  grep '^FAILED: ' "$build_log" | grep -Eqv '^FAILED: (\[code=[0-9]+\] )?(bench|examples)/' && finish
fi
bench_failed() { grep -Eq "^FAILED: (\[code=[0-9]+\] )?bench/(CMakeFiles/$1\.dir/|$1 *\$)" "$build_log"; }
example_failed() { grep -Eq "^FAILED: (\[code=[0-9]+\] )?examples/(CMakeFiles/$1\.dir/|$1 *\$)" "$build_log"; }
built() { # built BINARY NAME: true when the program was built, else records NAME as FAIL "not built"
  [ -n "$1" ] && return 0
  record "$2" FAIL 0 "not built"
  return 1
}

exe() { find "$build" -type f -name "$1" -perm -u+x | head -1; }
suite=$(exe nccl_suite)
run=$(exe dtensor-run)

# ---- 3. one process: NCCL on one-rank communicators, CUDA tests ---------------------------------------
step "nccl_suite, one-rank communicators" 90 20 "$suite"
for t in $cuda_targets; do
  [ "$t" = nccl_suite ] && continue
  bin=$(exe "$t")
  [ -n "$bin" ] && step "$t" 120 20 "$bin"
done

# ---- 4. several processes on the one GPU --------------------------------------------------------------
export NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo DTENSOR_TEST_HOSTID_PER_RANK=1 DTENSOR_TIMEOUT=90
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
step "nccl_suite, 2 processes" 120 40 "$run" --standalone --nproc-per-node 2 --stop-timeout 5 "$suite"
step "nccl_suite, 4 processes" 150 60 "$run" --standalone --nproc-per-node 4 --stop-timeout 5 "$suite"
step "nccl watchdog timeout, 2 processes" 60 30 "$run" --standalone --nproc-per-node 2 --stop-timeout 5 "$suite" timeout
step "nccl count mismatch named, 2 processes" 60 30 "$run" --standalone --nproc-per-node 2 --stop-timeout 5 "$suite" mismatch
step "nccl_suite, 2 processes, nonblocking" 120 40 env DTENSOR_NCCL_NONBLOCKING=1 \
  "$run" --standalone --nproc-per-node 2 --stop-timeout 5 "$suite"
step "nccl watchdog timeout, nonblocking" 60 30 env DTENSOR_NCCL_NONBLOCKING=1 \
  "$run" --standalone --nproc-per-node 2 --stop-timeout 5 "$suite" timeout

# ---- 4b. training on the GPU: example_06_train_cuda, every layout, 2 processes ---------------------------
# The model of examples/06_train.cpp on device tensors (cuBLAS, the library's CUDA kernels, NCCL), 3 steps
# in float with sizes no mesh axis divides; each run checks every loss and the final parameters against
# the same training on one rank (1e-5) and each step's collectives against the layout's, and exits 1
# otherwise. Meshes for 2 ranks: tp (1,1,2), ddp and fsdp (1,2,1), hsdp (2,1,1), fsdp_tp (1,1,2).
if [ -n "$example_targets" ]; then
  train=$(example_failed example_06_train_cuda || exe example_06_train_cuda)
  for layout in tp ddp fsdp hsdp fsdp_tp; do
    name="06_train_cuda --layout $layout, 2 processes"
    built "$train" "$name" && step "$name" 45 15 "$run" --standalone --nproc-per-node 2 --stop-timeout 5 \
      "$train" --layout "$layout" --dtype float --hidden 30 --ffn 42 --vocab 61 --steps 3
  done
else
  record "06_train_cuda (every layout)" FAIL 0 "not configured: needs the BLAS and Random123 (deps folder)"
fi

# ---- 5. benchmarks (BENCHMARKS.md, "GPU"): small sizes, few samples, JSON into $results ------------------
# One rank first (ours, then torch, whose rows join ours of the same rank count), then 2 processes.
bnccl=$(bench_failed bench_nccl || exe bench_nccl)
bred=$(bench_failed bench_redistribution_cuda || exe bench_redistribution_cuda)
torch_bench="$root/bench/redistribution/torch_dtensor_bench.py"
py=${DTENSOR_GPU_PYTHON:-python3}
multi=("$run" --standalone --nproc-per-node 2 --stop-timeout 5)
torchrun=("$py" -m torch.distributed.run --standalone --nnodes 1)
name="bench_nccl, one rank (4 B..16 MiB)"
built "$bnccl" "$name" && step "$name" 60 15 "$bnccl" --out "$results" --max-bytes 16777216 --scale 0.5
name="redistribution on CUDA, one rank"
built "$bred" "$name" && step "$name" 60 15 "$bred" --device cuda --out "$results" --scale 0.34
step "torch DTensor available" 45 10 "$py" "$torch_bench" --check
torch_rc=$?
torch_note="no torch DTensor on CUDA here (see the step above)"
name="torch DTensor redistribution, one rank"
case $torch_rc in
  0) step "$name" 90 30 "${torchrun[@]}" --nproc-per-node 1 "$torch_bench" --out "$results" --scale 0.34 ;;
  77) record "$name" SKIP 0 "$torch_note" ;;
  *) record "$name" "NOT RUN" 0 "the torch check did not pass" ;;
esac
# ~4 ms per collective over sockets between processes on one GPU: 7 ops x 8 sizes x 4 batches of 20, ours
# and raw, is about 9,000 collectives; rows are written as they finish, so a cut run keeps what it measured.
name="bench_nccl, 2 processes (4 B..64 KiB)"
built "$bnccl" "$name" &&
  step "$name" 90 30 "${multi[@]}" "$bnccl" --out "$results" --max-bytes 65536 --scale 0.2
name="redistribution on CUDA, 2 processes"
built "$bred" "$name" && step "$name" 90 30 "${multi[@]}" "$bred" --device cuda --out "$results" --scale 0.34
name="torch DTensor redistribution, 2 processes"
case $torch_rc in
  0) step "$name" 120 40 "${torchrun[@]}" --nproc-per-node 2 "$torch_bench" --out "$results" --scale 0.34 ;;
  77) record "$name" SKIP 0 "$torch_note" ;;
  *) record "$name" "NOT RUN" 0 "the torch check did not pass" ;;
esac

finish

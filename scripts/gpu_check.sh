#!/usr/bin/env bash
# gpu_check.sh: on a machine with a GPU (the H200 test machine: CUDA 13, NCCL from the nvidia-nccl-cu13
# Python package, CMake, ninja; no gloo, no Catch2, no apt, no network), configure and build dtensor with
# CUDA + NCCL, run every NCCL test on one-rank communicators and every CUDA test binary, then the
# collective suite as 2 and 4 processes on the one GPU (each process its own NCCL_HOSTID, NCCL_IB_DISABLE=1,
# NCCL_SOCKET_IFNAME=lo), and print a pass/fail table last. Finishes in under 6 minutes: steps that would
# start past the budget are reported as "not run".
#
#   scripts/gpu_prepare.sh                  # first, on a CPU machine: gathers build-gpu-deps/
#   scripts/gpu_check.sh [DEPS_DIR]         # then, on the GPU machine, from the repository root
#
# Environment: DTENSOR_GPU_DEPS (the deps folder, default build-gpu-deps), DTENSOR_GPU_BUILD (build folder,
# default build-gpu), NCCL_ROOT (NCCL's prefix; default: the nvidia.nccl Python package, else
# /usr/local/cuda), CUDACXX (nvcc), DTENSOR_GPU_BUDGET_S (default 330). When $OUT is set (the device tool),
# the table and a tarball of the logs are copied there. Exit status: 0 when nothing failed.
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
mkdir -p "$logs"
jobs=$(nproc 2>/dev/null || echo 4)

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
# Exit 77 counts as SKIP. Not started when fewer than NEEDED_S seconds of the budget are left.
step() {
  local name=$1 limit=$2 needed=$3
  shift 3
  local file="$logs/$(printf '%s' "$name" | tr -c 'A-Za-z0-9_.-' '_').log"
  if [ $(( budget - $(elapsed) )) -lt "$needed" ]; then
    record "$name" "NOT RUN" 0 "time budget (${budget}s) used up"
    return 1
  fi
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$file" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  case $rc in
    0) record "$name" PASS "$dt" "" ;;
    77) record "$name" SKIP "$dt" "$(grep -m1 -i 'skip' "$file" | cut -c1-60)" ;;
    124|137) record "$name" FAIL "$dt" "timed out after ${limit}s (log: ${file#$root/})"
             tail -n 25 "$file" | sed 's/^/    | /' ;;
    *) record "$name" FAIL "$dt" "exit $rc (log: ${file#$root/})"
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

finish() {
  local table
  table=$(print_table)
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    echo "$table" >"$OUT/gpu_check_table.txt"
    tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$build" gpu_check_logs 2>/dev/null || true
  fi
  echo "$table"
  exit $failed
}

# ---- 0. the machine ---------------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
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

# ---- 2. configure and build -------------------------------------------------------------------------
step "configure (CUDA + NCCL)" 120 60 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 -DNCCL_ROOT="$nccl_cmake_root" \
  -DDTENSOR_BUILD_EXAMPLES=OFF -DDTENSOR_BUILD_BENCH=OFF "${cmake_args[@]}" || finish
if ! grep -q "NCCL ON" "$logs/configure__CUDA___NCCL_.log"; then
  record "NCCL found by CMake" FAIL 0 "$(grep -m1 'dtensor: CUDA' "$logs/configure__CUDA___NCCL_.log")"
  finish
fi
# Every CUDA translation unit's target (tests/*/*.cu), plus the launcher and the NCCL suite.
cuda_targets=$(ninja -C "$build" -t targets all 2>/dev/null | grep -o 'CMakeFiles/[A-Za-z0-9_.-]*\.dir/[^:]*\.cu\.o' |
               sed 's|CMakeFiles/\([^/]*\)\.dir/.*|\1|' | sort -u)
step "build ($(echo $cuda_targets | wc -w) CUDA targets + dtensor-run)" 270 120 \
  cmake --build "$build" -j "$jobs" --target dtensor-run $cuda_targets || finish

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
step "nccl_suite, 2 processes" 120 40 "$run" --standalone --nproc-per-node 2 --stop-timeout 5 "$suite"
step "nccl_suite, 4 processes" 150 60 "$run" --standalone --nproc-per-node 4 --stop-timeout 5 "$suite"
step "nccl watchdog timeout, 2 processes" 60 30 "$run" --standalone --nproc-per-node 2 --stop-timeout 5 "$suite" timeout

finish

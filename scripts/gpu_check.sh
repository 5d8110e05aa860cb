#!/usr/bin/env bash
# gpu_check.sh: the GPU run of dtensor, on a machine with a GPU (the H200 test machine: CUDA 13, NCCL from
# the nvidia-nccl-cu13 Python package, CMake, ninja; no gloo, no Catch2, no apt, no network). One go,
# within a time budget, steps in order of what they prove:
#
#   0. pre-flight: a GPU is listed, its compute mode is Default (several processes share it), MIG is off,
#      the driver supports the toolkit's CUDA major version; otherwise stop at once, saying which;
#   1. the NCCL suite and the launcher built first (nothing else), then, while the CUDA tests, the
#      training example and the benchmarks build in the background:
#   2. the NCCL suite on one-rank communicators (and the watchdog beside a graph capture), then as 2
#      processes (NCCL_DEBUG=INFO: the log shows the transport) and 4 processes on the one GPU, the
#      watchdog's timeout, the count mismatch, a member missing at connection set-up and at
#      ncclCommInitRankConfig, the mismatch under DTENSOR_DEBUG=detail, and the suite and timeout on
#      blocking communicators;
#   3. every CUDA test binary (tests/*/test_*.cu), one process each;
#   4. examples/06_train.cpp on device tensors (example_06_train_cuda) in each of its six layouts as 2
#      processes, 3 steps in float, each checked against one rank with its collectives pinned;
#   5. the GPU benchmarks (BENCHMARKS.md, "GPU"), small sizes: the NCCL sweep (ours vs raw NCCL in the same
#      run) and the redistribution suite on CUDA tensors at 1 and 2 processes, and the same suite through
#      torch.distributed.tensor when the machine's torch has it;
#   and a table of every step last.
#
#   scripts/gpu_prepare.sh                 # first, on a CPU machine: gathers build-gpu-deps/
#   scripts/gpu_check.sh [DEPS_DIR]        # then, on the GPU machine, from the repository root
#   scripts/gpu_check.sh --dry-run         # the same sequence with every command replaced by a stub
#   scripts/gpu_check.sh --self-test       # the policy below and dry runs of its failure paths (no GPU)
#
# Policy: the exit status is 0 only when every step ran and passed. A step that fails, times out, is not
# built, or does not start because the budget is spent (NOT RUN) makes it non-zero; so does a GPU step
# that exits 77 (ctest's skip code) on this machine, which has a GPU. The one allowed skip is the torch
# probe (the machine's torch may lack torch.distributed.tensor; that is not dtensor's to prove).
#
# Environment: DTENSOR_GPU_DEPS (the deps folder, default build-gpu-deps), DTENSOR_GPU_BUILD (build folder,
# default build-gpu), NCCL_ROOT (NCCL's prefix; default: the nvidia.nccl Python package, else
# /usr/local/cuda), CUDACXX (nvcc), DTENSOR_GPU_BUDGET_S (default 570), DTENSOR_GPU_PYTHON (the Python with
# torch, default python3). Every NCCL step runs with the single-node environment below (sockets over
# loopback, no network plugin, no NVLS/MNNVL) and DTENSOR_TIMEOUT=20, so a hang costs seconds. When $OUT
# is set (the device tool), the table (gpu_check_table.txt), a tarball of the logs (gpu_check_logs.tar.gz)
# and one of the benchmarks' JSON results (gpu_check_bench.tar.gz) are copied there.
#
# Dry runs (--dry-run): no command runs; each step takes its expected seconds from a virtual clock, so the
# budget logic is exercised too. DTENSOR_GPU_CHECK_DRY_FAIL / _DRY_SKIP (regexes of step names) make steps
# exit 1 / 77, DTENSOR_GPU_CHECK_DRY_MISSING (regex of target names) makes programs "not built", and
# DTENSOR_GPU_CHECK_DRY_SMI="compute mode,MIG mode,driver CUDA version" (default "Default,Disabled,13.0")
# stands for what nvidia-smi reports.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
script="$root/scripts/gpu_check.sh"

mode=run
case "${1:-}" in
  --self-test) mode=self-test ;;
  --dry-run) mode=dry; shift ;;
esac

budget=${DTENSOR_GPU_BUDGET_S:-570}
deps=${1:-${DTENSOR_GPU_DEPS:-build-gpu-deps}}
case "$deps" in /*) ;; *) deps="$root/$deps" ;; esac
build=${DTENSOR_GPU_BUILD:-build-gpu}
case "$build" in /*) ;; *) build="$root/$build" ;; esac
logs="$build/gpu_check_logs"
results="$build/gpu_check_results" # the benchmarks' JSON (their --out)
rm -rf "$logs" "$results"
mkdir -p "$logs" "$results"
jobs=$(nproc 2>/dev/null || echo 4)

# ---- bookkeeping ------------------------------------------------------------------------------------
names=()
states=()
times=()
notes=()
failed=0
start=$(date +%s)
virtual=0 # the dry run's clock

elapsed() {
  if [ "$mode" = dry ]; then echo "$virtual"; else echo $(( $(date +%s) - start )); fi
}

record() { # name state seconds note
  names+=("$1"); states+=("$2"); times+=("$3"); notes+=("$4")
  case $2 in PASS|SKIP) ;; *) failed=1 ;; esac
  printf 'gpu_check: %-48s %-8s %4ss  %s\n' "$1" "$2" "$3" "$4"
}

log_name() { printf '%s/%s.log' "$logs" "$(printf '%s' "$1" | tr -c 'A-Za-z0-9_.-' '_')"; }

# run_cmd LOG LIMIT NAME NEEDED command...: the command with a timeout into LOG; in a dry run, the stub.
run_cmd() {
  local file=$1 limit=$2 name=$3 needed=$4
  shift 4
  if [ "$mode" = dry ]; then
    echo "dry run: $*" >"$file"
    virtual=$(( virtual + needed ))
    if [ -n "${DTENSOR_GPU_CHECK_DRY_FAIL:-}" ] && [[ $name =~ $DTENSOR_GPU_CHECK_DRY_FAIL ]]; then return 1; fi
    if [ -n "${DTENSOR_GPU_CHECK_DRY_SKIP:-}" ] && [[ $name =~ $DTENSOR_GPU_CHECK_DRY_SKIP ]]; then return 77; fi
    return 0
  fi
  timeout --kill-after=10 "$limit" "$@" >"$file" 2>&1
}

# step [--may-skip] NAME TIMEOUT_S NEEDED_S command...: runs the command with a timeout, logged to
# $logs/NAME.log. Not started when fewer than NEEDED_S seconds of the budget are left (NOT RUN); the
# timeout is cut to what is left, so the script ends within the budget (+10 s of kill grace). Exit 77 is a
# failure (a GPU test must not skip here) unless --may-skip.
step() {
  local may_skip=0
  if [ "$1" = --may-skip ]; then may_skip=1; shift; fi
  local name=$1 limit=$2 needed=$3
  shift 3
  local file
  file=$(log_name "$name")
  step_log=$file
  local left=$(( budget - $(elapsed) ))
  if [ "$left" -lt "$needed" ]; then
    record "$name" "NOT RUN" 0 "the time budget (${budget}s) was used up"
    return 1
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  local t0
  t0=$(elapsed)
  run_cmd "$file" "$limit" "$name" "$needed" "$@"
  local rc=$?
  local dt=$(( $(elapsed) - t0 ))
  local hint=""
  if grep -q "Duplicate GPU" "$file" 2>/dev/null; then
    hint="; several ranks on one GPU need NCCL_HOSTID set per process"
  fi
  case $rc in
    0) record "$name" PASS "$dt" "" ;;
    77) if [ $may_skip = 1 ]; then
          record "$name" SKIP "$dt" "$(grep -m1 -i 'skip' "$file" | cut -c1-70)"
        else
          record "$name" FAIL "$dt" "skipped (exit 77) on a machine with a GPU: $(grep -m1 -i 'skip' "$file" | cut -c1-60)"
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
  echo "====================================== gpu_check ======================================"
  printf '%-50s %-8s %6s  %s\n' "step" "result" "time" "note"
  printf '%-50s %-8s %6s  %s\n' "----" "------" "----" "----"
  local i
  for i in "${!names[@]}"; do
    printf '%-50s %-8s %5ss  %s\n' "${names[$i]}" "${states[$i]}" "${times[$i]}" "${notes[$i]}"
  done
  echo "---------------------------------------------------------------------------------------"
  local not_run=0 fail=0 i2
  for i2 in "${!states[@]}"; do
    case ${states[$i2]} in "NOT RUN") not_run=$((not_run + 1)) ;; FAIL) fail=$((fail + 1)) ;; esac
  done
  if [ $failed = 0 ]; then
    echo "total $(elapsed)s; every step ran and passed${dry_note:-}"
  else
    echo "total $(elapsed)s; $fail failed, $not_run not run (logs in ${logs#$root/})${dry_note:-}"
  fi
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
  if [ -n "${background_pid:-}" ]; then # builds still running when the steps end are stopped
    kill -- "-$background_pid" 2>/dev/null
  fi
  if [ "$mode" != dry ] && have_results; then
    echo
    echo "benchmarks (JSON in ${results#$root/}):"
    bench_summary
  fi
  [ "$mode" = dry ] && dry_note=" (dry run: nothing was executed)"
  table=$(print_table)
  if [ "$mode" != dry ] && [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    echo "$table" >"$OUT/gpu_check_table.txt"
    tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$build" gpu_check_logs 2>/dev/null || true
    if have_results; then
      tar -czf "$OUT/gpu_check_bench.tar.gz" -C "$build" gpu_check_results 2>/dev/null || true
    fi
  fi
  echo "$table"
  exit $failed
}

# ---- self-test: the step policy, and dry runs of the whole sequence, without a GPU ---------------------
if [ "$mode" = self-test ]; then
  fail_test() { echo "gpu_check self-test: $*"; exit 1; }
  expect() { # expect WHAT STATE: the last recorded step
    local i=$(( ${#names[@]} - 1 ))
    [ "${states[$i]}" = "$2" ] || fail_test "$1 gave ${states[$i]}, expected $2"
  }
  step "skip" 10 0 bash -c 'echo skipped; exit 77'; expect "exit 77" FAIL
  step --may-skip "allowed skip" 10 0 bash -c 'echo skipped; exit 77'; expect "exit 77 of a --may-skip step" SKIP
  step "pass" 10 0 true; expect "exit 0" PASS
  step "fail" 10 0 bash -c 'echo "NCCL WARN Duplicate GPU detected"; exit 1'; expect "exit 1" FAIL
  case "${notes[$(( ${#notes[@]} - 1 ))]}" in *NCCL_HOSTID*) ;; *) fail_test "no NCCL_HOSTID hint" ;; esac
  step "time out" 1 0 sleep 5; expect "a step past its limit" FAIL
  budget=0
  step "past the budget" 10 5 true; expect "a step past the budget" "NOT RUN"

  # Dry runs of the real sequence: (expected exit, what the output must contain, environment...).
  dry() {
    local want=$1 grep_for=$2
    shift 2
    local out rc
    out=$(env "$@" DTENSOR_GPU_BUILD="$build/dry" bash "$script" --dry-run 2>&1)
    rc=$?
    if [ "$want" = 0 ] && [ $rc != 0 ]; then fail_test "dry run with $* exited $rc, expected 0:"$'\n'"$out"; fi
    if [ "$want" != 0 ] && [ $rc = 0 ]; then fail_test "dry run with $* exited 0, expected non-zero:"$'\n'"$out"; fi
    if ! grep -qE -- "$grep_for" <<<"$out"; then fail_test "dry run with $* did not print /$grep_for/:"$'\n'"$out"; fi
    dry_out=$out
  }
  dry 0 'every step ran and passed' DTENSOR_GPU_CHECK_DRY_FAIL= # the planned sequence fits the budget
  # the order of value: one rank, 2 and 4 processes, timeout and mismatch, CUDA tests, training, benchmarks
  want="nccl_suite, one-rank communicators|nccl_suite, 2 processes|nccl_suite, 4 processes|nccl watchdog timeout, 2 processes|nccl count mismatch named, 2 processes|core_test_tensor_cuda|06_train_cuda --layout tp, 2 processes|bench_nccl, one rank (4 B..16 MiB)"
  order=$(sed -n 's/^gpu_check: \(.\{48\}\).*/\1/p' <<<"$dry_out" | sed 's/ *$//' | grep -Fx "${want//|/$'\n'}" | paste -sd'|')
  [ "$order" = "$want" ] || fail_test "the steps ran out of order: $order"
  dry 1 'nccl_suite, 4 processes +FAIL' DTENSOR_GPU_CHECK_DRY_FAIL='4 processes'         # a failed step
  dry 1 'nccl_suite, 2 processes +FAIL .*skipped' DTENSOR_GPU_CHECK_DRY_SKIP='^nccl_suite, 2' # a GPU test skipped
  dry 0 'torch DTensor available +SKIP' DTENSOR_GPU_CHECK_DRY_SKIP='^torch DTensor available' # the one allowed skip
  dry 1 'NOT RUN +0s +the time budget' DTENSOR_GPU_BUDGET_S=120                           # steps cut by the budget
  dry 1 '06_train_cuda --layout fsdp, 2 processes +FAIL +0s +not built' DTENSOR_GPU_CHECK_DRY_MISSING='^example_06_train_cuda$'
  dry 1 'core_test_tensor_cuda +FAIL +0s +not built' DTENSOR_GPU_CHECK_DRY_MISSING='^core_test_tensor_cuda$'
  dry 1 'build: CUDA tests.*FAIL' DTENSOR_GPU_CHECK_DRY_FAIL='^build: CUDA tests'          # a failed build
  dry 1 'pre-flight: compute mode +FAIL.*Exclusive_Process' DTENSOR_GPU_CHECK_DRY_SMI='Exclusive_Process,Disabled,13.0'
  grep -q 'nccl_suite, one-rank' <<<"$dry_out" && fail_test "steps ran after a failed pre-flight"
  dry 1 'pre-flight: MIG +FAIL' DTENSOR_GPU_CHECK_DRY_SMI='Default,Enabled,13.0'
  dry 1 'pre-flight: driver +FAIL.*12.4' DTENSOR_GPU_CHECK_DRY_SMI='Default,Disabled,12.4'
  echo "gpu_check self-test: passed (the step policy and 11 dry runs)"
  exit 0
fi

# ---- 0. the machine and the pre-flight ----------------------------------------------------------------
if [ "$mode" = dry ]; then
  IFS=, read -r smi_mode smi_mig smi_cuda <<<"${DTENSOR_GPU_CHECK_DRY_SMI:-Default,Disabled,13.0}"
  smi_list="GPU 0: NVIDIA H200 (dry run)"
else
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi 2>&1 | head -n 12 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=index,name,driver_version,compute_mode,mig.mode.current,memory.used --format=csv 2>&1 || true
    echo "c++: $(c++ --version 2>&1 | head -1)"
    echo "cmake: $(cmake --version | head -1); ninja: $(ninja --version 2>&1)"
  } | tee "$logs/machine.log"
  smi_list=$(nvidia-smi -L 2>/dev/null | grep '^GPU' || true)
  smi_mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader -i 0 2>/dev/null | tr -d ' ')
  smi_mig=$(nvidia-smi --query-gpu=mig.mode.current --format=csv,noheader -i 0 2>/dev/null | tr -d ' ')
  smi_cuda=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | grep -o '[0-9.]*$')
fi
if [ -z "$smi_list" ]; then
  record "pre-flight: a GPU is listed" FAIL 0 "nvidia-smi lists no GPU: gpu_check.sh runs on a GPU machine"
  finish
fi
record "pre-flight: a GPU is listed" PASS 0 "$(head -1 <<<"$smi_list" | cut -c1-60)"
if [ "$smi_mode" != Default ]; then
  record "pre-flight: compute mode" FAIL 0 "GPU 0 is in compute mode '$smi_mode': the multi-process steps put several processes on it; set Default (nvidia-smi -c DEFAULT)"
  finish
fi
record "pre-flight: compute mode" PASS 0 "Default"
case "$smi_mig" in
  Disabled|N/A|"[N/A]"|"") record "pre-flight: MIG" PASS 0 "${smi_mig:-not reported}" ;;
  *) record "pre-flight: MIG" FAIL 0 "MIG mode is '$smi_mig' on GPU 0: NCCL's tests need the whole GPU (MIG off)"
     finish ;;
esac
need_cuda=13
if [ "$mode" = run ]; then
  nvcc_probe=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  need_cuda=$("$nvcc_probe" --version 2>/dev/null | grep -o 'release [0-9]*' | grep -o '[0-9]*$' || echo 13)
fi
if [ -z "$smi_cuda" ] || [ "${smi_cuda%%.*}" -lt "$need_cuda" ]; then
  record "pre-flight: driver" FAIL 0 "the driver supports CUDA ${smi_cuda:-?}; this build needs CUDA $need_cuda (driver 580 or newer for CUDA 13)"
  finish
fi
record "pre-flight: driver" PASS 0 "supports CUDA $smi_cuda"

# ---- 1. the tools and what the deps folder brings -------------------------------------------------------
if [ "$mode" = dry ]; then
  nvcc=nvcc
  nccl=/dry-run/nccl
  nccl_cmake_root=$nccl
  cmake_args=()
else
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
  { [ -z "$nccl" ] || [ ! -f "$nccl/include/nccl.h" ]; } && nccl=/usr/local/cuda
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

  cmake_args=()
  if [ -f "$deps/catch2/src/catch_main.cpp" ]; then
    if [ ! -f "$deps/catch2/lib/libCatch2WithMain.a" ]; then
      step "compile Catch2's main" 120 40 bash -c "
        c++ -std=c++17 -O1 -I'$deps/catch2/include' -c '$deps/catch2/src/catch_main.cpp' -o '$build/catch_main.o' &&
        ar rcs '$deps/catch2/lib/libCatch2WithMain.a' '$build/catch_main.o'" || finish
    fi
    cmake_args+=("-DCatch2_DIR=$deps/catch2/lib/cmake/Catch2")
  elif ! ls /usr/lib/cmake/Catch2/Catch2Config.cmake /usr/local/lib/cmake/Catch2/Catch2Config.cmake >/dev/null 2>&1; then
    record "deps folder" FAIL 0 "no $deps: run scripts/gpu_prepare.sh on a CPU machine, copy it here"
    finish
  fi
  # gloo is optional here (the NCCL tests do not need it): used when its probe links and runs.
  if [ -f "$deps/gloo/probe.cpp" ] &&
     c++ -std=c++17 "$deps/gloo/probe.cpp" -I"$deps/gloo/include" -L"$deps/gloo/lib" -lgloo \
         -Wl,-rpath,"$deps/gloo/lib" -Wl,-rpath-link,"$deps/gloo/lib" -pthread -o "$build/gloo_probe" \
         >"$logs/gloo_probe.log" 2>&1 && "$build/gloo_probe" >>"$logs/gloo_probe.log" 2>&1; then
    cmake_args+=("-DGloo_DIR=$deps/gloo/lib/cmake/Gloo")
  else
    cmake_args+=("-DCMAKE_DISABLE_FIND_PACKAGE_Gloo=ON")
  fi
  # OpenBLAS: dtensor::blas, which example_06_train_cuda needs (its host GEMMs are compiled next to the
  # cuBLAS ones); the training steps fail as "not built" without it.
  blas_lib="$deps/openblas/lib"
  if [ -f "$deps/openblas/probe.cpp" ] &&
     step "OpenBLAS probe" 60 15 env LD_LIBRARY_PATH="$blas_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
       bash -c "c++ -std=c++17 '$deps/openblas/probe.cpp' -I'$deps/openblas/include' -L'$blas_lib' -lopenblas \
                    -Wl,-rpath-link,'$blas_lib' -o '$build/openblas_probe' && '$build/openblas_probe'"; then
    export LD_LIBRARY_PATH="$blas_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    cmake_args+=("-DBLAS_openblas_LIBRARY=$blas_lib/libopenblas.so" "-DCBLAS_INCLUDE_DIR=$deps/openblas/include")
  fi
  if [ -f "$deps/random123/include/Random123/philox.h" ]; then # rand, randn, dropout; the training example
    cmake_args+=("-DDTENSOR_RANDOM123_INCLUDE_DIR=$deps/random123/include")
  fi
  if [ -f "$deps/dlpack/include/dlpack/dlpack.h" ]; then # to_dlpack, from_dlpack (tests/core/test_dlpack*)
    cmake_args+=("-DDTENSOR_DLPACK_INCLUDE_DIR=$deps/dlpack/include")
  fi
fi

# ---- 2. configure; build what the first steps need, start the rest in the background -----------------
step "configure (CUDA + NCCL)" 120 20 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 -DNCCL_ROOT="$nccl_cmake_root" \
  -DDTENSOR_BUILD_EXAMPLES=ON -DDTENSOR_BUILD_BENCH=ON "${cmake_args[@]}" || finish
configure_log=$step_log
if [ "$mode" = run ] && ! grep -q "NCCL ON" "$configure_log"; then
  record "NCCL found by CMake" FAIL 0 "$(grep -m1 'dtensor: CUDA' "$configure_log")"
  finish
fi

# The targets: every CUDA test TU (tests/*/test_*.cu), the CUDA build of the training example, the GPU
# benchmarks.
if [ "$mode" = dry ]; then
  cuda_targets="core_test_tensor_cuda core_test_local_ops_cuda core_test_dlpack_cuda ops_test_local_gemm_cuda ops_test_random_cuda parallel_test_optim_cuda"
  example_targets=example_06_train_cuda
  bench_targets="bench_nccl bench_redistribution_cuda"
else
  all_targets=$(ninja -C "$build" -t targets all 2>/dev/null)
  cuda_targets=$(echo "$all_targets" | grep -o 'CMakeFiles/[A-Za-z0-9_.-]*\.dir/[^:]*\.cu\.o' |
                 sed 's|CMakeFiles/\([^/]*\)\.dir/.*|\1|' | grep -Ev '^(bench|example)_|^nccl_suite' | sort -u | paste -sd' ')
  example_targets=""
  echo "$all_targets" | grep -q "^example_06_train_cuda: phony" && example_targets="example_06_train_cuda"
  bench_targets=""
  for t in bench_nccl bench_redistribution_cuda; do
    echo "$all_targets" | grep -q "^$t: phony" && bench_targets="$bench_targets $t"
  done
fi

# -k 0: a target that fails to compile costs only its own steps ("not built").
step "build: NCCL suite, launcher" 240 60 cmake --build "$build" -j "$jobs" --target dtensor-run nccl_suite -- -k 0
build_logs=("$step_log")

# The rest builds in the background (lower priority) while the NCCL steps run: CUDA tests and the example
# first, the benchmarks next. Each is a step when it is waited for.
background_build() { # LOG TARGETS...
  local file=$1
  shift
  if [ "$mode" = dry ]; then echo "dry run: build $*" >"$file"; echo 0 >"$file.rc"; return; fi
  ( nice -n 10 cmake --build "$build" -j "$jobs" --target "$@" -- -k 0 >"$file" 2>&1; echo $? >"$file.rc" ) &
}
wait_build() { # NAME LOG EXPECTED_S: waits (within the budget) for a background build, recorded as a step
  local name=$1 file=$2 needed=$3
  if [ "$mode" = dry ]; then
    run_cmd "$file.dry" 0 "$name" "$needed" true
    local rc=$?
    [ $rc = 0 ] && record "$name" PASS "$needed" "" || record "$name" FAIL "$needed" "exit $rc"
    build_logs+=("$file")
    return
  fi
  local t0=$(elapsed)
  while [ ! -f "$file.rc" ] && [ "$(elapsed)" -lt "$budget" ]; do sleep 1; done
  build_logs+=("$file")
  if [ ! -f "$file.rc" ]; then
    record "$name" "NOT RUN" $(( $(elapsed) - t0 )) "still building when the time budget (${budget}s) ran out"
  elif [ "$(cat "$file.rc")" = 0 ]; then
    record "$name" PASS $(( $(elapsed) - t0 )) "waited"
  else
    record "$name" FAIL $(( $(elapsed) - t0 )) "exit $(cat "$file.rc") (log: ${file#$root/}); its targets' steps fail as not built"
    grep -A3 '^FAILED: ' "$file" | head -n 25 | sed 's/^/    | /'
  fi
}
tests_log="$logs/build_cuda_tests.log"
bench_log="$logs/build_benchmarks.log"
if [ "$mode" = run ]; then
  # Its own process group (job control on for this one job), so finish() can stop it.
  set -m
  ( background_build "$tests_log" $cuda_targets $example_targets
    while [ ! -f "$tests_log.rc" ]; do sleep 1; done
    if [ -n "$bench_targets" ]; then background_build "$bench_log" $bench_targets; else echo 0 >"$bench_log.rc"; fi
    wait ) &
  background_pid=$!
  set +m
else
  background_build "$tests_log" $cuda_targets $example_targets
  background_build "$bench_log" $bench_targets
fi

# prog TARGET: the program's path when it was built (not in a failed build), else empty.
prog() {
  local t=$1
  if [ "$mode" = dry ]; then
    if [ -n "${DTENSOR_GPU_CHECK_DRY_MISSING:-}" ] && [[ $t =~ $DTENSOR_GPU_CHECK_DRY_MISSING ]]; then return; fi
    echo "/dry-run/$t"
    return
  fi
  local f
  for f in "${build_logs[@]}"; do
    grep -Eq "^FAILED: (\[code=[0-9]+\] )?([^ ]*/)?(CMakeFiles/$t\.dir/|$t( |\$))" "$f" 2>/dev/null && return
  done
  find "$build" -type f -name "$t" -perm -u+x | head -1
}
built() { # built PATH NAME: true when PATH is not empty, else records NAME as FAIL "not built"
  [ -n "$1" ] && return 0
  record "$2" FAIL 0 "not built"
  return 1
}

# ---- 3. NCCL: one rank, then processes on the one GPU ------------------------------------------------
# Single node, several processes on one GPU: each its own NCCL_HOSTID (DTENSOR_TEST_HOSTID_PER_RANK), so
# NCCL sees separate hosts and talks over its own socket transport on loopback; no network plugin, no
# InfiniBand, no NVLink SHARP or multi-node NVLink, so a stray plugin or fabric on the machine cannot be
# picked up. DTENSOR_TIMEOUT: a hang costs seconds, not the budget.
export NCCL_NET=Socket NCCL_NET_PLUGIN=none NCCL_IB_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_MNNVL_ENABLE=0 \
       NCCL_SOCKET_IFNAME=lo DTENSOR_TEST_HOSTID_PER_RANK=1 DTENSOR_TIMEOUT=20
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
run=$(prog dtensor-run)
suite=$(prog nccl_suite)
multi=("$run" --standalone --stop-timeout 5 --nproc-per-node)

nccl_step() { # NAME TIMEOUT NEEDED PROCS ARGS... (PROCS 1: the suite alone)
  local name=$1 limit=$2 needed=$3 procs=$4
  shift 4
  built "$suite" "$name" || return
  if [ "$procs" = 1 ]; then
    step "$name" "$limit" "$needed" "$suite" "$@"
  else
    built "$run" "$name" || return
    step "$name" "$limit" "$needed" "${multi[@]}" "$procs" "$suite" "$@"
  fi
}
nccl_step "nccl_suite, one-rank communicators" 60 15 1
nccl_step "nccl watchdog beside a global-mode graph capture" 30 5 1 capture_watchdog
nccl_step "nccl_suite, 2 processes" 60 20 2 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,ENV
if [ "$mode" = run ] && [ -f "$step_log" ]; then
  transport=$(grep -m1 -oE 'NET/(Socket|IB|Plugin)[^ ]*( : [^ ]+)?' "$step_log" || true)
  echo "gpu_check: the 2-process suite's network: ${transport:-not reported} (NCCL_DEBUG=INFO in ${step_log#$root/})"
fi
nccl_step "nccl_suite, 4 processes" 90 30 4
# Failures: a member missing in an op (then every wait and the next op raise), in the first op's
# connection set-up, in ncclCommInitRankConfig; mismatched ops (every rank errs, none passes by NCCL
# completing them), and under DTENSOR_DEBUG=detail before anything is sent.
nccl_step "nccl watchdog timeout, 2 processes" 60 15 2 timeout
nccl_step "nccl count mismatch named, 2 processes" 90 20 2 mismatch
nccl_step "nccl member missing at connection set-up" 60 15 2 connect_timeout
nccl_step "nccl member missing at ncclCommInitRankConfig" 60 15 2 init_timeout
nccl_step "nccl mismatch caught by detail before sending" 60 10 2 mismatch_detail
# Blocking communicators (DTENSOR_NCCL_NONBLOCKING=0; nonblocking is the default). Not the set-up timeouts:
# a blocking call stuck in NCCL cannot be interrupted, by design.
nccl_step "nccl_suite, 2 processes, blocking" 60 20 2 env DTENSOR_NCCL_NONBLOCKING=0
nccl_step "nccl watchdog timeout, blocking" 60 15 2 env DTENSOR_NCCL_NONBLOCKING=0 timeout

# ---- 4. the CUDA tests, one process each ----------------------------------------------------------------
wait_build "build: CUDA tests, training example" "$tests_log" 30
for t in $cuda_targets; do
  bin=$(prog "$t")
  built "$bin" "$t" && step "$t" 90 10 "$bin"
done

# ---- 5. training on the GPU: example_06_train_cuda, every layout, 2 processes ---------------------------
# The model of examples/06_train.cpp on device tensors (cuBLAS, the library's CUDA kernels, NCCL), 3 steps
# in float with sizes no mesh axis divides; each run checks every loss and the final parameters against
# the same training on one rank (1e-5) and each step's collectives against the layout's, and exits 1
# otherwise. Meshes for 2 ranks: tp and tp_cm (1,1,2), ddp and fsdp (1,2,1), hsdp (2,1,1), fsdp_tp (1,1,2).
# tp_cm runs the collective matmuls (ops/collective_matmul.hpp): their exchanges on the group's NCCL stream
# beside the cuBLAS GEMMs on the tensors' stream.
train=""
[ -n "$example_targets" ] && train=$(prog example_06_train_cuda)
for layout in tp tp_cm ddp fsdp hsdp fsdp_tp; do
  name="06_train_cuda --layout $layout, 2 processes"
  built "$train" "$name" && step "$name" 45 12 "${multi[@]}" 2 \
    "$train" --layout "$layout" --hidden 30 --ffn 42 --vocab 61 --steps 3
done

# ---- 6. benchmarks (BENCHMARKS.md, "GPU"): small sizes, few samples, JSON into $results ------------------
wait_build "build: benchmarks" "$bench_log" 5
bnccl=$(prog bench_nccl)
bred=$(prog bench_redistribution_cuda)
torch_bench="$root/bench/redistribution/torch_dtensor_bench.py"
py=${DTENSOR_GPU_PYTHON:-python3}
torchrun=("$py" -m torch.distributed.run --standalone --nnodes 1)
name="bench_nccl, one rank (4 B..16 MiB)"
built "$bnccl" "$name" && step "$name" 60 15 "$bnccl" --out "$results" --max-bytes 16777216 --scale 0.5
name="redistribution on CUDA, one rank"
built "$bred" "$name" && step "$name" 60 15 "$bred" --device cuda --out "$results" --scale 0.34
# ~4 ms per collective over sockets between processes on one GPU; rows are written as they finish, so a
# cut run keeps what it measured.
name="bench_nccl, 2 processes (4 B..64 KiB)"
built "$bnccl" "$name" && step "$name" 90 25 "${multi[@]}" 2 "$bnccl" --out "$results" --max-bytes 65536 --scale 0.2
name="redistribution on CUDA, 2 processes"
built "$bred" "$name" && step "$name" 90 25 "${multi[@]}" 2 "$bred" --device cuda --out "$results" --scale 0.34
step --may-skip "torch DTensor available" 45 10 "$py" "$torch_bench" --check
torch_rc=$?
for procs in 1 2; do
  name="torch DTensor redistribution, $procs process(es)"
  case $torch_rc in
    0) step "$name" 120 25 "${torchrun[@]}" --nproc-per-node "$procs" "$torch_bench" --out "$results" --scale 0.34 ;;
    77) record "$name" SKIP 0 "no torch DTensor on CUDA here (the step above says why)" ;;
    *) record "$name" "NOT RUN" 0 "the torch check did not pass" ;;
  esac
done

finish

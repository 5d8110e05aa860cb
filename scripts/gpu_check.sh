#!/usr/bin/env bash
# gpu_check.sh: the GPU run of dtensor, on a machine with a GPU (the device machine: one H100 or H200, CUDA 13,
# PyTorch 2.11, NCCL from the nvidia-nccl-cu13 Python package, CMake, ninja; no gloo, no Catch2, no apt, no
# network), in one go, steps in order of what they prove. The programs are built on a CPU machine first
# (scripts/gpu_prepare.sh: sm_90, packed into build-gpu-pack/), so the device only runs them:
#
#   0. pre-flight: a GPU is listed, its compute mode is Default (several processes share it), MIG is off, the
#      driver supports CUDA 13; the pack unpacks, its programs load (ldd -r: every library and symbol found)
#      and the machine meets its floor (glibc; libstdc++ is linked in); otherwise stop, saying which;
#   1. the NCCL suite on a one-rank communicator, as 2 processes (NCCL_DEBUG=INFO: the log shows the
#      transport) and as 4 processes on the one GPU;
#   2. at once, each in its own processes: the watchdog beside a graph capture; the watchdog's timeout, the
#      count mismatch, a member missing at connection set-up and at ncclCommInitRankConfig, the mismatch
#      under DTENSOR_DEBUG=detail; the suite and the timeout on blocking communicators; every CUDA test
#      program (tests/*/test_*.cu and the two-TU link test), one process each;
#   3. examples/06_train.cpp on device tensors (example_06_train_cuda) in each of its six layouts as 2
#      processes, 3 steps in float, each checked against one rank (all six at once);
#   4. the GPU benchmarks (BENCHMARKS.md, "GPU"), small sizes, one after another: the NCCL sweep (ours vs raw
#      NCCL in the same run) and the redistribution suite on CUDA tensors at 1 and 2 processes, and the same
#      suite through torch.distributed.tensor when the machine's torch has it;
#   and a table of every step last, with each step's expected and measured seconds.
#
#   scripts/gpu_prepare.sh                    # first, on a CPU machine: builds and packs build-gpu-pack/
#   scripts/gpu_check.sh [PACK_DIR]           # then, on the GPU machine, from the repository root
#   scripts/gpu_check.sh --dry-run [TREE]     # on a CPU machine: the real command lines, validated (below)
#   scripts/gpu_check.sh --self-test          # the step policy, dry runs and their failure paths (no GPU)
#
# The plan: each step below carries its expected seconds (a reserve: the sleeps the mode contains, plus
# process start, CUDA context and NCCL set-up), and a step is not started when the budget has less left
# (NOT RUN). The expected times of the prebuilt path add up to 222 s (the dry run prints the sum: 220 s,
# without the pack's load check); the budget is DTENSOR_GPU_BUDGET_S (default 300 s, 570 s when the programs
# must be built here).
#
# Floor of the pack (gpu_prepare.sh writes the exact one into the pack's FLOOR and this checks it): glibc
# <= 2.36 (Debian 12, where it is built; the device image's Ubuntu 24.04 has 2.39), libstdc++ and libgcc
# linked statically, CUDA runtime 13, cuBLAS 13, NCCL 2 (libnccl.so.2, the wheel's) found at run time. When
# the pack is missing or the machine is below its floor, the programs are built here (the fallback: the
# deps/ folder of the pack brings Catch2, OpenBLAS, Random123 and DLPack), within a longer budget.
#
# Policy: the exit status is 0 only when every step ran and passed. A step that fails, times out, is not
# built, or does not start because the budget is spent (NOT RUN) makes it non-zero; so does a GPU step that
# exits 77 (ctest's skip code) on this machine, which has a GPU. The one allowed skip is the torch probe (the
# machine's torch may lack torch.distributed.tensor; that is not dtensor's to prove).
#
# Dry run (--dry-run [TREE], CI runs it): every step runs its real command line, argv and environment, on
# this machine, with DTENSOR_GPU_CHECK_VALIDATE=1, against the programs of a configured and built tree
# (default build/, the test build: the same CMake, so the same targets), discovered as the real run
# discovers them. The programs check what they are given and exit before touching CUDA (nccl_suite: its
# mode and the ranks it needs; example_06_train_cuda: its flags and mesh; the benchmarks: their flags; the
# torch script under torch's own launcher: its flags); dtensor-run launches them for real (its flags, the
# ranks' environment); a CUDA test program is a stub that takes no arguments and loads (ldd -r). Times come
# from the plan (a virtual clock), so the budget logic runs as on the device. DTENSOR_GPU_CHECK_DRY_FAIL /
# _DRY_SKIP (regexes of step names) make passing steps exit 1 / 77, DTENSOR_GPU_CHECK_DRY_MISSING (regex of
# target names) makes programs "not built", DTENSOR_GPU_CHECK_DRY_SMI="compute mode,MIG mode,driver CUDA
# version" (default "Default,Disabled,13.0") stands for what nvidia-smi reports, and
# DTENSOR_GPU_CHECK_DRY_EXEC=0 runs the policy alone (the commands not executed; the self-test's knob runs).
#
# Environment: DTENSOR_GPU_PACK (default build-gpu-pack), DTENSOR_GPU_BUILD (work folder, default build-gpu),
# NCCL_ROOT (NCCL's prefix; default: the nvidia.nccl Python package, else /usr/local/cuda), CUDACXX (nvcc,
# the fallback build), DTENSOR_GPU_BUDGET_S, DTENSOR_GPU_PYTHON (the Python with torch, default python3),
# DTENSOR_GPU_CHECK_TREE (the dry run's tree). Every NCCL step runs with the single-node environment below
# (sockets over loopback, no network plugin, no NVLS/MNNVL) and DTENSOR_TIMEOUT=20, so a hang costs seconds.
# When $OUT is set (the device tool), the table (gpu_check_table.txt), a tarball of the logs
# (gpu_check_logs.tar.gz) and one of the benchmarks' JSON results (gpu_check_bench.tar.gz) are copied there.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
script="$root/scripts/gpu_check.sh"
source "$root/scripts/lib/gpu_targets.sh"

mode=run
case "${1:-}" in
  --self-test) mode=self-test ;;
  --dry-run) mode=dry; shift ;;
esac

abs() { case "$1" in /*) echo "$1" ;; *) echo "$root/$1" ;; esac; }
build=$(abs "${DTENSOR_GPU_BUILD:-build-gpu}")
if [ "$mode" = dry ]; then
  tree=$(abs "${1:-${DTENSOR_GPU_CHECK_TREE:-build}}")
else
  pack=$(abs "${1:-${DTENSOR_GPU_PACK:-build-gpu-pack}}")
fi
logs="$build/gpu_check_logs"
results="$build/gpu_check_results" # the benchmarks' JSON (their --out)
rm -rf "$logs" "$results"
mkdir -p "$logs" "$results"
jobs=$(nproc 2>/dev/null || echo 4)
budget=${DTENSOR_GPU_BUDGET_S:-300}

# ---- bookkeeping ------------------------------------------------------------------------------------
names=()
states=()
times=()
expects=()
notes=()
failed=0
planned=0 # the sum of the expected seconds of the steps started
start=$(date +%s)
virtual=0 # the dry run's clock: every step takes its expected seconds

elapsed() {
  if [ "$mode" = dry ]; then echo "$virtual"; else echo $(( $(date +%s) - start )); fi
}

record() { # name state seconds expected note
  names+=("$1"); states+=("$2"); times+=("$3"); expects+=("$4"); notes+=("$5")
  case $2 in PASS|SKIP) ;; *) failed=1 ;; esac
  printf 'gpu_check: %-48s %-8s %4ss (exp %3ss)  %s\n' "$1" "$2" "$3" "$4" "$5"
}

log_name() { printf '%s/%s.log' "$logs" "$(printf '%s' "$1" | tr -c 'A-Za-z0-9_.-' '_')"; }

# Steps run in the background, each writing its status to LOG.rc and its seconds to LOG.t; a batch (below)
# starts several and waits for all, a plain step starts one and waits for it.
launch() { # LOG LIMIT NAME command...: starts the command with a timeout into LOG, in the background
  local file=$1 limit=$2 name=$3
  shift 3
  rm -f "$file.rc" "$file.t"
  (
    t0=$(date +%s)
    if [ "$mode" = dry ]; then
      # The real command line against the validating programs (not with DTENSOR_GPU_CHECK_DRY_EXEC=0: the
      # self-test's runs of the policy alone); then the policy tests' knobs.
      if [ "${DTENSOR_GPU_CHECK_DRY_EXEC:-1}" = 0 ]; then
        echo "not executed: $*" >"$file"
        rc=0
      else
        timeout --kill-after=5 60 "$@" >"$file" 2>&1
        rc=$?
      fi
      if [ $rc = 0 ] && [ -n "${DTENSOR_GPU_CHECK_DRY_FAIL:-}" ] && [[ $name =~ $DTENSOR_GPU_CHECK_DRY_FAIL ]]; then rc=1; fi
      if [ $rc = 0 ] && [ -n "${DTENSOR_GPU_CHECK_DRY_SKIP:-}" ] && [[ $name =~ $DTENSOR_GPU_CHECK_DRY_SKIP ]]; then rc=77; fi
    else
      timeout --kill-after=10 "$limit" "$@" >"$file" 2>&1
      rc=$?
    fi
    echo $(( $(date +%s) - t0 )) >"$file.t"
    echo $rc >"$file.rc"
  ) &
}

# A batch: steps started together (batch_begin), each with its own limit and expectation, and recorded when
# all are done (batch_end); the batch's expectation is its slowest step's. Outside a batch, a step runs alone.
in_batch=0
batch_pending=()
batch_begin() { in_batch=1; batch_pending=(); batch_virtual0=$virtual; batch_expected=0; }
batch_end() {
  wait
  local entry name file needed limit may_skip
  for entry in "${batch_pending[@]}"; do
    IFS=$'\t' read -r name file needed limit may_skip <<<"$entry"
    finish_step "$name" "$file" "$needed" "$limit" "$may_skip"
  done
  if [ "$mode" = dry ]; then virtual=$(( batch_virtual0 + batch_expected )); fi
  planned=$(( planned + batch_expected ))
  in_batch=0
  batch_pending=()
}

# step [--may-skip] NAME TIMEOUT_S EXPECTED_S command...: runs the command with a timeout, logged to
# $logs/NAME.log. Not started when fewer than EXPECTED_S seconds of the budget are left (NOT RUN); the
# timeout is cut to what is left, so the script ends within the budget (+10 s of kill grace). Exit 77 is a
# failure (a GPU test must not skip here) unless --may-skip. In a batch it starts and returns at once.
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
    record "$name" "NOT RUN" 0 "$needed" "the time budget (${budget}s) was used up"
    return 1
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  launch "$file" "$limit" "$name" "$@"
  if [ $in_batch = 1 ]; then
    batch_pending+=("$name"$'\t'"$file"$'\t'"$needed"$'\t'"$limit"$'\t'"$may_skip")
    [ "$needed" -gt "$batch_expected" ] && batch_expected=$needed
    return 0
  fi
  wait
  [ "$mode" = dry ] && virtual=$(( virtual + needed ))
  planned=$(( planned + needed ))
  finish_step "$name" "$file" "$needed" "$limit" "$may_skip"
}

finish_step() { # NAME LOG EXPECTED LIMIT MAY_SKIP: records a finished step; returns its status
  local name=$1 file=$2 needed=$3 limit=$4 may_skip=$5 rc dt hint=""
  rc=$(cat "$file.rc" 2>/dev/null || echo 1)
  dt=$(cat "$file.t" 2>/dev/null || echo 0)
  [ "$mode" = dry ] && dt=$needed
  if grep -q "Duplicate GPU" "$file" 2>/dev/null; then
    hint="; several ranks on one GPU need NCCL_HOSTID set per process"
  fi
  case $rc in
    0) record "$name" PASS "$dt" "$needed" "" ;;
    77) if [ "$may_skip" = 1 ]; then
          record "$name" SKIP "$dt" "$needed" "$(grep -m1 -i 'skip' "$file" | cut -c1-70)"
        else
          record "$name" FAIL "$dt" "$needed" "skipped (exit 77) on a machine with a GPU: $(grep -m1 -i 'skip' "$file" | cut -c1-60)"
        fi ;;
    124|137) record "$name" FAIL "$dt" "$needed" "timed out after ${limit}s (log: ${file#$root/})$hint"
             tail -n 25 "$file" | sed 's/^/    | /' ;;
    *) record "$name" FAIL "$dt" "$needed" "exit $rc (log: ${file#$root/})$hint"
       tail -n 25 "$file" | sed 's/^/    | /' ;;
  esac
  return "$rc"
}

print_table() {
  echo
  echo "=========================================== gpu_check ==========================================="
  printf '%-50s %-8s %6s %6s  %s\n' "step" "result" "time" "exp" "note"
  printf '%-50s %-8s %6s %6s  %s\n' "----" "------" "----" "---" "----"
  local i
  for i in "${!names[@]}"; do
    printf '%-50s %-8s %5ss %5ss  %s\n' "${names[$i]}" "${states[$i]}" "${times[$i]}" "${expects[$i]}" "${notes[$i]}"
  done
  echo "-------------------------------------------------------------------------------------------------"
  local not_run=0 fail=0 i2
  for i2 in "${!states[@]}"; do
    case ${states[$i2]} in "NOT RUN") not_run=$((not_run + 1)) ;; FAIL) fail=$((fail + 1)) ;; esac
  done
  local plan="plan ${planned}s expected of a ${budget}s budget"
  if [ $failed = 0 ]; then
    echo "total $(elapsed)s ($plan); every step ran and passed${dry_note:-}"
  else
    echo "total $(elapsed)s ($plan); $fail failed, $not_run not run (logs in ${logs#$root/})${dry_note:-}"
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
  [ $in_batch = 1 ] && batch_end
  if [ "$mode" != dry ] && have_results; then
    echo
    echo "benchmarks (JSON in ${results#$root/}):"
    bench_summary
  fi
  [ "$mode" = dry ] && dry_note=" (dry run: the real command lines, validated, nothing run on a GPU)"
  local table
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
  batch_begin
  step "batch: pass" 10 3 true
  step "batch: fail" 10 2 false
  step "batch: time out" 1 1 sleep 5
  batch_end
  [ "${states[*]: -3}" = "PASS FAIL FAIL" ] || fail_test "a batch recorded ${states[*]: -3}, expected PASS FAIL FAIL"
  budget=0
  step "past the budget" 10 5 true; expect "a step past the budget" "NOT RUN"

  # Dry runs of the real sequence: (expected exit, what the output must contain, environment...).
  tree=$(abs "${DTENSOR_GPU_CHECK_TREE:-build}")
  if ! gpu_targets "$tree" >/dev/null 2>&1; then
    echo "gpu_check self-test: the step policy passed; no CUDA/NCCL build tree at $tree for the dry runs: skipped"
    exit 77
  fi
  dry() {
    local want=$1 grep_for=$2
    shift 2
    local out rc
    out=$(env "$@" DTENSOR_GPU_BUILD="$build/dry" bash "${dry_script:-$script}" --dry-run "$tree" 2>&1)
    rc=$?
    if [ "$want" = 0 ] && [ $rc != 0 ]; then fail_test "dry run with $* exited $rc, expected 0:"$'\n'"$out"; fi
    if [ "$want" != 0 ] && [ $rc = 0 ]; then fail_test "dry run with $* exited 0, expected non-zero:"$'\n'"$out"; fi
    if ! grep -qE -- "$grep_for" <<<"$out"; then fail_test "dry run with $* did not print /$grep_for/:"$'\n'"$out"; fi
    dry_out=$out
  }
  dry 0 'every step ran and passed' DTENSOR_GPU_CHECK_DRY_FAIL= # the planned sequence validates and fits
  plan=$(sed -n 's/.*(plan \([0-9]*\)s expected.*/\1/p' <<<"$dry_out")
  [ -n "$plan" ] && [ "$plan" -le 240 ] || fail_test "the plan of the prebuilt path is ${plan:-?} s, more than 240"
  # the order of value: one rank, 2 and 4 processes, timeout and mismatch, CUDA tests, training, benchmarks
  want="nccl_suite, one-rank communicators|nccl_suite, 2 processes|nccl_suite, 4 processes|nccl watchdog timeout, 2 processes|nccl count mismatch named, 2 processes|core_test_tensor_cuda|06_train_cuda --layout tp, 2 processes|bench_nccl, one rank (4 B..16 MiB)"
  order=$(sed -n 's/^gpu_check: \(.\{48\}\).*/\1/p' <<<"$dry_out" | sed 's/ *$//' | grep -Fx "${want//|/$'\n'}" | paste -sd'|')
  [ "$order" = "$want" ] || fail_test "the steps ran out of order: $order"
  # The policy alone (the commands not executed: the run above validated them).
  export DTENSOR_GPU_CHECK_DRY_EXEC=0
  dry 1 'nccl_suite, 4 processes +FAIL' DTENSOR_GPU_CHECK_DRY_FAIL='4 processes'         # a failed step
  dry 1 'nccl_suite, 2 processes +FAIL .*skipped' DTENSOR_GPU_CHECK_DRY_SKIP='^nccl_suite, 2' # a GPU test skipped
  dry 0 'torch DTensor available +SKIP' DTENSOR_GPU_CHECK_DRY_SKIP='^torch DTensor available' # the one allowed skip
  dry 1 'NOT RUN +0s .*the time budget' DTENSOR_GPU_BUDGET_S=120                          # steps cut by the budget
  dry 1 '06_train_cuda --layout fsdp, 2 processes +FAIL +0s .*not built' DTENSOR_GPU_CHECK_DRY_MISSING='^example_06_train_cuda$'
  dry 1 'core_test_tensor_cuda +FAIL +0s .*not built' DTENSOR_GPU_CHECK_DRY_MISSING='^core_test_tensor_cuda$'
  dry 1 'pre-flight: compute mode +FAIL.*Exclusive_Process' DTENSOR_GPU_CHECK_DRY_SMI='Exclusive_Process,Disabled,13.0'
  grep -q 'nccl_suite, one-rank' <<<"$dry_out" && fail_test "steps ran after a failed pre-flight"
  dry 1 'pre-flight: MIG +FAIL' DTENSOR_GPU_CHECK_DRY_SMI='Default,Enabled,13.0'
  dry 1 'pre-flight: driver +FAIL.*12.4' DTENSOR_GPU_CHECK_DRY_SMI='Default,Disabled,12.4'

  # The dry run catches the defects the first version of this script had (issue 52): reintroduced in a copy
  # of it, each must fail the dry run, with the message the real run would give.
  export DTENSOR_GPU_CHECK_DRY_EXEC=1
  defect="$build/defect"
  rm -rf "$defect"
  mkdir -p "$defect/scripts/lib"
  ln -s "$root/bench" "$defect/bench"
  cp "$root/scripts/lib/gpu_targets.sh" "$defect/scripts/lib/"
  # (1) the extra arguments of a multi-process step after the suite's path: "nccl_suite env ...".
  sed 's|"${multi\[@\]}" "$procs" "$suite" "$@"|"${multi[@]}" "$procs" "$suite" env "$@"|' "$script" >"$defect/scripts/gpu_check.sh"
  cmp -s "$script" "$defect/scripts/gpu_check.sh" && fail_test "defect 1 could not be reintroduced"
  dry_script="$defect/scripts/gpu_check.sh" dry 1 "nccl_suite, 2 processes +FAIL" DTENSOR_GPU_CHECK_DRY_FAIL=
  grep -q "unknown mode 'env'" "$build/dry/gpu_check_logs/nccl_suite__2_processes.log" ||
    fail_test "defect 1's dry run did not say: unknown mode 'env'"
  # (2) every *.cu.o target taken as a program, the OBJECT library core_two_tu_device_tu among them.
  sed 's|^      nccl_suite) ;;|      nccl_suite) ;;\n      core_two_tu_host_first) cuda_tests="$cuda_tests core_two_tu_device_tu" ;;|' \
    "$root/scripts/lib/gpu_targets.sh" >"$defect/scripts/lib/gpu_targets.sh"
  cp "$script" "$defect/scripts/gpu_check.sh"
  cmp -s "$root/scripts/lib/gpu_targets.sh" "$defect/scripts/lib/gpu_targets.sh" && fail_test "defect 2 could not be reintroduced"
  dry_script="$defect/scripts/gpu_check.sh" dry 1 "core_two_tu_device_tu +FAIL +0s .*not built" DTENSOR_GPU_CHECK_DRY_FAIL=
  echo "gpu_check self-test: passed (the step policy and a batch; a dry run of every real command line, plan" \
       "${plan} s; 9 dry runs of the policy's failure paths; both defects of issue 52 fail the dry run)"
  exit 0
fi

# ---- 0. the machine and the pre-flight ----------------------------------------------------------------
if [ "$mode" = dry ]; then
  IFS=, read -r smi_mode smi_mig smi_cuda <<<"${DTENSOR_GPU_CHECK_DRY_SMI:-Default,Disabled,13.0}"
  smi_list="GPU 0: NVIDIA H100 (dry run)"
else
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi 2>&1 | head -n 12 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=index,name,driver_version,compute_mode,mig.mode.current,memory.used --format=csv 2>&1 || true
    echo "glibc: $(getconf GNU_LIBC_VERSION 2>&1); c++: $(c++ --version 2>&1 | head -1)"
    echo "cmake: $(cmake --version 2>&1 | head -1); ninja: $(ninja --version 2>&1)"
  } | tee "$logs/machine.log"
  smi_list=$(nvidia-smi -L 2>/dev/null | grep '^GPU' || true)
  smi_mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader -i 0 2>/dev/null | tr -d ' ')
  smi_mig=$(nvidia-smi --query-gpu=mig.mode.current --format=csv,noheader -i 0 2>/dev/null | tr -d ' ')
  smi_cuda=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | grep -o '[0-9.]*$')
fi
if [ -z "$smi_list" ]; then
  record "pre-flight: a GPU is listed" FAIL 0 0 "nvidia-smi lists no GPU: gpu_check.sh runs on a GPU machine"
  finish
fi
record "pre-flight: a GPU is listed" PASS 0 0 "$(head -1 <<<"$smi_list" | cut -c1-60)"
if [ "$smi_mode" != Default ]; then
  record "pre-flight: compute mode" FAIL 0 0 "GPU 0 is in compute mode '$smi_mode': the multi-process steps put several processes on it; set Default (nvidia-smi -c DEFAULT)"
  finish
fi
record "pre-flight: compute mode" PASS 0 0 "Default"
case "$smi_mig" in
  Disabled|N/A|"[N/A]"|"") record "pre-flight: MIG" PASS 0 0 "${smi_mig:-not reported}" ;;
  *) record "pre-flight: MIG" FAIL 0 0 "MIG mode is '$smi_mig' on GPU 0: NCCL's tests need the whole GPU (MIG off)"
     finish ;;
esac
if [ -z "$smi_cuda" ] || [ "${smi_cuda%%.*}" -lt 13 ]; then
  record "pre-flight: driver" FAIL 0 0 "the driver supports CUDA ${smi_cuda:-?}; the programs need CUDA 13 (driver 580 or newer)"
  finish
fi
record "pre-flight: driver" PASS 0 0 "supports CUDA $smi_cuda"

# ---- 1. the programs: the pack (or, below its floor, a build here), and the libraries they load -----------
# prog TARGET: the program's path, or empty when it was not built.
if [ "$mode" = dry ]; then
  stubs="$build/dry_stubs"
  rm -rf "$stubs"
  mkdir -p "$stubs"
  if ! gpu_targets "$tree" 2>"$logs/targets.log"; then
    record "programs of the build tree" FAIL 0 0 "$(head -1 "$logs/targets.log") (configure and build it first)"
    finish
  fi
  prog() {
    local t=$1 p
    if [ -n "${DTENSOR_GPU_CHECK_DRY_MISSING:-}" ] && [[ $t =~ $DTENSOR_GPU_CHECK_DRY_MISSING ]]; then return; fi
    p=$(gpu_program "$tree" "$t")
    [ -z "$p" ] && return
    if [[ " $cuda_tests " == *" $t "* ]]; then
      # A CUDA test program: the check runs it with no arguments; the stub takes none and checks it loads.
      cat >"$stubs/$t" <<EOF
#!/usr/bin/env bash
[ \$# -eq 0 ] || { echo "$t: invalid: the check runs it with no arguments, got: \$*" >&2; exit 2; }
missing=\$(ldd -r "$p" 2>&1 | grep -E 'not found|undefined symbol')
[ -z "\$missing" ] || { echo "$t: invalid: \$missing" >&2; exit 2; }
echo "$t: valid: no arguments, loads"
EOF
      chmod +x "$stubs/$t"
      echo "$stubs/$t"
    else
      echo "$p"
    fi
  }
  export DTENSOR_GPU_CHECK_VALIDATE=1
  source_note="the build tree ${tree#$root/}"
else
  # NCCL: the machine's (the nvidia-nccl-cu13 wheel), else the toolkit's; cuBLAS and the CUDA runtime: the
  # toolkit's, else the wheels'.
  py=${DTENSOR_GPU_PYTHON:-python3}
  nccl=${NCCL_ROOT:-}
  [ -z "$nccl" ] && nccl=$("$py" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
  { [ -z "$nccl" ] || [ ! -f "$nccl/include/nccl.h" ]; } && nccl=/usr/local/cuda
  libdirs="$nccl/lib"
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
           $("$py" -c 'import nvidia, os; [print(os.path.join(p, d, "lib")) for p in nvidia.__path__ for d in ("cublas", "cuda_runtime", "cu13")]' 2>/dev/null); do
    [ -d "$d" ] && libdirs="$libdirs:$d"
  done
  echo "NCCL at $nccl; libraries searched: $libdirs" | tee -a "$logs/machine.log"

  use_pack=0
  unpacked="$build/pack"
  if [ -f "$pack/dtensor-gpu.tar.xz" ]; then
    rm -rf "$unpacked"
    mkdir -p "$unpacked"
    if ! tar -xJf "$pack/dtensor-gpu.tar.xz" -C "$unpacked" 2>"$logs/unpack.log"; then
      record "pack: unpack" FAIL 0 2 "$(head -1 "$logs/unpack.log")"
    else
      floor=$(sed -n 's/^glibc //p' "$unpacked/FLOOR")
      have=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
      if [ "$(printf '%s\n%s\n' "$floor" "$have" | sort -V | head -1)" != "$floor" ]; then
        record "pack: floor" SKIP 0 0 "the pack needs glibc $floor, this machine has $have: building here instead"
      else
        export LD_LIBRARY_PATH="$unpacked/lib:$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        step "pack: every program loads (ldd -r)" 30 2 bash -c '
          bad=0
          for p in "$1"/bin/*; do
            m=$(ldd -r "$p" 2>&1 | grep -E "not found|undefined symbol" | sort -u | head -3)
            [ -n "$m" ] && { echo "${p##*/}: $m"; bad=1; }
          done
          exit $bad' _ "$unpacked" && use_pack=1 # a pack that does not load fails the check, and is built here
        # shellcheck disable=SC1091
        source "$unpacked/TARGETS"
        source_note="the pack ($(head -1 "$unpacked/MANIFEST" | cut -c1-60))"
      fi
    fi
  else
    record "pack: none" SKIP 0 0 "no $pack/dtensor-gpu.tar.xz (scripts/gpu_prepare.sh makes it): building here"
  fi
  if [ $use_pack = 1 ]; then
    prog() { [ -x "$unpacked/bin/$1" ] && echo "$unpacked/bin/$1"; return 0; }
  else
    # ---- the fallback: configure and build the programs on this machine ------------------------------
    [ -z "${DTENSOR_GPU_BUDGET_S:-}" ] && budget=570
    deps="$unpacked/deps"
    [ -d "$deps" ] || deps=$(abs "${DTENSOR_GPU_DEPS:-build-gpu-deps}")
    nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    if [ ! -x "$nvcc" ]; then
      record "find nvcc" FAIL 0 0 "no pack and no nvcc (set CUDACXX, or run scripts/gpu_prepare.sh and carry build-gpu-pack)"
      finish
    fi
    nccl_cmake_root=$nccl
    ncclib=$(ls "$nccl"/lib/libnccl.so* 2>/dev/null | head -1)
    if [ -n "$ncclib" ] && [ ! -e "$nccl/lib/libnccl.so" ]; then
      # The wheel ships only libnccl.so.2; give the linker the unversioned name in our build folder.
      mkdir -p "$build/nccl-link/lib" "$build/nccl-link/include"
      ln -sf "$ncclib" "$build/nccl-link/lib/libnccl.so"
      ln -sf "$nccl/include/"nccl*.h "$build/nccl-link/include/"
      nccl_cmake_root="$build/nccl-link"
    fi
    export LD_LIBRARY_PATH="$deps/openblas/lib:$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    cmake_args=(-DCMAKE_DISABLE_FIND_PACKAGE_Gloo=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
    if [ -f "$deps/catch2/src/catch_main.cpp" ]; then
      if [ ! -f "$deps/catch2/lib/libCatch2WithMain.a" ]; then
        step "compile Catch2's main" 120 40 bash -c "
          c++ -std=c++17 -O1 -I'$deps/catch2/include' -c '$deps/catch2/src/catch_main.cpp' -o '$build/catch_main.o' &&
          ar rcs '$deps/catch2/lib/libCatch2WithMain.a' '$build/catch_main.o'" || finish
      fi
      cmake_args+=("-DCatch2_DIR=$deps/catch2/lib/cmake/Catch2")
    fi
    [ -f "$deps/openblas/include/cblas.h" ] &&
      cmake_args+=("-DBLAS_openblas_LIBRARY=$deps/openblas/lib/libopenblas.so" "-DCBLAS_INCLUDE_DIR=$deps/openblas/include")
    [ -d "$deps/random123/include" ] && cmake_args+=("-DDTENSOR_RANDOM123_INCLUDE_DIR=$deps/random123/include")
    [ -d "$deps/dlpack/include" ] && cmake_args+=("-DDTENSOR_DLPACK_INCLUDE_DIR=$deps/dlpack/include")
    tree="$build/tree"
    step "configure here (fallback: CUDA + NCCL)" 120 20 cmake -S "$root" -B "$tree" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 -DNCCL_ROOT="$nccl_cmake_root" \
      -DDTENSOR_BUILD_EXAMPLES=ON -DDTENSOR_BUILD_BENCH=ON "${cmake_args[@]}" || finish
    gpu_targets "$tree" 2>>"$step_log" || { record "programs of the build tree" FAIL 0 0 "see ${step_log#$root/}"; finish; }
    # -k 0: a target that fails to compile costs only its own steps ("not built").
    step "build here (fallback): every program" 420 240 cmake --build "$tree" -j "$jobs" --target \
      $launcher_targets $cuda_tests $example_targets $bench_targets -- -k 0
    build_log=$step_log
    prog() {
      grep -Eq "^FAILED: (\[code=[0-9]+\] )?([^ ]*/)?(CMakeFiles/$1\.dir/|$1( |\$))" "$build_log" 2>/dev/null && return
      gpu_program "$tree" "$1"
    }
    source_note="built here (fallback)"
  fi
fi
echo "gpu_check: programs from $source_note: CUDA tests: ${cuda_tests:-none}; training: ${example_targets:-none};" \
     "benchmarks: ${bench_targets:-none}"

built() { # built PATH NAME: true when PATH is not empty, else records NAME as FAIL "not built"
  [ -n "$1" ] && return 0
  record "$2" FAIL 0 0 "not built"
  return 1
}

# ---- 2. NCCL: one rank, then processes on the one GPU ------------------------------------------------
# Single node, several processes on one GPU: each its own NCCL_HOSTID (DTENSOR_TEST_HOSTID_PER_RANK), so
# NCCL sees separate hosts and talks over its own socket transport on loopback; no network plugin, no
# InfiniBand, no NVLink SHARP or multi-node NVLink, so a stray plugin or fabric on the machine cannot be
# picked up. DTENSOR_TIMEOUT: a hang costs seconds, not the budget.
export NCCL_NET=Socket NCCL_NET_PLUGIN=none NCCL_IB_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_MNNVL_ENABLE=0 \
       NCCL_SOCKET_IFNAME=lo DTENSOR_TEST_HOSTID_PER_RANK=1 DTENSOR_TIMEOUT=20
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
run=$(prog dtensor-run)
suite=$(prog nccl_suite)
multi=("$run" --standalone --backend nccl --stop-timeout 5 --nproc-per-node)

# nccl_step NAME TIMEOUT EXPECTED PROCS [VAR=VALUE...] [MODE]: the suite alone (PROCS 1) or under the
# launcher, with the environment assignments in front of the command (env VAR=VALUE ... program mode).
nccl_step() {
  local name=$1 limit=$2 needed=$3 procs=$4
  shift 4
  local vars=()
  while [ $# -gt 0 ] && [[ $1 == *=* ]]; do vars+=("$1"); shift; done
  built "$suite" "$name" || return
  if [ "$procs" = 1 ]; then
    step "$name" "$limit" "$needed" env "${vars[@]}" "$suite" "$@"
  else
    built "$run" "$name" || return
    step "$name" "$limit" "$needed" env "${vars[@]}" "${multi[@]}" "$procs" "$suite" "$@"
  fi
}
nccl_step "nccl_suite, one-rank communicators" 60 10 1
nccl_step "nccl_suite, 2 processes" 60 15 2 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,ENV
if [ "$mode" = run ] && [ -f "$step_log" ]; then
  transport=$(grep -m1 -oE 'NET/(Socket|IB|Plugin)[^ ]*( : [^ ]+)?' "$step_log" || true)
  echo "gpu_check: the 2-process suite's network: ${transport:-not reported} (NCCL_DEBUG=INFO in ${step_log#$root/})"
fi
nccl_step "nccl_suite, 4 processes" 90 20 4

# ---- 3. at once: NCCL's failure paths and the CUDA test programs ------------------------------------
# Failures: a member missing in an op (then every wait and the next op raise), in the first op's connection
# set-up, in ncclCommInitRankConfig; mismatched ops (every rank errs, none passes by NCCL completing them),
# and under DTENSOR_DEBUG=detail before anything is sent; blocking communicators (DTENSOR_NCCL_NONBLOCKING=0;
# nonblocking is the default; not the set-up timeouts: a blocking call stuck in NCCL cannot be interrupted,
# by design). Each pair of processes has its own store, port and NCCL_HOSTIDs; the modes' own sleeps (8 s)
# and timeouts (2 s) set their expectations.
batch_begin
nccl_step "nccl watchdog beside a global-mode graph capture" 30 10 1 capture_watchdog
nccl_step "nccl watchdog timeout, 2 processes" 60 20 2 timeout
nccl_step "nccl count mismatch named, 2 processes" 90 30 2 mismatch
nccl_step "nccl member missing at connection set-up" 60 20 2 connect_timeout
nccl_step "nccl member missing at ncclCommInitRankConfig" 60 20 2 init_timeout
nccl_step "nccl mismatch caught by detail before sending" 60 10 2 mismatch_detail
nccl_step "nccl_suite, 2 processes, blocking" 60 15 2 DTENSOR_NCCL_NONBLOCKING=0
nccl_step "nccl watchdog timeout, blocking" 60 20 2 DTENSOR_NCCL_NONBLOCKING=0 timeout
for t in $cuda_tests; do
  bin=$(prog "$t")
  built "$bin" "$t" && step "$t" 90 10 "$bin"
done
batch_end

# ---- 4. training on the GPU: example_06_train_cuda, every layout, 2 processes each, all at once -------
# The model of examples/06_train.cpp on device tensors (cuBLAS, the library's CUDA kernels, NCCL), 3 steps in
# float with sizes no mesh axis divides; each run checks every loss and the final parameters against the
# same training on one rank (1e-4) and each step's collectives against the layout's, and exits 1 otherwise.
# Meshes for 2 ranks: tp and tp_cm (1,1,2), ddp and fsdp (1,2,1), hsdp (2,1,1), fsdp_tp (1,1,2). tp_cm runs
# the collective matmuls (ops/collective_matmul.hpp): their exchanges on the group's NCCL stream beside the
# cuBLAS GEMMs on the tensors' stream.
train=""
[ -n "$example_targets" ] && train=$(prog example_06_train_cuda)
batch_begin
for layout in tp tp_cm ddp fsdp hsdp fsdp_tp; do
  name="06_train_cuda --layout $layout, 2 processes"
  built "$train" "$name" && built "$run" "$name" && step "$name" 60 25 "${multi[@]}" 2 \
    "$train" --layout "$layout" --hidden 30 --ffn 42 --vocab 61 --steps 3
done
batch_end

# ---- 5. benchmarks (BENCHMARKS.md, "GPU"): small sizes, few samples, JSON into $results, one at a time -----
bnccl=$(prog bench_nccl)
bred=$(prog bench_redistribution_cuda)
torch_bench="$root/bench/redistribution/torch_dtensor_bench.py"
py=${DTENSOR_GPU_PYTHON:-python3}
# torch's processes under dtensor-run with torchrun's environment, rank 0 hosting torch's own store (as torchrun
# leaves it): one launcher for both sides, and none of torchrun's version differences (1.13's refuses
# --nproc-per-node, and with Python 3.11 its default --redirects 0).
torchrun=("$run" --standalone --rank0-store --stop-timeout 5 --nproc-per-node)
name="bench_nccl, one rank (4 B..16 MiB)"
built "$bnccl" "$name" && step "$name" 60 10 "$bnccl" --out "$results" --max-bytes 16777216 --scale 0.5
name="redistribution on CUDA, one rank"
built "$bred" "$name" && step "$name" 60 10 "$bred" --device cuda --out "$results" --scale 0.34
# ~4 ms per collective over sockets between processes on one GPU; rows are written as they finish, so a cut
# run keeps what it measured.
name="bench_nccl, 2 processes (4 B..64 KiB)"
built "$bnccl" "$name" && built "$run" "$name" &&
  step "$name" 90 25 "${multi[@]}" 2 "$bnccl" --out "$results" --max-bytes 65536 --scale 0.2
name="redistribution on CUDA, 2 processes"
built "$bred" "$name" && built "$run" "$name" &&
  step "$name" 90 25 "${multi[@]}" 2 "$bred" --device cuda --out "$results" --scale 0.34
step --may-skip "torch DTensor available" 45 10 "$py" "$torch_bench" --check
torch_rc=$?
for procs in 1 2; do
  name="torch DTensor redistribution, $procs process(es)"
  needed=$((procs == 1 ? 15 : 25))
  case $torch_rc in
    0) step "$name" 120 "$needed" "${torchrun[@]}" "$procs" "$py" "$torch_bench" --out "$results" --scale 0.34 ;;
    77) record "$name" SKIP 0 "$needed" "no torch DTensor on CUDA here (the step above says why)" ;;
    *) record "$name" "NOT RUN" 0 "$needed" "the torch check did not pass" ;;
  esac
done

finish

#!/usr/bin/env bash
# The sanitizer runs of the test command (issue 18): the tests of the layers that own memory, threads and
# sockets, built and run under ASan + UBSan and under TSan. A documented subset of the suite, to stay
# inside CI's time budget on 2 cores: the compute layers (ops/, nn/, train/) are pure index arithmetic over
# the same Tensor code and run under ASan + UBSan only through the layers listed here.
#
#   scripts/sanitize.sh            # both configurations
#   scripts/sanitize.sh asan|tsan  # one
#
# Any report fails the run (UBSan does not recover; TSan exits 66). tests/sanitizers/tsan.supp lists the
# only suppressions, each a race TSan reports inside an uninstrumented library.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/phases.sh
phases_begin

phase "sanitize: install missing packages" scripts/deps.sh

# Tests that own threads, sockets or raw memory: the Tensor core, the store, every collective and
# point-to-point path of the gloo backend (and its error, mismatch and group paths), DTensor
# redistribution, the object collectives, DDP's overlapped buckets, the real-process suites under
# dtensor-run (launcher, store rendezvous, gloo suite, faults) and under mpirun (the MPI backend, its
# store and faults; ASan + UBSan only: Open MPI's own threads are not instrumented, so TSan cannot see
# their synchronisation, and tests/sanitizers/lsan.supp names the memory Open MPI keeps past exit).
asan_targets=(core_test_tensor local_test_copy rendezvous_test_store backends_test_nccl_watchdog comm_test_collectives comm_test_p2p
              comm_test_errors comm_test_mismatch comm_test_groups comm_test_backend_front comm_test_object tensor_test_dtensor
              train_test_ddp run_test_init run_rank_program run_launcher_test run_gloo_suite
              run_fault_program dtensor-run run_mpi_suite run_test_mpi_store run_mpi_fault_program)
asan_tests='^(core|local|rendezvous|backends|comm|tensor|train|run)/'
# The threaded tests: store server, the NCCL watchdog's policy (against fakes), backend executors and
# completers, async work, DDP's bucket hooks.
tsan_targets=(rendezvous_test_store backends_test_nccl_watchdog comm_test_collectives comm_test_p2p comm_test_errors
              comm_test_mismatch comm_test_object
              comm_test_groups comm_test_backend_front train_test_ddp)
tsan_tests='^(rendezvous/|backends/|comm/|train/)'

# The tests under mpirun, started by it or by dtensor-run (Open MPI's stacks need the slow unwinder for
# lsan.supp to match them).
mpi_tests='^run/(mpi_|gloo_suite_over_mpi|launcher/mpi_)'

run() { # preset, ctest regex, targets...
  local preset=$1 regex=$2
  shift 2
  phase "$preset: configure" cmake --preset "$preset" || return
  phase "$preset: build" cmake --build --preset "$preset" --target "$@" || return
  # Catch2 adds a <target>_NOT_BUILT entry for each test executable outside the subset.
  phase "$preset: ctest" ctest --preset "$preset" -R "$regex" -E "_NOT_BUILT|$mpi_tests"
}

status=0
which=${1:-all}
if [[ $which == all || $which == asan ]]; then
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1 \
    LSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/lsan.supp \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    run asan "$asan_tests" "${asan_targets[@]}" || status=1
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1:fast_unwind_on_malloc=0 \
    LSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/lsan.supp UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    phase "asan: ctest under mpirun" ctest --preset asan -R "$mpi_tests" -E '_NOT_BUILT' || status=1
fi
if [[ $which == all || $which == tsan ]]; then
  TSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/tsan.supp:halt_on_error=0:second_deadlock_stack=1" \
    run tsan "$tsan_tests" "${tsan_targets[@]}" || status=1
fi
if [[ ${phases_owner:-0} == 1 ]]; then
  print_phases "scripts/sanitize.sh phases"
fi
exit $status

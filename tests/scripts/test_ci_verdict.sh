#!/usr/bin/env bash
# CI judges the code, not the machine: the real .ci/run, scripts/test.sh and scripts/sanitize.sh, in a copy of
# the tree whose cmake, ctest, compiler and package installer are stubs that sleep, run under a clock made
# K times as fast (DTENSOR_CLOCK_SCALE: a machine K times slower).
#   - a machine slow enough that the test command takes 2100 s (the old gate failed above 1440 s) passes,
#     and prints the test command in calibration units equal (within noise) to a 3x slower machine's;
#   - a failed phase fails, naming it;
#   - a run past the 75-minute limit fails.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/dtensor-ci-verdict.XXXXXX")
trap 'rm -rf "$work"' EXIT

tree=$work/tree
mkdir -p "$tree/.ci" "$tree/scripts/lib" "$work/bin"
cp "$src/.ci/run" "$tree/.ci/"
cp "$src/scripts/test.sh" "$src/scripts/sanitize.sh" "$tree/scripts/"
cp "$src/scripts/lib/phases.sh" "$src/scripts/lib/ci.sh" "$src/scripts/lib/calibrate.cpp" "$tree/scripts/lib/"
printf '#!/bin/sh\nexit 0\n' >"$tree/scripts/deps.sh"
chmod +x "$tree/scripts/deps.sh"
# The stubs: the test build takes 1 s, ctest 0.5 s, every other cmake or ctest call 0.05 s, a compile of the
# calibration unit 0.2 s; STUB_FAIL names a call ("ctest --preset default") that exits 1.
cat >"$work/bin/stub" <<'STUB'
#!/usr/bin/env bash
what="$(basename "$0") $*"
case "$what" in
  "cmake --build --preset default"*) sleep 1 ;;
  "ctest --preset default"*) sleep 0.5 ;;
  c++*) sleep 0.2; for ((i = 1; i <= $#; ++i)); do [[ ${!i} == -o ]] && { j=$((i + 1)); : >"${!j}"; }; done ;;
  *) sleep 0.05 ;;
esac
[[ -n ${STUB_FAIL:-} && $what == "$STUB_FAIL"* ]] && { echo "stub: $what failed"; exit 1; }
[[ $what == c++*--version* ]] && echo "stub c++ 1.0"
exit 0
STUB
chmod +x "$work/bin/stub"
for t in cmake ctest c++; do ln -s stub "$work/bin/$t"; done

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
run_ci() { # run_ci SCALE [VAR=VALUE...]: .ci/run's output in $out, its status in $rc
  local scale=$1
  shift
  rc=0
  out=$(cd "$tree" && env -u DTENSOR_PHASE_LOG PATH="$work/bin:$PATH" CXX=c++ DTENSOR_CLOCK_SCALE="$scale" "$@" \
        bash .ci/run 2>&1) || rc=$?
}
test_cal() { sed -n 's/^budgets.*test command [0-9]* s = \([0-9.]*\) cal.*/\1/p' <<<"$out"; }

# A slow machine: the test command takes about 1000 + 500 + 3 x 200 (calibration) + 4 x 50 s.
run_ci 1000 DTENSOR_TEST_BUDGET_CAL=5 # a goal this run is over: noted, not failed
test_s=$(sed -n 's/^budgets.*test command \([0-9]*\) s.*/\1/p' <<<"$out")
[[ $rc == 0 ]] || fail "a slow machine failed CI (exit $rc):"$'\n'"$out"
((${test_s:-0} > 1440)) || fail "the slow machine's test command took only ${test_s:-?} s: the case proves nothing"
grep -q '^ci: passed' <<<"$out" || fail "no 'ci: passed' line"
grep -q 'over its goal' <<<"$out" || fail "the test command over its goal is not noted"
grep -qE '^test: build +[0-9]+ +[0-9.]+ +ok' <<<"$out" || fail "the phase table has no calibration column"
slow_cal=$(test_cal)

# A machine 3x slower still: the same work in the same calibration units.
run_ci 3000 DTENSOR_CI_LIMIT_S=100000
[[ $rc == 0 ]] || fail "a 3x slower machine failed CI (exit $rc)"
slower_cal=$(test_cal)
awk -v a="$slow_cal" -v b="$slower_cal" 'BEGIN { exit !(a > 0 && b / a > 0.8 && b / a < 1.25) }' ||
  fail "the test command in calibration units differs between a slow and a 3x slower machine: $slow_cal vs $slower_cal"

# A failed phase fails CI, on a fast machine too.
run_ci 1 STUB_FAIL="ctest --preset default"
[[ $rc != 0 ]] || fail "a failed ctest phase passed CI"
grep -qE '^test: ctest .*exit 1' <<<"$out" || fail "the failed phase is not shown as failed:"$'\n'"$out"
grep -q 'FAILED: a phase failed' <<<"$out" || fail "no 'a phase failed' verdict"

# Past the limit where CI would be cut off: fails.
run_ci 3000
[[ $rc != 0 ]] || fail "a run past the 75-minute limit passed CI:"$'\n'"$out"
grep -q 'past its limit of 4500 s' <<<"$out" || fail "no limit verdict:"$'\n'"$out"

if ((failures)); then
  exit 1
fi
echo "ci verdict: a slow machine passes (test command ${test_s} s = $slow_cal cal; 3x slower: $slower_cal cal)," \
     "a failed phase fails, a run past 75 min fails"

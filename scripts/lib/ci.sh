# CI's calibration and verdict (sourced by .ci/run and tests/scripts/test_ci_verdict.sh, after phases.sh).
#
# The verdict judges the code, not the machine: CI fails on a failed phase, or when the whole run passes the
# wall time past which CI would be cut off anyway (DTENSOR_CI_LIMIT_S, default 75 min of CI's 90). The budgets
# (the test command <= 15 min, .ci/run <= 35 min on the reference run of docs/testing.md) are goals: printed
# in seconds and in calibration units, never a reason to fail. These VMs differ 2x in speed between sessions;
# the calibration unit (the time this machine takes to compile scripts/lib/calibrate.cpp, timed at the start)
# makes runs on different machines comparable.

calibration_name="cal" # 1 cal: the fastest of 3 compiles of scripts/lib/calibrate.cpp at -O0 (C++20)

# Budgets in calibration units, from the reference run (docs/testing.md#budgets): the seconds of the budget
# over that run's calibration unit.
test_budget_cal=${DTENSOR_TEST_BUDGET_CAL:-350}
ci_budget_cal=${DTENSOR_CI_BUDGET_CAL:-820}

# calibrate: times the unit once per phase log (a script nested in another that calibrated does not again)
# and writes its seconds (two decimals) to $DTENSOR_PHASE_LOG.cal, where calibration_s reads it; its own
# time is the phase "calibration". A compiler that cannot compile it leaves the phases in seconds only (the
# build phase then fails on its own).
calibrate() {
  [[ -s $DTENSOR_PHASE_LOG.cal ]] && return 0
  local src best="" t0 t1 dt i out start unit
  src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/calibrate.cpp"
  out=$(mktemp "${TMPDIR:-/tmp}/dtensor-calibrate.XXXXXX")
  start=$(phases_clock_ns)
  for i in 1 2 3; do
    t0=$(phases_clock_ns)
    if ! "${CXX:-c++}" -std=c++20 -O0 -c "$src" -o "$out" 2>/dev/null; then
      rm -f "$out"
      echo "ci: calibration: ${CXX:-c++} could not compile $src; phases are in seconds only"
      return 0
    fi
    t1=$(phases_clock_ns)
    dt=$(((t1 - t0) / 10000000)) # hundredths of a second
    if [[ -z $best ]] || ((dt < best)); then best=$dt; fi
  done
  rm -f "$out"
  ((best > 0)) || best=1
  unit=$(printf '%d.%02d' $((best / 100)) $((best % 100)))
  printf 'calibration\t%s\t0\n' $((($(phases_clock_ns) - start) / 1000000000)) >>"$DTENSOR_PHASE_LOG"
  echo "$unit" >"$DTENSOR_PHASE_LOG.cal"
  echo "ci: calibration: 1 $calibration_name = $unit s (the fastest of 3 compiles of scripts/lib/calibrate.cpp" \
       "by $("${CXX:-c++}" --version | head -1))"
}

calibration_s() { cat "$DTENSOR_PHASE_LOG.cal" 2>/dev/null || true; } # empty without a calibration

# in_cal SECONDS: the seconds in calibration units (one decimal), or "-" without a calibration.
in_cal() {
  local unit
  unit=$(calibration_s)
  if [[ -z $unit ]]; then
    echo "-"
  else
    awk -v s="$1" -v c="$unit" 'BEGIN { printf "%.1f", s / c }'
  fi
}

# ci_verdict STATUS TEST_TOTAL_S CI_TOTAL_S: prints the budget lines and returns CI's exit status: STATUS
# (non-zero when a phase failed), or 1 when the run passed the wall-time limit.
ci_verdict() {
  local status=$1 test_total=$2 ci_total=$3 limit=${DTENSOR_CI_LIMIT_S:-4500}
  local test_cal ci_cal
  test_cal=$(in_cal "$test_total")
  ci_cal=$(in_cal "$ci_total")
  printf 'budgets (goals, not gates): test command %d s = %s %s (goal %d %s); CI %d s = %s %s (goal %d %s)\n' \
    "$test_total" "$test_cal" "$calibration_name" "$test_budget_cal" "$calibration_name" \
    "$ci_total" "$ci_cal" "$calibration_name" "$ci_budget_cal" "$calibration_name"
  if [[ $test_cal != - ]] && awk -v a="$test_cal" -v b="$test_budget_cal" 'BEGIN { exit !(a > b) }'; then
    echo "ci: note: the test command took $test_cal $calibration_name, over its goal of $test_budget_cal:" \
         "find the phase above that grew (ninja -C build -t recompact; .ninja_log) before adding more."
  fi
  if [[ $ci_cal != - ]] && awk -v a="$ci_cal" -v b="$ci_budget_cal" 'BEGIN { exit !(a > b) }'; then
    echo "ci: note: CI took $ci_cal $calibration_name, over its goal of $ci_budget_cal (see the phases above)."
  fi
  if ((status != 0)); then
    echo "ci: FAILED: a phase failed (the table above says which)."
    return "$status"
  fi
  if ((ci_total > limit)); then
    echo "ci: FAILED: CI took $ci_total s, past its limit of $limit s (CI is cut off at 90 min): make room" \
         "before adding more (the phases above, in $calibration_name, say where)."
    return 1
  fi
  echo "ci: passed"
  return 0
}

# Phase timing for the test and CI scripts (sourced, not run): `phase NAME command...` runs the command and
# appends "NAME<TAB>seconds<TAB>status" to $DTENSOR_PHASE_LOG; `print_phases [TITLE]` prints the table of
# every phase recorded there (and each phase in calibration units when scripts/lib/ci.sh's calibrate wrote
# $DTENSOR_PHASE_LOG.cal).
# A script that starts the log (`phases_begin`) owns it; one called by another (.ci/run runs scripts/test.sh
# and scripts/sanitize.sh) appends to its caller's.
#
# DTENSOR_CLOCK_SCALE=K (an integer, default 1) makes the clock run K times as fast: every phase and the
# calibration take K times as long as they did, as on a machine K times slower (the CI verdict's test).

phases_begin() { # starts a log unless a caller already did
  if [[ -z ${DTENSOR_PHASE_LOG:-} ]]; then
    DTENSOR_PHASE_LOG=$(mktemp "${TMPDIR:-/tmp}/dtensor-phases.XXXXXX")
    DTENSOR_CLOCK_ORIGIN=$(date +%s%N)
    export DTENSOR_PHASE_LOG DTENSOR_CLOCK_ORIGIN
    phases_owner=1
  fi
}

phases_clock_ns() { # nanoseconds since phases_begin, scaled by DTENSOR_CLOCK_SCALE
  echo $((($(date +%s%N) - ${DTENSOR_CLOCK_ORIGIN:-0}) * ${DTENSOR_CLOCK_SCALE:-1}))
}

phase() { # phase NAME command...: the command's status is returned; the time is recorded either way
  local name=$1 t0 rc
  shift
  t0=$(phases_clock_ns)
  echo "== phase: $name"
  rc=0
  "$@" || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$((($(phases_clock_ns) - t0) / 1000000000))" "$rc" >>"$DTENSOR_PHASE_LOG"
  return $rc
}

print_phases() { # print_phases TITLE: the table, and the sum of the phases
  awk -F'\t' -v title="$1" -v cal="$(cat "$DTENSOR_PHASE_LOG.cal" 2>/dev/null)" -v unit="${calibration_name:-cal}" '
    BEGIN {
      printf "\n%s\n%-44s %9s %9s  %s\n", title, "phase", "seconds", (cal == "" ? "" : unit), "status"
    }
    {
      printf "%-44s %9d %9s  %s\n", $1, $2, (cal == "" ? "" : sprintf("%.1f", $2 / cal)), ($3 == 0 ? "ok" : "exit " $3)
      total += $2
    }
    END {
      printf "%-44s %9d %9s  (%d min %d s)\n", "total", total, (cal == "" ? "" : sprintf("%.1f", total / cal)),
             total / 60, total % 60
      if (cal != "") printf "(1 %s = %s s on this machine, now)\n", unit, cal
    }' "$DTENSOR_PHASE_LOG"
}

phases_total() { # phases_total [PREFIX]: the seconds of every phase (whose name starts with PREFIX)
  awk -F'\t' -v prefix="${1:-}" 'index($1, prefix) == 1 { t += $2 } END { print t + 0 }' "$DTENSOR_PHASE_LOG"
}

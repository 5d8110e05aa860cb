# Phase timing for the test and CI scripts (sourced, not run): `phase NAME command...` runs the command and
# appends "NAME<TAB>seconds<TAB>status" to $DTENSOR_PHASE_LOG; `print_phases [TITLE]` prints the table of
# every phase recorded there. A script that starts the log (`phases_begin`) owns it; one called by another
# (.ci/run runs scripts/test.sh and scripts/sanitize.sh) appends to its caller's.

phases_begin() { # starts a log unless a caller already did
  if [[ -z ${DTENSOR_PHASE_LOG:-} ]]; then
    DTENSOR_PHASE_LOG=$(mktemp "${TMPDIR:-/tmp}/dtensor-phases.XXXXXX")
    export DTENSOR_PHASE_LOG
    phases_owner=1
  fi
}

phase() { # phase NAME command...: the command's status is returned; the time is recorded either way
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  echo "== phase: $name"
  rc=0
  "$@" || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$(($(date +%s) - t0))" "$rc" >>"$DTENSOR_PHASE_LOG"
  return $rc
}

print_phases() { # print_phases TITLE: the table, and the sum of the phases
  awk -F'\t' -v title="$1" '
    BEGIN { printf "\n%s\n%-44s %9s  %s\n", title, "phase", "seconds", "status" }
    { printf "%-44s %9d  %s\n", $1, $2, ($3 == 0 ? "ok" : "exit " $3); total += $2 }
    END { printf "%-44s %9d  (%d min %d s)\n", "total", total, total / 60, total % 60 }' "$DTENSOR_PHASE_LOG"
}

phases_total() { awk -F'\t' '{ t += $2 } END { print t + 0 }' "$DTENSOR_PHASE_LOG"; }

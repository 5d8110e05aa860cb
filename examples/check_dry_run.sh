#!/bin/sh
# The dry run against the real run: PROGRAM (which takes --comm-table PREFIX and writes what each rank
# communicated to PREFIX.<rank>) runs as NPROC processes under dtensor-run, then as each rank alone on the
# fake backend (DTENSOR_BACKEND=fake RANK=r WORLD_SIZE=NPROC); every rank's table must be the same, byte
# for byte.
#
# usage: check_dry_run.sh DIR NPROC DTENSOR_RUN PROGRAM [ARGS...]
set -u
dir=$1 nproc=$2 run=$3 program=$4
shift 4
rm -rf "$dir" && mkdir -p "$dir" || exit 1
"$run" --standalone --backend gloo --nproc-per-node "$nproc" --stop-timeout 5 "$program" "$@" \
  --comm-table "$dir/real" >"$dir/real.log" 2>&1 || {
  cat "$dir/real.log"
  echo "check_dry_run: the real run failed"
  exit 1
}
rc=0
r=0
while [ "$r" -lt "$nproc" ]; do
  if ! DTENSOR_BACKEND=fake RANK=$r WORLD_SIZE=$nproc "$program" "$@" --comm-table "$dir/fake" \
    >"$dir/fake.$r.log" 2>&1; then
    cat "$dir/fake.$r.log"
    echo "check_dry_run: the dry run of rank $r failed"
    rc=1
  elif ! diff -u "$dir/real.$r" "$dir/fake.$r"; then
    echo "check_dry_run: rank $r: the dry run's communication (+) differs from the real run's (-)"
    rc=1
  else
    echo "rank $r of $nproc: the dry run communicates what the real run does:"
    cat "$dir/fake.$r"
  fi
  r=$((r + 1))
done
[ "$rc" -eq 0 ] && rm -rf "$dir"
exit "$rc"

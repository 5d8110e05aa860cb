#!/bin/sh
# The dry run against the real run: PROGRAM (which takes --comm-table PREFIX and --memory-table PREFIX and
# writes what each rank communicated, and the host memory of its tensors, to PREFIX.<rank>) runs as NPROC
# processes under dtensor-run, then as each rank alone on the fake backend (DTENSOR_BACKEND=fake RANK=r
# WORLD_SIZE=NPROC). Every rank's communication table must be the same, byte for byte, and so must its
# memory table (the tensors' bytes by category, live, at the peak; the heap_peak line, the whole heap as
# the program measures it, is not compared). The real run's output is printed first; its exit status, when
# not 0, is this script's.
#
# With HEAP_TOLERANCE=P (a percentage) set, the script checks the real run alone, another way: each rank's
# tensor peak must be within P % of the heap peak it measured (every operator new), i.e. what the tables
# count (and the dry run, which counts the same) is what the process holds. Run it at sizes where tensors
# are most of the heap: the library's other allocations (plans, groups, the backend's) are a few hundred
# KB a rank.
#
# usage: check_dry_run.sh DIR NPROC DTENSOR_RUN PROGRAM [ARGS...]
set -u
dir=$1 nproc=$2 run=$3 program=$4
shift 4
rm -rf "$dir" && mkdir -p "$dir" || exit 1
"$run" --standalone --backend gloo --nproc-per-node "$nproc" --stop-timeout 5 "$program" "$@" \
  --comm-table "$dir/real" --memory-table "$dir/real.mem" >"$dir/real.log" 2>&1
rc=$?
cat "$dir/real.log"
if [ "$rc" -ne 0 ]; then
  # 77: the run skipped (as dtensor_add_multiprocess_test's SKIP_RETURN_CODE)
  [ "$rc" -eq 77 ] || echo "check_dry_run: the real run failed"
  exit "$rc"
fi
rc=0
r=0
while [ "$r" -lt "$nproc" ]; do
  grep -v '^heap_peak' "$dir/real.mem.$r" >"$dir/real.tensors.$r"
  if [ -n "${HEAP_TOLERANCE:-}" ]; then
    if ! awk -v tol="$HEAP_TOLERANCE" -v rank="$r" '
      $1 == "tensor_peak" { t = $2 }
      $1 == "heap_peak" { h = $2 }
      END {
        d = t > h ? t - h : h - t
        apart = h > 0 ? 100 * d / h : 100
        printf "rank %d: tensors at their peak %d bytes, the heap at its peak %d bytes: %.1f percent apart\n", rank, t, h, apart
        ok = h > 0 && apart <= tol
        exit (ok ? 0 : 1)
      }' "$dir/real.mem.$r"; then
      echo "check_dry_run: rank $r: the tensors' peak is more than $HEAP_TOLERANCE % from the heap's"
      rc=1
    fi
    r=$((r + 1))
    continue
  fi
  if ! DTENSOR_BACKEND=fake RANK=$r WORLD_SIZE=$nproc "$program" "$@" --comm-table "$dir/fake" \
    --memory-table "$dir/fake.mem" >"$dir/fake.$r.log" 2>&1; then
    cat "$dir/fake.$r.log"
    echo "check_dry_run: the dry run of rank $r failed"
    rc=1
  elif ! diff -u "$dir/real.$r" "$dir/fake.$r"; then
    echo "check_dry_run: rank $r: the dry run's communication (+) differs from the real run's (-)"
    rc=1
  elif ! grep -v '^heap_peak' "$dir/fake.mem.$r" | diff -u "$dir/real.tensors.$r" -; then
    echo "check_dry_run: rank $r: the dry run's memory (+) differs from the real run's (-)"
    rc=1
  else
    echo "rank $r of $nproc: the dry run communicates and holds what the real run does:"
    cat "$dir/fake.$r" "$dir/real.tensors.$r"
  fi
  r=$((r + 1))
done
[ "$rc" -eq 0 ] && rm -rf "$dir"
exit "$rc"

#!/usr/bin/env bash
# Compile cost (g++ -std=c++20 -O2, the flags of a Release build; median wall time and peak RSS of the
# compiler over `reps` runs):
#  - umbrella_header: a TU that includes <dtensor/dtensor.hpp>, next to one that includes only the standard
#    headers the dtensor headers it reaches include (BENCHMARKS.md, "Compile cost");
#  - redistributions_20: bench/compile/redistributions_tu.cpp -- the umbrella plus DTensor and 20 different
#    redistributions instantiated on 1-, 2- and 3-axis meshes -- next to a TU with only the standard
#    headers that TU reaches through dtensor;
#  - ops_20: bench/compile/ops_tu.cpp -- <dtensor/ops.hpp> plus 20 different ops on DTensors (pointwise,
#    reductions, transpose, matmul/linear when OpenBLAS's header is found) -- next to the umbrella alone;
#  - new_combination: the cost of a second (element type, rank, mesh) combination, i.e.
#    bench/compile/combination_new.cpp (two combinations, each distributed, redistributed twice and
#    gathered) next to combination_first.cpp (the first one alone).
# Prints a table and writes bench/results/compile_time.json (the harness schema: ours_us / ref_us are the
# median compile times in microseconds; seconds and peak_kib fields as well).
#
# usage: bench/compile/compile_time.sh [repetitions=5]
set -euo pipefail
cd "$(dirname "$0")/../.."
reps=${1:-5}
cxx=${CXX:-g++}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cat > "$tmp/umbrella.cpp" <<'CPP'
#include <dtensor/dtensor.hpp>
int main() { return 0; }
CPP
cp bench/compile/redistributions_tu.cpp "$tmp/redistributions.cpp"
cp bench/compile/combination_first.cpp bench/compile/combination_new.cpp "$tmp/"
cp bench/compile/ops_tu.cpp "$tmp/ops.cpp"
# The ops TU instantiates matmul where a BLAS header is found (as a dtensor::blas build would).
blas_flags=()
if [ -f /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h ]; then
  blas_flags=(-DDTENSOR_HAS_BLAS=1 -isystem /usr/include/x86_64-linux-gnu/openblas-pthread)
fi

# A TU with the standard headers that the dtensor headers reachable from $1 include.
std_only() {
  local reached
  reached=$("$cxx" -std=c++20 -Iinclude -MM "$1" | tr ' \\' '\n\n' | grep 'include/dtensor/' || true)
  grep -hoE '^#include <[a-z_]+>' $reached | sort -u
  echo 'int main() { return 0; }'
}
std_only "$tmp/umbrella.cpp" > "$tmp/std_only.cpp"
std_only "$tmp/redistributions.cpp" > "$tmp/std_only_redist.cpp"

measure() { # file [extra flags...] -> "median_seconds peak_kib"
  local f=$1 times=() peak=0
  shift
  for _ in $(seq "$reps"); do
    /usr/bin/time -f '%e %M' -o "$tmp/t" "$cxx" -std=c++20 -O2 -Iinclude "$@" -c "$f" -o "$tmp/o.o"
    read -r s kib < "$tmp/t"
    times+=("$s")
    (( kib > peak )) && peak=$kib
  done
  local med
  med=$(printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  echo "$med $peak"
}

read -r u_s u_kib < <(measure "$tmp/umbrella.cpp")
read -r s_s s_kib < <(measure "$tmp/std_only.cpp")
read -r r_s r_kib < <(measure "$tmp/redistributions.cpp")
read -r rs_s rs_kib < <(measure "$tmp/std_only_redist.cpp")
read -r o_s o_kib < <(measure "$tmp/ops.cpp" "${blas_flags[@]}")
read -r c1_s c1_kib < <(measure "$tmp/combination_first.cpp")
read -r c2_s c2_kib < <(measure "$tmp/combination_new.cpp")
delta=$(awk -v a="$c2_s" -v b="$c1_s" 'BEGIN { printf "%.2f", a - b }')
printf '%-52s %10s %12s\n' "translation unit" "median s" "peak MiB"
printf '%-52s %10s %12d\n' "#include <dtensor/dtensor.hpp>" "$u_s" $((u_kib / 1024))
printf '%-52s %10s %12d\n' "std headers dtensor uses" "$s_s" $((s_kib / 1024))
printf '%-52s %10s %12d\n' "dtensor + DTensor + 20 redistributions" "$r_s" $((r_kib / 1024))
printf '%-52s %10s %12d\n' "std headers that TU reaches" "$rs_s" $((rs_kib / 1024))
printf '%-52s %10s %12d\n' "dtensor + 20 ops on DTensors" "$o_s" $((o_kib / 1024))
printf '%-52s %10s %12d\n' "one (T, Rank, Mesh) combination" "$c1_s" $((c1_kib / 1024))
printf '%-52s %10s %12d\n' "two combinations" "$c2_s" $((c2_kib / 1024))
printf '%-52s %10s\n' "cost of the new combination (difference)" "$delta"
mkdir -p bench/results
compiler=$($cxx --version | head -1)
date=$(date -u +%Y-%m-%d)
us() { awk -v s="$1" 'BEGIN { printf "%d", s * 1000000 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }'; }
cat > bench/results/compile_time.json <<JSON
[
  {"suite": "compile", "name": "umbrella_header", "backend": "none", "ranks": 1, "bytes": 0,
   "ours_us": $(us "$u_s"), "ref_name": "std_headers_only", "ref_us": $(us "$s_s"), "ratio": $(ratio "$u_s" "$s_s"),
   "compiler": "$compiler", "reps": $reps,
   "seconds": $u_s, "peak_kib": $u_kib, "ref_seconds": $s_s, "ref_peak_kib": $s_kib, "date": "$date"},
  {"suite": "compile", "name": "redistributions_20", "backend": "none", "ranks": 1, "bytes": 0,
   "ours_us": $(us "$r_s"), "ref_name": "std_headers_only", "ref_us": $(us "$rs_s"), "ratio": $(ratio "$r_s" "$rs_s"),
   "compiler": "$compiler", "reps": $reps,
   "seconds": $r_s, "peak_kib": $r_kib, "ref_seconds": $rs_s, "ref_peak_kib": $rs_kib, "date": "$date"},
  {"suite": "compile", "name": "ops_20", "backend": "none", "ranks": 1, "bytes": 0,
   "ours_us": $(us "$o_s"), "ref_name": "umbrella_header", "ref_us": $(us "$u_s"), "ratio": $(ratio "$o_s" "$u_s"),
   "compiler": "$compiler", "reps": $reps, "blas": "${#blas_flags[@]}",
   "seconds": $o_s, "peak_kib": $o_kib, "ref_seconds": $u_s, "ref_peak_kib": $u_kib, "date": "$date"},
  {"suite": "compile", "name": "new_combination", "backend": "none", "ranks": 1, "bytes": 0,
   "ours_us": $(us "$c2_s"), "ref_name": "first_combination_only", "ref_us": $(us "$c1_s"), "ratio": $(ratio "$c2_s" "$c1_s"),
   "compiler": "$compiler", "reps": $reps, "delta_seconds": $delta,
   "seconds": $c2_s, "peak_kib": $c2_kib, "ref_seconds": $c1_s, "ref_peak_kib": $c1_kib, "date": "$date"}
]
JSON
echo "wrote bench/results/compile_time.json"

#!/usr/bin/env bash
# Compile cost of the umbrella header: times compiling a TU that includes <dtensor/dtensor.hpp> next to
# a TU that includes only the standard headers dtensor itself uses, both with the flags of a Release
# build (g++ -std=c++20 -O2). Prints a table and writes bench/results/compile_time.json.
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
# The standard headers that the dtensor headers reachable from the umbrella include.
reached=$("$cxx" -std=c++20 -Iinclude -MM "$tmp/umbrella.cpp" | tr ' \\' '\n\n' | grep 'include/dtensor/' || true)
std_headers=$(grep -hoE '^#include <[a-z_]+>' $reached | sort -u)
printf '%s\nint main() { return 0; }\n' "$std_headers" > "$tmp/std_only.cpp"

measure() { # file -> "median_seconds peak_kib"
  local f=$1 times=() peak=0
  for _ in $(seq "$reps"); do
    /usr/bin/time -f '%e %M' -o "$tmp/t" "$cxx" -std=c++20 -O2 -Iinclude -c "$f" -o "$tmp/o.o"
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
printf '%-34s %10s %12s\n' "translation unit" "median s" "peak MiB"
printf '%-34s %10s %12d\n' "#include <dtensor/dtensor.hpp>" "$u_s" $((u_kib / 1024))
printf '%-34s %10s %12d\n' "std headers dtensor uses" "$s_s" $((s_kib / 1024))
mkdir -p bench/results
cat > bench/results/compile_time.json <<JSON
[
  {"suite": "compile", "name": "umbrella_header", "compiler": "$($cxx --version | head -1)", "reps": $reps,
   "seconds": $u_s, "peak_kib": $u_kib, "ref_name": "std_headers_only", "ref_seconds": $s_s, "ref_peak_kib": $s_kib,
   "date": "$(date -u +%Y-%m-%d)"}
]
JSON
echo "wrote bench/results/compile_time.json"

# Sourced by the scripts that run one of our benchmarks next to a torch 1.13 script at 4 processes
# (bench/moe/moe_vs_torch.sh, bench/pipeline/pipeline_vs_torch.sh): parses --passes K and --smoke,
# builds dtensor-run and the benchmark (bench/common/release_build.sh: BUILD_DIR, default build-bench),
# and runs the passes with the order alternating (odd passes: ours first), pass p writing its JSON into
# $tmp/p; torch is left out where python3-torch is missing. Leaves `tmp` (removed at exit) and `passes`.
#
# usage, from the repository root: source bench/common/paired_runs.sh NAME BENCH_TARGET TORCH_SCRIPT "$@"
name=$1
target=$2
torch_script=$3
shift 3
passes=3
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
  --passes) passes=$2; shift 2 ;;
  --smoke) extra+=(--smoke); passes=1; shift ;;
  *) echo "$name: unknown argument $1" >&2; exit 2 ;;
  esac
done
source bench/common/release_build.sh "$target"
run="$build/tools/dtensor-run/dtensor-run --standalone --tee 0 --nproc-per-node 4"
have_torch=0
/usr/bin/python3 -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null && have_torch=1
for ((p = 1; p <= passes; ++p)); do
  mkdir -p "$tmp/$p"
  if [[ $have_torch == 1 && $((p % 2)) == 0 ]]; then
    $run --rank0-store /usr/bin/python3 "$torch_script" "${extra[@]}" --out "$tmp/$p"
  fi
  $run "$build/bench/$target" "${extra[@]}" --out "$tmp/$p" >/dev/null
  if [[ $have_torch == 1 && $((p % 2)) == 1 ]]; then
    $run --rank0-store /usr/bin/python3 "$torch_script" "${extra[@]}" --out "$tmp/$p"
  fi
done

# The programs of the GPU check, read from a configured CMake build tree (sourced by scripts/gpu_check.sh and
# scripts/gpu_prepare.sh, so the tree the programs are built in and the list the check runs agree).
#
# gpu_targets TREE: sets
#   cuda_tests       every test executable with a CUDA object among its link inputs (tests/*/test_*.cu and any
#                    other test program made of nvcc objects), but not nccl_suite (steps of its own);
#   example_targets  example_06_train_cuda where the tree has it;
#   bench_targets    bench_nccl (a C++ program on NCCL) and bench_redistribution_cuda where the tree has them;
#   launcher_targets dtensor-run and nccl_suite.
# Only executables count: an OBJECT library's .cu.o (tests/core/two_tu's device_tu) is not a program. Returns
# 1, naming what is missing, when the tree has no build.ninja or no nccl_suite (NCCL or CUDA not found there).
gpu_targets() {
  local tree=$1 all executables cuda_exe t
  cuda_tests=""
  example_targets=""
  bench_targets=""
  launcher_targets=""
  if [[ ! -f $tree/build.ninja ]]; then
    echo "gpu_targets: $tree is not a configured Ninja build tree" >&2
    return 1
  fi
  all=$(ninja -C "$tree" -t targets all 2>/dev/null)
  # Executables: "path: <LANG>_EXECUTABLE_LINKER__<target>_<config>" (not the .cmake files of catch_discover).
  executables=$(sed -n 's/^\([^ :]*\): [A-Z]*_EXECUTABLE_LINKER__.*/\1/p' <<<"$all" | grep -v '\.cmake$' |
                grep -v "^$tree/" | sort -u)
  # Those whose link inputs include an object compiled by nvcc.
  # shellcheck disable=SC2086
  cuda_exe=$(ninja -C "$tree" -t query $executables 2>/dev/null | awk '
    /^[^ ]/ { target = $1; sub(/:$/, "", target); next }
    /\.cu\.o$/ { print target }' | sort -u)
  for t in $cuda_exe; do
    t=${t##*/}
    case $t in
      nccl_suite) ;;
      example_06_train_cuda) example_targets=$t ;;
      bench_redistribution_cuda) bench_targets="${bench_targets:+$bench_targets }$t" ;;
      bench_*) ;;
      example_*) ;;
      *) cuda_tests="${cuda_tests:+$cuda_tests }$t" ;;
    esac
  done
  grep -q '^bench/bench_nccl: ' <<<"$all" && bench_targets="bench_nccl${bench_targets:+ $bench_targets}"
  grep -q '^tools/dtensor-run/dtensor-run: ' <<<"$all" && launcher_targets="dtensor-run"
  if grep -q '^tests/nccl/nccl_suite: ' <<<"$all"; then
    launcher_targets="$launcher_targets nccl_suite"
  else
    echo "gpu_targets: $tree has no nccl_suite (configured without NCCL or without CUDA)" >&2
    return 1
  fi
  return 0
}

# gpu_program TREE TARGET: the path of TARGET's executable in TREE (from build.ninja), empty when not built.
gpu_program() {
  local tree=$1 t=$2 path
  path=$(ninja -C "$tree" -t targets all 2>/dev/null |
         sed -n "s|^\\([^ :]*/$t\\): [A-Z]*_EXECUTABLE_LINKER__.*|\\1|p; s|^\\($t\\): [A-Z]*_EXECUTABLE_LINKER__.*|\\1|p" |
         grep -v "^$tree/" | head -1)
  [[ -n $path && -x $tree/$path ]] && echo "$tree/$path"
  return 0
}

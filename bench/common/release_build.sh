# Sourced by the benchmark scripts, from the repository root: configures BUILD_DIR (default build-bench) as
# a Release build without CUDA when it is not configured, builds dtensor-run and the targets named, gives
# each process one BLAS and one OpenMP thread, and makes `tmp`, a directory removed at exit. Leaves `build`.
#
# usage: source bench/common/release_build.sh TARGET...
build=${BUILD_DIR:-build-bench}
if [[ ! -f "$build/build.ninja" && ! -f "$build/Makefile" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTENSOR_ENABLE_CUDA=OFF
fi
cmake --build "$build" -j2 --target dtensor-run "$@"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

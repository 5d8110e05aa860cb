#!/usr/bin/env bash
# gpu_prepare.sh: on a CPU machine with the CUDA Toolkit (nvcc 13, NCCL 2.28 under /usr/local/cuda; Debian 12),
# build every program scripts/gpu_check.sh runs on the GPU machine, for sm_90 (H100, H200; with compute_90
# PTX beside), and pack them into one git-ignored folder that travels with the repository (the device tool's
# `carry`), so the device machine only runs them:
#
#   scripts/gpu_prepare.sh [PACK_DIR]     # default build-gpu-pack (build tree: build-gpu-prep)
#
# PACK_DIR/dtensor-gpu.tar.xz holds:
#   bin/      the programs, stripped: dtensor-run, nccl_suite, every CUDA test program, example_06_train_cuda,
#             bench_nccl, bench_redistribution_cuda (the list comes from the build tree, scripts/lib/gpu_targets.sh,
#             as the dry run's does); libstdc++ and libgcc linked in (-static-libstdc++ -static-libgcc);
#             no MPI, no gloo (not on the GPU machine, not needed by these programs)
#   lib/      the shared libraries of ours they need that the GPU machine lacks: OpenBLAS (Debian's pthread
#             build; example_06_train_cuda's host GEMMs) and what it needs beyond glibc (libgfortran,
#             libquadmath). CUDA's runtime and cuBLAS 13 and NCCL 2 come from the GPU machine.
#   deps/     what building there needs, for the fallback when the machine is below the floor: Catch2 2.x's
#             header and CMake helpers (its main compiled there), OpenBLAS's headers, Random123, DLPack
#   TARGETS   the programs by role (sourced by gpu_check.sh)
#   FLOOR     the newest glibc symbol version any packed file needs (checked there before anything runs)
#   MANIFEST  commit, toolchain, sizes and checksums
# The pack must stay under 64 MiB with the repository (the device tool's limit): this script fails above
# 56 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source scripts/lib/gpu_targets.sh
out=${1:-build-gpu-pack}
case "$out" in /*) ;; *) out="$root/$out" ;; esac
tree="$root/build-gpu-prep"
stage="$tree/pack"
limit_mib=56

scripts/deps.sh # the compiler, Catch2, OpenBLAS, Random123 and DLPack from Debian, when missing
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
[ -x "$nvcc" ] || { echo "gpu_prepare: no nvcc at $nvcc (set CUDACXX)"; exit 1; }

# ---- build ----------------------------------------------------------------------------------------------
t0=$(date +%s)
mkdir -p "$tree"
cmake -S "$root" -B "$tree" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DNCCL_ROOT=/usr/local/cuda \
  -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_Gloo=ON -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON \
  -DDTENSOR_BUILD_TESTS=ON -DDTENSOR_BUILD_EXAMPLES=ON -DDTENSOR_BUILD_BENCH=ON \
  -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" >"$tree/configure.log" 2>&1 ||
  { tail -n 30 "$tree/configure.log"; exit 1; }
gpu_targets "$tree"
programs="$launcher_targets $cuda_tests $example_targets $bench_targets"
echo "gpu_prepare: building $programs"
cmake --build "$tree" -j "$(nproc)" --target $programs
t1=$(date +%s)

# ---- stage ----------------------------------------------------------------------------------------------
rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/lib"
for t in $programs; do
  p=$(gpu_program "$tree" "$t")
  [ -n "$p" ] || { echo "gpu_prepare: $t was not built"; exit 1; }
  cp "$p" "$stage/bin/$t"
  strip --strip-unneeded "$stage/bin/$t"
done
# Shared libraries beyond the system's and CUDA's: copied (OpenBLAS and its Fortran runtime). Never the C++
# runtime (libstdc++, libgcc_s): ours is linked in, and cuBLAS, NCCL and torch on that machine need its own,
# newer one, which a copy of this machine's first on LD_LIBRARY_PATH would shadow.
system_lib='^(libc|libm|libdl|librt|libpthread|ld-linux.*|libstdc\+\+|libgcc_s|libcudart|libcublas|libcublasLt|libnccl|libcuda)\.so'
for p in "$stage"/bin/*; do
  ldd "$p" | awk '/=> \// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $system_lib ]] && continue
  cp -L "$path" "$stage/lib/$name"
  for dep in $(ldd "$path" | awk '/=> \// {print $1 "=" $3}'); do
    [[ ${dep%%=*} =~ $system_lib ]] || cp -L "${dep#*=}" "$stage/lib/${dep%%=*}"
  done
done
{
  echo "cuda_tests=\"$cuda_tests\""
  echo "example_targets=\"$example_targets\""
  echo "bench_targets=\"$bench_targets\""
  echo "launcher_targets=\"$launcher_targets\""
} >"$stage/TARGETS"

# The floor: the newest GLIBC_ symbol version needed; libstdc++ must need none (linked in).
needs=$(objdump -T "$stage"/bin/* "$stage"/lib/* 2>/dev/null | grep -oE 'GLIBC_[0-9.]+' | sed 's/GLIBC_//' | sort -uV | tail -1)
needed_by=$(for f in "$stage"/bin/* "$stage"/lib/*; do
              if objdump -T "$f" 2>/dev/null | grep -q "GLIBC_$needs[^.0-9]"; then echo "${f##*/}"; fi
            done | paste -sd' ')
cxx=$(objdump -T "$stage"/bin/* 2>/dev/null | grep -oE 'GLIBCXX_[0-9.]+' | sort -uV | tail -1 || true)
if [ -n "$cxx" ]; then
  echo "gpu_prepare: a program needs the machine's libstdc++ ($cxx): link it statically"
  exit 1
fi
echo "glibc $needs" >"$stage/FLOOR"
echo "(glibc $needs: $needed_by)" >>"$stage/FLOOR"
echo "libstdc++ linked in" >>"$stage/FLOOR"

# ---- deps/ for the fallback build ---------------------------------------------------------------------
d="$stage/deps"
mkdir -p "$d/catch2/include/catch2" "$d/catch2/lib/cmake/Catch2" "$d/catch2/src" "$d/openblas/include" \
         "$d/openblas/lib" "$d/random123/include" "$d/dlpack/include"
cp /usr/include/catch2/catch.hpp "$d/catch2/include/catch2/"
for f in Catch.cmake CatchAddTests.cmake ParseAndAddCatchTests.cmake Catch2ConfigVersion.cmake; do
  cp "/usr/lib/cmake/Catch2/$f" "$d/catch2/lib/cmake/Catch2/"
done
printf '#define CATCH_CONFIG_MAIN\n#include <catch2/catch.hpp>\n' >"$d/catch2/src/catch_main.cpp"
cat >"$d/catch2/lib/cmake/Catch2/Catch2Config.cmake" <<'EOF'
# Catch2 2.x for a machine without it (made by dtensor's scripts/gpu_prepare.sh). The header comes from this
# folder; libCatch2WithMain.a is compiled on that machine (scripts/gpu_check.sh's fallback does).
get_filename_component(_catch2_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET Catch2::Catch2)
  add_library(Catch2::Catch2 INTERFACE IMPORTED)
  set_target_properties(Catch2::Catch2 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_catch2_prefix}/include")
endif()
if(NOT TARGET Catch2::Catch2WithMain)
  if(NOT EXISTS "${_catch2_prefix}/lib/libCatch2WithMain.a")
    message(FATAL_ERROR "${_catch2_prefix}/lib/libCatch2WithMain.a is missing: scripts/gpu_check.sh compiles "
                        "it from ${_catch2_prefix}/src/catch_main.cpp")
  endif()
  add_library(Catch2::Catch2WithMain STATIC IMPORTED)
  set_target_properties(Catch2::Catch2WithMain PROPERTIES
    IMPORTED_LOCATION "${_catch2_prefix}/lib/libCatch2WithMain.a" INTERFACE_LINK_LIBRARIES Catch2::Catch2)
endif()
list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
set(Catch2_FOUND TRUE)
EOF
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
blas_inc=$(dirname "$(readlink -f "/usr/include/$multiarch/openblas_config.h")")
cp "$blas_inc/cblas.h" "$blas_inc/openblas_config.h" "$d/openblas/include/"
for f in "$stage"/lib/*; do ln -s "../../../lib/${f##*/}" "$d/openblas/lib/${f##*/}"; done
[ -e "$d/openblas/lib/libopenblas.so.0" ] && ln -s libopenblas.so.0 "$d/openblas/lib/libopenblas.so"
cp -r /usr/include/Random123 "$d/random123/include/"
cp -r /usr/include/dlpack "$d/dlpack/include/"

{
  echo "dtensor $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+changes'), built $(date -u +%FT%TZ) by scripts/gpu_prepare.sh"
  echo "nvcc: $("$nvcc" --version | tail -1); c++: $(c++ --version | head -1); $(ldd --version | head -1)"
  echo "sm_90 (+ compute_90 PTX); Release; floor: $(paste -sd';' "$stage/FLOOR")"
  (cd "$stage" && find . -type f ! -name MANIFEST -print0 | sort -z | xargs -0 sha256sum)
} >"$stage/MANIFEST"

# ---- pack ---------------------------------------------------------------------------------------------
mkdir -p "$out"
rm -f "$out/dtensor-gpu.tar.xz"
tar -cf - -C "$stage" . | xz -T0 -6 >"$out/dtensor-gpu.tar.xz"
cp "$stage/MANIFEST" "$out/MANIFEST"
bytes=$(stat -c %s "$out/dtensor-gpu.tar.xz")
t2=$(date +%s)
printf 'gpu_prepare: %s: %d programs, %.1f MiB packed (%s unpacked), floor %s; built in %d s, packed in %d s\n' \
  "${out#$root/}/dtensor-gpu.tar.xz" "$(ls "$stage/bin" | wc -l)" "$(echo "$bytes / 1048576" | bc -l)" \
  "$(du -sh "$stage" | cut -f1)" "$(head -1 "$stage/FLOOR")" $((t1 - t0)) $((t2 - t1))
if ((bytes > limit_mib * 1048576)); then
  echo "gpu_prepare: the pack is over $limit_mib MiB: it would not travel with the repository (64 MiB in all)"
  exit 1
fi
echo "gpu_prepare: on the GPU machine: scripts/gpu_check.sh (the device tool: carry ${out#$root/})"

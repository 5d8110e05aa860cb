#!/usr/bin/env bash
# gpu_prepare.sh: run on a CPU machine (Debian 12, network or apt available) to gather, into one
# git-ignored folder, what the GPU test machine lacks (docs/design.md, Testing and machines:
# no gloo, no Catch2, no apt, no network).
# scripts/gpu_check.sh then uses that folder on the GPU machine.
#
#   scripts/gpu_prepare.sh [DIR]        # DIR defaults to build-gpu-deps (ignored by git: build*/)
#
# The folder holds, with relative paths only (it may be copied anywhere):
#   catch2/   Catch2 2.x's single header, its CMake helpers (Catch.cmake, CatchAddTests.cmake) and a
#             Catch2Config.cmake whose Catch2::Catch2WithMain is compiled *on the GPU machine* by
#             gpu_check.sh from src/catch_main.cpp (no binary compatibility to hope for)
#   gloo/     gloo's headers, libgloo.so and the shared libraries it needs beyond glibc (hiredis,
#             ibverbs, libnl), with a GlooConfig.cmake; gpu_check.sh uses them only if a probe program
#             links and runs there (the NCCL tests do not need gloo)
#   openblas/ OpenBLAS's cblas.h (with openblas_config.h), libopenblas.so.0 (Debian's pthread build, which
#             picks its kernels for the CPU at run time) and the shared libraries it needs beyond glibc
#             (libgfortran, libquadmath), libopenblas.so -> libopenblas.so.0, and a probe program: the
#             host BLAS that dtensor::blas needs, which example_06_train_cuda links (its host GEMMs are
#             instantiated next to the cuBLAS ones); gpu_check.sh uses it only if the probe links and
#             runs there
#   random123/ Random123's headers (rand, randn, dropout; header-only)
#   dlpack/   dlpack/dlpack.h (core/dlpack.hpp; header-only)
#   MANIFEST  where each piece came from, versions and checksums
# NCCL is not included: on the GPU machine it comes from the nvidia-nccl-cu13 Python package.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${1:-build-gpu-deps}
case "$out" in /*) ;; *) out="$root/$out" ;; esac

scripts/deps.sh # catch2, libgloo-dev, librandom123-dev and libdlpack-dev from Debian, when missing

rm -rf "$out"
mkdir -p "$out/catch2/include/catch2" "$out/catch2/lib/cmake/Catch2" "$out/catch2/src" \
         "$out/gloo/include" "$out/gloo/lib/cmake/Gloo"

# ---- Catch2 -------------------------------------------------------------------------------------------
cp /usr/include/catch2/catch.hpp "$out/catch2/include/catch2/"
for f in Catch.cmake CatchAddTests.cmake ParseAndAddCatchTests.cmake Catch2ConfigVersion.cmake; do
  cp "/usr/lib/cmake/Catch2/$f" "$out/catch2/lib/cmake/Catch2/"
done
cat > "$out/catch2/src/catch_main.cpp" <<'EOF'
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
EOF
cat > "$out/catch2/lib/cmake/Catch2/Catch2Config.cmake" <<'EOF'
# Catch2 2.x for a machine without it (made by dtensor's scripts/gpu_prepare.sh). The header comes from
# this folder; libCatch2WithMain.a must have been compiled on this machine (scripts/gpu_check.sh does).
get_filename_component(_catch2_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET Catch2::Catch2)
  add_library(Catch2::Catch2 INTERFACE IMPORTED)
  set_target_properties(Catch2::Catch2 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_catch2_prefix}/include")
endif()
if(NOT TARGET Catch2::Catch2WithMain)
  if(NOT EXISTS "${_catch2_prefix}/lib/libCatch2WithMain.a")
    message(FATAL_ERROR "${_catch2_prefix}/lib/libCatch2WithMain.a is missing: run scripts/gpu_check.sh, "
                        "which compiles it from ${_catch2_prefix}/src/catch_main.cpp")
  endif()
  add_library(Catch2::Catch2WithMain STATIC IMPORTED)
  set_target_properties(Catch2::Catch2WithMain PROPERTIES
    IMPORTED_LOCATION "${_catch2_prefix}/lib/libCatch2WithMain.a"
    INTERFACE_LINK_LIBRARIES Catch2::Catch2)
endif()
list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
set(Catch2_FOUND TRUE)
EOF

# ---- gloo ---------------------------------------------------------------------------------------------
cp -r /usr/include/gloo "$out/gloo/include/"
cp -P /usr/lib/libgloo.so* "$out/gloo/lib/"
for dep in $(ldd /usr/lib/libgloo.so.0 | awk '/=>/ {print $3}'); do
  case "$(basename "$dep")" in
    libc.so*|libm.so*|libstdc++.so*|libgcc_s.so*|ld-linux*|libpthread.so*|libdl.so*|librt.so*) ;; # the machine's own
    *) cp -L "$dep" "$out/gloo/lib/" ;;
  esac
done
cat > "$out/gloo/lib/cmake/Gloo/GlooConfig.cmake" <<'EOF'
# gloo 0.5 for a machine without it (made by dtensor's scripts/gpu_prepare.sh from Debian's libgloo-dev).
get_filename_component(_gloo_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(GLOO_VERSION "0.5.0")
if(NOT TARGET gloo)
  add_library(gloo SHARED IMPORTED)
  set_target_properties(gloo PROPERTIES
    IMPORTED_LOCATION "${_gloo_prefix}/lib/libgloo.so.0.5.0"
    IMPORTED_SONAME "libgloo.so.0"
    INTERFACE_INCLUDE_DIRECTORIES "${_gloo_prefix}/include"
    INTERFACE_LINK_OPTIONS "-Wl,-rpath,${_gloo_prefix}/lib;-Wl,-rpath-link,${_gloo_prefix}/lib")
endif()
set(Gloo_FOUND TRUE)
EOF
cat > "$out/gloo/probe.cpp" <<'EOF'
// Links and runs against the bundled gloo: a one-rank context over the TCP transport.
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>
#include <cstdio>
int main() {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::HashStore store;
  auto ctx = std::make_shared<gloo::rendezvous::Context>(0, 1);
  ctx->connectFullMesh(store, dev);
  std::puts("gloo probe ok");
}
EOF

# ---- OpenBLAS -----------------------------------------------------------------------------------------
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
blas_lib=$(readlink -f "/usr/lib/$multiarch/libopenblas.so.0")
blas_inc=$(dirname "$(readlink -f "/usr/include/$multiarch/openblas_config.h")")
mkdir -p "$out/openblas/include" "$out/openblas/lib"
cp "$blas_inc/cblas.h" "$blas_inc/openblas_config.h" "$out/openblas/include/"
cp -L "$blas_lib" "$out/openblas/lib/libopenblas.so.0"
ln -s libopenblas.so.0 "$out/openblas/lib/libopenblas.so"
for dep in $(ldd "$blas_lib" | awk '/=>/ {print $3}'); do
  case "$(basename "$dep")" in
    libc.so*|libm.so*|libstdc++.so*|libgcc_s.so*|ld-linux*|libpthread.so*|libdl.so*|librt.so*) ;; # the machine's own
    *) cp -L "$dep" "$out/openblas/lib/" ;;
  esac
done
cat > "$out/openblas/probe.cpp" <<'EOF'
// Links and runs against the bundled OpenBLAS: one small sgemm and dgemm, checked.
#include <cblas.h>
#include <cstdio>
int main() {
  const float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  float c[4] = {};
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2);
  const double x[2] = {1, 2}, y[2] = {3, 4};
  double z[1] = {};
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 1, 1, 2, 1.0, x, 2, y, 1, 0.0, z, 1);
  const bool ok = c[0] == 19 && c[1] == 22 && c[2] == 43 && c[3] == 50 && z[0] == 11;
  std::puts(ok ? "openblas probe ok" : "openblas probe: wrong results");
  return ok ? 0 : 1;
}
EOF

# ---- Random123 ----------------------------------------------------------------------------------------
mkdir -p "$out/random123/include"
cp -r /usr/include/Random123 "$out/random123/include/"

# ---- DLPack -------------------------------------------------------------------------------------------
mkdir -p "$out/dlpack/include"
cp -r /usr/include/dlpack "$out/dlpack/include/"

# ---- manifest -----------------------------------------------------------------------------------------
{
  echo "made by scripts/gpu_prepare.sh on $(hostname) at $(date -u +%FT%TZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  dpkg-query -W -f='${Package} ${Version}\n' catch2 libgloo-dev libgloo0 libopenblas-dev libopenblas0-pthread \
    libgfortran5 librandom123-dev libdlpack-dev 2>/dev/null || true
  echo "glibc of this machine: $(ldd --version | head -1)"
  (cd "$out" && find . -type f ! -name MANIFEST -print0 | sort -z | xargs -0 sha256sum)
} > "$out/MANIFEST"

echo "gpu_prepare: wrote $out ($(du -sh "$out" | cut -f1)); copy it next to the repository on the GPU machine"
echo "             (or pass it in the device tool's carry list) and run scripts/gpu_check.sh there"

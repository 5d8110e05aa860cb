#pragma once
// The host GEMM kernel: a GemmPlan run by the BLAS's cblas_sgemm / cblas_dgemm, one call per batch entry.
// Non-template (the element type is a DType), so every typed matmul shares it.
//
// DTENSOR_HAS_BLAS is 1 when the build links a BLAS with cblas.h (the CMake target dtensor::blas defines
// it); otherwise this header declares nothing and host GEMMs do not compile (gemm.hpp says which target
// to link).

#ifndef DTENSOR_HAS_BLAS
#define DTENSOR_HAS_BLAS 0
#endif

#if DTENSOR_HAS_BLAS

#include <cstdint>
#include <string>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/local/gemm_plan.hpp"

// OpenBLAS's cblas.h declares a global `bfloat16` (a uint16_t), which would make `bfloat16` ambiguous in
// every program that says `using namespace dtensor;`: it gets another name for the length of the include.
#define bfloat16 dtensor_openblas_bfloat16
#include <cblas.h>
#undef bfloat16

namespace dtensor::detail {

inline CBLAS_TRANSPOSE blas_transpose(const BlasOperand& x) noexcept {
  return x.trans ? CblasTrans : CblasNoTrans;
}

/// Runs `p` (no operand left to copy) on host memory: `first` and `second` are the product's operands
/// in the order the user wrote them, `c` the output; `dtype` is float32 or float64.
inline void blas_gemm(DType dtype, const GemmPlan& p, const void* first, const void* second, void* c,
                      double alpha, double beta) {
  if (p.m == 0 || p.n == 0 || p.batch == 0) {
    return;
  }
  DTENSOR_CHECK(p.m <= blas_int_max && p.n <= blas_int_max && p.k <= blas_int_max,
                "matmul: a " + std::to_string(p.m) + " x " + std::to_string(p.k) + " x " +
                    std::to_string(p.n) + " product exceeds the BLAS's 32-bit sizes");
  const void* a = p.swapped ? second : first;
  const void* b = p.swapped ? first : second;
  const auto m = static_cast<int>(p.m);
  const auto n = static_cast<int>(p.n);
  const auto k = static_cast<int>(p.k);
  const auto lda = static_cast<int>(p.a.ld);
  const auto ldb = static_cast<int>(p.b.ld);
  const auto ldc = static_cast<int>(p.c.ld);
  for (std::int64_t i = 0; i < p.batch; ++i) {
    if (dtype == DType::float32) {
      cblas_sgemm(CblasRowMajor, blas_transpose(p.a), blas_transpose(p.b), m, n, k, static_cast<float>(alpha),
                  static_cast<const float*>(a) + i * p.stride_a, lda,
                  static_cast<const float*>(b) + i * p.stride_b, ldb, static_cast<float>(beta),
                  static_cast<float*>(c) + i * p.stride_c, ldc);
    } else {
      cblas_dgemm(CblasRowMajor, blas_transpose(p.a), blas_transpose(p.b), m, n, k, alpha,
                  static_cast<const double*>(a) + i * p.stride_a, lda,
                  static_cast<const double*>(b) + i * p.stride_b, ldb, beta,
                  static_cast<double*>(c) + i * p.stride_c, ldc);
    }
  }
}

} // namespace dtensor::detail

#endif // DTENSOR_HAS_BLAS

#pragma once
// The CUDA GEMM kernel: a GemmPlan run by cuBLAS (cublasGemmEx, or cublasGemmStridedBatchedEx for a
// batch) on the output tensor's stream. float and double compute in their own precision (no TF32);
// bfloat16 and half are read and written as they are and accumulate in float (CUBLAS_COMPUTE_32F).
//
// cuBLAS is column-major; a row-major C (m x n) is a column-major C^T (n x m) with the same ld, so the
// plan runs as C^T = op(B)^T op(A)^T with the same transpose flags and the operands in the other order.
//
// Handles are made once per (device, stream) and thread and destroyed when the thread ends: cuBLAS
// handles are not thread safe, and one handle shared by two streams would share its workspace between
// kernels that may run at the same time.
//
// DTENSOR_HAS_CUBLAS is 1 when the build links cuBLAS (dtensor::cuda defines it where the toolkit has
// it); without it, or without DTENSOR_HAS_CUDA, this header declares nothing.

#include "dtensor/core/config.hpp"

#ifndef DTENSOR_HAS_CUBLAS
#define DTENSOR_HAS_CUBLAS 0
#endif

#if DTENSOR_HAS_CUDA && DTENSOR_HAS_CUBLAS

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/gemm_plan.hpp"

namespace dtensor::detail {

inline void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]] {
    throw_error(std::string("matmul: ") + call + " failed: " + cublasGetStatusName(status) + ": " +
                cublasGetStatusString(status));
  }
}

/// This thread's cuBLAS handle for the current device and `stream`, made on first use.
inline cublasHandle_t cublas_handle(int device, cudaStream_t stream) {
  struct Entry {
    int device;
    cudaStream_t stream;
    cublasHandle_t handle;
  };
  struct Cache {
    std::vector<Entry> entries;
    Cache() = default;
    Cache(const Cache&) = delete;
    Cache& operator=(const Cache&) = delete;
    ~Cache() {
      for (const Entry& e : entries) {
        (void)cublasDestroy(e.handle); // nothing to report to at thread exit
      }
    }
  };
  thread_local Cache cache;
  for (const Entry& e : cache.entries) {
    if (e.device == device && e.stream == stream) {
      return e.handle;
    }
  }
  cublasHandle_t handle = nullptr;
  check_cublas(cublasCreate(&handle), "cublasCreate");
  const cublasStatus_t status = cublasSetStream(handle, stream);
  if (status != CUBLAS_STATUS_SUCCESS) {
    (void)cublasDestroy(handle);
    check_cublas(status, "cublasSetStream");
  }
  cache.entries.push_back({device, stream, handle});
  return handle;
}

inline cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
  case DType::float32:
    return CUDA_R_32F;
  case DType::float64:
    return CUDA_R_64F;
  case DType::bfloat16:
    return CUDA_R_16BF;
  case DType::float16:
    return CUDA_R_16F;
  default:
    throw_error("matmul: no cuBLAS GEMM for " + std::string(dtype_name(dtype)));
  }
}

inline cublasOperation_t cublas_operation(const BlasOperand& x) noexcept {
  return x.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
}

/// Runs `p` (no operand left to copy) on device memory of `device`, enqueued on `stream` (not
/// synchronised): `first` and `second` are the product's operands in the order the user wrote them.
inline void cublas_gemm(DType dtype, const GemmPlan& p, const void* first, const void* second, void* c,
                        double alpha, double beta, Device device, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0 || p.batch == 0) {
    return;
  }
  DTENSOR_CHECK(p.m <= blas_int_max && p.n <= blas_int_max && p.k <= blas_int_max && p.batch <= blas_int_max,
                "matmul: a batch of " + std::to_string(p.batch) + " " + std::to_string(p.m) + " x " +
                    std::to_string(p.k) + " x " + std::to_string(p.n) +
                    " products exceeds cuBLAS's 32-bit sizes");
  TensorDeviceGuard guard(device.index);
  cublasHandle_t handle = cublas_handle(device.index, stream);
  const void* a = p.swapped ? second : first;
  const void* b = p.swapped ? first : second;
  const cudaDataType_t type = cuda_data_type(dtype);
  const bool dbl = dtype == DType::float64;
  const cublasComputeType_t compute = dbl ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const float alpha_f = static_cast<float>(alpha);
  const float beta_f = static_cast<float>(beta);
  const void* alpha_p = dbl ? static_cast<const void*>(&alpha) : &alpha_f;
  const void* beta_p = dbl ? static_cast<const void*>(&beta) : &beta_f;
  const auto m = static_cast<int>(p.m);
  const auto n = static_cast<int>(p.n);
  const auto k = static_cast<int>(p.k);
  const auto lda = static_cast<int>(p.a.ld);
  const auto ldb = static_cast<int>(p.b.ld);
  const auto ldc = static_cast<int>(p.c.ld);
  if (p.batch == 1) {
    check_cublas(cublasGemmEx(handle, cublas_operation(p.b), cublas_operation(p.a), n, m, k, alpha_p, b, type,
                              ldb, a, type, lda, beta_p, c, type, ldc, compute, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
    return;
  }
  check_cublas(cublasGemmStridedBatchedEx(handle, cublas_operation(p.b), cublas_operation(p.a), n, m, k,
                                          alpha_p, b, type, ldb, p.stride_b, a, type, lda, p.stride_a, beta_p,
                                          c, type, ldc, p.stride_c, static_cast<int>(p.batch), compute,
                                          CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx");
}

} // namespace dtensor::detail

#endif // DTENSOR_HAS_CUDA && DTENSOR_HAS_CUBLAS

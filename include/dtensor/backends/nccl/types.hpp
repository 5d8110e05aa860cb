#pragma once
// NCCL's names for dtensor's element types and reductions, and error checking for NCCL and CUDA calls
// (the counterpart of backends/gloo/types.hpp and backends/mpi/types.hpp: what the backend needs to know
// about the data).
//
//  - float32/64, bfloat16, float16, int32, int64, uint8 map to the NCCL type of the same layout;
//    float8_e4m3 / float8_e5m2 to ncclFloat8e4m3 / ncclFloat8e5m2 (NCCL 2.24 and later; an older NCCL
//    throws a clear Error for them). NCCL reduces fp8 on sm_90 and newer GPUs only; data movement
//    (all_gather, all_to_all, broadcast, P2P) works on any.
//  - ReduceOp::avg is ncclAvg for every type (integers: wrap-around sum, then divide truncating, as the
//    gloo backend does). ncclRedOpCreatePreMulSum is not needed for any op of the Backend interface.

#include "dtensor/backends/type_tables.hpp"
#include "dtensor/core/cuda_devices.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/reduce_op.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace dtensor::detail {

#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
inline constexpr ncclDataType_t nccl_float8_e4m3 = ncclFloat8e4m3;
inline constexpr ncclDataType_t nccl_float8_e5m2 = ncclFloat8e5m2;
#else // this NCCL has no 8-bit floats: nccl_type throws for them
inline constexpr ncclDataType_t nccl_float8_e4m3 = ncclNumTypes;
inline constexpr ncclDataType_t nccl_float8_e5m2 = ncclNumTypes;
#endif

/// NCCL's type of the same layout as each element type; ncclNumTypes where this NCCL lacks one (fp8 before
/// NCCL 2.24).
inline constexpr DTypeTable<ncclDataType_t> nccl_types{.float32 = ncclFloat32,
                                                       .float64 = ncclFloat64,
                                                       .bfloat16 = ncclBfloat16,
                                                       .float16 = ncclFloat16,
                                                       .int32 = ncclInt32,
                                                       .int64 = ncclInt64,
                                                       .uint8 = ncclUint8,
                                                       .float8_e4m3 = nccl_float8_e4m3,
                                                       .float8_e5m2 = nccl_float8_e5m2};

/// NCCL's type for `d`; Error for a type this NCCL lacks.
inline ncclDataType_t nccl_type(DType d) {
  const ncclDataType_t t = nccl_types.at(d, "NCCL backend");
  DTENSOR_CHECK(t != ncclNumTypes, "NCCL backend: " + std::string(dtype_name(d)) +
                                       " needs NCCL 2.24 or later (this is " +
                                       std::to_string(NCCL_VERSION_CODE) + ")");
  return t;
}

/// NCCL's reduction for `op` (avg is ncclAvg for every type). NCCL has no bitwise reduction: band, bor and
/// bxor are refused (as torch's NCCL backend refuses BAND, BOR and BXOR).
inline ncclRedOp_t nccl_op(ReduceOp op) {
  DTENSOR_CHECK(!is_bitwise(op), "NCCL backend: NCCL has no bitwise reduction (ReduceOp " +
                                     std::string(to_string(op)) +
                                     "); use the gloo or MPI backend for band, bor and bxor");
  constexpr ReduceOpTable<ncclRedOp_t> ops{.sum = ncclSum,
                                           .avg = ncclAvg,
                                           .max = ncclMax,
                                           .min = ncclMin,
                                           .product = ncclProd,
                                           .band = ncclNumOps,
                                           .bor = ncclNumOps,
                                           .bxor = ncclNumOps};
  return ops.at(op, "NCCL backend");
}

/// "ncclInvalidUsage (invalid usage): <NCCL's last error>"
inline std::string nccl_error_text(ncclResult_t r, ncclComm_t comm = nullptr) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') {
    s += ": ";
    s += last;
  }
  return s;
}

/// Throws when `err` is not cudaSuccess. `context` is a string, or a callable that returns one, called only
/// on failure (so a hot path builds no message).
template <class Context>
void check_cuda(cudaError_t err, const char* call, Context&& context) {
  if (err != cudaSuccess) [[unlikely]] {
    std::string where;
    if constexpr (std::is_invocable_v<Context>) {
      where = context();
    } else {
      where = context;
    }
    throw Error(where + ": " + call + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
}

/// Makes `device` current for its lifetime (restores the previous one).
class CudaDeviceGuard {
public:
  explicit CudaDeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess || previous_ == device) {
      previous_ = -1;
      return;
    }
    check_cuda(cudaSetDevice(device), "cudaSetDevice", "NCCL backend, cuda:" + std::to_string(device));
  }
  ~CudaDeviceGuard() {
    if (previous_ >= 0) {
      (void)cudaSetDevice(previous_);
    }
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

private:
  int previous_ = -1;
};

} // namespace dtensor::detail

namespace dtensor {

/// Number of CUDA devices this process can use; 0 when there is no driver or device, and also when CUDA
/// cannot use the GPU there (an old driver: probe_cuda_devices() in core/cuda_devices.hpp tells the two
/// apart). Never throws; what "auto" backend selection asks.
inline int nccl_device_count() noexcept {
  return probe_cuda_devices().count;
}

} // namespace dtensor

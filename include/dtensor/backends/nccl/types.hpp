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

/// NCCL's type of the same layout as element type T (no definition for a type NCCL lacks).
template <class T>
inline constexpr ncclDataType_t nccl_type_of = ncclNumTypes;
template <>
inline constexpr ncclDataType_t nccl_type_of<float> = ncclFloat32;
template <>
inline constexpr ncclDataType_t nccl_type_of<double> = ncclFloat64;
template <>
inline constexpr ncclDataType_t nccl_type_of<bfloat16> = ncclBfloat16;
template <>
inline constexpr ncclDataType_t nccl_type_of<half> = ncclFloat16;
template <>
inline constexpr ncclDataType_t nccl_type_of<std::int32_t> = ncclInt32;
template <>
inline constexpr ncclDataType_t nccl_type_of<std::int64_t> = ncclInt64;
template <>
inline constexpr ncclDataType_t nccl_type_of<std::uint8_t> = ncclUint8;
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
template <>
inline constexpr ncclDataType_t nccl_type_of<float8_e4m3> = ncclFloat8e4m3;
template <>
inline constexpr ncclDataType_t nccl_type_of<float8_e5m2> = ncclFloat8e5m2;
#endif

/// NCCL's type for `d` (visit_dtype's list); Error for a type this NCCL lacks.
inline ncclDataType_t nccl_type(DType d) {
  const ncclDataType_t t = visit_dtype(d, []<class T>(T) { return nccl_type_of<T>; });
  DTENSOR_CHECK(t != ncclNumTypes, "NCCL backend: " + std::string(dtype_name(d)) +
                                       " needs NCCL 2.24 or later (this is " +
                                       std::to_string(NCCL_VERSION_CODE) + ")");
  return t;
}

inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
  case ReduceOp::sum:
    return ncclSum;
  case ReduceOp::avg:
    return ncclAvg;
  case ReduceOp::max:
    return ncclMax;
  case ReduceOp::min:
    return ncclMin;
  case ReduceOp::product:
    return ncclProd;
  }
  throw Error("NCCL backend: unsupported reduce op " + std::to_string(static_cast<int>(op)));
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

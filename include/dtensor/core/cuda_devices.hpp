#pragma once
// Whether this process sees a CUDA device, and if not, why: the one place that tells "no GPU here" (no
// device, or no CUDA driver installed at all: skip the GPU work) from "a GPU that CUDA cannot use" (a driver
// older than the runtime, a driver/runtime mismatch, devices busy or unavailable: an error to report, never
// a skip). GPU tests skip on the first and fail on the second; make_nccl_backend names the second.
//
//   const dtensor::CudaDevices d = dtensor::probe_cuda_devices();
//   if (d.none())     { /* skip: d.reason() says "no CUDA driver is installed", "0 devices", ... */ }
//   if (d.unusable()) { /* fail: d.reason() names the CUDA error, e.g. cudaErrorInsufficientDriver */ }
//
// A machine without a driver makes cudaGetDeviceCount report cudaErrorInsufficientDriver too, so that error
// alone does not tell an old driver from none: cudaDriverGetVersion does (0 when no driver is installed).
// Present only where DTENSOR_HAS_CUDA is 1 (link dtensor::cuda).

#include "dtensor/core/config.hpp"

#if DTENSOR_HAS_CUDA
#include <cuda_runtime_api.h>

#include <string>

namespace dtensor {

/// What cudaGetDeviceCount and cudaDriverGetVersion said about this process's devices.
struct CudaDevices {
  int count = 0;                   ///< visible devices (0 unless error is cudaSuccess)
  cudaError_t error = cudaSuccess; ///< cudaGetDeviceCount's result
  int driver_version = 0;          ///< cudaDriverGetVersion's (1000 * major + 10 * minor; 0: no driver)

  /// Nothing to use: 0 devices, cudaErrorNoDevice, or no CUDA driver installed. GPU work skips.
  bool none() const noexcept {
    if (error == cudaSuccess) {
      return count == 0;
    }
    return error == cudaErrorNoDevice || (error == cudaErrorInsufficientDriver && driver_version == 0);
  }
  /// A driver or device is there but CUDA cannot use it (an old driver, a mismatch): an error, never a skip.
  bool unusable() const noexcept { return error != cudaSuccess && !none(); }

  /// Why there is no usable device, or how many there are: "2 devices", "0 devices", "no CUDA driver is
  /// installed", "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version
  /// (the driver supports CUDA 12.4, this program's runtime is 13.0)".
  std::string reason() const {
    if (error == cudaSuccess) {
      return std::to_string(count) + (count == 1 ? " device" : " devices");
    }
    if (error == cudaErrorInsufficientDriver && driver_version == 0) {
      return "no CUDA driver is installed";
    }
    std::string s = std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
    if (driver_version > 0) {
      int runtime = 0;
      (void)cudaRuntimeGetVersion(&runtime);
      s += " (the driver supports CUDA " + version_text(driver_version) + ", this program's runtime is " +
           version_text(runtime) + ")";
    }
    return s;
  }

private:
  static std::string version_text(int v) {
    return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
  }
};

/// The devices as the CUDA runtime reports them (never throws; leaves no sticky error behind).
inline CudaDevices probe_cuda_devices() noexcept {
  CudaDevices d;
  d.error = cudaGetDeviceCount(&d.count);
  if (d.error != cudaSuccess) {
    d.count = 0;
    (void)cudaGetLastError();
  }
  if (cudaDriverGetVersion(&d.driver_version) != cudaSuccess) {
    d.driver_version = 0;
    (void)cudaGetLastError();
  }
  return d;
}

} // namespace dtensor

#endif // DTENSOR_HAS_CUDA

#pragma once
// The skip policy of every GPU test (the CUDA Catch2 tests, nccl_suite): skip only where the machine has no
// usable CUDA device at all -- no device, or no CUDA driver installed (dtensor::CudaDevices::none) -- and
// fail loudly, naming the CUDA error, on anything else: a driver older than the runtime must fail, not skip.

#include "dtensor/core/cuda_devices.hpp"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace dtensor::test_support {

#ifdef DTENSOR_SKIP_CODE
inline constexpr int kSkipCode = DTENSOR_SKIP_CODE;
#else
inline constexpr int kSkipCode = 77; // ctest's SKIP_RETURN_CODE in this project
#endif

/// Returns when a CUDA device is visible. Without one, prints "note: no CUDA device visible (<why>);
/// skipping <what>" and ends the program with kSkipCode (ctest's skip). When a device or driver is there but
/// CUDA cannot use it, throws std::runtime_error naming the error (a Catch2 case then fails with it).
inline void require_cuda_device(const std::string& what) {
  const CudaDevices d = probe_cuda_devices();
  if (d.count > 0) {
    return;
  }
  if (d.none()) {
    std::printf("note: no CUDA device visible (%s); skipping %s\n", d.reason().c_str(), what.c_str());
    std::fflush(stdout);
    std::exit(kSkipCode);
  }
  throw std::runtime_error("CUDA cannot use this machine's GPU, so " + what +
                           " fail instead of skipping: " + d.reason());
}

} // namespace dtensor::test_support

#pragma once
// The skip policy of every GPU test (the CUDA Catch2 tests, nccl_suite): skip only where the machine has no
// usable CUDA device at all -- no device, or no CUDA driver installed (dtensor::CudaDevices::none) -- and
// fail loudly, naming the CUDA error, on anything else: a driver older than the runtime must fail, not skip.
// With it, what every CUDA test file would otherwise write again:
//
//   using dtensor::test_support::require_cuda_device;
//   TEST_CASE("...", "[cuda]") {
//     require_cuda_device();                       // skips the program without a GPU, naming this file
//     dtensor::test_support::CudaStream stream;    // a non-blocking stream, destroyed at the end

#include "dtensor/core/cuda_devices.hpp"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <source_location>
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

/// The same for the test cases of a CUDA test file (call it first in each case that needs a GPU): the
/// note names the calling file, "skipping the tests of test_random_cuda.cu".
inline void require_cuda_device(const std::source_location& caller = std::source_location::current()) {
  const std::string path = caller.file_name();
  require_cuda_device("the tests of " + path.substr(path.find_last_of('/') + 1));
}

/// A non-blocking CUDA stream made for a test and destroyed after it: pass `stream.s` to tensors and ops.
/// Throws std::runtime_error (a failed test case) when CUDA cannot make one.
struct CudaStream {
  cudaStream_t s = nullptr;

  CudaStream() {
    const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      throw std::runtime_error(std::string("cudaStreamCreateWithFlags failed: ") + cudaGetErrorName(e) +
                               ": " + cudaGetErrorString(e));
    }
  }
  ~CudaStream() { (void)cudaStreamDestroy(s); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
};

} // namespace dtensor::test_support

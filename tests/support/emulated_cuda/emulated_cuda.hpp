#pragma once
// The emulated CUDA device: a CUDA runtime and cuBLAS for a machine without a GPU, so that the device
// kernels of the local ops run, and are checked against the host kernels, in CI. A program built in
// emulation (every TU with DTENSOR_EMULATE_DEVICE=1 and DTENSOR_HAS_CUDA=1: CMake's dtensor_emulated_cuda
// target) links this library instead of libcudart and libcublas; the CUDA headers are the toolkit's own.
//
//   dtensor::Tensor<float, 1> d = host.to(dtensor::Device::cuda());   // cudaMallocAsync, cudaMemcpyAsync
//   dtensor::local::scale(d, 2.0);                                     // the device kernel, on the host
//   auto n = dtensor::emulated_cuda::counters().stream_syncs;          // host synchronisations so far
//
// What it is: one device (cuda:0), executing everything at once on the calling thread (every stream is
// always idle, so synchronising returns at once, but is counted). Kernels are local/copy.hpp's Thrust
// functors, compiled for Thrust's host system and launched through cudaLaunchKernel with their device
// paths (DTENSOR_ON_DEVICE), indices in descending order. cuBLAS's GEMMs are a column-major reference loop
// (float accumulation for CUBLAS_COMPUTE_32F, double for 64F), with cuBLAS's argument checks (sizes,
// leading dimensions, types), so the row-major to column-major mapping and the grouped GEMM's pointer
// arrays (read from device memory) are checked for real.
//
// Device memory is a PROT_NONE arena: each allocation on pages of its own, its end at the end of its last
// page (at cudaMalloc's 256-byte alignment) and an unmapped guard page after it, readable and writable only
// while an emulated kernel, copy, memset or GEMM runs (and then only the live allocations). Host code that
// dereferences a device pointer, and a kernel that reads past an allocation or after a free, crash here as
// they would on a GPU (or worse). Copies, memsets and GEMM operands must lie inside one live allocation
// (device) or outside the arena (host), as their cudaMemcpyKind says; otherwise the call fails with
// cudaErrorInvalidValue (CUBLAS_STATUS_INVALID_VALUE), naming nothing, as CUDA does. Fresh allocations
// hold 0xff bytes (NaN, -1), not zeros, so an output element a kernel forgets to write shows.
//
// What emulation proves: the kernels' logic (indexing, tiles, strides, broadcasting, the device branches
// of every DTENSOR_ON_DEVICE site, dropout keys, GQA head mapping...), the launch sites (counts, which
// stream and device, what is read from where), the host <-> device traffic of the ops, and the cuBLAS
// argument mapping. What it does not: that nvcc compiles the code (CI's nvcc build does that), CUDA's
// libm (expf, logf, erf: the C library's here, a few ulps apart), fused multiply-adds nvcc contracts,
// real concurrency (races between threads of one kernel, between streams, between host and device:
// everything here is ordered), stream-order bugs (a missing synchronisation is invisible when every call
// completes at once), device limits (grid sizes, memory), cuBLAS's own numerics (blocking, split-k), and
// kernels that read host memory (allowed here, a crash or a slow path on a GPU).

#include <cstdint>

namespace dtensor::emulated_cuda {

/// What the emulated device has done since the program started.
struct Counters {
  std::int64_t kernels = 0;      ///< cudaLaunchKernel calls that ran
  std::int64_t stream_syncs = 0; ///< cudaStreamSynchronize (and cudaEventSynchronize)
  std::int64_t device_syncs = 0; ///< cudaDeviceSynchronize
  std::int64_t copies = 0;       ///< cudaMemcpy*, host <-> device and device <-> device
  std::int64_t memsets = 0;      ///< cudaMemset*
  std::int64_t gemms = 0;        ///< cuBLAS GEMM calls
  std::int64_t allocations = 0;  ///< cudaMalloc / cudaMallocAsync
  std::int64_t live_bytes = 0;   ///< bytes allocated and not yet freed
};

/// A snapshot of the counters (thread safe).
Counters counters();

/// Whether `p` points into a live allocation of the emulated device.
bool is_device_pointer(const void* p);

} // namespace dtensor::emulated_cuda

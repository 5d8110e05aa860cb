#pragma once
// Build configuration: which optional facilities this translation unit sees.
//
// DTENSOR_HAS_CUDA is 1 when the build defines it (the CMake target dtensor::cuda, and dtensor::nccl
// through it, define it for every TU that links them) or, failing that, when the TU is compiled by nvcc;
// code that needs the CUDA runtime is guarded by it so the CPU build needs only C++20.
//
// One program, one meaning: Tensor, AnyTensor and what depends on the configuration live in an inline
// namespace named after it (DTENSOR_CONFIG_NS: `cuda1` or `cuda0`), and the local kernels (local/) in one
// named after the compiler too (DTENSOR_LOCAL_OPS_NS, see local/copy.hpp). Two TUs built differently
// then use different symbols instead of one inline function with two bodies (an ODR violation whose
// outcome depended on the link order); passing a Tensor between them fails to link rather than
// misbehaving. Link dtensor::cuda (or define DTENSOR_HAS_CUDA=1 everywhere) so .cpp and .cu TUs agree.

#ifndef DTENSOR_HAS_CUDA
#if defined(__CUDACC__)
#define DTENSOR_HAS_CUDA 1
#else
#define DTENSOR_HAS_CUDA 0
#endif
#endif

#if DTENSOR_HAS_CUDA
#define DTENSOR_CONFIG_NS cuda1
#else
#define DTENSOR_CONFIG_NS cuda0
#endif

#if defined(__CUDACC__)
#define DTENSOR_HOST_DEVICE __host__ __device__
#else
#define DTENSOR_HOST_DEVICE
#endif

// Device emulation (tests): DTENSOR_EMULATE_DEVICE=1 in a TU compiled by a plain C++ compiler with
// DTENSOR_HAS_CUDA=1 makes CUDA tensors run the device kernels' code on the host: the kernels are
// compiled with Thrust's host system and launched through the CUDA runtime's cudaLaunchKernel, which the
// emulated runtime of tests/support/emulated_cuda (linked instead of libcudart and cuBLAS) runs at once on
// the calling thread. It is a whole-program mode: every TU of the program defines it (the CMake target
// dtensor_emulated_cuda does); the local kernels take their own inline namespace (local/copy.hpp).
//
// DTENSOR_ON_DEVICE says whether the code running is device code, so that a kernel's device path and its
// host path can be written as `if (DTENSOR_ON_DEVICE) {...} else {...}` (host-only calls in the host path
// still sit under `#if !defined(__CUDA_ARCH__)`): a constant in nvcc's device pass (true) and in every
// other build (false), so nothing changes there; under emulation, a flag the emulated launch sets on its
// thread while a kernel runs, so CUDA tensors take the device path and host tensors the host path.
#ifndef DTENSOR_EMULATE_DEVICE
#define DTENSOR_EMULATE_DEVICE 0
#endif
#if DTENSOR_EMULATE_DEVICE
#if defined(__CUDACC__)
#error "DTENSOR_EMULATE_DEVICE: compile with a host C++ compiler (g++, clang++), not nvcc"
#endif
#if !DTENSOR_HAS_CUDA
#error "DTENSOR_EMULATE_DEVICE needs DTENSOR_HAS_CUDA=1 (CUDA tensors, the CUDA headers)"
#endif
namespace dtensor::detail {
/// True on a thread while it runs an emulated kernel (set by local/copy.hpp's emulated launch).
inline thread_local bool emulated_device_code = false;
} // namespace dtensor::detail
#define DTENSOR_ON_DEVICE (::dtensor::detail::emulated_device_code)
#elif defined(__CUDA_ARCH__)
#define DTENSOR_ON_DEVICE true
#else
#define DTENSOR_ON_DEVICE false
#endif

// Marks a function that only runs when something failed (building an error message): never inlined and
// optimised for size, which keeps the hot paths small and every TU's optimiser work down.
#if defined(__GNUC__) && !defined(__CUDA_ARCH__)
#define DTENSOR_COLD [[gnu::cold, gnu::noinline]]
#else
#define DTENSOR_COLD
#endif

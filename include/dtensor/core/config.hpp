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

// Marks a function that only runs when something failed (building an error message): never inlined and
// optimised for size, which keeps the hot paths small and every TU's optimiser work down.
#if defined(__GNUC__) && !defined(__CUDA_ARCH__)
#define DTENSOR_COLD [[gnu::cold, gnu::noinline]]
#else
#define DTENSOR_COLD
#endif

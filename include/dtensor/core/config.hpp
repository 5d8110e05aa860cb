#pragma once
// Build configuration: which optional facilities this translation unit sees.
//
// DTENSOR_HAS_CUDA is 1 when the TU is compiled by nvcc (or another CUDA compiler) or when the build
// defines it; code that needs the CUDA runtime is guarded by it so the CPU build needs only C++20.

#ifndef DTENSOR_HAS_CUDA
#if defined(__CUDACC__)
#define DTENSOR_HAS_CUDA 1
#else
#define DTENSOR_HAS_CUDA 0
#endif
#endif

#if defined(__CUDACC__)
#define DTENSOR_HOST_DEVICE __host__ __device__
#else
#define DTENSOR_HOST_DEVICE
#endif

// The CUDA tests, as they are, on the emulated device (tests/support/emulated_cuda): their sources compiled
// by the host compiler with DTENSOR_EMULATE_DEVICE, so every kernel they launch runs its device code on the
// host, at their shapes and dtypes, against the host kernels they compare with: attention forward and
// backward, copies, fills, scale, the fp8 and 16-bit conversions in device code, tensors and streams, rand,
// randn and dropout, SGD, AdamW, clip_grad_norm's sums, init's fills, the cuBLAS GEMMs and grouped GEMM.
// One TU (each of these sources alone would parse Catch2 and the library again).

#include "../core/test_tensor_cuda.cu"
#include "../local/test_gemm_cuda.cu"
#include "../local/test_kernels_cuda.cu"
#include "../ops/test_random_cuda.cu"
#include "../train/test_optim_cuda.cu"

static_assert(DTENSOR_EMULATE_DEVICE == 1 && DTENSOR_LOCAL_OPS_CUDA == 1,
              "built in emulation: CUDA tensors run the device kernels on the host");

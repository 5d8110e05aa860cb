// The redistribution suite compiled by nvcc (bench_redistribution_cuda): DTensor's local copies and fills
// on CUDA tensors run as Thrust kernels, as in a user's nvcc translation unit. Run with --device cuda
// (redistribution_bench.cpp has the cases, the method and the flags).
#include "redistribution_bench.cpp"

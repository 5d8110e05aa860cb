// Random fills and dropout (local/random.hpp) on Device::cuda(0), made by kernels in this nvcc TU,
// against the host's, bit for bit: every element type, rand and randn, whole tensors of 2^20 elements (the
// log / cos of Box-Muller on many inputs), blocks at offsets of a larger global tensor written into
// strided device views, a tensor on a non-default stream, and dropout. The DTensor layer adds no
// arithmetic to these (each rank fills its block), so test_random.cpp's mesh tests carry over. Every test
// case exits with DTENSOR_SKIP_CODE when no GPU is visible (CI only compiles this file).

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>

#include "dtensor/core/tensor.hpp"
#include "dtensor/local/random.hpp"

#include "../support/cuda_device.hpp"

// CUDA's cuda_fp16.h declares a global ::half: name dtensor's types in full here.
using dtensor::Device;
using dtensor::GlobalBlock;
using dtensor::Tensor;
namespace local = dtensor::local;
using dtensor::test_support::CudaStream;
using dtensor::test_support::require_cuda_device;

static_assert(DTENSOR_HAS_CUDA == 1 && DTENSOR_HAS_RANDOM123 == 1 && DTENSOR_LOCAL_OPS_CUDA == 1,
              "this test links dtensor::cuda and dtensor::random and launches kernels");

namespace {

/// Number of elements where two host tensors of one shape differ in their bytes.
template <class T, int R>
std::int64_t differing(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  REQUIRE(a.shape() == b.shape());
  const Tensor<T, R> ca = a.contiguous();
  const Tensor<T, R> cb = b.contiguous();
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < ca.numel(); ++i) {
    bad += std::memcmp(&ca.data()[i], &cb.data()[i], sizeof(T)) != 0;
  }
  return bad;
}

template <class T, int R>
Tensor<T, R> block_of(const Tensor<T, R>& t, const typename Tensor<T, R>::Shape& offset,
                      const typename Tensor<T, R>::Shape& shape) {
  Tensor<T, R> v = t;
  for (int d = 0; d < R; ++d) {
    v = v.narrow(d, offset[d], shape[d]);
  }
  return v;
}

template <class T>
void check_type(const char* name) {
  INFO(name);
  const Device gpu = Device::cuda(0);
  // Whole tensors: 2^20 elements, rand and randn, two keys.
  for (std::uint64_t seed : {std::uint64_t{1}, std::uint64_t{0x9e3779b97f4a7c15ull}}) {
    const std::array<std::int64_t, 1> n{std::int64_t{1} << 20};
    CHECK(differing(local::rand<T, 1>(n, seed, 3, gpu).to(Device::cpu()), local::rand<T, 1>(n, seed, 3)) ==
          0);
    CHECK(differing(local::randn<T, 1>(n, seed, 3, gpu).to(Device::cpu()), local::randn<T, 1>(n, seed, 3)) ==
          0);
  }
  // Blocks of a (37, 19, 5) global tensor written into strided device views on a non-default stream.
  const std::array<std::int64_t, 3> global{37, 19, 5};
  const Tensor<T, 3> uniform = local::rand<T, 3>(global, 7, 1);
  const Tensor<T, 3> normal = local::randn<T, 3>(global, 7, 1);
  CudaStream stream;
  for (const auto& [at, shape] :
       {std::pair<std::array<std::int64_t, 3>, std::array<std::int64_t, 3>>{{0, 0, 0}, {37, 19, 5}},
        {{10, 3, 0}, {9, 16, 5}},
        {{36, 18, 4}, {1, 1, 1}},
        {{5, 0, 2}, {0, 19, 3}}}) {
    Tensor<T, 3> big(std::array<std::int64_t, 3>{shape[0] + 1, shape[1] + 2, shape[2] + 3}, gpu, stream.s);
    const Tensor<T, 3> window = block_of(big, {1, 1, 2}, shape);
    local::rand_into(window, 7, 1, GlobalBlock<3>{at, global});
    CHECK(differing(window.to(Device::cpu()), block_of(uniform, at, shape)) == 0);
    local::randn_into(window, 7, 1, GlobalBlock<3>{at, global});
    CHECK(differing(window.to(Device::cpu()), block_of(normal, at, shape)) == 0);
  }
  // Dropout of a device tensor, whole and as a block of its global tensor.
  const Tensor<T, 3> x = local::randn<T, 3>(global, 2);
  const Tensor<T, 3> xd = x.to(gpu);
  for (double p : {0.0, 0.1, 0.5, 1.0}) {
    CHECK(differing(local::dropout(xd, p, 5, 9).to(Device::cpu()), local::dropout(x, p, 5, 9)) == 0);
  }
  const std::array<std::int64_t, 3> at{4, 2, 1};
  const std::array<std::int64_t, 3> shape{20, 11, 3};
  const Tensor<T, 3> xb = block_of(x, at, shape).contiguous();
  CHECK(differing(local::dropout(xb.to(gpu), 0.3, 5, 9, GlobalBlock<3>{at, global}).to(Device::cpu()),
                  block_of(local::dropout(x, 0.3, 5, 9), at, shape)) == 0);
}

} // namespace

TEST_CASE("CUDA rand, randn and dropout equal the host's bit for bit", "[cuda][ops]") {
  require_cuda_device();
  check_type<float>("float");
  check_type<double>("double");
  check_type<dtensor::bfloat16>("bfloat16");
  check_type<dtensor::half>("half");
}

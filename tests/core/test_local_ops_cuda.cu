// Local data movement (local/copy.hpp) on Device::cuda(0), as Thrust kernels: strided copies,
// fills and scalings of narrowed device views of ranks 1-4 against the host path, every element type,
// and the fp8 conversions in device code against the host ones. Every test case exits with
// DTENSOR_SKIP_CODE when no GPU is visible (CI only compiles this file).

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/core/tensor_io.hpp"
#include "dtensor/local/copy.hpp"

#include "../support/cuda_device.hpp"
#include "../support/random_bytes.hpp"

// Thrust includes CUDA's cuda_fp16.h, which declares a global ::half: name dtensor's types in full here.
using dtensor::Device;
using dtensor::Tensor;
namespace local = dtensor::local;
using dtensor::test_support::require_cuda_device;

static_assert(DTENSOR_HAS_CUDA == 1, "this test is compiled by nvcc");
static_assert(DTENSOR_LOCAL_OPS_CUDA == 1,
              "nvcc with the CUDA Toolkit's Thrust: device tensors run as kernels");

namespace {

using dtensor::test_support::random_bytes;

/// True when the two host tensors hold the same bytes (contiguous, same shape).
template <class T, int R>
bool same_bytes(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

template <class T, int R>
Tensor<T, R> narrowed(Tensor<T, R> t, const std::array<std::int64_t, R>& offset,
                      const std::array<std::int64_t, R>& shape) {
  for (int d = 0; d < R; ++d) {
    t = t.narrow(d, offset[d], shape[d]);
  }
  return t;
}

/// The same copy and fill on host and device views must leave the same bytes in the parents.
template <class T, int R>
void check_device_against_host(std::mt19937& rng) {
  for (int trial = 0; trial < 8; ++trial) {
    std::array<std::int64_t, R> shape{}, parent{}, dst_at{}, src_at{};
    for (int d = 0; d < R; ++d) {
      shape[d] = 1 + static_cast<std::int64_t>(rng() % 5);
      parent[d] = shape[d] + static_cast<std::int64_t>(rng() % 3);
      dst_at[d] = static_cast<std::int64_t>(rng() % (parent[d] - shape[d] + 1));
      src_at[d] = static_cast<std::int64_t>(rng() % (parent[d] - shape[d] + 1));
    }
    const auto host_dst = random_bytes<T, R>(parent, rng);
    const auto host_src = random_bytes<T, R>(parent, rng);
    const auto dev_dst = host_dst.to(Device::cuda());
    const auto dev_src = host_src.to(Device::cuda());
    local::copy(narrowed<T, R>(host_dst, dst_at, shape), narrowed<T, R>(host_src, src_at, shape));
    local::copy(narrowed<T, R>(dev_dst, dst_at, shape), narrowed<T, R>(dev_src, src_at, shape));
    INFO("rank " << R << ", trial " << trial);
    CHECK(same_bytes(dev_dst.to(Device::cpu()), host_dst));
    const T value = T(static_cast<float>(3));
    local::fill(narrowed<T, R>(host_dst, src_at, shape), value);
    local::fill(narrowed<T, R>(dev_dst, src_at, shape), value);
    CHECK(same_bytes(dev_dst.to(Device::cpu()), host_dst));
  }
}

__global__ void fp8_round_trip(const float* in, std::uint8_t* e4m3, std::uint8_t* e5m2, float* back4,
                               float* back5, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    e4m3[i] = dtensor::float8_e4m3(in[i]).bits;
    e5m2[i] = dtensor::float8_e5m2(in[i]).bits;
    back4[i] = dtensor::float8_e4m3::from_bits(static_cast<std::uint8_t>(i & 0xff));
    back5[i] = dtensor::float8_e5m2::from_bits(static_cast<std::uint8_t>(i & 0xff));
  }
}

} // namespace

TEMPLATE_TEST_CASE("device copies and fills match the host path", "[cuda][local_ops]", float, double,
                   dtensor::bfloat16, dtensor::half, dtensor::float8_e4m3, dtensor::float8_e5m2, std::int32_t,
                   std::int64_t, std::uint8_t) {
  require_cuda_device();
  std::mt19937 rng(3);
  check_device_against_host<TestType, 1>(rng);
  check_device_against_host<TestType, 2>(rng);
  check_device_against_host<TestType, 3>(rng);
  check_device_against_host<TestType, 4>(rng);
}

TEST_CASE("device scale, host <-> device copies, and a second stream", "[cuda][local_ops]") {
  require_cuda_device();
  auto h = Tensor<float, 2>::full({5, 7}, 2.0f);
  auto d = h.to(Device::cuda());
  local::scale(d.narrow(1, 2, 3), 1.5);
  local::scale(h.narrow(1, 2, 3), 1.5);
  CHECK(dtensor::equal(d, h));
  // Host <-> device goes through Tensor::copy_from.
  auto back = Tensor<float, 2>::zeros({5, 3});
  local::copy(back, d.narrow(1, 2, 3));
  CHECK(dtensor::equal(back, h.narrow(1, 2, 3)));
  // A tensor on its own stream: the kernel runs there and the op is still synchronous.
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  {
    Tensor<float, 2> other({5, 3}, Device::cuda(), s);
    local::copy(other, d.narrow(1, 2, 3));
    CHECK(dtensor::equal(other, h.narrow(1, 2, 3)));
    local::fill(other, 7.0f);
    CHECK(dtensor::equal(other, Tensor<float, 2>::full({5, 3}, 7.0f)));
  }
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  // An empty view launches nothing.
  local::fill(d.narrow(0, 0, 0), 1.0f);
}

TEST_CASE("fp8 conversions agree between host and device", "[cuda][fp8]") {
  require_cuda_device();
  std::vector<float> in;
  for (std::uint32_t u = 0; u < 0xffffffffu - 65521; u += 65521) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    in.push_back(f);
  }
  for (float f : {0.0f, -0.0f, 1.0625f, 448.0f, 464.0f, 464.5f, 61440.0f, 0x1p-10f, 0x1p-17f, 3 * 0x1p-17f}) {
    in.push_back(f);
  }
  while (in.size() % 256 != 0) {
    in.push_back(1.0f);
  }
  const int n = static_cast<int>(in.size());
  auto d_in = Tensor<float, 1>::from_blob(in.data(), {n}).to(Device::cuda());
  auto e4 = Tensor<std::uint8_t, 1>({n}, Device::cuda());
  auto e5 = Tensor<std::uint8_t, 1>({n}, Device::cuda());
  auto b4 = Tensor<float, 1>({n}, Device::cuda());
  auto b5 = Tensor<float, 1>({n}, Device::cuda());
  fp8_round_trip<<<(n + 255) / 256, 256>>>(d_in.data(), e4.data(), e5.data(), b4.data(), b5.data(), n);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const auto h4 = e4.to(Device::cpu());
  const auto h5 = e5.to(Device::cpu());
  const auto hb4 = b4.to(Device::cpu());
  const auto hb5 = b5.to(Device::cpu());
  int wrong = 0;
  for (int i = 0; i < n; ++i) {
    wrong += h4.data()[i] == dtensor::float8_e4m3(in[i]).bits ? 0 : 1;
    wrong += h5.data()[i] == dtensor::float8_e5m2(in[i]).bits ? 0 : 1;
    const float r4 = dtensor::float8_e4m3::from_bits(static_cast<std::uint8_t>(i & 0xff));
    const float r5 = dtensor::float8_e5m2::from_bits(static_cast<std::uint8_t>(i & 0xff));
    wrong += std::memcmp(&r4, hb4.data() + i, 4) == 0 ? 0 : 1;
    wrong += std::memcmp(&r5, hb5.data() + i, 4) == 0 ? 0 : 1;
  }
  CHECK(wrong == 0);
}

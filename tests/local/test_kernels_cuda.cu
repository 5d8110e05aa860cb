// Local data movement (local/copy.hpp) on Device::cuda(0), as Thrust kernels: strided copies,
// fills and scalings of narrowed device views of ranks 1-4 against the host path, every element type,
// and the fp8 conversions in device code against the host ones. Local attention of CUDA tensors
// (local/attention_cuda.hpp) against the host kernel: forward and backward, GQA, causal, dropout, given
// positions and a head offset, float, double and bfloat16. Every test case exits with
// DTENSOR_SKIP_CODE when no GPU is visible (CI only compiles this file).

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/core/tensor_io.hpp"
#include "dtensor/local/attention.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"

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

/// Element i: in[i] to both fp8 formats (the bits), and bit pattern i & 0xff of each back to float. A kernel
/// launched by the library's launcher (local::launch), so an emulated build runs it too.
struct Fp8RoundTrip {
  struct {
    std::int64_t count;
  } layout;
  const float* in;
  std::uint8_t* e4m3;
  std::uint8_t* e5m2;
  float* back4;
  float* back5;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    e4m3[i] = dtensor::float8_e4m3(in[i]).bits;
    e5m2[i] = dtensor::float8_e5m2(in[i]).bits;
    back4[i] = dtensor::float8_e4m3::from_bits(static_cast<std::uint8_t>(i & 0xff));
    back5[i] = dtensor::float8_e5m2::from_bits(static_cast<std::uint8_t>(i & 0xff));
  }
};

/// Host inputs: multiples of 1/8 in [-1, 1] (exact in every element type).
template <class T>
Tensor<T, 4> attention_input(std::array<std::int64_t, 4> shape, int seed) {
  Tensor<T, 4> t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = T(0.125f * static_cast<float>((i * 7 + seed * 13 + (i * i) % 5) % 17 - 8));
  }
  return t;
}

/// The largest |device - host| relative to 1 + |host| (device copied back).
template <class T, int R>
double max_rel_diff(const Tensor<T, R>& device, const Tensor<T, R>& host) {
  const auto d = device.to(Device::cpu());
  REQUIRE(d.shape() == host.shape());
  double m = 0;
  for (std::int64_t i = 0; i < d.numel(); ++i) {
    const double a = static_cast<double>(static_cast<float>(d.data()[i]));
    const double b = static_cast<double>(static_cast<float>(host.data()[i]));
    m = std::max(m, (a == b) ? 0.0 : std::abs(a - b) / (1 + std::abs(b)));
  }
  return m;
}

} // namespace

TEMPLATE_TEST_CASE("attention of CUDA tensors equals the host kernel's, forward and backward",
                   "[cuda][attention]", float, double, dtensor::bfloat16) {
  require_cuda_device();
  using T = TestType;
  const double tol = std::is_same_v<T, double> ? 1e-10 : std::is_same_v<T, float> ? 1e-4 : 2e-2;
  // GQA: local q heads 4 of a global 8 starting at head 4, k/v heads 2 of 4; a batch offset; 37 queries
  // and 45 keys at ascending global positions of a sequence of 91 (as a shard of a zigzag layout holds)
  const auto q = attention_input<T>({2, 4, 37, 5}, 1);
  const auto k = attention_input<T>({2, 2, 45, 5}, 2);
  const auto v = attention_input<T>({2, 2, 45, 3}, 3);
  const auto g = attention_input<T>({2, 4, 37, 3}, 4);
  std::vector<std::int64_t> q_pos, k_pos;
  for (std::int64_t i = 0; i < 37; ++i) {
    q_pos.push_back(i < 19 ? 2 * i : 91 - 37 + i); // two runs, front and back
  }
  for (std::int64_t j = 0; j < 45; ++j) {
    k_pos.push_back(2 * j);
  }
  struct Case {
    bool causal;
    double dropout;
    bool coords;
  };
  for (const Case c : {Case{false, 0, false}, Case{true, 0, false}, Case{true, 0.25, false},
                       Case{true, 0, true}, Case{false, 0.5, true}}) {
    INFO("causal " << c.causal << ", dropout " << c.dropout << ", positions and offsets " << c.coords);
    const local::AttentionParams params{
        .causal = c.causal, .scale = 0, .dropout = c.dropout, .seed = 7, .offset = 3};
    local::AttentionCoords coords;
    if (c.coords) {
      coords = {.batch0 = 1,
                .head0 = 4,
                .heads = 8,
                .kv_heads = 4,
                .seq_q = 91,
                .seq_k = 91,
                .q_pos = q_pos.data(),
                .k_pos = k_pos.data()};
    }
    const auto [o, lse] = local::attention_forward(q, k, v, params, coords);
    const auto [dq, dk, dv] = local::attention_backward(q, k, v, o, lse, g, params, coords);
    const Device gpu = Device::cuda();
    const auto [o_d, lse_d] = local::attention_forward(q.to(gpu), k.to(gpu), v.to(gpu), params, coords);
    CHECK(o_d.device() == gpu);
    CHECK(max_rel_diff(o_d, o) <= tol);
    CHECK(max_rel_diff(lse_d, lse) <= tol);
    const auto [dq_d, dk_d, dv_d] =
        local::attention_backward(q.to(gpu), k.to(gpu), v.to(gpu), o_d, lse_d, g.to(gpu), params, coords);
    CHECK(max_rel_diff(dq_d, dq) <= tol);
    CHECK(max_rel_diff(dk_d, dk) <= tol);
    CHECK(max_rel_diff(dv_d, dv) <= tol);
  }
}

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
  // A tensor on its own stream: the kernel runs there, stream-ordered after d's stream (local::copy joins
  // the two), and reading it back waits for it.
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
  local::launch(Fp8RoundTrip{{n}, d_in.data(), e4.data(), e5.data(), b4.data(), b5.data()}, Device::cuda(),
                nullptr, "fp8 round trip");
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

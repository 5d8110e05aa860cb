// The training utilities' local kernels on Device::cuda(0), made in this nvcc TU, against the host's: SGD
// and AdamW steps of raw shards (float, and bfloat16 with fp32 state and master weights) within float
// rounding (nvcc contracts multiply-adds), the local sums of clip_grad_norm, and init's fills bit for bit
// (one explicit fma each). The DTensor layer adds no arithmetic to these (each rank runs them on its
// shard), so test_optim.cpp's mesh tests carry over. Every test case exits with DTENSOR_SKIP_CODE when no
// GPU is visible (CI only compiles this file).

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime_api.h>

#include "dtensor/core/tensor.hpp"
#include "dtensor/nn/init.hpp"
#include "dtensor/train/clip.hpp"
#include "dtensor/train/optim.hpp"

#include "../support/cuda_device.hpp"

// CUDA's cuda_fp16.h declares a global ::half: name dtensor's types in full here.
using dtensor::bfloat16;
using dtensor::Device;
using dtensor::GlobalBlock;
using dtensor::Tensor;
using dtensor::test_support::require_cuda_device;
namespace optim = dtensor::optim;

static_assert(DTENSOR_HAS_CUDA == 1 && DTENSOR_HAS_RANDOM123 == 1 && DTENSOR_LOCAL_OPS_CUDA == 1,
              "this test links dtensor::cuda and dtensor::random and launches kernels");

namespace {

template <class T>
Tensor<T, 1> host_values(std::int64_t n, int seed, double scale) {
  Tensor<T, 1> t({n});
  for (std::int64_t i = 0; i < n; ++i) {
    t.data()[i] = T(static_cast<float>(scale * double((i * 7 + seed * 13 + (i * i) % 5) % 7 - 3)));
  }
  return t;
}

template <class Opt, class T>
void compare_steps(const typename Opt::options_type& options, double tol) {
  const std::int64_t n = 100003;
  Tensor<T, 1> host = host_values<T>(n, 1, 0.5);
  Tensor<T, 1> device = host.to(Device::cuda(0));
  Opt on_host(options), on_device(options);
  for (int step = 0; step < 4; ++step) {
    const Tensor<T, 1> g = host_values<T>(n, 10 + step, 0.25);
    on_host.step(0, host, g);
    on_device.step(0, device, g.to(Device::cuda(0)));
  }
  const Tensor<T, 1> back = device.to(Device::cpu());
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double a = static_cast<float>(host.data()[i]);
    const double b = static_cast<float>(back.data()[i]);
    bad += std::abs(a - b) > tol * (1 + std::abs(a));
  }
  CHECK(bad == 0);
}

} // namespace

TEST_CASE("SGD and AdamW steps of CUDA shards equal the host's within float rounding", "[parallel][cuda]") {
  require_cuda_device();
  compare_steps<optim::SGD, float>({.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
                                   1e-6);
  compare_steps<optim::SGD, float>({.lr = 0.05, .momentum = 0.8, .nesterov = true}, 1e-6);
  compare_steps<optim::AdamW, float>({.lr = 0.05, .weight_decay = 0.1, .amsgrad = true}, 1e-5);
  // bfloat16: fp32 state on the device; a rounding of the update may land on either neighbour.
  compare_steps<optim::AdamW, bfloat16>({.lr = 0.01, .master_weights = true}, 1e-2);
  compare_steps<optim::SGD, bfloat16>({.lr = 0.05, .momentum = 0.9}, 1e-2);
}

TEST_CASE("clip_grad_norm's local sums on CUDA equal the host's", "[parallel][cuda]") {
  require_cuda_device();
  const Tensor<float, 1> x = host_values<float>((1 << 20) + 5, 3, 1);
  const Tensor<float, 1> d = x.to(Device::cuda(0));
  for (dtensor::NormType t : {dtensor::l2_norm, dtensor::inf_norm, dtensor::NormType{1}}) {
    // Integer values: the sums are exact in any order.
    CHECK(dtensor::detail::local_norm_sum(d, t) == dtensor::detail::local_norm_sum(x, t));
  }
}

TEST_CASE("init's fills on CUDA equal the host's bit for bit", "[parallel][cuda]") {
  require_cuda_device();
  const std::array<std::int64_t, 2> global{300, 257};
  const GlobalBlock<2> whole{{0, 0}, global};
  auto check = [&](auto gen) {
    using T = decltype(gen(std::uint64_t{0}));
    Tensor<T, 2> host(global);
    Tensor<T, 2> device(global, Device::cuda(0));
    dtensor::local::fill_random(host, gen, whole, "test");
    dtensor::local::fill_random(device, gen, whole, "test");
    const Tensor<T, 2> back = device.to(Device::cpu());
    CHECK(std::memcmp(host.data(), back.data(), host.nbytes()) == 0);
  };
  check(dtensor::init::detail::NormalFill<float>{7, 3, 0.5, 0.02});
  check(dtensor::init::detail::NormalFill<double>{7, 3, -1, 3});
  check(dtensor::init::detail::NormalFill<bfloat16>{7, 4, 0, 0.1});
  check(dtensor::init::detail::UniformFill<float>{9, 1, -0.3, 0.6});
  check(dtensor::init::detail::UniformFill<double>{9, 2, -2, 4});
}

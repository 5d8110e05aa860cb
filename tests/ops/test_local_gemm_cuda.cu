// The local GEMM (local/gemm.hpp) on Device::cuda(0) through cuBLAS, against the host GEMM (itself
// checked against a triple loop in test_local_gemm.cpp): every element type, rank 2 and batched (rank 3 x
// rank 2, rank 3 x rank 3), the four transposes, operands and outputs contiguous, padded, column-major
// and strided (copied), alpha and beta, empty m, n and k, with c on a non-default stream. Integer data:
// cuBLAS accumulates bfloat16 and half in float too, so the results must be equal bit for bit. Every test
// case exits with DTENSOR_SKIP_CODE when no GPU is visible (CI only compiles this file).

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include <cuda_runtime_api.h>

#include "dtensor/core/tensor.hpp"
#include "dtensor/local/gemm.hpp"

#include "../support/cuda_device.hpp"
#include "../support/gemm_operands.hpp"

// CUDA's cuda_fp16.h declares a global ::half: name dtensor's types in full here.
using dtensor::Device;
using dtensor::Tensor;
using dtensor::test_support::Layout;
using dtensor::test_support::layouts;
using dtensor::test_support::make_operand;
namespace local = dtensor::local;
using dtensor::test_support::CudaStream;
using dtensor::test_support::require_cuda_device;

static_assert(DTENSOR_HAS_CUDA == 1 && DTENSOR_HAS_CUBLAS == 1, "this test links dtensor::cuda with cuBLAS");

namespace {

/// Number of elements of c's whole buffer (view and gaps) where the GPU's result differs from the host's.
template <class T, int R, int R2>
int check_case(std::int64_t batch, std::int64_t m, std::int64_t n, std::int64_t k, bool ta, bool tb,
               Layout la, Layout lb, Layout lc, double alpha, double beta, cudaStream_t stream,
               std::mt19937& rng) {
  auto a = make_operand<T, R>(batch, ta ? k : m, ta ? m : k, la, rng);
  auto b = make_operand<T, R2>(batch, tb ? n : k, tb ? k : n, lb, rng);
  auto c = make_operand<T, R>(batch, m, n, lc, rng);
  const Tensor<T, 1> da = a.owner.to(Device::cuda(0));
  const Tensor<T, 1> db = b.owner.to(Device::cuda(0));
  const Tensor<T, 1> dc = c.owner.to(Device::cuda(0));
  // a and b on the legacy default stream (ready: to() synchronises), c on `stream`: copies of a and b
  // must live until the GEMM on c's stream has read them.
  local::matmul_into(a.view_of(da), b.view_of(db), c.view_of(dc, stream), ta, tb, alpha, beta);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  local::matmul_into(a.view, b.view, c.view, ta, tb, alpha, beta);
  const Tensor<T, 1> got = dc.to(Device::cpu());
  int bad = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    bad += std::memcmp(&got.data()[i], &c.owner.data()[i], sizeof(T)) != 0;
  }
  if (bad != 0) {
    UNSCOPED_INFO("batch " << batch << " m " << m << " n " << n << " k " << k << " trans " << ta << tb
                           << " layouts " << int(la) << int(lb) << int(lc) << " alpha " << alpha << " beta "
                           << beta);
  }
  return bad;
}

struct Sizes {
  std::int64_t m, n, k;
};
constexpr std::array<Sizes, 5> sizes{{{3, 5, 7}, {17, 9, 13}, {0, 4, 5}, {4, 0, 5}, {4, 5, 0}}};

template <class T, int R, int R2>
void check_all(std::int64_t batch) {
  require_cuda_device();
  CudaStream stream;
  std::mt19937 rng(2024);
  int bad = 0;
  for (const Sizes& s : sizes) {
    for (int t = 0; t < 4; ++t) {
      for (Layout la : layouts) {
        for (Layout lb : layouts) {
          for (Layout lc : layouts) {
            for (const auto& [alpha, beta] : {std::pair{1.0, 0.0}, std::pair{2.0, -1.0}}) {
              bad += check_case<T, R, R2>(batch, s.m, s.n, s.k, (t & 1) != 0, (t & 2) != 0, la, lb, lc, alpha,
                                          beta, stream.s, rng);
            }
          }
        }
      }
    }
  }
  CHECK(bad == 0);
}

} // namespace

TEMPLATE_TEST_CASE("cuBLAS matmul_into: rank 2, every transpose, layout and size", "[gemm][cuda]", float,
                   double, dtensor::bfloat16, dtensor::half) {
  check_all<TestType, 2, 2>(1);
}

TEMPLATE_TEST_CASE("cuBLAS matmul_into: rank 3 x rank 2 and rank 3 x rank 3", "[gemm][cuda]", float, double,
                   dtensor::bfloat16, dtensor::half) {
  check_all<TestType, 3, 2>(3);
  check_all<TestType, 3, 3>(2);
}

TEST_CASE("cuBLAS matmul: the allocating form on a's device and stream, and a device mismatch",
          "[gemm][cuda]") {
  require_cuda_device();
  CudaStream stream;
  Tensor<float, 3> x(std::array<std::int64_t, 3>{4, 6, 8}, Device::cuda(0), stream.s);
  x.fill(1.0f);
  const auto w = Tensor<float, 2>::full({5, 8}, 0.5f, Device::cuda(0));
  const Tensor<float, 3> y = local::matmul(x, w, false, true);
  CHECK(y.device() == Device::cuda(0));
  CHECK(y.stream() == stream.s);
  REQUIRE(cudaStreamSynchronize(stream.s) == cudaSuccess);
  const Tensor<float, 3> h = y.to(Device::cpu());
  for (std::int64_t i = 0; i < h.numel(); ++i) {
    CHECK(h.data()[i] == 4.0f);
  }
  const auto host_w = Tensor<float, 2>::full({5, 8}, 0.5f);
  try {
    local::matmul(x, host_w, false, true);
    FAIL("no error for operands on two devices");
  } catch (const dtensor::Error& e) {
    CHECK(std::string(e.what()).find("a is on cuda:0 but b on cpu") != std::string::npos);
  }
}

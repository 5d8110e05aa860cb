// The local GEMM (local/gemm.hpp) on Device::cuda(0) through cuBLAS, against the host GEMM (itself
// checked against a triple loop in test_gemm.cpp): every element type, rank 2 and batched (rank 3 x
// rank 2, rank 3 x rank 3), the four transposes, operands and outputs contiguous, padded, column-major
// and strided (copied), alpha and beta, empty m, n and k, with c on a non-default stream. Integer data:
// cuBLAS accumulates bfloat16 and half in float too, so the results must be equal bit for bit. Every test
// case exits with DTENSOR_SKIP_CODE when no GPU is visible (CI only compiles this file).
// The grouped GEMM (local/grouped_gemm.hpp) the same way: one cublasGemmGroupedBatchedEx for float,
// bfloat16 and half, the per-group loop for double, against the host's per-group matmul_into.

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "dtensor/core/tensor.hpp"
#include "dtensor/local/gemm.hpp"
#include "dtensor/local/grouped_gemm.hpp"

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

namespace {

/// One grouped_matmul_into on the GPU (a and b on the legacy default stream, every c on `stream`) over
/// groups of different sizes (an empty m, n and k among them), each in its own layouts, against the host's
/// matmul_into on each group. Compares c's whole buffers bit for bit; returns the number that differ.
template <class T>
int check_grouped(bool ta, bool tb, double alpha, double beta, int rotation, cudaStream_t stream,
                  std::mt19937& rng) {
  constexpr std::array<Sizes, 6> group_sizes{
      {{3, 5, 7}, {0, 4, 5}, {17, 9, 13}, {4, 6, 0}, {1, 1, 1}, {5, 0, 3}}};
  std::vector<dtensor::test_support::Operand<T, 2>> a, b, c;
  std::vector<Tensor<T, 1>> da, db, dc;
  std::vector<Tensor<T, 2>> av, bv, cv;
  for (std::size_t g = 0; g < group_sizes.size(); ++g) {
    const auto [m, n, k] = group_sizes[g];
    const auto layout = [&](std::size_t shift) { return layouts[(g + shift + rotation) % layouts.size()]; };
    a.push_back(make_operand<T, 2>(1, ta ? k : m, ta ? m : k, layout(0), rng));
    b.push_back(make_operand<T, 2>(1, tb ? n : k, tb ? k : n, layout(1), rng));
    c.push_back(make_operand<T, 2>(1, m, n, layout(2), rng));
    da.push_back(a[g].owner.to(Device::cuda(0)));
    db.push_back(b[g].owner.to(Device::cuda(0)));
    dc.push_back(c[g].owner.to(Device::cuda(0)));
    av.push_back(a[g].view_of(da[g]));
    bv.push_back(b[g].view_of(db[g]));
    cv.push_back(c[g].view_of(dc[g], stream));
  }
  local::grouped_matmul_into<T>(av, bv, cv, ta, tb, alpha, beta);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  int bad = 0;
  for (std::size_t g = 0; g < group_sizes.size(); ++g) {
    local::matmul_into(a[g].view, b[g].view, c[g].view, ta, tb, alpha, beta);
    const Tensor<T, 1> got = dc[g].to(Device::cpu());
    for (std::int64_t i = 0; i < got.numel(); ++i) {
      bad += std::memcmp(&got.data()[i], &c[g].owner.data()[i], sizeof(T)) != 0;
    }
  }
  if (bad != 0) {
    UNSCOPED_INFO("trans " << ta << tb << " alpha " << alpha << " beta " << beta << " rotation " << rotation);
  }
  return bad;
}

} // namespace

TEMPLATE_TEST_CASE("cuBLAS grouped_matmul_into: every group as the host's matmul_into, empty m, n and k "
                   "included",
                   "[gemm][grouped][cuda]", float, double, dtensor::bfloat16, dtensor::half) {
  require_cuda_device();
  CudaStream stream;
  std::mt19937 rng(4242);
  int bad = 0;
  for (int t = 0; t < 4; ++t) {
    for (const auto& [alpha, beta] : {std::pair{1.0, 0.0}, std::pair{2.0, -1.0}}) {
      for (int rotation = 0; rotation < 4; ++rotation) { // every group sees every layout
        bad += check_grouped<TestType>((t & 1) != 0, (t & 2) != 0, alpha, beta, rotation, stream.s, rng);
      }
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("cuBLAS grouped_matmul_into: every c on one stream", "[gemm][grouped][cuda]") {
  require_cuda_device();
  CudaStream stream;
  const auto a = Tensor<float, 2>::full({2, 3}, 1.0f, Device::cuda(0));
  const auto b = Tensor<float, 2>::full({3, 4}, 1.0f, Device::cuda(0));
  const Tensor<float, 2> c0(std::array<std::int64_t, 2>{2, 4}, Device::cuda(0), stream.s);
  const Tensor<float, 2> c1(std::array<std::int64_t, 2>{2, 4}, Device::cuda(0));
  const std::vector<Tensor<float, 2>> as{a, a}, bs{b, b}, cs{c0, c1};
  try {
    local::grouped_matmul_into<float>(as, bs, cs);
    FAIL("no error for outputs on two streams");
  } catch (const dtensor::Error& e) {
    CHECK(std::string(e.what()).find("grouped_matmul_into: group 1's c is ordered on another CUDA stream") !=
          std::string::npos);
  }
  REQUIRE(cudaStreamSynchronize(stream.s) == cudaSuccess);
}

// Local tensors on Device::cuda(0): allocation (default and explicit streams), host <-> device copies,
// strided (narrowed) copies in every direction, fills, every element type, and the 16-bit float
// conversions in device code. Every test case exits with DTENSOR_SKIP_CODE when no GPU is visible (and
// fails on a GPU that CUDA cannot use), except the last, which checks that policy on any machine.

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/core/tensor_io.hpp"
#include "dtensor/local/pointwise.hpp"

#include "../support/cuda_device.hpp"

// Thrust and cuBLAS bring CUDA's cuda_fp16.h, which declares a global ::half: name dtensor's in full here.
using Catch::Contains;
using dtensor::bfloat16;
using dtensor::Device;
using dtensor::Tensor;
using dtensor::test_support::require_cuda_device;

static_assert(DTENSOR_HAS_CUDA == 1, "this test is compiled by nvcc");

namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const dtensor::Error& e) {
    return e.what();
  }
  return "<no dtensor::Error thrown>";
}

template <class T, int Rank>
Tensor<T, Rank> iota(std::array<std::int64_t, Rank> shape) {
  Tensor<T, Rank> t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = static_cast<T>(static_cast<float>(i % 200));
  }
  return t;
}

bool is_device_pointer(const void* p) {
  cudaPointerAttributes attributes{};
  return cudaPointerGetAttributes(&attributes, p) == cudaSuccess && attributes.type == cudaMemoryTypeDevice;
}

/// Element i: in[i] to half and bfloat16 (the bits) and back to float. A kernel launched by the library's
/// launcher (local::launch), so an emulated build runs it too.
struct Convert16Bit {
  struct {
    std::int64_t count;
  } layout;
  const float* in;
  std::uint16_t* h;
  std::uint16_t* b;
  float* h_back;
  float* b_back;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const dtensor::half hv = in[i];
    const bfloat16 bv = in[i];
    h[i] = hv.bits;
    b[i] = bv.bits;
    h_back[i] = hv;
    b_back[i] = bv;
  }
};

} // namespace

TEST_CASE("device tensors: allocation and layout", "[cuda]") {
  require_cuda_device();
  auto t = Tensor<float, 2>(Tensor<float, 2>::Shape{3, 4}, Device::cuda(0));
  CHECK(t.defined());
  CHECK(t.device() == Device::cuda(0));
  CHECK(t.shape() == std::array<std::int64_t, 2>{3, 4});
  CHECK(t.strides() == std::array<std::int64_t, 2>{4, 1});
  CHECK(t.is_contiguous());
  CHECK(t.stream() == nullptr);
  CHECK(is_device_pointer(t.data()));
  CHECK(t.narrow(1, 1, 2).data() == t.data() + 1);
  CHECK_THAT(error_of([&] { (void)t(0, 0); }), Contains("needs a host tensor"));

  SECTION("zero-size tensors allocate nothing") {
    auto e = Tensor<float, 2>::zeros({0, 4}, Device::cuda());
    CHECK(e.defined());
    CHECK(e.numel() == 0);
    CHECK(e.to(Device::cpu()).numel() == 0);
    CHECK(dtensor::equal(e, Tensor<float, 2>::zeros({0, 4})));
  }
  SECTION("an explicit stream orders allocation, copies and the free") {
    cudaStream_t stream = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    {
      Tensor<int, 1> s({1000}, Device::cuda(0), stream);
      CHECK(s.stream() == stream);
      s.fill(42);
      CHECK(dtensor::equal(s, Tensor<int, 1>::full({1000}, 42)));
      auto c = s.clone(); // keeps the stream
      CHECK(c.stream() == stream);
      auto d = Tensor<int, 1>::zeros({1000}, Device::cuda()); // legacy default stream
      d.copy_from(s);
      CHECK(dtensor::equal(d, s));
    }
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  }
  SECTION("a device index that does not exist is an Error") {
    int count = 0;
    REQUIRE(cudaGetDeviceCount(&count) == cudaSuccess);
    CHECK_THAT(error_of([&] { Tensor<float, 1>(Tensor<float, 1>::Shape{4}, Device::cuda(count)); }),
               Contains("cudaSetDevice"));
    (void)cudaGetLastError();
  }
}

TEST_CASE("device tensors: host <-> device copies", "[cuda]") {
  require_cuda_device();
  auto h = iota<float, 2>({5, 7});
  auto d = h.to(Device::cuda(0));
  CHECK(d.device() == Device::cuda(0));
  CHECK(is_device_pointer(d.data()));
  auto back = d.to(Device::cpu());
  CHECK(back.device() == Device::cpu());
  CHECK(dtensor::equal(back, h));
  CHECK(dtensor::equal(d, h)); // equal() copies device tensors to the host

  auto d2 = Tensor<float, 2>::zeros({5, 7}, Device::cuda());
  d2.copy_from(h); // host -> existing device tensor
  CHECK(dtensor::equal(d2, h));
  auto d3 = d2.clone(); // device -> device
  CHECK(d3.data() != d2.data());
  CHECK(dtensor::equal(d3, h));
  auto d4 = d2.to(Device::cuda(0)); // always a copy
  CHECK(d4.data() != d2.data());
  CHECK(dtensor::equal(d4, h));
  CHECK(d.narrow(0, 2, 1).narrow(1, 3, 1).item() == h(2, 3));
  CHECK_THAT(dtensor::to_string(d.narrow(0, 0, 1).narrow(1, 0, 3)),
             Contains("Tensor(float32, [1, 3], cuda:0) [[0, 1, 2]]"));
}

TEST_CASE("device tensors: strided copies", "[cuda]") {
  require_cuda_device();
  auto h = iota<int, 2>({6, 8});
  auto d = h.to(Device::cuda());

  SECTION("device view -> host") {
    CHECK(dtensor::equal(d.narrow(1, 2, 3).to(Device::cpu()), h.narrow(1, 2, 3).contiguous()));
    CHECK(dtensor::equal(d.narrow(1, 2, 3), h.narrow(1, 2, 3)));
    auto host_view_target = Tensor<int, 2>::zeros({6, 10});
    host_view_target.narrow(1, 4, 3).copy_from(d.narrow(1, 2, 3)); // strided on both sides
    CHECK(dtensor::equal(host_view_target.narrow(1, 4, 3), h.narrow(1, 2, 3)));
    CHECK(host_view_target(0, 0) == 0);
  }
  SECTION("host view -> device view") {
    auto target = Tensor<int, 2>::full({6, 5}, -1, Device::cuda());
    target.narrow(1, 1, 3).copy_from(h.narrow(1, 4, 3));
    auto got = target.to(Device::cpu());
    for (int i = 0; i < 6; ++i) {
      for (int j = 0; j < 5; ++j) {
        CHECK(got(i, j) == (j >= 1 && j < 4 ? h(i, j + 3) : -1));
      }
    }
  }
  SECTION("device view -> device view, rank 3") {
    auto h3 = iota<double, 3>({3, 4, 5});
    auto d3 = h3.to(Device::cuda());
    auto target = Tensor<double, 3>::zeros({3, 3, 6}, Device::cuda());
    target.narrow(1, 1, 2).narrow(2, 0, 4).copy_from(d3.narrow(1, 2, 2).narrow(2, 1, 4));
    auto expected = Tensor<double, 3>::zeros({3, 3, 6});
    expected.narrow(1, 1, 2).narrow(2, 0, 4).copy_from(h3.narrow(1, 2, 2).narrow(2, 1, 4));
    CHECK(dtensor::equal(target, expected));
  }
  SECTION("transposed and broadcast device sources") {
    auto transposed = Tensor<int, 2>::from_blob(d.data(), {8, 6}, {1, 8}, Device::cuda());
    auto t = transposed.to(Device::cpu());
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 6; ++j) {
        CHECK(t(i, j) == h(j, i));
      }
    }
    auto broadcast = Tensor<int, 2>::from_blob(d.data() + 5, {3, 4}, {0, 0}, Device::cuda());
    CHECK(dtensor::equal(broadcast, Tensor<int, 2>::full({3, 4}, h(0, 5))));
  }
}

TEST_CASE("device tensors: fill", "[cuda]") {
  require_cuda_device();
  CHECK(dtensor::equal(Tensor<float, 2>::zeros({3, 3}, Device::cuda()), Tensor<float, 2>::zeros({3, 3})));
  // More elements than the host seed holds: exercises the doubling copies, with a ragged tail.
  CHECK(dtensor::equal(Tensor<double, 1>::full({5003}, 2.5, Device::cuda()),
                       Tensor<double, 1>::full({5003}, 2.5)));
  CHECK(dtensor::equal(Tensor<std::uint8_t, 1>::full({77}, 200, Device::cuda()),
                       Tensor<std::uint8_t, 1>::full({77}, 200)));
  CHECK(dtensor::equal(Tensor<dtensor::half, 1>::full({9}, 1.5f, Device::cuda()),
                       Tensor<dtensor::half, 1>::full({9}, 1.5f)));
  CHECK(dtensor::equal(Tensor<std::int32_t, 1>::full({9}, -1, Device::cuda()),
                       Tensor<std::int32_t, 1>::full({9}, -1)));

  auto d = Tensor<int, 2>::zeros({4, 5}, Device::cuda());
  d.narrow(1, 1, 3).fill(7); // non-contiguous device view
  auto expected = Tensor<int, 2>::zeros({4, 5});
  expected.narrow(1, 1, 3).fill(7);
  CHECK(dtensor::equal(d, expected));
  d.narrow(0, 3, 1).fill(0x01010101); // contiguous view, one repeated byte: cudaMemset
  expected.narrow(0, 3, 1).fill(0x01010101);
  CHECK(dtensor::equal(d, expected));
}

TEMPLATE_TEST_CASE("device tensors: every element type", "[cuda]", float, double, bfloat16, dtensor::half,
                   std::int32_t, std::int64_t, std::uint8_t) {
  require_cuda_device();
  using T = TestType;
  const auto v = [](int i) { return static_cast<T>(static_cast<float>(i)); };
  auto h = Tensor<T, 2>::from_values({2, 3}, {v(1), v(2), v(3), v(4), v(5), v(6)});
  auto d = h.to(Device::cuda());
  CHECK(dtensor::equal(d, h));
  auto z = Tensor<T, 2>::zeros({2, 3}, Device::cuda());
  z.narrow(1, 1, 2).copy_from(d.narrow(1, 0, 2));
  z.narrow(1, 0, 1).fill(v(9));
  CHECK(dtensor::equal(z, Tensor<T, 2>::from_values({2, 3}, {v(9), v(1), v(2), v(9), v(4), v(5)})));
}

TEST_CASE("16-bit float conversions agree between host and device", "[cuda]") {
  require_cuda_device();
  std::vector<float> in;
  for (std::uint32_t u = 0; u < 0xffffffffu - 65521; u += 65521) { // a sweep of float bit patterns
    float f;
    std::memcpy(&f, &u, sizeof f);
    in.push_back(f);
  }
  for (float f : {0.0f, -0.0f, 1.0f, 65504.0f, 65520.0f, 0x1p-24f, 0x1p-25f, 1.00390625f}) {
    in.push_back(f);
  }
  const int n = static_cast<int>(in.size());
  auto host_in = Tensor<float, 1>::from_blob(in.data(), {n});
  auto d_in = host_in.to(Device::cuda());
  auto h_bits = Tensor<std::int32_t, 1>::zeros({n}, Device::cuda()); // room for uint16 pairs
  auto b_bits = Tensor<std::int32_t, 1>::zeros({n}, Device::cuda());
  auto h_back = Tensor<float, 1>::zeros({n}, Device::cuda());
  auto b_back = Tensor<float, 1>::zeros({n}, Device::cuda());
  dtensor::local::launch(Convert16Bit{{n},
                                      d_in.data(),
                                      reinterpret_cast<std::uint16_t*>(h_bits.data()),
                                      reinterpret_cast<std::uint16_t*>(b_bits.data()),
                                      h_back.data(),
                                      b_back.data()},
                         Device::cuda(), nullptr, "16-bit conversions");
  auto hb = h_bits.to(Device::cpu());
  auto bb = b_bits.to(Device::cpu());
  auto hf = h_back.to(Device::cpu());
  auto bf = b_back.to(Device::cpu());
  const auto* hb16 = reinterpret_cast<const std::uint16_t*>(hb.data());
  const auto* bb16 = reinterpret_cast<const std::uint16_t*>(bb.data());
  int mismatches = 0;
  for (int i = 0; i < n; ++i) {
    const dtensor::half hv = in[i];
    const bfloat16 bv = in[i];
    const float hvf = hv;
    const float bvf = bv;
    const bool same = hb16[i] == hv.bits && bb16[i] == bv.bits &&
                      std::memcmp(&hf(i), &hvf, sizeof(float)) == 0 &&
                      std::memcmp(&bf(i), &bvf, sizeof(float)) == 0;
    if (!same && ++mismatches <= 5) {
      FAIL_CHECK("input " << in[i] << ": device half 0x" << std::hex << hb16[i] << " bfloat16 0x" << bb16[i]
                          << ", host half 0x" << hv.bits << " bfloat16 0x" << bv.bits);
    }
  }
  CHECK(mismatches == 0);
}

// Runs without a GPU too: the skip policy of every GPU test (tests/support/cuda_device.hpp).
TEST_CASE("GPU tests skip only without a device or a driver and fail on an old driver", "[cuda][skip]") {
  using dtensor::CudaDevices;
  const CudaDevices two{2, cudaSuccess, 13000};
  CHECK(!two.none());
  CHECK(!two.unusable());
  CHECK(two.reason() == "2 devices");
  CHECK(CudaDevices{0, cudaSuccess, 13000}.none());
  CHECK(CudaDevices{0, cudaErrorNoDevice, 13000}.none());
  const CudaDevices no_driver{0, cudaErrorInsufficientDriver, 0};
  CHECK(no_driver.none());
  CHECK(no_driver.reason() == "no CUDA driver is installed");
  const CudaDevices old_driver{0, cudaErrorInsufficientDriver, 12040};
  CHECK(!old_driver.none());
  CHECK(old_driver.unusable());
  CHECK_THAT(old_driver.reason(), Contains("cudaErrorInsufficientDriver") && Contains("supports CUDA 12.4"));
  CHECK(CudaDevices{0, cudaErrorSystemDriverMismatch, 13000}.unusable());
  CHECK(CudaDevices{0, cudaErrorDevicesUnavailable, 13000}.unusable());
  // This machine: a GPU, or none at all; a GPU that CUDA cannot use fails here, with the reason.
  const CudaDevices here = dtensor::probe_cuda_devices();
  INFO("this machine: " << here.reason());
  CHECK(!here.unusable());
}

// DLPack interop for CUDA tensors on Device::cuda(0): what to_dlpack describes, the round trip through
// from_dlpack, and a producer's cudaMalloc'd memory imported and released once. Every test case exits
// with DTENSOR_SKIP_CODE when no GPU is visible.

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "dtensor/core/dlpack.hpp"
#include "dtensor/core/tensor.hpp"

#include "../support/cuda_device.hpp"

using dtensor::bfloat16;
using dtensor::Device;
using dtensor::Tensor;
using dtensor::test_support::require_cuda_device;

static_assert(DTENSOR_HAS_CUDA == 1, "this test is compiled by nvcc");

namespace {

Tensor<float, 2> device_iota(std::int64_t rows, std::int64_t cols) {
  Tensor<float, 2> host({rows, cols});
  for (std::int64_t i = 0; i < host.numel(); ++i) {
    host.data()[i] = static_cast<float>(i);
  }
  return host.to(Device::cuda(0));
}

} // namespace

TEST_CASE("to_dlpack describes a CUDA tensor and holds its storage", "[dlpack][cuda]") {
  require_cuda_device();
  auto t = device_iota(4, 6);
  auto v = t.narrow(1, 2, 3);
  const long before = t.storage().use_count();
  DLManagedTensor* m = dtensor::to_dlpack(v);
  const DLTensor& d = m->dl_tensor;
  CHECK(d.device.device_type == kDLCUDA);
  CHECK(d.device.device_id == 0);
  CHECK(d.data == v.data());
  CHECK(d.byte_offset == 0);
  CHECK(d.shape[1] == 3);
  CHECK(d.strides[0] == 6);
  CHECK(d.strides[1] == 1);
  CHECK(t.storage().use_count() == before + 1);
  m->deleter(m);
  CHECK(t.storage().use_count() == before);

  Tensor<bfloat16, 1> b({4}, Device::cuda(0));
  DLManagedTensor* mb = dtensor::to_dlpack(b);
  CHECK(mb->dl_tensor.dtype.code == kDLBfloat);
  CHECK(mb->dl_tensor.dtype.bits == 16);
  mb->deleter(mb);
}

TEST_CASE("a CUDA tensor round-trips through DLPack without a copy", "[dlpack][cuda]") {
  require_cuda_device();
  auto t = device_iota(3, 4);
  auto back = dtensor::from_dlpack<float, 2>(dtensor::to_dlpack(t.narrow(0, 1, 2)));
  CHECK(back.device() == Device::cuda(0));
  CHECK(back.data() == t.data() + 4);
  auto host = back.to(Device::cpu());
  CHECK(host(0, 0) == 4.0f);
  CHECK(host(1, 3) == 11.0f);
}

TEST_CASE("from_dlpack releases a producer's device memory once", "[dlpack][cuda]") {
  require_cuda_device();
  struct Producer {
    std::array<std::int64_t, 2> shape{2, 3};
    DLManagedTensor managed{};
    int deleted = 0;
  } p;
  std::vector<float> values{0, 1, 2, 3, 4, 5};
  void* data = nullptr;
  REQUIRE(cudaMalloc(&data, sizeof(float) * 7) == cudaSuccess);
  REQUIRE(cudaMemcpy(static_cast<float*>(data) + 1, values.data(), sizeof(float) * 6,
                     cudaMemcpyHostToDevice) == cudaSuccess);
  DLTensor& d = p.managed.dl_tensor;
  d.data = data;
  d.byte_offset = sizeof(float);
  d.device = {kDLCUDA, 0};
  d.ndim = 2;
  d.dtype = {kDLFloat, 32, 1};
  d.shape = p.shape.data();
  d.strides = nullptr;
  p.managed.manager_ctx = &p;
  p.managed.deleter = [](DLManagedTensor* self) {
    cudaFree(self->dl_tensor.data);
    ++static_cast<Producer*>(self->manager_ctx)->deleted;
  };
  {
    auto t = dtensor::from_dlpack<float, 2>(&p.managed);
    auto col = t.narrow(1, 2, 1);
    t = Tensor<float, 2>();
    CHECK(p.deleted == 0);
    auto host = col.to(Device::cpu());
    CHECK(host(0, 0) == 2.0f);
    CHECK(host(1, 0) == 5.0f);
  }
  CHECK(p.deleted == 1);
}

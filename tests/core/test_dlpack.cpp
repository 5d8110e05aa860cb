// DLPack interop on the host: what to_dlpack describes (types, strides, devices), who owns what (the
// storage reference a DLManagedTensor holds, the producer's deleter called exactly once, and not at all
// when from_dlpack throws), and the errors for what dtensor cannot represent. CUDA tensors:
// test_dlpack_cuda.cu; a real consumer (PyTorch): tests/dlpack/test_dlpack.py.

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/dlpack.hpp"
#include "dtensor/core/tensor.hpp"

using Catch::Contains;
using dtensor::AnyTensor;
using dtensor::bfloat16;
using dtensor::Device;
using dtensor::DType;
using dtensor::half;
using dtensor::Tensor;

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

Tensor<float, 2> iota(std::int64_t rows, std::int64_t cols) {
  Tensor<float, 2> t({rows, cols});
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = static_cast<float>(i);
  }
  return t;
}

/// A producer's DLManagedTensor over memory it owns, counting its deleter's calls.
struct Producer {
  std::vector<float> values;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  DLManagedTensor managed{};
  int deleted = 0;

  Producer(std::vector<std::int64_t> shape_, std::vector<std::int64_t> strides_, std::size_t n)
      : values(n), shape(std::move(shape_)), strides(std::move(strides_)) {
    for (std::size_t i = 0; i < n; ++i) {
      values[i] = static_cast<float>(i);
    }
    DLTensor& t = managed.dl_tensor;
    t.data = values.data();
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<int>(shape.size());
    t.dtype = {kDLFloat, 32, 1};
    t.shape = shape.data();
    t.strides = strides.empty() ? nullptr : strides.data();
    t.byte_offset = 0;
    managed.manager_ctx = this;
    managed.deleter = [](DLManagedTensor* self) { ++static_cast<Producer*>(self->manager_ctx)->deleted; };
  }
};

template <class T>
DLDataType exported_type() {
  Tensor<T, 1> t({3});
  DLManagedTensor* m = dtensor::to_dlpack(t);
  const DLDataType type = m->dl_tensor.dtype;
  m->deleter(m);
  return type;
}

bool same(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

} // namespace

TEST_CASE("to_dlpack describes a host tensor and holds one reference to its storage", "[dlpack]") {
  auto t = iota(3, 4);
  const long before = t.storage().use_count();
  DLManagedTensor* m = dtensor::to_dlpack(t);
  const DLTensor& d = m->dl_tensor;
  CHECK(d.data == t.data());
  CHECK(d.byte_offset == 0);
  CHECK(d.device.device_type == kDLCPU);
  CHECK(d.device.device_id == 0);
  CHECK(d.ndim == 2);
  CHECK(same(d.dtype, {kDLFloat, 32, 1}));
  CHECK(d.shape[0] == 3);
  CHECK(d.shape[1] == 4);
  CHECK(d.strides[0] == 4);
  CHECK(d.strides[1] == 1);
  CHECK(t.storage().use_count() == before + 1);
  m->deleter(m);
  CHECK(t.storage().use_count() == before);
}

TEST_CASE("to_dlpack keeps the memory alive after the last dtensor handle is gone", "[dlpack]") {
  DLManagedTensor* m = nullptr;
  std::weak_ptr<void> storage;
  {
    auto t = iota(2, 3);
    storage = t.storage();
    m = dtensor::to_dlpack(t);
  }
  REQUIRE_FALSE(storage.expired());
  CHECK(static_cast<const float*>(m->dl_tensor.data)[5] == 5.0f);
  m->deleter(m);
  CHECK(storage.expired());
}

TEST_CASE("to_dlpack preserves the strides and offset of a view", "[dlpack]") {
  auto t = iota(4, 6);
  auto v = t.narrow(0, 1, 2).narrow(1, 3, 2); // (2, 2) at (1, 3), strides (6, 1)
  DLManagedTensor* m = dtensor::to_dlpack(v);
  const DLTensor& d = m->dl_tensor;
  CHECK(d.data == v.data());
  CHECK(static_cast<const float*>(d.data)[0] == 9.0f);
  CHECK(d.shape[0] == 2);
  CHECK(d.shape[1] == 2);
  CHECK(d.strides[0] == 6);
  CHECK(d.strides[1] == 1);
  m->deleter(m);
}

TEST_CASE("to_dlpack names every supported element type with its DLPack code", "[dlpack]") {
  CHECK(same(exported_type<float>(), {kDLFloat, 32, 1}));
  CHECK(same(exported_type<double>(), {kDLFloat, 64, 1}));
  CHECK(same(exported_type<half>(), {kDLFloat, 16, 1}));
  CHECK(same(exported_type<bfloat16>(), {kDLBfloat, 16, 1}));
  CHECK(same(exported_type<std::int32_t>(), {kDLInt, 32, 1}));
  CHECK(same(exported_type<std::int64_t>(), {kDLInt, 64, 1}));
  CHECK(same(exported_type<std::uint8_t>(), {kDLUInt, 8, 1}));
}

TEST_CASE("to_dlpack refuses the float8 types and undefined tensors", "[dlpack]") {
  Tensor<dtensor::float8_e4m3, 1> a({2});
  Tensor<dtensor::float8_e5m2, 1> b({2});
  CHECK_THAT(error_of([&] { dtensor::to_dlpack(a); }), Contains("float8_e4m3fn has no DLPack type code"));
  CHECK_THAT(error_of([&] { dtensor::to_dlpack(b); }), Contains("float8_e5m2 has no DLPack type code"));
  CHECK_THAT(error_of([&] { dtensor::to_dlpack(Tensor<float, 1>()); }), Contains("undefined"));
}

TEST_CASE("from_dlpack of to_dlpack shares memory in both the typed and the erased form", "[dlpack]") {
  auto t = iota(3, 4);
  std::weak_ptr<void> storage = t.storage();
  Tensor<float, 2> back = dtensor::from_dlpack<float, 2>(dtensor::to_dlpack(t.narrow(1, 1, 2)));
  CHECK(back.data() == t.data() + 1);
  CHECK(back.shape() == std::array<std::int64_t, 2>{3, 2});
  CHECK(back.strides() == std::array<std::int64_t, 2>{4, 1});
  CHECK(back(2, 1) == 10.0f);
  AnyTensor any = dtensor::from_dlpack(dtensor::to_dlpack(AnyTensor(t)));
  CHECK(any.dtype() == DType::float32);
  CHECK(any.data() == t.data());
  t = Tensor<float, 2>();
  REQUIRE_FALSE(storage.expired()); // both imports keep it
  CHECK(back(0, 0) == 1.0f);
  back = Tensor<float, 2>();
  any = AnyTensor();
  CHECK(storage.expired());
}

TEST_CASE("from_dlpack calls the producer's deleter once, when the last view goes", "[dlpack]") {
  Producer p({3, 4}, {}, 12); // null strides: row-major
  {
    Tensor<float, 2> t = dtensor::from_dlpack<float, 2>(&p.managed);
    CHECK(t.data() == p.values.data());
    CHECK(t.strides() == std::array<std::int64_t, 2>{4, 1});
    CHECK(t(1, 2) == 6.0f);
    Tensor<float, 2> col = t.narrow(1, 3, 1);
    AnyTensor erased(col);
    t = Tensor<float, 2>();
    col = Tensor<float, 2>();
    CHECK(p.deleted == 0);
    CHECK(static_cast<const float*>(erased.data())[4] == 7.0f);
  }
  CHECK(p.deleted == 1);
}

TEST_CASE("from_dlpack honours strides, byte_offset and a rank-0 tensor", "[dlpack]") {
  Producer p({2, 3}, {1, 2}, 6); // column-major (2, 3)
  p.managed.dl_tensor.byte_offset = 0;
  {
    Tensor<float, 2> t = dtensor::from_dlpack<float, 2>(&p.managed);
    CHECK(t.strides() == std::array<std::int64_t, 2>{1, 2});
    CHECK(t(1, 2) == 5.0f);
    CHECK(t(0, 1) == 2.0f);
  }
  Producer q({}, {}, 8);
  q.managed.dl_tensor.byte_offset = 3 * sizeof(float);
  {
    AnyTensor s = dtensor::from_dlpack(&q.managed);
    CHECK(s.rank() == 0);
    CHECK(s.numel() == 1);
    CHECK(*static_cast<const float*>(s.data()) == 3.0f);
  }
  CHECK(p.deleted == 1);
  CHECK(q.deleted == 1);
}

TEST_CASE("from_dlpack maps DLPack devices to dtensor devices", "[dlpack]") {
  Producer pinned({2}, {}, 2);
  pinned.managed.dl_tensor.device = {kDLCUDAHost, 0};
  CHECK(dtensor::from_dlpack(&pinned.managed).device() == Device::cpu());
  // Device memory is carried, never dereferenced, so a host buffer stands in for it here.
  Producer gpu({2}, {}, 2);
  gpu.managed.dl_tensor.device = {kDLCUDA, 1};
  CHECK(dtensor::from_dlpack<float, 1>(&gpu.managed).device() == Device::cuda(1));
  Producer managed({2}, {}, 2);
  managed.managed.dl_tensor.device = {kDLCUDAManaged, 2};
  CHECK(dtensor::from_dlpack(&managed.managed).device() == Device::cuda(2));
  CHECK(pinned.deleted + gpu.deleted + managed.deleted == 3);
}

TEST_CASE("from_dlpack errors name the problem and leave the tensor with the caller", "[dlpack]") {
  Producer p({2, 3}, {3, 1}, 6);
  DLTensor& d = p.managed.dl_tensor;
  auto import_error = [&] { return error_of([&] { dtensor::from_dlpack(&p.managed); }); };

  d.dtype = {kDLComplex, 64, 1};
  CHECK_THAT(import_error(), Contains("DLPack type kDLComplex bits 64 lanes 1 has no dtensor element type"));
  d.dtype = {kDLFloat, 32, 4};
  CHECK_THAT(import_error(), Contains("kDLFloat bits 32 lanes 4"));
  d.dtype = {kDLInt, 16, 1};
  CHECK_THAT(import_error(), Contains("kDLInt bits 16 lanes 1"));
  d.dtype = {kDLFloat, 32, 1};

  d.device = {kDLVulkan, 0};
  CHECK_THAT(import_error(), Contains("DLPack device type 7 (device 0) is not supported"));
  d.device = {kDLCPU, 0};

  p.strides = {-3, 1};
  d.strides = p.strides.data();
  CHECK_THAT(import_error(),
             Contains("stride -3 in dim 0 of shape (2, 3): dtensor tensors cannot have negative strides"));
  p.strides = {3, 1};

  p.shape[0] = -1;
  CHECK_THAT(import_error(), Contains("negative size -1 in dim 0"));
  p.shape[0] = std::int64_t{1} << 40;
  p.shape[1] = std::int64_t{1} << 20;
  CHECK_THAT(import_error(), Contains("the shape is too large"));
  p.shape[0] = 2;
  p.shape[1] = 3;

  d.ndim = 9;
  CHECK_THAT(import_error(), Contains("ndim 9 is outside [0, 8]"));
  d.ndim = 2;

  CHECK_THAT(error_of([&] { dtensor::from_dlpack<float, 3>(&p.managed); }),
             Contains("from_dlpack<float32, 3>: the DLPack tensor is float32 of rank 2, shape (2, 3)"));
  CHECK_THAT(error_of([&] { dtensor::from_dlpack<double, 2>(&p.managed); }),
             Contains("from_dlpack<float64, 2>: the DLPack tensor is float32 of rank 2"));
  CHECK_THAT(error_of([] { dtensor::from_dlpack(nullptr); }), Contains("null"));
  CHECK(p.deleted == 0); // every failure left it with the caller

  CHECK(dtensor::from_dlpack<float, 2>(&p.managed)(1, 2) == 5.0f); // still intact, and now taken
  CHECK(p.deleted == 1);
}

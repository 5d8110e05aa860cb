// The C side of test_dlpack.py: makes dtensor tensors for PyTorch to import (to_dlpack) and imports
// PyTorch's (from_dlpack), counting the storage each export holds and the deleter calls each import makes.

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "dtensor/core/dlpack.hpp"
#include "dtensor/core/tensor.hpp"

namespace {

int live_exports = 0;         // dtensor storages still held by something (a DLManagedTensor, a torch tensor)
int import_deleter_calls = 0; // producer deleters from_dlpack has called
void (*producer_deleter)(DLManagedTensor*) = nullptr;
std::string last_error;

/// A host tensor of `shape` holding 0, 1, 2, ... in row-major order, whose storage counts itself live.
template <class T, int Rank>
dtensor::Tensor<T, Rank> counted_iota(std::array<std::int64_t, Rank> shape) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) {
    n *= s;
  }
  T* data = new T[n];
  for (std::int64_t i = 0; i < n; ++i) {
    data[i] = static_cast<T>(static_cast<float>(i));
  }
  ++live_exports;
  std::shared_ptr<void> owner(data, [](void* p) {
    delete[] static_cast<T*>(p);
    --live_exports;
  });
  return dtensor::Tensor<T, Rank>::from_blob(data, shape, dtensor::detail::contiguous_strides(shape),
                                             dtensor::Device::cpu(), std::move(owner));
}

void counting_deleter(DLManagedTensor* m) {
  ++import_deleter_calls;
  producer_deleter(m);
}

} // namespace

extern "C" {

/// Kind 0: float32 (3, 4); 1: float32 (2, 3) view at (1, 2) of a (4, 6), strides (6, 1); 2: bfloat16 (2, 3);
/// 3: float16 (2, 3); 4: float64 (2, 3); 5: int32 (5); 6: int64 (5); 7: uint8 (2, 2). Values: the
/// row-major position in the whole buffer.
DLManagedTensor* dtensor_test_make(int kind) {
  switch (kind) {
  case 0:
    return dtensor::to_dlpack(counted_iota<float, 2>({3, 4}));
  case 1:
    return dtensor::to_dlpack(counted_iota<float, 2>({4, 6}).narrow(0, 1, 2).narrow(1, 2, 3));
  case 2:
    return dtensor::to_dlpack(counted_iota<dtensor::bfloat16, 2>({2, 3}));
  case 3:
    return dtensor::to_dlpack(counted_iota<dtensor::half, 2>({2, 3}));
  case 4:
    return dtensor::to_dlpack(counted_iota<double, 2>({2, 3}));
  case 5:
    return dtensor::to_dlpack(counted_iota<std::int32_t, 1>({5}));
  case 6:
    return dtensor::to_dlpack(counted_iota<std::int64_t, 1>({5}));
  case 7:
    return dtensor::to_dlpack(counted_iota<std::uint8_t, 2>({2, 2}));
  default:
    return nullptr;
  }
}

void* dtensor_test_data_ptr(const DLManagedTensor* m) {
  return m->dl_tensor.data;
}

int dtensor_test_live_exports() {
  return live_exports;
}

int dtensor_test_import_deleter_calls() {
  return import_deleter_calls;
}

const char* dtensor_test_last_error() {
  return last_error.c_str();
}

/// Imports `m` as a float32 (rows, cols) tensor, checks that it is the memory at `data` holding
/// `expected` (row-major), writes -1 into element (0, 0) and lets it go. Returns 0 when all holds, 1 for
/// other values, 2 for other memory, 3 when from_dlpack threw (last_error says why; `m` is then still
/// the caller's). The producer's deleter is wrapped to count its calls.
int dtensor_test_consume(DLManagedTensor* m, const void* data, std::int64_t rows, std::int64_t cols,
                         const float* expected) {
  const auto deleter = m->deleter;
  try {
    producer_deleter = deleter;
    m->deleter = counting_deleter;
    auto t = dtensor::from_dlpack<float, 2>(m);
    if (t.data() != data || t.shape(0) != rows || t.shape(1) != cols) {
      return 2;
    }
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        if (t(i, j) != expected[i * cols + j]) {
          return 1;
        }
      }
    }
    t(0, 0) = -1.0f;
    return 0;
  } catch (const std::exception& e) {
    m->deleter = deleter; // it stays the caller's, as it came
    last_error = e.what();
    return 3;
  }
}

} // extern "C"

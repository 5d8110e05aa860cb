#pragma once
// Random tensor contents for the local_ops tests (host and CUDA).

#include <dtensor/core/tensor.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>

namespace dtensor::test_support {

/// A host tensor of `shape` whose bytes are pseudo-random (NaN patterns included: compare as bits).
template <class T, int R>
Tensor<T, R> random_bytes(const std::array<std::int64_t, R>& shape, std::mt19937& rng) {
  Tensor<T, R> t(shape);
  auto* p = reinterpret_cast<unsigned char*>(t.data());
  for (std::size_t i = 0; i < t.nbytes(); ++i) {
    p[i] = static_cast<unsigned char>(rng());
  }
  return t;
}

} // namespace dtensor::test_support

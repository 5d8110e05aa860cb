#pragma once
// Overflow-checked int64 arithmetic for shapes, strides and byte counts: a product that does not fit is
// reported instead of wrapping (signed overflow is undefined behaviour).
//
//   std::int64_t n = 1;
//   if (!dtensor::detail::checked_mul(n, size, n)) { /* shape too large */ }

#include <cstddef>
#include <cstdint>

namespace dtensor::detail {

/// out = a * b; false (out unspecified) when the product does not fit in int64.
constexpr bool checked_mul(std::int64_t a, std::int64_t b, std::int64_t& out) noexcept {
  return !__builtin_mul_overflow(a, b, &out);
}

/// Whether a tensor of `sizes` (a range of int64, every one >= 0) with elements of `element_size` bytes
/// is representable: the product of its non-zero sizes, times the element size, fits in int64. Zero sizes
/// are skipped so that the contiguous strides of an empty tensor fit too (PyTorch's rule).
template <class Sizes>
constexpr bool representable_extent(const Sizes& sizes, std::size_t element_size) noexcept {
  std::int64_t n = static_cast<std::int64_t>(element_size);
  for (std::int64_t s : sizes) {
    if (s != 0 && !checked_mul(n, s, n)) {
      return false;
    }
  }
  return true;
}

} // namespace dtensor::detail

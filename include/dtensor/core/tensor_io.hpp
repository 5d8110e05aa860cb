#pragma once
// Comparing and printing tensors (for tests and debugging); kept apart from tensor.hpp so that
// including a tensor does not pull in <ostream>.
//
//   auto a = dtensor::Tensor<int, 2>::from_values({2, 2}, {1, 2, 3, 4});
//   dtensor::equal(a, a.clone());   // true
//   dtensor::to_string(a);          // "Tensor(int32, [2, 2], cpu) [[1, 2], [3, 4]]"
//   std::cout << a.narrow(1, 1, 1); // "Tensor(int32, [2, 1], cpu) [[2], [4]]"

#include <array>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>

#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/tensor.hpp"

namespace dtensor {

inline std::ostream& operator<<(std::ostream& os, Device d) {
  return os << d.to_string();
}
inline std::ostream& operator<<(std::ostream& os, DType d) {
  return os << dtype_name(d);
}
inline std::ostream& operator<<(std::ostream& os, bfloat16 v) {
  return os << static_cast<float>(v);
}
inline std::ostream& operator<<(std::ostream& os, half v) {
  return os << static_cast<float>(v);
}

/// True when `a` and `b` have the same shape and equal values (compared with ==, so NaN differs from
/// everything, -0 equals +0); strides and devices may differ. Device tensors are copied to the host.
template <class T, int Rank>
bool equal(const Tensor<T, Rank>& a, const Tensor<T, Rank>& b) {
  if (a.shape() != b.shape()) {
    return false;
  }
  if (a.numel() == 0) {
    return true;
  }
  const Tensor<T, Rank> ha = a.device().is_cpu() ? a : a.to(Device::cpu());
  const Tensor<T, Rank> hb = b.device().is_cpu() ? b : b.to(Device::cpu());
  bool same = true;
  detail::strided_for_each(
      ha.shape(), std::array<std::array<std::int64_t, Rank>, 2>{ha.strides(), hb.strides()},
      [&](const std::array<std::int64_t, 2>& off) { same = same && ha.data()[off[0]] == hb.data()[off[1]]; });
  return same;
}

namespace detail {

template <class T>
void print_element(std::ostream& os, T v) {
  if constexpr (std::is_same_v<T, std::uint8_t>) {
    os << static_cast<unsigned>(v); // a number, not a character
  } else {
    os << v;
  }
}

/// Nested brackets from dim `dim` on; with `summarize`, dims longer than 6 show 3 entries, "...", 3.
template <class T, std::size_t Rank>
void print_values(std::ostream& os, const T* data, const std::array<std::int64_t, Rank>& shape,
                  const std::array<std::int64_t, Rank>& strides, std::size_t dim, bool summarize) {
  if (dim == Rank) {
    print_element(os, *data);
    return;
  }
  os << '[';
  const std::int64_t n = shape[dim];
  for (std::int64_t i = 0; i < n; ++i) {
    if (i > 0) {
      os << ", ";
    }
    if (summarize && n > 6 && i == 3) {
      os << "..., ";
      i = n - 3;
    }
    print_values(os, data + i * strides[dim], shape, strides, dim + 1, summarize);
  }
  os << ']';
}

} // namespace detail

/// "Tensor(<dtype>, <shape>, <device>) <values>", values in nested brackets; tensors of more than 64
/// elements are elided like numpy/torch (3 leading and 3 trailing entries per long dim).
template <class T, int Rank>
std::string to_string(const Tensor<T, Rank>& t) {
  std::ostringstream os;
  os << "Tensor(" << dtype_name(t.dtype()) << ", ";
  if (!t.defined()) {
    os << "undefined)";
    return os.str();
  }
  os << detail::shape_to_string(t.shape()) << ", " << t.device().to_string() << ")";
  if (t.device().is_meta()) { // no values
    return os.str();
  }
  os << " ";
  const Tensor<T, Rank> h = t.device().is_cpu() ? t : t.to(Device::cpu());
  detail::print_values(os, h.data(), h.shape(), h.strides(), 0, h.numel() > 64);
  return os.str();
}

template <class T, int Rank>
std::ostream& operator<<(std::ostream& os, const Tensor<T, Rank>& t) {
  return os << to_string(t);
}

} // namespace dtensor

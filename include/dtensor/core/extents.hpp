#pragma once
// Shapes: Extents, the run-time shape or offset that AnyTensor, the layout algebra (layout/), the planner
// and the executor work on; Block, a box of a tensor; and the two spellings of a shape, a typed tensor's
// std::array<std::int64_t, R> and Extents.
//
//   std::array<std::int64_t, 2> shape{7, 5};
//   dtensor::Extents e = dtensor::detail::to_extents(shape);        // (7, 5), size 2
//   auto back = dtensor::detail::to_array<2>(e);                    // == shape
//   std::string s = dtensor::detail::shape_string(e);               // "(7, 5)"

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "dtensor/core/format.hpp"
#include "dtensor/core/static_vector.hpp"

namespace dtensor {

/// A shape or offset of a tensor with a run-time number of dims.
using Extents = StaticVector<std::int64_t, max_tensor_rank>;

/// A box of a tensor: its shape and the index of its first element. A rank's block of a global tensor
/// (layout/algebra.hpp, local_block) is one.
struct Block {
  Extents shape;
  Extents offset;
  friend constexpr bool operator==(const Block&, const Block&) = default;
};

} // namespace dtensor

namespace dtensor::detail {

/// The first R entries of `e` as an array. @pre e.size() >= R.
template <int R>
std::array<std::int64_t, R> to_array(const Extents& e) {
  std::array<std::int64_t, R> a{};
  for (int d = 0; d < R; ++d) {
    a[d] = e[d];
  }
  return a;
}

/// `a` as Extents of size R. @pre R <= max_tensor_rank.
template <std::size_t R>
Extents to_extents(const std::array<std::int64_t, R>& a) {
  Extents e;
  for (std::int64_t v : a) {
    e.push_back(v);
  }
  return e;
}

/// "(7, 5)": the same text as AnyTensor::to_string.
inline std::string shape_string(const Extents& e) {
  return format_list(e, ", ", "(", ")");
}

} // namespace dtensor::detail

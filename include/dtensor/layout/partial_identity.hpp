#pragma once
// What a rank holds under Partial when it does not hold the value itself: the identity of the pending
// reduction (sum: 0, product: 1). A Partial<sum> / Partial<product> made from a replicated value keeps
// the value on coordinate 0 of its axis and the identity everywhere else (holds_value, layout/placement.hpp),
// so that reducing over the axis gives the value back exactly.
//
//   PlacementList pl{Placement::partial(ReduceOp::sum), Placement::replicate()};
//   holds_partial_value(pl, MeshCoord{1, 0});                     // false: coordinate 1 holds the identity
//   fill_identity(block, identity_op(pl, MeshCoord{1, 0}));       // block = 0

#include <cstring>

#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"

namespace dtensor {

/// The value a Partial coordinate other than 0 holds after R -> P(op): op's identity (sum, bxor: 0; product:
/// 1), as the bytes of one element of `dtype`.
inline void partial_identity(DType dtype, ReduceOp op, unsigned char (&out)[8]) {
  std::memset(out, 0, sizeof out);
  if (op == ReduceOp::product) {
    visit_dtype(dtype, [&](auto zero) {
      const auto one = static_cast<decltype(zero)>(1.0f);
      std::memcpy(out, &one, sizeof one);
    });
  }
}

/// True when the rank at `coord` holds the value itself under `placements`, not an identity (holds_value
/// on every axis).
constexpr bool holds_partial_value(const PlacementList& placements, const MeshCoord& coord) {
  for (int a = 0; a < placements.size(); ++a) {
    if (!holds_value(placements[a], coord[a])) {
      return false;
    }
  }
  return true;
}

/// The op whose identity a rank that does not hold the value fills its block with.
constexpr ReduceOp identity_op(const PlacementList& placements, const MeshCoord& coord) {
  for (int a = 0; a < placements.size(); ++a) {
    if (!holds_value(placements[a], coord[a])) {
      return placements[a].op;
    }
  }
  return ReduceOp::sum;
}

/// `t` filled with the identity of `op`.
inline void fill_identity(const AnyTensor& t, ReduceOp op) {
  unsigned char v[8];
  partial_identity(t.dtype(), op, v);
  t.fill_bytes(v);
}

} // namespace dtensor

#pragma once
// Compile-time validation of a typed placement list against a mesh shape and a tensor rank (any `Shape`
// with a static `rank`: a MeshShape, mesh/mesh_shape.hpp).

#include "dtensor/layout/placement.hpp"

namespace dtensor {

/// Checks that `P...` is a valid placement list for a tensor of `TensorRank` dims on `Shape`: otherwise the
/// instantiation fails with one message that says what to change.
/// @post true: a failed check is its own static_assert, never a false for the caller's static_assert to
/// report a second time (so `static_assert(validate_placements<...>())` gives one error).
template <class Shape, int TensorRank, class... P>
consteval bool validate_placements() {
  static_assert((PlacementType<P> && ...),
                "placements must be Shard<D>, Replicate or Partial<ReduceOp> (one per mesh axis)");
  static_assert(TensorRank >= 0 && TensorRank <= max_tensor_rank, "tensor rank must be in [0, 8]");
  if constexpr ((PlacementType<P> && ...)) {
    constexpr PlacementError e = check_placements(placement_list_v<P...>, Shape::rank, TensorRank);
    static_assert(e != PlacementError::count_mismatch,
                  "wrong number of placements: give exactly one placement per mesh axis (use Replicate for "
                  "axes that do not split the tensor)");
    static_assert(e != PlacementError::shard_dim_out_of_range,
                  "Shard<D>: D must be in [-rank, rank) of the tensor (use Shard<-1> for the last dim)");
    static_assert(e != PlacementError::mixed_partial_ops,
                  "Partial placements with different ops on different mesh axes: only Partial<sum> and "
                  "Partial<avg> may be mixed; reduce one axis first (redistribute it to Replicate or Shard)");
  }
  return true;
}

} // namespace dtensor

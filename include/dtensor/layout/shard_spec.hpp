#pragma once
// ShardSpec: the exact description of how a tensor is laid out on a mesh.
//
// A placement list says what each mesh axis does; when several axes shard one tensor dim it does not say
// in which order they split it. ShardSpec adds that order: for every tensor dim, the mesh axes that split
// it, outermost first. A placement list's default order is left to right over the mesh axes (PyTorch's);
// plans may pass through other orders (what PyTorch calls _StridedShard) and must end in the default one.

#include <cstdint>
#include <string>

#include "dtensor/core/static_vector.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"

namespace dtensor {

/// The mesh axes splitting one tensor dim, outermost first.
using AxisOrder = StaticVector<std::int8_t, max_mesh_rank>;

struct ShardSpec {
  PlacementList placements;                       ///< one per mesh axis, Shard dims non-negative
  StaticVector<AxisOrder, max_tensor_rank> order; ///< per tensor dim

  /// The default (left-to-right) spec of a placement list for a tensor of `tensor_rank` dims.
  /// @pre check_placements(list, list.size(), tensor_rank) == PlacementError::none
  static constexpr ShardSpec from(const PlacementList& list, int tensor_rank) {
    ShardSpec s{normalize(list, tensor_rank), {}};
    for (int d = 0; d < tensor_rank; ++d) {
      s.order.push_back({});
    }
    for (int a = 0; a < s.placements.size(); ++a) {
      if (s.placements[a].is_shard()) {
        s.order[s.placements[a].dim].push_back(static_cast<std::int8_t>(a));
      }
    }
    return s;
  }

  constexpr int mesh_rank() const noexcept { return placements.size(); }
  constexpr int tensor_rank() const noexcept { return order.size(); }

  /// True when `axis` is the innermost (last) splitter of `dim`.
  constexpr bool is_innermost(int axis, int dim) const noexcept {
    return !order[dim].empty() && order[dim].back() == axis;
  }

  /// True when the order of every dim is left to right (the spec a placement list alone describes).
  constexpr bool is_default_order() const noexcept {
    for (const AxisOrder& o : order) {
      for (int i = 1; i < o.size(); ++i) {
        if (o[i - 1] > o[i]) {
          return false;
        }
      }
    }
    return true;
  }

  /// Axis `axis` stops sharding (becomes `p`, not a Shard).
  constexpr void unshard(int axis, Placement p) {
    const int d = placements[axis].dim;
    AxisOrder kept;
    for (std::int8_t a : order[d]) {
      if (a != axis) {
        kept.push_back(a);
      }
    }
    order[d] = kept;
    placements[axis] = p;
  }

  /// Axis `axis` (not a Shard) starts sharding `dim`, as its innermost splitter.
  constexpr void shard_innermost(int axis, int dim) {
    placements[axis] = Placement::shard(dim);
    order[dim].push_back(static_cast<std::int8_t>(axis));
  }

  friend constexpr bool operator==(const ShardSpec&, const ShardSpec&) = default;
};

/// The block held by the rank at `coord`: every dim is split by its axes in the spec's order.
constexpr Block spec_block(const Extents& global, const ShardSpec& spec, const MeshSizes& sizes,
                           const MeshCoord& coord) {
  Block b{global, Extents(global.size(), 0)};
  for (int d = 0; d < global.size(); ++d) {
    for (std::int8_t a : spec.order[d]) {
      const std::int64_t n = b.shape[d];
      b.offset[d] += chunk_offset(n, sizes[a], coord[a]);
      b.shape[d] = chunk_size(n, sizes[a], coord[a]);
    }
  }
  return b;
}

/// "[S(0),S(0)]" for default orders; "[S(0),S(0)]{0:1,0}" lists each dim's order when it is not.
inline std::string to_string(const ShardSpec& spec) {
  std::string s = to_string(spec.placements);
  if (spec.is_default_order()) {
    return s;
  }
  s += "{";
  bool first = true;
  for (int d = 0; d < spec.tensor_rank(); ++d) {
    if (spec.order[d].size() < 2) {
      continue;
    }
    s += (first ? "" : " ") + std::to_string(d) + ":";
    first = false;
    for (int i = 0; i < spec.order[d].size(); ++i) {
      s += (i ? "," : "") + std::to_string(spec.order[d][i]);
    }
  }
  return s + "}";
}

} // namespace dtensor

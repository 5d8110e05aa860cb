#pragma once
// Layout algebra: where each rank sits on the mesh and which block of a global tensor it holds.
//
// Plain constexpr functions over small values (CuTe's habit): with static inputs they fold at compile
// time, with dynamic ones the same code runs at run time.
//
//   rank <-> coordinate     row-major: the last mesh axis varies fastest (PyTorch, JAX, numpy)
//   axis groups             the ranks that differ from this one only along one axis, in axis order;
//                           colour/key for a communicator split (colour = the other coordinates)
//   chunks                  torch.chunk: c = ceil(n / k); chunk i has max(0, min(n, (i+1)c) - ic) items
//                           at offset min(n, ic)
//   local blocks            a placement list applied to a global shape, axes left to right: every axis
//                           that shards dim d splits the block its predecessors left on d (Extents and
//                           Block themselves are in core/extents.hpp: AnyTensor needs them too)

#include <cstdint>
#include <string>

#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/static_vector.hpp"
#include "dtensor/layout/placement.hpp"

namespace dtensor {

/// Sizes of the mesh axes, in axis order.
using MeshSizes = StaticVector<int, max_mesh_rank>;
/// A rank's coordinate on the mesh, one entry per axis.
using MeshCoord = StaticVector<int, max_mesh_rank>;

/// A set of mesh axes, as a bit mask.
using AxisMask = std::uint16_t;

constexpr AxisMask axis_bit(int a) noexcept {
  return static_cast<AxisMask>(1u << a);
}
constexpr int axis_count(AxisMask m) noexcept {
  int n = 0;
  for (; m != 0; m &= static_cast<AxisMask>(m - 1)) {
    ++n;
  }
  return n;
}
/// The lowest axis of a non-empty mask.
constexpr int first_axis(AxisMask m) noexcept {
  int a = 0;
  while (!(m & axis_bit(a))) {
    ++a;
  }
  return a;
}

/// Number of ranks in a mesh.
constexpr int mesh_numel(const MeshSizes& sizes) noexcept {
  int n = 1;
  for (int s : sizes) {
    n *= s;
  }
  return n;
}

/// @pre 0 <= rank < mesh_numel(sizes). @post coord_to_rank(result, sizes) == rank.
constexpr MeshCoord rank_to_coord(int rank, const MeshSizes& sizes) {
  MeshCoord coord(sizes.size(), 0);
  for (int a = sizes.size() - 1; a >= 0; --a) {
    coord[a] = rank % sizes[a];
    rank /= sizes[a];
  }
  return coord;
}

constexpr int coord_to_rank(const MeshCoord& coord, const MeshSizes& sizes) noexcept {
  int rank = 0;
  for (int a = 0; a < sizes.size(); ++a) {
    rank = rank * sizes[a] + coord[a];
  }
  return rank;
}

/// The rank at position `i` of the group along `axis` that contains `rank` (its key is `i`).
constexpr int axis_group_rank(int rank, int axis, int i, const MeshSizes& sizes) {
  MeshCoord coord = rank_to_coord(rank, sizes);
  coord[axis] = i;
  return coord_to_rank(coord, sizes);
}

/// All ranks of the group along `axis` that contains `rank`, ordered by their coordinate on `axis`.
template <int Capacity = 64>
constexpr StaticVector<int, Capacity> axis_group_ranks(int rank, int axis, const MeshSizes& sizes) {
  StaticVector<int, Capacity> out;
  for (int i = 0; i < sizes[axis]; ++i) {
    out.push_back(axis_group_rank(rank, axis, i, sizes));
  }
  return out;
}

/// Colour of `rank`'s group along `axis` for a communicator split: the row-major index of the other
/// coordinates. Ranks share a colour exactly when they share a group along `axis`.
constexpr int axis_color(int rank, int axis, const MeshSizes& sizes) {
  const MeshCoord coord = rank_to_coord(rank, sizes);
  int color = 0;
  for (int a = 0; a < sizes.size(); ++a) {
    if (a != axis) {
      color = color * sizes[a] + coord[a];
    }
  }
  return color;
}

/// Key of `rank` in its group along `axis` (its coordinate on that axis = its rank in the group).
constexpr int axis_key(int rank, int axis, const MeshSizes& sizes) {
  return rank_to_coord(rank, sizes)[axis];
}

/// The size of torch.chunk's full chunks: ceil(n / k) (the last chunks may be shorter or empty).
/// @pre n >= 0, k >= 1. Exact for every such n (no intermediate exceeds n).
constexpr std::int64_t full_chunk_size(std::int64_t n, int k) noexcept {
  return n / k + (n % k != 0 ? 1 : 0);
}

/// Offset of chunk `i`: i * ceil(n / k), clamped to n for empty chunks.
/// @pre n >= 0, 0 <= i < k. i * ceil(n / k) < n + k, so it fits whenever n does.
constexpr std::int64_t chunk_offset(std::int64_t n, int k, int i) noexcept {
  const std::int64_t o = full_chunk_size(n, k) * i;
  return o < n ? o : n;
}

/// Length of chunk `i` of `n` items split into `k` chunks the torch.chunk way (trailing chunks may be
/// short or empty): min(ceil(n / k), n - chunk_offset), computed without forming (i + 1) * ceil(n / k).
/// @pre n >= 0, 0 <= i < k.
constexpr std::int64_t chunk_size(std::int64_t n, int k, int i) noexcept {
  const std::int64_t c = full_chunk_size(n, k);
  const std::int64_t rest = n - chunk_offset(n, k, i);
  return c < rest ? c : rest;
}

/// The block that the rank at `coord` holds of a tensor of shape `global` placed by `placements`
/// (one per mesh axis; Shard dims may be negative) on a mesh of `sizes`. Replicate and Partial axes
/// keep the block; Shard axes split it, left to right.
/// @pre check_placements(placements, sizes.size(), global.size()) == PlacementError::none
constexpr Block local_block(const Extents& global, const PlacementList& placements, const MeshSizes& sizes,
                            const MeshCoord& coord) {
  Block b{global, Extents(global.size(), 0)};
  for (int a = 0; a < placements.size(); ++a) {
    const Placement p = normalize(placements[a], global.size());
    if (!p.is_shard()) {
      continue;
    }
    const std::int64_t n = b.shape[p.dim];
    b.offset[p.dim] += chunk_offset(n, sizes[a], coord[a]);
    b.shape[p.dim] = chunk_size(n, sizes[a], coord[a]);
  }
  return b;
}

constexpr Block local_block(const Extents& global, const PlacementList& placements, const MeshSizes& sizes,
                            int rank) {
  return local_block(global, placements, sizes, rank_to_coord(rank, sizes));
}

/// Number of elements of an extent list.
constexpr std::int64_t numel(const Extents& shape) noexcept {
  std::int64_t n = 1;
  for (std::int64_t s : shape) {
    n *= s;
  }
  return n;
}

/// "(dp=2, tp=4)" for axis names and sizes (a size < 0 prints as '?', not yet known).
template <class Names>
std::string mesh_to_string(const Names& names, const MeshSizes& sizes) {
  std::string s = "(";
  for (int a = 0; a < sizes.size(); ++a) {
    if (a > 0) {
      s += ", ";
    }
    s += std::string(names[a]) + "=" + (sizes[a] < 0 ? std::string("?") : std::to_string(sizes[a]));
  }
  return s + ")";
}

} // namespace dtensor

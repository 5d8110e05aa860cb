#pragma once
// An independent oracle of who holds what: torch.chunk written out on lists of indices, with no call into
// the library's layout code (chunk_size, chunk_offset, local_block, spec_block, group_member, intersect),
// so a bug there cannot also be in the oracle the exhaustive plan and exchange tests compare against.
//
//   owner_map(5, {0, 1}, sizes)      // for each index along a dim split by axes 0 then 1, the coordinates
//                                    // of those axes that own it
//   holds(global, spec, sizes, c)    // per dim, the sorted global indices the rank at coordinate c holds

#include <dtensor/layout/shard_spec.hpp>

#include <cstdint>
#include <vector>

namespace dtensor::test_support {

/// torch.chunk(items, k) by its definition: chunks of ceil(n / k) items taken in order, the last ones
/// shorter, missing chunks empty (k of them in all).
inline std::vector<std::vector<std::int64_t>> torch_chunk(const std::vector<std::int64_t>& items, int k) {
  const std::int64_t n = static_cast<std::int64_t>(items.size());
  std::int64_t per = n / k;
  if (per * k < n) {
    ++per;
  }
  std::vector<std::vector<std::int64_t>> out(k);
  int chunk = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (static_cast<std::int64_t>(out[chunk].size()) == per) {
      ++chunk;
    }
    out[chunk].push_back(items[i]);
  }
  return out;
}

/// For every index 0..n-1 along one dim split by `axes` (outermost first): the coordinate on each of those
/// axes of the ranks that hold it (entry j for axes[j]). Chunks the whole index list by the first axis,
/// each chunk by the next, and so on.
inline std::vector<std::vector<int>> owner_map(std::int64_t n, const std::vector<int>& axes,
                                               const MeshSizes& sizes) {
  std::vector<std::vector<int>> owner(n);
  std::vector<std::int64_t> all;
  for (std::int64_t i = 0; i < n; ++i) {
    all.push_back(i);
  }
  std::vector<std::vector<std::int64_t>> pieces{all}; // the index lists split so far
  for (int axis : axes) {
    std::vector<std::vector<std::int64_t>> next;
    for (const auto& piece : pieces) {
      const auto chunks = torch_chunk(piece, sizes[axis]);
      for (int c = 0; c < sizes[axis]; ++c) {
        for (std::int64_t i : chunks[c]) {
          owner[i].push_back(c);
        }
        next.push_back(chunks[c]);
      }
    }
    pieces = next;
  }
  return owner;
}

/// Per tensor dim, the sorted global indices held by the rank at mesh coordinate `coord` under `spec`.
inline std::vector<std::vector<std::int64_t>> holds(const Extents& global, const ShardSpec& spec,
                                                    const MeshSizes& sizes, const MeshCoord& coord) {
  std::vector<std::vector<std::int64_t>> out(global.size());
  for (int d = 0; d < global.size(); ++d) {
    std::vector<int> axes;
    for (std::int8_t a : spec.order[d]) {
      axes.push_back(a);
    }
    const auto owner = owner_map(global[d], axes, sizes);
    for (std::int64_t i = 0; i < global[d]; ++i) {
      bool mine = true;
      for (std::size_t j = 0; j < axes.size(); ++j) {
        mine = mine && owner[i][j] == coord[axes[j]];
      }
      if (mine) {
        out[d].push_back(i);
      }
    }
  }
  return out;
}

/// True when global index `idx` is in the per-dim index sets `held`.
inline bool held_at(const std::vector<std::vector<std::int64_t>>& held, const Extents& idx) {
  for (int d = 0; d < idx.size(); ++d) {
    bool in = false;
    for (std::int64_t i : held[d]) {
      in = in || i == idx[d];
    }
    if (!in) {
      return false;
    }
  }
  return true;
}

/// True when `b` (offset and shape per dim) is exactly the per-dim index sets `held`.
inline bool block_is(const Block& b, const std::vector<std::vector<std::int64_t>>& held) {
  if (b.shape.size() != static_cast<int>(held.size())) {
    return false;
  }
  for (int d = 0; d < b.shape.size(); ++d) {
    std::vector<std::int64_t> range;
    for (std::int64_t i = 0; i < b.shape[d]; ++i) {
      range.push_back(b.offset[d] + i);
    }
    if (range != held[d]) {
      return false;
    }
  }
  return true;
}

/// Every global index of `b`, row-major (none when a size is 0).
inline std::vector<Extents> indices_of(const Block& b) {
  std::vector<Extents> out;
  for (int d = 0; d < b.shape.size(); ++d) {
    if (b.shape[d] <= 0) {
      return out;
    }
  }
  Extents idx = b.offset;
  while (true) {
    out.push_back(idx);
    int d = b.shape.size() - 1;
    while (d >= 0 && ++idx[d] == b.offset[d] + b.shape[d]) {
      idx[d] = b.offset[d];
      --d;
    }
    if (d < 0) {
      return out;
    }
  }
}

/// The row-major mesh coordinate of `rank` (the last axis varies fastest), written out.
inline MeshCoord coord_of(int rank, const MeshSizes& sizes) {
  MeshCoord c(sizes.size(), 0);
  for (int a = sizes.size() - 1; a >= 0; --a) {
    c[a] = rank % sizes[a];
    rank /= sizes[a];
  }
  return c;
}

/// The coordinate of member `q` of the group over the axes in `mask` containing `me`: `me` with the group's
/// axes set to the q-th combination of their coordinates, row-major over those axes.
inline MeshCoord member_coord(const MeshCoord& me, AxisMask mask, const MeshSizes& sizes, int q) {
  MeshCoord c = me;
  for (int a = sizes.size() - 1; a >= 0; --a) {
    if (mask & (1u << a)) {
      c[a] = q % sizes[a];
      q /= sizes[a];
    }
  }
  return c;
}

} // namespace dtensor::test_support

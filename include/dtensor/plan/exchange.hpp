#pragma once
// Geometry of plan steps at run time: which piece of which block goes between which ranks, and how many
// bytes each rank receives. The executor moves exactly these pieces; the cost model counts them.
//
// Blocks of a layout tile the tensor: two ranks' blocks are identical (replicas) or disjoint. An exchange
// over a group of axes sends every rank the intersection of its target block with each distinct source
// block of its group, from exactly one holder (see exchange_pieces).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dtensor/core/layout.hpp"
#include "dtensor/plan/planner.hpp"
#include "dtensor/plan/shard_spec.hpp"

namespace dtensor {

/// The common part of two blocks (empty shape where they do not meet).
constexpr Block intersect(const Block& a, const Block& b) {
  Block r{Extents(a.shape.size(), 0), Extents(a.shape.size(), 0)};
  for (int d = 0; d < a.shape.size(); ++d) {
    const std::int64_t lo = a.offset[d] > b.offset[d] ? a.offset[d] : b.offset[d];
    const std::int64_t ea = a.offset[d] + a.shape[d];
    const std::int64_t eb = b.offset[d] + b.shape[d];
    const std::int64_t hi = ea < eb ? ea : eb;
    r.offset[d] = lo;
    r.shape[d] = hi > lo ? hi - lo : 0;
  }
  return r;
}

/// Number of ranks in the group over `axes`.
constexpr int group_size(AxisMask axes, const MeshSizes& sizes) noexcept {
  int n = 1;
  for (int a = 0; a < sizes.size(); ++a) {
    if (axes & axis_bit(a)) {
      n *= sizes[a];
    }
  }
  return n;
}

/// Rank of `coord` in its group over `axes` (row-major over those axes, in axis order).
constexpr int group_rank(const MeshCoord& coord, AxisMask axes, const MeshSizes& sizes) noexcept {
  int q = 0;
  for (int a = 0; a < sizes.size(); ++a) {
    if (axes & axis_bit(a)) {
      q = q * sizes[a] + coord[a];
    }
  }
  return q;
}

/// The coordinate of member `q` of the group over `axes` that contains `coord`.
constexpr MeshCoord group_member(MeshCoord coord, AxisMask axes, const MeshSizes& sizes, int q) noexcept {
  for (int a = sizes.size() - 1; a >= 0; --a) {
    if (axes & axis_bit(a)) {
      coord[a] = q % sizes[a];
      q /= sizes[a];
    }
  }
  return coord;
}

/// One piece an exchange moves: `block` (global coordinates) to or from group rank `peer`.
struct Piece {
  int peer;
  Block block;
};

namespace detail {

/// Finds the coordinates whose block under `spec` meets `box`: the axes in `free` vary, the others keep
/// their value in `coord`. Walks the nested torch.chunk splits of each dim, outermost first, visiting only
/// chunks that meet `box`, so the cost is proportional to the number of blocks found, not to the mesh.
template <class F>
struct MeetingBlocks {
  const Extents& global;
  const ShardSpec& spec;
  const MeshSizes& sizes;
  AxisMask free;
  const Block& box;
  MeshCoord& coord;
  F& f;

  /// Dim d, its i-th splitting axis next, the current chunk of dim d being [off, off + len).
  void visit(int d, int i, std::int64_t off, std::int64_t len) {
    if (d == global.size()) {
      f();
      return;
    }
    if (i == spec.order[d].size()) {
      if (d + 1 < global.size()) {
        visit(d + 1, 0, 0, global[d + 1]);
      } else {
        f();
      }
      return;
    }
    const int a = spec.order[d][i];
    const int k = sizes[a];
    const std::int64_t lo = box.offset[d];
    const std::int64_t hi = box.offset[d] + box.shape[d];
    auto descend = [&](int c) {
      const std::int64_t o = off + chunk_offset(len, k, c);
      const std::int64_t n = chunk_size(len, k, c);
      if (n > 0 && o < hi && lo < o + n) {
        coord[a] = c;
        visit(d, i + 1, o, n);
      }
    };
    if (!(free & axis_bit(a))) {
      descend(coord[a]);
      return;
    }
    const std::int64_t full = full_chunk_size(len, k);
    if (full == 0 || hi <= off || off + len <= lo) {
      return;
    }
    const int first = lo <= off ? 0 : static_cast<int>((lo - off) / full);
    const int last = static_cast<int>(std::min<std::int64_t>(k - 1, (hi - 1 - off) / full));
    const int saved = coord[a];
    for (int c = first; c <= last; ++c) {
      descend(c);
    }
    coord[a] = saved;
  }
};

/// Calls f() for every coordinate (written into `coord`; restored afterwards) whose block under `spec`
/// meets `box`, the axes in `free` varying and the others fixed. A free axis that splits no dim of `spec`
/// takes every value.
template <class F>
void for_each_meeting(const Extents& global, const ShardSpec& spec, const MeshSizes& sizes, AxisMask free,
                      const Block& box, MeshCoord& coord, F&& f) {
  for (int d = 0; d < global.size(); ++d) {
    if (box.shape[d] == 0) {
      return;
    }
  }
  AxisMask splitting = 0;
  for (int d = 0; d < spec.tensor_rank(); ++d) {
    for (std::int8_t a : spec.order[d]) {
      splitting |= axis_bit(a);
    }
  }
  const AxisMask loose = free & static_cast<AxisMask>(~splitting); // every value
  auto inner = [&] {
    MeetingBlocks<decltype(f)> walk{global, spec, sizes, free, box, coord, f};
    if (global.size() == 0) {
      f();
    } else {
      walk.visit(0, 0, 0, global[0]);
    }
  };
  // Loop over the loose axes (row-major), then walk the splitting ones.
  int loose_axes[max_mesh_rank];
  int count = 0;
  for (int a = 0; a < sizes.size(); ++a) {
    if (loose & axis_bit(a)) {
      loose_axes[count++] = a;
    }
  }
  const MeshCoord saved = coord;
  for (int a = 0; a < count; ++a) {
    coord[loose_axes[a]] = 0;
  }
  for (;;) {
    inner();
    int a = count - 1;
    for (; a >= 0; --a) {
      if (++coord[loose_axes[a]] < sizes[loose_axes[a]]) {
        break;
      }
      coord[loose_axes[a]] = 0;
    }
    if (a < 0) {
      break;
    }
  }
  coord = saved;
}

/// The axes of `mask` that split some dim under `spec`.
constexpr AxisMask splitting_axes(const ShardSpec& spec, AxisMask mask) {
  AxisMask m = 0;
  for (int d = 0; d < spec.tensor_rank(); ++d) {
    for (std::int8_t a : spec.order[d]) {
      m |= axis_bit(a);
    }
  }
  return m & mask;
}

} // namespace detail

/// The pieces the rank at `me` sends and receives in the exchange step `st` (all_to_all or permute),
/// ordered by peer; a piece with peer == its own group rank is a local copy.
///
/// Which copy sends a replicated block: a target receives each source block from the holder that shares
/// its coordinates on every group axis the source does not split (itself, if it holds the block), so
/// copies of a replicated source share the sending. The cost is proportional to the pieces found: the
/// source blocks meeting this rank's target block, and the target blocks meeting its source block.
inline void exchange_pieces(const Step& st, const Extents& global, const MeshSizes& sizes,
                            const MeshCoord& me, std::vector<Piece>& sends, std::vector<Piece>& recvs) {
  sends.clear();
  recvs.clear();
  const Block mine_before = spec_block(global, st.before, sizes, me);
  const Block mine_after = spec_block(global, st.after, sizes, me);
  const AxisMask sharded = detail::splitting_axes(st.before, st.axes); // group axes that split the source
  MeshCoord c = me;
  // What I receive: the source blocks meeting my target block, each from the holder that has my
  // coordinates on the group axes the source does not split.
  detail::for_each_meeting(global, st.before, sizes, sharded, mine_after, c, [&] {
    recvs.push_back(
        {group_rank(c, st.axes, sizes), intersect(spec_block(global, st.before, sizes, c), mine_after)});
  });
  // What I send: to every target whose block meets mine and that has my coordinates on the group axes
  // the source does not split (on group axes the source splits and the target does not, every value).
  detail::for_each_meeting(global, st.after, sizes, sharded, mine_before, c, [&] {
    sends.push_back(
        {group_rank(c, st.axes, sizes), intersect(mine_before, spec_block(global, st.after, sizes, c))});
  });
  auto by_peer = [](const Piece& a, const Piece& b) { return a.peer < b.peer; };
  std::sort(sends.begin(), sends.end(), by_peer);
  std::sort(recvs.begin(), recvs.end(), by_peer);
}

/// Elements the rank at `coord` receives from other ranks in step `st` (an all_reduce counts the
/// 2(n-1)/n of a ring, rounded up; a reduce_scatter the (n-1) partial copies of its output).
inline std::int64_t step_elements_received(const Step& st, const Extents& global, const MeshSizes& sizes,
                                           const MeshCoord& coord) {
  const Block before = spec_block(global, st.before, sizes, coord);
  const Block after = spec_block(global, st.after, sizes, coord);
  const std::int64_t n = group_size(st.axes, sizes);
  switch (st.kind) {
  case StepKind::local_partial:
  case StepKind::local_chunk:
    return 0;
  case StepKind::all_gather:
    return numel(after.shape) - numel(before.shape);
  case StepKind::reduce_scatter:
    return (n - 1) * numel(after.shape);
  case StepKind::all_reduce:
    return (2 * (n - 1) * numel(before.shape) + n - 1) / n;
  case StepKind::all_to_all:
  case StepKind::permute: {
    std::vector<Piece> sends;
    std::vector<Piece> recvs;
    exchange_pieces(st, global, sizes, coord, sends, recvs);
    const int me = group_rank(coord, st.axes, sizes);
    std::int64_t total = 0;
    for (const Piece& p : recvs) {
      total += p.peer == me ? 0 : numel(p.block.shape);
    }
    return total;
  }
  }
  return 0;
}

/// Bytes per rank of a plan for a tensor of `global` shape on a mesh of `sizes`: for each step the most
/// any rank receives, summed over the steps.
inline std::int64_t bytes_per_rank(const Plan& plan, const Extents& global, const MeshSizes& sizes,
                                   std::int64_t element_size) {
  std::int64_t total = 0;
  for (const Step& st : plan.steps) {
    std::int64_t most = 0;
    for (int r = 0; r < mesh_numel(sizes); ++r) {
      const std::int64_t e = step_elements_received(st, global, sizes, rank_to_coord(r, sizes));
      most = e > most ? e : most;
    }
    total += most * element_size;
  }
  return total;
}

} // namespace dtensor

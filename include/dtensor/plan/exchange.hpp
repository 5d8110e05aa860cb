#pragma once
// Geometry of plan steps at run time: which piece of which block goes between which ranks, and how many
// bytes each rank receives. The executor moves exactly these pieces; the cost model counts them.
//
// Blocks of a layout tile the tensor: two ranks' blocks are identical (replicas) or disjoint. An exchange
// over a group of axes sends every rank the intersection of its target block with each distinct source
// block of its group, from exactly one holder: itself when it holds that block, else the holder q that
// follows it most closely in group order ((q - me) mod k smallest), which spreads the sending.

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

/// The pieces the rank at `me` sends and receives in the exchange step `st` (all_to_all or permute),
/// ordered by peer; a piece with peer == its own group rank is a local copy.
inline void exchange_pieces(const Step& st, const Extents& global, const MeshSizes& sizes,
                            const MeshCoord& me, std::vector<Piece>& sends, std::vector<Piece>& recvs) {
  sends.clear();
  recvs.clear();
  const int k = group_size(st.axes, sizes);
  const int my_q = group_rank(me, st.axes, sizes);
  std::vector<Block> before(k);
  std::vector<Block> after(k);
  std::vector<MeshCoord> coords(k);
  for (int q = 0; q < k; ++q) {
    coords[q] = group_member(me, st.axes, sizes, q);
    before[q] = spec_block(global, st.before, sizes, coords[q]);
    after[q] = spec_block(global, st.after, sizes, coords[q]);
  }
  // The member that sends the source block held by `holder` to `target`: the target itself if it holds
  // it, else the holder that shares the most mesh coordinates with the target (so copies of a replicated
  // block share the sending: a target on tp = 1 receives from the copy on tp = 1), then the nearest after
  // the target in group order.
  auto source_for = [&](int target, int holder) {
    if (before[target] == before[holder]) {
      return target;
    }
    auto differing = [&](int q) {
      int d = 0;
      for (int a = 0; a < coords[q].size(); ++a) {
        d += coords[q][a] != coords[target][a];
      }
      return d;
    };
    int best = holder;
    int best_differing = differing(holder);
    int best_distance = ((holder - target) % k + k) % k;
    for (int q = 0; q < k; ++q) {
      if (!(before[q] == before[holder])) {
        continue;
      }
      const int d = differing(q);
      const int distance = ((q - target) % k + k) % k;
      if (d < best_differing || (d == best_differing && distance < best_distance)) {
        best = q;
        best_differing = d;
        best_distance = distance;
      }
    }
    return best;
  };
  for (int t = 0; t < k; ++t) { // what I send to t
    const Block piece = intersect(before[my_q], after[t]);
    if (numel(piece.shape) > 0 && source_for(t, my_q) == my_q) {
      sends.push_back({t, piece});
    }
  }
  for (int q = 0; q < k; ++q) { // what I receive from q
    const Block piece = intersect(before[q], after[my_q]);
    if (numel(piece.shape) > 0 && source_for(my_q, q) == q) {
      recvs.push_back({q, piece});
    }
  }
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

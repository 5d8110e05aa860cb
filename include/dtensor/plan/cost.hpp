#pragma once
// A plan's steps measured on the exchange geometry (layout/exchange.hpp): the pieces an exchange step
// moves, the elements each rank receives in a step, and bytes_per_rank, the cost model the planner's
// users rank plans by (ops/fewest_bytes.hpp). The geometry itself (which block piece goes where when one
// layout becomes another) needs no plan and lives in layout/; this header adds what a Step means.

#include <cstdint>
#include <vector>

#include "dtensor/core/extents.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/exchange.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/plan/step.hpp"

namespace dtensor {

/// The pieces the rank at `me` sends and receives in the exchange step `st` (all_to_all or permute),
/// ordered by peer; a piece with peer == its own group rank is a local copy (layout/exchange.hpp says
/// which copy of a replicated block sends it).
inline void exchange_pieces(const Step& st, const Extents& global, const MeshSizes& sizes,
                            const MeshCoord& me, std::vector<Piece>& sends, std::vector<Piece>& recvs) {
  exchange_pieces(st.before, st.after, st.axes, global, sizes, me, sends, recvs);
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

namespace detail {

/// The most any rank lacks of its target block in step `st` (see most_lacking on two layouts).
template <int FrontCapacity = 64>
constexpr std::int64_t most_lacking(const Step& st, const Extents& global, const MeshSizes& sizes) {
  return most_lacking<FrontCapacity>(st.before, st.after, global, sizes);
}

} // namespace detail

/// The most elements any rank receives in step `st` (the largest step_elements_received over the mesh),
/// in closed form: no rank is visited, so it runs in constant expressions.
///   local_partial, local_chunk   0
///   reduce_scatter, all_reduce   from the largest block, which coordinate 0 holds (chunk 0 is a largest
///                                chunk of every split, and chunk sizes grow with what is split)
///   all_gather, all_to_all,      the most any rank lacks of its target block: the pieces it receives
///   permute                      tile its target block, and the one it keeps is the part it holds
/// @pre `st` is a step of a plan (make_plan, make_exchange_plan): each group of an exchange holds all the
/// data its members need.
constexpr std::int64_t most_elements_received(const Step& st, const Extents& global, const MeshSizes& sizes) {
  const std::int64_t n = group_size(st.axes, sizes);
  const MeshCoord origin(sizes.size(), 0);
  switch (st.kind) {
  case StepKind::local_partial:
  case StepKind::local_chunk:
    return 0;
  case StepKind::reduce_scatter:
    return (n - 1) * numel(spec_block(global, st.after, sizes, origin).shape);
  case StepKind::all_reduce:
    return (2 * (n - 1) * numel(spec_block(global, st.before, sizes, origin).shape) + n - 1) / n;
  case StepKind::all_gather:
  case StepKind::all_to_all:
  case StepKind::permute:
    return detail::most_lacking(st.before, st.after, global, sizes);
  }
  return 0;
}

/// Bytes per rank of a plan for a tensor of `global` shape on a mesh of `sizes`: for each step the most
/// any rank receives (most_elements_received), summed over the steps. Constexpr: a compile-time policy
/// may cost plans for static meshes.
/// @pre the steps are those of a plan (see most_elements_received).
///
///   constexpr Plan p = make_plan({Placement::shard(0)}, {Placement::shard(1)}, 2);
///   static_assert(bytes_per_rank(p, {8, 6}, {2}, 4) == 4 * 4 * 3);
constexpr std::int64_t bytes_per_rank(const Plan& plan, const Extents& global, const MeshSizes& sizes,
                                      std::int64_t element_size) {
  std::int64_t total = 0;
  for (const Step& st : plan.steps) {
    total += most_elements_received(st, global, sizes) * element_size;
  }
  return total;
}

} // namespace dtensor

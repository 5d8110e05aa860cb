#pragma once
// A redistribution plan as values: its steps (which collective on which mesh axes, between which exact
// layouts) and why a plan cannot exist. The planner (plan/planner.hpp) makes plans; the cost model
// (plan/cost.hpp) and the executor (exec/execute.hpp) read them.

#include <cstdint>
#include <string_view>

#include "dtensor/core/static_vector.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/shard_spec.hpp"

namespace dtensor {

enum class StepKind : std::uint8_t {
  local_partial,
  local_chunk,
  reduce_scatter,
  all_to_all,
  permute,
  all_gather,
  all_reduce
};

constexpr std::string_view to_string(StepKind k) noexcept {
  switch (k) {
  case StepKind::local_partial:
    return "local_partial";
  case StepKind::local_chunk:
    return "local_chunk";
  case StepKind::reduce_scatter:
    return "reduce_scatter";
  case StepKind::all_to_all:
    return "all_to_all";
  case StepKind::permute:
    return "permute";
  case StepKind::all_gather:
    return "all_gather";
  case StepKind::all_reduce:
    return "all_reduce";
  }
  return "?";
}

/// One step of a plan. `before` and `after` are the exact layouts around it.
struct Step {
  StepKind kind = StepKind::local_chunk;
  AxisMask axes = 0; ///< the mesh axes it runs over (one, except flattened all_to_all and permute)
  int src_dim = -1;  ///< the dim it gathers, moves from (all_to_all) or reduces (none otherwise)
  int dst_dim = -1;  ///< the dim it scatters, chunks or moves to
  ReduceOp op = ReduceOp::sum;
  ShardSpec before;
  ShardSpec after;

  constexpr int axis() const noexcept { return first_axis(axes); }
  constexpr bool communicates() const noexcept {
    return kind != StepKind::local_partial && kind != StepKind::local_chunk;
  }
};

/// Why a redistribution cannot exist.
enum class PlanError : std::uint8_t {
  none,
  invalid_source,    ///< the source placement list fails check_placements
  invalid_target,    ///< the target placement list fails check_placements
  shard_to_partial,  ///< S -> P on some axis
  partial_op_change, ///< P(a) -> P(b), a != b
};

inline constexpr int max_plan_steps = 3 * max_mesh_rank + 2;

/// Where a plan puts its all_reduce steps (P -> R) relative to its Shard/Replicate changes.
enum class AllReduceOrder : std::uint8_t {
  by_size, ///< where the data is smaller, judged with the mesh sizes given to make_plan
  first,   ///< before them (where they grow the data)
  last     ///< after them (where they shrink it)
};

struct Plan {
  ShardSpec src;
  ShardSpec dst;
  StaticVector<Step, max_plan_steps> steps;
  PlanError error = PlanError::none;
  /// The plan has all_reduce steps and Shard/Replicate changes, so their order depends on the mesh sizes:
  /// all_reduce first exactly when all_reduce_first(sizes) (plan/planner.hpp).
  bool order_depends_on_sizes = false;
  /// Other mesh sizes may give another plan: the all_reduce order above, or make_plan ranked candidates by
  /// their cost on the nominal sizes. A DTensor on a mesh with dynamic axes then plans for the real sizes.
  bool sizes_decide = false;
  /// The layouts compared to decide that order: before the Shard/Replicate changes, and their target with
  /// the all_reduce axes still Partial.
  ShardSpec order_from;
  ShardSpec order_to;

  constexpr int size() const noexcept { return steps.size(); }
  /// Number of steps that communicate.
  constexpr int num_collectives() const noexcept {
    int n = 0;
    for (const Step& s : steps) {
      n += s.communicates() ? 1 : 0;
    }
    return n;
  }
  constexpr int count(StepKind k) const noexcept {
    int n = 0;
    for (const Step& s : steps) {
      n += s.kind == k ? 1 : 0;
    }
    return n;
  }
};

} // namespace dtensor

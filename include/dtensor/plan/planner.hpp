#pragma once
// The redistribution planner: which collective on which mesh axes, in which order.
//
// A plan turns a source ShardSpec into a target one with steps ordered shrink -> permute -> grow, so no
// step holds more data than the larger of source and target needs:
//
//   local_partial(a, op)        R -> P(op): coordinate 0 keeps the value, the others take op's identity
//                               (sum: 0, product: 1; avg, max and min keep the value). Reducing it again
//                               is exact, except avg on floats: (v + ... + v) / n rounds (docs/tensor.md)
//   local_chunk(a, d)           R -> S(d): keep this coordinate's torch.chunk piece, no communication
//   reduce_scatter(a, d, op)    P(op) -> S(d)
//   all_reduce(a, op)           P(op) -> R
//   all_to_all(a, i -> j)       S(i) -> S(j) over one axis, or over several axes flattened into one group
//   permute(axes)               any change of Shard/Replicate over several axes, as the exact exchange of
//                               the intersections of source and target blocks (point to point; a rank
//                               whose target block it already holds sends and receives nothing)
//   all_gather(a, d)            S(d) -> R
//
// A per-axis collective is used only where it is exact: the axis it moves must be the innermost splitter
// of its dim before (all_gather, all_to_all) and after (local_chunk, reduce_scatter, all_to_all) the
// step. Where per-axis steps cannot reach the target's order (several axes sharding one dim), one
// exchange over the smallest group of axes that holds all the needed data does it: an all_to_all over
// the flattened group when the axes move together from one dim to another, else a permute.
//
// Everything is constexpr over values: `make_plan` runs at compile time for the typed redistribute and
// at run time for printing and tests.

#include <cstdint>
#include <string>

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
  /// all_reduce first exactly when all_reduce_first(sizes) (see below).
  bool order_depends_on_sizes = false;
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

namespace detail {

constexpr void add_step(Plan& plan, ShardSpec& cur, StepKind kind, AxisMask axes, int src_dim, int dst_dim,
                        ReduceOp op, const ShardSpec& after) {
  plan.steps.push_back(Step{kind, axes, src_dim, dst_dim, op, cur, after});
  cur = after;
}

/// Tries to turn `cur` into `dst` (which differ only in Shard/Replicate axes and orders) with per-axis
/// steps: local_chunk (axes increasing), all_to_all (axes in `a2a_ascending` order), all_gather (axes
/// decreasing). Returns false (leaving `plan` and `cur` alone) if a step would be inexact or the result
/// is not exactly `dst`.
constexpr bool try_per_axis(Plan& plan, ShardSpec& cur, const ShardSpec& dst, bool a2a_ascending) {
  Plan trial = plan;
  ShardSpec s = cur;
  const int n = s.mesh_rank();
  for (int a = 0; a < n; ++a) { // R -> S(d): local chunk, appended innermost
    if (s.placements[a].is_replicate() && dst.placements[a].is_shard()) {
      ShardSpec next = s;
      next.shard_innermost(a, dst.placements[a].dim);
      add_step(trial, s, StepKind::local_chunk, axis_bit(a), -1, dst.placements[a].dim, ReduceOp::sum, next);
    }
  }
  for (int i = 0; i < n; ++i) { // S(i) -> S(j): all_to_all, exact when a is innermost on both sides
    const int a = a2a_ascending ? i : n - 1 - i;
    const Placement from = s.placements[a];
    const Placement to = dst.placements[a];
    if (from.is_shard() && to.is_shard() && from.dim != to.dim) {
      if (!s.is_innermost(a, from.dim)) {
        return false;
      }
      ShardSpec next = s;
      next.unshard(a, Placement::replicate());
      next.shard_innermost(a, to.dim);
      add_step(trial, s, StepKind::all_to_all, axis_bit(a), from.dim, to.dim, ReduceOp::sum, next);
    }
  }
  for (int a = n - 1; a >= 0; --a) { // S(d) -> R: all_gather, exact when a is innermost
    if (s.placements[a].is_shard() && dst.placements[a].is_replicate()) {
      const int d = s.placements[a].dim;
      if (!s.is_innermost(a, d)) {
        return false;
      }
      ShardSpec next = s;
      next.unshard(a, Placement::replicate());
      add_step(trial, s, StepKind::all_gather, axis_bit(a), d, -1, ReduceOp::sum, next);
    }
  }
  if (!(s == dst)) {
    return false;
  }
  plan = trial;
  cur = s;
  return true;
}

/// The smallest set of axes, containing every axis whose placement or position differs between `cur`
/// and `dst`, such that for every dim the splitters outside the set come before all splitters inside it
/// on both sides: then each group along the set holds all the data its members need.
constexpr AxisMask exchange_axes(const ShardSpec& cur, const ShardSpec& dst) {
  AxisMask g = 0;
  for (int a = 0; a < cur.mesh_rank(); ++a) {
    if (!(cur.placements[a] == dst.placements[a])) {
      g |= axis_bit(a);
    }
  }
  for (int d = 0; d < cur.tensor_rank(); ++d) { // axes at different positions in a dim's order
    const AxisOrder& x = cur.order[d];
    const AxisOrder& y = dst.order[d];
    for (int i = 0; i < x.size(); ++i) {
      if (i >= y.size() || x[i] != y[i]) {
        for (int k = i; k < x.size(); ++k) {
          g |= axis_bit(x[k]);
        }
        for (int k = i; k < y.size(); ++k) {
          g |= axis_bit(y[k]);
        }
        break;
      }
    }
  }
  for (bool grew = true; grew;) { // close under the order rule
    grew = false;
    for (const ShardSpec* s : {&cur, &dst}) {
      for (const AxisOrder& o : s->order) {
        bool inside_seen = false;
        for (std::int8_t a : o) {
          if (g & axis_bit(a)) {
            inside_seen = true;
          } else if (inside_seen) {
            g |= axis_bit(a);
            grew = true;
          }
        }
      }
    }
  }
  return g;
}

/// True when the axes of `g` are, in this order, the innermost splitters of `dim` and nothing else.
constexpr bool is_suffix(const AxisOrder& o, AxisMask g) {
  const int k = axis_count(g);
  if (o.size() < k) {
    return false;
  }
  int prev = -1;
  for (int i = o.size() - k; i < o.size(); ++i) {
    if (!(g & axis_bit(o[i])) || o[i] < prev) {
      return false;
    }
    prev = o[i];
  }
  return true;
}

/// One exchange from `cur` to `dst` over the axes `g`: all_to_all when every axis of g moves together
/// from dim i (innermost, left to right) to dim j (innermost, left to right), else permute.
constexpr void add_exchange(Plan& plan, ShardSpec& cur, const ShardSpec& dst, AxisMask g) {
  int i = -1;
  int j = -1;
  bool together = true;
  for (int a = 0; a < cur.mesh_rank() && together; ++a) {
    if (!(g & axis_bit(a))) {
      continue;
    }
    const Placement from = cur.placements[a];
    const Placement to = dst.placements[a];
    together =
        from.is_shard() && to.is_shard() && from.dim != to.dim && (i < 0 || (i == from.dim && j == to.dim));
    i = from.dim;
    j = to.dim;
  }
  together = together && is_suffix(cur.order[i], g) && is_suffix(dst.order[j], g);
  if (together) {
    add_step(plan, cur, StepKind::all_to_all, g, i, j, ReduceOp::sum, dst);
  } else {
    add_step(plan, cur, StepKind::permute, g, -1, -1, ReduceOp::sum, dst);
  }
}

/// Elements per rank of a spec relative to the global tensor: 1 / (product of sharding axis sizes),
/// with `nominal` sizes; used to place all_reduce where the data is smallest.
constexpr double relative_size(const ShardSpec& s, const MeshSizes& nominal) {
  double f = 1.0;
  for (int a = 0; a < s.mesh_rank(); ++a) {
    if (s.placements[a].is_shard()) {
      f /= nominal[a];
    }
  }
  return f;
}

} // namespace detail

/// Checks that src -> dst can exist (see PlanError).
constexpr PlanError check_transition(const PlacementList& src, const PlacementList& dst, int tensor_rank) {
  if (check_placements(src, src.size(), tensor_rank) != PlacementError::none) {
    return PlanError::invalid_source;
  }
  if (check_placements(dst, src.size(), tensor_rank) != PlacementError::none) {
    return PlanError::invalid_target;
  }
  for (int a = 0; a < src.size(); ++a) {
    if (src[a].is_shard() && dst[a].is_partial()) {
      return PlanError::shard_to_partial;
    }
    if (src[a].is_partial() && dst[a].is_partial() && src[a].op != dst[a].op) {
      return PlanError::partial_op_change;
    }
  }
  return PlanError::none;
}

/// True when the all_reduce steps of `plan` go first on a mesh of `sizes`: the Shard/Replicate changes
/// grow the data per rank (so reducing before them moves less).
constexpr bool all_reduce_first(const Plan& plan, const MeshSizes& sizes) {
  return detail::relative_size(plan.order_to, sizes) > detail::relative_size(plan.order_from, sizes);
}

/// The plan from `src` to `dst` for a tensor of `tensor_rank` dims. `nominal` mesh sizes (empty: 2 per
/// axis) only decide where all_reduce goes (with AllReduceOrder::by_size); the plan is exact for every
/// size.
constexpr Plan make_plan(const PlacementList& src_list, const PlacementList& dst_list, int tensor_rank,
                         MeshSizes nominal = {}, AllReduceOrder order = AllReduceOrder::by_size) {
  Plan plan;
  plan.error = check_transition(src_list, dst_list, tensor_rank);
  if (plan.error != PlanError::none) {
    return plan;
  }
  while (nominal.size() < src_list.size()) {
    nominal.push_back(2);
  }
  plan.src = ShardSpec::from(src_list, tensor_rank);
  plan.dst = ShardSpec::from(dst_list, tensor_rank);
  const ShardSpec& dst = plan.dst;
  ShardSpec cur = plan.src;
  const int n = cur.mesh_rank();

  // 1. Shrink: R -> P locally; P -> S(d) by reduce_scatter (innermost on d afterwards).
  for (int a = 0; a < n; ++a) {
    if (cur.placements[a].is_replicate() && dst.placements[a].is_partial()) {
      ShardSpec next = cur;
      next.placements[a] = dst.placements[a];
      detail::add_step(plan, cur, StepKind::local_partial, axis_bit(a), -1, -1, dst.placements[a].op, next);
    }
  }
  for (int a = 0; a < n; ++a) {
    if (cur.placements[a].is_partial() && dst.placements[a].is_shard()) {
      ShardSpec next = cur;
      next.placements[a] = Placement::replicate();
      next.shard_innermost(a, dst.placements[a].dim);
      detail::add_step(plan, cur, StepKind::reduce_scatter, axis_bit(a), -1, dst.placements[a].dim,
                       cur.placements[a].op, next);
    }
  }

  // 2. P -> R by all_reduce, before the Shard/Replicate changes when they grow the data, after otherwise.
  ShardSpec rs_target = dst; // the target of the Shard/Replicate phase: P -> R axes still partial
  for (int a = 0; a < n; ++a) {
    if (cur.placements[a].is_partial() && dst.placements[a].is_replicate()) {
      rs_target.placements[a] = cur.placements[a];
    }
  }
  auto all_reduces = [&] {
    for (int a = 0; a < n; ++a) {
      if (cur.placements[a].is_partial() && dst.placements[a].is_replicate()) {
        ShardSpec next = cur;
        next.placements[a] = Placement::replicate();
        detail::add_step(plan, cur, StepKind::all_reduce, axis_bit(a), -1, -1, cur.placements[a].op, next);
        rs_target.placements[a] = Placement::replicate();
      }
    }
  };
  bool any_all_reduce = false;
  for (int a = 0; a < n; ++a) {
    any_all_reduce = any_all_reduce || (cur.placements[a].is_partial() && dst.placements[a].is_replicate());
  }
  plan.order_from = cur;
  plan.order_to = rs_target;
  plan.order_depends_on_sizes = any_all_reduce && !(cur == rs_target);
  const bool grows =
      order == AllReduceOrder::by_size ? all_reduce_first(plan, nominal) : order == AllReduceOrder::first;
  if (grows) {
    all_reduces();
  }

  // 3. Shard/Replicate changes: per-axis collectives where exact, else one exchange.
  if (!(cur == rs_target)) {
    if (!detail::try_per_axis(plan, cur, rs_target, true) &&
        !detail::try_per_axis(plan, cur, rs_target, false)) {
      detail::add_exchange(plan, cur, rs_target, detail::exchange_axes(cur, rs_target));
    }
  }
  if (!grows) {
    all_reduces();
  }
  return plan;
}

/// The always-exact fallback for Shard/Replicate changes: one permute over every mesh axis that moves
/// exactly the intersections of source and target blocks. Tests use it to cross-check the collective
/// plans. Partial placements must be equal on both sides (they are carried, not reduced).
constexpr Plan make_exchange_plan(const PlacementList& src_list, const PlacementList& dst_list,
                                  int tensor_rank) {
  Plan plan;
  plan.error = check_transition(src_list, dst_list, tensor_rank);
  if (plan.error != PlanError::none) {
    return plan;
  }
  plan.src = ShardSpec::from(src_list, tensor_rank);
  plan.dst = ShardSpec::from(dst_list, tensor_rank);
  for (int a = 0; a < src_list.size(); ++a) {
    if ((plan.src.placements[a].is_partial() || plan.dst.placements[a].is_partial()) &&
        !(plan.src.placements[a] == plan.dst.placements[a])) {
      plan.error = PlanError::partial_op_change;
      return plan;
    }
  }
  if (!(plan.src == plan.dst)) {
    ShardSpec cur = plan.src;
    detail::add_step(plan, cur, StepKind::permute, static_cast<AxisMask>((1u << src_list.size()) - 1), -1, -1,
                     ReduceOp::sum, plan.dst);
  }
  return plan;
}

/// "dp" or "dp*tp": the axes of `m` by name.
template <class Names>
std::string axes_to_string(AxisMask m, const Names& names, int mesh_rank) {
  std::string s;
  for (int a = 0; a < mesh_rank; ++a) {
    if (m & axis_bit(a)) {
      s += (s.empty() ? "" : "*") + std::string(names[a]);
    }
  }
  return s;
}

/// "all_gather(dp, dim 0)"; `names` are the axis names of a mesh of `mesh_rank` axes.
template <class Names>
std::string to_string(const Step& st, const Names& names, int mesh_rank) {
  std::string s = std::string(to_string(st.kind)) + "(" + axes_to_string(st.axes, names, mesh_rank);
  switch (st.kind) {
  case StepKind::local_partial:
  case StepKind::all_reduce:
    s += ", " + std::string(to_string(st.op));
    break;
  case StepKind::local_chunk:
    s += ", dim " + std::to_string(st.dst_dim);
    break;
  case StepKind::reduce_scatter:
    s += ", dim " + std::to_string(st.dst_dim) + ", " + std::string(to_string(st.op));
    break;
  case StepKind::all_to_all:
    s += ", dim " + std::to_string(st.src_dim) + " -> dim " + std::to_string(st.dst_dim);
    break;
  case StepKind::all_gather:
    s += ", dim " + std::to_string(st.src_dim);
    break;
  case StepKind::permute:
    break;
  }
  return s + ")";
}

/// "[S(0),R] -> [R,S(1)]: local_chunk(tp, dim 1); all_gather(dp, dim 0)"; `names` are the axis names.
template <class Names>
std::string to_string(const Plan& plan, const Names& names) {
  std::string s = to_string(plan.src) + " -> " + to_string(plan.dst) + ":";
  if (plan.steps.empty()) {
    return s + " nothing to do";
  }
  for (int i = 0; i < plan.steps.size(); ++i) {
    s += (i ? "; " : " ") + to_string(plan.steps[i], names, plan.src.mesh_rank());
  }
  return s;
}

} // namespace dtensor

#pragma once
// The redistribution planner: which collective on which mesh axes, in which order.
//
// A plan turns a source ShardSpec into a target one with steps ordered shrink -> permute -> grow, so no
// step holds more data than the larger of source and target needs:
//
//   local_chunk(a, d)           R -> S(d): keep this coordinate's torch.chunk piece, no communication
//   reduce_scatter(a, d, op)    P(op) -> S(d)
//   all_reduce(axes, op)        P(op) -> R, over one axis or several flattened into one group
//   all_to_all(a, i -> j)       S(i) -> S(j) over one axis, or over several axes flattened into one group
//   permute(axes)               any change of Shard/Replicate over several axes, as the exact exchange of
//                               the intersections of source and target blocks (point to point; a rank
//                               whose target block it already holds sends and receives nothing)
//   all_gather(a, d)            S(d) -> R
//   local_partial(a, op)        R -> P(op), last: coordinate 0 keeps the value, the others take op's
//                               identity (sum: 0, product: 1; avg, max and min keep the value). Reducing it
//                               again is exact, except avg on floats: (v + ... + v) / n rounds
//                               (docs/tensor.md)
//
// A per-axis collective is used only where it is exact: the axis it moves must be the innermost splitter
// of its dim before (all_gather, all_to_all) and after (local_chunk, reduce_scatter, all_to_all) the
// step. Where per-axis steps cannot reach the target's order (several axes sharding one dim), one
// exchange over the smallest group of axes that holds all the needed data does it: an all_to_all over
// the flattened group when the axes move together from one dim to another, else a permute.
//
// Where Partial axes are reduced and something else changes too, make_plan ranks candidate plans (how
// each axis is reduced, what is chunked first) by bytes_per_rank and keeps the cheapest (see make_plan).
//
// An axis of size 1 (a static size, or the real one of a dynamic axis: make_plan's `nominal`) gets no step:
// over one rank a shard is the whole dim and a partial value is the value, so the plan is the one of the
// mesh without that axis ([S(0),P] -> [S(0),R] on (4, 1): nothing to do), as in torch's redistribute.
//
// Everything is constexpr over values: `make_plan` runs at compile time for the typed redistribute and
// at run time for printing and tests.

#include <cstdint>
#include <string>

#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/plan/cost.hpp"
#include "dtensor/plan/step.hpp"

namespace dtensor {

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

namespace detail {

/// How a plan reduces its Partial source axes (those whose target is not Partial), and what it does first.
struct Reduction {
  /// Per mesh axis, for the reduced axes: -1 all_reduce (the target is R), d >= 0 reduce_scatter onto dim
  /// d (innermost there). An axis whose target is R may be reduce-scattered and gathered again later.
  /// For the axes that are R: -1 nothing first, d >= 0 chunk onto dim d before the reductions, so they
  /// reduce less data (the Shard/Replicate changes then move or gather it as needed: a replicated axis
  /// shares the reduction's work between its copies; one that becomes P does so locally at the end).
  StaticVector<std::int8_t, max_mesh_rank> choice;
  bool one_exchange = false; ///< the Shard/Replicate changes as one exchange even where per-axis steps exist
  bool chunks_descending = false; ///< chunk the last axis first (innermost: the first an all_to_all moves)
};

/// The plan of one Reduction: [local_chunk]; reduce_scatter per axis; all_reduce over the all_reduce axes
/// flattened (one group per op) before or after the Shard/Replicate changes (per-axis collectives where
/// exact, else one exchange); local_partial.
constexpr Plan plan_with(Plan plan, const Reduction& r, const MeshSizes& nominal, AllReduceOrder order) {
  const ShardSpec& dst = plan.dst;
  ShardSpec cur = plan.src;
  const int n = cur.mesh_rank();
  for (int i = 0; i < n; ++i) { // R -> S(d) locally, before reducing
    const int a = r.chunks_descending ? n - 1 - i : i;
    if (cur.placements[a].is_replicate() && r.choice[a] >= 0) {
      ShardSpec next = cur;
      next.shard_innermost(a, r.choice[a]);
      add_step(plan, cur, StepKind::local_chunk, axis_bit(a), -1, r.choice[a], ReduceOp::sum, next);
    }
  }
  for (int a = 0; a < n; ++a) { // P -> S(d) by reduce_scatter
    if (cur.placements[a].is_partial() && !dst.placements[a].is_partial() && r.choice[a] >= 0) {
      ShardSpec next = cur;
      next.placements[a] = Placement::replicate();
      next.shard_innermost(a, r.choice[a]);
      add_step(plan, cur, StepKind::reduce_scatter, axis_bit(a), -1, r.choice[a], cur.placements[a].op, next);
    }
  }
  // P -> R by all_reduce, the axes of one op flattened into one group: before the Shard/Replicate changes
  // when they grow the data, after otherwise.
  // The target of the Shard/Replicate phase: the all_reduce axes still Partial, the R -> P ones still R.
  ShardSpec rs_target = dst;
  AxisMask reduced = 0;
  for (int a = 0; a < n; ++a) {
    if (cur.placements[a].is_partial() && !dst.placements[a].is_partial()) {
      rs_target.placements[a] = cur.placements[a];
      reduced |= axis_bit(a);
    } else if (dst.placements[a].is_partial() && !plan.src.placements[a].is_partial()) {
      rs_target.placements[a] = Placement::replicate();
    }
  }
  auto all_reduces = [&] {
    while (reduced != 0) {
      const ReduceOp op = cur.placements[first_axis(reduced)].op;
      AxisMask g = 0;
      ShardSpec next = cur;
      for (int a = 0; a < n; ++a) {
        if ((reduced & axis_bit(a)) && cur.placements[a].op == op) {
          g |= axis_bit(a);
          next.placements[a] = Placement::replicate();
          rs_target.placements[a] = Placement::replicate();
        }
      }
      add_step(plan, cur, StepKind::all_reduce, g, -1, -1, op, next);
      reduced &= static_cast<AxisMask>(~g);
    }
  };
  plan.order_from = cur;
  plan.order_to = rs_target;
  plan.order_depends_on_sizes = reduced != 0 && !(cur == rs_target);
  const bool grows =
      order == AllReduceOrder::by_size ? all_reduce_first(plan, nominal) : order == AllReduceOrder::first;
  if (grows) {
    all_reduces();
  }
  if (!(cur == rs_target)) {
    if (r.one_exchange ||
        (!try_per_axis(plan, cur, rs_target, true) && !try_per_axis(plan, cur, rs_target, false))) {
      add_exchange(plan, cur, rs_target, exchange_axes(cur, rs_target));
    }
  }
  all_reduces();
  for (int a = 0; a < n; ++a) { // R -> P locally, last: until then a replicated axis may share the work
    if (cur.placements[a].is_replicate() && dst.placements[a].is_partial()) {
      ShardSpec next = cur;
      next.placements[a] = dst.placements[a];
      add_step(plan, cur, StepKind::local_partial, axis_bit(a), -1, -1, dst.placements[a].op, next);
    }
  }
  return plan;
}

/// An even global shape for ranking plans: every dim splits evenly by every nominal axis size (their
/// product, per dim), or empty when the tensor would not fit in 2^40 elements (then plans are not ranked).
constexpr Extents nominal_global(const MeshSizes& nominal, int tensor_rank) {
  std::int64_t per_dim = 1;
  for (int v : nominal) {
    per_dim *= v;
  }
  double total = 1;
  Extents g;
  for (int d = 0; d < tensor_rank; ++d) {
    g.push_back(per_dim);
    total *= static_cast<double>(per_dim);
  }
  return total <= 1099511627776.0 ? g : Extents{};
}

/// make_plan of a valid transition, every axis planned as it is (make_plan handles the axes of size 1).
constexpr Plan plan_any_sizes(const PlacementList& src_list, const PlacementList& dst_list, int tensor_rank,
                              MeshSizes nominal, AllReduceOrder order) {
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
  const int n = plan.src.mesh_rank();
  // The rule's plan: reduce onto the target's dim (all_reduce where it is R), chunk with the other changes.
  // The choices of the others: reduced axes -1 (if the target is R) or any dim; R axes -1 or any dim.
  detail::Reduction rule;
  detail::Reduction lowest;
  AxisMask reduced = 0;    // Partial axes whose target is not Partial
  AxisMask replicated = 0; // R axes in the source
  for (int a = 0; a < n; ++a) {
    const Placement from = plan.src.placements[a];
    const Placement to = plan.dst.placements[a];
    reduced |= from.is_partial() && !to.is_partial() ? axis_bit(a) : 0;
    replicated |= from.is_replicate() ? axis_bit(a) : 0;
    const bool onto_target = (reduced & axis_bit(a)) && to.is_shard();
    rule.choice.push_back(static_cast<std::int8_t>(onto_target ? to.dim : -1));
    lowest.choice.push_back(static_cast<std::int8_t>(onto_target ? 0 : -1));
  }
  const AxisMask choosing = reduced | replicated;
  Plan first = detail::plan_with(plan, rule, nominal, order);
  first.sizes_decide = first.order_depends_on_sizes;
  // Nothing to choose when the rule's plan only reduces and no axis is replicated: an all_reduce costs
  // what a reduce_scatter and an all_gather cost, and reducing onto another dim adds a move.
  const bool only_reduces =
      replicated == 0 &&
      first.count(StepKind::reduce_scatter) + first.count(StepKind::all_reduce) == first.size();
  const Extents global = detail::nominal_global(nominal, tensor_rank);
  if (reduced == 0 || only_reduces || global.empty()) {
    return first;
  }
  Plan best = first;
  std::int64_t best_bytes = bytes_per_rank(first, global, nominal, 1);
  for (detail::Reduction r = lowest;;) {
    int chunked = 0;
    for (int a = 0; a < n; ++a) {
      chunked += (replicated & axis_bit(a)) && r.choice[a] >= 0 ? 1 : 0;
    }
    for (int v = 0; v < (chunked > 1 ? 4 : 2); ++v) {
      r.one_exchange = (v & 1) != 0;
      r.chunks_descending = (v & 2) != 0;
      const Plan p = detail::plan_with(plan, r, nominal, order);
      const std::int64_t b = bytes_per_rank(p, global, nominal, 1);
      if (b < best_bytes) {
        best = p;
        best_bytes = b;
      }
      // One exchange instead of per-axis steps differs only where two or more of them communicate.
      const int moves =
          p.count(StepKind::all_to_all) + p.count(StepKind::all_gather) + p.count(StepKind::permute);
      v += !r.one_exchange && moves < 2 ? 1 : 0;
    }
    int a = 0; // the next choice: an odometer over the axes that have one
    for (; a < n; ++a) {
      if (!(choosing & axis_bit(a))) {
        continue;
      }
      if (++r.choice[a] < tensor_rank) {
        break;
      }
      r.choice[a] = lowest.choice[a];
    }
    if (a == n) {
      best.sizes_decide = true; // another nominal size may rank another candidate first
      return best;
    }
  }
}

/// The placements `list` with those of the axes of size 1 in `sizes` made Replicate, but a Partial that
/// `other` (the other side of the transition) carries too: over one rank a shard is the whole dim and a
/// partial value is the value, so a transition that changes only such axes moves nothing.
constexpr PlacementList without_unit_axes(const PlacementList& list, const PlacementList& other,
                                          const MeshSizes& sizes) {
  PlacementList out = list;
  for (int a = 0; a < out.size() && a < sizes.size(); ++a) {
    if (sizes[a] == 1 && !(out[a].is_partial() && other[a] == out[a])) {
      out[a] = Placement::replicate();
    }
  }
  return out;
}

} // namespace detail

/// The plan from `src` to `dst` for a tensor of `tensor_rank` dims. `nominal` mesh sizes (empty: 2 per
/// axis) decide between plans whose cost depends on them; every plan is exact for every size.
///
/// Without Partial sources to reduce, the plan is the rule above. With them, the planner ranks the plans
/// of every Reduction (each reduced axis: all_reduce if its target is R, or reduce_scatter onto any dim;
/// each replicated axis chunked onto any dim first, or not) by bytes_per_rank on an even global shape of the
/// nominal sizes (plan/cost.hpp; its model cannot be costed here, so in closed form on values) and keeps the
/// cheapest, the rule's plan on ties. So a reduction runs on the smallest data the target allows, and an
/// all_reduce whose result is exchanged anyway becomes a reduce_scatter whose gather joins that exchange:
///
///   [R,P] -> [S(0),S(0)]     local_chunk(dp, dim 0); reduce_scatter(tp, dim 0)          (not 3x the bytes)
///   [P,P] -> [R,R]           all_reduce(dp*tp)                   (3/4 of two all_reduces' bytes, 2x2)
///   [S(0),P] -> [S(1),R]     reduce_scatter(tp, dim 0); permute(dp*tp)  (5/6 of all_to_all + all_reduce)
///
/// tests/plan/test_search.cpp compares every plan with the cheapest sequence of these steps found by
/// exhaustive search (plan/search.hpp).
constexpr Plan make_plan(const PlacementList& src_list, const PlacementList& dst_list, int tensor_rank,
                         MeshSizes nominal = {}, AllReduceOrder order = AllReduceOrder::by_size) {
  const PlanError error = check_transition(src_list, dst_list, tensor_rank);
  if (error != PlanError::none) {
    Plan plan;
    plan.error = error;
    return plan;
  }
  // Axes of size 1 (static sizes, or the real ones) are planned as Replicate: no step runs over them.
  Plan plan = detail::plan_any_sizes(detail::without_unit_axes(src_list, dst_list, nominal),
                                     detail::without_unit_axes(dst_list, src_list, nominal), tensor_rank,
                                     nominal, order);
  plan.src = ShardSpec::from(src_list, tensor_rank);
  plan.dst = ShardSpec::from(dst_list, tensor_rank);
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

#pragma once
// The cheapest plan over the planner's step kinds, by exhaustive search: the yardstick the planner's plans
// are measured against (tests/plan/test_search.cpp, bench/redistribution).
//
// make_plan builds one plan by rules (shrink, permute, grow). cheapest_plan instead searches every
// sequence of steps from the source layout to the target, through any intermediate layout (every
// placement of every axis, every order of the axes splitting a dim), and returns one of least
// bytes_per_rank (plan/cost.hpp: for each step the most any rank receives, summed over the steps). The
// steps it may take are those the executor runs, with flattened groups wherever a collective may use one:
//
//   Shard/Replicate change    any change of the non-Partial axes: one exchange, costed as most_lacking (the
//                             local_chunk, all_gather, all_to_all or permute that makes it costs that)
//   all_reduce(G)             Partial axes G (one op) -> R, G one axis or several flattened
//   reduce_scatter(G, d)      Partial axes G (one op) -> S(d), appended innermost on d in axis order
//   local_partial(a)          R -> P where the target is Partial
//
// So a redistribution's cost in this model is at least cheapest_plan's: a plan of these steps, one after
// another, cannot move fewer bytes. What it does not cover is a schedule that forwards data while it is
// still being reduced (a reduce whose result leaves its root chunk by chunk): that is not a sequence of
// collectives, and for Partial sources it can move less (see docs/plan.md, "Partial sources").
//
// Run time only (it allocates); the state space is small: for a mesh of k axes and a tensor of rank r,
// at most (r + 2)^k placement lists, each with the orders of its sharded dims.

#include <cstdint>
#include <map>
#include <queue>
#include <string>
#include <vector>

#include "dtensor/core/extents.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/plan/cost.hpp"
#include "dtensor/plan/planner.hpp"

namespace dtensor {

/// What cheapest_plan found: its bytes per rank and its steps (Shard/Replicate changes as StepKind::permute
/// over the axes that change; check_transition's error and no steps if none can exist).
struct SearchResult {
  std::int64_t bytes = 0;
  std::vector<Step> steps;
  PlanError error = PlanError::none;
};

namespace detail {

/// A key that tells layouts apart: each axis's placement, then each dim's order.
inline std::string spec_key(const ShardSpec& s) {
  std::string k;
  for (const Placement& p : s.placements) {
    k += static_cast<char>('0' + static_cast<int>(p.kind));
    k += static_cast<char>('0' + (p.is_shard() ? p.dim : p.is_partial() ? static_cast<int>(p.op) : 0));
  }
  for (const AxisOrder& o : s.order) {
    k += '|';
    for (std::int8_t a : o) {
      k += static_cast<char>('0' + a);
    }
  }
  return k;
}

/// Every layout whose Partial axes are those of `base` (same ops) and whose other axes are Replicate or
/// Shard(d), with every order of the axes that split each dim.
inline std::vector<ShardSpec> same_partials(const ShardSpec& base) {
  const int n = base.mesh_rank();
  const int rank = base.tensor_rank();
  std::vector<ShardSpec> out;
  std::vector<int> choice(static_cast<std::size_t>(n), -1); // -1: R, d >= 0: S(d); Partial axes skipped
  for (;;) {
    ShardSpec s = base;
    for (int d = 0; d < rank; ++d) {
      s.order[d] = {};
    }
    for (int a = 0; a < n; ++a) {
      if (!base.placements[a].is_partial()) {
        s.placements[a] = choice[a] < 0 ? Placement::replicate() : Placement::shard(choice[a]);
      }
    }
    // Every order: enumerate the permutations of each dim's axes (odometer over dims).
    std::vector<std::vector<std::int8_t>> axes_of(static_cast<std::size_t>(rank));
    for (int a = 0; a < n; ++a) {
      if (s.placements[a].is_shard()) {
        axes_of[s.placements[a].dim].push_back(static_cast<std::int8_t>(a));
      }
    }
    for (;;) {
      for (int d = 0; d < rank; ++d) {
        s.order[d] = {};
        for (std::int8_t a : axes_of[d]) {
          s.order[d].push_back(a);
        }
      }
      out.push_back(s);
      int d = 0;
      while (d < rank && !std::next_permutation(axes_of[d].begin(), axes_of[d].end())) {
        ++d; // this dim wrapped back to sorted: carry into the next
      }
      if (d == rank) {
        break;
      }
    }
    int a = 0;
    for (; a < n; ++a) {
      if (base.placements[a].is_partial()) {
        continue;
      }
      if (++choice[a] < rank) {
        break;
      }
      choice[a] = -1;
    }
    if (a == n) {
      return out;
    }
  }
}

} // namespace detail

/// The cheapest plan from `src_list` to `dst_list` for a tensor of `global` shape on a mesh of `sizes`,
/// in bytes per rank of `element_size`-byte elements (see the top of this file for the steps it may take).
inline SearchResult cheapest_plan(const PlacementList& src_list, const PlacementList& dst_list,
                                  const Extents& global, const MeshSizes& sizes, std::int64_t element_size) {
  SearchResult result;
  result.error = check_transition(src_list, dst_list, global.size());
  if (result.error != PlanError::none) {
    return result;
  }
  const ShardSpec src = ShardSpec::from(src_list, global.size());
  const ShardSpec dst = ShardSpec::from(dst_list, global.size());
  const int n = src.mesh_rank();

  struct Node {
    std::int64_t cost;
    int from;  ///< index of the node it was reached from (-1 for the source)
    Step step; ///< the step that reached it
    ShardSpec spec;
  };
  std::vector<Node> nodes{{0, -1, Step{}, src}};
  std::map<std::string, int> index{{detail::spec_key(src), 0}};
  std::map<std::string, std::vector<ShardSpec>> classes; // same_partials, by the Partial axes' key
  using Entry = std::pair<std::int64_t, int>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  queue.push({0, 0});
  std::vector<bool> done(1, false);

  auto relax = [&](int from, const Step& st) {
    const std::int64_t cost = nodes[from].cost + most_elements_received(st, global, sizes) * element_size;
    const std::string key = detail::spec_key(st.after);
    const auto [it, fresh] = index.try_emplace(key, static_cast<int>(nodes.size()));
    if (fresh) {
      nodes.push_back({cost, from, st, st.after});
      done.push_back(false);
    } else if (cost < nodes[it->second].cost) {
      nodes[it->second] = {cost, from, st, st.after};
    } else {
      return;
    }
    queue.push({cost, it->second});
  };

  while (!queue.empty()) {
    const auto [cost, i] = queue.top();
    queue.pop();
    if (done[i] || cost != nodes[i].cost) {
      continue;
    }
    done[i] = true;
    const ShardSpec cur = nodes[i].spec;
    if (cur == dst) {
      break;
    }
    // Shard/Replicate changes: every layout with the same Partial axes.
    std::string partial_key;
    AxisMask partial = 0;
    for (int a = 0; a < n; ++a) {
      if (cur.placements[a].is_partial()) {
        partial |= axis_bit(a);
        partial_key += static_cast<char>('0' + a);
        partial_key += static_cast<char>('0' + static_cast<int>(cur.placements[a].op));
      }
    }
    auto cls = classes.find(partial_key);
    if (cls == classes.end()) {
      cls = classes.emplace(partial_key, detail::same_partials(cur)).first;
    }
    for (const ShardSpec& next : cls->second) {
      if (!(next == cur)) {
        relax(i, Step{StepKind::permute, detail::exchange_axes(cur, next), -1, -1, ReduceOp::sum, cur, next});
      }
    }
    // Reductions over every non-empty set of Partial axes of one op: to R, or to S(d) innermost.
    for (AxisMask g = partial; g != 0; g = static_cast<AxisMask>((g - 1) & partial)) {
      const ReduceOp op = cur.placements[first_axis(g)].op;
      bool one_op = true;
      for (int a = 0; a < n; ++a) {
        one_op = one_op && (!(g & axis_bit(a)) || cur.placements[a].op == op);
      }
      if (!one_op) {
        continue;
      }
      ShardSpec reduced = cur;
      for (int a = 0; a < n; ++a) {
        if (g & axis_bit(a)) {
          reduced.placements[a] = Placement::replicate();
        }
      }
      relax(i, Step{StepKind::all_reduce, g, -1, -1, op, cur, reduced});
      for (int d = 0; d < cur.tensor_rank(); ++d) {
        ShardSpec scattered = reduced;
        for (int a = 0; a < n; ++a) {
          if (g & axis_bit(a)) {
            scattered.shard_innermost(a, d);
          }
        }
        relax(i, Step{StepKind::reduce_scatter, g, -1, d, op, cur, scattered});
      }
    }
    // R -> P where the target is Partial.
    for (int a = 0; a < n; ++a) {
      if (cur.placements[a].is_replicate() && dst.placements[a].is_partial()) {
        ShardSpec next = cur;
        next.placements[a] = dst.placements[a];
        relax(i, Step{StepKind::local_partial, axis_bit(a), -1, -1, dst.placements[a].op, cur, next});
      }
    }
  }

  const int last = index.at(detail::spec_key(dst));
  result.bytes = nodes[last].cost;
  for (int i = last; nodes[i].from >= 0; i = nodes[i].from) {
    result.steps.insert(result.steps.begin(), nodes[i].step);
  }
  return result;
}

} // namespace dtensor

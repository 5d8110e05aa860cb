#pragma once
// Opt-in: where an op's inputs match none of its rules, bring them to the placements that do with the
// fewest bytes per rank, chosen at compile time.
//
//   auto c = matmul(a, b);                 // a [S(1)], b [S(1)]: does not compile, names the redistribute
//   auto c = matmul(a, b, fewest_bytes);   // the cheapest fix: b -> [S(0)] (all_to_all), c [P]
//   constexpr FitChoice f = fewest_bytes_choice<Mesh>(op_spec::matmul(2, 2), {placements_of<A>,
//                                                      placements_of<B>}, {2, 2}, 4);
//   std::cout << to_string(f, Mesh::names);   // b [S(1)] -> [S(0)]: all_to_all(x, dim 1 -> 0); out [P]; ...
//
// The candidates are the per-axis strategies of the op's einsum rule (ops/rules.hpp), over every mesh
// axis: all Replicate; Shard on one label (each operand that has it shards its dim, the others Replicate);
// or an input's Partial kept (others Replicate, where the op is linear in it). Each combination the rule
// accepts costs the sum over operands of the planner's bytes per rank (plan/cost.hpp, closed form)
// for nominal shapes: every dim nominal_extent long (even over any mesh axis up to 16), dynamic mesh axes
// nominal_axis_size ranks. The first cheapest wins (candidates in the order above, axis by axis), so the
// choice is deterministic; when the inputs already match a rule nothing moves. The default of every op
// stays "no rule: a compile error that says what to redistribute".

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "dtensor/core/static_vector.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/plan/cost.hpp"
#include "dtensor/plan/planner.hpp"

namespace dtensor {

/// The opt-in policy of the ops that take it: `matmul(a, b, fewest_bytes)`.
struct FewestBytesTag {};
inline constexpr FewestBytesTag fewest_bytes{};

/// The length of every dim of the nominal operands the choice is costed on (2^6 * 3^2 * 5 * 7: even over
/// mesh axes of 1-10, 12, 14, 15, 16 ranks).
inline constexpr std::int64_t nominal_extent = 20160;
/// The size the choice assumes for a dynamic mesh axis.
inline constexpr int nominal_axis_size = 4;

/// What fewest_bytes chose: each operand's target placements, the output's, and the cost.
struct FitChoice {
  StaticVector<PlacementList, max_operands> from; ///< the operands' placements
  StaticVector<PlacementList, max_operands> to;   ///< what each is brought to
  StaticVector<std::int8_t, max_operands> ranks;  ///< the operands' tensor ranks
  PlacementList out;
  std::int64_t bytes = -1; ///< per rank, summed over the operands, for the nominal shapes; -1: no candidate
  MeshSizes sizes;         ///< the mesh sizes costed on

  constexpr bool found() const noexcept { return bytes >= 0; }
};

namespace detail {

/// The distinct labels of the operands, in order of first appearance.
constexpr Labels operand_labels(const OpSpec& s) {
  Labels all;
  for (const Labels& l : s.in) {
    for (char c : l) {
      if (find_label(all, c) < 0) {
        all.push_back(c);
      }
    }
  }
  return all;
}

/// The placements of the operands on one axis under strategy `option` (see the top of this file): 0 all
/// Replicate; 1 .. L Shard on label `all[option - 1]`; L + 1 the inputs' Partials kept. False where the
/// option does not exist on this axis.
constexpr bool axis_option(const OpSpec& s, const Labels& all,
                           const StaticVector<PlacementList, max_operands>& in, int axis, int option,
                           StaticVector<Placement, max_operands>& out) {
  out.clear();
  if (option == 0) {
    for (int k = 0; k < s.in.size(); ++k) {
      out.push_back(Placement::replicate());
    }
    return true;
  }
  if (option <= all.size()) {
    const char c = all[option - 1];
    for (int k = 0; k < s.in.size(); ++k) {
      const int d = find_label(s.in[k], c);
      out.push_back(d >= 0 ? Placement::shard(d) : Placement::replicate());
    }
    return true;
  }
  bool any = false;
  for (int k = 0; k < s.in.size(); ++k) {
    const Placement p = in[k][axis];
    any = any || p.is_partial();
    out.push_back(p.is_partial() ? p : Placement::replicate());
  }
  return any;
}

} // namespace detail

/// The fewest-bytes choice for an op `s` whose operands have placements `in` and tensor ranks `ranks`, on
/// a mesh of `mesh_sizes` (-1: dynamic), elements of `element_size` bytes (see the top of this file).
constexpr FitChoice fit_fewest_bytes(const OpSpec& s, const StaticVector<PlacementList, max_operands>& in,
                                     const StaticVector<std::int8_t, max_operands>& ranks,
                                     MeshSizes mesh_sizes, std::int64_t element_size) {
  FitChoice best;
  best.from = in;
  best.ranks = ranks;
  for (int& n : mesh_sizes) {
    n = n < 0 ? nominal_axis_size : n;
  }
  best.sizes = mesh_sizes;
  const RuleResult direct = apply_rule(s, in);
  if (direct.ok()) {
    best.to = in;
    best.out = direct.out;
    best.bytes = 0;
    return best;
  }
  // Each operand's cost by its target: candidates share targets (an operand sees only its own labels), and
  // a plan's cost is the expensive part.
  struct Known {
    int operand;
    PlacementList to;
    std::int64_t bytes;
  };
  StaticVector<Known, 3 * 64> known;
  auto cost = [&](int k, const PlacementList& to) -> std::int64_t {
    for (const Known& e : known) {
      if (e.operand == k && e.to == to) {
        return e.bytes;
      }
    }
    const Plan p = make_plan(in[k], to, ranks[k], mesh_sizes);
    const std::int64_t b = p.error != PlanError::none ? -1
                                                      : bytes_per_rank(p, Extents(ranks[k], nominal_extent),
                                                                       mesh_sizes, element_size);
    if (known.size() < known.capacity()) {
      known.push_back({k, to, b});
    }
    return b;
  };
  const int axes = mesh_sizes.size();
  const Labels labels = detail::operand_labels(s);
  const int options = labels.size() + 2;
  StaticVector<int, max_mesh_rank> pick(axes, 0);
  for (;;) {
    StaticVector<PlacementList, max_operands> cand(in.size(), PlacementList{});
    bool exists = true;
    for (int a = 0; a < axes && exists; ++a) {
      StaticVector<Placement, max_operands> per;
      exists = detail::axis_option(s, labels, in, a, pick[a], per);
      for (int k = 0; k < in.size() && exists; ++k) {
        cand[k].push_back(per[k]);
      }
    }
    const RuleResult r = exists ? apply_rule(s, cand) : RuleResult{};
    if (exists && r.ok()) {
      std::int64_t bytes = 0;
      for (int k = 0; k < in.size() && bytes >= 0; ++k) {
        const std::int64_t b = cost(k, cand[k]);
        bytes = b < 0 ? -1 : bytes + b;
      }
      if (bytes >= 0 && (best.bytes < 0 || bytes < best.bytes)) {
        best.to = cand;
        best.out = r.out;
        best.bytes = bytes;
      }
    }
    int a = axes - 1;
    for (; a >= 0; --a) {
      if (++pick[a] < options) {
        break;
      }
      pick[a] = 0;
    }
    if (a < 0) {
      break;
    }
  }
  return best;
}

/// fit_fewest_bytes for operands on a mesh of type Mesh (a MeshShape).
template <class Mesh>
constexpr FitChoice fewest_bytes_choice(const OpSpec& s, const StaticVector<PlacementList, max_operands>& in,
                                        const StaticVector<std::int8_t, max_operands>& ranks,
                                        std::int64_t element_size = 4) {
  return fit_fewest_bytes(s, in, ranks, Mesh::sizes(), element_size);
}

/// "operand 1 [S(1)] -> [S(0)]: all_to_all(x, dim 1 -> 0); out [P]; 812 MB per rank (nominal 20160^2
/// operands)".
template <class Names>
std::string to_string(const FitChoice& c, const Names& names) {
  if (!c.found()) {
    return "no placements of the inputs match a rule";
  }
  std::string s;
  for (int k = 0; k < c.from.size(); ++k) {
    if (!(c.from[k] == c.to[k])) {
      s += "operand " + std::to_string(k) + " " +
           to_string(make_plan(c.from[k], c.to[k], c.ranks[k], c.sizes), names) + "; ";
    }
  }
  if (s.empty()) {
    s = "the inputs match a rule; ";
  }
  return s + "out " + to_string(c.out) + "; " + std::to_string(c.bytes) +
         " bytes per rank for operands with every dim " + std::to_string(nominal_extent) + " long";
}

namespace detail {

/// The choice for operands X... of an op whose OpSpec Spec::spec() gives.
template <class Spec, class... X>
struct Fit {
  using First = std::tuple_element_t<0, std::tuple<X...>>;
  static constexpr FitChoice choice = fewest_bytes_choice<typename dtensor_traits<First>::shape_type>(
      Spec::spec(), {X::placements...}, {static_cast<std::int8_t>(X::rank)...},
      static_cast<std::int64_t>(sizeof(typename First::value_type)));
  static_assert(choice.found(), "fewest_bytes: no placements of the inputs match any rule of this op");
  /// Operand K's target; Replicate on every axis where there is none (a stand-in after the static_assert).
  template <int K>
  struct To {
    static constexpr PlacementList list() {
      return choice.found() ? choice.to[K]
                            : PlacementList(dtensor_traits<First>::shape_type::rank, Placement::replicate());
    }
  };
  template <int K, class Xk>
  using target_t = dtensor_from_t<typename Xk::value_type, Xk::rank, typename dtensor_traits<Xk>::shape_type,
                                  &To<K>::list>;
};

/// The operands brought to the placements Fit chose (a tuple of DTensors).
template <class Spec, class... X, std::size_t... K>
auto fit_inputs(std::index_sequence<K...>, const X&... xs) {
  using F = Fit<Spec, X...>;
  return std::tuple<typename F::template target_t<static_cast<int>(K), X>...>(
      redistribute_as<typename F::template target_t<static_cast<int>(K), X>, X>::run(xs)...);
}

template <class Spec, class... X>
auto fit_inputs(const X&... xs) {
  return fit_inputs<Spec>(std::index_sequence_for<X...>{}, xs...);
}

} // namespace detail

} // namespace dtensor

#pragma once
// The backward of a redistribution, planned like the forward: constexpr code over placement values.
//
//   y = x.redistribute<Dst...>()          x has placements Src, y has Dst
//   dx = dy.redistribute<dual(Src)...>()  dy has any (linear) placements G; then the Partial<avg> factors
//
// A gradient is a DTensor of its own whose placements describe it: the gradient of x holds, on each rank,
// the derivative of the loss by what that rank holds of x. Hence the dual of a placement:
//
//   Shard<d>       -> Shard<d>     a shard's gradient is the same shard of the gradient
//   Partial<sum>   -> Replicate    every partial contributes with coefficient 1: each gets all of it
//   Partial<avg>   -> Replicate    each partial contributes with 1/n: Replicate scaled by 1/n
//   Replicate      -> Replicate, or Partial<sum> where the consumer ran a different computation on each
//                     coordinate (each then holds its own contribution; their sum is the gradient)
//   Partial<max/min/product> -> none: not linear, no backward (a compile error says so)
//
// and the forward/backward table falls out of make_plan: all_reduce (P -> R) has the identity as its
// backward (R -> R), all_gather (S -> R) a reduce_scatter (P -> S) or a local chunk (R -> S), and so on.
// The factors: a Partial<avg> axis of Src divides the gradient by the axis size; one that appears in Dst
// only (R -> P(avg), which keeps the value on every coordinate: n copies, each counted 1/n) multiplies it.
//
// The pairing that makes this the adjoint (tests/backward/test_backward.cpp checks it over every plan):
// <x, g> = sum over global elements of sum_full(x) * value(g), where sum_full reduces x's Partial axes by
// sum whatever their op and value(g) is the gradient's global tensor. Then <A x, dy> = <x, A^T dy>.

#include <cstdint>
#include <string>

#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/plan/planner.hpp"

namespace dtensor {

/// Whether a placement has a linear backward (every one but Partial<max/min/product>).
constexpr bool is_linear(Placement p) noexcept {
  return !p.is_partial() || p.op == ReduceOp::sum || p.op == ReduceOp::avg;
}

/// The gradient placement of a primal one (see the top of this file); Replicate for a non-linear one,
/// which backward_error reports.
constexpr Placement dual(Placement p) noexcept {
  return p.is_partial() ? Placement::replicate() : p;
}

constexpr PlacementList dual(PlacementList list) noexcept {
  for (Placement& p : list) {
    p = dual(p);
  }
  return list;
}

/// Why a backward cannot exist.
enum class BackwardError : std::uint8_t {
  none,
  forward,             ///< the forward redistribution itself cannot exist (see Plan::error)
  nonlinear_primal,    ///< Src or Dst has Partial<max/min/product>
  nonlinear_gradient,  ///< the gradient has Partial<max/min/product>
  gradient_placements, ///< the requested gradient placements do not describe the gradient of Src
  invalid_gradient,    ///< the gradient placement list fails check_placements
  gradient_transition, ///< the gradient placements cannot become the requested ones (Shard -> Partial)
};

/// "Partial<max> has no linear backward ...": the sentence for an error, empty for none.
constexpr std::string_view to_string(BackwardError e) noexcept {
  switch (e) {
  case BackwardError::none:
    return "";
  case BackwardError::forward:
    return "the forward redistribution cannot exist";
  case BackwardError::nonlinear_primal:
    return "Partial<max/min/product> has no linear backward (the gradient would depend on which rank held "
           "the extreme value or on the other factors): reduce it to Replicate before the differentiable "
           "part";
  case BackwardError::nonlinear_gradient:
    return "a gradient cannot be Partial<max/min/product>: gradients add up, use Partial<sum>";
  case BackwardError::gradient_placements:
    return "the gradient placements do not fit the primal's: a Shard<d> axis needs Shard<d>, a Partial axis "
           "Replicate, a Replicate axis Replicate or Partial<sum>";
  case BackwardError::invalid_gradient:
    return "the gradient placement list is not valid for this mesh and tensor rank";
  case BackwardError::gradient_transition:
    return "a Shard gradient cannot become Partial<sum> (no such redistribution): ask for Replicate there";
  }
  return "?";
}

/// Whether `out` may be the gradient placements of a primal with placements `src`: the dual, except that a
/// Replicate axis may also keep the gradient Partial<sum> (each coordinate's contribution, summed later).
constexpr bool fits_gradient(const PlacementList& src, const PlacementList& out, int tensor_rank) noexcept {
  if (src.size() != out.size()) {
    return false;
  }
  for (int a = 0; a < src.size(); ++a) {
    const Placement s = normalize(src[a], tensor_rank);
    const Placement o = normalize(out[a], tensor_rank);
    const bool ok = o == dual(s) || (s.is_replicate() && o == Placement::partial(ReduceOp::sum));
    if (!ok) {
      return false;
    }
  }
  return true;
}

/// The backward of `src -> dst` for a gradient with placements `grad`, returned with placements `out`.
struct BackwardPlan {
  Plan plan;             ///< grad -> out
  AxisMask divide = 0;   ///< axes whose size divides the gradient (Partial<avg> in src)
  AxisMask multiply = 0; ///< axes whose size multiplies it (Partial<avg> in dst only)
  BackwardError error = BackwardError::none;

  /// The factor the gradient is scaled by on a mesh of `sizes` (1 when neither mask is set).
  constexpr double scale(const MeshSizes& sizes) const noexcept {
    double f = 1;
    for (int a = 0; a < sizes.size(); ++a) {
      if (divide & axis_bit(a)) {
        f /= sizes[a];
      }
      if (multiply & axis_bit(a)) {
        f *= sizes[a];
      }
    }
    return f;
  }
  constexpr bool scales() const noexcept { return (divide | multiply) != 0; }
};

/// The backward of the redistribution src -> dst (a rank-`tensor_rank` tensor) taking a gradient with
/// placements `grad` to placements `out` (fits_gradient(src, out)); `nominal` and `order` as for make_plan.
constexpr BackwardPlan make_backward_plan(const PlacementList& src, const PlacementList& dst,
                                          const PlacementList& grad, const PlacementList& out,
                                          int tensor_rank, MeshSizes nominal = {},
                                          AllReduceOrder order = AllReduceOrder::by_size) {
  BackwardPlan b;
  if (check_transition(src, dst, tensor_rank) != PlanError::none) {
    b.error = BackwardError::forward;
    return b;
  }
  for (int a = 0; a < src.size(); ++a) {
    if (!is_linear(src[a]) || !is_linear(dst[a])) {
      b.error = BackwardError::nonlinear_primal;
      return b;
    }
  }
  if (check_placements(grad, src.size(), tensor_rank) != PlacementError::none) {
    b.error = BackwardError::invalid_gradient;
    return b;
  }
  for (const Placement& g : grad) {
    if (!is_linear(g)) {
      b.error = BackwardError::nonlinear_gradient;
      return b;
    }
  }
  if (!fits_gradient(src, out, tensor_rank)) {
    b.error = BackwardError::gradient_placements;
    return b;
  }
  for (int a = 0; a < src.size(); ++a) {
    const bool src_avg = src[a] == Placement::partial(ReduceOp::avg);
    const bool dst_avg = dst[a] == Placement::partial(ReduceOp::avg);
    if (src_avg && !dst_avg) {
      b.divide |= axis_bit(a);
    } else if (dst_avg && !src_avg) {
      b.multiply |= axis_bit(a);
    }
  }
  b.plan = make_plan(grad, out, tensor_rank, nominal, order);
  if (b.plan.error != PlanError::none) {
    b.error = BackwardError::gradient_transition;
  }
  return b;
}

/// The backward with the default gradient placements dual(src).
constexpr BackwardPlan make_backward_plan(const PlacementList& src, const PlacementList& dst,
                                          const PlacementList& grad, int tensor_rank, MeshSizes nominal = {},
                                          AllReduceOrder order = AllReduceOrder::by_size) {
  return make_backward_plan(src, dst, grad, dual(src), tensor_rank, nominal, order);
}

/// "[P(sum)] -> [S(0)]: reduce_scatter(x, dim 0, sum)", then the factors by axis name
/// ("; scale by 1/size(tp)").
template <class Names>
std::string to_string(const BackwardPlan& b, const Names& names) {
  std::string s = to_string(b.plan, names);
  const int n = b.plan.src.mesh_rank();
  if (b.divide != 0) {
    s += "; scale by 1/size(" + axes_to_string(b.divide, names, n) + ")";
  }
  if (b.multiply != 0) {
    s += "; scale by size(" + axes_to_string(b.multiply, names, n) + ")";
  }
  return s;
}

} // namespace dtensor

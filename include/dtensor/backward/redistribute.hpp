#pragma once
// The backward of redistribute, without an autograd engine: an op returns its output and a typed context
// that keeps what its backward needs (here the mesh and the global shape), and the backward is a call.
//
//   auto [y, back] = redistribute_with_backward<Replicate>(x);   // x [S(0)] -> y [R]: all_gather
//   DTensor<float, 2, Mesh, Partial<>> dy = ...;       // y's gradient, from a rank-specific consumer
//   DTensor<float, 2, Mesh, Shard<0>> dx = back(dy);   // reduce_scatter: the plan of dy -> dual(Src)
//
// The gradient's placements are part of its type: back(dy) returns dual(Src) (backward/duality.hpp: Shard<d>
// stays, Partial<sum/avg> and Replicate become Replicate), back.to<Out...>(dy) other gradient placements of
// Src (Partial<sum> on its Replicate axes, to defer that reduction). The plan is fixed at compile time
// (backward_plan_of prints it); Partial<avg> axes add one local scaling. A Partial<max/min/product> on
// either side has no linear backward and does not compile.

#include <array>
#include <cstdint>
#include <string>
#include <utility>

#include "dtensor/backward/duality.hpp"
#include "dtensor/backward/with_backward.hpp"
#include "dtensor/comm/work.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/plan/planner.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {

/// Whether `a` may share memory with `b` (the same storage, or, for from_blob tensors, overlapping
/// element ranges): the backward then scales a copy, never the caller's gradient.
template <class T, int R1, int R2>
bool may_alias(const Tensor<T, R1>& a, const Tensor<T, R2>& b) {
  if (a.numel() == 0 || b.numel() == 0) {
    return false;
  }
  if (a.storage() && b.storage()) {
    return a.storage() == b.storage();
  }
  return a.data() < b.data() + b.numel() && b.data() < a.data() + a.numel();
}

template <class P>
struct dual_placement {
  using type = P;
};
template <ReduceOp Op>
struct dual_placement<Partial<Op>> {
  static_assert(Op == ReduceOp::sum || Op == ReduceOp::avg,
                "backward: Partial<max/min/product> has no linear backward (the gradient would depend on "
                "which rank held the extreme value, or on the other factors); redistribute it to Replicate "
                "before the part you differentiate");
  using type = Replicate;
};

template <class P>
consteval bool linear_gradient_placement() {
  static_assert(
      is_linear(P::value),
      "backward: a gradient cannot be Partial<max/min/product>: gradients add up, use Partial<sum>");
  return true;
}

} // namespace detail

/// The gradient placement of a primal placement type: Shard<d> -> Shard<d>, Partial<sum/avg> ->
/// Replicate, Replicate -> Replicate.
template <PlacementType P>
using dual_t = typename detail::dual_placement<P>::type;

/// The backward plan of Src -> Dst (Placements<...>) for a gradient with placements G, to the gradient
/// placements Out (default: the duals of Src), on meshes of shape `Shape`; printable like plan_of.
template <class Shape, int Rank, class Src, class Dst, class G, class Out = void>
constexpr auto backward_plan_of();

/// A backward plan with its mesh's axis names, for printing and costing (see MeshPlan).
template <class Shape>
struct MeshBackwardPlan {
  BackwardPlan backward;

  /// "[P(sum)] -> [S(0)]: reduce_scatter(x, dim 0, sum)", with any Partial<avg> factor after it.
  std::string to_string() const { return dtensor::to_string(backward, Shape::names); }
  constexpr std::int64_t bytes_per_rank(const Extents& global, const MeshSizes& sizes,
                                        std::int64_t element_size = 4) const {
    return dtensor::bytes_per_rank(backward.plan, global, sizes, element_size);
  }
};

template <class Shape, int Rank, class Src, class Dst, class G, class Out>
constexpr auto backward_plan_of() {
  constexpr PlacementList out = [] {
    if constexpr (std::is_void_v<Out>) {
      return dual(Src::value);
    } else {
      return Out::value;
    }
  }();
  constexpr BackwardPlan b = make_backward_plan(Src::value, Dst::value, G::value, out, Rank);
  static_assert(b.error != BackwardError::forward, "backward_plan_of: the forward Src -> Dst cannot exist");
  static_assert(b.error != BackwardError::nonlinear_primal,
                "backward_plan_of: Partial<max/min/product> has no linear backward");
  static_assert(b.error != BackwardError::nonlinear_gradient,
                "backward_plan_of: a gradient cannot be Partial<max/min/product>");
  static_assert(
      b.error != BackwardError::gradient_placements,
      "backward_plan_of: Out must be the gradient placements of Src: Shard<d> for Shard<d>, Replicate "
      "for Partial, Replicate or Partial<sum> for Replicate");
  static_assert(
      b.error != BackwardError::gradient_transition,
      "backward_plan_of: a Shard gradient cannot become Partial<sum> (no such redistribution): ask for "
      "Replicate there");
  static_assert(b.error != BackwardError::invalid_gradient, "backward_plan_of: invalid gradient placements");
  return MeshBackwardPlan<Shape>{b};
}

template <class T, int Rank, class Shape, class... P>
class PendingBackward;

/// The backward context of `y = x.redistribute<D...>()` where x has placements S...: call it with y's
/// gradient (any linear placements) to get x's.
template <class T, int Rank, class Shape, class Src, class Dst>
class RedistributeBackward;

template <class T, int Rank, class Shape, class... S, class... D>
class RedistributeBackward<T, Rank, Shape, Placements<S...>, Placements<D...>> {
  static_assert((is_linear(D::value) && ...),
                "backward: Partial<max/min/product> has no linear backward; redistribute it to Replicate "
                "before the part you differentiate");
  static constexpr BackwardPlan scaling =
      make_backward_plan(placement_list_v<S...>, placement_list_v<D...>, dual(placement_list_v<S...>),
                         dual(placement_list_v<S...>), Rank);
  static_assert(!scaling.scales() || std::is_floating_point_v<T> || detail::is_reduced_float_v<T>,
                "backward: a Partial<avg> axis scales the gradient, which needs a floating element type");

public:
  /// The gradient of x with its default placements.
  using grad_type = DTensor<T, Rank, Shape, dual_t<S>...>;

  RedistributeBackward(DeviceMesh<Shape> mesh, std::array<std::int64_t, Rank> global)
      : mesh_(std::move(mesh)), global_(global) {}

  /// x's gradient (placements dual(S)...) from y's gradient `grad` (placements G...).
  template <class U, int R2, class Shape2, class... G>
  grad_type operator()(const DTensor<U, R2, Shape2, G...>& grad) const {
    return to<dual_t<S>...>(grad);
  }

  /// x's gradient with placements Out... (Shard<d> for Shard<d>, Replicate for Partial, Replicate or
  /// Partial<sum> for Replicate).
  template <class... Out, class U, int R2, class Shape2, class... G>
  DTensor<T, Rank, Shape, Out...> to(const DTensor<U, R2, Shape2, G...>& grad) const {
    static_assert(same_tensor_type<U, R2, Shape2>,
                  "backward: the gradient must have the forward's element type, rank and mesh shape");
    if constexpr (!same_tensor_type<U, R2, Shape2>) {
      throw Error("unreachable"); // the static_assert above failed: nothing more to compile
    } else if constexpr (!gradient_fits<Placements<Out...>, G...>()) {
      throw Error("unreachable"); // gradient_fits said why: nothing more to compile
    } else {
      check(grad);
      auto dx = grad.template redistribute<Out...>();
      if constexpr (scaling.scales()) {
        if (detail::may_alias(dx.local(), grad.local())) {
          dx = DTensor<T, Rank, Shape, Out...>(dx.mesh(), dx.local().clone(), dx.global_shape());
        }
        local::scale(dx.local(), factor(dx.mesh()));
      }
      return dx;
    }
  }

  /// Asynchronous: the first communicating step is in flight when this returns; wait() gives x's gradient.
  template <class... G>
  PendingBackward<T, Rank, Shape, dual_t<S>...> operator()(const DTensor<T, Rank, Shape, G...>& grad,
                                                           AsyncOp) const {
    if constexpr (!gradient_fits<Placements<dual_t<S>...>, G...>()) {
      throw Error("unreachable"); // gradient_fits said why: nothing more to compile
    } else {
      check(grad);
      return PendingBackward<T, Rank, Shape, dual_t<S>...>(grad.template redistribute<dual_t<S>...>(async_op),
                                                           factor(grad.mesh()), grad.local());
    }
  }

  /// The plan the gradient G... takes (printable, with bytes per rank).
  template <class... G>
  static constexpr MeshBackwardPlan<Shape> plan_for() {
    return backward_plan_of<Shape, Rank, Placements<S...>, Placements<D...>, Placements<G...>>();
  }

  const std::array<std::int64_t, Rank>& global_shape() const noexcept { return global_; }

private:
  template <class U, int R2, class Shape2>
  static constexpr bool same_tensor_type = (std::is_same_v<U, T> && R2 == Rank &&
                                            std::is_same_v<Shape2, Shape>);

  /// Whether a gradient with placements G... becomes x's gradient with placements OutList; where not, one
  /// static_assert (here, in backward_plan_of, or the forward's in x.redistribute<D...>()) says why, and the
  /// caller compiles nothing more.
  template <class OutList, class... G>
  static consteval bool gradient_fits() {
    if constexpr (detail::plan_v<Shape, Rank, Placements<S...>, Placements<D...>>.error != PlanError::none) {
      return false;
    } else {
      static_assert((detail::linear_gradient_placement<G>() && ...));
      if constexpr ((is_linear(G::value) && ...)) {
        return backward_plan_of<Shape, Rank, Placements<S...>, Placements<D...>, Placements<G...>, OutList>()
                   .backward.error == BackwardError::none;
      } else {
        return false;
      }
    }
  }

  /// The run-time checks of a gradient: x's global shape, the forward's mesh.
  template <class... G>
  void check(const DTensor<T, Rank, Shape, G...>& grad) const {
    if (grad.global_shape() != global_) {
      throw Error("backward of redistribute " + dtensor::to_string(placement_list_v<S...>) + " -> " +
                  dtensor::to_string(placement_list_v<D...>) + " on mesh rank " +
                  std::to_string(grad.mesh().rank()) + ": the gradient's global shape " +
                  detail::shape_string(detail::to_extents(grad.global_shape())) + " is not the forward's " +
                  detail::shape_string(detail::to_extents(global_)));
    }
    if (grad.mesh().sizes() != mesh_.sizes() || grad.mesh().coordinate() != mesh_.coordinate()) {
      throw Error("backward of redistribute " + dtensor::to_string(placement_list_v<S...>) + " -> " +
                  dtensor::to_string(placement_list_v<D...>) + " on mesh rank " +
                  std::to_string(mesh_.rank()) + ": the gradient lives on a different mesh " +
                  mesh_to_string(Shape::names, grad.mesh().sizes()) + " than the forward's " +
                  mesh_to_string(Shape::names, mesh_.sizes()));
    }
  }

  static double factor(const DeviceMeshBase& mesh) { return scaling.scale(mesh.sizes()); }

  DeviceMesh<Shape> mesh_;
  std::array<std::int64_t, Rank> global_;
};

/// An asynchronous backward in flight: wait() finishes the redistribution and applies any Partial<avg>
/// factor.
template <class T, int Rank, class Shape, class... P>
class PendingBackward {
public:
  PendingBackward(PendingRedistribute<T, Rank, Shape, P...> pending, double factor, Tensor<T, Rank> grad)
      : pending_(std::move(pending)), factor_(factor), grad_(std::move(grad)) {}

  bool is_completed() const { return pending_.is_completed(); }

  DTensor<T, Rank, Shape, P...> wait() {
    auto dx = pending_.wait();
    if constexpr (std::is_floating_point_v<T> || detail::is_reduced_float_v<T>) {
      if (factor_ != 1.0) {
        if (detail::may_alias(dx.local(), grad_)) {
          dx = DTensor<T, Rank, Shape, P...>(dx.mesh(), dx.local().clone(), dx.global_shape());
        }
        local::scale(dx.local(), factor_);
      }
    }
    grad_ = {};
    return dx;
  }

private:
  PendingRedistribute<T, Rank, Shape, P...> pending_;
  double factor_;
  Tensor<T, Rank> grad_; ///< the gradient's local tensor, which the result must not scale in place
};

/// y = x.redistribute<Q...>() and the context of its backward.
template <class... Q, class T, int Rank, class Shape, class... P>
WithBackward<DTensor<T, Rank, Shape, Q...>,
             RedistributeBackward<T, Rank, Shape, Placements<P...>, Placements<Q...>>>
redistribute_with_backward(const DTensor<T, Rank, Shape, P...>& x) {
  // A Partial<max/min/product> in P... or Q... fails once, in the return type (RedistributeBackward).
  return {x.template redistribute<Q...>(), {x.mesh(), x.global_shape()}};
}

namespace detail {

/// redistribute_with_backward to the placements of the DTensor type D.
template <class D>
struct with_backward_to;
template <class T, int R, class Shape, class... Q>
struct with_backward_to<DTensor<T, R, Shape, Q...>> {
  template <class X>
  static auto run(const X& x) {
    return redistribute_with_backward<Q...>(x);
  }
};

} // namespace detail

} // namespace dtensor

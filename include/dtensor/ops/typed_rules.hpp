#pragma once
// The typed side of the sharding rules: a rule's placement values become a DTensor type, its errors
// become static_asserts, and one helper runs a local function on the operands' blocks of the output's block.
// The ops (ops/pointwise.hpp, ops/reduce.hpp, ...) are thin on top of it.
//
// Inputs a rule rejects give one compile error, the rule's message, and it comes first: an op names its
// output type through rule_result_t, which reports the rule's error before any DTensor type is formed and
// then stands in a well-formed type (Replicate on every mesh axis), so nothing after it adds an error about
// a malformed placement list. Every check_* of the library follows the same contract: it returns true,
// and a failed check is its own static_assert with the message, never a false for the caller's
// static_assert to report a second time.

#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "dtensor/backward/duality.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {
template <Placement::Kind K, int D, ReduceOp Op>
struct placement_of {
  using type = Replicate;
};
template <int D, ReduceOp Op>
struct placement_of<Placement::Kind::shard, D, Op> {
  using type = Shard<D>;
};
template <int D, ReduceOp Op>
struct placement_of<Placement::Kind::partial, D, Op> {
  using type = Partial<Op>;
};
} // namespace detail

/// The placement type of the placement value List()[I]: Shard<d>, Replicate or Partial<op>. (The value's
/// fields are template arguments one by one: g++ 12 cannot take the Placement itself as one.)
template <auto List, int I>
using placement_at_t = typename detail::placement_of<List()[I].kind, List()[I].dim, List()[I].op>::type;

namespace detail {

template <class T, int Rank, class Shape, auto List, class Seq>
struct dtensor_from;
template <class T, int Rank, class Shape, auto List, std::size_t... I>
struct dtensor_from<T, Rank, Shape, List, std::index_sequence<I...>> {
  using type = DTensor<T, Rank, Shape, placement_at_t<List, static_cast<int>(I)>...>;
};

/// The placements of a DTensor type, and its element type, rank and mesh shape.
template <class D>
struct dtensor_traits;
template <class T, int Rank, class Shape, class... P>
struct dtensor_traits<DTensor<T, Rank, Shape, P...>> {
  using value_type = T;
  using shape_type = Shape;
  static constexpr int rank = Rank;
  static constexpr PlacementList placements = normalize(placement_list_v<P...>, Rank);
};

} // namespace detail

/// DTensor<T, Rank, Shape, ...> with the placements List() returns (List: a constexpr callable).
template <class T, int Rank, class Shape, auto List>
using dtensor_from_t =
    typename detail::dtensor_from<T, Rank, Shape, List, std::make_index_sequence<List().size()>>::type;

template <class D>
concept AnyDTensor = requires {
  typename detail::dtensor_traits<std::remove_cvref_t<D>>::value_type;
};

template <class D>
inline constexpr PlacementList placements_of = detail::dtensor_traits<std::remove_cvref_t<D>>::placements;

namespace detail {

/// X's placements with mesh axis `Axis` set to `P`.
template <class X, int Axis, Placement P>
struct WithAxis {
  static constexpr PlacementList list() {
    PlacementList l = X::placements;
    l[Axis] = P;
    return l;
  }
};
/// The DTensor type X with mesh axis `Axis` placed as `P`.
template <class X, int Axis, Placement P>
using with_axis_t = dtensor_from_t<typename X::value_type, X::rank, typename dtensor_traits<X>::shape_type,
                                   &WithAxis<X, Axis, P>::list>;
/// The DTensor type X with mesh axis `Axis` sharding dim `Dim`.
template <class X, int Axis, int Dim>
using with_axis_shard_t = with_axis_t<X, Axis, Placement::shard(Dim)>;

/// static_asserts naming what to redistribute when `E` is not none (the rule's message, the only error).
/// @post true (see the top of this file).
template <RuleError E>
consteval bool check_rule() {
  static_assert(
      E != RuleError::different_dims,
      "dtensor op: the operands are sharded on different dims along one mesh axis: redistribute one "
      "so both shard the same dim, or to Replicate");
  static_assert(
      E != RuleError::contracted_mismatch,
      "dtensor op: a contracted dim is sharded in one operand but not in the other: redistribute the "
      "other to Shard that dim too, or this one to Replicate");
  static_assert(
      E != RuleError::partial_nonlinear,
      "dtensor op: a Partial input to a nonlinear op (relu, gelu, silu, exp, max, x + scalar, ...): "
      "redistribute<Replicate> it first");
  static_assert(E != RuleError::partial_plus_other,
                "dtensor op: Partial + a non-Partial operand would add that operand once per rank: "
                "redistribute<Replicate> the Partial one first");
  static_assert(E != RuleError::partial_product,
                "dtensor op: Partial * Partial is not Partial: redistribute<Replicate> one factor first");
  static_assert(E != RuleError::partial_and_shard,
                "dtensor op: one operand is Partial and another Shard along the same mesh axis: "
                "redistribute<Replicate> the Partial one first");
  static_assert(E != RuleError::partial_op,
                "dtensor op: a Partial<max/min/product> input: only Partial<sum/avg> pass through ops; "
                "redistribute<Replicate> it first");
  static_assert(E != RuleError::partial_ops_differ,
                "dtensor op: Partial operands with different ops (sum and avg): redistribute one first");
  static_assert(E != RuleError::partial_divisor,
                "dtensor op: dividing by a Partial: redistribute<Replicate> the divisor first");
  static_assert(E != RuleError::shard_axes,
                "dtensor op: an operand shards a dim over mesh axes that are not the first of those the "
                "output shards it over: redistribute it to match, or to Replicate");
  static_assert(E != RuleError::shape, "dtensor op: internal error: dim labels do not fit the operands");
  return true;
}

/// The output placements of an op on a mesh of shape `Shape`, from its rule `Rule()` (a constexpr callable
/// returning a RuleResult): the rule's, or where it rejects the inputs, after check_rule reported why,
/// Replicate on every axis (a stand-in that keeps the rest of the compile quiet).
template <class Shape, auto Rule>
struct RuleOut {
  static constexpr RuleResult result = Rule();
  static constexpr bool checked = check_rule<result.error>();
  static constexpr PlacementList list() {
    return checked && result.ok() ? result.out : PlacementList(Shape::rank, Placement::replicate());
  }
};

} // namespace detail

/// The DTensor type an op with rule `Rule` returns (see detail::RuleOut): the first place that names it
/// reports a rejected input, with the rule's message.
template <class T, int Rank, class Shape, auto Rule>
using rule_result_t = dtensor_from_t<T, Rank, Shape, &detail::RuleOut<Shape, Rule>::list>;

namespace detail {

/// x's data as the DTensor type D (x's element type, rank and mesh; other placements), unchecked: for the
/// branch after a failed static_assert on x's placements, which goes on with the placements the check
/// wanted so that it adds no error of its own (it never runs: the program does not compile).
template <class D, class X>
D stand_in(const X& x) {
  return D(x.mesh(), x.local(), x.global_shape());
}

/// The local tensor of `x` cut to `need` (a block within x's own block).
template <class T, int R>
Tensor<T, R> cut(const Tensor<T, R>& local, const Block& held, const Block& need) {
  Tensor<T, R> t = local;
  for (int d = 0; d < R; ++d) {
    if (need.shape[d] != held.shape[d]) {
      t = t.narrow(d, need.offset[d] - held.offset[d], need.shape[d]);
    }
  }
  return t;
}

/// Operand `x`'s local tensor cut to what the output block needs (labels: x's, the output's).
template <class X>
auto operand_view(const X& x, const Labels& mine, const Labels& out, const Block& out_block) {
  const Block held =
      spec_block(to_extents(x.global_shape()), X::spec, x.mesh().sizes(), x.mesh().coordinate());
  const Block need = operand_block(mine, out, held, out_block);
  return cut<typename X::value_type, X::rank>(x.local(), held, need);
}

/// The gradient placements to bring a gradient with placements `grad` to, before an op's backward runs on
/// the local blocks of a primal with placements `primal` (pointwise in the gradient): where the primal is
/// Shard<d>, the gradient is Shard<d> (from Replicate that is a local chunk); where the primal is
/// Replicate, the gradient may stay Replicate or Partial<sum>; everything else becomes Replicate.
constexpr PlacementList gradient_target(const PlacementList& primal, const PlacementList& grad) {
  PlacementList t;
  for (int a = 0; a < primal.size(); ++a) {
    const Placement p = primal[a];
    const Placement g = grad[a];
    if (p.is_shard()) {
      t.push_back(p);
    } else if (p.is_replicate() && g == Placement::partial(ReduceOp::sum)) {
      t.push_back(g);
    } else {
      t.push_back(Placement::replicate());
    }
  }
  return t;
}

template <class X, class G>
struct GradTarget {
  static constexpr PlacementList list() { return gradient_target(X::placements, placements_of<G>); }
};

template <class X>
struct DualOf {
  static constexpr PlacementList list() { return dual(X::placements); }
};

/// x.redistribute<Q...>() for the placements of the DTensor type D.
template <class D, class X>
struct redistribute_as;
template <class T, int R, class Shape, class... Q, class X>
struct redistribute_as<DTensor<T, R, Shape, Q...>, X> {
  static DTensor<T, R, Shape, Q...> run(const X& x) { return x.template redistribute<Q...>(); }
};

/// g brought to placements that describe the gradient of a primal placed like `X` (dual, or Partial<sum>
/// kept where X is Replicate).
template <class X, class G>
auto as_gradient_of(G g) {
  if constexpr (fits_gradient(X::placements, G::placements, X::rank)) {
    return g;
  } else {
    using D = dtensor_from_t<typename X::value_type, X::rank, typename dtensor_traits<X>::shape_type,
                             &DualOf<X>::list>;
    return redistribute_as<D, G>::run(g);
  }
}

} // namespace detail

} // namespace dtensor

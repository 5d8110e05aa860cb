#pragma once
// Reductions of a DTensor over one dim, the output placements fixed at compile time by ops/rules.hpp:
//
//   auto s = sum<1>(x);    // x [S(1)] -> s [P(sum)]: each rank sums its columns, the total is pending
//   auto m = mean<0>(x);   // x [S(1)] -> m [S(0)]: dim 1 of x is dim 0 of the result
//   auto h = max<1>(x);    // x [S(1)] -> h [P(max)]
//
// The dim is dropped (torch's keepdim=False). A reduction over a sharded dim gives Partial<op> (sum and
// mean: Partial<sum>; a mean divides each rank's local sum by the global count, so uneven shards are
// exact); sum and mean are linear (a Partial<sum/avg> input stays Partial), max and min are not (a Partial
// input does not compile). An empty shard contributes the op's identity. Every reduction has a backward
// (`auto [y, back] = max<1>(x, with_backward)`); max and min split the gradient between ties, as torch's
// amax and amin.

#include <array>
#include <cstdint>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {

template <ReduceOp Op, int Dim, class X>
constexpr RuleResult reduce_rule() {
  OpSpec s;
  const Labels in = trailing_labels(X::rank, X::rank);
  const Labels out = labels_without(X::rank, Dim);
  s.in.push_back(in);
  s.out = out;
  s.linearity = Op == ReduceOp::sum || Op == ReduceOp::avg ? Linearity::linear : Linearity::nonlinear;
  s.contract = Op == ReduceOp::avg ? ReduceOp::sum : Op;
  return apply_rule(s, {X::placements});
}

/// The output type of the reduction by Op over dim Dim of X (naming it reports inputs the rule rejects).
template <ReduceOp Op, int Dim, class X>
using reduce_result_t = rule_result_t<typename X::value_type, X::rank - 1,
                                      typename dtensor_traits<X>::shape_type, &reduce_rule<Op, Dim, X>>;

template <ReduceOp Op, int Dim, class X>
auto reduce_dim(const X& x) {
  static_assert(X::rank >= 1, "dtensor reduction: a rank-0 tensor has no dim to reduce");
  static_assert(Dim >= -X::rank && Dim < X::rank,
                "dtensor reduction: dim out of range for the tensor's rank");
  constexpr int dim = Dim < 0 ? Dim + X::rank : Dim;
  using Y = reduce_result_t<Op, dim, X>;
  std::array<std::int64_t, X::rank - 1> global{};
  for (int d = 0, o = 0; d < X::rank; ++d) {
    if (d != dim) {
      global[o++] = x.global_shape()[d];
    }
  }
  const double divide = Op == ReduceOp::avg ? static_cast<double>(x.global_shape()[dim]) : 1.0;
  const auto kept = local::reduce(Op, x.local(), dim, divide);
  std::array<std::int64_t, X::rank - 1> local_shape{};
  for (int d = 0, o = 0; d < X::rank; ++d) {
    if (d != dim) {
      local_shape[o++] = kept.shape()[d];
    }
  }
  return Y(x.mesh(), kept.template view<X::rank - 1>(local_shape), global);
}

/// X's placements with Partial made Replicate: the layout of X's blocks, which its gradient takes.
template <class X>
struct BlocksOf {
  static constexpr PlacementList list() {
    PlacementList l = X::placements;
    for (Placement& p : l) {
      p = p.is_partial() ? Placement::replicate() : p;
    }
    return l;
  }
  using type = dtensor_from_t<typename X::value_type, X::rank, typename dtensor_traits<X>::shape_type, &list>;
};

/// The rule of spreading a gradient G (x's labels without Dim) over x's blocks.
template <int Dim, class X, class G>
struct ExpandOut {
  static constexpr RuleResult rule() {
    OpSpec s;
    const Labels full = trailing_labels(X::rank, X::rank);
    const Labels less = labels_without(X::rank, Dim);
    s.in.push_back(full);
    s.in.push_back(less);
    s.out = full;
    s.linearity = Linearity::multiplicative;
    return apply_rule(s, {BlocksOf<X>::list(), G::placements});
  }
};

} // namespace detail

/// The backward context of sum<Dim> / mean<Dim> of X: keeps the mesh and x's global shape.
template <ReduceOp Op, int Dim, class X>
class ReduceBackward {
public:
  ReduceBackward(typename X::mesh_type mesh, typename X::shape_type global)
      : mesh_(std::move(mesh)), global_(global) {}

  /// x's gradient: y's gradient repeated along Dim (divided by its global length for a mean).
  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using T = typename X::value_type;
    using Shape = typename dtensor_traits<X>::shape_type;
    using Y = reduce_result_t<Op, Dim, X>;
    static_assert(std::is_same_v<typename G::value_type, T> && G::rank == X::rank - 1,
                  "backward: the gradient must have the forward output's element type and rank");
    using Target = dtensor_from_t<T, X::rank - 1, Shape, &GradTarget<Y, G>::list>;
    const Target gt = redistribute_as<Target, G>::run(g);
    using DX = rule_result_t<T, X::rank, Shape, &ExpandOut<Dim, X, Target>::rule>;
    const Labels full = trailing_labels(X::rank, X::rank);
    const Labels less = labels_without(X::rank, Dim);
    const Block out = spec_block(to_extents(global_), DX::spec, mesh_.sizes(), mesh_.coordinate());
    const auto v = operand_view(gt, less, full, out).contiguous();
    std::array<std::int64_t, X::rank> with_dim{};
    std::array<std::int64_t, X::rank> shape{};
    for (int d = 0, o = 0; d < X::rank; ++d) {
      with_dim[d] = d == Dim ? 1 : v.shape()[o++];
      shape[d] = out.shape[d];
    }
    const double factor = Op == ReduceOp::avg ? 1.0 / static_cast<double>(global_[Dim]) : 1.0;
    auto local = local::expand(local::Scale{factor}, v.template view<X::rank>(with_dim), shape);
    return as_gradient_of<X>(DX(mesh_, std::move(local), global_));
  }

private:
  typename X::mesh_type mesh_;
  typename X::shape_type global_;
};

namespace detail {

/// Y's placements with Partial<max/min> made Partial<sum>: where y was pending a max, a count is pending
/// a sum.
template <class Y>
struct CountOf {
  static constexpr PlacementList list() {
    PlacementList l = Y::placements;
    for (Placement& p : l) {
      p = p.is_partial() ? Placement::partial(ReduceOp::sum) : p;
    }
    return l;
  }
  using type = dtensor_from_t<typename Y::value_type, Y::rank, typename dtensor_traits<Y>::shape_type, &list>;
};

} // namespace detail

/// The backward context of max<Dim> / min<Dim> of X (torch's amax/amin): the gradient goes to every
/// element that attains the extremum, split evenly between ties. Keeps x and the forward's output; the
/// backward completes the extremum over Dim (an all_reduce where Dim is sharded) and counts the ties
/// (another, of the counts).
template <ReduceOp Op, int Dim, class X, class Y>
class ExtremumBackward {
public:
  ExtremumBackward(X x, Y y) : x_(std::move(x)), y_(std::move(y)) {}

  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using T = typename X::value_type;
    using Shape = typename dtensor_traits<X>::shape_type;
    static_assert(std::is_same_v<typename G::value_type, T> && G::rank == X::rank - 1,
                  "backward: the gradient must have the forward output's element type and rank");
    using Target = dtensor_from_t<T, X::rank - 1, Shape, &GradTarget<Y, G>::list>;
    const Target gt = redistribute_as<Target, G>::run(g);
    using DX = rule_result_t<T, X::rank, Shape, &ExpandOut<Dim, X, Target>::rule>;
    using YB = typename BlocksOf<Y>::type;
    using YC = typename CountOf<Y>::type;
    const Labels full = trailing_labels(X::rank, X::rank);
    const Labels less = labels_without(X::rank, Dim);
    const auto& mesh = x_.mesh();
    const Extents global = to_extents(x_.global_shape());
    const Block held = spec_block(global, X::spec, mesh.sizes(), mesh.coordinate());
    const Block out = spec_block(global, DX::spec, mesh.sizes(), mesh.coordinate());
    auto with_dim = [&](const auto& t, const Block& b) {
      std::array<std::int64_t, X::rank> one{};
      std::array<std::int64_t, X::rank> shape{};
      for (int d = 0, o = 0; d < X::rank; ++d) {
        one[d] = d == Dim ? 1 : t.shape()[o++];
        shape[d] = b.shape[d];
      }
      return local::expand(local::Scale{1}, t.contiguous().template view<X::rank>(one), shape);
    };
    // The extremum over all of Dim, on x's block; where x attains it; how many do, over all of Dim.
    const YB m = redistribute_as<YB, Y>::run(y_);
    const auto attained =
        local::map(local::Attained{}, x_.local(), with_dim(operand_view(m, less, full, held), held));
    const auto counted = local::reduce(ReduceOp::sum, attained, Dim);
    std::array<std::int64_t, X::rank - 1> count_shape{};
    for (int d = 0, o = 0; d < X::rank; ++d) {
      if (d != Dim) {
        count_shape[o++] = counted.shape()[d];
      }
    }
    const YB count = redistribute_as<YB, YC>::run(
        YC(mesh, counted.template view<X::rank - 1>(count_shape), y_.global_shape()));
    const auto share = local::map(local::Div{}, operand_view(gt, less, full, out).contiguous(),
                                  operand_view(count, less, full, out));
    auto local = local::map(local::Mul{}, cut<T, X::rank>(attained, held, out), with_dim(share, out));
    return as_gradient_of<X>(DX(mesh, std::move(local), x_.global_shape()));
  }

private:
  X x_;
  Y y_;
};

/// The sum over dim Dim (a template argument: the output placements depend on it).
template <int Dim, AnyDTensor X>
auto sum(const X& x) {
  return detail::reduce_dim<ReduceOp::sum, Dim>(x);
}
/// The mean over dim Dim (exact over uneven shards: local sums divided by the global count).
template <int Dim, AnyDTensor X>
auto mean(const X& x) {
  return detail::reduce_dim<ReduceOp::avg, Dim>(x);
}
/// sum / mean with the context of the backward: `auto [y, back] = sum<1>(x, with_backward); dx = back(dy);`
template <int Dim, AnyDTensor X>
auto sum(const X& x, WithBackwardTag) {
  constexpr int dim = Dim < 0 ? Dim + X::rank : Dim;
  auto y = sum<dim>(x);
  using Back = ReduceBackward<ReduceOp::sum, dim, X>;
  return WithBackward<decltype(y), Back>{std::move(y), Back(x.mesh(), x.global_shape())};
}
template <int Dim, AnyDTensor X>
auto mean(const X& x, WithBackwardTag) {
  constexpr int dim = Dim < 0 ? Dim + X::rank : Dim;
  auto y = mean<dim>(x);
  using Back = ReduceBackward<ReduceOp::avg, dim, X>;
  return WithBackward<decltype(y), Back>{std::move(y), Back(x.mesh(), x.global_shape())};
}
/// The maximum over dim Dim (NaN wins, as in torch). Not for Partial inputs.
template <int Dim, AnyDTensor X>
auto max(const X& x) {
  return detail::reduce_dim<ReduceOp::max, Dim>(x);
}
/// The minimum over dim Dim. Not for Partial inputs.
template <int Dim, AnyDTensor X>
auto min(const X& x) {
  return detail::reduce_dim<ReduceOp::min, Dim>(x);
}
/// max / min with the context of the backward (torch's amax/amin: ties share the gradient evenly).
template <int Dim, AnyDTensor X>
auto max(const X& x, WithBackwardTag) {
  constexpr int dim = Dim < 0 ? Dim + X::rank : Dim;
  auto y = max<dim>(x);
  using Back = ExtremumBackward<ReduceOp::max, dim, X, decltype(y)>;
  return WithBackward<decltype(y), Back>{y, Back(x, y)};
}
template <int Dim, AnyDTensor X>
auto min(const X& x, WithBackwardTag) {
  constexpr int dim = Dim < 0 ? Dim + X::rank : Dim;
  auto y = min<dim>(x);
  using Back = ExtremumBackward<ReduceOp::min, dim, X, decltype(y)>;
  return WithBackward<decltype(y), Back>{y, Back(x, y)};
}

} // namespace dtensor

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
// input does not compile). An empty shard contributes the op's identity.

#include <array>
#include <cstdint>

#include "dtensor/ops/local/pointwise.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {

template <ReduceOp Op, int Dim, class X>
constexpr RuleResult reduce_rule() {
  OpSpec s;
  Labels in;
  Labels out;
  for (int d = 0; d < X::rank; ++d) {
    in.push_back(static_cast<char>('a' + d));
    if (d != Dim) {
      out.push_back(static_cast<char>('a' + d));
    }
  }
  s.in.push_back(in);
  s.out = out;
  s.linearity = Op == ReduceOp::sum || Op == ReduceOp::avg ? Linearity::linear : Linearity::nonlinear;
  s.contract = Op == ReduceOp::avg ? ReduceOp::sum : Op;
  return apply_rule(s, {X::placements});
}

template <ReduceOp Op, int Dim, class X>
struct ReduceOut {
  static constexpr PlacementList list() { return reduce_rule<Op, Dim, X>().out; }
};

template <ReduceOp Op, int Dim, class X>
auto reduce_dim(const X& x) {
  static_assert(X::rank >= 1, "dtensor reduction: a rank-0 tensor has no dim to reduce");
  static_assert(Dim >= -X::rank && Dim < X::rank,
                "dtensor reduction: dim out of range for the tensor's rank");
  constexpr int dim = Dim < 0 ? Dim + X::rank : Dim;
  static_assert(check_rule<reduce_rule<Op, dim, X>().error>());
  using T = typename X::value_type;
  using Y =
      dtensor_from_t<T, X::rank - 1, typename dtensor_traits<X>::shape_type, &ReduceOut<Op, dim, X>::list>;
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

} // namespace detail

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

} // namespace dtensor

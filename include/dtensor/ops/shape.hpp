#pragma once
// Dim shuffles of DTensors: a Shard moves with its dim, and the plan never communicates.
//
//   auto t = transpose<0, 1>(x);   // x [S(0), R] (m, n) -> t [S(1), R] (n, m)
//   auto [t2, back] = transpose<0, 1>(x, with_backward);   // dx = back(dt): the same swap back
//
// The local shard is transposed into new contiguous memory (DTensor shards are contiguous).

#include <array>
#include <cstdint>
#include <utility>

#include "dtensor/core/with_backward.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed.hpp"
#include "dtensor/tensor/dtensor.hpp"
#include "dtensor/tensor/local_ops.hpp"

namespace dtensor {

namespace detail {

template <int D0, int D1, class X>
struct TransposeOut {
  static constexpr RuleResult rule() {
    OpSpec s;
    s.in.push_back(trailing_labels(X::rank, X::rank));
    Labels out = trailing_labels(X::rank, X::rank);
    out[D0] = static_cast<char>('a' + D1);
    out[D1] = static_cast<char>('a' + D0);
    s.out = out;
    s.linearity = Linearity::linear;
    return apply_rule(s, {X::placements});
  }
  static constexpr PlacementList list() { return rule().out; }
};

template <int D0, int D1, class X>
auto transpose_dims(const X& x) {
  static_assert(D0 >= 0 && D0 < X::rank && D1 >= 0 && D1 < X::rank, "transpose: dims out of range");
  static_assert(check_rule<TransposeOut<D0, D1, X>::rule().error>());
  using T = typename X::value_type;
  using Y =
      dtensor_from_t<T, X::rank, typename dtensor_traits<X>::shape_type, &TransposeOut<D0, D1, X>::list>;
  auto swap = [](auto a) {
    std::swap(a[D0], a[D1]);
    return a;
  };
  const auto& local = x.local();
  // A view of the shard with the two dims swapped, copied into contiguous memory of its shape.
  const auto view =
      Tensor<T, X::rank>::from_blob(const_cast<T*>(local.data()), swap(local.shape()), swap(local.strides()),
                                    local.device(), local.stream_handle());
  auto out = empty_like(view.shape(), local);
  local_ops::copy(out, view);
  return Y(x.mesh(), std::move(out), swap(x.global_shape()));
}

} // namespace detail

/// The backward context of a transpose: the same swap of the gradient (after bringing it to the output's
/// layout).
template <int D0, int D1, class X>
class TransposeBackward {
public:
  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using Y = dtensor_from_t<typename X::value_type, X::rank, typename dtensor_traits<X>::shape_type,
                             &TransposeOut<D0, D1, X>::list>;
    using Target = dtensor_from_t<typename X::value_type, X::rank, typename dtensor_traits<X>::shape_type,
                                  &GradTarget<Y, G>::list>;
    return as_gradient_of<X>(transpose_dims<D0, D1>(redistribute_as<Target, G>::run(g)));
  }
};

/// x with dims D0 and D1 swapped (negative dims count from the end).
template <int D0, int D1, AnyDTensor X>
auto transpose(const X& x) {
  return detail::transpose_dims < D0 < 0 ? D0 + X::rank : D0, D1 < 0 ? D1 + X::rank : D1 > (x);
}
template <int D0, int D1, AnyDTensor X>
auto transpose(const X& x, WithBackwardTag) {
  constexpr int d0 = D0 < 0 ? D0 + X::rank : D0;
  constexpr int d1 = D1 < 0 ? D1 + X::rank : D1;
  auto y = detail::transpose_dims<d0, d1>(x);
  return WithBackward<decltype(y), TransposeBackward<d0, d1, X>>{std::move(y), {}};
}

} // namespace dtensor

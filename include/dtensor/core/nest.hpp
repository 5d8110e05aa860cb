#pragma once
// Nests: leaves (DTensors, gradient holders: whatever a trait names) in tuples (anything with
// std::tuple_size) and ranges, nested as deep as wanted. A model's parameters, their gradients and the
// optimizer's view of them are nests of one shape; clip_grad_norm, the trainers and the user's loops over
// parameters walk them with these.
#include <cstddef>
#include <iterator>
#include <tuple>
#include <type_traits>
#include <utility>

namespace dtensor::detail {

template <class V>
concept TupleLike = requires {
  std::tuple_size<V>::value;
};

/// f(leaf) for every leaf of the nest p, in order; IsLeaf<V>::value says whether a V is a leaf. The leaves
/// come as p holds them (const when p is).
template <template <class> class IsLeaf, class P, class F>
void for_each_leaf(P&& p, F&& f) {
  using V = std::remove_cvref_t<P>;
  if constexpr (IsLeaf<V>::value) {
    f(p);
  } else if constexpr (TupleLike<V>) {
    std::apply([&](auto&&... e) { (for_each_leaf<IsLeaf>(e, f), ...); }, p);
  } else {
    for (auto&& e : p) {
      for_each_leaf<IsLeaf>(e, f);
    }
  }
}

/// f(x, y) for the leaves x of the nest a and y of the nest b, which has a's shape, in order.
template <template <class> class IsLeaf, class A, class B, class F>
void for_each_leaf_pair(A&& a, B&& b, F&& f) {
  using V = std::remove_cvref_t<A>;
  if constexpr (IsLeaf<V>::value) {
    f(a, b);
  } else if constexpr (TupleLike<V>) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (for_each_leaf_pair<IsLeaf>(std::get<I>(a), std::get<I>(b), f), ...);
    }
    (std::make_index_sequence<std::tuple_size_v<V>>{});
  } else {
    for (std::size_t i = 0; i < std::size(a); ++i) {
      for_each_leaf_pair<IsLeaf>(a[i], b[i], f);
    }
  }
}

} // namespace dtensor::detail

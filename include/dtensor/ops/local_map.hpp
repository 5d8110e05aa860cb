#pragma once
// local_map: run your own local function on the shards, with the placements of its inputs and output
// declared and checked at compile time (torch.distributed.tensor.experimental.local_map):
//
//   auto f = local_map<In<Shard<0>, Replicate>, Out<Partial<>>>(
//       [](const Tensor<float, 2>& a, const Tensor<float, 2>& b) { return my_kernel(a, b); });
//   DTensor<float, 2, Mesh, Partial<>> y = f(a, b);     // a: [S(0)], b: [R] on a 1-axis mesh
//
// In lists one entry per input, Out the output: a placement type (Shard<d>, Replicate, Partial<op>) for a
// 1-axis mesh, or Placements<...> with one placement per mesh axis. An input whose placements are not the
// declared ones does not compile (redistribute it first: local_map never communicates). The function gets
// each input's local tensor and returns the output's (a Tensor), or a LocalResult with the output's
// global shape where its shards are uneven; otherwise that shape is the local one times the number of
// shards of each sharded dim, as DTensor::from_local infers it.

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/core/tensor.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

/// The declared placements of local_map's inputs, one entry per input.
template <class... P>
struct In {};
/// The declared placements of local_map's output.
template <class P>
struct Out {};

/// A local function's result with the output's global shape (for uneven shards).
template <class T, int Rank>
struct LocalResult {
  Tensor<T, Rank> local;
  std::array<std::int64_t, Rank> global;
};

namespace detail {

/// An entry of In / Out as a placement list type: Placements<P> for a placement type, else itself.
template <class P>
struct as_placements {
  using type = P;
};
template <PlacementType P>
struct as_placements<P> {
  using type = Placements<P>;
};

template <class D, class PL>
struct with_placements;
template <class T, int R, class Shape, class... Old, class... New>
struct with_placements<DTensor<T, R, Shape, Old...>, Placements<New...>> {
  using type = DTensor<T, R, Shape, New...>;
};

template <class T>
struct local_result_traits {
  using tensor = T;
};
template <class T, int R>
struct local_result_traits<LocalResult<T, R>> {
  using tensor = Tensor<T, R>;
};

template <class X, class Declared>
consteval bool check_local_map_input() {
  static_assert(X::placements == normalize(Declared::value, X::rank),
                "local_map: an input's placements are not the declared ones (In<...>): redistribute it to "
                "them first (local_map never communicates)");
  return true;
}

} // namespace detail

/// The function returned by local_map (see the top of this file).
template <class InDecl, class OutDecl, class F>
class LocalMap;

template <class... I, class O, class F>
class LocalMap<In<I...>, Out<O>, F> {
public:
  explicit LocalMap(F f) : f_(std::move(f)) {}

  template <AnyDTensor... X>
  auto operator()(const X&... xs) const {
    static_assert(sizeof...(X) == sizeof...(I), "local_map: In<...> declares a different number of inputs");
    if constexpr (sizeof...(X) != sizeof...(I)) {
      return std::get<0>(std::tie(xs...)); // after the error above, a stand-in: no second error
    } else {
      return run(xs...);
    }
  }

private:
  template <class... X>
  auto run(const X&... xs) const {
    static_assert((detail::check_local_map_input<X, typename detail::as_placements<I>::type>() && ...));
    const auto& first = std::get<0>(std::tie(xs...));
    using Result = std::invoke_result_t<const F&, const typename X::local_type&...>;
    using Local = typename detail::local_result_traits<Result>::tensor;
    using T = typename Local::value_type;
    constexpr int rank = Local::rank;
    using Mesh = std::remove_cvref_t<decltype(first.mesh())>;
    using Y = typename detail::with_placements<DTensor<T, rank, typename Mesh::shape_type>,
                                               typename detail::as_placements<O>::type>::type;
    Result r = f_(xs.local()...);
    if constexpr (std::is_same_v<Result, Local>) {
      return Y::from_local(first.mesh(), std::move(r));
    } else {
      return Y::from_local(first.mesh(), std::move(r.local), r.global);
    }
  }

  F f_;
};

/// `f` on the local shards, with In<...> the inputs' placements and Out<...> the output's.
template <class InDecl, class OutDecl, class F>
LocalMap<InDecl, OutDecl, std::decay_t<F>> local_map(F&& f) {
  return LocalMap<InDecl, OutDecl, std::decay_t<F>>(std::forward<F>(f));
}

} // namespace dtensor

#pragma once
// softmax and log_softmax along a dim of a DTensor, forward and backward, the placements unchanged:
//
//   auto p = softmax<1>(x);                      // x [S(0)]: local, rows are whole
//   auto q = softmax<1>(y);                      // y [S(1)]: the distributed form, no gather: the row max
//                                                // (all_reduce max) and the sum of exponentials (all_reduce
//                                                // sum) over the axes that shard dim 1, of one value per row
//   auto [l, back] = log_softmax<-1>(y, with_backward);   // dx = back(dl)
//
// A Partial input does not compile (softmax is not linear). The row statistics are computed on each
// rank's block and completed over exactly the mesh axes that shard the dim (elsewhere nothing moves); the
// backward needs one more row sum (sum of g * y for softmax, of g for log_softmax), completed the same way.
// A gradient that is Partial<sum> on Replicate axes stays Partial (the backward is linear in it). Along
// the last dim on the host each output row is computed from its row statistics directly (a row at a time,
// local::host_map_row); elsewhere the statistics are repeated to the block's shape for elementwise maps.

#include <array>
#include <cstdint>
#include <utility>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace local {

/// exp(x - m)
struct ExpShifted {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x, C m) const {
    return math::exp(x - m);
  }
};
/// e / s
struct Normalize {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C e, C s) const {
    return e / s;
  }
};
/// x - m - log(s)
struct LogNormalize {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x, C m, C s) const {
    return x - m - std::log(s);
  }
};
/// softmax backward: y (g - s), s = sum(g y) along the dim
struct SoftmaxGrad {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C y, C g, C s) const {
    return y * (g - s);
  }
};
/// log_softmax backward: g - exp(y) s, s = sum(g) along the dim
struct LogSoftmaxGrad {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C y, C g, C s) const {
    return g - math::exp(y) * s;
  }
};

} // namespace local

namespace detail {

/// X's placements with every axis that shards Dim made Replicate, and the dim removed from the others'
/// Shard numbering: the placements of a row statistic completed over Dim.
template <int Dim, class X>
struct RowStats {
  static constexpr PlacementList list() {
    PlacementList l;
    for (Placement p : X::placements) {
      p = normalize(p, X::rank);
      if (p.is_shard()) {
        p = p.dim == Dim ? Placement::replicate() : Placement::shard(p.dim > Dim ? p.dim - 1 : p.dim);
      }
      l.push_back(p);
    }
    return l;
  }
};
/// The same, before completing: the axes that shard Dim hold a Partial<Op>.
template <ReduceOp Op, int Dim, class X>
struct RowPartials {
  static constexpr PlacementList list() {
    PlacementList l = RowStats<Dim, X>::list();
    for (int a = 0; a < l.size(); ++a) {
      if (normalize(X::placements[a], X::rank) == Placement::shard(Dim)) {
        l[a] = Placement::partial(Op);
      }
    }
    return l;
  }
};

/// `t` (a tensor on x's block) reduced by Op along Dim over the whole global dim: the local reduction, then
/// an all_reduce over the mesh axes that shard Dim. The result keeps Dim with size 1.
template <ReduceOp Op, int Dim, class X, class T>
Tensor<T, X::rank> reduce_along(const X& x, const Tensor<T, X::rank>& t) {
  using Shape = typename dtensor_traits<X>::shape_type;
  using Part = dtensor_from_t<T, X::rank - 1, Shape, &RowPartials<Op, Dim, X>::list>;
  using Done = dtensor_from_t<T, X::rank - 1, Shape, &RowStats<Dim, X>::list>;
  const Tensor<T, X::rank> kept = local::reduce(Op, t, Dim);
  std::array<std::int64_t, X::rank - 1> local{};
  std::array<std::int64_t, X::rank - 1> global{};
  for (int d = 0, o = 0; d < X::rank; ++d) {
    if (d != Dim) {
      local[o] = kept.shape()[d];
      global[o++] = x.global_shape()[d];
    }
  }
  const Done done =
      redistribute_as<Done, Part>::run(Part(x.mesh(), kept.template view<X::rank - 1>(local), global));
  return done.local().template view<X::rank>(kept.shape());
}

/// `t` (size 1 along Dim) repeated to `shape`.
template <class T, int R>
Tensor<T, R> repeat(const Tensor<T, R>& t, const typename Tensor<T, R>::Shape& shape) {
  return local::expand(local::Scale{1}, t, shape);
}

template <int Dim, class X>
constexpr bool softmax_ok() {
  static_assert(X::rank >= 1 && Dim >= 0 && Dim < X::rank, "softmax: dim out of range");
  static_assert(check_rule<pointwise_rule<Linearity::nonlinear, X>().error>());
  return true;
}

/// On the host, along the last dim: out[r, k] = make(r)(a[r, k], rest[r, k]...) for each row r, each row
/// through local::host_map_row (so a row statistic needs no tensor repeated to the full shape).
template <class Make, class T, int R, class... A>
Tensor<T, R> host_rows_map(const Make& make, const Tensor<T, R>& a, const A&... rest) {
  using C = local::compute_t<T>;
  const std::int64_t n = R == 0 ? 1 : a.shape()[R - 1];
  const std::int64_t rows = n == 0 || a.device().is_meta() ? 0 : a.numel() / n; // meta: the output only
  const Tensor<T, R> ac = a.contiguous();
  const std::array<Tensor<T, R>, sizeof...(A)> rc{rest.contiguous()...};
  Tensor<T, R> out = empty_like(a.shape(), a);
  for (std::int64_t r = 0; r < rows; ++r) {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      local::host_map_row<C>(out.data() + r * n, n, make(r), ac.data() + r * n, rc[K].data() + r * n...);
    }
    (std::index_sequence_for<A...>{});
  }
  return out;
}

template <bool Log, int Dim, class X>
X softmax_dim(const X& x) {
  static_assert(softmax_ok<Dim, X>());
  const auto& t = x.local();
  if constexpr (Dim == X::rank - 1) {
    if (!t.device().is_cuda()) { // a row at a time (meta: the same tensors, no values): the row max and
                                 // sum are never repeated to t's shape
      using C = local::compute_t<typename X::value_type>;
      const auto m = reduce_along<ReduceOp::max, Dim>(x, t).contiguous();
      const auto* mp = m.data();
      const auto e = host_rows_map(
          [mp](std::int64_t r) {
            const C mr = static_cast<C>(mp[r]);
            return [mr](C v) { return local::ExpShifted{}(v, mr); };
          },
          t);
      const auto s = reduce_along<ReduceOp::sum, Dim>(x, e).contiguous();
      const auto* sp = s.data();
      if constexpr (Log) {
        return X(x.mesh(),
                 host_rows_map(
                     [mp, sp](std::int64_t r) {
                       const C mr = static_cast<C>(mp[r]);
                       const C sr = static_cast<C>(sp[r]);
                       return [mr, sr](C v) { return local::LogNormalize{}(v, mr, sr); };
                     },
                     t),
                 x.global_shape());
      } else {
        return X(x.mesh(),
                 host_rows_map(
                     [sp](std::int64_t r) {
                       const C sr = static_cast<C>(sp[r]);
                       return [sr](C v) { return local::Normalize{}(v, sr); };
                     },
                     e),
                 x.global_shape());
      }
    }
  }
  const auto m = repeat(reduce_along<ReduceOp::max, Dim>(x, t), t.shape());
  const auto e = local::map(local::ExpShifted{}, t, m);
  const auto s = repeat(reduce_along<ReduceOp::sum, Dim>(x, e), t.shape());
  if constexpr (Log) {
    return X(x.mesh(), local::map(local::LogNormalize{}, t, m, s), x.global_shape());
  } else {
    return X(x.mesh(), local::map(local::Normalize{}, e, s), x.global_shape());
  }
}

} // namespace detail

/// The backward of softmax<Dim> / log_softmax<Dim> of X: keeps the output.
template <bool Log, int Dim, class X>
class SoftmaxBackward {
public:
  explicit SoftmaxBackward(X y) : y_(std::move(y)) {}

  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using T = typename X::value_type;
    using Shape = typename dtensor_traits<X>::shape_type;
    static_assert(std::is_same_v<typename G::value_type, T> && G::rank == X::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    DTENSOR_CHECK(g.global_shape() == y_.global_shape(),
                  "backward of softmax: the gradient's global shape differs from the output's");
    using Target = dtensor_from_t<T, X::rank, Shape, &GradTarget<X, G>::list>;
    const Target gt = redistribute_as<Target, G>::run(g);
    const auto& y = y_.local();
    const auto& gl = gt.local();
    // The row sum is linear in g: a Partial<sum> gradient (on Replicate axes) stays Partial there.
    if constexpr (Dim == X::rank - 1) {
      if (!y.device().is_cuda()) { // a row at a time, as the forward
        using C = local::compute_t<T>;
        const auto s = (Log ? reduce_along<ReduceOp::sum, Dim>(gt, gl)
                            : reduce_along<ReduceOp::sum, Dim>(gt, local::map(local::Mul{}, gl, y)))
                           .contiguous();
        const auto* sp = s.data();
        const auto dx = host_rows_map(
            [sp](std::int64_t r) {
              const C sr = static_cast<C>(sp[r]);
              return [sr](C yv, C gv) {
                return Log ? local::LogSoftmaxGrad{}(yv, gv, sr) : local::SoftmaxGrad{}(yv, gv, sr);
              };
            },
            y, gl);
        return as_gradient_of<X>(Target(y_.mesh(), dx, y_.global_shape()));
      }
    }
    if constexpr (Log) {
      const auto s = repeat(reduce_along<ReduceOp::sum, Dim>(gt, gl), y.shape());
      return as_gradient_of<X>(
          Target(y_.mesh(), local::map(local::LogSoftmaxGrad{}, y, gl, s), y_.global_shape()));
    } else {
      const auto s = repeat(reduce_along<ReduceOp::sum, Dim>(gt, local::map(local::Mul{}, gl, y)), y.shape());
      return as_gradient_of<X>(
          Target(y_.mesh(), local::map(local::SoftmaxGrad{}, y, gl, s), y_.global_shape()));
    }
  }

private:
  X y_;
};

/// softmax along Dim (negative: from the end); the distributed form where Dim is sharded.
template <int Dim, AnyDTensor X>
X softmax(const X& x) {
  return detail::softmax_dim < false, Dim < 0 ? Dim + X::rank : Dim > (x);
}
template <int Dim, AnyDTensor X>
auto softmax(const X& x, WithBackwardTag) {
  constexpr int d = Dim < 0 ? Dim + X::rank : Dim;
  X y = detail::softmax_dim<false, d>(x);
  return WithBackward<X, SoftmaxBackward<false, d, X>>{y, SoftmaxBackward<false, d, X>(y)};
}
/// log(softmax(x)) along Dim, computed as x - max - log(sum(exp(x - max))).
template <int Dim, AnyDTensor X>
X log_softmax(const X& x) {
  return detail::softmax_dim < true, Dim < 0 ? Dim + X::rank : Dim > (x);
}
template <int Dim, AnyDTensor X>
auto log_softmax(const X& x, WithBackwardTag) {
  constexpr int d = Dim < 0 ? Dim + X::rank : Dim;
  X y = detail::softmax_dim<true, d>(x);
  return WithBackward<X, SoftmaxBackward<true, d, X>>{y, SoftmaxBackward<true, d, X>(y)};
}

} // namespace dtensor

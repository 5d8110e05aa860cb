#pragma once
// layer_norm and rms_norm over the K trailing dims of a DTensor, with weight (and bias), forward and
// backward:
//
//   auto y = layer_norm<1>(x, w, b, 1e-5);         // x [S(0)] (seq, hidden): sequence parallel, local
//   auto [r, back] = rms_norm<1>(x, w, 1e-6, with_backward);
//   auto [dx, dw] = back(dr);                      // dw [P]: each rank summed its own rows
//
// The normalized dims must not be sharded (a compile error names the fix: redistribute them to Replicate;
// shard a leading dim instead, as sequence parallelism does), and the input must not be Partial (the
// statistics are not linear); the weight and bias are Replicate. So the forward never communicates. The
// weight's and bias's gradients sum over the rows: Partial<sum> on the mesh axes that shard a leading dim
// (each rank summed its rows; the caller reduces, e.g. with the data-parallel gradient reduction),
// Replicate elsewhere (or Partial where the output's gradient was).

#include <array>
#include <cmath>
#include <cstdint>
#include <utility>

#include "dtensor/core/with_backward.hpp"
#include "dtensor/ops/local/pointwise.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/typed.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace local {

/// (x - mean) * rstd
struct Standardize {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x, C mean, C rstd) const {
    return (x - mean) * rstd;
  }
};
/// x * x
struct Square {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x) const {
    return x * x;
  }
};
/// 1 / sqrt(v + eps)
struct Rsqrt {
  double eps = 0;
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C v) const {
    return C(1) / std::sqrt(v + C(eps));
  }
};
/// The layer_norm input gradient from dxhat = g w, its row sums and xhat: rstd (dxhat - mean(dxhat) -
/// xhat mean(dxhat xhat)).
struct LayerNormGrad {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C dxhat, C xhat, C rstd, C mean_d, C mean_dx) const {
    return rstd * (dxhat - mean_d - xhat * mean_dx);
  }
};
/// The rms_norm input gradient: rstd (g w - x rstd^2 mean(g w x)).
struct RmsNormGrad {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C gw, C x, C rstd, C mean_gwx) const {
    return rstd * (gw - x * rstd * rstd * mean_gwx);
  }
};

} // namespace local

namespace detail {

enum class NormError : std::uint8_t { none, normalized_sharded, partial_input, parameter_not_replicate };

template <int K, class X, class... W>
constexpr NormError norm_check() {
  for (Placement p : X::placements) {
    p = normalize(p, X::rank);
    if (p.is_shard() && p.dim >= X::rank - K) {
      return NormError::normalized_sharded;
    }
    if (p.is_partial()) {
      return NormError::partial_input;
    }
  }
  for (const PlacementList& l : {W::placements...}) {
    for (Placement p : l) {
      if (!p.is_replicate()) {
        return NormError::parameter_not_replicate;
      }
    }
  }
  return NormError::none;
}

template <NormError E>
consteval bool check_norm() {
  static_assert(E != NormError::normalized_sharded,
                "layer_norm / rms_norm: a normalized (trailing) dim is sharded: redistribute it to Replicate "
                "first (shard a leading dim instead, as sequence parallelism shards the sequence)");
  static_assert(E != NormError::partial_input,
                "layer_norm / rms_norm: a Partial input (the statistics are not linear): "
                "redistribute<Replicate> it first");
  static_assert(E != NormError::parameter_not_replicate,
                "layer_norm / rms_norm: the weight and bias must be Replicate on every mesh axis");
  return E == NormError::none;
}

/// The placements of a weight's gradient: Partial<sum> where x shards a leading dim (each rank summed its
/// rows), the gradient's own (Replicate or Partial<sum>) elsewhere.
template <class X, class G>
struct ParamGrad {
  static constexpr PlacementList list() {
    PlacementList l;
    for (int a = 0; a < X::placements.size(); ++a) {
      const bool rows = X::placements[a].is_shard();
      const Placement g = G::placements[a];
      l.push_back(rows || g.is_partial() ? Placement::partial(ReduceOp::sum) : Placement::replicate());
    }
    return l;
  }
};

/// x's local block as (rows, n): n the product of the K trailing dims.
template <int K, class T, int R>
Tensor<T, 2> as_rows(const Tensor<T, R>& t) {
  std::int64_t n = 1;
  for (int d = R - K; d < R; ++d) {
    n *= t.shape()[d];
  }
  const std::int64_t rows = n == 0 ? 0 : t.numel() / n;
  return t.contiguous().template view<2>({rows, n});
}

template <class T, int R>
Tensor<T, 1> as_vector(const Tensor<T, R>& t) {
  return t.contiguous().template view<1>({t.numel()});
}

/// Row statistics of a (rows, n) tensor, repeated along the row.
template <class T>
Tensor<T, 2> row_mean(const Tensor<T, 2>& t) {
  return local::expand(local::Scale{1}, local::reduce(ReduceOp::sum, t, 1, double(t.shape()[1])), t.shape());
}

/// What the forward keeps for the backward, on (rows, n).
template <class T>
struct NormSaved {
  Tensor<T, 2> xhat; ///< layer_norm: (x - mean) rstd; rms_norm: x
  Tensor<T, 2> rstd; ///< repeated along the row
};

template <bool Rms, class T>
NormSaved<T> normalize_rows(const Tensor<T, 2>& x, double eps) {
  if constexpr (Rms) {
    const auto rstd = local::map(local::Rsqrt{eps}, row_mean(local::map(local::Square{}, x)));
    return {x, rstd};
  } else {
    const auto mean = row_mean(x);
    const auto centered = local::map(local::Sub{}, x, mean);
    const auto rstd = local::map(local::Rsqrt{eps}, row_mean(local::map(local::Square{}, centered)));
    return {local::map(local::Mul{}, centered, rstd), rstd};
  }
}

template <bool Rms, int K, class X, class W, class B>
X norm_forward(const X& x, const W& w, const B* b, double eps, NormSaved<typename X::value_type>* saved) {
  static_assert(K >= 1 && K <= X::rank && W::rank == K,
                "layer_norm / rms_norm: the weight has the K normalized dims");
  static_assert(check_norm<norm_check<K, X, W, B>()>());
  for (int d = 0; d < K; ++d) {
    DTENSOR_CHECK(w.global_shape()[d] == x.global_shape()[X::rank - K + d],
                  "layer_norm / rms_norm: the weight's shape is not the normalized dims' " +
                      shape_string(to_extents(x.global_shape())));
  }
  const auto rows = as_rows<K>(x.local());
  NormSaved<typename X::value_type> s = normalize_rows<Rms>(rows, eps);
  auto y =
      local::map(local::Mul{}, Rms ? local::map(local::Mul{}, rows, s.rstd) : s.xhat, as_vector(w.local()));
  if (b != nullptr) {
    y = local::map(local::Add{}, y, as_vector(b->local()));
  }
  if (saved != nullptr) {
    *saved = std::move(s);
  }
  return X(x.mesh(), y.template view<X::rank>(x.local().shape()), x.global_shape());
}

} // namespace detail

/// The backward of layer_norm / rms_norm: back(dy) gives {dx, dw} (rms_norm, or layer_norm without bias)
/// or {dx, dw, db}.
template <bool Rms, bool Bias, int K, class X, class W>
class NormBackward {
public:
  NormBackward(X x, W w, detail::NormSaved<typename X::value_type> saved)
      : x_(std::move(x)), w_(std::move(w)), saved_(std::move(saved)) {}

  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using T = typename X::value_type;
    using Shape = typename dtensor_traits<X>::shape_type;
    static_assert(std::is_same_v<typename G::value_type, T> && G::rank == X::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    DTENSOR_CHECK(g.global_shape() == x_.global_shape(),
                  "backward of a norm: the gradient's global shape differs from the output's");
    using Target = dtensor_from_t<T, X::rank, Shape, &GradTarget<X, G>::list>;
    using DW = dtensor_from_t<T, K, Shape, &ParamGrad<X, Target>::list>;
    const Target gt = redistribute_as<Target, G>::run(g);
    const auto gr = as_rows<K>(gt.local());
    const auto w = as_vector(w_.local());
    const auto gw = local::map(local::Mul{}, gr, w);
    const auto& xhat = saved_.xhat;
    const auto& rstd = saved_.rstd;
    Tensor<T, 2> dx;
    Tensor<T, 1> dw;
    if constexpr (Rms) {
      const auto mean_gwx = row_mean(local::map(local::Mul{}, gw, xhat));
      dx = local::map(local::RmsNormGrad{}, gw, xhat, rstd, mean_gwx);
      dw = local::sum_to_rank<1>(local::map(local::Mul{}, local::map(local::Mul{}, gr, xhat), rstd));
    } else {
      const auto mean_d = row_mean(gw);
      const auto mean_dx = row_mean(local::map(local::Mul{}, gw, xhat));
      dx = local::map(local::LayerNormGrad{}, gw, xhat, rstd, mean_d, mean_dx);
      dw = local::sum_to_rank<1>(local::map(local::Mul{}, gr, xhat));
    }
    auto dxt = as_gradient_of<X>(
        Target(x_.mesh(), dx.template view<X::rank>(x_.local().shape()), x_.global_shape()));
    DW dwt(x_.mesh(), dw.template view<K>(w_.local().shape()), w_.global_shape());
    if constexpr (Bias) {
      DW dbt(x_.mesh(), local::sum_to_rank<1>(gr).template view<K>(w_.local().shape()), w_.global_shape());
      return std::tuple{std::move(dxt), std::move(dwt), std::move(dbt)};
    } else {
      return std::pair{std::move(dxt), std::move(dwt)};
    }
  }

private:
  X x_;
  W w_;
  detail::NormSaved<typename X::value_type> saved_;
};

/// (x - mean) / sqrt(var + eps) * w + b over the K trailing dims (biased variance, as torch).
template <int K, AnyDTensor X, AnyDTensor W, AnyDTensor B>
X layer_norm(const X& x, const W& w, const B& b, double eps = 1e-5) {
  return detail::norm_forward<false, K>(x, w, &b, eps, nullptr);
}
template <int K, AnyDTensor X, AnyDTensor W, AnyDTensor B>
auto layer_norm(const X& x, const W& w, const B& b, double eps, WithBackwardTag) {
  detail::NormSaved<typename X::value_type> saved;
  X y = detail::norm_forward<false, K>(x, w, &b, eps, &saved);
  using Back = NormBackward<false, true, K, X, W>;
  return WithBackward<X, Back>{std::move(y), Back(x, w, std::move(saved))};
}
/// x / sqrt(mean(x^2) + eps) * w over the K trailing dims.
template <int K, AnyDTensor X, AnyDTensor W>
X rms_norm(const X& x, const W& w, double eps = 1e-6) {
  return detail::norm_forward<true, K>(x, w, static_cast<const W*>(nullptr), eps, nullptr);
}
template <int K, AnyDTensor X, AnyDTensor W>
auto rms_norm(const X& x, const W& w, double eps, WithBackwardTag) {
  detail::NormSaved<typename X::value_type> saved;
  X y = detail::norm_forward<true, K>(x, w, static_cast<const W*>(nullptr), eps, &saved);
  using Back = NormBackward<true, false, K, X, W>;
  return WithBackward<X, Back>{std::move(y), Back(x, w, std::move(saved))};
}

} // namespace dtensor

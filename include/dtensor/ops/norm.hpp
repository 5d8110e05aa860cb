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
//
// On the host, forward and backward are row kernels (NormRowsHost): one pass for each row statistic
// (summed in host_lanes partial sums, local/pointwise.hpp) and one that writes the row, computed in
// float (double for double); the weight's and bias's gradients are accumulated over the rows in order.
// CUDA tensors run the same formulas as elementwise maps and reductions.

#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/typed_rules.hpp"
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

/// @post true: a failed check is its own static_assert (as check_rule).
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
  return true;
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

/// `t` (rows, 1) repeated to `shape` (rows, n).
template <class T>
Tensor<T, 2> repeat_rows(const Tensor<T, 2>& t, const std::array<std::int64_t, 2>& shape) {
  return local::expand(local::Scale{1}, t, shape);
}

/// What the forward keeps for the backward, on (rows, n).
template <class T>
struct NormSaved {
  Tensor<T, 2> xhat; ///< layer_norm: (x - mean) rstd; rms_norm: x
  Tensor<T, 2> rstd; ///< (rows, 1)
};

/// The host row kernels of layer_norm (Rms = false) and rms_norm on contiguous (rows, n) tensors.
template <bool Rms, class T>
struct NormRowsHost {
  using C = local::compute_t<T>;

  /// The sum of f(k) over k < n: host_lanes partial sums combined pairwise (left to right for short rows).
  template <class F>
  static C row_sum(std::int64_t n, const F& f) {
    using local::host_lanes;
    C s = 0;
    std::int64_t k = 0;
    if (n >= 2 * host_lanes) {
      C acc[host_lanes];
      for (int j = 0; j < host_lanes; ++j) {
        acc[j] = f(j);
      }
      for (k = host_lanes; k + host_lanes <= n; k += host_lanes) {
        for (int j = 0; j < host_lanes; ++j) {
          acc[j] += f(k + j);
        }
      }
      for (int w = host_lanes / 2; w >= 1; w /= 2) {
        for (int j = 0; j < w; ++j) {
          acc[j] += acc[j + w];
        }
      }
      s = acc[0];
    } else if (n > 0) {
      s = f(0);
      k = 1;
    }
    for (; k < n; ++k) {
      s += f(k);
    }
    return s;
  }

  /// y = xhat w (+ b) with xhat and rstd (rows, 1) as the forward defines them; xhat is written for
  /// layer_norm only (rms_norm keeps x).
  static void forward(const T* x, const T* w, const T* b, T* y, T* xhat, T* rstd, std::int64_t rows,
                      std::int64_t n, double eps) {
    const C cn = static_cast<C>(n);
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      if constexpr (Rms) {
        const C ms = row_sum(n,
                             [xr](std::int64_t k) {
                               const C v = static_cast<C>(xr[k]);
                               return v * v;
                             }) /
                     cn;
        const C rs = local::Rsqrt{eps}(ms);
        rstd[r] = T(rs);
        if (b == nullptr) {
          local::host_map_row<C>(
              yr, n, [rs](C v, C g) { return v * rs * g; }, xr, w);
        } else {
          local::host_map_row<C>(
              yr, n, [rs](C v, C g, C c) { return v * rs * g + c; }, xr, w, b);
        }
      } else {
        const C mean = row_sum(n, [xr](std::int64_t k) { return static_cast<C>(xr[k]); }) / cn;
        const C var = row_sum(n,
                              [xr, mean](std::int64_t k) {
                                const C c = static_cast<C>(xr[k]) - mean;
                                return c * c;
                              }) /
                      cn;
        const C rs = local::Rsqrt{eps}(var);
        rstd[r] = T(rs);
        T* hr = xhat + r * n;
        local::host_map_row<C>(
            hr, n, [mean, rs](C v) { return (v - mean) * rs; }, xr);
        if (b == nullptr) {
          local::host_map_row<C>(
              yr, n, [](C h, C g) { return h * g; }, hr, w);
        } else {
          local::host_map_row<C>(
              yr, n, [](C h, C g, C c) { return h * g + c; }, hr, w, b);
        }
      }
    }
  }

  /// dx from the output's gradient g; dw (and db) summed over the rows in order, in C (`acc_w`, `acc_b`
  /// of n elements each).
  static void backward(const T* g, const T* w, const T* xhat, const T* rstd, T* dx, C* acc_w, C* acc_b,
                       std::int64_t rows, std::int64_t n) {
    const C cn = static_cast<C>(n);
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* gr = g + r * n;
      const T* hr = xhat + r * n;
      const C rs = static_cast<C>(rstd[r]);
      const C mean_gwx =
          row_sum(n,
                  [gr, w, hr](std::int64_t k) {
                    return static_cast<C>(gr[k]) * static_cast<C>(w[k]) * static_cast<C>(hr[k]);
                  }) /
          cn;
      if constexpr (Rms) {
        local::host_map_row<C>(
            dx + r * n, n,
            [rs, mean_gwx](C gv, C wv, C h) { return local::RmsNormGrad{}(gv * wv, h, rs, mean_gwx); }, gr, w,
            hr);
      } else {
        const C mean_d =
            row_sum(n, [gr, w](std::int64_t k) { return static_cast<C>(gr[k]) * static_cast<C>(w[k]); }) / cn;
        local::host_map_row<C>(
            dx + r * n, n,
            [rs, mean_d, mean_gwx](C gv, C wv, C h) {
              return local::LayerNormGrad{}(gv * wv, h, rs, mean_d, mean_gwx);
            },
            gr, w, hr);
      }
      // The weight's gradient: g xhat (rms_norm: g x rstd), the bias's g; row 0 starts the sums.
      accumulate(acc_w, n, r == 0, [gr, hr, rs](std::int64_t k) {
        const C v = static_cast<C>(gr[k]) * static_cast<C>(hr[k]);
        return Rms ? v * rs : v;
      });
      if (acc_b != nullptr) {
        accumulate(acc_b, n, r == 0, [gr](std::int64_t k) { return static_cast<C>(gr[k]); });
      }
    }
  }

  /// acc[k] = f(k) (first) or acc[k] + f(k), in blocks whose values are computed into a local array.
  template <class F>
  static void accumulate(C* acc, std::int64_t n, bool first, const F& f) {
    using local::host_block;
    std::int64_t k = 0;
    for (; k + host_block <= n; k += host_block) {
      C v[host_block];
      for (int j = 0; j < host_block; ++j) {
        v[j] = f(k + j);
      }
      for (int j = 0; j < host_block; ++j) {
        acc[k + j] = first ? v[j] : acc[k + j] + v[j];
      }
    }
    for (; k < n; ++k) {
      acc[k] = first ? f(k) : acc[k] + f(k);
    }
  }
};

/// The forward on (rows, n): y, and what the backward needs.
template <bool Rms, class T>
Tensor<T, 2> normalize_rows(const Tensor<T, 2>& x, const Tensor<T, 1>& w, const Tensor<T, 1>* b, double eps,
                            NormSaved<T>& s) {
  const std::int64_t rows = x.shape()[0];
  const std::int64_t n = x.shape()[1];
  if (!x.device().is_cuda()) { // the host's (meta: its tensors, no kernel)
    const Tensor<T, 2> xc = x.contiguous();
    const Tensor<T, 1> wc = w.contiguous();
    const Tensor<T, 1> bc = b != nullptr ? b->contiguous() : Tensor<T, 1>();
    Tensor<T, 2> y = empty_like(x.shape(), x);
    s.rstd = empty_like(std::array<std::int64_t, 2>{rows, 1}, x);
    s.xhat = Rms ? xc : empty_like(x.shape(), x);
    if (x.device().is_meta()) {
      return y;
    }
    NormRowsHost<Rms, T>::forward(xc.data(), wc.data(), b != nullptr ? bc.data() : nullptr, y.data(),
                                  s.xhat.data(), s.rstd.data(), rows, n, eps);
    return y;
  }
  Tensor<T, 2> y;
  if constexpr (Rms) {
    s.rstd = local::map(local::Rsqrt{eps},
                        local::reduce(ReduceOp::sum, local::map(local::Square{}, x), 1, double(n)));
    s.xhat = x;
    y = local::map(local::Mul{}, local::map(local::Mul{}, x, repeat_rows(s.rstd, x.shape())), w);
  } else {
    const auto centered = local::map(local::Sub{}, x, row_mean(x));
    s.rstd = local::map(local::Rsqrt{eps},
                        local::reduce(ReduceOp::sum, local::map(local::Square{}, centered), 1, double(n)));
    s.xhat = local::map(local::Mul{}, centered, repeat_rows(s.rstd, x.shape()));
    y = local::map(local::Mul{}, s.xhat, w);
  }
  return b != nullptr ? local::map(local::Add{}, y, *b) : y;
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
  NormSaved<typename X::value_type> s;
  const Tensor<typename X::value_type, 1> bias =
      b != nullptr ? as_vector(b->local()) : Tensor<typename X::value_type, 1>();
  auto y = normalize_rows<Rms>(rows, as_vector(w.local()), b != nullptr ? &bias : nullptr, eps, s);
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
    const auto& xhat = saved_.xhat;
    Tensor<T, 2> dx;
    Tensor<T, 1> dw, db;
    if (!gr.device().is_cuda()) { // the host's (meta: its tensors, no kernel)
      using C = local::compute_t<T>;
      const bool meta = gr.device().is_meta();
      const std::int64_t rows = gr.shape()[0];
      const std::int64_t n = gr.shape()[1];
      const Tensor<T, 1> wc = w.contiguous();
      dx = empty_like(gr.shape(), gr);
      std::vector<C> acc(static_cast<std::size_t>(Bias ? 2 * n : n), C(0));
      if (!meta) {
        NormRowsHost<Rms, T>::backward(gr.data(), wc.data(), xhat.data(), saved_.rstd.data(), dx.data(),
                                       acc.data(), Bias ? acc.data() + n : nullptr, rows, n);
      }
      dw = Tensor<T, 1>({n}, gr.device());
      for (std::int64_t k = 0; k < n && !meta; ++k) {
        dw.data()[k] = T(acc[static_cast<std::size_t>(k)]);
      }
      if constexpr (Bias) {
        db = Tensor<T, 1>({n}, gr.device());
        for (std::int64_t k = 0; k < n && !meta; ++k) {
          db.data()[k] = T(acc[static_cast<std::size_t>(n + k)]);
        }
      }
    } else if constexpr (Rms) {
      const auto gw = local::map(local::Mul{}, gr, w);
      const auto rstd = repeat_rows(saved_.rstd, gr.shape());
      const auto mean_gwx = row_mean(local::map(local::Mul{}, gw, xhat));
      dx = local::map(local::RmsNormGrad{}, gw, xhat, rstd, mean_gwx);
      dw = local::sum_to_rank<1>(local::map(local::Mul{}, local::map(local::Mul{}, gr, xhat), rstd));
    } else {
      const auto gw = local::map(local::Mul{}, gr, w);
      const auto rstd = repeat_rows(saved_.rstd, gr.shape());
      const auto mean_d = row_mean(gw);
      const auto mean_dx = row_mean(local::map(local::Mul{}, gw, xhat));
      dx = local::map(local::LayerNormGrad{}, gw, xhat, rstd, mean_d, mean_dx);
      dw = local::sum_to_rank<1>(local::map(local::Mul{}, gr, xhat));
      if constexpr (Bias) {
        db = local::sum_to_rank<1>(gr);
      }
    }
    auto dxt = as_gradient_of<X>(
        Target(x_.mesh(), dx.template view<X::rank>(x_.local().shape()), x_.global_shape()));
    DW dwt(x_.mesh(), dw.template view<K>(w_.local().shape()), w_.global_shape());
    if constexpr (Bias) {
      DW dbt(x_.mesh(), db.template view<K>(w_.local().shape()), w_.global_shape());
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

#pragma once
// Cross-entropy on logits sharded on the vocab dim (torch's loss_parallel), forward and backward:
//
//   auto loss = cross_entropy(logits, target);     // logits [S(1)] (tokens, vocab), target [R] (tokens)
//   auto [l, back] = cross_entropy(logits, target, with_backward);
//   auto dlogits = back(1.0);                      // [S(1)], like the logits
//   auto l3 = cross_entropy(logits3, target2);     // (batch, seq, vocab) [S(0),S(1),S(2)], target (batch,
//                                                  // seq) [S(0),S(1),R]: data, context, tensor parallel
//
// The logits are (rows..., vocab): one or more leading dims of rows (a batch, a sequence) and the vocab
// last; the target has the leading dims. No gather of the logits: the row max is completed by an
// all_reduce(max) over the mesh axes that shard the vocab, then the sum of exponentials and the target's
// logit (picked on the rank that owns its column, zero elsewhere) together by one all_reduce(sum) of two
// values per row; the mean over the rows by one all_reduce of two values over the axes that shard a leading
// dim (data or context parallel). Logits may be Shard<d> (any dim) or Replicate on each axis, never
// Partial; the target is placed like the logits' rows (Shard<d> where they shard leading dim d, Replicate
// elsewhere). Rows whose target is ignore_index (-100, as torch) count neither in the sum nor in the mean.
// The loss is a rank-0 DTensor, Replicate. The backward gives (softmax(x) - onehot(target)) * g / count,
// placed like the logits, with no communication (the forward keeps the row statistics).
//
// mse_loss(y, target): the mean of (y - target)^2 over every element of the global tensors (torch's
// mse_loss, reduction 'mean'), y and target of one DTensor type (any placements but Partial): each rank sums
// the squares of its block in double, one all_reduce of one value over the axes that shard y completes the
// sum. The backward gives 2 (y - target) g / numel, placed like y, with no communication.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

inline constexpr std::int64_t ignore_index = -100;

namespace local {

/// Row r of a (rows, width) block: the target's logit if its column [begin, begin + width) holds it,
/// else 0; written to stats[r * 2 + 1] next to the sum of exp(x - m) in stats[r * 2] (on the host
/// summed in host_lanes partial sums, see local/pointwise.hpp).
template <class T, class I>
struct CrossEntropyRows {
  struct {
    std::int64_t count;
  } layout;
  T* stats;
  const T* x;
  const T* m;
  const I* target;
  std::int64_t width;
  std::int64_t begin;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t r) const {
    using C = compute_t<T>;
    const C mr = static_cast<C>(m[r]);
    const T* xr = x + r * width;
    C s = 0;
    std::int64_t k = 0;
#if !defined(__CUDA_ARCH__)
    if (!DTENSOR_ON_DEVICE && width >= 2 * host_lanes) {
      C acc[host_lanes] = {};
      for (; k + host_lanes <= width; k += host_lanes) {
        for (int j = 0; j < host_lanes; ++j) {
          acc[j] += math::exp(static_cast<C>(xr[k + j]) - mr);
        }
      }
      for (int w = host_lanes / 2; w >= 1; w /= 2) {
        for (int j = 0; j < w; ++j) {
          acc[j] += acc[j + w];
        }
      }
      s = acc[0];
    }
#endif
    for (; k < width; ++k) {
      s += math::exp(static_cast<C>(xr[k]) - mr);
    }
    const std::int64_t c = static_cast<std::int64_t>(target[r]) - begin;
    stats[r * 2] = T(s);
    stats[r * 2 + 1] = c >= 0 && c < width ? xr[c] : T(0);
  }
};

/// dx = (exp(x - m) / s - [column is the target]) * scale, zero on ignored rows. Index i is row i when
/// `per_row` (the host: a row at a time, in blocks), else element i (a GPU thread per element).
template <class T, class I>
struct CrossEntropyGrad {
  struct {
    std::int64_t count;
  } layout;
  T* dx;
  const T* x;
  const T* m;
  const T* stats; ///< completed: the sum of exponentials at 2 r
  const I* target;
  std::int64_t width;
  std::int64_t begin;
  double scale;
  bool per_row;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    if (per_row) {
      row(i);
    } else {
      element(i);
    }
  }

  DTENSOR_HOST_DEVICE void element(std::int64_t i) const {
    using C = compute_t<T>;
    const std::int64_t r = i / width;
    const std::int64_t k = i % width;
    const auto t = static_cast<std::int64_t>(target[r]);
    if (t == -100) {
      dx[i] = T(0);
      return;
    }
    const C p = math::exp(static_cast<C>(x[i]) - static_cast<C>(m[r])) / static_cast<C>(stats[r * 2]);
    dx[i] = T((p - (t - begin == k ? C(1) : C(0))) * C(scale));
  }

  DTENSOR_HOST_DEVICE void row(std::int64_t r) const {
    if (DTENSOR_ON_DEVICE) {
      (void)r; // CUDA launches an index per element: device code has no row form
      return;
    }
#if !defined(__CUDA_ARCH__)
    using C = compute_t<T>;
    T* d = dx + r * width;
    const T* xr = x + r * width;
    const auto t = static_cast<std::int64_t>(target[r]);
    if (t == -100) {
      for (std::int64_t k = 0; k < width; ++k) {
        d[k] = T(0);
      }
      return;
    }
    const C mr = static_cast<C>(m[r]);
    const C s = static_cast<C>(stats[r * 2]);
    const C sc = C(scale);
    // p - 0 is p: every column as a non-target one, then the target's column again.
    host_map_row<C>(
        d, width, [mr, s, sc](C v) { return (math::exp(v - mr) / s) * sc; }, xr);
    const std::int64_t c = t - begin;
    if (c >= 0 && c < width) {
      const C p = math::exp(static_cast<C>(xr[c]) - mr) / s;
      d[c] = T((p - C(1)) * sc);
    }
#endif
  }
};

} // namespace local

namespace detail {

enum class LossError : std::uint8_t { none, partial_logits, target_placement, types };

template <class X, class Target>
constexpr LossError loss_check() {
  if (X::rank < 2 || Target::rank != X::rank - 1) {
    return LossError::types;
  }
  for (int a = 0; a < X::placements.size(); ++a) {
    const Placement x = normalize(X::placements[a], X::rank);
    if (x.is_partial()) {
      return LossError::partial_logits;
    }
    const Placement want = x.is_shard() && x.dim < X::rank - 1 ? x : Placement::replicate();
    if (!(normalize(Target::placements[a], Target::rank) == want)) {
      return LossError::target_placement;
    }
  }
  return LossError::none;
}

/// @post true: a failed check is its own static_assert (as check_rule).
template <LossError E>
consteval bool check_loss() {
  static_assert(E != LossError::types,
                "cross_entropy: logits (rows..., vocab) and an integer target (rows...): one dim fewer");
  static_assert(E != LossError::partial_logits,
                "cross_entropy: Partial logits (the loss is not linear in them): redistribute<Replicate> or "
                "reduce_scatter them to Shard<vocab dim> first");
  static_assert(E != LossError::target_placement,
                "cross_entropy: the target must be placed like the logits' rows: Shard<d> on the axes where "
                "the logits shard leading dim d, Replicate on the others");
  return true;
}

/// Placements of per-row statistics (rows..., 1 or 2): the logits' Shard of a leading dim where they shard
/// one; Partial<Op> where they shard the vocab (before completing) or Replicate (after); Replicate elsewhere.
template <class X, bool Done, ReduceOp Op>
struct LossRows {
  static constexpr PlacementList list() {
    PlacementList l;
    for (Placement p : X::placements) {
      p = normalize(p, X::rank);
      l.push_back(
          p == Placement::shard(X::rank - 1) ? (Done ? Placement::replicate() : Placement::partial(Op)) : p);
    }
    return l;
  }
};
/// Placements of the loss's (sum, count): Partial<sum> where the logits shard a leading dim, else Replicate.
template <class X, bool Done>
struct LossTotal {
  static constexpr PlacementList list() {
    PlacementList l;
    for (Placement p : X::placements) {
      p = normalize(p, X::rank);
      l.push_back(!Done && p.is_shard() && p.dim < X::rank - 1 ? Placement::partial(ReduceOp::sum)
                                                               : Placement::replicate());
    }
    return l;
  }
};

/// `shape` with its last extent replaced by `last`.
template <std::size_t R>
std::array<std::int64_t, R> with_last(std::array<std::int64_t, R> shape, std::int64_t last) {
  shape[R - 1] = last;
  return shape;
}
template <class X>
struct LossReplicate {
  static constexpr PlacementList list() {
    return PlacementList(X::placements.size(), Placement::replicate());
  }
};

/// What the backward needs: the row max, the completed row statistics, the count of counted rows.
template <class T, class I>
struct LossSaved {
  Tensor<T, 1> m;
  Tensor<T, 2> stats;
  Tensor<I, 1> target;
  std::int64_t begin = 0;
  double count = 0;
};

template <class X, class Target>
using loss_t = dtensor_from_t<typename X::value_type, 0, typename dtensor_traits<X>::shape_type,
                              &LossReplicate<X>::list>;

template <class X, class Target>
loss_t<X, Target>
cross_entropy_forward(const X& x, const Target& target,
                      LossSaved<typename X::value_type, typename Target::value_type>* saved) {
  static_assert(std::is_same_v<typename Target::value_type, std::int32_t> ||
                    std::is_same_v<typename Target::value_type, std::int64_t>,
                "cross_entropy: the target is a DTensor of int32 or int64 class indices");
  static_assert(check_loss<loss_check<X, Target>()>());
  using T = typename X::value_type;
  using I = typename Target::value_type;
  using Shape = typename dtensor_traits<X>::shape_type;
  constexpr int R = X::rank;
  const auto& mesh = x.mesh();
  const auto global = x.global_shape();
  const std::int64_t vocab = global[R - 1];
  bool rows_match = true;
  for (int d = 0; d + 1 < R; ++d) {
    rows_match = rows_match && target.global_shape()[d] == global[d];
  }
  DTENSOR_CHECK(rows_match, "cross_entropy: logits of global shape " + shape_string(to_extents(global)) +
                                " and a target of " + shape_string(to_extents(target.global_shape())) +
                                ": the target's shape is the logits' without the last (vocab) dim");
  const Block held = spec_block(to_extents(global), X::spec, mesh.sizes(), mesh.coordinate());
  const auto xr = x.local().contiguous();
  const auto tl = target.local().contiguous();
  const std::int64_t width = xr.shape()[R - 1];
  const std::int64_t n = width > 0 ? xr.numel() / width : tl.numel();
  const auto xl = xr.template view<2>({n, width}); // the rows this rank holds, one after another
  if (tl.device().is_cpu()) {
    for (std::int64_t r = 0; r < n; ++r) {
      const auto t = static_cast<std::int64_t>(tl.data()[r]);
      if (t == ignore_index || (t >= 0 && t < vocab)) {
        continue;
      }
      std::string at; // the row's global index
      std::int64_t rest = r;
      for (int d = R - 2; d >= 0; --d) {
        const std::int64_t e = std::max<std::int64_t>(xr.shape()[d], 1);
        at = std::to_string(held.offset[d] + rest % e) + (at.empty() ? "" : ", " + at);
        rest /= e;
      }
      throw Error("cross_entropy: target " + std::to_string(t) + " of row (" + at + ") is outside [0, " +
                  std::to_string(vocab) + ") and not ignore_index (-100)");
    }
  }
  // 1. The row max over the whole vocab.
  using MaxPart = dtensor_from_t<T, R, Shape, &LossRows<X, false, ReduceOp::max>::list>;
  using MaxDone = dtensor_from_t<T, R, Shape, &LossRows<X, true, ReduceOp::max>::list>;
  const Tensor<T, 2> m_local = local::reduce(ReduceOp::max, xl, 1);
  const Tensor<T, 2> m =
      redistribute_as<MaxDone, MaxPart>::run(
          MaxPart(mesh, m_local.template view<R>(with_last(xr.shape(), 1)), with_last(global, 1)))
          .local()
          .contiguous()
          .template view<2>({n, 1});
  // 2. The sum of exponentials and the target's logit, completed together.
  using SumPart = dtensor_from_t<T, R, Shape, &LossRows<X, false, ReduceOp::sum>::list>;
  using SumDone = dtensor_from_t<T, R, Shape, &LossRows<X, true, ReduceOp::sum>::list>;
  Tensor<T, 2> stats_local = empty_like(std::array<std::int64_t, 2>{n, 2}, xl);
  local::CrossEntropyRows<T, I> rows_run{{n},   stats_local.data(), xl.data(), m.data(), tl.data(),
                                         width, held.offset[R - 1]};
  local::launch(rows_run, xl.device(), xl.stream_handle(), "cross_entropy");
  const Tensor<T, 2> stats =
      redistribute_as<SumDone, SumPart>::run(
          SumPart(mesh, stats_local.template view<R>(with_last(xr.shape(), 2)), with_last(global, 2)))
          .local()
          .contiguous()
          .template view<2>({n, 2});
  // 3. The rows' losses summed with their count, over the rows this rank holds, completed over the axes
  //    that shard the rows. Small: on the host. Meta logits: the same tensors, meta, and a NaN loss.
  const bool meta = xl.device().is_meta();
  const Device host = meta ? Device::meta() : Device::cpu();
  const ::dtensor::detail::HostSyncScope reads("cross_entropy: the rows' maxima, sums and targets");
  const auto ms = m.to(host);
  const auto ss = stats.to(host);
  const auto ts = tl.to(host);
  double total = 0;
  double count = 0;
  for (std::int64_t r = 0; r < n && !meta; ++r) {
    if (static_cast<std::int64_t>(ts.data()[r]) == ignore_index) {
      continue;
    }
    total += std::log(double(ss.data()[r * 2])) + double(ms.data()[r]) - double(ss.data()[r * 2 + 1]);
    count += 1;
  }
  using TotalPart = dtensor_from_t<double, 1, Shape, &LossTotal<X, false>::list>;
  using TotalDone = dtensor_from_t<double, 1, Shape, &LossTotal<X, true>::list>;
  Tensor<double, 1> pair({2}, host);
  if (!meta) {
    pair.data()[0] = total;
    pair.data()[1] = count;
  }
  // Reduced on the logits' device (NCCL reduces device memory only), read back on the host.
  const Tensor<double, 1> pair_on = xl.device().is_cuda() ? pair.to(xl.device()) : pair;
  const auto sums_on = redistribute_as<TotalDone, TotalPart>::run(TotalPart(mesh, pair_on, {2})).local();
  const ::dtensor::detail::HostSyncScope read_sums("cross_entropy: the loss's sum and count");
  const Tensor<double, 1> sums = sums_on.device().is_cuda() ? sums_on.to(Device::cpu()) : sums_on;
  total = meta ? std::nan("") : sums.data()[0];
  count = meta ? 0 : sums.data()[1];
  Tensor<T, 0> loss(std::array<std::int64_t, 0>{});
  loss.data()[0] = T(count > 0 ? total / count : std::nan(""));
  if (saved != nullptr) {
    *saved = {m.template view<1>({n}), stats, tl.template view<1>({n}), held.offset[R - 1], count};
  }
  return loss_t<X, Target>(mesh, loss.to(xl.device()), std::array<std::int64_t, 0>{});
}

} // namespace detail

/// The backward of cross_entropy: the logits' gradient for a loss gradient g (a number, or a rank-0
/// DTensor), placed like the logits.
template <class X, class Target>
class CrossEntropyBackward {
  using T = typename X::value_type;
  using I = typename Target::value_type;

public:
  CrossEntropyBackward(X x, detail::LossSaved<T, I> saved) : x_(std::move(x)), saved_(std::move(saved)) {}

  X operator()(double g = 1.0) const {
    const auto xr = x_.local().contiguous();
    const std::int64_t width = xr.shape()[X::rank - 1];
    const auto xl = xr.template view<2>({width > 0 ? xr.numel() / width : saved_.target.numel(), width});
    Tensor<T, 2> dx = detail::empty_like(xl.shape(), xl);
    const double scale = saved_.count > 0 ? g / saved_.count : 0.0;
    const bool per_row = xl.device().is_cpu();
    local::CrossEntropyGrad<T, I> run{{per_row ? xl.shape()[0] : xl.numel()},
                                      dx.data(),
                                      xl.data(),
                                      saved_.m.data(),
                                      saved_.stats.data(),
                                      saved_.target.data(),
                                      xl.shape()[1],
                                      saved_.begin,
                                      scale,
                                      per_row};
    local::launch(run, xl.device(), xl.stream_handle(), "cross_entropy backward");
    return X(x_.mesh(), dx.template view<X::rank>(xr.shape()), x_.global_shape());
  }
  template <AnyDTensor G>
  requires(G::rank == 0) X operator()(const G& g) const {
    const auto full = g.full_tensor().to(Device::cpu());
    return (*this)(double(full.data()[0]));
  }

private:
  X x_;
  detail::LossSaved<T, I> saved_;
};

/// The mean cross-entropy of `logits` (rows..., vocab) against class indices `target` (see the top of this
/// file); a rank-0 Replicate DTensor.
template <AnyDTensor X, AnyDTensor Target>
auto cross_entropy(const X& logits, const Target& target) {
  return detail::cross_entropy_forward(logits, target, nullptr);
}
template <AnyDTensor X, AnyDTensor Target>
auto cross_entropy(const X& logits, const Target& target, WithBackwardTag) {
  detail::LossSaved<typename X::value_type, typename Target::value_type> saved;
  auto loss = detail::cross_entropy_forward(logits, target, &saved);
  using Back = CrossEntropyBackward<X, Target>;
  return WithBackward<decltype(loss), Back>{std::move(loss), Back(logits, std::move(saved))};
}

namespace detail {

/// Placements of mse_loss's sum: Partial<sum> over the axes that shard y (any dim), Replicate elsewhere.
template <class X, bool Done>
struct MseTotal {
  static constexpr PlacementList list() {
    PlacementList l;
    for (Placement p : X::placements) {
      l.push_back(!Done && normalize(p, X::rank).is_shard() ? Placement::partial(ReduceOp::sum)
                                                            : Placement::replicate());
    }
    return l;
  }
};

template <class X>
consteval bool check_mse() {
  constexpr bool partial = [] {
    for (Placement p : X::placements) {
      if (p.is_partial()) {
        return true;
      }
    }
    return false;
  }();
  static_assert(!partial, "mse_loss: Partial y (the loss is not linear in it): redistribute<Replicate> or "
                          "reduce_scatter it first");
  return true;
}

} // namespace detail

/// The backward of mse_loss: y's gradient 2 (y - target) g / numel for a loss gradient g (a number, or a
/// rank-0 DTensor), placed like y.
template <class X>
class MseBackward {
public:
  MseBackward(X diff, double numel) : diff_(std::move(diff)), numel_(numel) {}

  X operator()(double g = 1.0) const { return scale(diff_, numel_ > 0 ? 2.0 * g / numel_ : 0.0); }
  template <AnyDTensor G>
  requires(G::rank == 0) X operator()(const G& g) const {
    const auto full = g.full_tensor().to(Device::cpu());
    return (*this)(double(full.data()[0]));
  }

private:
  X diff_;
  double numel_;
};

namespace detail {

/// The loss, y - target and the global element count.
template <class X>
auto mse_forward(const X& y, const X& target) {
  static_assert(check_mse<X>());
  using T = typename X::value_type;
  using Shape = typename dtensor_traits<X>::shape_type;
  DTENSOR_CHECK(y.global_shape() == target.global_shape(),
                "mse_loss: y of global shape " + shape_string(to_extents(y.global_shape())) +
                    " and a target of " + shape_string(to_extents(target.global_shape())) +
                    ": the two must have one shape");
  const auto d = sub(y, target);
  const auto dl = d.local().contiguous();
  const bool meta = dl.device().is_meta();
  const Device host = meta ? Device::meta() : Device::cpu();
  double total = 0;
  {
    const ::dtensor::detail::HostSyncScope reads("mse_loss: the differences");
    const auto dh = dl.to(host);
    for (std::int64_t i = 0; i < dh.numel() && !meta; ++i) {
      total += double(dh.data()[i]) * double(dh.data()[i]);
    }
  }
  double numel = 1;
  for (const auto e : y.global_shape()) {
    numel *= double(e);
  }
  using TotalPart = dtensor_from_t<double, 1, Shape, &MseTotal<X, false>::list>;
  using TotalDone = dtensor_from_t<double, 1, Shape, &MseTotal<X, true>::list>;
  Tensor<double, 1> one({1}, host);
  if (!meta) {
    one.data()[0] = total;
  }
  const Tensor<double, 1> one_on = dl.device().is_cuda() ? one.to(dl.device()) : one;
  const auto sum_on = redistribute_as<TotalDone, TotalPart>::run(TotalPart(y.mesh(), one_on, {1})).local();
  const ::dtensor::detail::HostSyncScope read_sum("mse_loss: the loss's sum");
  const Tensor<double, 1> sum = sum_on.device().is_cuda() ? sum_on.to(Device::cpu()) : sum_on;
  Tensor<T, 0> loss(std::array<std::int64_t, 0>{});
  loss.data()[0] = T(meta ? std::nan("") : (numel > 0 ? sum.data()[0] / numel : std::nan("")));
  return std::tuple{dtensor_from_t<T, 0, Shape, &LossReplicate<X>::list>(y.mesh(), loss.to(dl.device()),
                                                                         std::array<std::int64_t, 0>{}),
                    d, numel};
}

} // namespace detail

/// The mean squared error of y against target (see the top of this file); a rank-0 Replicate DTensor.
template <AnyDTensor X>
auto mse_loss(const X& y, const X& target) {
  return std::get<0>(detail::mse_forward(y, target));
}
template <AnyDTensor X>
auto mse_loss(const X& y, const X& target, WithBackwardTag) {
  auto [loss, diff, numel] = detail::mse_forward(y, target);
  using Back = MseBackward<decltype(diff)>;
  return WithBackward<decltype(loss), Back>{std::move(loss), Back(std::move(diff), numel)};
}

} // namespace dtensor

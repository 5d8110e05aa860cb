#pragma once
// Gradient clipping by the global norm over sharded gradients, torch.nn.utils.clip_grad_norm_'s semantics:
//
//   double norm = clip_grad_norm(1.0, dw1, dw2, db);          // the 2-norm of all of them together
//   double top = clip_grad_norm(1.0, inf_norm, dw1, dw2, db); // the largest |element|
//   double n = total_norm(l2_norm, dw1, dw2);                 // the norm only (no scaling)
//
// The gradients are DTensors of one mesh with any Shard / Replicate placements (a Partial gradient does not
// compile: reduce it first). The norm counts every element of every global gradient once: each rank sums
// |x|^p over its shard (in double), and a gradient's sum is taken on the ranks at coordinate 0 of each
// axis where that gradient is Replicate but some gradient of the call is Shard; the others contribute 0,
// so replicas are not double counted. One all_reduce of one double (sum; max for the inf norm) over the
// group of the axes where any gradient is Shard completes every gradient's sum at once, whatever mix of
// placements they have (no all_reduce when every gradient is replicated): every rank gets the same total.
// Then clip_coef = max_norm / (norm + 1e-6), clamped to 1; below 1 every gradient's shard is scaled by it in
// place (torch multiplies by the clamped coefficient, 1, also when it does not clip: the same values). A
// NaN or infinite norm scales by NaN or 0 as torch does (no error_if_nonfinite).
// Meta gradients (core/device.hpp: a dry run) have no norm: NaN, after the same collective.
//
// The sums run as a local kernel on the library's launcher: one partial sum per tile (a whole run on the
// host, a block of elements per thread on CUDA), added on the host; the one double the ranks all_reduce is
// on the gradients' device (host or CUDA: gloo, MPI or NCCL). `local_norm_sum(x)` is that per-shard sum for
// a plain local tensor, whose caller completes the sum over the ranks itself.
//
// FSDP's flat groups are gradient holders (the GradientHolder concept): `clip_grad_norm(1.0, emb, blocks...,
// head)` takes FlatParamGroups, mixed with DTensors of the same mesh. A group's gradient shard holds pieces
// of its parameters; a piece counts on the ranks at coordinate 0 of each axis of the call's group where its
// parameter is not Shard (the FSDP shard axis excepted: its ranks hold disjoint pieces), and clipping scales
// the gradient shard in place.

#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <ranges>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/nest.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

/// The p of a p-norm: 2 by default, `inf_norm` for the largest absolute value.
struct NormType {
  double p = 2;
  constexpr bool is_inf() const noexcept { return p == std::numeric_limits<double>::infinity(); }
};
inline constexpr NormType l2_norm{2};
inline constexpr NormType inf_norm{std::numeric_limits<double>::infinity()};

namespace detail {

template <class G>
consteval bool check_clip_grad() {
  using GT = dtensor_traits<G>;
  using T = typename GT::value_type;
  static_assert(std::is_floating_point_v<T> || is_reduced_float_v<T>,
                "clip_grad_norm: gradients must have a floating element type");
  constexpr bool partial = [] {
    for (const Placement& p : GT::placements) {
      if (p.is_partial()) {
        return true;
      }
    }
    return false;
  }();
  static_assert(!partial, "clip_grad_norm: a gradient is Partial on a mesh axis (a sum still pending over "
                          "ranks): reduce it first (redistribute<...>() to Shard/Replicate)");
  return true;
}

/// The axes where placements `l` shard a dim.
constexpr AxisMask shard_axes(const PlacementList& l) {
  AxisMask m = 0;
  for (int a = 0; a < l.size(); ++a) {
    if (l[a].is_shard()) {
      m |= axis_bit(a);
    }
  }
  return m;
}

inline namespace DTENSOR_LOCAL_OPS_NS {

/// Index i writes to out[i] tile i's sum of |x|^p (p = 2: x * x; p = 1: |x|), or its largest |x| (inf).
template <class T>
struct NormRuns {
  local::RunLayout<1, 1> layout;
  const T* in;
  double* out;
  double p;
  bool inf;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const local::Tile<1> t = layout.locate(i);
    double acc = 0;
    for (std::int64_t r = 0; r < t.rows; ++r) {
      const T* x = in + t.offset[0] + r * t.row_stride[0];
      for (std::int64_t k = 0; k < t.n; ++k) {
        const double v = std::fabs(static_cast<double>(static_cast<local::compute_t<T>>(x[k])));
        if (inf) {
          acc = v > acc || v != v ? v : acc; // NaN propagates
        } else if (p == 2) {
          acc += v * v;
        } else if (p == 1) {
          acc += v;
        } else {
          acc += std::pow(v, p);
        }
      }
    }
    out[i] = acc;
  }
};

/// Elements per CUDA thread in a norm's partial sums.
inline constexpr std::int64_t norm_cuda_width = 4096;

/// This rank's sum of |x|^p (or max |x|) over the contiguous tensor `x`.
template <class T, int R>
double local_norm_sum(const Tensor<T, R>& x, NormType type) {
  const std::int64_t n = x.numel();
  if (n == 0) {
    return 0;
  }
  const bool host = x.device().is_cpu();
  const Tensor<T, R> c = x.contiguous();
  NormRuns<T> run{local::make_run_layout<1, 1>(
                      {n}, {{{1}}}, host ? local::host_tile : local::TileShape{1, norm_cuda_width}),
                  c.data(), nullptr, type.p, type.is_inf()};
#if DTENSOR_HAS_CUDA
  Tensor<double, 1> partial({run.layout.count}, c.device(), c.stream());
#else
  Tensor<double, 1> partial({run.layout.count}, c.device());
#endif
  run.out = partial.data();
  local::launch(run, c.device(), c.stream_handle(), "clip_grad_norm");
  if (c.device().is_meta()) { // no values: no norm
    return std::nan("");
  }
  const ::dtensor::detail::HostSyncScope read("clip_grad_norm: a gradient's local norm");
  const Tensor<double, 1> sums = host ? partial : partial.to(Device::cpu());
  double acc = 0;
  for (std::int64_t i = 0; i < sums.numel(); ++i) { // one value per tile
    const double v = sums.data()[i];
    acc = type.is_inf() ? (v > acc || v != v ? v : acc) : acc + v;
  }
  return acc;
}

} // namespace DTENSOR_LOCAL_OPS_NS

} // namespace detail

// In the launcher's namespace: its body calls a kernel that differs between nvcc and host TUs.
inline namespace DTENSOR_LOCAL_OPS_NS {

/// This rank's sum of |x|^p over the local tensor `x` (the largest |x| for inf_norm), accumulated in double
/// on x's device: what total_norm adds up for one gradient shard. No communication.
template <class T, int R>
double local_norm_sum(const Tensor<T, R>& x, NormType type = l2_norm) {
  static_assert(std::is_floating_point_v<T> || detail::is_reduced_float_v<T>,
                "local_norm_sum: the element type must be floating");
  DTENSOR_CHECK(type.p > 0, "local_norm_sum: norm_type must be positive, not " + std::to_string(type.p));
  return detail::local_norm_sum(x, type);
}

} // namespace DTENSOR_LOCAL_OPS_NS

/// A holder of gradient shards that the norm functions take besides DTensors (FlatParamGroup,
/// train/fsdp.hpp): the mesh axes where its ranks' shards differ, this rank's share of the sum over
/// `group_axes` (each element counted once over the mesh), and scaling in place.
template <class H>
concept GradientHolder = requires(const H& h, NormType type, AxisMask axes, double coef) {
  { H::grad_norm_axes() } -> std::same_as<AxisMask>;
  { h.local_grad_norm_sum(type, axes) } -> std::same_as<double>;
  h.scale_grad(coef);
  h.local_grad();
  h.mesh();
};

namespace detail {

/// Two partial results of a norm: their sum, or their max for the inf norm (a NaN propagates).
inline double combine_norm(NormType type, double acc, double s) {
  return type.is_inf() ? (s > acc || s != s ? s : acc) : acc + s;
}

} // namespace detail

/// One gradient: a DTensor or a gradient holder.
template <class G>
concept GradientTensorOrHolder = AnyDTensor<G> || GradientHolder<std::remove_cvref_t<G>>;

namespace detail {

template <class G>
struct is_tuple : std::false_type {};
template <class... E>
struct is_tuple<std::tuple<E...>> : std::true_type {};

/// Whether G is a gradient source: a gradient, or a tuple or range of sources (nested as deep as wanted).
template <class G>
constexpr bool is_gradient_source() {
  if constexpr (GradientTensorOrHolder<G>) {
    return true;
  } else if constexpr (is_tuple<G>::value) {
    return []<class... E>(std::type_identity<std::tuple<E...>>) {
      return (is_gradient_source<std::remove_cvref_t<E>>() && ...);
    }(std::type_identity<G>{});
  } else if constexpr (std::ranges::input_range<const G>) {
    return is_gradient_source<std::remove_cvref_t<std::ranges::range_value_t<const G>>>();
  } else {
    return false;
  }
}

} // namespace detail

/// What total_norm and clip_grad_norm take: gradient DTensors, gradient holders, and tuples and ranges of
/// them, nested and mixed (a std::vector of the blocks' groups; a layer's tuple of gradients; a std::vector
/// of the blocks' tuples).
template <class G>
concept GradientSource = detail::is_gradient_source<std::remove_cvref_t<G>>();

namespace detail {

/// Whether this rank contributes gradient G's sum: it sits at coordinate 0 of every axis in `group_axes`
/// where G is not sharded.
template <class G>
bool counts_here(const G& g, AxisMask group_axes) {
  for (int a = 0; a < G::placements.size(); ++a) {
    if ((group_axes & axis_bit(a)) && !G::placements[a].is_shard() && g.mesh().coordinate()[a] != 0) {
      return false;
    }
  }
  return true;
}

/// The first gradient type of a source (for the mesh check).
template <class G>
struct gradient_of {
  using type = G;
};
template <class E0, class... E>
struct gradient_of<std::tuple<E0, E...>> {
  using type = typename gradient_of<std::remove_cvref_t<E0>>::type;
};
template <class G>
requires(!GradientTensorOrHolder<G> && !is_tuple<G>::value) struct gradient_of<G> {
  using type = typename gradient_of<std::remove_cvref_t<std::ranges::range_value_t<const G>>>::type;
};
template <class G>
using gradient_of_t = typename gradient_of<G>::type;

template <class G>
struct is_gradient_leaf : std::bool_constant<GradientTensorOrHolder<G>> {};

/// f(gradient) for every gradient of the source, in order.
template <class G, class F>
void for_each_gradient(const G& g, F&& f) {
  for_each_leaf<is_gradient_leaf>(g, f);
}

/// The axes where a gradient's shards differ, this rank's share of its sum, its device, scaling.
template <class G>
constexpr AxisMask norm_axes() {
  if constexpr (AnyDTensor<G>) {
    static_assert(check_clip_grad<G>());
    return shard_axes(G::placements);
  } else {
    return G::grad_norm_axes();
  }
}
/// The axes where the shards of any gradient of source G differ.
template <class G>
constexpr AxisMask source_norm_axes() {
  if constexpr (GradientTensorOrHolder<G>) {
    return norm_axes<G>();
  } else if constexpr (is_tuple<G>::value) {
    return []<class... E>(std::type_identity<std::tuple<E...>>) {
      return (AxisMask{0} | ... | source_norm_axes<std::remove_cvref_t<E>>());
    }(std::type_identity<G>{});
  } else {
    return source_norm_axes<std::remove_cvref_t<std::ranges::range_value_t<const G>>>();
  }
}
template <class G>
double norm_share(const G& g, NormType type, AxisMask group_axes) {
  if constexpr (AnyDTensor<G>) {
    // Every rank adds to the max (replicas hold the same values); sums only once per block.
    return type.is_inf() || counts_here(g, group_axes) ? detail::local_norm_sum(g.local(), type) : 0.0;
  } else {
    return g.local_grad_norm_sum(type, group_axes);
  }
}
template <class G>
Device norm_device(const G& g) {
  if constexpr (AnyDTensor<G>) {
    return g.local().device();
  } else {
    return g.local_grad().device();
  }
}
template <class G>
void scale_gradient(const G& g, double coef) {
  if constexpr (AnyDTensor<G>) {
    local::scale(g.local(), coef);
  } else {
    g.scale_grad(coef);
  }
}

} // namespace detail

/// The norm of all the gradients' global elements together (see the header comment): gradient DTensors,
/// gradient holders (FlatParamGroup) and ranges of them, on one mesh; the same value on every rank.
/// Collective over the mesh axes where any gradient is Shard.
template <GradientSource G0, GradientSource... G>
double total_norm(NormType type, const G0& g0, const G&... grads) {
  using Mesh0 = std::remove_cvref_t<decltype(std::declval<const detail::gradient_of_t<G0>&>().mesh())>;
  static_assert(
      (std::is_same_v<
           Mesh0, std::remove_cvref_t<decltype(std::declval<const detail::gradient_of_t<G>&>().mesh())>> &&
       ...),
      "clip_grad_norm: every gradient must be on the same mesh");
  DTENSOR_CHECK(type.p > 0, "clip_grad_norm: norm_type must be positive, not " + std::to_string(type.p));
  constexpr AxisMask axes = (detail::source_norm_axes<G0>() | ... | detail::source_norm_axes<G>());
  double acc = 0;
  const Mesh0* mesh = nullptr; // the first gradient's: the others must match it
  Device device;
  auto add = [&](const auto& g) {
    if (mesh == nullptr) {
      mesh = &g.mesh();
      device = detail::norm_device(g);
    }
    DTENSOR_CHECK(g.mesh().sizes() == mesh->sizes() && g.mesh().coordinate() == mesh->coordinate(),
                  "clip_grad_norm: every gradient must be on the same mesh");
    acc = detail::combine_norm(type, acc, detail::norm_share(g, type, axes));
  };
  detail::for_each_gradient(g0, add);
  (detail::for_each_gradient(grads, add), ...);
  if constexpr (axes != 0) {
    // Every rank holds the same sources, so all of them call or none does; over axes of size 1 only, the
    // share is the total (a size-1 axis costs nothing).
    if (mesh != nullptr && (axes & ~mesh->unit_axes()) != 0) {
      // On the gradients' device: NCCL reduces device memory only.
      Tensor<double, 1> total = Tensor<double, 1>::full({1}, acc, device);
      all_reduce(total, type.is_inf() ? ReduceOp::max : ReduceOp::sum, mesh->group_over(axes));
      const ::dtensor::detail::HostSyncScope read("clip_grad_norm: the total norm");
      acc = device.is_meta() ? std::nan("") : total.item(); // meta gradients: no norm
    } else if (mesh != nullptr && device.is_meta()) {
      acc = std::nan("");
    }
  }
  return type.is_inf() ? acc : (type.p == 2 ? std::sqrt(acc) : std::pow(acc, 1.0 / type.p));
}

/// Scales every gradient's shard in place by clip_coef = max_norm / (norm + 1e-6) when that is below 1
/// (torch.nn.utils.clip_grads_with_norm_); `norm` is total_norm's result. No communication.
template <GradientSource... G>
void clip_grads_with_norm(double max_norm, double norm, const G&... grads) {
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1 || coef != coef) {
    (detail::for_each_gradient(grads, [&](const auto& g) { detail::scale_gradient(g, coef); }), ...);
  }
}

/// Clips the gradients by their global p-norm (torch.nn.utils.clip_grad_norm_): returns the norm before
/// clipping and scales the gradients' shards in place when it exceeds max_norm.
template <GradientSource G0, GradientSource... G>
double clip_grad_norm(double max_norm, NormType type, const G0& g0, const G&... grads) {
  const double norm = total_norm(type, g0, grads...);
  clip_grads_with_norm(max_norm, norm, g0, grads...);
  return norm;
}
/// The 2-norm form: clip_grad_norm(max_norm, grads...).
template <GradientSource G0, GradientSource... G>
double clip_grad_norm(double max_norm, const G0& g0, const G&... grads) {
  return clip_grad_norm(max_norm, l2_norm, g0, grads...);
}

} // namespace dtensor

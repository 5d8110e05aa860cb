#pragma once
// Random DTensors and dropout whose values do not depend on the sharding: element i of the global tensor
// is a function of (seed, offset, i) only (local/random.hpp: Random123's Philox4x32-10, one call per
// element), so a fill on any mesh with any placements equals the same fill on one rank, bit for bit, on
// the host and on CUDA, and no rank talks to another.
//
//   auto w = rand<float, Shard<0>, Replicate>(mesh, {1024, 512}, /*seed=*/7);   // uniform in (0, 1)
//   auto z = randn<Replicate, Shard<1>>(mesh, {8, 64}, 7, /*offset=*/1);         // float by default
//   Tensor<float, 2> same = local::randn<float, 2>({8, 64}, 7, 1);               // == z.full_tensor()
//   auto h = dropout(x, 0.1, /*seed=*/7, /*offset=*/step);                       // x's placements
//   auto [y, back] = dropout(x, 0.1, 7, step, with_backward);  auto dx = back(dy); // the same mask
//
// `offset` is a stream number (torch's philox offset): calls that must differ (dropout at each step,
// each layer's initialisation) take different offsets or seeds.
//
// Partial placements hold the value as the factories do (tensor/distribute.hpp): on coordinate 0 of a
// Partial<sum/product> axis and the op's identity (0, 1) on the others, the value on every coordinate of
// a Partial<avg/max/min> axis, so full_tensor() is still the one-rank fill; that is what a torch user reading
// "a Partial DTensor of rand" means (the sum of the partials is the random tensor, not n copies of it). It is
// exact except for Partial<avg>: (v + ... + v) / n may round (not at 1, 2 or 4 ranks; by an ulp at 3, by two
// at 8: docs/tensor.md, "Partial<avg> rounds").
//
// dropout is linear in x once the mask is fixed, and the mask depends on global indices only, so every
// partial value gets the same mask and a Partial<sum/avg> x stays Partial (sum_r(x_r * m) = (sum_r x_r)
// * m); Partial<max/min/product> inputs do not compile, as for every pointwise op. Its backward applies
// the same mask to dy (regenerated from the seed, no mask is stored) and returns the gradient in dy's
// placements where they fit x's, else in dual(x)'s.
//
// Needs Random123's headers (Debian's librandom123-dev; the CMake target dtensor::random): without them
// instantiating any of these is a compile error naming the package.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/device.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/layout/partial_identity.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/local/random.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {

enum class RandomFill : std::uint8_t { uniform, normal };

template <std::size_t Rank>
std::array<std::int64_t, Rank> shape_array(const std::int64_t (&shape)[Rank]) {
  std::array<std::int64_t, Rank> a{};
  for (std::size_t d = 0; d < Rank; ++d) {
    a[d] = shape[d];
  }
  return a;
}

template <class T>
concept RandomElement = random_element_v<T>;

} // namespace detail

// Everything that launches kernels differs between nvcc and plain C++ TUs: in the local kernels' inline
// namespace (DTENSOR_LOCAL_OPS_NS), so that each TU keeps its own (one build, one meaning; see
// local/copy.hpp).
inline namespace DTENSOR_LOCAL_OPS_NS {

namespace random_impl {

template <class T, detail::RandomFill K, class... P, class Shape, std::size_t Rank>
DTensor<T, static_cast<int>(Rank), Shape, P...>
random_fill(const DeviceMesh<Shape>& mesh, const std::array<std::int64_t, Rank>& shape, std::uint64_t seed,
            std::uint64_t offset, Device device) {
  static_assert(detail::check_random_element<T>());
  constexpr int R = static_cast<int>(Rank);
  using Result = DTensor<T, R, Shape, P...>;
  for (int d = 0; d < R; ++d) {
    DTENSOR_CHECK(shape[d] >= 0, std::string(K == detail::RandomFill::uniform ? "rand" : "randn") +
                                     ": negative size in the global shape " + detail::shape_to_string(shape));
  }
  const Block mine = spec_block(detail::to_extents(shape), Result::spec, mesh.sizes(), mesh.coordinate());
  Tensor<T, R> local(detail::to_array<R>(mine.shape), device);
  if (!holds_partial_value(Result::placements, mesh.coordinate())) {
    fill_identity(AnyTensor(local), identity_op(Result::placements, mesh.coordinate()));
  } else {
    const GlobalBlock<R> at{detail::to_array<R>(mine.offset), shape};
    if constexpr (K == detail::RandomFill::uniform) {
      local::rand_into(local, seed, offset, at);
    } else {
      local::randn_into(local, seed, offset, at);
    }
  }
  return Result(mesh, std::move(local), shape);
}

} // namespace random_impl

/// A DTensor of `global_shape` with placements P..., uniform in (0, 1) (never 0 or 1, within torch.rand's
/// [0, 1)): element i of the global tensor is local::uniform_at<T>(seed, offset, i). No communication.
/// T: float, double, bfloat16 or half.
template <detail::RandomElement T, PlacementType... P, class Shape, std::size_t Rank>
DTensor<T, static_cast<int>(Rank), Shape, P...>
rand(const DeviceMesh<Shape>& mesh, const std::array<std::int64_t, Rank>& global_shape, std::uint64_t seed,
     std::uint64_t offset = 0, Device device = Device::cpu()) {
  return random_impl::random_fill<T, detail::RandomFill::uniform, P...>(mesh, global_shape, seed, offset,
                                                                        device);
}
template <detail::RandomElement T, PlacementType... P, class Shape, std::size_t Rank>
auto rand(const DeviceMesh<Shape>& mesh, const std::int64_t (&global_shape)[Rank], std::uint64_t seed,
          std::uint64_t offset = 0, Device device = Device::cpu()) {
  return rand<T, P...>(mesh, detail::shape_array(global_shape), seed, offset, device);
}
/// rand of float (torch's default dtype): rand<Shard<0>>(mesh, {4, 6}, seed).
template <PlacementType... P, class Shape, std::size_t Rank>
auto rand(const DeviceMesh<Shape>& mesh, const std::int64_t (&global_shape)[Rank], std::uint64_t seed,
          std::uint64_t offset = 0, Device device = Device::cpu()) {
  return rand<float, P...>(mesh, detail::shape_array(global_shape), seed, offset, device);
}
template <PlacementType... P, class Shape, std::size_t Rank>
auto rand(const DeviceMesh<Shape>& mesh, const std::array<std::int64_t, Rank>& global_shape,
          std::uint64_t seed, std::uint64_t offset = 0, Device device = Device::cpu()) {
  return rand<float, P...>(mesh, global_shape, seed, offset, device);
}

/// A DTensor of `global_shape` with placements P..., standard normal: element i of the global tensor is
/// local::normal_at<T>(seed, offset, i) (Box-Muller). No communication.
template <detail::RandomElement T, PlacementType... P, class Shape, std::size_t Rank>
DTensor<T, static_cast<int>(Rank), Shape, P...>
randn(const DeviceMesh<Shape>& mesh, const std::array<std::int64_t, Rank>& global_shape, std::uint64_t seed,
      std::uint64_t offset = 0, Device device = Device::cpu()) {
  return random_impl::random_fill<T, detail::RandomFill::normal, P...>(mesh, global_shape, seed, offset,
                                                                       device);
}
template <detail::RandomElement T, PlacementType... P, class Shape, std::size_t Rank>
auto randn(const DeviceMesh<Shape>& mesh, const std::int64_t (&global_shape)[Rank], std::uint64_t seed,
           std::uint64_t offset = 0, Device device = Device::cpu()) {
  return randn<T, P...>(mesh, detail::shape_array(global_shape), seed, offset, device);
}
/// randn of float.
template <PlacementType... P, class Shape, std::size_t Rank>
auto randn(const DeviceMesh<Shape>& mesh, const std::int64_t (&global_shape)[Rank], std::uint64_t seed,
           std::uint64_t offset = 0, Device device = Device::cpu()) {
  return randn<float, P...>(mesh, detail::shape_array(global_shape), seed, offset, device);
}
template <PlacementType... P, class Shape, std::size_t Rank>
auto randn(const DeviceMesh<Shape>& mesh, const std::array<std::int64_t, Rank>& global_shape,
           std::uint64_t seed, std::uint64_t offset = 0, Device device = Device::cpu()) {
  return randn<float, P...>(mesh, global_shape, seed, offset, device);
}

namespace random_impl {

/// x * mask / (1 - p) on x's block of the output (the linear pointwise rule: x's placements).
template <class X>
auto dropout_of(const X& x, double p, std::uint64_t seed, std::uint64_t offset) {
  static_assert(detail::check_random_element<typename X::value_type>());
  using Y = detail::pointwise_result_t<X, Linearity::linear, X>;
  constexpr int R = X::rank;
  const Block out =
      spec_block(detail::to_extents(x.global_shape()), Y::spec, x.mesh().sizes(), x.mesh().coordinate());
  const Labels labels = trailing_labels(R, R);
  const GlobalBlock<R> at{detail::to_array<R>(out.offset), x.global_shape()};
  auto local = local::dropout(detail::operand_view(x, labels, labels, out), p, seed, offset, at);
  return Y(x.mesh(), std::move(local), x.global_shape());
}

} // namespace random_impl

/// The backward context of dropout: keeps p, the seed and the offset (the mask is made again).
template <class X>
class DropoutBackward {
public:
  DropoutBackward(double p, std::uint64_t seed, std::uint64_t offset, typename X::shape_type global)
      : p_(p), seed_(seed), offset_(offset), global_(global) {}

  /// dx = dy * mask / (1 - p), from dy with any linear placements of x's global shape.
  template <AnyDTensor G>
  auto operator()(const G& dy) const {
    static_assert(std::is_same_v<typename G::value_type, typename X::value_type> && G::rank == X::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    DTENSOR_CHECK(dy.global_shape() == global_,
                  "backward of dropout: the gradient's global shape differs from the output's");
    return detail::as_gradient_of<X>(random_impl::dropout_of(dy, p_, seed_, offset_));
  }

private:
  double p_;
  std::uint64_t seed_;
  std::uint64_t offset_;
  typename X::shape_type global_;
};

/// Dropout with probability p (0 <= p <= 1): global element i of x is kept, times 1 / (1 - p), when
/// local::dropout_keeps(seed, offset, i, p) (i.e. rand<float>(seed, offset) at i >= p), else zeroed. The
/// output has x's placements; no communication.
template <AnyDTensor X>
auto dropout(const X& x, double p, std::uint64_t seed, std::uint64_t offset = 0) {
  return random_impl::dropout_of(x, p, seed, offset);
}
/// Dropout and its backward context: `auto [y, back] = dropout(x, p, seed, offset, with_backward);`.
template <AnyDTensor X>
auto dropout(const X& x, double p, std::uint64_t seed, std::uint64_t offset, WithBackwardTag) {
  auto y = random_impl::dropout_of(x, p, seed, offset);
  return WithBackward<decltype(y), DropoutBackward<X>>{std::move(y),
                                                       DropoutBackward<X>(p, seed, offset, x.global_shape())};
}
template <AnyDTensor X>
auto dropout(const X& x, double p, std::uint64_t seed, WithBackwardTag) {
  return dropout(x, p, seed, 0, with_backward);
}

} // namespace DTENSOR_LOCAL_OPS_NS

} // namespace dtensor

#pragma once
// Making DTensors: distribute_tensor (from one rank, or slicing a tensor every rank holds) and factories
// (zeros, ones, full, from_global_index). Typed shells over exec/blocks.hpp.
//
// Partial placements: the global tensor is the reduction over each Partial axis, so a distributed value v
// is held as v on coordinate 0 of every Partial<sum> / Partial<product> axis and as the op's identity
// (0 / 1) elsewhere; Partial<avg/max/min> axes hold v on every coordinate. Reducing gives v back exactly,
// except for Partial<avg> on floats: (v + ... + v) / n rounds, exact at 1, 2 and 4 ranks and for integer
// values (while n * v is exact), else within an ulp or two (docs/tensor.md, "Partial<avg> rounds").

#include <array>
#include <cstdint>
#include <vector>

#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/exec/blocks.hpp"
#include "dtensor/exec/execute.hpp"
#include "dtensor/layout/partial_identity.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

/// Tag for distribute_tensor: every rank already holds the full tensor; each keeps its shard, no
/// communication.
struct ReplicatedSource {
  explicit ReplicatedSource() = default;
};
inline constexpr ReplicatedSource replicated_source{};

/// Distributes `full` from mesh rank `src` with placements P...: one scatter over the mesh sends every rank
/// exactly its shard. Every rank of the mesh calls it. Only the source's contents and shape are read; the
/// other ranks pass a tensor on the device the shards should live on (any shape, e.g. {0, 0}), or an
/// undefined tensor for host shards.
template <class... P, class T, int Rank, class Shape>
DTensor<T, Rank, Shape, P...> distribute_tensor(const DeviceMesh<Shape>& mesh, const Tensor<T, Rank>& full,
                                                int src = 0) {
  using Result = DTensor<T, Rank, Shape, P...>;
  Extents global;
  AnyTensor local = exec::scatter_blocks(mesh, AnyTensor(full), dtype_v<T>, Rank, src, Result::spec,
                                         Result::placements, global);
  return Result(mesh, std::move(local).template as<T, Rank>(), detail::to_array<Rank>(global));
}

/// Distributes a tensor that every rank already holds in full: each rank keeps its shard.
template <class... P, class T, int Rank, class Shape>
DTensor<T, Rank, Shape, P...> distribute_tensor(const DeviceMesh<Shape>& mesh, const Tensor<T, Rank>& full,
                                                ReplicatedSource) {
  using Result = DTensor<T, Rank, Shape, P...>;
  AnyTensor local = exec::slice_block(mesh, AnyTensor(full), Result::spec, Result::placements);
  return Result(mesh, std::move(local).template as<T, Rank>(), full.shape());
}

/// A DTensor whose global element at index i is fn(i) (an std::array<int64_t, Rank>), built locally on
/// the host and moved to `device`.
template <class T, class... P, class Shape, std::size_t Rank, class Fn>
DTensor<T, static_cast<int>(Rank), Shape, P...> from_global_index(const DeviceMesh<Shape>& mesh,
                                                                  const std::int64_t (&shape)[Rank], Fn fn,
                                                                  Device device = Device::cpu()) {
  constexpr int R = static_cast<int>(Rank);
  using Result = DTensor<T, R, Shape, P...>;
  std::array<std::int64_t, R> global{};
  for (int d = 0; d < R; ++d) {
    global[d] = shape[d];
  }
  exec::check_global_shape(detail::to_extents(global), sizeof(T), "from_global_index");
  const Block mine = spec_block(detail::to_extents(global), Result::spec, mesh.sizes(), mesh.coordinate());
  if (device.is_meta()) { // the shard's shape, no values
    return Result(mesh, Tensor<T, R>(detail::to_array<R>(mine.shape), device), global);
  }
  Tensor<T, R> local(detail::to_array<R>(mine.shape));
  if (!holds_partial_value(Result::placements, mesh.coordinate())) {
    fill_identity(AnyTensor(local), identity_op(Result::placements, mesh.coordinate()));
    return Result(mesh, device.is_cpu() ? std::move(local) : local.to(device), global);
  }
  std::array<std::int64_t, R> idx{};
  T* out = local.data();
  for (std::int64_t i = 0; i < local.numel(); ++i) {
    std::int64_t rest = i;
    for (int d = R - 1; d >= 0; --d) {
      idx[d] = mine.offset[d] + rest % mine.shape[d];
      rest /= mine.shape[d];
    }
    out[i] = static_cast<T>(fn(idx));
  }
  return Result(mesh, device.is_cpu() ? std::move(local) : local.to(device), global);
}

/// A DTensor filled with `value` (the global tensor equals value everywhere).
template <class T, class... P, class Shape, std::size_t Rank>
auto full(const DeviceMesh<Shape>& mesh, const std::int64_t (&shape)[Rank], T value,
          Device device = Device::cpu()) {
  return from_global_index<T, P...>(
      mesh, shape, [value](const auto&) { return value; }, device);
}

template <class T, class... P, class Shape, std::size_t Rank>
auto zeros(const DeviceMesh<Shape>& mesh, const std::int64_t (&shape)[Rank], Device device = Device::cpu()) {
  return full<T, P...>(mesh, shape, T(0.0f), device);
}

template <class T, class... P, class Shape, std::size_t Rank>
auto ones(const DeviceMesh<Shape>& mesh, const std::int64_t (&shape)[Rank], Device device = Device::cpu()) {
  return full<T, P...>(mesh, shape, T(1.0f), device);
}

} // namespace dtensor

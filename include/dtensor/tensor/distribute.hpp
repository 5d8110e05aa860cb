#pragma once
// Making DTensors: distribute_tensor (from one rank, or slicing a tensor every rank holds) and factories
// (zeros, ones, full, from_global_index).
//
// Partial placements: the global tensor is the reduction over each Partial axis, so a distributed value v
// is held as v on coordinate 0 of every Partial<sum> / Partial<product> axis and as the op's identity
// (0 / 1) elsewhere; Partial<avg/max/min> axes hold v on every coordinate. Either way it is exact.

#include <array>
#include <cstdint>
#include <vector>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/plan/shard_spec.hpp"
#include "dtensor/tensor/dtensor.hpp"
#include "dtensor/tensor/execute.hpp"
#include "dtensor/tensor/local_ops.hpp"

namespace dtensor {

/// Tag for distribute_tensor: every rank already holds the full tensor; each keeps its shard, no
/// communication.
struct ReplicatedSource {
  explicit ReplicatedSource() = default;
};
inline constexpr ReplicatedSource replicated_source{};

namespace detail {

/// True when the rank at `coord` holds the value itself (not an identity) under `placements`.
inline bool holds_partial_value(const PlacementList& placements, const MeshCoord& coord) {
  for (int a = 0; a < placements.size(); ++a) {
    const Placement p = placements[a];
    if (p.is_partial() && (p.op == ReduceOp::sum || p.op == ReduceOp::product) && coord[a] != 0) {
      return false;
    }
  }
  return true;
}

/// The identity of the first Partial<sum/product> axis where `coord` is not 0.
template <class T>
T partial_fill(const PlacementList& placements, const MeshCoord& coord) {
  for (int a = 0; a < placements.size(); ++a) {
    const Placement p = placements[a];
    if (p.is_partial() && (p.op == ReduceOp::sum || p.op == ReduceOp::product) && coord[a] != 0) {
      return partial_identity<T>(p.op);
    }
  }
  return T(0.0f);
}

template <class Shape>
AxisMask all_axes() {
  return static_cast<AxisMask>((1u << Shape::rank) - 1);
}

} // namespace detail

/// Distributes `full` from mesh rank `src` with placements P...: one scatter over the mesh sends every rank
/// exactly its shard. Every rank of the mesh calls it. Only the source's contents and shape are read; the
/// other ranks pass a tensor on the device the shards should live on (any shape, e.g. {0, 0}), or an
/// undefined tensor for host shards.
template <class... P, class T, int Rank, class Shape>
DTensor<T, Rank, Shape, P...> distribute_tensor(const DeviceMesh<Shape>& mesh, const Tensor<T, Rank>& full,
                                                int src = 0) {
  using Result = DTensor<T, Rank, Shape, P...>;
  const ProcessGroup g = mesh.group_over(detail::all_axes<Shape>());
  const int n = g.size();
  DTENSOR_CHECK(src >= 0 && src < n, "distribute_tensor: source rank " + std::to_string(src) +
                                         " is outside the mesh of " + std::to_string(n) + " ranks");
  // The global shape comes from the source, broadcast on the tensors' device (NCCL takes device memory).
  const Device dev = full.defined() ? full.device() : Device::cpu();
  auto shape = Tensor<std::int64_t, 1>::zeros({Rank});
  if (g.rank() == src) {
    DTENSOR_CHECK(full.defined(), "distribute_tensor: the source rank " + std::to_string(src) +
                                      " passed an undefined tensor");
    for (int d = 0; d < Rank; ++d) {
      shape(d) = full.shape()[d];
    }
  }
  auto shape_on_dev = shape.to(dev);
  broadcast(shape_on_dev, src, g);
  shape = shape_on_dev.to(Device::cpu());
  std::array<std::int64_t, Rank> global{};
  for (int d = 0; d < Rank; ++d) {
    global[d] = shape(d);
  }
  const Extents gext = detail::to_extents(global);

  std::vector<std::int64_t> counts(n);
  std::vector<Block> blocks(n);
  for (int q = 0; q < n; ++q) {
    const MeshCoord c = rank_to_coord(q, mesh.sizes());
    blocks[q] = spec_block(gext, Result::spec, mesh.sizes(), c);
    counts[q] = detail::holds_partial_value(Result::placements, c) ? numel(blocks[q].shape) : 0;
  }
  // The source sends each block straight from `full` where that block is contiguous in it (e.g. Shard(0)
  // of a contiguous tensor), the others from one packed copy (strided reads, no contiguous copy first).
  const Block whole{gext, Extents(Rank, 0)};
  std::vector<BufferRef> pieces;
  Tensor<T, 1> packed;
  if (g.rank() == src) {
    std::vector<Tensor<T, Rank>> regions(n);
    std::int64_t staged = 0;
    for (int q = 0; q < n; ++q) {
      regions[q] = detail::region(full, whole, blocks[q]);
      staged += regions[q].is_contiguous() ? 0 : counts[q];
    }
    packed = Tensor<T, 1>({staged}, dev);
    pieces.resize(n, BufferRef{nullptr, 0, dtype_v<T>, dev});
    std::int64_t at = 0;
    for (int q = 0; q < n; ++q) {
      if (counts[q] == 0) {
        continue;
      }
      if (regions[q].is_contiguous()) {
        pieces[q] = detail::buffer_of(regions[q]);
        continue;
      }
      auto dst = packed.narrow(0, at, counts[q]);
      local_ops::copy(dst.template view<Rank>(detail::to_array<Rank>(blocks[q].shape)), regions[q]);
      pieces[q] = detail::buffer_of(dst);
      at += counts[q];
    }
  }
  const int me = g.rank();
  Tensor<T, Rank> local(detail::to_array<Rank>(blocks[me].shape), dev);
  if (counts[me] == 0) {
    local_ops::fill(local, detail::partial_fill<T>(Result::placements, mesh.coordinate()));
  }
  CommOptions opts;
  opts.blocking = true;
  Tensor<T, 1> recv = local.template view<1>({local.numel()});
  if (counts[me] == 0) {
    recv = Tensor<T, 1>({0}, dev);
  }
  g.impl("distribute_tensor").scatter(pieces, detail::buffer_of(recv), src, opts)->wait();
  return Result(mesh, std::move(local), global);
}

/// Distributes a tensor that every rank already holds in full: each rank keeps its shard.
template <class... P, class T, int Rank, class Shape>
DTensor<T, Rank, Shape, P...> distribute_tensor(const DeviceMesh<Shape>& mesh, const Tensor<T, Rank>& full,
                                                ReplicatedSource) {
  using Result = DTensor<T, Rank, Shape, P...>;
  const Extents gext = detail::to_extents(full.shape());
  const Block mine = spec_block(gext, Result::spec, mesh.sizes(), mesh.coordinate());
  Tensor<T, Rank> local(detail::to_array<Rank>(mine.shape), full.device());
  if (detail::holds_partial_value(Result::placements, mesh.coordinate())) {
    local_ops::copy(local, detail::region(full, Block{gext, Extents(Rank, 0)}, mine));
  } else {
    local_ops::fill(local, detail::partial_fill<T>(Result::placements, mesh.coordinate()));
  }
  return Result(mesh, std::move(local), full.shape());
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
  const Block mine = spec_block(detail::to_extents(global), Result::spec, mesh.sizes(), mesh.coordinate());
  Tensor<T, R> local(detail::to_array<R>(mine.shape));
  if (!detail::holds_partial_value(Result::placements, mesh.coordinate())) {
    local_ops::fill(local, detail::partial_fill<T>(Result::placements, mesh.coordinate()));
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

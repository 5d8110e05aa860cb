#pragma once
// Making and checking DTensor blocks, as plain code over values (compiled once for every element type,
// rank and mesh type; tensor/distribute.hpp and tensor/dtensor.hpp are the typed shells):
//  - scatter_blocks: distribute_tensor from one rank (one scatter over the mesh);
//  - slice_block: distribute_tensor from a tensor every rank holds (no communication);
//  - verify_layout: from_local's cross-rank check of shapes (one small all_gather).
//
// Partial placements: the global tensor is the reduction over each Partial axis, so a distributed value v
// is held as v on coordinate 0 of every Partial<sum> / Partial<product> axis and as the op's identity
// (0 / 1) elsewhere; Partial<avg/max/min> axes hold v on every coordinate. Reducing gives v back exactly,
// except for Partial<avg> on floats: (v + ... + v) / n rounds, exact at 1, 2 and 4 ranks and for integer
// values (while n * v is exact), else within an ulp or two (docs/tensor.md, "Partial<avg> rounds").

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/checked_int.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/exec/execute.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/partial_identity.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/mesh/device_mesh.hpp"

namespace dtensor::exec {

namespace detail {

inline AxisMask all_axes(const DeviceMeshBase& mesh) {
  return static_cast<AxisMask>((1u << mesh.num_axes()) - 1);
}

/// "(1, 0)".
inline std::string coord_string(const MeshCoord& c) {
  return dtensor::detail::format_list(c, ", ", "(", ")");
}

} // namespace detail

/// Throws unless `global` is a representable tensor shape: every size >= 0, and the product of the non-zero
/// sizes times `element_size` fits in int64 (so the global tensor, its strides and every block fit).
inline void check_global_shape(const Extents& global, std::size_t element_size, const std::string& what) {
  for (int d = 0; d < global.size(); ++d) {
    DTENSOR_CHECK(global[d] >= 0,
                  what + ": the global shape " + AnyTensor::to_string(global) + " has a negative size");
  }
  DTENSOR_CHECK(dtensor::detail::representable_extent(global, element_size),
                what + ": the global shape " + AnyTensor::to_string(global) + " is too large (" +
                    std::to_string(element_size) +
                    "-byte elements: the product of its non-zero sizes, in bytes, does not fit in int64)");
}

/// The global shape of `full` on mesh rank `src`, known to every rank after one broadcast (on `dev`: NCCL
/// takes device memory only; on the host for a meta `dev`).
inline Extents broadcast_shape(const ProcessGroup& g, const AnyTensor& full, int rank, int src, Device dev) {
  dev = dev.is_meta() ? Device::cpu() : dev; // shapes are data, also of a meta tensor
  AnyTensor shape = AnyTensor::empty(DType::int64, Extents{rank}, Device::cpu());
  auto* s = static_cast<std::int64_t*>(shape.data());
  for (int d = 0; d < rank; ++d) {
    s[d] = g.rank() == src ? full.shape()[d] : 0;
  }
  AnyTensor on_dev = dev.is_cpu() ? shape : AnyTensor::empty(DType::int64, Extents{rank}, dev);
  if (!dev.is_cpu()) {
    on_dev.copy_from(shape);
  }
  g.broadcast(BufferRef{on_dev.data(), rank, DType::int64, dev}, src, blocking())->wait();
  if (!dev.is_cpu()) {
    shape.copy_from(on_dev);
  }
  Extents global;
  for (int d = 0; d < rank; ++d) {
    global.push_back(s[d]);
  }
  return global;
}

/// distribute_tensor from mesh rank `src`: one scatter over the mesh sends every rank exactly its block of
/// `spec` (a copy of the value where `placements` says it holds it, nothing where it holds an identity).
/// Off `src`, `full` gives only the device (undefined: host). Returns this rank's block; `global` is set to
/// the source's shape.
inline AnyTensor scatter_blocks(const DeviceMeshBase& mesh, const AnyTensor& full, DType dtype, int rank,
                                int src, const ShardSpec& spec, const PlacementList& placements,
                                Extents& global) {
  const ProcessGroup& g = mesh.group_over(detail::all_axes(mesh));
  const int n = g.size();
  DTENSOR_CHECK(src >= 0 && src < n, "distribute_tensor: source rank " + std::to_string(src) +
                                         " is outside the mesh of " + std::to_string(n) + " ranks");
  const int me = g.rank();
  DTENSOR_CHECK(me != src || full.defined(),
                "distribute_tensor: the source rank " + std::to_string(src) + " passed an undefined tensor");
  const Device dev = full.defined() ? full.device() : Device::cpu();
  global = broadcast_shape(g, full, rank, src, dev);

  std::vector<std::int64_t> counts(n);
  std::vector<Block> blocks(n);
  for (int q = 0; q < n; ++q) {
    const MeshCoord c = rank_to_coord(q, mesh.sizes());
    blocks[q] = spec_block(global, spec, mesh.sizes(), c);
    counts[q] = holds_partial_value(placements, c) ? numel(blocks[q].shape) : 0;
  }
  // The source sends each block straight from `full` where that block is contiguous in it (e.g. Shard(0)
  // of a contiguous tensor), the others from one packed copy (strided reads, no contiguous copy first).
  const Block whole{global, Extents(rank, 0)};
  std::vector<BufferRef> pieces;
  AnyTensor packed;
  if (me == src) {
    std::vector<AnyTensor> regions(n);
    std::int64_t staged = 0;
    for (int q = 0; q < n; ++q) {
      regions[q] = full.region(whole, blocks[q]);
      staged += regions[q].is_contiguous() ? 0 : counts[q];
    }
    packed = AnyTensor::empty(dtype, Extents{staged}, dev, full.stream());
    pieces.resize(n, BufferRef{nullptr, 0, dtype, dev, full.stream()});
    std::int64_t at = 0;
    for (int q = 0; q < n; ++q) {
      if (counts[q] == 0) {
        continue;
      }
      if (regions[q].is_contiguous()) {
        pieces[q] = BufferRef{regions[q].data(), counts[q], dtype, dev, full.stream()};
        continue;
      }
      const AnyTensor dst = packed.narrow(0, at, counts[q]);
      dst.view(blocks[q].shape).copy_from(regions[q]);
      pieces[q] = BufferRef{dst.data(), counts[q], dtype, dev, full.stream()};
      at += counts[q];
    }
  }
  AnyTensor local = AnyTensor::empty(dtype, blocks[me].shape, dev, full.defined() ? full.stream() : nullptr);
  BufferRef recv{local.data(), local.numel(), dtype, dev, local.stream()};
  if (counts[me] == 0) {
    fill_identity(local, identity_op(placements, mesh.coordinate()));
    recv.count = 0;
  }
  g.scatter(pieces, recv, src, blocking())->wait();
  return local;
}

/// distribute_tensor from a tensor every rank holds: this rank's block, no communication.
inline AnyTensor slice_block(const DeviceMeshBase& mesh, const AnyTensor& full, const ShardSpec& spec,
                             const PlacementList& placements) {
  const Block whole{full.shape(), Extents(full.rank(), 0)};
  const Block mine = spec_block(full.shape(), spec, mesh.sizes(), mesh.coordinate());
  AnyTensor local = full.new_empty(mine.shape);
  if (holds_partial_value(placements, mesh.coordinate())) {
    local.copy_from(full.region(whole, mine));
  } else {
    fill_identity(local, identity_op(placements, mesh.coordinate()));
  }
  return local;
}

/// from_local's checks: throws unless `local` is the block `spec` of `global` gives this rank. With
/// `across_ranks`, one all_gather of every rank's (local, global) shapes checks every rank's, naming the
/// first rank that differs.
inline void verify_layout(const DeviceMeshBase& mesh, const Extents& local, const Extents& global,
                          const ShardSpec& spec, const PlacementList& placements, std::size_t element_size,
                          Device dev, bool across_ranks) {
  dev = dev.is_meta() ? Device::cpu() : dev; // shapes are data, also of a meta tensor
  const int rank = global.size();
  if (!across_ranks) {
    check_global_shape(global, element_size,
                       "DTensor::from_local on mesh rank " + std::to_string(mesh.rank()));
    const Block b = spec_block(global, spec, mesh.sizes(), mesh.coordinate());
    DTENSOR_CHECK(local == b.shape,
                  "DTensor::from_local on mesh rank " + std::to_string(mesh.rank()) + ": the local shape " +
                      AnyTensor::to_string(local) + " is not the shard " + AnyTensor::to_string(b.shape) +
                      " that " + to_string(placements) + " of global shape " + AnyTensor::to_string(global) +
                      " gives mesh coordinate " + detail::coord_string(mesh.coordinate()));
    return;
  }
  const ProcessGroup& g = mesh.group_over(detail::all_axes(mesh));
  const int n = g.size();
  AnyTensor mine = AnyTensor::empty(DType::int64, Extents{2 * rank}, Device::cpu());
  auto* m = static_cast<std::int64_t*>(mine.data());
  for (int d = 0; d < rank; ++d) {
    m[d] = local[d];
    m[rank + d] = global[d];
  }
  AnyTensor all = AnyTensor::empty(DType::int64, Extents{2 * rank * n}, Device::cpu());
  AnyTensor mine_dev = dev.is_cpu() ? mine : AnyTensor::empty(DType::int64, mine.shape(), dev);
  AnyTensor all_dev = dev.is_cpu() ? all : AnyTensor::empty(DType::int64, all.shape(), dev);
  if (!dev.is_cpu()) {
    mine_dev.copy_from(mine);
  }
  std::vector<std::int64_t> counts(n, 2 * rank);
  std::vector<std::int64_t> displs(n);
  for (int q = 0; q < n; ++q) {
    displs[q] = 2 * rank * q;
  }
  g.all_gather(BufferRef{mine_dev.data(), 2 * rank, DType::int64, dev},
               BufferRef{all_dev.data(), 2 * rank * n, DType::int64, dev}, counts, displs, blocking())
      ->wait();
  if (!dev.is_cpu()) {
    all.copy_from(all_dev);
  }
  const auto* v = static_cast<const std::int64_t*>(all.data());
  for (int q = 0; q < n; ++q) {
    Extents their_local;
    Extents their_global;
    for (int d = 0; d < rank; ++d) {
      their_local.push_back(v[2 * rank * q + d]);
      their_global.push_back(v[2 * rank * q + rank + d]);
    }
    // Checked after the exchange, so that one rank's bad shape fails every rank instead of leaving the
    // others waiting in the all_gather.
    check_global_shape(their_global, element_size, "DTensor::from_local: mesh rank " + std::to_string(q));
    DTENSOR_CHECK(their_global == global, "DTensor::from_local: mesh rank " + std::to_string(q) +
                                              " passed global shape " + AnyTensor::to_string(their_global) +
                                              " but mesh rank " + std::to_string(mesh.rank()) + " passed " +
                                              AnyTensor::to_string(global));
    const MeshCoord c = rank_to_coord(q, mesh.sizes());
    const Block want = spec_block(their_global, spec, mesh.sizes(), c);
    DTENSOR_CHECK(their_local == want.shape,
                  "DTensor::from_local: mesh rank " + std::to_string(q) + " (coordinate " +
                      detail::coord_string(c) + ") holds a local tensor of shape " +
                      AnyTensor::to_string(their_local) + " but " + to_string(placements) +
                      " of global shape " + AnyTensor::to_string(their_global) + " gives it " +
                      AnyTensor::to_string(want.shape) + " (torch.chunk sizes)");
  }
}

} // namespace dtensor::exec

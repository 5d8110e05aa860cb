#pragma once
// DTensor redistributions in the process suite: the same cases on host tensors over gloo and on CUDA
// tensors over NCCL (scripts/gpu_check.sh), checked against the tensor on the host. Every collective kind
// the executor uses appears: all_gather, all_reduce, reduce_scatter, all_to_all on one axis and on a
// flattened group, the point-to-point permute, and the scatter of distribute_tensor.

#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/core/tensor_io.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/tensor/distribute.hpp"
#include "dtensor/tensor/dtensor.hpp"

#include <cstdint>
#include <string>

namespace suite {

inline dtensor::Tensor<float, 2> dtensor_reference(std::int64_t rows, std::int64_t cols) {
  dtensor::Tensor<float, 2> t({rows, cols});
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      t(i, j) = static_cast<float>((i * 7 + j) % 50);
    }
  }
  return t;
}

template <class DT>
void expect_full(const DT& x, const dtensor::Tensor<float, 2>& want, int rank, const std::string& what) {
  const auto got = x.full_tensor().to(dtensor::Device::cpu());
  DTENSOR_CHECK(dtensor::equal(got, want),
                "rank " + std::to_string(rank) + ": " + what + " differs from the tensor");
}

template <class Mesh>
void dtensor_1d(const Mesh& mesh, dtensor::Device dev, int rank) {
  using namespace dtensor;
  const auto full = dtensor_reference(11, 7);
  const auto on_dev = full.to(dev);
  auto s0 = distribute_tensor<Shard<0>>(mesh, on_dev, replicated_source);
  expect_full(s0.template redistribute<Replicate>(), full, rank, "S(0) -> R");
  expect_full(s0.template redistribute<Shard<1>>(), full, rank, "S(0) -> S(1)");
  auto p = distribute_tensor<Partial<>>(mesh, on_dev, 0);
  expect_full(p.template redistribute<Shard<0>>(), full, rank, "P -> S(0)");
  expect_full(p.template redistribute<Replicate>(), full, rank, "P -> R");
  auto r = distribute_tensor<Replicate>(mesh, on_dev, replicated_source);
  expect_full(r.template redistribute<Shard<1>>(), full, rank, "R -> S(1)");
  expect_full(r.template redistribute<Partial<>>().template redistribute<Replicate>(), full, rank,
              "R -> P -> R");
}

template <class Mesh>
void dtensor_2d(const Mesh& mesh, dtensor::Device dev, int rank) {
  using namespace dtensor;
  const auto full = dtensor_reference(9, 5);
  const auto on_dev = full.to(dev);
  auto x = distribute_tensor<Shard<0>, Shard<1>>(mesh, on_dev, 0);
  expect_full(x.template redistribute<Shard<1>, Shard<0>>(), full, rank,
              "[S(0),S(1)] -> [S(1),S(0)] (permute)");
  auto y = x.template redistribute<Shard<0>, Shard<0>>();
  expect_full(y.template redistribute<Shard<1>, Shard<1>>(), full, rank, "[S(0),S(0)] -> [S(1),S(1)]");
  auto pending = y.template redistribute<Replicate, Shard<1>>(async_op);
  expect_full(pending.wait(), full, rank, "async [S(0),S(0)] -> [R,S(1)]");
  auto p = distribute_tensor<Partial<>, Partial<>>(mesh, on_dev, 0);
  expect_full(p.template redistribute<Replicate, Shard<1>>(), full, rank, "[P,P] -> [R,S(1)]");
  auto s = distribute_tensor<Shard<0>, Replicate>(mesh, on_dev, replicated_source);
  expect_full(s.template redistribute<Replicate, Shard<1>>(), full, rank, "[S(0),R] -> [R,S(1)]");
}

/// 1-D mesh over the world; a (dp, tp=2) mesh when the world size is even.
inline void dtensor_cases(const Ctx& c) {
  using namespace dtensor;
  dtensor_1d(init_device_mesh<MeshShape<Axis<"x">>>(c.world), c.device, c.rank);
  if (c.size % 2 == 0) {
    dtensor_2d(init_device_mesh<MeshShape<Axis<"dp">, Axis<"tp", 2>>>(c.world), c.device, c.rank);
  }
}

} // namespace suite

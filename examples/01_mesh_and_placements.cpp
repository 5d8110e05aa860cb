// 01: a device mesh and placements.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_01_mesh_and_placements
//
// Builds a (dp, tp=2) mesh over the world, shows each rank's coordinate and axis groups, distributes a
// 6x4 tensor from rank 0 under a few placement lists and checks every rank's shard against the
// single-process slice of the same tensor.

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/core/tensor_io.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/tensor/visualize.hpp>

#include <cstdio>
#include <string>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;

namespace {

std::string ranks_of(const ProcessGroup& g) {
  std::string s = "{";
  for (std::size_t i = 0; i < g.ranks().size(); ++i) {
    s += (i ? "," : "") + std::to_string(g.ranks()[i]);
  }
  return s + "}";
}

// True when x's shard is exactly the slice of `full` its offset and shape name.
template <class DT>
bool shard_matches(const DT& x, const Tensor<float, 2>& full) {
  const auto off = x.local_offset();
  const auto& local = x.local();
  for (std::int64_t i = 0; i < local.shape()[0]; ++i) {
    for (std::int64_t j = 0; j < local.shape()[1]; ++j) {
      if (local(i, j) != full(off[0] + i, off[1] + j)) {
        return false;
      }
    }
  }
  return true;
}

} // namespace

int main() {
  ProcessGroup world = init_process_group();
  if (world.size() % 2 != 0) {
    std::fprintf(stderr, "example 01 needs an even number of ranks (tp = 2), got %d\n", world.size());
    return 1;
  }
  auto mesh = init_device_mesh<Mesh>(world);
  std::printf("rank %d: %s, dp group %s, tp group %s\n", world.rank(), mesh.to_string().c_str(),
              ranks_of(mesh.group<"dp">()).c_str(), ranks_of(mesh.group<"tp">()).c_str());

  Tensor<float, 2> full({6, 4});
  for (std::int64_t i = 0; i < 6; ++i) {
    for (std::int64_t j = 0; j < 4; ++j) {
      full(i, j) = static_cast<float>(10 * i + j);
    }
  }
  bool ok = true;
  auto show = [&](const auto& x) {
    ok = ok && shard_matches(x, full);
    if (world.rank() == 0) {
      std::printf("\n%s\n", visualize_sharding(x).c_str());
    }
  };
  show(distribute_tensor<Shard<0>, Replicate>(mesh, full));
  show(distribute_tensor<Shard<0>, Shard<1>>(mesh, full));
  show(distribute_tensor<Replicate, Shard<-1>>(mesh, full));
  show(distribute_tensor<Shard<0>, Shard<0>>(mesh, full));

  // Every rank reports; rank 0 sums the failures so the exit code covers the whole job.
  auto failures = Tensor<int, 1>::full({1}, ok ? 0 : 1);
  all_reduce(failures, ReduceOp::sum, world);
  if (world.rank() == 0) {
    std::printf("%s\n", failures(0) == 0 ? "every shard matches the reference" : "SHARD MISMATCH");
  }
  return failures(0) == 0 ? 0 : 1;
}

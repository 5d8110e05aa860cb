// 03: a tour of redistribution: plans fixed at compile time, sharding tables, communication counts.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_03_redistribution_tour
//
// On a (dp=2, tp=2) mesh, a 7x5 tensor (uneven on purpose) goes through transitions that show each kind
// of step: local chunks, all_gather, reduce_scatter, all_reduce, all_to_all (one axis and a flattened
// group) and an exact permutation. Each prints its plan (from the type alone), the sharding table of its
// result, and the collectives this rank ran with their bytes; each result is checked against the tensor.

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/core/tensor_io.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/plan/torch_reference.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/tensor/visualize.hpp>

#include <cstdio>
#include <string>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp", 2>, Axis<"tp", 2>>;

int main() {
  ProcessGroup world = init_process_group();
  if (world.size() != 4) {
    std::fprintf(stderr, "example 03 runs on 4 ranks (a 2x2 mesh), got %d\n", world.size());
    return 1;
  }
  auto mesh = init_device_mesh<Mesh>(world);
  const bool lead = world.rank() == 0;

  Tensor<float, 2> full({7, 5});
  for (std::int64_t i = 0; i < 7; ++i) {
    for (std::int64_t j = 0; j < 5; ++j) {
      full(i, j) = static_cast<float>(10 * i + j);
    }
  }
  int failures = 0;

  // Runs x -> Q..., prints what happened, checks the result.
  auto tour = [&]<class... Q>(const auto& x, const char* why) {
    using X = std::remove_cvref_t<decltype(x)>;
    CommDebugMode comm;
    auto y = x.template redistribute<Q...>();
    const auto counts = comm.to_string();
    const bool ok = equal(y.full_tensor(), full);
    failures += ok ? 0 : 1;
    if (lead) {
      const auto plan = X::template plan_to<Q...>();
      const Extents global{7, 5};
      std::printf("---- %s\n", why);
      std::printf("plan:    %s\n", plan.to_string().c_str());
      std::printf(
          "bytes per rank: ours %lld, PyTorch's greedy plan %lld (%s)\n",
          static_cast<long long>(plan.bytes_per_rank(global, mesh.sizes(), 4)),
          static_cast<long long>(
              torch_greedy_bytes(X::placements, placement_list_v<Q...>, global, mesh.sizes(), 4)),
          to_string(torch_greedy_plan(X::placements, placement_list_v<Q...>, 2), Mesh::names).c_str());
      std::printf("%s", visualize_sharding(y).c_str());
      std::printf("collectives on rank 0:\n%s", counts.c_str());
      std::printf("full_tensor %s the reference\n\n", ok ? "equals" : "DIFFERS FROM");
    }
    return y;
  };

  auto x = distribute_tensor<Shard<0>, Replicate>(mesh, full);
  if (lead) {
    std::printf("mesh %s; start: %s\n%s\n", Mesh::to_string().c_str(), x.to_string().c_str(),
                visualize_sharding(x).c_str());
  }
  auto a = tour.template operator()<Replicate, Shard<1>>(x, "[S(0),R] -> [R,S(1)]: shrink first, then grow");
  auto b = tour.template operator()<Shard<1>, Shard<0>>(
      a, "[R,S(1)] -> [S(1),S(0)]: both axes change dim; one exact exchange");
  auto c =
      tour.template operator()<Shard<0>, Shard<1>>(b, "[S(1),S(0)] -> [S(0),S(1)]: one exact permutation");
  auto d = tour.template operator()<Shard<0>, Shard<0>>(c, "[S(0),S(1)] -> [S(0),S(0)]: all_to_all on tp");
  auto e =
      tour.template operator()<Shard<1>, Shard<1>>(d, "[S(0),S(0)] -> [S(1),S(1)]: one all_to_all on dp*tp");
  tour.template operator()<Replicate, Replicate>(e, "[S(1),S(1)] -> [R,R]: all_gathers, inner axis first");

  auto p = distribute_tensor<Partial<>, Partial<>>(mesh, full);
  tour.template operator()<Replicate, Shard<1>>(
      p, "[P,P] -> [R,S(1)]: reduce_scatter, then all_reduce on less data");
  tour.template operator()<Shard<0>, Replicate>(p, "[P,P] -> [S(0),R]");

  auto total = Tensor<int, 1>::full({1}, failures);
  all_reduce(total, ReduceOp::sum, world);
  if (lead) {
    std::printf("%s\n", total(0) == 0 ? "every redistribution matches the reference" : "MISMATCH");
  }
  return total(0) == 0 ? 0 : 1;
}

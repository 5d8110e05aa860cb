#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/tensor/visualize.hpp>

#include <cstdio>

using namespace dtensor;

int main() {
  using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;
  ProcessGroup world = init_process_group(); // gloo on CPUs, NCCL on GPUs, from the environment
  auto mesh = init_device_mesh<Mesh>(world); // dp = world.size() / 2, checked

  Tensor<float, 2> full({8, 6}); // read on rank 0 only: full(i, j) = 10 i + j
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 6; ++j) {
      full(i, j) = 10.0f * i + j;
    }
  }
  auto x = distribute_tensor<Shard<0>, Replicate>(mesh, full); // one scatter from rank 0
  auto y = x.redistribute<Replicate, Shard<1>>();              // the plan printed below
  Tensor<float, 2> z = y.full_tensor();                        // every rank gets all of it

  double sum = 0;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 6; ++j) {
      sum += z(i, j);
    }
  }
  if (world.rank() == 0) {
    std::printf("x: %s\n", x.to_string().c_str());
    std::printf("y: %s\n", y.to_string().c_str());
    std::printf("plan: %s\n", x.plan_for<Replicate, Shard<1>>().to_string().c_str());
    std::printf("%s", visualize_sharding(y).c_str());
    std::printf("sum of y.full_tensor(): %g\n", sum);
  }
  return sum == 1800.0 ? 0 : 1;
}

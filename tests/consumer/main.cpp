// The consumer: a one-rank job through the public API (init_process_group without a launcher is rank 0
// of 1), a mesh, a redistribution.
#include <dtensor/comm/init.hpp>
#include <dtensor/tensor/distribute.hpp>

int main() {
  using namespace dtensor;
  ProcessGroup world = init_process_group();
  auto mesh = init_device_mesh<MeshShape<Axis<"dp">>>(world);
  auto x = ones<float, Shard<0>>(mesh, {4, 3});
  auto y = x.redistribute<Replicate>();
  return y.local()(3, 2) == 1.0f && world.size() == 1 ? 0 : 1;
}

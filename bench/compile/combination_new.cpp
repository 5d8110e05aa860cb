// Compile-cost probe: combination_first.cpp plus a second (element type, rank, mesh) combination with the
// same calls.
#define DTENSOR_PROBE_NEW
#include "combination_first.cpp"

using M3 = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp", 2>>;

Tensor<double, 3> second(const DeviceMesh<M3>& mesh, const Tensor<double, 3>& full) {
  auto x = distribute_tensor<Shard<0>, Shard<1>, Replicate>(mesh, full);
  auto y = x.redistribute<Replicate, Shard<2>, Shard<0>>();
  auto z = y.redistribute<Shard<1>, Shard<0>, Shard<2>>();
  return z.full_tensor();
}
int main() {
  return 0;
}

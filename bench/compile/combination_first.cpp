// Compile-cost probe (bench/compile/compile_time.sh): one (element type, rank, mesh) combination used the
// way a program uses it (distribute_tensor, redistribute, full_tensor). combination_new.cpp adds a second
// combination; the difference of the two compile times is the cost of a new combination.
#include <dtensor/dtensor.hpp>

using namespace dtensor;
using M2 = MeshShape<Axis<"dp">, Axis<"tp">>;

Tensor<float, 2> first(const DeviceMesh<M2>& mesh, const Tensor<float, 2>& full) {
  auto x = distribute_tensor<Shard<0>, Replicate>(mesh, full);
  auto y = x.redistribute<Replicate, Shard<1>>();
  auto z = y.redistribute<Shard<1>, Shard<0>>();
  return z.full_tensor();
}
#ifndef DTENSOR_PROBE_NEW
int main() {
  return 0;
}
#endif

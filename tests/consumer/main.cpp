// The consumer: a one-rank job through the public API (init_process_group without a launcher is rank 0
// of 1), a mesh, a redistribution; a local GEMM where dtensor::blas is linked, and a random fill where
// dtensor::random is, a checkpoint round trip where dtensor::checkpoint is.
#include <dtensor/comm/init.hpp>
#include <dtensor/tensor/distribute.hpp>
#if DTENSOR_HAS_BLAS
#include <dtensor/local/gemm.hpp>
#endif
#if DTENSOR_HAS_RANDOM123
#include <dtensor/local/random.hpp>
#endif
#if DTENSOR_HAS_CHECKPOINT
#include <dtensor/checkpoint/checkpoint.hpp>

#include <filesystem>
#include <string>
#include <unistd.h>
#endif

int main() {
  using namespace dtensor;
  ProcessGroup world = init_process_group();
  auto mesh = init_device_mesh<MeshShape<Axis<"dp">>>(world);
  auto x = ones<float, Shard<0>>(mesh, {4, 3});
  auto y = x.redistribute<Replicate>();
#if DTENSOR_HAS_BLAS
  static_assert(sizeof(bfloat16) == 2, "dtensor's bfloat16, not ambiguous with OpenBLAS's (gemm.hpp)");
  const Tensor<float, 2> p = local::matmul(y.local(), y.local(), false, true); // (4, 4), every element 3
  if (p(3, 0) != 3.0f) {
    return 1;
  }
#endif
#if DTENSOR_HAS_RANDOM123
  const Tensor<float, 1> u = local::rand<float, 1>({4}, 1);
  if (!(u(0) > 0.0f && u(0) < 1.0f)) {
    return 1;
  }
#endif
#if DTENSOR_HAS_CHECKPOINT
  const auto dir =
      std::filesystem::temp_directory_path() / ("dtensor_consumer_" + std::to_string(::getpid()));
  checkpoint::save(dir, {{"x", x}});
  const auto back = checkpoint::load<DTensor<float, 2, MeshShape<Axis<"dp">>, Replicate>>(dir, "x", mesh);
  std::filesystem::remove_all(dir);
  if (back.local()(3, 2) != 1.0f) {
    return 1;
  }
#endif
  return y.local()(3, 2) == 1.0f && world.size() == 1 ? 0 : 1;
}

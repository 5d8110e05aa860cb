// Saves a checkpoint from a (2,2) mesh and consolidates it into the safetensors file argv[1], for
// read_consolidated.py to open from Python. The values are read_consolidated.py's formula.
#include <dtensor/checkpoint/checkpoint.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>

using namespace dtensor;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;

namespace {

/// sin(flat index + seed) * 3 + 1/3, in T (as read_consolidated.py computes it).
template <class T>
Tensor<T, 2> values(std::int64_t rows, std::int64_t cols, int seed) {
  Tensor<T, 2> t({rows, cols});
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const double v = std::sin(static_cast<double>(i * cols + j + seed)) * 3.0 + 1.0 / 3.0;
      t(i, j) = static_cast<T>(std::is_integral_v<T> ? std::floor(v * 1000) : v);
    }
  }
  return t;
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT.safetensors\n", argv[0]);
    return 2;
  }
  const std::filesystem::path out = argv[1];
  const std::filesystem::path dir = out.string() + ".ckpt";
  testing::run_ranks(4, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
    checkpoint::save(
        dir, {{"w", distribute_tensor<Shard<0>, Shard<1>>(mesh, values<float>(7, 5, 0), replicated_source)},
              {"layer.1/b",
               distribute_tensor<Replicate, Shard<0>>(mesh, values<double>(3, 2, 1), replicated_source)},
              {"ids", distribute_tensor<Shard<1>, Replicate>(mesh, values<std::int64_t>(2, 3, 2),
                                                             replicated_source)}});
  });
  checkpoint::consolidate(dir, out);
  std::filesystem::remove_all(dir);
  return 0;
}

// A checkpoint across real processes (dtensor-run): `save DIR` on 4 ranks as (2,2) [S(0),S(1)]; `reload
// DIR DIR2` on 3 ranks loads [S(1)], checks it bit for bit and saves it again; `check DIR2` on 1 rank loads
// it whole and checks it. A rank that finds a difference exits 1 naming it.
#include <dtensor/checkpoint/checkpoint.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/tensor/distribute.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

using namespace dtensor;
namespace ckpt = dtensor::checkpoint;
using Mesh1 = MeshShape<Axis<"x">>;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;

namespace {

/// Non-integer values: sin(flat index + seed) * 3 + 1/3.
template <class T>
Tensor<T, 2> reference(std::int64_t rows, std::int64_t cols, int seed) {
  Tensor<T, 2> t({rows, cols});
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      t(i, j) = static_cast<T>(std::sin(static_cast<double>(i * cols + j + seed)) * 3.0 + 1.0 / 3.0);
    }
  }
  return t;
}

template <class T>
void expect_bits(const Tensor<T, 2>& got, const Tensor<T, 2>& want, const std::string& what) {
  DTENSOR_CHECK(got.shape() == want.shape() && std::memcmp(got.data(), want.data(), got.nbytes()) == 0,
                what + " differs from the saved values");
}

} // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const auto w = reference<float>(7, 5, 0);
  const auto b = reference<double>(3, 4, 1);
  try {
    ProcessGroup world = init_process_group();
    if (mode == "save" && argc == 3 && world.size() == 4) {
      auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
      ckpt::save(argv[2], {{"w", distribute_tensor<Shard<0>, Shard<1>>(mesh, w, replicated_source)},
                           {"b", distribute_tensor<Replicate, Shard<0>>(mesh, b, replicated_source)}});
    } else if (mode == "reload" && argc == 4 && world.size() == 3) {
      auto mesh = init_device_mesh<Mesh1>(world);
      auto lw = ckpt::load<DTensor<float, 2, Mesh1, Shard<1>>>(argv[2], "w", mesh);
      auto lb = ckpt::load<DTensor<double, 2, Mesh1, Shard<1>>>(argv[2], "b", mesh);
      expect_bits(lw.local(), distribute_tensor<Shard<1>>(mesh, w, replicated_source).local(),
                  "w on 3 ranks");
      expect_bits(lb.local(), distribute_tensor<Shard<1>>(mesh, b, replicated_source).local(),
                  "b on 3 ranks");
      ckpt::save(argv[3], {{"w", lw}, {"b", lb}});
    } else if (mode == "check" && argc == 3 && world.size() == 1) {
      auto mesh = init_device_mesh<Mesh1>(world);
      expect_bits(ckpt::load<DTensor<float, 2, Mesh1, Replicate>>(argv[2], "w", mesh).local(), w,
                  "w on 1 rank");
      expect_bits(ckpt::load<DTensor<double, 2, Mesh1, Replicate>>(argv[2], "b", mesh).local(), b,
                  "b on 1 rank");
    } else {
      std::fprintf(stderr, "usage: save DIR (4 ranks) | reload DIR DIR2 (3 ranks) | check DIR2 (1 rank)\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}

// local_map (ops/local_map.hpp): a user's local function on the shards with declared placements, against
// a single-process computation; the output's type is the declared one.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/local_map.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <string>
#include <type_traits>

using namespace dtensor;

namespace {

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

using Mesh1 = MeshShape<Axis<"x">>;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;

// Row sums of a block times a replicated scale vector's first element: a partial result per rank when the
// rows' columns are sharded.
Tensor<double, 1> row_sums(const Tensor<double, 2>& a, const Tensor<double, 1>& s) {
  Tensor<double, 1> out({a.shape()[0]});
  for (std::int64_t i = 0; i < a.shape()[0]; ++i) {
    double v = 0;
    for (std::int64_t j = 0; j < a.shape()[1]; ++j) {
      v += a(i, j);
    }
    out(i) = v * s(0);
  }
  return out;
}

} // namespace

TEST_CASE("local_map: declared placements in and out, uneven shards, no communication", "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    testing::run_ranks(n, [n](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      Tensor<double, 2> full({5, 7});
      for (std::int64_t e = 0; e < full.numel(); ++e) {
        full.data()[e] = double(e % 9 - 4);
      }
      const auto a = distribute_tensor<Shard<1>>(mesh, full, replicated_source);
      const auto s = distribute_tensor<Replicate>(mesh, Tensor<double, 1>::full({1}, 3.0), replicated_source);
      auto f = local_map<In<Shard<1>, Replicate>, Out<Partial<>>>(row_sums);
      CommDebugMode comm;
      auto y = f(a, s);
      static_assert(std::is_same_v<decltype(y), DTensor<double, 1, Mesh1, Partial<>>>);
      expect(comm.total_count() == 0, "local_map communicates nothing\n" + comm.to_string());
      const auto got = y.full_tensor();
      for (std::int64_t i = 0; i < 5; ++i) {
        double want = 0;
        for (std::int64_t j = 0; j < 7; ++j) {
          want += full(i, j);
        }
        expect(got(i) == 3 * want, "row " + std::to_string(i) + ": " + std::to_string(got(i)));
      }
      // A sharded output of uneven size: the function gives the global shape.
      auto g = local_map<In<Shard<1>>, Out<Shard<1>>>([&](const Tensor<double, 2>& t) {
        return LocalResult<double, 2>{t.clone(), {5, 7}};
      });
      const auto copy = g(a);
      expect(copy.global_shape() == std::array<std::int64_t, 2>{5, 7}, "the declared global shape");
      const auto back = copy.full_tensor();
      for (std::int64_t e = 0; e < full.numel(); ++e) {
        expect(back.data()[e] == full.data()[e], "the sharded output round-trips");
      }
      (void)n;
    });
  }
  testing::run_ranks(4, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
    const auto a =
        distribute_tensor<Shard<0>, Shard<1>>(mesh, Tensor<double, 2>::full({4, 6}, 2.0), replicated_source);
    auto f = local_map<In<Placements<Shard<0>, Shard<1>>>, Out<Placements<Shard<0>, Shard<1>>>>(
        [](const Tensor<double, 2>& t) {
          auto u = t.clone();
          u.fill(5.0);
          return u;
        });
    auto y = f(a);
    static_assert(std::is_same_v<decltype(y), DTensor<double, 2, Mesh2, Shard<0>, Shard<1>>>);
    const auto full = y.full_tensor();
    for (std::int64_t e = 0; e < full.numel(); ++e) {
      expect(full.data()[e] == 5.0, "2-D mesh local_map");
    }
  });
}

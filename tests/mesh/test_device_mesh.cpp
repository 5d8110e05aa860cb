// DeviceMesh over in-process gloo ranks: per-axis groups, slice and flatten give the groups and local
// ranks PyTorch's DeviceMesh gives; sizes are resolved or rejected with clear errors.

#include <catch2/catch.hpp>

#include <dtensor/comm/collectives.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <string>
#include <vector>

using namespace dtensor;

namespace {

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

std::vector<int> ranks_of(const ProcessGroup& g) {
  return {g.ranks().begin(), g.ranks().end()};
}

std::string str(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    s += (i ? "," : "") + std::to_string(v[i]);
  }
  return s + "]";
}

// The group along `axis` of `rank` on `sizes`, by brute force (PyTorch's rule: ranks that share every
// other coordinate, in rank order).
std::vector<int> expected_group(int rank, int axis, const MeshSizes& sizes) {
  std::vector<int> out;
  const MeshCoord c = rank_to_coord(rank, sizes);
  for (int r = 0; r < mesh_numel(sizes); ++r) {
    MeshCoord d = rank_to_coord(r, sizes);
    d[axis] = c[axis];
    if (d == c) {
      out.push_back(r);
    }
  }
  return out;
}

template <class Mesh>
void check_axis_groups(const Mesh& mesh, int world_rank) {
  for (int a = 0; a < Mesh::ndim; ++a) {
    const auto want = expected_group(world_rank, a, mesh.sizes());
    const auto got = ranks_of(mesh.group(a));
    expect(got == want, "rank " + std::to_string(world_rank) + " axis " + std::to_string(a) + ": group " +
                            str(got) + ", expected " + str(want));
    expect(mesh.group(a).rank() == mesh.coordinate()[a], "group rank differs from the coordinate");
  }
  expect(mesh.rank() == world_rank, "mesh rank differs from the world rank");
}

} // namespace

TEST_CASE("2x2 mesh: dp groups {0,2},{1,3}, tp groups {0,1},{2,3}", "[mesh][dist]") {
  using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;
  testing::run_ranks(4, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world);
    const int r = world.rank();
    expect(mesh.size<"dp">() == 2 && mesh.size<"tp">() == 2 && mesh.size() == 4, "sizes");
    expect(mesh.local_rank<"dp">() == r / 2 && mesh.local_rank<"tp">() == r % 2, "local ranks");
    const std::vector<std::vector<int>> dp{{0, 2}, {1, 3}, {0, 2}, {1, 3}};
    const std::vector<std::vector<int>> tp{{0, 1}, {0, 1}, {2, 3}, {2, 3}};
    expect(ranks_of(mesh.group<"dp">()) == dp[r], "dp group of rank " + std::to_string(r));
    expect(ranks_of(mesh.group<"tp">()) == tp[r], "tp group of rank " + std::to_string(r));
    check_axis_groups(mesh, r);
    expect(mesh.to_string() ==
               "DeviceMesh(dp=2, tp=2) at (" + std::to_string(r / 2) + ", " + std::to_string(r % 2) + ")",
           mesh.to_string());

    // The groups work: a sum over tp adds the two ranks of the row.
    auto t = Tensor<float, 1>::full({3}, static_cast<float>(r));
    all_reduce(t, ReduceOp::sum, mesh.group<"tp">());
    expect(t(0) == static_cast<float>(r / 2 * 4 + 1), "tp all_reduce");

    // slice: typed sub-meshes sharing the groups.
    auto tp_mesh = mesh.slice<"tp">();
    static_assert(decltype(tp_mesh)::ndim == 1);
    static_assert(std::is_same_v<decltype(tp_mesh)::shape_type, MeshShape<Axis<"tp", 2>>>);
    expect(tp_mesh.group<"tp">() == mesh.group<"tp">(), "slice shares the tp group");
    expect(tp_mesh.local_rank<"tp">() == r % 2 && tp_mesh.size() == 2, "slice local rank");
    auto swapped = mesh.slice<"tp", "dp">();
    expect(swapped.coordinate() == MeshCoord{r % 2, r / 2}, "slice<tp,dp> coordinate");

    // flatten: one merged axis "dp_tp" with its own group, row-major over (dp, tp).
    auto flat = mesh.flatten<"dp", "tp">();
    static_assert(std::is_same_v<decltype(flat)::shape_type, MeshShape<Axis<"dp_tp">>>);
    expect(ranks_of(flat.group<"dp_tp">()) == std::vector<int>{0, 1, 2, 3}, "flattened group");
    expect(flat.local_rank<"dp_tp">() == r, "flattened local rank");
    auto flat_swapped = mesh.flatten<"tp", "dp">();
    expect(ranks_of(flat_swapped.group<"tp_dp">()) == std::vector<int>{0, 2, 1, 3},
           "flatten<tp,dp> orders by tp first: " + str(ranks_of(flat_swapped.group<"tp_dp">())));
    expect(mesh.group_over(axis_bit(0) | axis_bit(1)) == flat.group<"dp_tp">(),
           "group_over reuses flatten's group");
  });
}

TEST_CASE("(2,3) and 3-axis meshes give PyTorch's groups", "[mesh][dist]") {
  testing::run_ranks(6, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<MeshShape<Axis<"dp", 2>, Axis<"tp">>>(world);
    expect(mesh.size<"tp">() == 3, "tp deduced as 3");
    check_axis_groups(mesh, world.rank());
    auto flat = mesh.flatten<"dp", "tp">();
    expect(flat.size() == 6 && flat.local_rank<"dp_tp">() == world.rank(), "flatten (2,3)");
  });
  testing::run_ranks(8, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>>(world, 2, 2);
    expect(mesh.sizes() == MeshSizes{2, 2, 2}, "sizes (2,2,2)");
    check_axis_groups(mesh, world.rank());
    auto dp_tp = mesh.slice<"dp", "tp">();
    check_axis_groups(mesh.slice<"pp", "dp", "tp">(), world.rank());
    expect(dp_tp.group<"tp">() == mesh.group<"tp">(), "slice shares groups");
    // flatten<"dp","tp"> on the 3-axis mesh: the ranks sharing pp, row-major over (dp, tp).
    auto flat = mesh.flatten<"dp", "tp">();
    const int base = world.rank() / 4 * 4;
    expect(ranks_of(flat.group<"dp_tp">()) == std::vector<int>{base, base + 1, base + 2, base + 3},
           "flatten dp,tp of a 3-axis mesh");
  });
  testing::run_ranks(4, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<MeshShape<Axis<"a", 2>, Axis<"b", 1>, Axis<"c", 2>>>(world);
    check_axis_groups(mesh, world.rank());
  });
}

TEST_CASE("mesh sizes that cannot span the world are errors", "[mesh][dist]") {
  testing::run_ranks(1, [](ProcessGroup& world) {
    auto m = init_device_mesh<MeshShape<Axis<"dp">>>(world);
    expect(m.size() == 1 && m.group<"dp">().size() == 1, "1-rank mesh");
  });
  auto fails_with = [](int n, auto make, const std::string& what) {
    try {
      testing::run_ranks(n, make);
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(what) != std::string::npos);
      return;
    }
    FAIL("no error for " << what);
  };
  fails_with(
      6, [](ProcessGroup& w) { init_device_mesh<MeshShape<Axis<"dp">, Axis<"tp", 4>>>(w); },
      "the world size 6 is not a multiple of the product of the other axis sizes (4)");
  fails_with(
      4, [](ProcessGroup& w) { init_device_mesh<MeshShape<Axis<"dp", 2>, Axis<"tp", 3>>>(w); },
      "the axis sizes multiply to 6 but the process group has 4 ranks");
  fails_with(
      4, [](ProcessGroup& w) { init_device_mesh<MeshShape<Axis<"dp">, Axis<"tp">>>(w); },
      "more than one axis size is unknown");
  fails_with(
      4, [](ProcessGroup& w) { init_device_mesh<MeshShape<Axis<"dp">, Axis<"tp">>>(w, 3); },
      "the world size 4 is not a multiple of the product of the other axis sizes (3)");
  fails_with(
      2, [](ProcessGroup& w) { init_device_mesh<MeshShape<Axis<"dp">>>(w, 0); },
      "dynamic axis size 0 must be > 0");
}

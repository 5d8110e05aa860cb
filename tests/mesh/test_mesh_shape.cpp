// The compile-time vocabulary: axes, mesh shapes, placement types and their validation.

#include <catch2/catch.hpp>

#include <dtensor/layout/placement_check.hpp>
#include <dtensor/mesh/mesh_shape.hpp>

#include <type_traits>

using namespace dtensor;

using Mesh2D = MeshShape<Axis<"dp">, Axis<"tp", 4>>;
using Mesh3D = MeshShape<Axis<"pp", 2>, Axis<"dp", 3>, Axis<"tp", 4>>;

TEST_CASE("Axis carries a name and a static or dynamic size", "[mesh]") {
  STATIC_REQUIRE(Axis<"tp", 4>::name == "tp");
  STATIC_REQUIRE(Axis<"tp", 4>::size == 4);
  STATIC_REQUIRE(Axis<"tp", 4>::is_static);
  STATIC_REQUIRE(Axis<"dp">::size == dynamic_size);
  STATIC_REQUIRE_FALSE(Axis<"dp">::is_static);
}

TEST_CASE("MeshShape looks axes up by name and multiplies static sizes", "[mesh]") {
  STATIC_REQUIRE(Mesh2D::rank == 2);
  STATIC_REQUIRE(Mesh2D::index_of<"dp">() == 0);
  STATIC_REQUIRE(Mesh2D::index_of<"tp">() == 1);
  STATIC_REQUIRE(Mesh2D::has_axis<"tp">);
  STATIC_REQUIRE_FALSE(Mesh2D::has_axis<"pp">);
  STATIC_REQUIRE(Mesh2D::num_dynamic == 1);
  STATIC_REQUIRE_FALSE(Mesh2D::is_static);
  STATIC_REQUIRE(Mesh2D::static_product == 4);
  STATIC_REQUIRE(Mesh2D::sizes() == MeshSizes{dynamic_size, 4});
  STATIC_REQUIRE(Mesh3D::static_product == 24);
  STATIC_REQUIRE(Mesh3D::is_static);
  STATIC_REQUIRE(Mesh3D::index_of<"tp">() == 2);
  CHECK(Mesh2D::to_string() == "(dp=?, tp=4)");
  CHECK(Mesh3D::to_string() == "(pp=2, dp=3, tp=4)");
}

TEST_CASE("placement types name placement values", "[mesh]") {
  STATIC_REQUIRE(Shard<1>::dim == 1);
  STATIC_REQUIRE(Shard<-1>::value == Placement::shard(-1));
  STATIC_REQUIRE(Partial<>::op == ReduceOp::sum);
  STATIC_REQUIRE(Partial<ReduceOp::avg>::value == Placement::partial(ReduceOp::avg));
  STATIC_REQUIRE_FALSE(Partial<ReduceOp::avg>::value == Placement::partial(ReduceOp::sum));
  STATIC_REQUIRE(PlacementType<Replicate>);
  STATIC_REQUIRE_FALSE(PlacementType<int>);
  STATIC_REQUIRE(normalize(Placement::shard(-1), 3) == Placement::shard(2));
  STATIC_REQUIRE(placement_list_v<Shard<0>, Replicate>.size() == 2);
}

TEST_CASE("valid placement lists pass validation", "[mesh]") {
  STATIC_REQUIRE(validate_placements<Mesh2D, 2, Shard<0>, Shard<1>>());
  STATIC_REQUIRE(validate_placements<Mesh2D, 2, Shard<0>, Shard<0>>());
  STATIC_REQUIRE(validate_placements<Mesh2D, 2, Shard<-1>, Replicate>());
  STATIC_REQUIRE(validate_placements<Mesh2D, 1, Partial<ReduceOp::sum>, Partial<ReduceOp::avg>>());
  STATIC_REQUIRE(validate_placements<Mesh3D, 3, Partial<ReduceOp::max>, Replicate, Partial<ReduceOp::max>>());
  STATIC_REQUIRE(validate_placements<Mesh3D, 0, Replicate, Replicate, Partial<>>());
}

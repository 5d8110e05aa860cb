// The opt-in fewest_bytes policy (ops/fewest_bytes.hpp): its choices pinned at compile time (the cheapest fix
// by the planner's bytes per rank, nothing moved when a rule already matches, large static meshes costed in
// constant evaluation), and ops called with it against a single-process computation on 1-4 ranks and (2,2).
#include <catch2/catch.hpp>

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/fewest_bytes.hpp>
#include <dtensor/ops/matmul.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

using Four = MeshShape<Axis<"x", 4>>;
using Big = MeshShape<Axis<"a", 8>, Axis<"b", 16>, Axis<"c", 8>>;

template <class... Ps>
constexpr PlacementList pl = placement_list_v<Ps...>;

// matmul [S(1)] x [S(1)]: A shards k, B shards n. Fixes: B -> S(0) (one all_to_all of B, C Partial), A -> R
// (all_gather of A, C S(1)), or worse. The all_to_all moves 3/16 of B per rank, the all_gather 3/4 of A.
constexpr FitChoice mm = fewest_bytes_choice<Four>(op_spec::matmul(2, 2), {pl<S<1>>, pl<S<1>>}, {2, 2});
static_assert(mm.found() && mm.to[0] == pl<S<1>> && mm.to[1] == pl<S<0>> && mm.out == pl<P>);
static_assert(mm.bytes == nominal_extent * nominal_extent * 3 / 16 * 4);

// Inputs that match a rule stay.
constexpr FitChoice same = fewest_bytes_choice<Four>(op_spec::matmul(2, 2), {pl<R>, pl<S<1>>}, {2, 2});
static_assert(same.bytes == 0 && same.to[0] == pl<R> && same.to[1] == pl<S<1>> && same.out == pl<S<1>>);

// add [S(0)] + [S(1)]: both ways cost one all_to_all; the first label (dim 0) wins the tie.
constexpr FitChoice ab =
    fewest_bytes_choice<Four>(op_spec::pointwise(Linearity::additive, {2, 2}), {pl<S<0>>, pl<S<1>>}, {2, 2});
static_assert(ab.to[0] == pl<S<0>> && ab.to[1] == pl<S<0>> && ab.out == pl<S<0>>);

// Partial + Replicate: reduce_scatter the Partial and take a local chunk of the Replicate ((n-1)/n of the
// tensor) beats all_reduce (2(n-1)/n).
constexpr FitChoice pr =
    fewest_bytes_choice<Four>(op_spec::pointwise(Linearity::additive, {2, 2}), {pl<P>, pl<R>}, {2, 2});
static_assert(pr.to[0] == pl<S<0>> && pr.to[1] == pl<S<0>> && pr.out == pl<S<0>>);
static_assert(pr.bytes == nominal_extent * nominal_extent * 3);

// A bias (rank 1) against a matrix sharded on its rows and columns of a 2-D mesh.
constexpr FitChoice bias = fewest_bytes_choice<MeshShape<Axis<"dp", 2>, Axis<"tp", 4>>>(
    op_spec::pointwise(Linearity::additive, {2, 1}), {pl<S<0>, S<1>>, pl<S<0>, R>}, {2, 1});
static_assert(bias.to[0] == pl<S<0>, S<1>> && bias.to[1] == pl<R, S<0>> && bias.out == pl<S<0>, S<1>>);

// A (8, 16, 8) static mesh: 1024 ranks, costed in constant evaluation.
constexpr FitChoice big =
    fewest_bytes_choice<Big>(op_spec::matmul(2, 2), {pl<S<1>, S<0>, R>, pl<S<1>, R, S<0>>}, {2, 2});
static_assert(big.found() && big.bytes > 0);

template <class Mesh, class... Sizes>
void fit_cases(int ranks, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    constexpr bool two = Mesh::rank == 2;
    using Cols = std::conditional_t<two, Placements<R, S<1>>, Placements<S<1>>>;
    using Rows = std::conditional_t<two, Placements<S<0>, R>, Placements<S<0>>>;
    using Part = std::conditional_t<two, Placements<P, R>, Placements<P>>;
    using Rep = std::conditional_t<two, Placements<R, R>, Placements<R>>;
    using A = typename dt<Mesh, 2, Cols>::type;
    using B = typename dt<Mesh, 2, Cols>::type;
    const std::int64_t m = 5;
    const std::int64_t k = 3;
    const std::int64_t n = 4;
    auto c = matmul(make<A>(mesh, {m, k}, 1), make<B>(mesh, {k, n}, 2), fewest_bytes);
    // On (dp, tp) the cheapest also cuts B's columns over dp first (a local chunk), so less moves on tp.
    using MatOut = std::conditional_t<two, Placements<S<1>, P>, Placements<P>>;
    static_assert(std::is_same_v<decltype(c), typename dt<Mesh, 2, MatOut>::type>);
    check_full(
        c,
        [&](std::int64_t e) {
          double s = 0;
          for (std::int64_t i = 0; i < k; ++i) {
            s += value(1, (e / n) * k + i) * value(2, i * n + e % n);
          }
          return s;
        },
        0, "matmul [S(1)] x [S(1)] with fewest_bytes");
    using X = typename dt<Mesh, 2, Part>::type;
    using Y = typename dt<Mesh, 2, Rep>::type;
    auto z = add(make<X>(mesh, {m, k}, 3), make<Y>(mesh, {m, k}, 4), fewest_bytes);
    // On (dp, tp) (dynamic: costed as 4 x 4): a local chunk on tp, then a reduce_scatter of that quarter
    // over dp (3/16 of the tensor; the all_reduce of a quarter that [R,S(0)] needs moves 3/8).
    using AddOut = std::conditional_t<two, Placements<S<0>, S<1>>, Placements<S<0>>>;
    static_assert(std::is_same_v<decltype(z), typename dt<Mesh, 2, AddOut>::type>);
    check_full(
        z, [](std::int64_t e) { return value(3, e) + value(4, e); }, 0,
        "Partial + Replicate with fewest_bytes");
    // linear with its weight sharded on the input features against a row-sharded x: x -> shard its k.
    using W = typename dt<Mesh, 2, Cols>::type;
    auto y = linear(make<typename dt<Mesh, 2, Rows>::type>(mesh, {m, k}, 5), make<W>(mesh, {n, k}, 6),
                    fewest_bytes);
    check_full(
        y,
        [&](std::int64_t e) {
          double s = 0;
          for (std::int64_t i = 0; i < k; ++i) {
            s += value(5, (e / n) * k + i) * value(6, (e % n) * k + i);
          }
          return s;
        },
        0, "linear with fewest_bytes");
  });
}

} // namespace

TEST_CASE("fewest_bytes: the choice is printable", "[ops]") {
  const std::string s = to_string(mm, Four::names);
  INFO(s);
  CHECK(s.find("operand 1 [S(1)] -> [S(0)]: all_to_all(x") != std::string::npos);
  CHECK(s.find("out [P(sum)]") != std::string::npos);
  CHECK(to_string(same, Four::names).find("the inputs match a rule") != std::string::npos);
}

TEST_CASE("fewest_bytes: ops with inputs that match no rule, on 1-4 ranks and (2,2)", "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    fit_cases<Mesh1>(n);
  }
  fit_cases<Mesh2>(4, 2, 2);
}

// The cost model in closed form (bytes_per_rank, most_elements_received in plan/cost.hpp) against its
// oracle, which visits every rank of the mesh and finds each exchange's pieces rank by rank
// (test_support::reference_bytes_per_rank, step_elements_received). Step by step and in total, for the
// planner's plan (with either all_reduce order where they differ) and the one-permute fallback of every
// pair of placement lists of {R, P, S(d)} (so also dims sharded by several axes, in either order on the way):
// meshes of 1-2 axes of sizes 1-4 with tensors of rank 1-3, every 3-axis mesh of sizes 1-4 with rank-2
// tensors and a few with rank-3 ones, a few larger meshes; global shapes even, uneven, with empty shards
// and with zero-size dims. The exchange steps on meshes of up to 16 ranks are also checked without the
// Pareto fronts (every coordinate at once), and static_asserts evaluate (8, 16, 8) cases at compile time.

#include <catch2/catch.hpp>

#include <dtensor/plan/cost.hpp>
#include <dtensor/plan/planner.hpp>

#include "../support/enumerate.hpp"
#include "../support/exchange_reference.hpp"

#include <algorithm>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
constexpr Placement S(int d) {
  return Placement::shard(d);
}

std::string describe(const MeshSizes& sizes, const Extents& global) {
  std::string s = "mesh (";
  for (int a = 0; a < sizes.size(); ++a) {
    s += (a ? "," : "") + std::to_string(sizes[a]);
  }
  s += "), global (";
  for (int d = 0; d < global.size(); ++d) {
    s += (d ? "," : "") + std::to_string(global[d]);
  }
  return s + ")";
}

/// The oracle of most_elements_received: step_elements_received on every rank.
std::int64_t most_by_ranks(const Step& st, const Extents& global, const MeshSizes& sizes) {
  std::int64_t most = 0;
  for (int r = 0; r < mesh_numel(sizes); ++r) {
    most = std::max(most, step_elements_received(st, global, sizes, rank_to_coord(r, sizes)));
  }
  return most;
}

/// What the comparisons covered.
struct Coverage {
  std::int64_t steps = 0;
  std::int64_t nonzero = 0;          ///< steps where some rank receives something
  std::int64_t by_kind[7] = {};      ///< steps per StepKind
  std::int64_t uneven = 0;           ///< exchange steps whose ranks lack different amounts
  std::int64_t fallback_checked = 0; ///< steps also checked without the Pareto fronts
  std::int64_t unordered = 0;        ///< exchange steps with a dim split in decreasing axis order
};

bool has_unordered_dim(const Step& st) {
  for (const ShardSpec* spec : {&st.before, &st.after}) {
    for (const AxisOrder& o : spec->order) {
      for (int i = 1; i < o.size(); ++i) {
        if (o[i - 1] > o[i]) {
          return true;
        }
      }
    }
  }
  return false;
}

/// Compares closed form and oracle on every step of the plans of src -> dst, and the plans' totals.
void check_pair(const PlacementList& src, const PlacementList& dst, const MeshSizes& sizes,
                const std::vector<Extents>& shapes, Coverage& cov, bool also_fallback) {
  const int rank = shapes.front().size();
  std::vector<Plan> plans{make_plan(src, dst, rank, sizes, AllReduceOrder::first),
                          make_exchange_plan(src, dst, rank)};
  if (plans[0].order_depends_on_sizes) { // the other all_reduce order is another plan
    plans.push_back(make_plan(src, dst, rank, sizes, AllReduceOrder::last));
  }
  for (const Plan& plan : plans) {
    if (plan.error != PlanError::none) {
      continue;
    }
    for (const Extents& global : shapes) {
      INFO(to_string(plan.src) << " -> " << to_string(plan.dst) << " on " << describe(sizes, global));
      for (const Step& st : plan.steps) {
        INFO("step " << to_string(st.kind));
        const std::int64_t oracle = most_by_ranks(st, global, sizes);
        REQUIRE(most_elements_received(st, global, sizes) == oracle);
        const bool exchange = st.kind == StepKind::all_gather || st.kind == StepKind::all_to_all ||
                              st.kind == StepKind::permute;
        if (exchange && also_fallback) { // every coordinate, no front kept (HeldFront of one point)
          REQUIRE(detail::most_lacking<1>(st, global, sizes) == oracle);
          ++cov.fallback_checked;
        }
        cov.unordered += exchange && has_unordered_dim(st);
        if (exchange && oracle > 0) {
          std::int64_t least = oracle;
          for (int r = 0; r < mesh_numel(sizes); ++r) {
            least = std::min(least, step_elements_received(st, global, sizes, rank_to_coord(r, sizes)));
          }
          cov.uneven += least < oracle;
        }
        ++cov.steps;
        cov.nonzero += oracle > 0;
        ++cov.by_kind[static_cast<int>(st.kind)];
      }
      REQUIRE(bytes_per_rank(plan, global, sizes, 4) ==
              test_support::reference_bytes_per_rank(plan, global, sizes, 4));
    }
  }
}

std::vector<Placement> options(int rank) {
  std::vector<Placement> o{R, P};
  for (int d = 0; d < rank; ++d) {
    o.push_back(S(d));
  }
  return o;
}

/// Every mesh of `axes` axes with sizes 1-4.
std::vector<MeshSizes> meshes(int axes) {
  std::vector<MeshSizes> out;
  const int n = axes == 1 ? 4 : axes == 2 ? 16 : 64;
  for (int i = 0; i < n; ++i) {
    MeshSizes s;
    for (int a = 0, k = i; a < axes; ++a, k /= 4) {
      s.push_back(1 + k % 4);
    }
    out.push_back(s);
  }
  return out;
}

// Shapes per tensor rank: even splits, uneven ones, dims smaller than their number of shards (empty
// shards) and zero-size dims.
const std::vector<Extents> shapes1{{0}, {1}, {3}, {8}, {13}, {48}};
const std::vector<Extents> shapes2{{0, 6}, {1, 1}, {3, 10}, {8, 12}, {13, 7}, {5, 0}};
const std::vector<Extents> shapes3{{0, 4, 4}, {1, 2, 3}, {8, 12, 16}, {7, 5, 3}, {9, 1, 6}};

void check_all_pairs(const std::vector<MeshSizes>& mesh_list, const std::vector<Extents>& shapes,
                     Coverage& cov) {
  const int rank = shapes.front().size();
  for (const MeshSizes& sizes : mesh_list) {
    const auto lists = test_support::all_placement_lists(sizes.size(), options(rank));
    for (const PlacementList& src : lists) {
      for (const PlacementList& dst : lists) {
        check_pair(src, dst, sizes, shapes, cov, mesh_numel(sizes) <= 16);
      }
    }
  }
}

void check_coverage(const Coverage& cov) {
  for (StepKind k : {StepKind::local_partial, StepKind::local_chunk, StepKind::reduce_scatter,
                     StepKind::all_to_all, StepKind::permute, StepKind::all_gather, StepKind::all_reduce}) {
    INFO(to_string(k));
    CHECK(cov.by_kind[static_cast<int>(k)] > 0);
  }
  CHECK(cov.nonzero > cov.steps / 4);
  CHECK(cov.uneven > 0);
  CHECK(cov.fallback_checked > 0);
  CHECK(cov.unordered > 0);
}

// A permute of one 3-D tensor on an (8, 16, 8) mesh: each axis moves from one dim to another, so every
// dim and every axis is in one component (1,024 coordinates).
constexpr Plan rotate = make_plan(PlacementList{S(0), S(1), S(2)}, PlacementList{S(1), S(2), S(0)}, 3);
// The overhead benchmark's permute: [R,S(1),S(2)] -> [S(0),S(2),S(1)].
constexpr Plan swap = make_plan(PlacementList{R, S(1), S(2)}, PlacementList{S(0), S(2), S(1)}, 3);
constexpr MeshSizes big{8, 16, 8};

static_assert(rotate.size() == 1 && rotate.steps[0].kind == StepKind::permute);
static_assert(bytes_per_rank(rotate, Extents{4096, 4096, 4096}, big, 4) == 4LL * 4096 * 4096 * 4096 / 1024);
static_assert(bytes_per_rank(rotate, Extents{1000, 999, 37}, big, 4) > 0);
static_assert(bytes_per_rank(swap, Extents{4096, 4096, 4096}, big, 4) > 0);
static_assert(bytes_per_rank(make_exchange_plan(PlacementList{S(0), S(1), S(2)},
                                                PlacementList{S(2), S(0), S(0)}, 3),
                             Extents{100, 30, 7}, big, 2) > 0);

} // namespace

TEST_CASE("bytes_per_rank in closed form equals the rank-by-rank oracle: 1-2 axes, ranks 1-3",
          "[plan][cost]") {
  Coverage cov;
  for (int axes : {1, 2}) {
    check_all_pairs(meshes(axes), shapes1, cov);
    check_all_pairs(meshes(axes), shapes2, cov);
    check_all_pairs(meshes(axes), shapes3, cov);
  }
  check_coverage(cov);
  CHECK(cov.steps > 100000);
}

TEST_CASE("bytes_per_rank in closed form equals the rank-by-rank oracle: 3 axes", "[plan][cost]") {
  Coverage cov;
  check_all_pairs(meshes(3), {{0, 6}, {13, 7}}, cov);
  check_all_pairs({{2, 2, 2}, {1, 3, 2}, {4, 2, 3}}, {{1, 2, 3}, {8, 12, 16}, {9, 1, 6}}, cov);
  check_coverage(cov);
}

TEST_CASE("bytes_per_rank in closed form equals the rank-by-rank oracle: larger meshes", "[plan][cost]") {
  Coverage cov;
  const std::vector<Extents> shapes{{64, 48, 40}, {100, 33, 7}, {5, 200, 3}};
  for (const MeshSizes& sizes : {MeshSizes{16}, MeshSizes{5, 7}, MeshSizes{8, 6}, MeshSizes{6, 4, 2}}) {
    const auto lists = test_support::all_placement_lists(sizes.size(), {R, S(0), S(1), S(2)});
    for (const PlacementList& src : lists) {
      for (const PlacementList& dst : lists) {
        check_pair(src, dst, sizes, shapes, cov, false);
      }
    }
  }
  CHECK(cov.nonzero > 1000);
  // The (8, 16, 8) plans of the static_asserts above.
  for (const Plan* plan : {&rotate, &swap}) {
    for (const Extents& global : {Extents{4096, 4096, 4096}, Extents{1000, 999, 37}, Extents{7, 300, 64}}) {
      INFO(to_string(plan->src) << " -> " << to_string(plan->dst) << " on " << describe(big, global));
      CHECK(bytes_per_rank(*plan, global, big, 4) ==
            test_support::reference_bytes_per_rank(*plan, global, big, 4));
    }
  }
}

TEST_CASE("most_elements_received by step kind", "[plan][cost]") {
  const MeshSizes sizes{2, 3};
  // all_gather of S(0) over 3 ranks, 10 rows: chunks 4, 4, 2; the rank with 2 rows lacks 8 rows of 5.
  const Plan ag = make_plan(PlacementList{R, S(0)}, PlacementList{R, R}, 2);
  REQUIRE(ag.size() == 1);
  CHECK(most_elements_received(ag.steps[0], {10, 5}, sizes) == 8 * 5);
  // reduce_scatter over 2 ranks of 7 rows: 1 partial copy of the largest chunk (4 rows).
  const Plan rs = make_plan(PlacementList{P, R}, PlacementList{S(0), R}, 2);
  CHECK(most_elements_received(rs.steps[0], {7, 5}, sizes) == 4 * 5);
  // all_reduce over 3 ranks: 2(n-1)/n of the block, rounded up.
  const Plan ar = make_plan(PlacementList{R, P}, PlacementList{R, R}, 2);
  CHECK(most_elements_received(ar.steps[0], {7, 5}, sizes) == (2 * 2 * 35 + 2) / 3);
  // S(0) -> S(1) over 3 ranks on (10, 6): every rank targets 10 x 2; rank 2 holds 2 x 2 of it.
  const Plan a2a = make_plan(PlacementList{R, S(0)}, PlacementList{R, S(1)}, 2);
  REQUIRE(a2a.steps[0].kind == StepKind::all_to_all);
  CHECK(most_elements_received(a2a.steps[0], {10, 6}, sizes) == 10 * 2 - 2 * 2);
  // The example of bytes_per_rank's doc block.
  constexpr Plan p = make_plan({Placement::shard(0)}, {Placement::shard(1)}, 2);
  STATIC_REQUIRE(bytes_per_rank(p, {8, 6}, {2}, 4) == 4 * 4 * 3);
  // A local chunk costs nothing.
  const Plan lc = make_plan(PlacementList{R, R}, PlacementList{S(1), R}, 2);
  CHECK(bytes_per_rank(lc, {10, 6}, sizes, 4) == 0);
}

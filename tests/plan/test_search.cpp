// The planner against the cheapest plan found by exhaustive search (plan/search.hpp): for every pair of
// {R, P, S(0), S(1)} lists on meshes (2), (4), (2,2), (4,2), (2,3) and (2,2,2), the planner's bytes per rank
// equal the search's on even shapes (every dim split evenly: the planner ranks its candidates on one) and
// stay within the measured margin on uneven ones. The search itself: its plan is a chain of exact layouts
// from source to target, it never costs more than the planner's plan (whose steps it may all take), and a
// few answers are checked by hand. Pinned: the two Partial-source rows of bench_redistribution that sat
// at 1.5x the bench's lower bound are at the cheapest plan of collectives in sequence, so that bound is
// the higher one (docs/plan.md, "Partial sources").

#include <catch2/catch.hpp>

#include <dtensor/plan/cost.hpp>
#include <dtensor/plan/planner.hpp>
#include <dtensor/plan/search.hpp>

#include "../support/enumerate.hpp"

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
const std::vector<std::string> names{"dp", "tp", "cp"};

std::string describe(const PlacementList& src, const PlacementList& dst, const MeshSizes& sizes,
                     const Extents& global) {
  std::string s = to_string(src) + " -> " + to_string(dst) + " on (";
  for (int a = 0; a < sizes.size(); ++a) {
    s += (a ? "," : "") + std::to_string(sizes[a]);
  }
  s += ") for (";
  for (int d = 0; d < global.size(); ++d) {
    s += (d ? "," : "") + std::to_string(global[d]);
  }
  return s + ")";
}

/// The search's steps chain from the source layout to the target, each changing only what its kind may.
void check_chain(const SearchResult& r, const PlacementList& src, const PlacementList& dst, int rank) {
  ShardSpec cur = ShardSpec::from(src, rank);
  for (const Step& st : r.steps) {
    REQUIRE(st.before == cur);
    for (int a = 0; a < cur.mesh_rank(); ++a) {
      const Placement from = st.before.placements[a];
      const Placement to = st.after.placements[a];
      const bool in_group = (st.axes & axis_bit(a)) != 0;
      switch (st.kind) {
      case StepKind::all_reduce:
        CHECK((in_group ? from.is_partial() && to.is_replicate() : from == to));
        break;
      case StepKind::reduce_scatter:
        CHECK((in_group ? from.is_partial() && to.is_shard(st.dst_dim) : from == to));
        break;
      case StepKind::local_partial:
        CHECK((in_group ? from.is_replicate() && to.is_partial() : from == to));
        break;
      default: // a Shard/Replicate change: Partial axes stay
        CHECK(from.is_partial() == to.is_partial());
      }
    }
    cur = st.after;
  }
  CHECK(cur == ShardSpec::from(dst, rank));
}

struct Tally {
  int pairs = 0;
  int equal = 0;
  double worst = 1.0; ///< the largest planner / search ratio
  std::string worst_case;
};

void compare_all(const MeshSizes& sizes, const Extents& global, Tally& t, bool chains) {
  const auto lists = test_support::all_placement_lists(sizes.size(), {R, P, S(0), S(1)});
  for (const PlacementList& src : lists) {
    for (const PlacementList& dst : lists) {
      const Plan plan = make_plan(src, dst, global.size(), sizes);
      if (plan.error != PlanError::none) {
        continue;
      }
      const SearchResult best = cheapest_plan(src, dst, global, sizes, 4);
      const std::int64_t planned = bytes_per_rank(plan, global, sizes, 4);
      INFO(describe(src, dst, sizes, global) << ": " << to_string(plan, names));
      REQUIRE(best.error == PlanError::none);
      REQUIRE(best.bytes <= planned); // every step of the planner's plan is one the search may take
      if (chains) {
        check_chain(best, src, dst, global.size());
      }
      ++t.pairs;
      t.equal += planned == best.bytes ? 1 : 0;
      const double ratio = best.bytes > 0 ? double(planned) / double(best.bytes) : planned > 0 ? 1e9 : 1.0;
      if (ratio > t.worst) {
        t.worst = ratio;
        t.worst_case = describe(src, dst, sizes, global) + ": " + to_string(plan, names);
      }
    }
  }
}

} // namespace

TEST_CASE("the search: hand-checked answers", "[plan][search]") {
  // [P] -> [R] over 4: one all_reduce, 2 * 3/4 of the tensor.
  SearchResult r = cheapest_plan({P}, {R}, {8, 4}, {4}, 4);
  CHECK(r.bytes == 4 * 2 * 3 * 8);
  REQUIRE(r.steps.size() == 1);
  CHECK(r.steps[0].kind == StepKind::all_reduce);
  // [P,P] -> [R,R] on 2x2: one all_reduce over the 4 ranks (1.5 tensors), not two (2 tensors).
  r = cheapest_plan({P, P}, {R, R}, {8, 4}, {2, 2}, 4);
  CHECK(r.bytes == 4 * 48);
  REQUIRE(r.steps.size() == 1);
  CHECK(r.steps[0].axes == 3);
  // [S(0)] -> [S(1)] over 2 on (8, 4): a quarter of the tensor.
  CHECK(cheapest_plan({S(0)}, {S(1)}, {8, 4}, {2}, 4).bytes == 4 * 8);
  // [R,P] -> [S(0),S(0)] on 2x2: chunk over dp first, then reduce_scatter a half over tp: 1/4 of the
  // tensor, not the 3/4 of reducing it all first and then exchanging.
  CHECK(cheapest_plan({R, P}, {S(0), S(0)}, {8, 4}, {2, 2}, 4).bytes == 4 * 8);
  // Nothing to do.
  CHECK(cheapest_plan({S(0), R}, {S(0), R}, {8, 4}, {2, 2}, 4).steps.empty());
  // A transition that cannot exist.
  CHECK(cheapest_plan({S(0)}, {P}, {8, 4}, {2}, 4).error == PlanError::shard_to_partial);
}

TEST_CASE("Partial sources: the bench rows that sat at 1.5x its lower bound are the cheapest sequence",
          "[plan][search]") {
  // bench_redistribution's 512x256 float rows. The bench's bound for them (R * (1 + 1/p_s - 2/p)) is what
  // a rank must receive if reductions could forward their results while still reducing; no sequence of
  // collectives gets there (docs/plan.md, "Partial sources", derives both).
  const Extents global{512, 256};
  const Plan two = make_plan({P, S(0)}, {S(0), R}, 2, {2, 2});
  CHECK(to_string(two, names) == "[P(sum),S(0)] -> [S(0),R]: reduce_scatter(dp, dim 0, sum); permute(dp*tp)");
  CHECK(bytes_per_rank(two, global, {2, 2}, 4) == 393216);
  CHECK(cheapest_plan({P, S(0)}, {S(0), R}, global, {2, 2}, 4).bytes == 393216);

  const Plan three = make_plan({P, S(0), S(1)}, {S(1), S(0), R}, 2, {2, 2, 2});
  CHECK(bytes_per_rank(three, global, {2, 2, 2}, 4) == 196608);
  CHECK(cheapest_plan({P, S(0), S(1)}, {S(1), S(0), R}, global, {2, 2, 2}, 4).bytes == 196608);
}

TEST_CASE("the planner moves what the cheapest plan moves: even shapes, 1-2 axes", "[plan][search]") {
  Tally t;
  for (const MeshSizes& sizes :
       {MeshSizes{2}, MeshSizes{4}, MeshSizes{2, 2}, MeshSizes{4, 2}, MeshSizes{2, 4}}) {
    compare_all(sizes, {32, 16}, t, true);
  }
  INFO("worst: " << t.worst_case);
  CHECK(t.equal == t.pairs);
  CHECK(t.pairs > 400);
}

TEST_CASE("the planner moves what the cheapest plan moves: even shapes, 2x2x2", "[plan][search]") {
  Tally t;
  compare_all({2, 2, 2}, {16, 8}, t, false);
  INFO("worst: " << t.worst_case);
  CHECK(t.equal == t.pairs);
  CHECK(t.pairs > 2700);
}

TEST_CASE("the planner within the measured margin of the cheapest plan: uneven shapes", "[plan][search]") {
  // The planner ranks its candidates on an even shape, so where a dim splits unevenly another candidate
  // can be cheaper. Measured: within 0.6 % at (512, 256) on 3-way axes; up to 1.5x on (7, 5), where a
  // rank holds 1-4 elements.
  Tally big;
  for (const MeshSizes& sizes : {MeshSizes{2, 3}, MeshSizes{3, 2}}) {
    compare_all(sizes, {512, 256}, big, false);
  }
  INFO("worst: " << big.worst_case);
  CHECK(big.worst <= 1.006);
  CHECK(big.equal * 10 >= big.pairs * 9);

  Tally tiny;
  for (const MeshSizes& sizes : {MeshSizes{2, 3}, MeshSizes{3, 2}, MeshSizes{2, 2}}) {
    compare_all(sizes, {7, 5}, tiny, false);
  }
  INFO("worst: " << tiny.worst_case);
  CHECK(tiny.worst <= 1.5);
}

// The redistribution planner, checked geometrically: for every plan, every step is exact for the block
// layouts around it (a collective's group holds exactly the data its members need), and the plan ends in
// the target layout. Exhaustive over meshes of 1-3 axes of sizes 1-4 (1-2 axes: every transition between
// {R, P, S(0), S(1)} lists; 3 axes: {R, P, S(0), S(1)} sources to {R, S(0), S(1)} targets), tensors of
// rank 2 with dims in {0, 1, 3, 5, 7}. Every block the steps are checked on is first compared with an
// independent oracle (support/owner_oracle.hpp), so a wrong chunk_offset or spec_block cannot pass.

#include <catch2/catch.hpp>

#include "../support/enumerate.hpp"
#include "../support/owner_oracle.hpp"

#include <dtensor/plan/planner.hpp>

#include <functional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

using namespace dtensor;

namespace {

const std::vector<std::string> names{"dp", "tp", "cp"};

std::string plan_string(std::initializer_list<Placement> src, std::initializer_list<Placement> dst) {
  return to_string(make_plan(PlacementList(src), PlacementList(dst), 2), names);
}

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
constexpr Placement S(int d) {
  return Placement::shard(d);
}

bool contains(const Block& outer, const Extents& idx) {
  for (int d = 0; d < idx.size(); ++d) {
    if (idx[d] < outer.offset[d] || idx[d] >= outer.offset[d] + outer.shape[d]) {
      return false;
    }
  }
  return true;
}

// The ranks of r's group over the axes in `g`, row-major over them (an odometer over those axes).
std::vector<int> group_of(int r, AxisMask g, const MeshSizes& sizes) {
  MeshCoord c = rank_to_coord(r, sizes);
  for (int a = 0; a < sizes.size(); ++a) {
    if (g & axis_bit(a)) {
      c[a] = 0;
    }
  }
  std::vector<int> out;
  while (true) {
    out.push_back(coord_to_rank(c, sizes));
    int a = sizes.size() - 1;
    for (; a >= 0; --a) {
      if ((g & axis_bit(a)) && ++c[a] < sizes[a]) {
        break;
      }
      if (g & axis_bit(a)) {
        c[a] = 0;
      }
    }
    if (a < 0) {
      return out;
    }
  }
}

// Returns an empty string when every rank's spec_block of `spec` is the block the independent oracle
// (support/owner_oracle.hpp: torch.chunk on index lists) says it holds, else what differs. Each (spec,
// mesh, shape) is checked once.
std::string check_blocks_against_oracle(const ShardSpec& spec, const Extents& global,
                                        const MeshSizes& sizes) {
  static std::set<std::tuple<std::string, std::vector<int>, std::vector<std::int64_t>>> done;
  const std::vector<int> mesh(sizes.begin(), sizes.end());
  const std::vector<std::int64_t> shape(global.begin(), global.end());
  if (!done.insert({to_string(spec), mesh, shape}).second) {
    return {};
  }
  for (int r = 0; r < mesh_numel(sizes); ++r) {
    const auto held = test_support::holds(global, spec, sizes, test_support::coord_of(r, sizes));
    if (!test_support::block_is(spec_block(global, spec, sizes, rank_to_coord(r, sizes)), held)) {
      return "the block of rank " + std::to_string(r) + " under " + to_string(spec) +
             " is not what torch.chunk gives it";
    }
  }
  return {};
}

// Returns an empty string when `step` is exact for `global` on `sizes`, else what is wrong.
std::string check_step(const Step& st, const Extents& global, const MeshSizes& sizes) {
  const int world = mesh_numel(sizes);
  for (const ShardSpec* spec : {&st.before, &st.after}) {
    if (std::string err = check_blocks_against_oracle(*spec, global, sizes); !err.empty()) {
      return err;
    }
  }
  std::vector<Block> befores;
  for (int r = 0; r < world; ++r) {
    befores.push_back(spec_block(global, st.before, sizes, rank_to_coord(r, sizes)));
  }
  for (int r = 0; r < world; ++r) {
    const MeshCoord c = rank_to_coord(r, sizes);
    const Block& before = befores[r];
    const Block after = spec_block(global, st.after, sizes, c);
    const auto group = st.communicates() ? group_of(r, st.axes, sizes) : std::vector<int>{};
    switch (st.kind) {
    case StepKind::local_partial:
      if (!(before == after)) {
        return "local_partial changed the block";
      }
      break;
    case StepKind::all_reduce:
    case StepKind::reduce_scatter:
    case StepKind::local_chunk: {
      for (int m : group) {
        if (st.kind != StepKind::local_chunk && !(befores[m] == before)) {
          return "members reduce different blocks";
        }
      }
      Block want = before;
      if (st.kind != StepKind::all_reduce) {
        const int a = st.axis();
        const int d = st.dst_dim;
        want.offset[d] += chunk_offset(before.shape[d], sizes[a], c[a]);
        want.shape[d] = chunk_size(before.shape[d], sizes[a], c[a]);
      }
      if (!(want == after)) {
        return "the block after is not the chunk of the block before";
      }
      break;
    }
    case StepKind::all_gather: {
      const int d = st.src_dim;
      std::int64_t at = after.offset[d];
      for (int m : group) { // members in coordinate order tile the gathered dim
        const Block& bm = befores[m];
        for (int k = 0; k < global.size(); ++k) {
          if (k != d && (bm.offset[k] != after.offset[k] || bm.shape[k] != after.shape[k])) {
            return "gathered blocks differ off the gathered dim";
          }
        }
        if (bm.offset[d] != at && bm.shape[d] != 0) {
          return "gathered blocks are not contiguous in member order";
        }
        at += bm.shape[d];
      }
      if (at != after.offset[d] + after.shape[d]) {
        return "gathered blocks do not cover the block after";
      }
      break;
    }
    case StepKind::all_to_all:
    case StepKind::permute: {
      // Every element of the block after is held by some member of the group before.
      Extents idx = after.offset;
      if (numel(after.shape) == 0) {
        break;
      }
      while (true) {
        bool held = false;
        for (int m : group) {
          held = held || contains(befores[m], idx);
        }
        if (!held) {
          return "an element of the target block is not in the group";
        }
        int d = global.size() - 1;
        while (d >= 0 && ++idx[d] == after.offset[d] + after.shape[d]) {
          idx[d] = after.offset[d];
          --d;
        }
        if (d < 0) {
          break;
        }
      }
      break;
    }
    }
  }
  return {};
}

void check_all_plans(int axes, const std::vector<Placement>& src_options,
                     const std::vector<Placement>& dst_options, const std::vector<MeshSizes>& meshes) {
  const std::vector<std::int64_t> dims{0, 1, 3, 5, 7};
  int plans = 0;
  for (const PlacementList& src : test_support::all_placement_lists(axes, src_options)) {
    for (const PlacementList& dst : test_support::all_placement_lists(axes, dst_options)) {
      const Plan plan = make_plan(src, dst, 2);
      if (plan.error != PlanError::none) {
        continue;
      }
      ++plans;
      INFO(to_string(plan, names));
      ShardSpec cur = plan.src;
      for (const Step& st : plan.steps) {
        REQUIRE(st.before == cur);
        cur = st.after;
      }
      REQUIRE(cur == plan.dst);
      for (int d = 0; d < 2; ++d) { // the target is the placement list's default order: axes left to right
        std::vector<int> splitters, want;
        for (std::int8_t a : plan.dst.order[d]) {
          splitters.push_back(a);
        }
        for (int a = 0; a < axes; ++a) {
          if (dst[a].is_shard() && dst[a].dim == d) {
            want.push_back(a);
          }
        }
        REQUIRE(splitters == want);
      }
      REQUIRE(plan.size() <= 2 * axes + 1);
      for (const MeshSizes& sizes : meshes) {
        for (std::int64_t m : dims) {
          for (std::int64_t n : dims) {
            for (const Step& st : plan.steps) {
              const std::string err = check_step(st, Extents{m, n}, sizes);
              if (!err.empty()) {
                FAIL(err << " in step " << to_string(st.kind) << " on mesh " << mesh_to_string(names, sizes)
                         << ", shape (" << m << ", " << n << ")");
              }
            }
          }
        }
      }
    }
  }
  CHECK(plans > 0);
}

std::vector<MeshSizes> meshes(int axes) {
  std::vector<MeshSizes> out;
  for (int i = 1; i <= 4; ++i) {
    if (axes == 1) {
      out.push_back({i});
      continue;
    }
    for (int j = 1; j <= 4; ++j) {
      if (axes == 2) {
        out.push_back({i, j});
        continue;
      }
      for (int k = 1; k <= 3; ++k) {
        out.push_back({i, j, k});
      }
    }
  }
  return out;
}

} // namespace

// The step table of docs/design.md, The planner.
TEST_CASE("single-axis transitions use the collective of the design's step table", "[plan]") {
  CHECK(plan_string({S(0)}, {R}) == "[S(0)] -> [R]: all_gather(dp, dim 0)");
  CHECK(plan_string({P}, {R}) == "[P(sum)] -> [R]: all_reduce(dp, sum)");
  CHECK(plan_string({P}, {S(1)}) == "[P(sum)] -> [S(1)]: reduce_scatter(dp, dim 1, sum)");
  CHECK(plan_string({S(0)}, {S(1)}) == "[S(0)] -> [S(1)]: all_to_all(dp, dim 0 -> dim 1)");
  CHECK(plan_string({R}, {S(1)}) == "[R] -> [S(1)]: local_chunk(dp, dim 1)");
  CHECK(plan_string({R}, {P}) == "[R] -> [P(sum)]: local_partial(dp, sum)");
  CHECK(plan_string({R}, {R}) == "[R] -> [R]: nothing to do");
  CHECK(plan_string({P}, {P}) == "[P(sum)] -> [P(sum)]: nothing to do");
  CHECK(plan_string({S(-1)}, {S(1)}) == "[S(1)] -> [S(1)]: nothing to do");
}

TEST_CASE("multi-axis plans: shrink, permute, grow, with exchanges where order matters", "[plan]") {
  CHECK(plan_string({S(0), R}, {R, S(1)}) ==
        "[S(0),R] -> [R,S(1)]: local_chunk(tp, dim 1); all_gather(dp, dim 0)");
  CHECK(plan_string({S(0), S(1)}, {S(1), S(0)}) == "[S(0),S(1)] -> [S(1),S(0)]: permute(dp*tp)");
  CHECK(plan_string({S(0), S(0)}, {S(1), S(1)}) ==
        "[S(0),S(0)] -> [S(1),S(1)]: all_to_all(dp*tp, dim 0 -> dim 1)");
  CHECK(plan_string({S(0), S(0)}, {R, S(1)}) ==
        "[S(0),S(0)] -> [R,S(1)]: all_to_all(tp, dim 0 -> dim 1); all_gather(dp, dim 0)");
  CHECK(plan_string({S(0), S(1)}, {R, R}) ==
        "[S(0),S(1)] -> [R,R]: all_gather(tp, dim 1); all_gather(dp, dim 0)");
  CHECK(plan_string({S(0), S(0)}, {R, R}) ==
        "[S(0),S(0)] -> [R,R]: all_gather(tp, dim 0); all_gather(dp, dim 0)");
  CHECK(plan_string({P, P}, {R, S(1)}) ==
        "[P(sum),P(sum)] -> [R,S(1)]: reduce_scatter(tp, dim 1, sum); all_reduce(dp, sum)");
  CHECK(plan_string({P, S(0)}, {R, R}) ==
        "[P(sum),S(0)] -> [R,R]: all_reduce(dp, sum); all_gather(tp, dim 0)");
  CHECK(plan_string({R, R}, {P, S(0)}) ==
        "[R,R] -> [P(sum),S(0)]: local_chunk(tp, dim 0); local_partial(dp, sum)");
}

TEST_CASE("Partial sources: the cheapest of the candidate plans", "[plan]") {
  // Chunk first, so the reduction runs on a quarter of the data, not all of it.
  CHECK(plan_string({R, P}, {S(0), S(0)}) ==
        "[R,P(sum)] -> [S(0),S(0)]: local_chunk(dp, dim 0); reduce_scatter(tp, dim 0, sum)");
  // Several axes to R with one op: one all_reduce over them flattened.
  CHECK(plan_string({P, P}, {R, R}) == "[P(sum),P(sum)] -> [R,R]: all_reduce(dp*tp, sum)");
  // An all_reduce whose result would be exchanged anyway: a reduce_scatter whose gather joins the exchange.
  CHECK(plan_string({S(0), P}, {S(1), R}) ==
        "[S(0),P(sum)] -> [S(1),R]: reduce_scatter(tp, dim 0, sum); permute(dp*tp)");
  // A replicated axis shares the reduction where it is larger than 2 (a static size of 4 on dp).
  CHECK(to_string(make_plan(PlacementList{P, R}, PlacementList{S(0), R}, 2, MeshSizes{4, 2}), names) ==
        "[P(sum),R] -> [S(0),R]: local_chunk(tp, dim 1); reduce_scatter(dp, dim 0, sum); all_gather(tp, dim "
        "1)");
  // On 2x2 it would not pay: the rule's plan.
  CHECK(plan_string({P, R}, {S(0), R}) == "[P(sum),R] -> [S(0),R]: reduce_scatter(dp, dim 0, sum)");
}

TEST_CASE("forbidden transitions are reported", "[plan]") {
  STATIC_REQUIRE(make_plan(PlacementList{S(0)}, PlacementList{Placement::partial()}, 2).error ==
                 PlanError::shard_to_partial);
  STATIC_REQUIRE(
      make_plan(PlacementList{Placement::partial(ReduceOp::max)}, PlacementList{Placement::partial()}, 2)
          .error == PlanError::partial_op_change);
  STATIC_REQUIRE(make_plan(PlacementList{S(2)}, PlacementList{Placement::replicate()}, 2).error ==
                 PlanError::invalid_source);
  STATIC_REQUIRE(
      make_plan(PlacementList{Placement::partial(ReduceOp::sum), Placement::partial(ReduceOp::avg)},
                PlacementList{Placement::partial(ReduceOp::sum), Placement::partial(ReduceOp::max)}, 2)
          .error == PlanError::invalid_target);
}

TEST_CASE("plans fold at compile time", "[plan]") {
  constexpr Plan p = make_plan(PlacementList{S(0), S(1)}, PlacementList{S(1), S(0)}, 2);
  STATIC_REQUIRE(p.size() == 1);
  STATIC_REQUIRE(p.steps[0].kind == StepKind::permute);
  constexpr Plan q = make_plan(PlacementList{S(0), S(0)}, PlacementList{S(1), S(1)}, 2);
  STATIC_REQUIRE(q.count(StepKind::all_to_all) == 1);
  STATIC_REQUIRE(q.num_collectives() == 1);
}

TEST_CASE("every plan is exact step by step: 1-axis meshes", "[plan][exhaustive]") {
  check_all_plans(1, {R, P, S(0), S(1)}, {R, P, S(0), S(1)}, meshes(1));
}

TEST_CASE("every plan is exact step by step: 2-axis meshes", "[plan][exhaustive]") {
  check_all_plans(2, {R, P, S(0), S(1)}, {R, P, S(0), S(1)}, meshes(2));
}

TEST_CASE("every plan is exact step by step: 3-axis meshes", "[plan][exhaustive]") {
  check_all_plans(3, {R, P, S(0), S(1)}, {R, S(0), S(1)}, meshes(3));
}

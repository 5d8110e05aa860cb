// The backward of redistribute (backward/duality.hpp, backward/redistribute.hpp): the table of docs/design.md
// falls out of the planner, and for every redistribution the planner makes on 1-, 2- and 3-axis meshes the
// derived backward is the adjoint of the forward: <A x, dy> == <x, A^T dy> for random integer-valued x, dy.
#include <catch2/catch.hpp>

#include <dtensor/backward/duality.hpp>
#include <dtensor/backward/redistribute.hpp>
#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/enumerate.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

using namespace dtensor;

namespace {

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

using R = Replicate;
using P = Partial<>;
using Pavg = Partial<ReduceOp::avg>;
template <int D>
using S = Shard<D>;
using Mesh1 = MeshShape<Axis<"x">>;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;
using Mesh3 = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>;

template <class Src, class Dst, class G>
constexpr Plan bwd1() {
  return backward_plan_of<Mesh1, 2, Src, Dst, G>().backward.plan;
}

constexpr bool is_single(const Plan& p, StepKind k) {
  return p.size() == 1 && p.steps[0].kind == k;
}

// The table, as the planner derives it.
static_assert(is_single(bwd1<Placements<S<0>>, Placements<R>, Placements<P>>(), StepKind::reduce_scatter),
              "all_gather's backward for a Partial gradient is a reduce_scatter");
static_assert(is_single(bwd1<Placements<S<0>>, Placements<R>, Placements<R>>(), StepKind::local_chunk),
              "all_gather's backward for a Replicate gradient is a local chunk");
static_assert(bwd1<Placements<P>, Placements<R>, Placements<R>>().size() == 0,
              "all_reduce's backward is the identity");
static_assert(is_single(bwd1<Placements<R>, Placements<S<0>>, Placements<S<0>>>(), StepKind::all_gather),
              "a local chunk's backward is an all_gather");
static_assert(is_single(bwd1<Placements<P>, Placements<S<0>>, Placements<S<0>>>(), StepKind::all_gather),
              "reduce_scatter's backward is an all_gather");
static_assert(is_single(bwd1<Placements<S<0>>, Placements<S<1>>, Placements<S<1>>>(), StepKind::all_to_all) &&
                  bwd1<Placements<S<0>>, Placements<S<1>>, Placements<S<1>>>().steps[0].src_dim == 1 &&
                  bwd1<Placements<S<0>>, Placements<S<1>>, Placements<S<1>>>().steps[0].dst_dim == 0,
              "all_to_all's backward is the all_to_all the other way");
static_assert(is_single(bwd1<Placements<R>, Placements<R>, Placements<P>>(), StepKind::all_reduce),
              "the identity into a rank-specific computation has an all_reduce as its backward");
static_assert(backward_plan_of<Mesh1, 2, Placements<Pavg>, Placements<R>, Placements<R>>().backward.divide ==
                  1,
              "Partial<avg>'s gradient is scaled by 1/n");
static_assert(
    backward_plan_of<Mesh1, 2, Placements<R>, Placements<Pavg>, Placements<R>>().backward.multiply == 1,
    "R -> Partial<avg> keeps n copies: the gradient is n times each's");
static_assert(backward_plan_of<Mesh1, 2, Placements<R>, Placements<S<0>>, Placements<R>, Placements<P>>()
                      .backward.plan.size() == 1,
              "the gradient of a Replicate primal may stay Partial<sum> (here: one local_partial step)");
static_assert(std::is_same_v<dual_t<Shard<1>>, Shard<1>> && std::is_same_v<dual_t<P>, R> &&
              std::is_same_v<dual_t<Pavg>, R> && std::is_same_v<dual_t<R>, R>);
static_assert(make_backward_plan({Placement::partial(ReduceOp::max)}, {Placement::replicate()},
                                 {Placement::replicate()}, 2)
                  .error == BackwardError::nonlinear_primal);
static_assert(make_backward_plan({Placement::shard(0)}, {Placement::replicate()},
                                 {Placement::partial(ReduceOp::min)}, 2)
                  .error == BackwardError::nonlinear_gradient);
static_assert(make_backward_plan({Placement::shard(0)}, {Placement::replicate()}, {Placement::replicate()},
                                 {Placement::replicate()}, 2)
                  .error == BackwardError::gradient_placements);

// A small deterministic integer in [-4, 4] for (stream, index): independent streams for x's partials and
// the gradient's.
int value(std::uint64_t stream, std::uint64_t index) {
  std::uint64_t z = stream * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<int>(z % 9) - 4;
}

// Coordinate of `coord` over the axes of `list` that are Partial, as one index, and how many there are.
struct PartialIndex {
  int index = 0;
  int count = 1;
};
PartialIndex partial_index(const PlacementList& list, const MeshCoord& coord, const MeshSizes& sizes) {
  PartialIndex p;
  for (int a = 0; a < list.size(); ++a) {
    if (list[a].is_partial()) {
      p.index = p.index * sizes[a] + coord[a];
      p.count *= sizes[a];
    }
  }
  return p;
}

// Product of the sizes of the axes of `list` that are Partial<avg>.
int avg_factor(const PlacementList& list, const MeshSizes& sizes) {
  int f = 1;
  for (int a = 0; a < list.size(); ++a) {
    f *= list[a] == Placement::partial(ReduceOp::avg) ? sizes[a] : 1;
  }
  return f;
}

// The copies of one element a placement list makes: the product of its Replicate axes' sizes (a
// pairing counts each element once).
int replicas(const PlacementList& list, const MeshSizes& sizes) {
  int f = 1;
  for (int a = 0; a < list.size(); ++a) {
    f *= list[a].is_replicate() ? sizes[a] : 1;
  }
  return f;
}

// This rank's local tensor of a DTensor with placements `list` whose partial states are
// partial(c, i, j) for Partial coordinate c (everything else: the block of that global tensor).
template <class F>
Tensor<double, 2> make_local(const Extents& global, const PlacementList& list, const MeshSizes& sizes,
                             const MeshCoord& coord, F partial) {
  const Block b = spec_block(global, ShardSpec::from(list, 2), sizes, coord);
  const PartialIndex c = partial_index(list, coord, sizes);
  Tensor<double, 2> t({b.shape[0], b.shape[1]});
  for (std::int64_t i = 0; i < b.shape[0]; ++i) {
    for (std::int64_t j = 0; j < b.shape[1]; ++j) {
      t(i, j) = partial(c, b.offset[0] + i, b.offset[1] + j);
    }
  }
  return t;
}

// sum over this rank's elements of local * gradient value (global tensor g at the block), times
// `weight`.
template <class G>
double local_pairing(const Tensor<double, 2>& local, const Block& b, G g, double weight) {
  double s = 0;
  for (std::int64_t i = 0; i < local.shape()[0]; ++i) {
    for (std::int64_t j = 0; j < local.shape()[1]; ++j) {
      s += local(i, j) * g(b.offset[0] + i, b.offset[1] + j);
    }
  }
  return s * weight;
}

struct Case {
  PlacementList src, dst, grad, out;
};

std::string describe(const Case& c) {
  return to_string(c.src) + " -> " + to_string(c.dst) + " with gradient " + to_string(c.grad) + " to " +
         to_string(c.out);
}

// Runs every case on this rank and returns, per case, this rank's share of <A x, dy> and <x, A^T dy>
// (scaled by the mesh size so the R-copy weights stay integral).
std::vector<double> pairings(const std::vector<Case>& cases, const Extents& global,
                             const DeviceMeshBase& mesh) {
  const MeshSizes& sizes = mesh.sizes();
  const MeshCoord& coord = mesh.coordinate();
  const double world = mesh.size();
  std::vector<double> out;
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    const std::uint64_t seed = 1000 * k;
    // x: partial state c is its own random tensor.
    auto x_partial = [&](PartialIndex p, std::int64_t i, std::int64_t j) {
      return double(value(seed + 1 + p.index, std::uint64_t(i * global[1] + j)));
    };
    // The gradient's value; its Partial states are random and add up to it (times the avg factors).
    const int g_avg = avg_factor(c.grad, sizes);
    auto g_value = [&](std::int64_t i, std::int64_t j) {
      return double(value(seed + 500, std::uint64_t(i * global[1] + j)));
    };
    auto g_partial = [&](PartialIndex p, std::int64_t i, std::int64_t j) {
      const std::uint64_t at = std::uint64_t(i * global[1] + j);
      if (p.index != 0) {
        return double(value(seed + 600 + p.index, at));
      }
      double rest = 0;
      for (int q = 1; q < p.count; ++q) {
        rest += value(seed + 600 + q, at);
      }
      return g_value(i, j) * g_avg - rest;
    };
    const Tensor<double, 2> x = make_local(global, c.src, sizes, coord, x_partial);
    const Tensor<double, 2> dy = make_local(global, c.grad, sizes, coord, g_partial);

    const Plan fwd = make_plan(c.src, c.dst, 2, sizes);
    const BackwardPlan bwd = make_backward_plan(c.src, c.dst, c.grad, c.out, 2, sizes);
    expect(fwd.error == PlanError::none && bwd.error == BackwardError::none, describe(c) + ": no plan");
    const auto y = exec::run_steps(fwd, 0, AnyTensor(x), global, mesh).as<double, 2>();
    auto dx = exec::run_steps(bwd.plan, 0, AnyTensor(dy), global, mesh).as<double, 2>();

    // dx's value, where dx keeps Partial<sum> axes: each holds a part of it.
    const Block yb = spec_block(global, ShardSpec::from(c.dst, 2), sizes, coord);
    const Block xb = spec_block(global, ShardSpec::from(c.src, 2), sizes, coord);
    expect(y.shape()[0] == yb.shape[0] && y.shape()[1] == yb.shape[1], describe(c) + ": y's block");
    expect(dx.shape()[0] == xb.shape[0] && dx.shape()[1] == xb.shape[1], describe(c) + ": dx's block");
    // <A x, dy> = <sum_full(y), value(dy)>; <x, A^T dy> = <sum_full(x), value(dx)>, dx scaled by the
    // avg factors. A Partial<sum> axis of dx over a Replicate axis of x adds up dx's parts: no 1/n for it.
    const double lhs = local_pairing(y, yb, g_value, world / replicas(c.dst, sizes));
    int dx_copies = 1;
    for (int a = 0; a < c.src.size(); ++a) {
      dx_copies *= c.src[a].is_replicate() && c.out[a].is_replicate() ? sizes[a] : 1;
    }
    const double factor = bwd.scale(sizes);
    double rhs = 0;
    for (std::int64_t i = 0; i < x.shape()[0]; ++i) {
      for (std::int64_t j = 0; j < x.shape()[1]; ++j) {
        rhs += x(i, j) * dx(i, j) * factor;
      }
    }
    out.push_back(lhs);
    out.push_back(rhs * world / dx_copies);
  }
  return out;
}

// Every (src, dst) pair from `options` whose forward exists, with the first `gradients` of these gradient
// placements: one drawn from `options`, dual(dst) (what a redundant consumer gives), Partial<sum> on every
// axis dst does not shard (a rank-specific consumer); each to dual(src), and dual(dst) also to
// Partial<sum> on src's Replicate axes.
std::vector<Case> all_cases(int axes, const std::vector<Placement>& options, int gradients = 3) {
  const auto lists = test_support::all_placement_lists(axes, options);
  std::vector<Case> cases;
  std::uint64_t draw = 7;
  for (const PlacementList& src : lists) {
    for (const PlacementList& dst : lists) {
      if (check_transition(src, dst, 2) != PlanError::none) {
        continue;
      }
      PlacementList rank_specific = dst;
      for (Placement& p : rank_specific) {
        p = p.is_shard() ? p : Placement::partial(ReduceOp::sum);
      }
      draw = draw * 6364136223846793005ull + 1442695040888963407ull;
      const PlacementList& drawn = lists[(draw >> 33) % lists.size()];
      PlacementList partial_out = dual(src);
      for (int a = 0; a < axes; ++a) {
        if (src[a].is_replicate()) {
          partial_out[a] = Placement::partial(ReduceOp::sum);
        }
      }
      const PlacementList grads[] = {drawn, dual(dst), rank_specific};
      for (int i = 0; i < gradients; ++i) {
        cases.push_back({src, dst, grads[i], dual(src)});
      }
      if (!(partial_out == dual(src)) &&
          make_backward_plan(src, dst, dual(dst), partial_out, 2).error == BackwardError::none) {
        cases.push_back({src, dst, dual(dst), partial_out});
      }
    }
  }
  return cases;
}

template <class Mesh, class... Sizes>
void check_adjoint(const std::vector<Case>& cases, const Extents& global, int ranks, Sizes... sizes) {
  INFO("mesh of " << ranks << " ranks, " << cases.size() << " cases");
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    auto sums = Tensor<double, 1>({std::int64_t(2 * cases.size())});
    const std::vector<double> mine = pairings(cases, global, mesh);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      sums(std::int64_t(i)) = mine[i];
    }
    all_reduce(sums, ReduceOp::sum, world);
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const double lhs = sums(std::int64_t(2 * k));
      const double rhs = sums(std::int64_t(2 * k + 1));
      expect(std::abs(lhs - rhs) <= 1e-9 * (1 + std::abs(lhs)),
             describe(cases[k]) + ": <A x, dy> = " + std::to_string(lhs) +
                 " but <x, A^T dy> = " + std::to_string(rhs));
    }
  });
}

const std::vector<Placement> all_options{Placement::replicate(), Placement::shard(0), Placement::shard(1),
                                         Placement::partial(ReduceOp::sum),
                                         Placement::partial(ReduceOp::avg)};

} // namespace

TEST_CASE("adjoint identity: every 1-axis redistribution and gradient, 1 to 4 ranks, uneven and empty shards",
          "[backward]") {
  const auto cases = all_cases(1, all_options);
  for (int n = 1; n <= 4; ++n) {
    check_adjoint<Mesh1>(cases, {5, 3}, n);
  }
}

TEST_CASE("adjoint identity: every 2-axis redistribution, meshes (2,2), (1,3), (3,1)", "[backward]") {
  const auto cases = all_cases(2, all_options);
  check_adjoint<Mesh2>(cases, {5, 3}, 4, 2, 2);
  check_adjoint<Mesh2>(cases, {5, 3}, 3, 1, 3);
  check_adjoint<Mesh2>(cases, {3, 2}, 3, 3, 1);
}

// On three axes, two option sets of four (each case ~3 ms on the 2-core machine): every placement pair
// of five options would take a minute.
TEST_CASE("adjoint identity: every 3-axis redistribution over {R, S(0), S(1), P(avg)}, mesh (2,1,2)",
          "[backward]") {
  const auto cases = all_cases(
      3,
      {Placement::replicate(), Placement::shard(0), Placement::shard(1), Placement::partial(ReduceOp::avg)},
      1);
  check_adjoint<Mesh3>(cases, {5, 3}, 4, 2, 1, 2);
}

namespace {

// This rank's block of the global tensor value(i, j) = 10 i + j (+ rank-dependent noise that sums to zero
// over each Partial<sum> axis), as a DTensor of type DT.
template <class DT, class Mesh>
DT make_tensor(const Mesh& mesh, std::int64_t rows, std::int64_t cols, double scale = 1) {
  const Block b = spec_block(Extents{rows, cols}, DT::spec, mesh.sizes(), mesh.coordinate());
  const PartialIndex p = partial_index(DT::placements, mesh.coordinate(), mesh.sizes());
  typename DT::local_type t({b.shape[0], b.shape[1]});
  for (std::int64_t i = 0; i < b.shape[0]; ++i) {
    for (std::int64_t j = 0; j < b.shape[1]; ++j) {
      const double v = scale * (10 * (b.offset[0] + i) + b.offset[1] + j);
      // sum partials: value on the first, then +k, -k pairs that cancel.
      const double noise = p.count == 1 ? 0 : (p.index == 0 ? -(p.count - 1) : 1);
      t(i, j) = static_cast<typename DT::value_type>(p.count == 1 ? v : (p.index == 0 ? v : 0) + noise);
    }
  }
  return DT::from_local(mesh, t, {{rows, cols}});
}

// Every element of `t` equals scale * (10 i + j) at its global index.
template <class DT>
void expect_value(const DT& t, double scale, const std::string& what) {
  const auto off = t.local_offset();
  for (std::int64_t i = 0; i < t.local().shape()[0]; ++i) {
    for (std::int64_t j = 0; j < t.local().shape()[1]; ++j) {
      const double want = scale * (10 * (off[0] + i) + off[1] + j);
      expect(std::abs(double(t.local()(i, j)) - want) < 1e-9,
             what + ": at (" + std::to_string(off[0] + i) + ", " + std::to_string(off[1] + j) + ") " +
                 std::to_string(double(t.local()(i, j))) + " != " + std::to_string(want));
    }
  }
}

} // namespace

TEST_CASE("the table through the DTensor API: each backward runs exactly its collective", "[backward]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    testing::run_ranks(n, [n](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      const std::int64_t rows = 2 * n + 1; // uneven; empty shards at n = 4 for 3 columns over S(1)
      using XS = DTensor<double, 2, Mesh1, S<0>>;
      using XR = DTensor<double, 2, Mesh1, R>;
      using XP = DTensor<double, 2, Mesh1, P>;
      using XA = DTensor<double, 2, Mesh1, Pavg>;
      const auto x = make_tensor<XS>(mesh, rows, 3);
      const auto dy_p = make_tensor<XP>(mesh, rows, 3, 2);
      const auto dy_r = make_tensor<XR>(mesh, rows, 3, 2);
      const std::string label = n == 1 ? "" : "x";
      auto only = [&](const CommDebugMode& c, std::string_view op, const std::string& what) {
        expect(c.total_count() == (n == 1 ? c.total_count() : 1) && (n == 1 || c.count(op, "x") == 1),
               what + ": exactly one " + std::string(op) + "\n" + c.to_string());
      };
      {
        CommDebugMode c;
        auto [y, back] = redistribute_with_backward<R>(x); // all_gather
        only(c, "all_gather", "forward S(0) -> R");
        expect_value(y, 1, "S(0) -> R forward");
        c.reset();
        DTensor<double, 2, Mesh1, S<0>> dx = back(dy_p); // reduce_scatter
        only(c, "reduce_scatter", "backward of S(0) -> R, Partial gradient");
        expect_value(dx, 2, "backward of S(0) -> R, Partial gradient");
        c.reset();
        dx = back(dy_r); // local chunk
        expect(c.total_count() == 0,
               "backward of S(0) -> R, Replicate gradient: no communication\n" + c.to_string());
        expect_value(dx, 2, "backward of S(0) -> R, Replicate gradient");
        c.reset();
        auto pending = back(dy_p, async_op);
        dx = pending.wait();
        only(c, "reduce_scatter", "async backward");
        expect_value(dx, 2, "async backward of S(0) -> R");
        expect(back.plan_for<P>().to_string() == "[P(sum)] -> [S(0)]: reduce_scatter(x, dim 0, sum)",
               "printed backward plan: " + back.plan_for<P>().to_string());
      }
      {
        const auto xp = make_tensor<XP>(mesh, rows, 3);
        CommDebugMode c;
        auto [y, back] = redistribute_with_backward<R>(xp); // all_reduce
        only(c, "all_reduce", "forward P -> R");
        c.reset();
        XR dx = back(dy_r);
        expect(c.total_count() == 0, "all_reduce's backward is the identity\n" + c.to_string());
        expect_value(dx, 2, "backward of P -> R");
      }
      {
        const auto xr = make_tensor<XR>(mesh, rows, 3);
        auto [y, back] = redistribute_with_backward<S<0>>(xr); // local chunk
        const auto dy = make_tensor<XS>(mesh, rows, 3, 2);
        CommDebugMode c;
        XR dx = back(dy);
        only(c, "all_gather", "a local chunk's backward");
        expect_value(dx, 2, "backward of R -> S(0)");
        c.reset();
        DTensor<double, 2, Mesh1, P> dx_partial = back.to<P>(dy_r); // deferred: no communication
        expect(c.total_count() == 0, "a Partial gradient of a Replicate primal needs no communication");
        expect_value(dx_partial.redistribute<R>(), 2, "backward of R -> S(0) kept Partial");
      }
      {
        const auto xa = make_tensor<XA>(mesh, rows, 3);
        auto [y, back] = redistribute_with_backward<R>(xa);
        XR dx = back(dy_r);
        expect_value(dx, 2.0 / n, "Partial<avg>'s gradient is scaled by 1/n");
        auto [z, back2] = redistribute_with_backward<Pavg>(y);
        DTensor<double, 2, Mesh1, R> dz = back2(make_tensor<XR>(mesh, rows, 3, 2.0 / n));
        expect_value(dz, 2, "R -> Partial<avg>: the n copies' gradients add up");
        expect_value(back(dy_r, async_op).wait(), 2.0 / n, "async backward scales too");
        expect_value(dy_r, 2, "the scaling never touches the caller's gradient");
      }
      {
        auto [y, back] = redistribute_with_backward<R>(x);
        const auto wrong = make_tensor<XP>(mesh, rows + 1, 3);
        bool threw = false;
        try {
          (void)back(wrong);
        } catch (const Error& e) {
          threw = std::string(e.what()).find("global shape (" + std::to_string(rows + 1) +
                                             ", 3) is not the "
                                             "forward's (" +
                                             std::to_string(rows) + ", 3)") != std::string::npos;
        }
        expect(threw, "a gradient of another global shape is refused, naming both shapes");
      }
      (void)label;
    });
  }
}

TEST_CASE("adjoint identity: every 3-axis redistribution over {R, S(0), P(sum), P(avg)}, mesh (1,2,2)",
          "[backward]") {
  const auto cases = all_cases(3,
                               {Placement::replicate(), Placement::shard(0),
                                Placement::partial(ReduceOp::sum), Placement::partial(ReduceOp::avg)},
                               1);
  check_adjoint<Mesh3>(cases, {5, 3}, 4, 1, 2, 2);
}

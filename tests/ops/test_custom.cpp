// Users' ops with their own sharding rules (ops/custom.hpp), against a single-process computation: an
// einsum-like OpSpec (elementwise, and a contraction that leaves a Partial), a free-form constexpr rule
// for an op that creates a dim, and op_sharding specialized for a type that has no rule of its own; on
// 1-D meshes of 1-4 ranks and on (2,2), uneven and empty shards included.
#include <catch2/catch.hpp>

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/custom.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

// silu(gate) * up, elementwise: a nonlinear op of two operands labelled alike.
struct SwiGlu {
  static constexpr OpSpec sharding{{labels("tf"), labels("tf")}, labels("tf"), Linearity::nonlinear};
  Tensor<double, 2> operator()(const Tensor<double, 2>& gate, const Tensor<double, 2>& up) const {
    expect(gate.shape() == up.shape(), "SwiGlu: the engine cut the operands to different blocks");
    Tensor<double, 2> out(gate.shape());
    const auto g = gate.contiguous();
    const auto u = up.contiguous();
    for (std::int64_t e = 0; e < out.numel(); ++e) {
      out.data()[e] = g.data()[e] / (1 + std::exp(-g.data()[e])) * u.data()[e];
    }
    return out;
  }
};

// The scaled row sums sum_f x[t, f] * w[f]: f is contracted, so sharding it leaves a Partial<sum>.
struct RowDot {
  static constexpr OpSpec sharding{{labels("tf"), labels("f")}, labels("t"), Linearity::multiplicative};
  Tensor<double, 1> operator()(const Tensor<double, 2>& x, const Tensor<double, 1>& w) const {
    Tensor<double, 1> out({x.shape()[0]});
    for (std::int64_t t = 0; t < x.shape()[0]; ++t) {
      double s = 0;
      for (std::int64_t f = 0; f < x.shape()[1]; ++f) {
        s += x(t, f) * w(f);
      }
      out(t) = s;
    }
    return out;
  }
};

// Per row: (min, max), a new dim of 2. A free-form rule: rows may be sharded, the reduced dim may not, and
// it is not linear.
struct RowRange {
  static constexpr RuleResult rule(const StaticVector<PlacementList, max_operands>& in) {
    RuleResult r;
    for (int a = 0; a < in[0].size(); ++a) {
      const Placement p = in[0][a];
      if (p.is_partial()) {
        r.error = RuleError::partial_nonlinear;
        r.axis = a;
        return r;
      }
      if (p == Placement::shard(1) || p == Placement::shard(-1)) {
        r.error = RuleError::contracted_mismatch;
        r.axis = a;
        return r;
      }
      r.out.push_back(p);
    }
    return r;
  }
  LocalResult<double, 2> operator()(const Tensor<double, 2>& x) const {
    Tensor<double, 2> out({x.shape()[0], 2});
    for (std::int64_t t = 0; t < x.shape()[0]; ++t) {
      double lo = 1e300;
      double hi = -1e300;
      for (std::int64_t f = 0; f < x.shape()[1]; ++f) {
        lo = std::min(lo, x(t, f));
        hi = std::max(hi, x(t, f));
      }
      out(t, 0) = lo;
      out(t, 1) = hi;
    }
    return {out, {rows, 2}};
  }
  std::int64_t rows = 0;
};

// A type with no rule of its own (say, from another library): negation, given a rule from outside.
struct Negate {
  Tensor<double, 2> operator()(const Tensor<double, 2>& x) const {
    Tensor<double, 2> out(x.shape());
    const auto c = x.contiguous();
    for (std::int64_t e = 0; e < out.numel(); ++e) {
      out.data()[e] = -c.data()[e];
    }
    return out;
  }
};

} // namespace

template <>
struct dtensor::op_sharding<Negate> {
  static constexpr OpSpec sharding{{labels("ab")}, labels("ab"), Linearity::linear};
};

namespace {

// The rule's table, pinned.
using X1R = DTensor<double, 2, Mesh1, R>;
using X1S0 = DTensor<double, 2, Mesh1, S<0>>;
using X1S1 = DTensor<double, 2, Mesh1, S<1>>;
using X1P = DTensor<double, 2, Mesh1, P>;
static_assert(detail::custom_rule<SwiGlu, X1S0, X1R>().out == placement_list_v<S<0>>);
static_assert(detail::custom_rule<SwiGlu, X1P, X1R>().error == RuleError::partial_nonlinear);
static_assert(detail::custom_rule<RowDot, X1S1, DTensor<double, 1, Mesh1, S<0>>>().out ==
              placement_list_v<P>);
static_assert(detail::custom_rule<RowDot, X1S1, DTensor<double, 1, Mesh1, R>>().error ==
              RuleError::contracted_mismatch);
static_assert(detail::custom_rule<RowRange, X1S0>().out == placement_list_v<S<0>>);
static_assert(detail::custom_rule<RowRange, X1S1>().error == RuleError::contracted_mismatch);
static_assert(detail::custom_rule<Negate, X1P>().out == placement_list_v<P>);

// A local function that ignores its block.
struct Wrong {
  static constexpr OpSpec sharding{{labels("ab")}, labels("ab"), Linearity::linear};
  Tensor<double, 2> operator()(const Tensor<double, 2>&) const { return Tensor<double, 2>({1, 1}); }
};

template <class Mesh, class... Sizes>
void custom_cases(int ranks, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const std::array<std::int64_t, 2> shape{5, 3};
    constexpr bool two = Mesh::rank == 2;
    using Rows = std::conditional_t<two, Placements<S<0>, R>, Placements<S<0>>>;
    using Cols = std::conditional_t<two, Placements<R, S<1>>, Placements<S<1>>>;
    using Rep = std::conditional_t<two, Placements<R, R>, Placements<R>>;
    using Part = std::conditional_t<two, Placements<P, R>, Placements<P>>;
    using XRows = typename dt<Mesh, 2, Rows>::type;
    using XCols = typename dt<Mesh, 2, Cols>::type;
    using XRep = typename dt<Mesh, 2, Rep>::type;
    using XPart = typename dt<Mesh, 2, Part>::type;
    auto swiglu = [](std::int64_t e) {
      const double g = value(1, e);
      return g / (1 + std::exp(-g)) * value(2, e);
    };
    // Elementwise: two sharded operands, and a sharded one with a Replicate one (cut to the block).
    {
      auto y = apply_op(SwiGlu{}, make<XRows>(mesh, shape, 1), make<XRows>(mesh, shape, 2));
      static_assert(std::is_same_v<decltype(y), XRows>);
      check_full(y, swiglu, 1e-15, "SwiGlu rows");
      auto z = apply_op(SwiGlu{}, make<XCols>(mesh, shape, 1), make<XRep>(mesh, shape, 2));
      static_assert(std::is_same_v<decltype(z), XCols>);
      check_full(z, swiglu, 1e-15, "SwiGlu cols with a replicated operand");
    }
    // A contraction over a sharded f: Partial<sum>, made Replicate here to compare.
    {
      using W = typename dt<Mesh, 1, std::conditional_t<two, Placements<R, S<0>>, Placements<S<0>>>>::type;
      auto y = apply_op(RowDot{}, make<XCols>(mesh, shape, 1), make<W>(mesh, {3}, 3));
      using Sum = std::conditional_t<two, Placements<R, P>, Placements<P>>;
      static_assert(std::is_same_v<decltype(y), typename dt<Mesh, 1, Sum>::type>);
      check_full(
          y,
          [](std::int64_t t) {
            double s = 0;
            for (std::int64_t f = 0; f < 3; ++f) {
              s += value(1, t * 3 + f) * value(3, f);
            }
            return s;
          },
          0, "RowDot over sharded features");
    }
    // A free-form rule for an op that creates a dim, uneven rows.
    {
      auto y = apply_op(RowRange{5}, make<XRows>(mesh, shape, 1));
      static_assert(std::is_same_v<decltype(y), XRows>);
      check_full(
          y,
          [](std::int64_t e) {
            const std::int64_t t = e / 2;
            double lo = 1e300;
            double hi = -1e300;
            for (std::int64_t f = 0; f < 3; ++f) {
              lo = std::min(lo, value(1, t * 3 + f));
              hi = std::max(hi, value(1, t * 3 + f));
            }
            return e % 2 == 0 ? lo : hi;
          },
          0, "RowRange");
    }
    // A rule given from outside the type; linear, so a Partial passes.
    {
      auto y = apply_op(Negate{}, make<XPart>(mesh, shape, 4));
      static_assert(std::is_same_v<decltype(y), XPart>);
      check_full(
          y, [](std::int64_t e) { return -value(4, e); }, 0, "Negate of a Partial");
    }
  });
}

} // namespace

TEST_CASE("apply_op: users' ops with an OpSpec, a free rule or op_sharding, on 1-4 ranks and (2,2)",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    custom_cases<Mesh1>(n);
  }
  custom_cases<Mesh2>(4, 2, 2);
}

TEST_CASE("apply_op: a local function that returns the wrong block says so", "[ops]") {
  testing::run_ranks(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    bool threw = false;
    try {
      (void)apply_op(Wrong{}, make<X1S0>(mesh, {4, 3}, 1));
    } catch (const Error& e) {
      threw = std::string(e.what()).find("returned shape [1, 1] where this rank's output block is [2, 3]") !=
              std::string::npos;
      expect(threw, std::string("unexpected message: ") + e.what());
    }
    expect(threw, "a wrong local shape did not throw");
  });
}

// Reductions (ops/reduce.hpp) and dim shuffles and reshapes (ops/shape.hpp) on DTensors against a
// single-process computation, forward and backward: every placement on 1-D meshes of 1-4 ranks and on
// (2,2) and (3,2), uneven and empty shards (5x3 over 4 ranks), Partial inputs with noise that cancels;
// ties in max/min (values in [-3, 3]) share the gradient as in torch.amax.
#include <catch2/catch.hpp>

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/reduce.hpp>
#include <dtensor/ops/shape.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

using One = TypeList<Placements<R>, Placements<S<0>>, Placements<S<1>>, Placements<P>, Placements<Pavg>>;
using Two = TypeList<Placements<R, R>, Placements<S<0>, R>, Placements<R, S<1>>, Placements<S<0>, S<1>>,
                     Placements<S<1>, S<0>>, Placements<S<0>, S<0>>, Placements<P, R>, Placements<R, P>,
                     Placements<P, P>, Placements<P, S<0>>, Placements<Pavg, S<1>>, Placements<Pavg, Pavg>>;

// The reductions of x (value(1, .)) over dim D and their backward with a gradient value(7, .), against
// loops over the global tensor.
template <int D, class X, class Mesh>
void check_reductions(const Mesh& mesh, const X& x, const std::string& name) {
  const std::int64_t rows = x.global_shape()[0];
  const std::int64_t cols = x.global_shape()[1];
  const std::int64_t len = D == 0 ? rows : cols;
  const std::int64_t other = D == 0 ? cols : rows;
  auto at = [&](std::int64_t kept, std::int64_t k) { return D == 0 ? k * cols + kept : kept * cols + k; };
  auto fold = [&](std::int64_t e, double init, auto f) {
    double acc = init;
    for (std::int64_t k = 0; k < len; ++k) {
      acc = f(acc, value(1, at(e, k)));
    }
    return acc;
  };
  const std::string what = name + " over dim " + std::to_string(D);
  auto plus = [](double a, double v) { return a + v; };
  check_full(
      sum<D>(x), [&](std::int64_t e) { return fold(e, 0, plus); }, 0, "sum " + what);
  check_full(
      mean<D>(x), [&](std::int64_t e) { return fold(e, 0, plus) / double(len); }, 1e-15, "mean " + what);
  // sum / mean backward: the gradient (placed like the output) repeated along D, divided by its length for
  // mean. The flat index of x's element (i, j) is i * cols + j; its output element is the kept index.
  auto kept_of = [&](std::int64_t e) { return D == 0 ? e % other : e / len; };
  {
    auto [y, back] = sum<D>(x, with_backward);
    auto [m, mback] = mean<D>(x, with_backward);
    using GY = std::remove_cvref_t<decltype(y)>;
    check_full(
        back(make<GY>(mesh, y.global_shape(), 7)), [&](std::int64_t e) { return value(7, kept_of(e)); }, 0,
        "sum backward " + what);
    check_full(
        mback(make<GY>(mesh, y.global_shape(), 7)),
        [&](std::int64_t e) { return value(7, kept_of(e)) / double(len); }, 1e-15, "mean backward " + what);
  }
  if constexpr (detail::reduce_rule<ReduceOp::max, D, X>().ok()) {
    auto hi = [](double a, double v) { return std::max(a, v); };
    auto lo = [](double a, double v) { return std::min(a, v); };
    check_full(
        max<D>(x), [&](std::int64_t e) { return fold(e, -1e300, hi); }, 0, "max " + what);
    check_full(
        min<D>(x), [&](std::int64_t e) { return fold(e, 1e300, lo); }, 0, "min " + what);
    // The gradient reaches every element equal to the extremum, split evenly between ties.
    auto extremum_grad = [&](auto f, double init) {
      return [&, f, init](std::int64_t e) {
        const std::int64_t kept = kept_of(e);
        const double m = fold(kept, init, f);
        int ties = 0;
        for (std::int64_t k = 0; k < len; ++k) {
          ties += value(1, at(kept, k)) == m ? 1 : 0;
        }
        return value(1, e) == m ? value(7, kept) / ties : 0.0;
      };
    };
    auto [y, back] = max<D>(x, with_backward);
    auto [z, zback] = min<D>(x, with_backward);
    // The gradient of a Partial<max> output is Replicate there (its dual).
    using G = typename detail::BlocksOf<std::remove_cvref_t<decltype(y)>>::type;
    check_full(back(make<G>(mesh, y.global_shape(), 7)), extremum_grad(hi, -1e300), 1e-15,
               "max backward " + what);
    check_full(zback(make<G>(mesh, z.global_shape(), 7)), extremum_grad(lo, 1e300), 1e-15,
               "min backward " + what);
  }
}

template <class Mesh, class Opts, class... Sizes>
void reduce_cases(int ranks, Opts opts, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    for_each(opts, [&]<class PL>() {
      using X = typename dt<Mesh, 2, PL>::type;
      const X x = make<X>(mesh, {5, 3}, 1);
      const std::string name = to_string(X::placements);
      check_reductions<0>(mesh, x, name);
      check_reductions<1>(mesh, x, name);
      // transpose: element (i, j) of the result is x's (j, i); its backward swaps the gradient back.
      const std::int64_t cols = x.global_shape()[1];
      const std::int64_t rows = x.global_shape()[0];
      auto [t, back] = transpose<0, 1>(x, with_backward);
      check_full(
          t, [&](std::int64_t e) { return value(1, (e % rows) * cols + e / rows); }, 0, "transpose " + name);
      using GT = std::remove_cvref_t<decltype(t)>;
      check_full(
          back(make<GT>(mesh, t.global_shape(), 6)),
          [&](std::int64_t e) { return value(6, (e % cols) * rows + e / cols); }, 0,
          "transpose backward " + name);
    });
  });
}

using One3 = TypeList<Placements<R>, Placements<S<0>>, Placements<S<1>>, Placements<S<2>>, Placements<P>,
                      Placements<Pavg>>;
using Two3 = TypeList<Placements<R, R>, Placements<S<0>, S<1>>, Placements<S<2>, S<0>>,
                      Placements<S<0>, S<0>>, Placements<S<1>, S<1>>, Placements<S<1>, S<2>>,
                      Placements<P, S<2>>, Placements<R, Pavg>, Placements<P, P>>;

// permute, flatten, unflatten and reshape of a (12, 12, 2) tensor (12: every dim sharded over 1-4 or 3x2
// ranks is even, so the Shard survives the merges) and their backward.
template <class Mesh, class Opts, class... Sizes>
void shape_cases(int ranks, Opts opts, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const std::array<std::int64_t, 3> shape{12, 12, 2};
    for_each(opts, [&]<class PL>() {
      using X = typename dt<Mesh, 3, PL>::type;
      const X x = make<X>(mesh, shape, 1);
      const std::string name = to_string(X::placements);
      auto identity = [](int seed) { return [seed](std::int64_t e) { return value(seed, e); }; };
      // permute<2, 0, 1>: y(i, j, k) = x(j, k, i), y of shape (2, 12, 12).
      {
        auto [y, back] = permute<2, 0, 1>(x, with_backward);
        static_assert(std::is_same_v<decltype(permute<-1, 0, 1>(x)), decltype(y)>);
        auto x_index = [](std::int64_t e) {
          const std::int64_t i = e / 144;
          const std::int64_t j = (e / 12) % 12;
          const std::int64_t k = e % 12;
          return j * 24 + k * 2 + i;
        };
        check_full(
            y, [&](std::int64_t e) { return value(1, x_index(e)); }, 0, "permute " + name);
        using GY = std::remove_cvref_t<decltype(y)>;
        // dx(j, k, i) = g(i, j, k): x's flat index f = j * 24 + k * 2 + i.
        auto g_index = [](std::int64_t f) { return (f % 2) * 144 + (f / 24) * 12 + (f / 2) % 12; };
        check_full(
            back(make<GY>(mesh, y.global_shape(), 4)), [&](std::int64_t f) { return value(4, g_index(f)); },
            0, "permute backward " + name);
      }
      // flatten / unflatten keep the flat order; unflatten undoes flatten, to the same type.
      if constexpr (detail::RegroupOut<0, 2, true, X>::rule().error == detail::ReshapeError::none) {
        auto [f, back] = flatten<0, 1>(x, with_backward);
        check_full(f, identity(1), 0, "flatten<0, 1> " + name);
        using F = std::remove_cvref_t<decltype(f)>;
        static_assert(F::rank == 2);
        check_full(back(make<F>(mesh, f.global_shape(), 3)), identity(3), 0,
                   "flatten<0, 1> backward " + name);
        auto [u, uback] = unflatten<0>(f, std::array<std::int64_t, 2>{12, -1}, with_backward);
        static_assert(std::is_same_v<decltype(u), X>);
        check_full(u, identity(1), 0, "unflatten<0> " + name);
        check_full(uback(make<X>(mesh, shape, 5)), identity(5), 0, "unflatten<0> backward " + name);
      }
      if constexpr (detail::RegroupOut<1, 2, true, X>::rule().error == detail::ReshapeError::none) {
        auto [f, back] = flatten<1, -1>(x, with_backward);
        check_full(f, identity(1), 0, "flatten<1, 2> " + name);
        using F = std::remove_cvref_t<decltype(f)>;
        check_full(back(make<F>(mesh, f.global_shape(), 3)), identity(3), 0,
                   "flatten<1, 2> backward " + name);
        static_assert(std::is_same_v<decltype(unflatten<1>(f, std::array<std::int64_t, 2>{12, 2})), X>);
      }
      if constexpr (!detail::any_shard(X::placements)) {
        auto [r, back] = reshape<2>(x, {36, 8}, with_backward);
        check_full(r, identity(1), 0, "reshape " + name);
        using RT = std::remove_cvref_t<decltype(r)>;
        check_full(back(make<RT>(mesh, r.global_shape(), 2)), identity(2), 0, "reshape backward " + name);
      }
    });
  });
}

} // namespace

TEST_CASE(
    "reductions over each dim, forward and backward, and transpose: every placement on 1-D meshes of 1-4 "
    "ranks and on (2,2), (3,2)",
    "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    reduce_cases<Mesh1>(n, One{});
  }
  reduce_cases<Mesh2>(4, Two{}, 2, 2);
  reduce_cases<Mesh2>(6, Two{}, 3, 2);
}

TEST_CASE(
    "permute, flatten, unflatten, reshape and their backward: every placement on 1-D meshes of 1-4 ranks "
    "and on (2,2), (3,2)",
    "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    shape_cases<Mesh1>(n, One3{});
  }
  shape_cases<Mesh2>(4, Two3{}, 2, 2);
  shape_cases<Mesh2>(6, Two3{}, 3, 2);
}

TEST_CASE(
    "flatten / unflatten where the shards would not line up: the same error on every rank, naming sizes",
    "[ops]") {
  testing::run_ranks(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    // 5 rows over 2 ranks: [0, 3) and [3, 5); merged with 2 per row: [0, 6), [6, 10), but the chunks of 10
    // are [0, 5), [5, 10).
    using X = DTensor<double, 3, Mesh1, S<0>>;
    const X x = make<X>(mesh, {5, 2, 3}, 1);
    bool threw = false;
    try {
      (void)flatten<0, 1>(x);
    } catch (const Error& e) {
      const std::string m = e.what();
      threw = m.find("flatten<0, 1>") != std::string::npos &&
              m.find("rank 0 of the mesh holds rows [0, 3)") != std::string::npos;
      expect(threw, "unexpected message: " + m);
    }
    expect(threw, "flatten of misaligned shards did not throw");
    // The split: 10 = (5, 2) with the Shard on the 10: [0, 5) is not whole rows of 2.
    using Y = DTensor<double, 2, Mesh1, S<0>>;
    const Y y = make<Y>(mesh, {10, 3}, 1);
    threw = false;
    try {
      (void)unflatten<0>(y, std::array<std::int64_t, 2>{5, 2});
    } catch (const Error& e) {
      threw = std::string(e.what()).find("unflatten<0>") != std::string::npos;
    }
    expect(threw, "unflatten of misaligned shards did not throw");
    threw = false;
    try {
      (void)unflatten<0>(y, std::array<std::int64_t, 2>{3, 3});
    } catch (const Error& e) {
      threw = std::string(e.what()).find("multiply to 9") != std::string::npos;
    }
    expect(threw, "unflatten into sizes of the wrong product did not throw");
  });
}

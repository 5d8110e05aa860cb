// Pointwise ops on DTensors (ops/pointwise.hpp) against a single-process computation: every input
// placement combination the rules accept on 1-D meshes of 1-4 ranks and on (2,2) and (3,2), uneven and
// empty shards (5x3 over 4 ranks), Partial inputs with noise that cancels; and the unary backwards. The
// references are the formulas written here (gelu's erf form, silu, exp, relu and their derivatives), never
// the library's element functions. A (4, 67) tensor gives shards of 32+ contiguous elements with a tail on
// every mesh (the host maps' vectorised blocks of 32 and the elements after them).
#include <catch2/catch.hpp>

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <cmath>
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

template <class X, class F>
constexpr bool accepts_unary() {
  return detail::pointwise_rule<Linearity::nonlinear, X>().ok();
}

// The references: torch's definitions, in double.
double gelu_ref(double x) {
  return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
}
double gelu_grad_ref(double x, double g) {
  const double pi = 3.14159265358979323846;
  const double cdf = 0.5 * (1 + std::erf(x / std::sqrt(2.0)));
  const double pdf = std::exp(-x * x / 2) / std::sqrt(2 * pi);
  return g * (cdf + x * pdf);
}
double sigmoid_ref(double x) {
  return 1 / (1 + std::exp(-x));
}
double silu_ref(double x) {
  return x * sigmoid_ref(x);
}
double silu_grad_ref(double x, double g) {
  const double s = sigmoid_ref(x);
  return g * (s + x * s * (1 - s));
}

// The unary ops on a (5, 3) tensor, and a (4, 67) one (`wide`), of every placement in `opts`; the
// backwards with a gradient of every placement in `opts` ((5, 3)), or of the input's placements (wide).
template <class Mesh, class Opts, class... Sizes>
void unary_cases(int ranks, Opts opts, bool wide, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const std::array<std::int64_t, 2> shape =
        wide ? std::array<std::int64_t, 2>{4, 67} : std::array<std::int64_t, 2>{5, 3};
    for_each(opts, [&]<class PL>() {
      using X = typename dt<Mesh, 2, PL>::type;
      const X x = make<X>(mesh, shape, 1);
      const std::string name =
          to_string(X::placements) + " (" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ")";
      check_full(
          scale(x, 3.0), [](std::int64_t e) { return 3 * value(1, e); }, 0, "scale " + name);
      if constexpr (detail::pointwise_rule<Linearity::nonlinear, X>().ok()) {
        check_full(
            relu(x), [](std::int64_t e) { return std::max(value(1, e), 0.0); }, 0, "relu " + name);
        check_full(
            exp(x), [](std::int64_t e) { return std::exp(value(1, e)); }, 1e-14, "exp " + name);
        check_full(
            gelu(x), [](std::int64_t e) { return gelu_ref(value(1, e)); }, 1e-14, "gelu " + name);
        check_full(
            silu(x), [](std::int64_t e) { return silu_ref(value(1, e)); }, 1e-14, "silu " + name);
        check_full(
            add(x, 2.5), [](std::int64_t e) { return value(1, e) + 2.5; }, 0, "x + 2.5 " + name);
        // Backward: the input's gradient is f'(x) * g.
        auto grads = [&]<class G>() {
          const G g = make<G>(mesh, shape, 2);
          const std::string gname = name + " with gradient " + to_string(G::placements);
          auto [y, back] = gelu(x, with_backward);
          check_full(
              back(g), [](std::int64_t e) { return gelu_grad_ref(value(1, e), value(2, e)); }, 1e-14,
              "gelu backward " + gname);
          auto [si, siback] = silu(x, with_backward);
          check_full(
              siback(g), [](std::int64_t e) { return silu_grad_ref(value(1, e), value(2, e)); }, 1e-14,
              "silu backward " + gname);
          auto [ex, exback] = exp(x, with_backward);
          check_full(
              exback(g), [](std::int64_t e) { return value(2, e) * std::exp(value(1, e)); }, 1e-14,
              "exp backward " + gname);
          auto [r, rback] = relu(x, with_backward);
          check_full(
              rback(g), [](std::int64_t e) { return value(1, e) > 0 ? value(2, e) : 0.0; }, 0,
              "relu backward " + gname);
          auto [s, sback] = scale(x, -2.0, with_backward);
          check_full(
              sback(g), [](std::int64_t e) { return -2 * value(2, e); }, 0, "scale backward " + gname);
        };
        if (wide) {
          grads.template operator()<X>();
        } else {
          for_each(opts, [&]<class GL>() { grads.template operator()<typename dt<Mesh, 2, GL>::type>(); });
        }
      }
    });
  });
}

// The binary ops on (5, 3) tensors, or (4, 67) ones (`wide`), every pair of placements in `opts`.
template <class Mesh, class Opts, class... Sizes>
void binary_cases(int ranks, Opts opts, bool wide, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const std::array<std::int64_t, 2> shape =
        wide ? std::array<std::int64_t, 2>{4, 67} : std::array<std::int64_t, 2>{5, 3};
    for_each(opts, [&]<class AL>() {
      using A = typename dt<Mesh, 2, AL>::type;
      const A a = make<A>(mesh, shape, 1);
      for_each(opts, [&]<class BL>() {
        using B = typename dt<Mesh, 2, BL>::type;
        const B b = make<B>(mesh, shape, 3);
        const std::string name = to_string(A::placements) + " and " + to_string(B::placements);
        auto va = [](std::int64_t e) { return value(1, e); };
        auto vb = [](std::int64_t e) { return value(3, e); };
        if constexpr (detail::pointwise_rule<Linearity::additive, A, B>().ok()) {
          check_full(
              add(a, b), [&](std::int64_t e) { return va(e) + vb(e); }, 0, "add " + name);
          check_full(
              sub(a, b), [&](std::int64_t e) { return va(e) - vb(e); }, 0, "sub " + name);
        }
        if constexpr (detail::pointwise_rule<Linearity::multiplicative, A, B>().ok()) {
          check_full(
              mul(a, b), [&](std::int64_t e) { return va(e) * vb(e); }, 0, "mul " + name);
        }
        // Backward with a Replicate and a Partial<sum> gradient: da, db against the derivatives.
        using GR = typename dt<Mesh, 2, typename detail::AllReplicate<Mesh::rank>::type>::type;
        using GP =
            std::conditional_t<Mesh::rank == 1, DTensor<double, 2, Mesh, P>, DTensor<double, 2, Mesh, P, P>>;
        auto vg = [](std::int64_t e) { return value(5, e); };
        auto grads = [&]<class G>(const G& g) {
          const std::string gname = name + " with gradient " + to_string(G::placements);
          if constexpr (detail::pointwise_rule<Linearity::additive, A, B>().ok()) {
            auto [y, back] = add(a, b, with_backward);
            auto [da, db] = back(g);
            check_full(da, vg, 0, "add backward da " + gname);
            check_full(db, vg, 0, "add backward db " + gname);
            auto [y2, back2] = sub(a, b, with_backward);
            auto [da2, db2] = back2(g);
            check_full(
                db2, [&](std::int64_t e) { return -vg(e); }, 0, "sub backward db " + gname);
          }
          if constexpr (detail::pointwise_rule<Linearity::multiplicative, A, B>().ok()) {
            auto [y, back] = mul(a, b, with_backward);
            auto [da, db] = back(g);
            check_full(
                da, [&](std::int64_t e) { return vg(e) * vb(e); }, 0, "mul backward da " + gname);
            check_full(
                db, [&](std::int64_t e) { return vg(e) * va(e); }, 0, "mul backward db " + gname);
          }
          if constexpr (detail::pointwise_rule<Linearity::quotient, A, B>().ok()) {
            auto shifted = add(b, 10.0);
            auto [y, back] = div(a, shifted, with_backward);
            auto [da, db] = back(g);
            check_full(
                da, [&](std::int64_t e) { return vg(e) / (vb(e) + 10); }, 1e-15, "div backward da " + gname);
            check_full(
                db, [&](std::int64_t e) { return -vg(e) * va(e) / ((vb(e) + 10) * (vb(e) + 10)); }, 1e-15,
                "div backward db " + gname);
          }
        };
        grads(make<GR>(mesh, shape, 5));
        grads(make<GP>(mesh, shape, 5));
        if constexpr (detail::pointwise_rule<Linearity::quotient, A, B>().ok()) {
          // value(3, .) is never 0 where it divides: shift it away from 0.
          auto shifted = add(b, 10.0);
          check_full(
              div(a, shifted), [&](std::int64_t e) { return va(e) / (vb(e) + 10); }, 1e-15, "div " + name);
        }
      });
      // A bias of rank 1 (the last dim) with each placement the rules accept.
      using Bias = DTensor<double, 1, Mesh, R, R>;
      if constexpr (Mesh::rank == 1) {
        using B1 = DTensor<double, 1, Mesh, R>;
        using B2 = DTensor<double, 1, Mesh, S<0>>;
        const std::int64_t cols = shape[1];
        const B1 b1 = make<B1>(mesh, {cols}, 4);
        const B2 b2 = make<B2>(mesh, {cols}, 4);
        if constexpr (detail::pointwise_rule<Linearity::multiplicative, A, B1>().ok()) {
          check_full(
              mul(a, b1), [&](std::int64_t e) { return value(1, e) * value(4, e % cols); }, 0,
              "mul by a replicated row " + to_string(A::placements));
        }
        if constexpr (detail::pointwise_rule<Linearity::multiplicative, A, B2>().ok()) {
          check_full(
              mul(a, b2), [&](std::int64_t e) { return value(1, e) * value(4, e % cols); }, 0,
              "mul by a sharded row " + to_string(A::placements));
        }
        if constexpr (detail::pointwise_rule<Linearity::multiplicative, A, B1>().ok()) {
          // The row's gradient sums over the rows: sum_i g(i, j) * a(i, j).
          auto [y, back] = mul(a, b1, with_backward);
          auto [da, db] = back(make<DTensor<double, 2, Mesh, R>>(mesh, shape, 5));
          auto want = [&](std::int64_t j) {
            double s = 0;
            for (std::int64_t i = 0; i < shape[0]; ++i) {
              s += value(5, i * shape[1] + j) * value(1, i * shape[1] + j);
            }
            return s;
          };
          check_full(db, want, 0, "mul by a replicated row, the row's gradient " + to_string(A::placements));
        }
      } else {
        (void)sizeof(Bias);
      }
    });
  });
}

} // namespace

TEST_CASE("pointwise unary ops and their backward on 1-D meshes, every placement, 1-4 ranks", "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    unary_cases<Mesh1>(n, One{}, false);
    unary_cases<Mesh1>(n, One{}, true);
  }
}

TEST_CASE("pointwise unary ops and their backward on 2-D meshes (2,2) and (3,2)", "[ops]") {
  unary_cases<Mesh2>(4, Two{}, false, 2, 2);
  unary_cases<Mesh2>(6, Two{}, false, 3, 2);
  unary_cases<Mesh2>(4, Two{}, true, 2, 2);
  unary_cases<Mesh2>(6, Two{}, true, 3, 2);
}

TEST_CASE("pointwise binary ops on 1-D meshes: every pair of placements the rules accept, 1-4 ranks",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    binary_cases<Mesh1>(n, One{}, false);
    binary_cases<Mesh1>(n, One{}, true);
  }
}

TEST_CASE("pointwise binary ops on 2-D meshes (2,2) and (3,2)", "[ops]") {
  binary_cases<Mesh2>(4, Two{}, false, 2, 2);
  binary_cases<Mesh2>(6, Two{}, false, 3, 2);
}

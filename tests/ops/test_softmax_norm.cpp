// softmax / log_softmax (ops/softmax.hpp) and layer_norm / rms_norm (ops/norm.hpp) on DTensors against a
// single-process computation: forward against the formula, backward against central finite differences
// of the single-process forward (every element: the tensors are small), on 1-D meshes of 1-4 ranks and
// on (2,2) and (3,2), uneven and empty shards (5 x 3 and 5 x 6 over 4 ranks), gradients of several
// placements (a Partial gradient on Replicate axes stays Partial). The distributed softmax over a sharded
// dim moves one value per row, never the rows (CommDebugMode). Rows of 67-268 columns per shard reach the
// host row kernels' 16-lane sums and blocks of 32 with their tails: softmax forward and backward against
// the formulas written out, layer_norm and rms_norm against the formula and finite differences.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/norm.hpp>
#include <dtensor/ops/softmax.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

using Vec = std::vector<double>;
using Forward = std::function<Vec(const Vec&)>;

Vec values(int seed, std::int64_t n, double scale = 0.25) {
  Vec v(static_cast<std::size_t>(n));
  for (std::int64_t e = 0; e < n; ++e) {
    v[static_cast<std::size_t>(e)] = scale * value(seed, e);
  }
  return v;
}

// d/dx_e of sum_i g_i f(x)_i by central differences.
Vec finite_difference(const Forward& f, Vec x, const Vec& g) {
  const double h = 1e-5;
  Vec d(x.size());
  for (std::size_t e = 0; e < x.size(); ++e) {
    const double keep = x[e];
    auto loss = [&](double v) {
      x[e] = v;
      const Vec y = f(x);
      double s = 0;
      for (std::size_t i = 0; i < y.size(); ++i) {
        s += g[i] * y[i];
      }
      return s;
    };
    d[e] = (loss(keep + h) - loss(keep - h)) / (2 * h);
    x[e] = keep;
  }
  return d;
}

template <class Y>
void check_vec(const Y& y, const Vec& want, double tol, const std::string& what) {
  check_full(
      y, [&](std::int64_t e) { return want[static_cast<std::size_t>(e)]; }, tol, what);
}

// softmax / log_softmax of a (rows, cols) matrix along dim D.
template <int D>
Vec softmax_ref(const Vec& x, std::int64_t rows, std::int64_t cols, bool log) {
  Vec y(x.size());
  const std::int64_t len = D == 0 ? rows : cols;
  const std::int64_t other = D == 0 ? cols : rows;
  for (std::int64_t o = 0; o < other; ++o) {
    auto at = [&](std::int64_t k) { return static_cast<std::size_t>(D == 0 ? k * cols + o : o * cols + k); };
    double m = -1e300;
    for (std::int64_t k = 0; k < len; ++k) {
      m = std::max(m, x[at(k)]);
    }
    double s = 0;
    for (std::int64_t k = 0; k < len; ++k) {
      s += std::exp(x[at(k)] - m);
    }
    for (std::int64_t k = 0; k < len; ++k) {
      y[at(k)] = log ? x[at(k)] - m - std::log(s) : std::exp(x[at(k)] - m) / s;
    }
  }
  return y;
}

// A DTensor holding scale * value(seed, .) (make() holds value(seed, .)).
template <class X, class Mesh>
X scaled(const Mesh& mesh, const typename X::shape_type& shape, int seed, double scale) {
  const X x = make<X>(mesh, shape, seed);
  return X(x.mesh(), local::map(local::Scale{scale}, x.local()), shape);
}

template <class Mesh, class Opts, class Grads, class... Sizes>
void softmax_cases(int ranks, Opts opts, Grads grads, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const std::int64_t rows = 5;
    const std::int64_t cols = 3;
    for_each(opts, [&]<class PL>() {
      using X = typename dt<Mesh, 2, PL>::type;
      const X x = scaled<X>(mesh, {rows, cols}, 1, 0.5);
      const Vec xv = values(1, rows * cols, 0.5);
      const std::string name = to_string(X::placements);
      auto each_dim = [&]<int D>() {
        const std::string what = name + " along dim " + std::to_string(D);
        check_vec(softmax<D>(x), softmax_ref<D>(xv, rows, cols, false), 1e-14, "softmax " + what);
        check_vec(log_softmax<D>(x), softmax_ref<D>(xv, rows, cols, true), 1e-14, "log_softmax " + what);
        auto [y, back] = softmax<D>(x, with_backward);
        auto [l, lback] = log_softmax<D>(x, with_backward);
        for_each(grads, [&]<class GL>() {
          using G = typename dt<Mesh, 2, GL>::type;
          const G g = make<G>(mesh, {rows, cols}, 7);
          const Vec gv = values(7, rows * cols, 1);
          const std::string gw = what + " with gradient " + to_string(G::placements);
          check_vec(
              back(g),
              finite_difference([&](const Vec& v) { return softmax_ref<D>(v, rows, cols, false); }, xv, gv),
              1e-8, "softmax backward " + gw);
          check_vec(
              lback(g),
              finite_difference([&](const Vec& v) { return softmax_ref<D>(v, rows, cols, true); }, xv, gv),
              1e-8, "log_softmax backward " + gw);
        });
      };
      each_dim.template operator()<0>();
      each_dim.template operator()<1>();
    });
  });
}

// layer_norm / rms_norm of (rows, n) over the last dim, with weight w and bias b.
Vec norm_ref(const Vec& x, const Vec& w, const Vec* b, std::int64_t n, bool rms, double eps) {
  Vec y(x.size());
  const std::int64_t rows = static_cast<std::int64_t>(x.size()) / n;
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* row = x.data() + r * n;
    double mean = 0;
    for (std::int64_t k = 0; k < n; ++k) {
      mean += row[k] / double(n);
    }
    mean = rms ? 0 : mean;
    double var = 0;
    for (std::int64_t k = 0; k < n; ++k) {
      var += (row[k] - mean) * (row[k] - mean) / double(n);
    }
    const double rstd = 1 / std::sqrt(var + eps);
    for (std::int64_t k = 0; k < n; ++k) {
      const auto i = static_cast<std::size_t>(r * n + k);
      const auto j = static_cast<std::size_t>(k);
      y[i] = (row[k] - mean) * rstd * w[j] + (b != nullptr ? (*b)[j] : 0.0);
    }
  }
  return y;
}

template <class Mesh, class Opts, class... Sizes>
void norm_cases(int ranks, Opts opts, std::int64_t n, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const std::int64_t rows = 5;
    const double eps = 1e-5;
    using Rep = std::conditional_t<Mesh::rank == 2, Placements<R, R>, Placements<R>>;
    using W = typename dt<Mesh, 1, Rep>::type;
    const W w = scaled<W>(mesh, {n}, 2, 0.5);
    const W b = scaled<W>(mesh, {n}, 3, 0.5);
    const Vec wv = values(2, n, 0.5);
    const Vec bv = values(3, n, 0.5);
    for_each(opts, [&]<class PL>() {
      using X = typename dt<Mesh, 2, PL>::type;
      const X x = scaled<X>(mesh, {rows, n}, 1, 0.5);
      const Vec xv = values(1, rows * n, 0.5);
      const std::string name =
          to_string(X::placements) + " (" + std::to_string(rows) + ", " + std::to_string(n) + ")";
      check_vec(layer_norm<1>(x, w, b, eps), norm_ref(xv, wv, &bv, n, false, eps), 1e-12,
                "layer_norm " + name);
      check_vec(rms_norm<1>(x, w, eps), norm_ref(xv, wv, nullptr, n, true, eps), 1e-12, "rms_norm " + name);
      // The gradient placed like the output, and (where x is Replicate somewhere) Partial there.
      auto grads = [&]<class G>() {
        const G g = make<G>(mesh, {rows, n}, 7);
        const Vec gv = values(7, rows * n, 1);
        const std::string what = name + " with gradient " + to_string(G::placements);
        auto [y, back] = layer_norm<1>(x, w, b, eps, with_backward);
        auto [dx, dw, db] = back(g);
        check_vec(
            dx, finite_difference([&](const Vec& v) { return norm_ref(v, wv, &bv, n, false, eps); }, xv, gv),
            1e-7, "layer_norm dx " + what);
        check_vec(
            dw, finite_difference([&](const Vec& v) { return norm_ref(xv, v, &bv, n, false, eps); }, wv, gv),
            1e-7, "layer_norm dw " + what);
        check_vec(
            db, finite_difference([&](const Vec& v) { return norm_ref(xv, wv, &v, n, false, eps); }, bv, gv),
            1e-7, "layer_norm db " + what);
        auto [r, rback] = rms_norm<1>(x, w, eps, with_backward);
        auto [rdx, rdw] = rback(g);
        check_vec(
            rdx,
            finite_difference([&](const Vec& v) { return norm_ref(v, wv, nullptr, n, true, eps); }, xv, gv),
            1e-7, "rms_norm dx " + what);
        check_vec(
            rdw,
            finite_difference([&](const Vec& v) { return norm_ref(xv, v, nullptr, n, true, eps); }, wv, gv),
            1e-7, "rms_norm dw " + what);
        // Each rank summed its own rows: the weight's gradient is Partial where x shards the rows.
        using DW = std::remove_cvref_t<decltype(dw)>;
        for (int a = 0; a < Mesh::rank; ++a) {
          expect(DW::placements[a].is_partial() ==
                     (X::placements[a].is_shard() || G::placements[a].is_partial()),
                 "dw placements " + to_string(DW::placements));
        }
      };
      grads.template operator()<X>();
      if constexpr (X::placements[0].is_replicate()) {
        using GP =
            typename dt<Mesh, 2, std::conditional_t<Mesh::rank == 2, Placements<P, R>, Placements<P>>>::type;
        if constexpr (Mesh::rank == 1 || X::placements[1].is_replicate()) {
          grads.template operator()<GP>();
        }
      }
    });
  });
}

// softmax and log_softmax along dim D of x (rows, cols) holding 0.5 value(1, .), on rows wide enough for
// the host kernels' lanes and blocks; the backward against y (g - sum(g y)) and g - softmax(x) sum(g)
// along the dim, written out here.
template <class Mesh, class PL, int D>
void wide_softmax_case(const DeviceMesh<Mesh>& mesh, std::int64_t rows, std::int64_t cols) {
  using X = typename dt<Mesh, 2, PL>::type;
  const X x = scaled<X>(mesh, {rows, cols}, 1, 0.5);
  const Vec xv = values(1, rows * cols, 0.5);
  const X g = make<X>(mesh, {rows, cols}, 7);
  const Vec gv = values(7, rows * cols, 1);
  const std::string what = to_string(X::placements) + " (" + std::to_string(rows) + ", " +
                           std::to_string(cols) + ") along dim " + std::to_string(D);
  const Vec y = softmax_ref<D>(xv, rows, cols, false);
  check_vec(softmax<D>(x), y, 1e-13, "softmax " + what);
  check_vec(log_softmax<D>(x), softmax_ref<D>(xv, rows, cols, true), 1e-13, "log_softmax " + what);
  const std::int64_t len = D == 0 ? rows : cols;
  const std::int64_t other = D == 0 ? cols : rows;
  Vec dsoft(xv.size()), dlog(xv.size());
  for (std::int64_t o = 0; o < other; ++o) {
    auto at = [&](std::int64_t k) { return static_cast<std::size_t>(D == 0 ? k * cols + o : o * cols + k); };
    double gy = 0, gs = 0;
    for (std::int64_t k = 0; k < len; ++k) {
      gy += gv[at(k)] * y[at(k)];
      gs += gv[at(k)];
    }
    for (std::int64_t k = 0; k < len; ++k) {
      dsoft[at(k)] = y[at(k)] * (gv[at(k)] - gy);
      dlog[at(k)] = gv[at(k)] - y[at(k)] * gs;
    }
  }
  auto [s, back] = softmax<D>(x, with_backward);
  check_vec(back(g), dsoft, 1e-12, "softmax backward " + what);
  auto [l, lback] = log_softmax<D>(x, with_backward);
  check_vec(lback(g), dlog, 1e-12, "log_softmax backward " + what);
}

using One = TypeList<Placements<R>, Placements<S<0>>, Placements<S<1>>>;
using Two = TypeList<Placements<R, R>, Placements<S<0>, R>, Placements<R, S<1>>, Placements<S<0>, S<1>>,
                     Placements<S<1>, S<0>>, Placements<S<0>, S<0>>>;
using OneGrads = TypeList<Placements<R>, Placements<S<0>>, Placements<P>>;
using TwoGrads = TypeList<Placements<R, R>, Placements<P, S<1>>, Placements<S<0>, P>>;
using OneRows = TypeList<Placements<R>, Placements<S<0>>>;
using TwoRows = TypeList<Placements<R, R>, Placements<S<0>, R>, Placements<R, S<0>>, Placements<S<0>, S<0>>>;

} // namespace

TEST_CASE("softmax and log_softmax along each dim, forward and backward: every placement on 1-D meshes of "
          "1-4 ranks and on (2,2), (3,2)",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    softmax_cases<Mesh1>(n, One{}, OneGrads{});
  }
  softmax_cases<Mesh2>(4, Two{}, TwoGrads{}, 2, 2);
  softmax_cases<Mesh2>(6, Two{}, TwoGrads{}, 3, 2);
}

TEST_CASE("softmax over a sharded dim moves one value per row (max and sum all_reduces), never the rows",
          "[ops]") {
  testing::run_ranks(4, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    using X = DTensor<double, 2, Mesh1, S<1>>;
    const X x = make<X>(mesh, {6, 40}, 1);
    CommDebugMode debug;
    (void)softmax<1>(x);
    expect(debug.count("all_reduce") == 2 && debug.total_count() == 2,
           "softmax over a sharded dim: want 2 all_reduces, got\n" + debug.to_string());
    // Each all_reduce carries the 6 row statistics (48 bytes; counted as a ring's 2(n-1)/n), not the
    // 6 x 10 shard (480 bytes).
    expect(debug.total_bytes() <= 2 * 2 * 6 * 8, "softmax over a sharded dim moved\n" + debug.to_string());
  });
}

TEST_CASE("layer_norm and rms_norm with weight and bias, forward and backward: row (sequence) sharding on "
          "1-D meshes of 1-4 ranks and on (2,2), (3,2)",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    norm_cases<Mesh1>(n, OneRows{}, 6);
  }
  norm_cases<Mesh2>(4, TwoRows{}, 6, 2, 2);
  norm_cases<Mesh2>(6, TwoRows{}, 6, 3, 2);
}

TEST_CASE("softmax, log_softmax, layer_norm and rms_norm on rows of 67-268 columns (the host row kernels' "
          "16-lane sums, blocks of 32 and their tails), forward and backward, on 1-4 ranks and (2,2)",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    // 268 columns: shards of 268, 134, 90 / 90 / 88 and 67 on dim 1.
    testing::run_ranks(n, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      wide_softmax_case<Mesh1, Placements<S<1>>, 1>(mesh, 3, 268);
      wide_softmax_case<Mesh1, Placements<S<0>>, 1>(mesh, 5, 67);
      wide_softmax_case<Mesh1, Placements<R>, 1>(mesh, 3, 67);
      wide_softmax_case<Mesh1, Placements<S<1>>, 0>(mesh, 3, 268);
    });
    // Rows of 67: 4 lanes of 16 and 3, 2 blocks of 32 and 3.
    norm_cases<Mesh1>(n, OneRows{}, 67);
  }
  testing::run_ranks(4, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
    wide_softmax_case<Mesh2, Placements<S<0>, S<1>>, 1>(mesh, 5, 134);
    wide_softmax_case<Mesh2, Placements<S<1>, S<1>>, 1>(mesh, 3, 268);
  });
  norm_cases<Mesh2>(4, TwoRows{}, 67, 2, 2);
}

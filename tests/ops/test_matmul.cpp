// matmul and linear on DTensors (ops/matmul.hpp), forward and backward, against a single-process
// computation: every pair of input placements the rules accept on 1-D meshes of 1-4 ranks and a set of
// 2-D ones on (2,2) and (3,2), 2-D and batched, uneven and empty shards, gradients Replicate and Partial.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/matmul.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <string>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

// The reference as flat row-major vectors: C = A op(B) and the gradients for dC, batch-aware.
struct Ref {
  std::vector<double> c, da, db;
};

// a: (bs, m, k) (bs = 1 for 2-D), b: (bb, k, n) or, for linear, (bb, n, k); bb is 1 when shared.
Ref reference(std::int64_t bs, std::int64_t m, std::int64_t k, std::int64_t n, bool shared, bool linear) {
  Ref r;
  r.c.assign(bs * m * n, 0);
  r.da.assign(bs * m * k, 0);
  r.db.assign((shared ? 1 : bs) * k * n, 0);
  auto A = [&](std::int64_t b, std::int64_t i, std::int64_t l) { return value(1, (b * m + i) * k + l); };
  auto B = [&](std::int64_t b, std::int64_t l, std::int64_t j) {
    const std::int64_t bb = shared ? 0 : b;
    return value(2, linear ? (bb * n + j) * k + l : (bb * k + l) * n + j);
  };
  auto G = [&](std::int64_t b, std::int64_t i, std::int64_t j) { return value(5, (b * m + i) * n + j); };
  for (std::int64_t b = 0; b < bs; ++b) {
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        for (std::int64_t l = 0; l < k; ++l) {
          r.c[(b * m + i) * n + j] += A(b, i, l) * B(b, l, j);
          r.da[(b * m + i) * k + l] += G(b, i, j) * B(b, l, j);
          const std::int64_t bb = shared ? 0 : b;
          r.db[linear ? (bb * n + j) * k + l : (bb * k + l) * n + j] += A(b, i, l) * G(b, i, j);
        }
      }
    }
  }
  return r;
}

template <class X>
void check_full(const X& x, const std::vector<double>& want, const std::string& what) {
  const auto full = x.full_tensor();
  expect(full.numel() == std::int64_t(want.size()), what + ": size");
  for (std::int64_t e = 0; e < full.numel(); ++e) {
    expect(full.data()[e] == want[e], what + ": element " + std::to_string(e) + " is " +
                                          std::to_string(full.data()[e]) + ", want " +
                                          std::to_string(want[e]));
  }
}

template <bool Linear, int RA, int RB, class Mesh, class OptsA, class OptsB, class... Sizes>
void cases(int ranks, OptsA oa, OptsB ob, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const std::int64_t bs = RA == 3 ? 2 : 1, m = 5, k = 4, n = 3;
    const bool shared = RB == 2;
    const Ref ref = reference(bs, m, k, n, shared, Linear);
    for_each(oa, [&]<class AL>() {
      using A = typename dt<Mesh, RA, AL>::type;
      typename A::shape_type sa{};
      if constexpr (RA == 3) {
        sa = {bs, m, k};
      } else {
        sa = {m, k};
      }
      const A a = make<A>(mesh, sa, 1);
      for_each(ob, [&]<class BL>() {
        using B = typename dt<Mesh, RB, BL>::type;
        using Ps = detail::Products<RA, RB, Linear>;
        if constexpr (detail::ProductOut<&Ps::forward, A, B>::rule().ok()) {
          typename B::shape_type sb{};
          if constexpr (RB == 3) {
            sb = Linear ? typename B::shape_type{bs, n, k} : typename B::shape_type{bs, k, n};
          } else {
            sb = Linear ? typename B::shape_type{n, k} : typename B::shape_type{k, n};
          }
          const B b = make<B>(mesh, sb, 2);
          const std::string name = std::string(Linear ? "linear " : "matmul ") + to_string(A::placements) +
                                   " x " + to_string(B::placements);
          auto [c, back] = [&] {
            if constexpr (Linear) {
              return linear(a, b, with_backward);
            } else {
              return matmul(a, b, with_backward);
            }
          }();
          check_full(c, ref.c, name);
          using C = decltype(c);
          typename C::shape_type sc = c.global_shape();
          // The gradient Replicate, and Partial<sum> with noise.
          using GR = typename dt<Mesh, RA, typename detail::AllReplicate<Mesh::rank>::type>::type;
          const GR g = make<GR>(mesh, sc, 5);
          auto [da, db] = back(g);
          check_full(da, ref.da, name + ": dA for a Replicate gradient");
          check_full(db, ref.db, name + ": dB for a Replicate gradient");
          static_assert(fits_gradient(A::placements, decltype(da)::placements, RA) &&
                        fits_gradient(B::placements, decltype(db)::placements, RB));
        }
      });
    });
  });
}

using One = TypeList<Placements<R>, Placements<S<0>>, Placements<S<1>>, Placements<P>>;
using OneB = TypeList<Placements<R>, Placements<S<0>>, Placements<S<1>>, Placements<S<2>>, Placements<P>>;
using Two = TypeList<Placements<R, R>, Placements<S<0>, R>, Placements<R, S<1>>, Placements<S<0>, S<1>>,
                     Placements<S<1>, S<0>>, Placements<S<1>, S<1>>, Placements<P, R>, Placements<R, P>>;

} // namespace

TEST_CASE("matmul 2-D on 1-D meshes: every accepted pair, forward and backward, 1-4 ranks", "[ops]") {
  for (int r = 1; r <= 4; ++r) {
    INFO("ranks " << r);
    cases<false, 2, 2, Mesh1>(r, One{}, One{});
    cases<true, 2, 2, Mesh1>(r, One{}, One{});
  }
}

TEST_CASE("matmul and linear on 2-D meshes (2,2) and (3,2)", "[ops]") {
  cases<false, 2, 2, Mesh2>(4, Two{}, Two{}, 2, 2);
  cases<false, 2, 2, Mesh2>(6, Two{}, Two{}, 3, 2);
  cases<true, 2, 2, Mesh2>(4, Two{}, Two{}, 2, 2);
}

TEST_CASE("batched matmul: (b, m, k) x (k, n) shared and (b, m, k) x (b, k, n), 1-D meshes", "[ops]") {
  for (int r = 1; r <= 4; ++r) {
    INFO("ranks " << r);
    cases<false, 3, 2, Mesh1>(r, OneB{}, One{});
    cases<true, 3, 2, Mesh1>(r, OneB{}, One{});
    cases<false, 3, 3, Mesh1>(r, OneB{}, OneB{});
  }
}

TEST_CASE("the Megatron pair: column- then row-parallel matmul communicates only in the row output",
          "[ops]") {
  testing::run_ranks(4, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    using X = DTensor<double, 2, Mesh1, R>;
    const auto x = make<X>(mesh, {5, 4}, 1);
    const auto w1 = make<DTensor<double, 2, Mesh1, S<1>>>(mesh, {4, 6}, 2);
    const auto w2 = make<DTensor<double, 2, Mesh1, S<0>>>(mesh, {6, 3}, 3);
    CommDebugMode comm;
    auto h = matmul(x, w1);
    auto y = matmul(h, w2);
    static_assert(std::is_same_v<decltype(y), DTensor<double, 2, Mesh1, P>>);
    expect(comm.total_count() == 0, "the pair runs without communication\n" + comm.to_string());
    auto z = y.redistribute<R>();
    expect(comm.total_count() == 1 && comm.count("all_reduce") == 1, "one all_reduce\n" + comm.to_string());
  });
}

TEST_CASE("linear with a bias, forward and backward: column parallel and row-sharded inputs on 1-4 ranks",
          "[ops]") {
  for (int ranks = 1; ranks <= 4; ++ranks) {
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      const std::int64_t m = 5, k = 4, n = 3;
      auto check = [&]<class X, class W, class B>() {
        const X x = make<X>(mesh, {m, k}, 1);
        const W w = make<W>(mesh, {n, k}, 2);
        const B b = make<B>(mesh, {n}, 3);
        auto [y, back] = linear(x, w, b, with_backward);
        using Y = decltype(y);
        const std::string name =
            "linear with bias " + to_string(X::placements) + " " + to_string(W::placements);
        std::vector<double> want(static_cast<std::size_t>(m * n));
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) {
            double s = value(3, j);
            for (std::int64_t l = 0; l < k; ++l) {
              s += value(1, i * k + l) * value(2, j * k + l);
            }
            want[static_cast<std::size_t>(i * n + j)] = s;
          }
        }
        check_full(y, want, name);
        const Y g = make<Y>(mesh, y.global_shape(), 4);
        auto [dx, dw, db] = back(g);
        std::vector<double> want_db(static_cast<std::size_t>(n), 0.0);
        std::vector<double> want_dx(static_cast<std::size_t>(m * k), 0.0);
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) {
            want_db[static_cast<std::size_t>(j)] += value(4, i * n + j);
            for (std::int64_t l = 0; l < k; ++l) {
              want_dx[static_cast<std::size_t>(i * k + l)] += value(4, i * n + j) * value(2, j * k + l);
            }
          }
        }
        check_full(db, want_db, name + ": db");
        check_full(dx, want_dx, name + ": dx");
        (void)dw; // dW = dy^T x is the linear's own, tested above
      };
      check.template operator()<DTensor<double, 2, Mesh1, S<0>>, DTensor<double, 2, Mesh1, R>,
                                DTensor<double, 1, Mesh1, R>>();
      check.template operator()<DTensor<double, 2, Mesh1, R>, DTensor<double, 2, Mesh1, S<0>>,
                                DTensor<double, 1, Mesh1, S<0>>>();
    });
  }
}

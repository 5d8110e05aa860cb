// Collective matmul (ops/collective_matmul.hpp), forward and backward, against the unfused calls (the
// redistribute, then linear; linear, then the redistribute) and a single-process product: 1-D meshes of 1-4
// ranks, (dp, tp) and (cp, tp) meshes, even, uneven and empty sequence shards. Integer-valued doubles and
// floats compare bit for bit; non-integer ones bit for bit where the same GEMM runs on the same data (the
// gathered x, the weight gradients) and within rounding where a GEMM runs on a block of the rows.
#include <catch2/catch.hpp>

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/collective_matmul.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

// A DTensor of type DT holding value(seed, .) (integer-valued) or, with `real`, sin-valued numbers; no
// Partial axes.
template <class DT, class Mesh>
DT fill(const Mesh& mesh, const typename DT::shape_type& shape, int seed, bool real) {
  DT d = make<DT>(mesh, shape, seed);
  if (real) {
    const auto off = d.local_offset();
    const auto& l = d.local();
    for (std::int64_t e = 0; e < l.numel(); ++e) {
      std::int64_t rest = e, flat = 0, stride = 1;
      for (int k = DT::rank - 1; k >= 0; --k) {
        flat += (off[k] + rest % l.shape()[k]) * stride;
        rest /= l.shape()[k];
        stride *= shape[k];
      }
      l.data()[e] = typename DT::value_type(2 * std::sin(0.37 * double(flat) + seed));
    }
  }
  return d;
}

// a == b bit for bit (exact), else within rounding: a GEMM of a block of rows may round otherwise than the
// GEMM of all rows (OpenBLAS picks its kernel by size), so only integer values compare exactly.
template <class A, class B>
void same(const A& a, const B& b, bool exact, const std::string& what) {
  static_assert(std::is_same_v<A, B>, "the fused and unfused results have one type");
  using T = typename A::value_type;
  expect(a.global_shape() == b.global_shape() && a.local().shape() == b.local().shape(), what + ": shape");
  const auto x = a.local().contiguous();
  const auto y = b.local().contiguous();
  if (exact) {
    expect(std::memcmp(x.data(), y.data(), sizeof(T) * x.numel()) == 0,
           what + ": not bit-identical to the unfused path");
    return;
  }
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-13;
  for (std::int64_t e = 0; e < x.numel(); ++e) {
    const double u = x.data()[e], v = y.data()[e];
    expect(std::abs(u - v) <= tol * (1 + std::abs(v)), what + ": element " + std::to_string(e) + " is " +
                                                           std::to_string(u) + ", unfused " +
                                                           std::to_string(v));
  }
}

// full(y) == x w^T of the full tensors (exact for integer values).
template <class Y, class X, class W>
void check_product(const Y& y, const X& x, const W& w, const std::string& what) {
  const auto want = local::matmul(x.full_tensor(), w.full_tensor(), false, true);
  check_full(
      y, [&](std::int64_t e) { return double(want.data()[e]); }, 1e-5,
      what + " vs the single-process product");
}

// X (b, s, h) sharded on s over the last mesh axis (tp), W (n, h) [.., S(0)], M (b, s, f) [.., S(2)], V
// (h, f) [.., S(1)]: both fused ops and their backward against the unfused calls.
template <class X, class W, class M, class V, class Mesh, class... Sizes>
void cases(int ranks, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    for (const std::int64_t s : {7, 8, 2}) {
      for (const bool real : {false, true}) {
        const std::string what = "seq " + std::to_string(s) + (real ? " real" : " integer");
        const std::int64_t b = 2, h = 24, n1 = 10, n3 = 14, f = 20;
        const auto x = fill<X>(mesh, {b, s, h}, 1, real);
        const auto w1 = fill<W>(mesh, {n1, h}, 2, real);
        const auto w3 = fill<W>(mesh, {n3, h}, 3, real);

        // all_gather_linear, fused first (its outputs cannot reuse the unfused results' memory)
        auto [xg, y1, y3] = all_gather_linear(x, std::tie(w1, w3));
        auto [ys, back] = all_gather_linear(x, std::tie(w1, w3), with_backward);
        using Xg = std::remove_cvref_t<decltype(xg)>;
        const auto xgu = detail::redistribute_as<Xg, X>::run(x);
        auto [y1u, back1] = linear(xgu, w1, with_backward);
        auto [y3u, back3] = linear(xgu, w3, with_backward);
        same(xg, xgu, true, what + ": gathered x");
        same(y1, y1u, !real, what + ": linear(xg, w1)");
        same(y3, y3u, !real, what + ": linear(xg, w3)");
        same(std::get<1>(ys), y3u, !real, what + ": with_backward's linear(xg, w3)");
        if (!real) {
          check_product(y1, x, w1, what + ": linear(xg, w1)");
        }
        const auto dy1 = fill<std::remove_cvref_t<decltype(y1)>>(mesh, y1.global_shape(), 5, real);
        const auto dy3 = fill<std::remove_cvref_t<decltype(y3)>>(mesh, y3.global_shape(), 6, real);
        auto [dx, dws] = back(dy1, dy3);
        auto [dxg1, dw1u] = back1(dy1);
        auto [dxg3, dw3u] = back3(dy3);
        const auto dxu =
            detail::redistribute_as<std::remove_cvref_t<decltype(dx)>,
                                    std::remove_cvref_t<decltype(add(dxg1, dxg3))>>::run(add(dxg1, dxg3));
        same(dx, dxu, !real, what + ": dx of all_gather_linear");
        same(std::get<0>(dws), dw1u, true, what + ": dw1");
        same(std::get<1>(dws), dw3u, true, what + ": dw3");

        // linear_reduce_scatter
        const auto m = fill<M>(mesh, {b, s, f}, 7, real);
        const auto v = fill<V>(mesh, {h, f}, 8, real);
        auto [out, vback] = linear_reduce_scatter<X>(m, v, with_backward);
        auto [c, cback] = linear(m, v, with_backward);
        same(out, detail::redistribute_as<X, decltype(c)>::run(c), !real, what + ": linear_reduce_scatter");
        if (!real) {
          check_product(out, m, v, what + ": linear_reduce_scatter");
        }
        const auto dout = fill<X>(mesh, out.global_shape(), 9, real);
        auto [dm, dv] = vback(dout);
        using Cg = detail::with_axis_t<decltype(c), Mesh::rank - 1, Placement::replicate()>;
        auto [dmu, dvu] = cback(detail::redistribute_as<Cg, X>::run(dout));
        same(dm, dmu, !real, what + ": dm of linear_reduce_scatter");
        same(dv, dvu, true, what + ": dw of linear_reduce_scatter");
      }
    }
  });
}

template <class T>
void all_meshes() {
  using Mesh2cp = MeshShape<Axis<"cp">, Axis<"tp">>;
  for (int r = 1; r <= 4; ++r) {
    INFO("ranks " << r);
    cases<DTensor<T, 3, Mesh1, S<1>>, DTensor<T, 2, Mesh1, S<0>>, DTensor<T, 3, Mesh1, S<2>>,
          DTensor<T, 2, Mesh1, S<1>>, Mesh1>(r);
  }
  cases<DTensor<T, 3, Mesh2, S<0>, S<1>>, DTensor<T, 2, Mesh2, R, S<0>>, DTensor<T, 3, Mesh2, S<0>, S<2>>,
        DTensor<T, 2, Mesh2, R, S<1>>, Mesh2>(4, 2, 2);
  cases<DTensor<T, 3, Mesh2cp, S<1>, S<1>>, DTensor<T, 2, Mesh2cp, R, S<0>>,
        DTensor<T, 3, Mesh2cp, S<1>, S<2>>, DTensor<T, 2, Mesh2cp, R, S<1>>, Mesh2cp>(4, 2, 2);
}

} // namespace

TEST_CASE("collective matmul = the unfused calls, 1-4 ranks, (dp, tp) and (cp, tp), doubles", "[ops]") {
  all_meshes<double>();
}

TEST_CASE("collective matmul = the unfused calls, floats", "[ops]") {
  all_meshes<float>();
}

TEST_CASE("collective matmul: shapes that do not multiply fail on every rank before any exchange", "[ops]") {
  testing::run_ranks(3, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    const auto x = make<DTensor<double, 3, Mesh1, S<1>>>(mesh, {2, 5, 4}, 1);
    const auto w = make<DTensor<double, 2, Mesh1, S<0>>>(mesh, {6, 3}, 2);
    bool threw = false;
    try {
      all_gather_linear(x, std::tie(w));
    } catch (const Error& e) {
      threw = std::string(e.what()).find("do not multiply") != std::string::npos;
    }
    expect(threw, "all_gather_linear with in-features 3 against 4 must throw 'do not multiply'");
    const auto m = make<DTensor<double, 3, Mesh1, S<2>>>(mesh, {2, 5, 6}, 3);
    const auto v = make<DTensor<double, 2, Mesh1, S<1>>>(mesh, {4, 5}, 4);
    threw = false;
    try {
      linear_reduce_scatter<DTensor<double, 3, Mesh1, S<1>>>(m, v);
    } catch (const Error& e) {
      threw = std::string(e.what()).find("do not multiply") != std::string::npos;
    }
    expect(threw, "linear_reduce_scatter with in-features 5 against 6 must throw 'do not multiply'");
  });
}

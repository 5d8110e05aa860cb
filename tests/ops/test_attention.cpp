// scaled_dot_product_attention: the local blockwise kernel (local/attention.hpp) and the sharded op
// (ops/attention.hpp) against a plain single-process attention written here (the whole score matrix, in
// double): outputs and dq/dk/dv, causal and not, GQA (8 q heads over 2 k/v heads) and MHA, head_dim 5
// (not a multiple of any vector width), v_dim != head_dim, sequences that span several blocks with
// tails, rows that see no key, dropout (the same mask from the global indices), float and double, bfloat16
// inputs with float accumulation. The reference's own backward is checked against finite differences.
// The sharded op on 1-4 ranks with uneven and empty shards (batch 3, 6 heads, seq 13 over 4), on (2,2):
// every placement the rule accepts, no communication (CommDebugMode), and the GQA error when k/v heads
// cannot follow q's.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/core/flop_counter.hpp>
#include <dtensor/core/memory_tracker.hpp>
#include <dtensor/local/attention.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/attention.hpp>
#include <dtensor/ops/rotary.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

using Vec = std::vector<double>;

struct Sizes {
  std::int64_t b, h, hk, sq, sk, d, dv;
};

struct Ref {
  Vec o, lse, dq, dk, dv;
};

// Attention of row-major (b, h, sq, d), (b, hk, sk, d), (b, hk, sk, dv) in double, the whole score matrix
// at once, and its backward for the gradient g of o. keep(b, h, i, j) is the dropout mask (kept / (1 - p)
// is applied by the caller's scale `drop_scale`).
template <class Keep>
Ref reference(const Sizes& s, const Vec& q, const Vec& k, const Vec& v, const Vec& g, bool causal,
              double scale, Keep keep, double drop_scale, const std::vector<std::int64_t>& qpos = {},
              const std::vector<std::int64_t>& kpos = {}) {
  Ref r{Vec(s.b * s.h * s.sq * s.dv), Vec(s.b * s.h * s.sq), Vec(q.size()), Vec(k.size()), Vec(v.size())};
  const std::int64_t group = s.hk > 0 ? s.h / s.hk : 1;
  for (std::int64_t b = 0; b < s.b; ++b) {
    for (std::int64_t h = 0; h < s.h; ++h) {
      const std::int64_t hk = h / group;
      auto Q = [&](std::int64_t i, std::int64_t c) { return q[((b * s.h + h) * s.sq + i) * s.d + c]; };
      auto K = [&](std::int64_t j, std::int64_t c) { return k[((b * s.hk + hk) * s.sk + j) * s.d + c]; };
      auto V = [&](std::int64_t j, std::int64_t c) { return v[((b * s.hk + hk) * s.sk + j) * s.dv + c]; };
      for (std::int64_t i = 0; i < s.sq; ++i) {
        const std::int64_t pi = qpos.empty() ? i : qpos[i];
        Vec p(s.sk, 0.0);
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < s.sk; ++j) {
          const std::int64_t pj = kpos.empty() ? j : kpos[j];
          if (causal && pj > pi) {
            p[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double dot = 0;
          for (std::int64_t c = 0; c < s.d; ++c) {
            dot += Q(i, c) * K(j, c);
          }
          p[j] = dot * scale;
          m = std::max(m, p[j]);
        }
        double l = 0;
        for (auto& x : p) {
          x = m == -std::numeric_limits<double>::infinity() ? 0 : std::exp(x - m);
          l += x;
        }
        const std::int64_t row = (b * s.h + h) * s.sq + i;
        r.lse[row] = l > 0 ? m + std::log(l) : -std::numeric_limits<double>::infinity();
        Vec mask(s.sk), pd(s.sk); // the dropout factors, and the dropped probabilities
        for (std::int64_t j = 0; j < s.sk; ++j) {
          p[j] = l > 0 ? p[j] / l : 0;
          mask[j] = keep(b, h, pi, kpos.empty() ? j : kpos[j]) ? drop_scale : 0;
          pd[j] = p[j] * mask[j];
        }
        for (std::int64_t c = 0; c < s.dv; ++c) {
          double o = 0;
          for (std::int64_t j = 0; j < s.sk; ++j) {
            o += pd[j] * V(j, c);
          }
          r.o[row * s.dv + c] = o;
        }
        // backward of this row: dp_j = (g . v_j) mask_j; ds = p (dp - sum p dp)
        Vec dp(s.sk);
        double dot = 0;
        for (std::int64_t j = 0; j < s.sk; ++j) {
          double x = 0;
          for (std::int64_t c = 0; c < s.dv; ++c) {
            x += g[row * s.dv + c] * V(j, c);
            r.dv[((b * s.hk + hk) * s.sk + j) * s.dv + c] += pd[j] * g[row * s.dv + c];
          }
          dp[j] = x * mask[j];
          dot += p[j] * dp[j];
        }
        for (std::int64_t j = 0; j < s.sk; ++j) {
          const double ds = p[j] * (dp[j] - dot) * scale;
          for (std::int64_t c = 0; c < s.d; ++c) {
            r.dq[row * s.d + c] += ds * K(j, c);
            r.dk[((b * s.hk + hk) * s.sk + j) * s.d + c] += ds * Q(i, c);
          }
        }
      }
    }
  }
  return r;
}

Ref reference(const Sizes& s, const Vec& q, const Vec& k, const Vec& v, const Vec& g, bool causal,
              double scale, const std::vector<std::int64_t>& qpos = {},
              const std::vector<std::int64_t>& kpos = {}) {
  return reference(
      s, q, k, v, g, causal, scale, [](auto...) { return true; }, 1.0, qpos, kpos);
}

// An integer in [-3, 3] from a hash of (seed, flat index). Not the shared value(): that repeats every 35
// elements, so with head_dim 5 the rows of a sequence repeat every 7 positions, and a ring step that used
// another chunk's positions or data could compute the same numbers.
double input_value(int seed, std::int64_t flat) {
  std::uint64_t x = static_cast<std::uint64_t>(flat) * 0x9E3779B97F4A7C15ULL +
                    static_cast<std::uint64_t>(seed) * 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 29;
  return static_cast<double>(x % 7) - 3;
}

// The shared value(seed, .) of make<> (support/ops_tensors.hpp), for tests with Partial inputs.
Vec shared_values(int seed, std::int64_t n) {
  Vec v(static_cast<std::size_t>(n));
  for (std::int64_t e = 0; e < n; ++e) {
    v[e] = value(seed, e);
  }
  return v;
}

Vec values(int seed, std::int64_t n, double scale) {
  Vec v(static_cast<std::size_t>(n));
  for (std::int64_t e = 0; e < n; ++e) {
    v[e] = scale * input_value(seed, e);
  }
  return v;
}

// This rank's block of the DTensor X (no Partial axes) whose global element at flat index e is
// scale * input_value(seed, e).
template <class X, class Mesh>
X filled(const Mesh& mesh, const typename X::shape_type& shape, int seed, double scale) {
  const Extents global = detail::to_extents(shape);
  const Block b = spec_block(global, X::spec, mesh.sizes(), mesh.coordinate());
  typename X::shape_type local_shape{};
  for (int d = 0; d < X::rank; ++d) {
    local_shape[d] = b.shape[d];
  }
  typename X::local_type t(local_shape);
  for (std::int64_t e = 0; e < t.numel(); ++e) {
    std::int64_t rest = e;
    std::int64_t flat = 0;
    std::int64_t stride = 1;
    for (int d = X::rank - 1; d >= 0; --d) {
      flat += (b.offset[d] + rest % b.shape[d]) * stride;
      rest /= b.shape[d];
      stride *= global[d];
    }
    t.data()[e] = scale * input_value(seed, flat);
  }
  return X(mesh, t, shape);
}

template <class T>
Tensor<T, 4> tensor_of(const Vec& v, std::array<std::int64_t, 4> shape) {
  Tensor<T, 4> t(shape);
  for (std::int64_t e = 0; e < t.numel(); ++e) {
    t.data()[e] = T(static_cast<float>(v[e]));
  }
  return t;
}
// v rounded to T (the reference then computes from exactly the kernel's inputs)
template <class T>
Vec rounded(Vec v) {
  for (auto& x : v) {
    x = static_cast<double>(static_cast<float>(T(static_cast<float>(x))));
  }
  return v;
}

template <class T, int R>
void check_close(const Tensor<T, R>& got, const Vec& want, double tol, const std::string& what) {
  const auto c = got.contiguous();
  REQUIRE(c.numel() == static_cast<std::int64_t>(want.size()));
  for (std::int64_t e = 0; e < c.numel(); ++e) {
    const double g = std::is_same_v<T, double> ? static_cast<double>(c.data()[e])
                                               : static_cast<double>(static_cast<float>(c.data()[e]));
    if (!(std::abs(g - want[e]) <= tol * (1 + std::abs(want[e])) || (std::isinf(want[e]) && g == want[e]))) {
      FAIL(what << ": element " << e << " is " << std::setprecision(17) << g << ", want " << want[e]);
    }
  }
}

template <class T>
void check_local(const Sizes& s, bool causal, double tol, local::AttentionParams params = {},
                 const std::vector<std::int64_t>& qpos = {}, const std::vector<std::int64_t>& kpos = {}) {
  params.causal = causal;
  const Vec q = rounded<T>(values(1, s.b * s.h * s.sq * s.d, 0.25));
  const Vec k = rounded<T>(values(2, s.b * s.hk * s.sk * s.d, 0.25));
  const Vec v = rounded<T>(values(3, s.b * s.hk * s.sk * s.dv, 0.5));
  const Vec g = rounded<T>(values(4, s.b * s.h * s.sq * s.dv, 0.5));
  const double scale = params.scale != 0 ? params.scale : 1 / std::sqrt(double(s.d));
  local::AttentionCoords coords;
  coords.q_pos = qpos.empty() ? nullptr : qpos.data();
  coords.k_pos = kpos.empty() ? nullptr : kpos.data();
  Ref want;
  if (params.dropout > 0) {
#if DTENSOR_HAS_RANDOM123
    const double p = params.dropout;
    auto keep = [&](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
      const auto index = static_cast<std::uint64_t>(((b * s.h + h) * s.sq + i) * s.sk + j);
      return local::dropout_keeps(params.seed, params.offset, index, p);
    };
    want = reference(s, q, k, v, g, causal, scale, keep, 1 / (1 - p), qpos, kpos);
#endif
  } else {
    want = reference(s, q, k, v, g, causal, scale, qpos, kpos);
  }
  const auto qt = tensor_of<T>(q, {s.b, s.h, s.sq, s.d});
  const auto kt = tensor_of<T>(k, {s.b, s.hk, s.sk, s.d});
  const auto vt = tensor_of<T>(v, {s.b, s.hk, s.sk, s.dv});
  auto [o, lse] = local::attention_forward(qt, kt, vt, params, coords);
  check_close(o, want.o, tol, "o");
  check_close(lse, want.lse, tol, "lse");
  auto [dq, dk, dv] =
      local::attention_backward(qt, kt, vt, o, lse, tensor_of<T>(g, {s.b, s.h, s.sq, s.dv}), params, coords);
  check_close(dq, want.dq, tol, "dq");
  check_close(dk, want.dk, tol, "dk");
  check_close(dv, want.dv, tol, "dv");
}

} // namespace

TEST_CASE("the reference attention's backward equals finite differences of its forward", "[ops][attention]") {
  const Sizes s{1, 2, 1, 3, 4, 2, 3};
  const Vec q = values(1, s.b * s.h * s.sq * s.d, 0.25);
  const Vec k = values(2, s.b * s.hk * s.sk * s.d, 0.25);
  const Vec v = values(3, s.b * s.hk * s.sk * s.dv, 0.5);
  const Vec g = values(4, s.b * s.h * s.sq * s.dv, 0.5);
  for (bool causal : {false, true}) {
    const Ref r = reference(s, q, k, v, g, causal, 0.7);
    const auto loss = [&](const Vec& qq, const Vec& kk, const Vec& vv) {
      const Vec o = reference(s, qq, kk, vv, g, causal, 0.7).o;
      double l = 0;
      for (std::size_t i = 0; i < o.size(); ++i) {
        l += o[i] * g[i];
      }
      return l;
    };
    const auto fd = [&](int which, std::size_t e) {
      Vec a = q, b = k, c = v;
      Vec& x = which == 0 ? a : which == 1 ? b : c;
      const double h = 1e-6;
      x[e] += h;
      const double up = loss(a, b, c);
      x[e] -= 2 * h;
      return (up - loss(a, b, c)) / (2 * h);
    };
    for (std::size_t e = 0; e < q.size(); ++e) {
      CHECK(fd(0, e) == Approx(r.dq[e]).margin(1e-7));
    }
    for (std::size_t e = 0; e < k.size(); ++e) {
      CHECK(fd(1, e) == Approx(r.dk[e]).margin(1e-7));
    }
    for (std::size_t e = 0; e < v.size(); ++e) {
      CHECK(fd(2, e) == Approx(r.dv[e]).margin(1e-7));
    }
  }
}

TEST_CASE("local attention forward and backward equal the reference", "[ops][attention]") {
  // several query and key blocks (128 x 256) with tails; GQA; head_dim 5; v_dim 3
  const Sizes gqa{2, 8, 2, 150, 270, 5, 3};
  const Sizes mha{1, 3, 3, 70, 70, 8, 8};
  for (bool causal : {false, true}) {
    SECTION(causal ? "causal" : "not causal") {
      check_local<double>(gqa, causal, 1e-12);
      check_local<float>(gqa, causal, 2e-5);
      check_local<double>(mha, causal, 1e-12);
      check_local<float>(mha, causal, 2e-5);
      // bfloat16 inputs (the reference computes from the same rounded values), float accumulation; the
      // outputs are rounded to bfloat16 (8 bits): 2^-8 relative
      check_local<bfloat16>(mha, causal, 1.0 / 128);
      check_local<half>(mha, causal, 1.0 / 512);
    }
  }
  SECTION("an explicit scale, seq_q != seq_k (top-left causal alignment, as torch's is_causal)") {
    local::AttentionParams p;
    p.scale = 0.3;
    check_local<double>({1, 2, 1, 40, 150, 4, 4}, true, 1e-12, p);
    check_local<double>({1, 2, 1, 150, 40, 4, 4}, true, 1e-12, p);
  }
  SECTION("global positions: permuted rows, and rows that see no key (o = 0, lse = -inf, no gradient)") {
    std::vector<std::int64_t> qpos(90), kpos(130);
    for (std::size_t i = 0; i < qpos.size(); ++i) {
      qpos[i] = static_cast<std::int64_t>((i * 37) % qpos.size()) + 20; // rows 0..19 see no key below
    }
    for (std::size_t j = 0; j < kpos.size(); ++j) {
      kpos[j] = static_cast<std::int64_t>(kpos.size() - 1 - j) + 40; // keys from 40, reversed
    }
    check_local<double>({1, 2, 2, 90, 130, 5, 5}, true, 1e-12, {}, qpos, kpos);
  }
  SECTION("empty: no query rows, no keys, no heads") {
    check_local<double>({2, 2, 1, 0, 10, 4, 4}, true, 0);
    check_local<double>({2, 2, 1, 10, 0, 4, 4}, false, 0);
    check_local<double>({2, 0, 0, 10, 10, 4, 4}, false, 0);
  }
#if DTENSOR_HAS_RANDOM123
  SECTION("dropout: the mask of each (batch, head, query, key) from the global index") {
    local::AttentionParams p;
    p.dropout = 0.3;
    p.seed = 11;
    p.offset = 2;
    check_local<double>({2, 4, 2, 70, 140, 5, 4}, false, 1e-12, p);
    check_local<double>({2, 4, 2, 70, 140, 5, 4}, true, 1e-12, p);
  }
#endif
}

TEST_CASE("FlopCounter: attention counts its GEMMs over the pairs each query sees, on host and meta",
          "[ops][attention][flops]") {
  // (batch 2, 4 q heads, 2 kv heads, 5 queries, 7 keys, d 3, dv 2)
  for (const Device device : {Device::cpu(), Device::meta()}) {
    const Tensor<double, 4> q = Tensor<double, 4>::zeros({2, 4, 5, 3}, device);
    const Tensor<double, 4> k = Tensor<double, 4>::zeros({2, 2, 7, 3}, device);
    const Tensor<double, 4> v = Tensor<double, 4>::zeros({2, 2, 7, 2}, device);
    for (bool causal : {false, true}) {
      INFO(device.to_string() << (causal ? ", causal" : ""));
      local::AttentionParams p;
      p.causal = causal;
      // Causal, top-left aligned: query i sees keys 0..i, 1 + 2 + 3 + 4 + 5 = 15 of the 35 pairs.
      const double pairs = causal ? 15 : 35;
      FlopCounter flops;
      const auto [o, lse] = local::attention_forward(q, k, v, p);
      CHECK(flops.flops() == 2 * 2 * 4 * pairs * (3 + 2));
      flops.reset();
      (void)local::attention_backward(q, k, v, o, lse, o, p);
      CHECK(flops.flops() == 2 * 2 * 4 * pairs * (3 * 3 + 2 * 2));
    }
  }
}

TEST_CASE("the softmax's exponential pass: the run-time chosen loop equals the portable one bit for bit",
          "[ops][attention]") {
  // exp_shifted picks an AVX2 clone where the CPU has it (no FMA: the same IEEE operations, 8 lanes);
  // every 4093rd float bit pattern (NaNs, infinities, subnormals included) and -inf, a masked score.
  std::vector<float> a;
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFu; u += 4093) {
    a.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  }
  a.push_back(-std::numeric_limits<float>::infinity());
  std::vector<float> b = a;
  local::attention_detail::exp_shifted(a.data(), static_cast<std::int64_t>(a.size()), 1.5f);
  local::attention_detail::exp_shifted_blocks(b.data(), static_cast<std::int64_t>(b.size()), 1.5f);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    differ += std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]);
  }
  CHECK(differ == 0);
  CHECK(a.back() == 0.0f);                          // exp(-inf - shift) is exactly 0
  CHECK(std::abs(a[1] - std::exp(-1.5f)) <= 2e-7f); // a subnormal x: exp(x - 1.5) within 1 ulp
}

TEST_CASE("local attention: shapes that do not fit are errors naming them", "[ops][attention]") {
  const auto t = [](std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) {
    return Tensor<float, 4>::zeros({b, h, s, d});
  };
  CHECK_THROWS_WITH(local::attention_forward(t(1, 6, 4, 8), t(1, 4, 4, 8), t(1, 4, 4, 8)),
                    Catch::Contains("k/v's heads (4) must divide q's heads (6)"));
  CHECK_THROWS_WITH(local::attention_forward(t(1, 2, 4, 8), t(1, 2, 4, 7), t(1, 2, 4, 8)),
                    Catch::Contains("same head_dim"));
  CHECK_THROWS_WITH(local::attention_forward(t(1, 2, 4, 8), t(1, 2, 5, 8), t(1, 2, 4, 8)),
                    Catch::Contains("same heads and sequence length"));
  CHECK_THROWS_WITH(local::attention_forward(t(2, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)),
                    Catch::Contains("same batch size"));
}

namespace {

// The reference of the inputs the sharded tests make: value(seed, flat) scaled (q, k: 0.25; v, dO: 0.5;
// seeds 1-4), v_dim = head_dim.
Ref sharded_reference(const Sizes& s, bool causal) {
  const Vec q = values(1, s.b * s.h * s.sq * s.d, 0.25);
  const Vec k = values(2, s.b * s.hk * s.sk * s.d, 0.25);
  const Vec v = values(3, s.b * s.hk * s.sk * s.d, 0.5);
  const Vec g = values(4, s.b * s.h * s.sq * s.d, 0.5);
  return reference(s, q, k, v, g, causal, 1 / std::sqrt(double(s.d)));
}

// The sharded op on a mesh: q, k, v of placements Pq, Pk (k and v alike), the output and gradients against
// the reference of the whole tensors.
template <class Mesh, class Pq, class Pk, class... MeshSizes>
void check_sharded(int ranks, const Sizes& s, bool causal, MeshSizes... sizes) {
  using Q = typename dt<Mesh, 4, Pq>::type;
  using K = typename dt<Mesh, 4, Pk>::type;
  const Ref want = sharded_reference(s, causal);
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const auto scaled = [&]<class X>(int seed, std::array<std::int64_t, 4> shape, double f) {
      return filled<X>(mesh, shape, seed, f);
    };
    const Q qd = scaled.template operator()<Q>(1, {s.b, s.h, s.sq, s.d}, 0.25);
    const K kd = scaled.template operator()<K>(2, {s.b, s.hk, s.sk, s.d}, 0.25);
    const K vd = scaled.template operator()<K>(3, {s.b, s.hk, s.sk, s.d}, 0.5);
    const Q gd = scaled.template operator()<Q>(4, {s.b, s.h, s.sq, s.d}, 0.5);
    CommDebugMode debug;
    auto [o, back] = scaled_dot_product_attention(qd, kd, vd, {.causal = causal}, with_backward);
    auto [dq, dk, dv] = back(gd);
    expect(debug.total_count() == 0, "attention with the gradient in the output's placements communicates");
    const auto vec = [](const Vec& x) { return [&x](std::int64_t e) { return x[e]; }; };
    check_full(o, vec(want.o), 1e-12, "o");
    check_full(dq, vec(want.dq), 1e-12, "dq");
    check_full(dk, vec(want.dk), 1e-12, "dk");
    check_full(dv, vec(want.dv), 1e-12, "dv");
  });
}

} // namespace

TEST_CASE("sharded attention equals one rank's: batch, heads or queries' sequence sharded, 1-4 ranks",
          "[ops][attention]") {
  using Q = TypeList<Placements<R>, Placements<S<0>>, Placements<S<1>>, Placements<S<2>>>;
  // uneven and empty shards: batch 3, 6 heads, 13 queries over up to 4 ranks; MHA
  const Sizes mha{3, 6, 6, 13, 13, 5, 5};
  // GQA, 8 q heads over 2 k/v heads: k/v follow q's heads only where both counts divide the axis
  const Sizes gqa{2, 8, 2, 13, 11, 5, 5};
  for (int n = 1; n <= 4; ++n) {
    for (bool causal : {false, true}) {
      for_each(Q{}, [&]<class PQ>() {
        check_sharded<Mesh1, PQ, Placements<R>>(n, mha, causal, n); // k/v Replicate: each rank's part
        check_sharded<Mesh1, PQ, Placements<R>>(n, gqa, causal, n);
      });
      check_sharded<Mesh1, Placements<S<0>>, Placements<S<0>>>(n, mha, causal, n);
      check_sharded<Mesh1, Placements<S<1>>, Placements<S<1>>>(n, mha, causal, n);
      if (8 % n == 0 && 2 % n == 0) {
        check_sharded<Mesh1, Placements<S<1>>, Placements<S<1>>>(n, gqa, causal, n);
      }
    }
  }
}

TEST_CASE("sharded attention on a (2,2) mesh: batch over dp, heads or queries over tp", "[ops][attention]") {
  const Sizes gqa{3, 8, 2, 13, 13, 5, 5};
  for (bool causal : {false, true}) {
    check_sharded<Mesh2, Placements<S<0>, S<1>>, Placements<S<0>, S<1>>>(4, gqa, causal, 2, 2);
    check_sharded<Mesh2, Placements<S<0>, S<1>>, Placements<S<0>, R>>(4, gqa, causal, 2, 2);
    check_sharded<Mesh2, Placements<S<0>, S<2>>, Placements<S<0>, R>>(4, gqa, causal, 2, 2);
    check_sharded<Mesh2, Placements<S<1>, S<1>>, Placements<S<1>, S<1>>>(4, {3, 8, 8, 13, 13, 5, 5}, causal,
                                                                         2, 2);
  }
}

TEST_CASE("sharded attention: GQA k/v heads that cannot follow q's heads are an error naming them",
          "[ops][attention]") {
  // 8 q heads, 2 k/v heads over 4 ranks: rank 1's q heads [2, 4) need k/v head 0, which rank 0 holds (every
  // rank throws the same error: the check covers every rank's blocks)
  const auto uneven_groups = [] {
    check_sharded<Mesh1, Placements<S<1>>, Placements<S<1>>>(4, {1, 8, 2, 5, 5, 4, 4}, false, 4);
  };
  CHECK_THROWS_WITH(uneven_groups(), Catch::Contains("whole groups") && Catch::Contains("'s q heads ["));
}

namespace {

// A context-parallel form over Mesh1's axis "x": q, k, v sequence-sharded (Zz: in the zigzag layout), against
// the reference; `comm` checks the CommDebugMode of the forward (false) and of the backward (true).
template <class Form, bool Zz = false, class Comm>
void check_cp(int ranks, const Sizes& s, bool causal, Comm comm) {
  using X = DTensor<double, 4, Mesh1, S<2>>;
  const Ref want = sharded_reference(s, causal);
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world, ranks);
    const auto scaled = [&](int seed, std::array<std::int64_t, 4> shape, double f) {
      return filled<X>(mesh, shape, seed, f);
    };
    const X qd = scaled(1, {s.b, s.h, s.sq, s.d}, 0.25);
    const X kd = scaled(2, {s.b, s.hk, s.sk, s.d}, 0.25);
    const X vd = scaled(3, {s.b, s.hk, s.sk, s.d}, 0.5);
    const X gd = scaled(4, {s.b, s.h, s.sq, s.d}, 0.5);
    const auto [o, dq, dk, dv] = [&] {
      if constexpr (Zz) { // in the zigzag layout, and back to natural order to compare
        const auto zq = zigzag<"x", 2>(qd);
        const auto zk = zigzag<"x", 2>(kd);
        const auto zv = zigzag<"x", 2>(vd);
        const auto zg = zigzag<"x", 2>(gd);
        CommDebugMode forward;
        auto [zo, back] = attention<Form>(zq, zk, zv, {.causal = causal}, with_backward);
        comm(forward, ranks, false);
        CommDebugMode backward;
        auto [zdq, zdk, zdv] = back(zg);
        comm(backward, ranks, true);
        static_assert(std::is_same_v<decltype(zdq), Zigzag<"x", X>> &&
                      std::is_same_v<decltype(zo), Zigzag<"x", X>>);
        return std::tuple{unzigzag(zo), unzigzag(zdq), unzigzag(zdk), unzigzag(zdv)};
      } else {
        CommDebugMode forward;
        auto [o, back] = attention<Form>(qd, kd, vd, {.causal = causal}, with_backward);
        comm(forward, ranks, false);
        CommDebugMode backward;
        auto [dq, dk, dv] = back(gd);
        comm(backward, ranks, true);
        static_assert(std::is_same_v<decltype(dq), X> && std::is_same_v<decltype(dk), X>);
        return std::tuple{o, dq, dk, dv};
      }
    }();
    const auto vec = [](const Vec& x) { return [&x](std::int64_t e) { return x[e]; }; };
    check_full(o, vec(want.o), 1e-12, "o");
    check_full(dq, vec(want.dq), 1e-12, "dq");
    check_full(dk, vec(want.dk), 1e-12, "dk");
    check_full(dv, vec(want.dv), 1e-12, "dv");
  });
}

// Ulysses: q, k, v to heads and o back (4 all_to_all; none over a 1-rank axis); the duals backward.
void check_ulysses(int ranks, const Sizes& s, bool causal) {
  check_cp<Ulysses<"x">>(ranks, s, causal, [](const CommDebugMode& m, int n, bool is_backward) {
    const std::int64_t want = n > 1 ? 4 : 0;
    expect(m.total_count() == want && m.count("all_to_all") == want,
           std::string(is_backward ? "Ulysses backward: " : "Ulysses forward: ") +
               std::to_string(m.total_count()) + " collectives, want " + std::to_string(want) +
               " all_to_all");
  });
}

// Ring: n - 1 rounds forward, each one batch_isend_irecv (k and v to the next rank, from the previous one);
// backward k, v around again (n - 1 rounds) and dk, dv after them (n rounds: home again). Zz: in the zigzag
// layout (the same rounds).
template <bool Zz = false>
void check_ring(int ranks, const Sizes& s, bool causal) {
  check_cp<Ring<"x">, Zz>(ranks, s, causal, [](const CommDebugMode& m, int n, bool is_backward) {
    const std::int64_t rounds = !is_backward ? n - 1 : (n == 1 ? 0 : (n - 1) + n);
    expect(m.count("batch_isend_irecv") == rounds && m.total_count() == rounds,
           std::string(is_backward ? "ring backward: " : "ring forward: ") + std::to_string(m.total_count()) +
               " operations, want " + std::to_string(rounds) + " batch_isend_irecv");
  });
}

} // namespace

TEST_CASE("ring attention equals one rank's attention, 1-4 ranks, uneven and empty chunks, GQA",
          "[ops][attention]") {
  for (int n = 1; n <= 4; ++n) {
    for (bool causal : {false, true}) {
      check_ring(n, {2, 4, 4, 13, 13, 5, 5}, causal);   // 13 over 4: chunks 4, 4, 4, 1
      check_ring(n, {1, 8, 2, 3, 3, 4, 4}, causal);     // 3 over 4: an empty chunk; GQA
      check_ring(n, {1, 2, 1, 150, 150, 4, 4}, causal); // chunks that span several kernel blocks
    }
  }
}

namespace {

/// What one rank of `world` communicates (CommDebugMode's table) and the peak of the tensors it holds
/// (MemoryTracker) in the forward and backward of ring attention (natural and zigzag layout) and Ulysses,
/// of tensors on `device`.
std::string cp_trace(const ProcessGroup& world, Device device) {
  using X = DTensor<double, 4, Mesh1, S<2>>;
  auto mesh = init_device_mesh<Mesh1>(world, world.size());
  const X q = zeros<double, S<2>>(mesh, {2, 4, 13, 5}, device); // 13 over 4: uneven; GQA: 4 q heads, 2 kv
  const X k = zeros<double, S<2>>(mesh, {2, 2, 13, 5}, device);
  const X v = zeros<double, S<2>>(mesh, {2, 2, 13, 5}, device);
  std::string trace;
  const auto record = [&](const char* what, auto run) {
    CommDebugMode comm;
    MemoryTracker memory;
    run();
    trace += std::string(what) + "\n" + comm.to_string() + "peak " +
             std::to_string(memory.stats().peak_total) + "\n";
  };
  record("ring", [&] {
    auto [o, back] = attention<Ring<"x">>(q, k, v, {.causal = true}, with_backward);
    (void)back(o);
  });
  record("zigzag ring", [&] {
    const auto zq = zigzag<"x", 2>(q);
    auto [o, back] =
        attention<Ring<"x">>(zq, zigzag<"x", 2>(k), zigzag<"x", 2>(v), {.causal = true}, with_backward);
    (void)unzigzag(std::get<0>(back(o)));
  });
  record("ulysses", [&] { // whole groups on every rank: 4 k/v heads
    const X k4 = zeros<double, S<2>>(mesh, {2, 4, 13, 5}, device);
    auto [o, back] = attention<Ulysses<"x">>(q, k4, k4, {.causal = true}, with_backward);
    (void)back(o);
  });
  return trace;
}

} // namespace

TEST_CASE("context-parallel attention of meta tensors on a fake rank communicates and holds what a real rank "
          "does, 1-4 ranks",
          "[ops][attention][meta]") {
  for (int n = 1; n <= 4; ++n) {
    std::vector<std::string> real(static_cast<std::size_t>(n));
    std::mutex m;
    testing::run_ranks(n, [&](ProcessGroup& world) {
      std::string t = cp_trace(world, Device::cpu());
      std::lock_guard lock(m);
      real[static_cast<std::size_t>(world.rank())] = std::move(t);
    });
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r << " of " << n);
      CHECK(cp_trace(fake_world(r, n), Device::meta()) == real[static_cast<std::size_t>(r)]);
    }
  }
}

TEST_CASE("the zigzag layout: each rank a piece from the front and one from the back, every position once",
          "[ops][attention][zigzag]") {
  for (int n = 1; n <= 4; ++n) {
    for (std::int64_t len = 0; len <= 21; ++len) {
      std::vector<int> seen(static_cast<std::size_t>(len));
      for (int i = 0; i < n; ++i) {
        const std::vector<std::int64_t> p = zigzag_positions(len, n, i);
        const std::string at =
            "zigzag of " + std::to_string(len) + " over " + std::to_string(n) + ", rank " + std::to_string(i);
        expect(static_cast<std::int64_t>(p.size()) == chunk_size(len, n, i), at + ": torch.chunk's size");
        expect(std::is_sorted(p.begin(), p.end()), at + ": ascending");
        for (std::int64_t x : p) {
          expect(x >= 0 && x < len && ++seen[static_cast<std::size_t>(x)] == 1, at + ": a position twice");
        }
        if (len % (2 * n) == 0) { // chunks i and 2n - 1 - i of 2n
          const std::int64_t c = len / (2 * n);
          const ZigzagRuns z = zigzag_runs(len, n, i);
          expect(z.front == i * c && z.front_len == c && z.back == (2 * n - 1 - i) * c && z.back_len == c,
                 at + ": chunks i and 2n - 1 - i");
        }
      }
      expect(std::count(seen.begin(), seen.end(), 1) == len, "zigzag: every position once");
    }
  }
  static_assert(zigzag_runs(13, 4, 3).front == 6 && zigzag_runs(13, 4, 3).front_len == 1 &&
                zigzag_runs(13, 4, 0).back == 11 && zigzag_runs(13, 4, 0).back_len == 2);
}

TEST_CASE("zigzag and unzigzag: from Shard<seq> by one all_to_all, from Replicate locally, 1-4 ranks",
          "[ops][attention][zigzag]") {
  using X = DTensor<double, 4, Mesh1, S<2>>;
  using XR = DTensor<double, 4, Mesh1, R>;
  for (int n = 1; n <= 4; ++n) {
    for (const std::array<std::int64_t, 4> shape :
         {std::array<std::int64_t, 4>{2, 3, 13, 4}, {1, 2, 3, 2}, {1, 1, 16, 3}, {1, 2, 0, 2}}) {
      std::vector<std::int64_t> order; // natural position of each row of the zigzag layout's global order
      for (int r = 0; r < n; ++r) {
        const auto p = zigzag_positions(shape[2], n, r);
        order.insert(order.end(), p.begin(), p.end());
      }
      const auto want = [&](std::int64_t e) { // input 1 at the natural position of zigzag element e
        const std::int64_t d = e % shape[3];
        const std::int64_t j = (e / shape[3]) % shape[2];
        const std::int64_t bh = e / (shape[3] * shape[2]);
        return input_value(1, (bh * shape[2] + order[static_cast<std::size_t>(j)]) * shape[3] + d);
      };
      testing::run_ranks(n, [&](ProcessGroup& world) {
        auto mesh = init_device_mesh<Mesh1>(world, n);
        const X x = filled<X>(mesh, shape, 1, 1);
        CommDebugMode sharded;
        const Zigzag<"x", X> z = zigzag<"x", 2>(x);
        expect(sharded.count("all_to_all") == (n > 1 ? 1 : 0) && sharded.total_count() == (n > 1 ? 1 : 0),
               "zigzag of Shard<seq>: one all_to_all_single");
        check_full(z.tensor, want, 0, "zigzag of Shard<seq>");
        CommDebugMode replicated;
        const Zigzag<"x", X> zr = zigzag<"x", 2>(filled<XR>(mesh, shape, 1, 1));
        expect(replicated.total_count() == 0, "zigzag of Replicate communicates");
        check_full(zr.tensor, want, 0, "zigzag of Replicate");
        const X back = unzigzag(z);
        check_full(
            back, [](std::int64_t e) { return input_value(1, e); }, 0, "unzigzag");
      });
    }
  }
}

TEST_CASE("load-balanced ring attention (zigzag layout) equals one rank's attention, 1-4 ranks, uneven, GQA",
          "[ops][attention][zigzag]") {
  for (int n = 1; n <= 4; ++n) {
    for (bool causal : {false, true}) {
      check_ring<true>(n, {2, 4, 4, 13, 13, 5, 5}, causal);   // 13 over 4: pieces 2+2, 2+2, 2+2, 1+0
      check_ring<true>(n, {1, 8, 2, 3, 3, 4, 4}, causal);     // 3 over 4: empty pieces; GQA
      check_ring<true>(n, {1, 2, 1, 300, 300, 4, 4}, causal); // pieces that span several kernel blocks
    }
  }
}

TEST_CASE("Ulysses context parallelism equals one rank's attention, 1-4 ranks, uneven sequence and heads",
          "[ops][attention]") {
  for (int n = 1; n <= 4; ++n) {
    for (bool causal : {false, true}) {
      check_ulysses(n, {2, 6, 6, 13, 13, 5, 5}, causal); // 6 heads over 4: 2, 2, 2, 0
      if (8 % n == 0 && 2 % n == 0) {
        check_ulysses(n, {2, 8, 2, 13, 13, 5, 5}, causal); // GQA: whole groups per rank
      }
    }
  }
  // GQA whose k/v heads cannot follow q's: 2 k/v heads over 4 ranks
  CHECK_THROWS_WITH(check_ulysses(4, {1, 8, 2, 9, 9, 4, 4}, false), Catch::Contains("whole groups"));
}

namespace {

// RoPE of a row-major (b, h, seq, d) tensor at positions 0.. + offset, written out; sign -1: backward.
Vec rope_reference(const Vec& x, std::array<std::int64_t, 4> n, bool interleaved, double base, double sign,
                   std::int64_t offset = 0) {
  Vec y(x.size());
  const std::int64_t d = n[3];
  for (std::int64_t r = 0; r < n[0] * n[1] * n[2]; ++r) {
    const double p = static_cast<double>(r % n[2] + offset);
    for (std::int64_t i = 0; i < d / 2; ++i) {
      const double angle = p / std::pow(base, 2.0 * i / d);
      const std::int64_t a = interleaved ? 2 * i : i;
      const std::int64_t b = interleaved ? 2 * i + 1 : i + d / 2;
      const double xa = x[r * d + a];
      const double xb = x[r * d + b];
      y[r * d + a] = xa * std::cos(angle) - sign * xb * std::sin(angle);
      y[r * d + b] = xb * std::cos(angle) + sign * xa * std::sin(angle);
    }
  }
  return y;
}

template <class PL>
void check_rope(int ranks, bool interleaved) {
  using X = typename dt<Mesh1, 4, PL>::type;
  const std::array<std::int64_t, 4> n{2, 3, 13, 6};
  const RotaryOptions o{.base = 100, .interleaved = interleaved, .offset = 5};
  const Vec x = shared_values(1, n[0] * n[1] * n[2] * n[3]); // make<> fills these
  const Vec g = shared_values(4, n[0] * n[1] * n[2] * n[3]);
  const Vec want = rope_reference(x, n, interleaved, 100, 1, 5);
  const Vec want_dx = rope_reference(g, n, interleaved, 100, -1, 5);
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world, ranks);
    auto [y, back] = rotary_embedding<2>(make<X>(mesh, n, 1), o, with_backward);
    const X dx = back(make<X>(mesh, n, 4));
    check_full(
        y, [&](std::int64_t e) { return want[e]; }, 1e-12, "rope");
    check_full(
        dx, [&](std::int64_t e) { return want_dx[e]; }, 1e-12, "rope backward");
  });
}

} // namespace

TEST_CASE(
    "rotary_embedding rotates each shard by its rows' global positions: seq, heads, batch sharded, Partial",
    "[ops][rope]") {
  // position 1 of head_dim 2 turns by 1 radian: (1, 0) -> (cos 1, sin 1)
  testing::run_ranks(1, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world, 1);
    Tensor<double, 4> t({1, 1, 2, 2});
    t.data()[0] = t.data()[2] = 1;
    t.data()[1] = t.data()[3] = 0;
    const auto y = rotary_embedding<2>(DTensor<double, 4, Mesh1, R>(mesh, t, {1, 1, 2, 2})).local();
    expect(y.data()[0] == 1 && y.data()[1] == 0 && std::abs(y.data()[2] - std::cos(1.0)) < 1e-15 &&
               std::abs(y.data()[3] - std::sin(1.0)) < 1e-15,
           "rope of (1, 0) at positions 0 and 1");
  });
  for (int n = 1; n <= 4; ++n) {
    for (bool interleaved : {false, true}) {
      check_rope<Placements<S<2>>>(n, interleaved); // 13 positions over 4: offsets 0, 4, 8, 12
      check_rope<Placements<S<1>>>(n, interleaved);
      check_rope<Placements<S<0>>>(n, interleaved);
      check_rope<Placements<P>>(n, interleaved);
    }
  }
}

TEST_CASE(
    "ring attention posts each round before the kernel it overlaps, forward and backward (k/v, gradients)",
    "[ops][attention]") {
  using X = DTensor<double, 4, Mesh1, S<2>>;
  testing::run_ranks(3, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world, 3);
    const X x = make<X>(mesh, {1, 2, 9, 4}, 1);
    RingTrace trace;
    auto [o, back] = attention<Ring<"x">>(x, x, x, {.causal = true}, with_backward);
    (void)back(x);
    const std::vector<std::string> want{"post 0",
                                        "compute 0",
                                        "wait 0",
                                        "post 1",
                                        "compute 1",
                                        "wait 1",
                                        "compute 2",
                                        "wait 2",
                                        "backward post 0",
                                        "backward compute 0",
                                        "backward wait 0",
                                        "backward post grads 0",
                                        "backward post 1",
                                        "backward compute 1",
                                        "backward wait 1",
                                        "backward post grads 1",
                                        "backward compute 2",
                                        "backward wait 2",
                                        "backward post grads 2",
                                        "backward wait grads 2"};
    std::string got;
    for (const auto& e : trace.events()) {
      got += e + "; ";
    }
    expect(trace.events() == want, "ring attention's order on 3 ranks: " + got);
  });
}

TEST_CASE("batch-less attention (heads, seq, head_dim): heads or queries sharded, and its Ulysses form",
          "[ops][attention]") {
  using Q1 = DTensor<double, 3, Mesh1, S<0>>; // heads over x
  using Q2 = DTensor<double, 3, Mesh1, S<1>>; // queries over x
  using KV = DTensor<double, 3, Mesh1, R>;
  const Sizes s{1, 8, 2, 13, 13, 5, 5}; // GQA
  for (bool causal : {false, true}) {
    const Ref want = sharded_reference(s, causal);
    for (int n = 1; n <= 4; ++n) {
      testing::run_ranks(n, [&](ProcessGroup& world) {
        auto mesh = init_device_mesh<Mesh1>(world, n);
        const auto scaled = [&]<class X>(int seed, std::array<std::int64_t, 3> shape, double f) {
          return filled<X>(mesh, shape, seed, f);
        };
        const auto vec = [](const Vec& x) { return [&x](std::int64_t e) { return x[e]; }; };
        const KV k = scaled.template operator()<KV>(2, {s.hk, s.sk, s.d}, 0.25);
        const KV v = scaled.template operator()<KV>(3, {s.hk, s.sk, s.d}, 0.5);
        const auto run = [&]<class Q>() {
          const Q q = scaled.template operator()<Q>(1, {s.h, s.sq, s.d}, 0.25);
          auto [o, back] = scaled_dot_product_attention(q, k, v, {.causal = causal}, with_backward);
          auto [dq, dk, dv] = back(scaled.template operator()<Q>(4, {s.h, s.sq, s.d}, 0.5));
          check_full(o, vec(want.o), 1e-12, "o");
          check_full(dq, vec(want.dq), 1e-12, "dq");
          check_full(dk, vec(want.dk), 1e-12, "dk");
          check_full(dv, vec(want.dv), 1e-12, "dv");
        };
        run.template operator()<Q1>();
        run.template operator()<Q2>();
        if (8 % n == 0 && 2 % n == 0) { // Ulysses: k/v heads whole groups per rank
          const Q2 kq = scaled.template operator()<Q2>(2, {s.hk, s.sk, s.d}, 0.25);
          const Q2 vq = scaled.template operator()<Q2>(3, {s.hk, s.sk, s.d}, 0.5);
          const Q2 q = scaled.template operator()<Q2>(1, {s.h, s.sq, s.d}, 0.25);
          auto [o, back] = attention<Ulysses<"x">>(q, kq, vq, {.causal = causal}, with_backward);
          auto [dq, dk, dv] = back(scaled.template operator()<Q2>(4, {s.h, s.sq, s.d}, 0.5));
          check_full(o, vec(want.o), 1e-12, "Ulysses o");
          check_full(dq, vec(want.dq), 1e-12, "Ulysses dq");
          check_full(dk, vec(want.dk), 1e-12, "Ulysses dk");
          check_full(dv, vec(want.dv), 1e-12, "Ulysses dv");
        }
      });
    }
  }
}

TEST_CASE("rotary_embedding of a zigzag layout turns each row by its natural position, 1-4 ranks",
          "[ops][rope][zigzag]") {
  using X = DTensor<double, 4, Mesh1, S<2>>;
  const std::array<std::int64_t, 4> n{2, 3, 13, 6};
  const RotaryOptions o{.base = 100, .offset = 5};
  const Vec want = rope_reference(values(1, n[0] * n[1] * n[2] * n[3], 1), n, false, 100, 1, 5);
  const Vec want_dx = rope_reference(values(4, n[0] * n[1] * n[2] * n[3], 1), n, false, 100, -1, 5);
  for (int ranks = 1; ranks <= 4; ++ranks) {
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world, ranks);
      auto [y, back] = rotary_embedding<2>(zigzag<"x", 2>(filled<X>(mesh, n, 1, 1)), o, with_backward);
      const Zigzag<"x", X> dx = back(zigzag<"x", 2>(filled<X>(mesh, n, 4, 1)));
      check_full(
          unzigzag(y), [&](std::int64_t e) { return want[e]; }, 1e-12, "zigzag rope");
      check_full(
          unzigzag(dx), [&](std::int64_t e) { return want_dx[e]; }, 1e-12, "zigzag rope backward");
    });
  }
}

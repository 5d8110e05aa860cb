// The local GEMM (local/gemm.hpp) on host tensors, against a triple loop in double: every element
// type, rank 2 and batched (rank 3 x rank 2, rank 3 x rank 3), the four transpose combinations, operands
// and outputs that are contiguous, padded (narrowed), column-major (transposed views) or strided in both
// dims (copied), alpha and beta, empty m, n or k, odd sizes. The data are small integers, so every
// result is exact: float and double sums stay far below 2^24, and bfloat16 / half accumulate in float and
// round once, so they must equal the exact result rounded to their type (tolerance 0). One case with
// real-valued data states its tolerance. Also: the plan values (no copy for a transposed view, a
// column-major output computed as its transpose, the linear layer's batch folded into m) and the errors.
// The grouped GEMM (local/grouped_gemm.hpp): every group as its own matmul_into, and its errors.

#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dtensor/core/flop_counter.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/gemm.hpp"
#include "dtensor/local/grouped_gemm.hpp"

#include "../support/gemm_operands.hpp"

using namespace dtensor;

namespace {

// ---- plan values ------------------------------------------------------------------------------------
using detail::plan_gemm;
// A contiguous (4, 3) x (3, 5): plain row-major operands.
static_assert(!plan_gemm(1, {4, 3, 3, 1, 0}, false, {3, 5, 5, 1, 0}, false, {4, 5, 5, 1, 0}).needs_copy());
// a is a transposed view of a (3, 4) tensor (strides (1, 4)): a transposed GEMM with ld 4, no copy.
static_assert(plan_gemm(1, {4, 3, 1, 4, 0}, false, {3, 5, 5, 1, 0}, false, {4, 5, 5, 1, 0}).a.trans);
static_assert(plan_gemm(1, {4, 3, 1, 4, 0}, false, {3, 5, 5, 1, 0}, false, {4, 5, 5, 1, 0}).a.ld == 4);
// ... and asked for a^T, the two transposes cancel.
static_assert(!plan_gemm(1, {4, 3, 1, 4, 0}, true, {4, 5, 5, 1, 0}, false, {3, 5, 5, 1, 0}).a.trans);
// A column-major c (strides (1, 4)): computed as c^T = b^T a^T, operands swapped.
static_assert(plan_gemm(1, {4, 3, 3, 1, 0}, false, {3, 5, 5, 1, 0}, false, {4, 5, 1, 4, 0}).swapped);
// Two non-unit strides: copied.
static_assert(plan_gemm(1, {4, 3, 6, 2, 0}, false, {3, 5, 5, 1, 0}, false, {4, 5, 5, 1, 0}).a.copy);
// A linear layer, (8, 16, 32) x (32, 64) shared: one (128, 32) x (32, 64) GEMM.
static_assert(plan_gemm(8, {16, 32, 32, 1, 512}, false, {32, 64, 64, 1, 0}, false, {16, 64, 64, 1, 1024}).m ==
              128);
static_assert(
    plan_gemm(8, {16, 32, 32, 1, 512}, false, {32, 64, 64, 1, 0}, false, {16, 64, 64, 1, 1024}).batch == 1);
// ... but not when a is transposed (its matrices do not follow each other row after row).
static_assert(
    plan_gemm(8, {16, 32, 1, 16, 512}, false, {32, 64, 64, 1, 0}, false, {16, 64, 64, 1, 1024}).batch == 8);

// ---- operands in every layout -------------------------------------------------------------------------
using test_support::Layout;
using test_support::layouts;
using test_support::make_operand;

/// x(b, i, j) of a rank-2 (b ignored) or rank-3 host tensor, in double.
template <class T, int R>
double at(const Tensor<T, R>& x, std::int64_t b, std::int64_t i, std::int64_t j) {
  if constexpr (R == 2) {
    return static_cast<double>(static_cast<float>(x(i, j)));
  } else {
    return static_cast<double>(static_cast<float>(x(b, i, j)));
  }
}

/// The exact result rounded once to T, as the type's GEMM must produce it on integer data.
template <class T>
T rounded(double exact) {
  if constexpr (std::is_same_v<T, double>) {
    return exact;
  } else {
    return T(static_cast<float>(exact));
  }
}

std::string describe(std::int64_t batch, std::int64_t m, std::int64_t n, std::int64_t k, bool ta, bool tb,
                     Layout la, Layout lb, Layout lc, double alpha, double beta) {
  return "batch " + std::to_string(batch) + " m " + std::to_string(m) + " n " + std::to_string(n) + " k " +
         std::to_string(k) + " trans " + std::to_string(ta) + std::to_string(tb) + " layouts " +
         std::to_string(static_cast<int>(la)) + std::to_string(static_cast<int>(lb)) +
         std::to_string(static_cast<int>(lc)) + " alpha " + std::to_string(alpha) + " beta " +
         std::to_string(beta);
}

/// One c = alpha op(a) op(b) + beta c against the triple loop; also checks that c's buffer outside the view
/// is untouched. Returns the number of mismatching elements (0 expected).
template <class T, int R, int R2>
int check_case(std::int64_t batch, std::int64_t m, std::int64_t n, std::int64_t k, bool ta, bool tb,
               Layout la, Layout lb, Layout lc, double alpha, double beta, std::mt19937& rng) {
  auto a = make_operand<T, R>(batch, ta ? k : m, ta ? m : k, la, rng);
  auto b = make_operand<T, R2>(batch, tb ? n : k, tb ? k : n, lb, rng);
  auto c = make_operand<T, R>(batch, m, n, lc, rng);
  const Tensor<T, 1> before = c.owner.clone();
  std::vector<char> in_view(static_cast<std::size_t>(c.owner.numel()), 0);
  std::vector<double> expected;
  for (std::int64_t s = 0; s < batch; ++s) {
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double sum = 0;
        for (std::int64_t l = 0; l < k; ++l) {
          sum += (ta ? at(a.view, s, l, i) : at(a.view, s, i, l)) *
                 (tb ? at(b.view, s, j, l) : at(b.view, s, l, j));
        }
        expected.push_back(alpha * sum + (beta != 0 ? beta * at(c.view, s, i, j) : 0.0));
        const T* p = R == 2 ? &c.view.data()[i * c.view.strides()[R - 2] + j * c.view.strides()[R - 1]]
                            : &c.view.data()[s * c.view.strides()[0] + i * c.view.strides()[R - 2] +
                                             j * c.view.strides()[R - 1]];
        in_view[static_cast<std::size_t>(p - c.owner.data())] = 1;
      }
    }
  }
  local::matmul_into(a.view, b.view, c.view, ta, tb, alpha, beta);
  int bad = 0;
  std::size_t e = 0;
  for (std::int64_t s = 0; s < batch; ++s) {
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        const float got =
            static_cast<float>(R == 2 ? c.view.data()[i * c.view.strides()[0] + j * c.view.strides()[1]]
                                      : c.view.data()[s * c.view.strides()[0] + i * c.view.strides()[R - 2] +
                                                      j * c.view.strides()[R - 1]]);
        bad += got != static_cast<float>(rounded<T>(expected[e++]));
      }
    }
  }
  for (std::int64_t i = 0; i < c.owner.numel(); ++i) {
    if (in_view[static_cast<std::size_t>(i)] == 0) {
      bad += static_cast<float>(c.owner.data()[i]) != static_cast<float>(before.data()[i]);
    }
  }
  if (bad != 0) {
    UNSCOPED_INFO(describe(batch, m, n, k, ta, tb, la, lb, lc, alpha, beta));
  }
  return bad;
}

struct Sizes {
  std::int64_t m, n, k;
};
constexpr std::array<Sizes, 6> sizes{{{1, 1, 1}, {3, 5, 7}, {17, 9, 13}, {0, 4, 5}, {4, 0, 5}, {4, 5, 0}}};

/// Every size, transpose pair, layout triple and (alpha, beta) for one element type and rank pair.
template <class T, int R, int R2>
void check_all(std::int64_t batch) {
  std::mt19937 rng(12345);
  int bad = 0;
  int cases = 0;
  for (const Sizes& s : sizes) {
    for (int t = 0; t < 4; ++t) {
      for (Layout la : layouts) {
        for (Layout lb : layouts) {
          for (Layout lc : layouts) {
            for (const auto& [alpha, beta] : {std::pair{1.0, 0.0}, std::pair{2.0, -1.0}}) {
              bad += check_case<T, R, R2>(batch, s.m, s.n, s.k, (t & 1) != 0, (t & 2) != 0, la, lb, lc, alpha,
                                          beta, rng);
              ++cases;
            }
          }
        }
      }
    }
  }
  INFO(cases << " cases");
  CHECK(bad == 0);
}

} // namespace

TEMPLATE_TEST_CASE("matmul_into: rank 2, every transpose, layout and size", "[gemm]", float, double, bfloat16,
                   dtensor::half) {
  check_all<TestType, 2, 2>(1);
}

TEMPLATE_TEST_CASE("matmul_into: rank 3 x rank 2 (a shared b) and rank 3 x rank 3", "[gemm]", float, double,
                   bfloat16, dtensor::half) {
  check_all<TestType, 3, 2>(3);
  check_all<TestType, 3, 3>(2);
  check_all<TestType, 3, 3>(0); // an empty batch
}

TEST_CASE("matmul: the allocating form, a linear layer's batch folded into one GEMM", "[gemm]") {
  auto x = Tensor<float, 3>::full({4, 6, 8}, 1.0f);
  auto w = Tensor<float, 2>::full({5, 8}, 0.5f); // (out, in), as nn.Linear stores it
  const Tensor<float, 3> y = local::matmul(x, w, false, true);
  CHECK(y.shape() == std::array<std::int64_t, 3>{4, 6, 5});
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    CHECK(y.data()[i] == 4.0f);
  }
  const Tensor<double, 2> empty_k = local::matmul(Tensor<double, 2>({3, 0}), Tensor<double, 2>({0, 2}));
  CHECK(empty_k.shape() == std::array<std::int64_t, 2>{3, 2});
  for (std::int64_t i = 0; i < empty_k.numel(); ++i) {
    CHECK(empty_k.data()[i] == 0.0);
  }
}

TEST_CASE("matmul of meta tensors: the product's shape and no arithmetic, mismatches still errors",
          "[gemm][meta]") {
  const auto meta = dtensor::Device::meta();
  const auto x = Tensor<bfloat16, 3>({4, 6, 8}, meta);
  const auto w = Tensor<bfloat16, 2>({5, 8}, meta);
  const Tensor<bfloat16, 3> y = local::matmul(x, w, false, true);
  CHECK(y.shape() == std::array<std::int64_t, 3>{4, 6, 5});
  CHECK(y.device() == meta);
  CHECK_THROWS_WITH(local::matmul(x, w), Catch::Contains("matmul"));
  CHECK_THROWS_WITH(local::matmul(Tensor<float, 2>({2, 3}), Tensor<float, 2>({3, 2}, meta)),
                    Catch::Contains("cpu") && Catch::Contains("meta"));
  std::vector<Tensor<float, 2>> a{Tensor<float, 2>({3, 4}, meta), Tensor<float, 2>({0, 4}, meta)};
  std::vector<Tensor<float, 2>> b{Tensor<float, 2>({4, 2}, meta), Tensor<float, 2>({4, 2}, meta)};
  std::vector<Tensor<float, 2>> c{Tensor<float, 2>({3, 2}, meta), Tensor<float, 2>({0, 2}, meta)};
  local::grouped_matmul_into<float>(a, b, c);
}

TEST_CASE("FlopCounter: 2mnk a GEMM on every device, meta included, once for reduced types and groups",
          "[gemm][flops]") {
  const auto meta = dtensor::Device::meta();
  dtensor::FlopCounter flops;
  (void)local::matmul(Tensor<float, 2>({3, 4}), Tensor<float, 2>({4, 5}));
  CHECK(flops.flops() == 2 * 3 * 4 * 5);
  flops.reset();
  (void)local::matmul(Tensor<bfloat16, 3>({2, 3, 4}), Tensor<bfloat16, 2>({5, 4}), false, true);
  CHECK(flops.flops() == 2 * 2 * 3 * 4 * 5); // the float GEMM inside is not counted again
  flops.reset();
  (void)local::matmul(Tensor<float, 2>({8, 6}, meta), Tensor<float, 2>({8, 7}, meta), true, false);
  CHECK(flops.flops() == 2 * 6 * 8 * 7);
  const double before = dtensor::FlopCounter::clock();
  {
    dtensor::FlopCounter inner; // counters nest: each reads the thread's clock
    std::vector<Tensor<float, 2>> a{Tensor<float, 2>({3, 4}), Tensor<float, 2>({2, 4})};
    std::vector<Tensor<float, 2>> b{Tensor<float, 2>({4, 2}), Tensor<float, 2>({4, 2})};
    std::vector<Tensor<float, 2>> c{Tensor<float, 2>({3, 2}), Tensor<float, 2>({2, 2})};
    local::grouped_matmul_into<float>(a, b, c);
    std::vector<Tensor<float, 2>> am{a[0].to(meta)}, bm{b[0].to(meta)}, cm{c[0].to(meta)};
    local::grouped_matmul_into<float>(am, bm, cm);
    CHECK(inner.flops() == 2 * (3 * 4 * 2 + 2 * 4 * 2) + 2 * 3 * 4 * 2);
  }
  CHECK(dtensor::FlopCounter::clock() - before == flops.flops() - 2 * 6 * 8 * 7);
}

TEST_CASE("matmul_into: beta = 0 ignores c, NaN included", "[gemm]") {
  auto a = Tensor<float, 2>::full({2, 3}, 1.0f);
  auto b = Tensor<float, 2>::full({3, 2}, 2.0f);
  auto c = Tensor<float, 2>::full({2, 2}, std::numeric_limits<float>::quiet_NaN());
  local::matmul_into(a, b, c);
  for (std::int64_t i = 0; i < c.numel(); ++i) {
    CHECK(c.data()[i] == 6.0f);
  }
}

TEMPLATE_TEST_CASE("matmul: real-valued data within the type's rounding", "[gemm]", float, bfloat16,
                   dtensor::half) {
  // Tolerance per element: one rounding to T of the result (2^-8 relative for bfloat16, 2^-11 for half,
  // 2^-24 for float) plus float accumulation, k 2^-24 sum |a||b|.
  const double unit = std::is_same_v<TestType, bfloat16>        ? 0x1p-8
                      : std::is_same_v<TestType, dtensor::half> ? 0x1p-11
                                                                : 0x1p-24;
  constexpr std::int64_t m = 33, n = 21, k = 129;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  Tensor<TestType, 2> a({m, k}), b({k, n});
  for (auto* t : {&a, &b}) {
    for (std::int64_t i = 0; i < t->numel(); ++i) {
      t->data()[i] = TestType(value(rng));
    }
  }
  const Tensor<TestType, 2> c = local::matmul(a, b);
  int bad = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double exact = 0, magnitude = 0;
      for (std::int64_t l = 0; l < k; ++l) {
        const double p = static_cast<double>(static_cast<float>(a(i, l))) * static_cast<float>(b(l, j));
        exact += p;
        magnitude += std::abs(p);
      }
      const double got = static_cast<float>(c(i, j));
      bad += std::abs(got - exact) > unit * std::abs(exact) + k * 0x1p-24 * magnitude;
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("matmul_into: errors name the op, the shapes and the transposes", "[gemm]") {
  const auto throws_with = [](auto&& f, const std::string& text) {
    try {
      f();
      FAIL("no error; expected one containing: " << text);
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(text) != std::string::npos);
    }
  };
  Tensor<float, 2> a({2, 3}), b({4, 5}), c({2, 5});
  throws_with([&] { local::matmul_into(a, b, c); },
              "matmul_into: a [2, 3] x b [4, 5]: the inner dims differ (3 vs 4)");
  throws_with([&] { local::matmul(a, b, true, true); },
              "matmul: a [2, 3]^T x b [4, 5]^T: the inner dims differ "
              "(2 vs 5)");
  Tensor<float, 2> b2({3, 5}), c_wrong({5, 2});
  throws_with([&] { local::matmul_into(a, b2, c_wrong); }, "c has shape [5, 2], the product has [2, 5]");
  Tensor<float, 3> x({2, 3, 4}), y({3, 4, 5}), z({2, 3, 5});
  throws_with([&] { local::matmul_into(x, y, z); }, "the batch sizes differ (2 vs 3)");
  Tensor<float, 2> w({5, 4});
  throws_with([&] { local::matmul_into(x, w, z); },
              "matmul_into: a [2, 3, 4] x b [5, 4]: the inner dims differ");
  throws_with([&] { local::matmul_into(Tensor<float, 2>{}, b2, c); }, "undefined tensor");
}

namespace {

/// One grouped_matmul_into over groups of different sizes (an empty m, an empty n, an empty k among them),
/// each group's operands in its own layouts, against matmul_into on each group of a copy of c. Compares
/// c's whole buffers (views and gaps); returns the number of elements that differ.
template <class T>
int check_grouped(bool ta, bool tb, double alpha, double beta, int rotation, std::mt19937& rng) {
  constexpr std::array<Sizes, 6> group_sizes{
      {{3, 5, 7}, {0, 4, 5}, {17, 9, 13}, {4, 6, 0}, {1, 1, 1}, {5, 0, 3}}};
  std::vector<test_support::Operand<T, 2>> a, b, c;
  std::vector<Tensor<T, 1>> expected;
  for (std::size_t g = 0; g < group_sizes.size(); ++g) {
    const auto [m, n, k] = group_sizes[g];
    const auto layout = [&](std::size_t shift) { return layouts[(g + shift + rotation) % layouts.size()]; };
    a.push_back(make_operand<T, 2>(1, ta ? k : m, ta ? m : k, layout(0), rng));
    b.push_back(make_operand<T, 2>(1, tb ? n : k, tb ? k : n, layout(1), rng));
    c.push_back(make_operand<T, 2>(1, m, n, layout(2), rng));
    expected.push_back(c.back().owner.clone());
    local::matmul_into(a[g].view, b[g].view, c[g].view_of(expected[g]), ta, tb, alpha, beta);
  }
  std::vector<Tensor<T, 2>> av, bv, cv;
  for (std::size_t g = 0; g < group_sizes.size(); ++g) {
    av.push_back(a[g].view);
    bv.push_back(b[g].view);
    cv.push_back(c[g].view);
  }
  local::grouped_matmul_into<T>(av, bv, cv, ta, tb, alpha, beta);
  int bad = 0;
  for (std::size_t g = 0; g < group_sizes.size(); ++g) {
    for (std::int64_t i = 0; i < expected[g].numel(); ++i) {
      bad += static_cast<float>(c[g].owner.data()[i]) != static_cast<float>(expected[g].data()[i]);
    }
  }
  if (bad != 0) {
    UNSCOPED_INFO("trans " << ta << tb << " alpha " << alpha << " beta " << beta << " rotation " << rotation);
  }
  return bad;
}

} // namespace

TEMPLATE_TEST_CASE("grouped_matmul_into: every group as its own matmul_into, empty m, n and k included",
                   "[gemm][grouped]", float, double) {
  std::mt19937 rng(99);
  int bad = 0;
  for (int t = 0; t < 4; ++t) {
    for (const auto& [alpha, beta] : {std::pair{1.0, 0.0}, std::pair{2.0, -1.0}}) {
      for (int rotation = 0; rotation < 4; ++rotation) { // every group sees every layout
        bad += check_grouped<TestType>((t & 1) != 0, (t & 2) != 0, alpha, beta, rotation, rng);
      }
    }
  }
  CHECK(bad == 0);
  // k = 0 is c = beta c; no groups at all is nothing to do.
  const std::vector<Tensor<TestType, 2>> a{Tensor<TestType, 2>({2, 0})}, b{Tensor<TestType, 2>({0, 3})};
  const std::vector<Tensor<TestType, 2>> c{Tensor<TestType, 2>::full({2, 3}, TestType(5))};
  local::grouped_matmul_into<TestType>(a, b, c, false, false, 1.0, -2.0);
  for (std::int64_t i = 0; i < c[0].numel(); ++i) {
    CHECK(c[0].data()[i] == TestType(-10));
  }
  local::grouped_matmul_into<TestType>({}, {}, {});
}

TEST_CASE("grouped_matmul_into: errors name the counts or the group, before any group runs",
          "[gemm][grouped]") {
  using Catch::Matchers::Contains;
  const Tensor<float, 2> a0 = Tensor<float, 2>::full({2, 3}, 1.0f), b0 = Tensor<float, 2>::full({3, 5}, 1.0f);
  const Tensor<float, 2> c0 = Tensor<float, 2>::full({2, 5}, 7.0f);
  const Tensor<float, 2> a1({2, 3}), b1({4, 5}), c1({2, 5}), c_wrong({5, 2});
  const std::vector<Tensor<float, 2>> a{a0, a1}, b{b0, b1}, c{c0, c1};
  REQUIRE_THROWS_WITH(local::grouped_matmul_into<float>(a, b, std::span(c).first(1)),
                      Contains("grouped_matmul_into: a has 2 groups, b 2 and c 1"));
  REQUIRE_THROWS_WITH(
      local::grouped_matmul_into<float>(a, b, c),
      Contains("grouped_matmul_into: group 1: a [2, 3] x b [4, 5]: the inner dims differ (3 vs 4)"));
  for (std::int64_t i = 0; i < c0.numel(); ++i) { // group 0 did not run: group 1 was checked first
    REQUIRE(c0.data()[i] == 7.0f);
  }
  const std::vector<Tensor<float, 2>> a2{a0, a0}, b2{b0, b0}, c2{c0, c_wrong};
  REQUIRE_THROWS_WITH(local::grouped_matmul_into<float>(a2, b2, c2, false, false),
                      Contains("grouped_matmul_into: group 1: a [2, 3] x b [3, 5]: c has shape [5, 2], the "
                               "product has [2, 5]"));
  REQUIRE_THROWS_WITH(local::grouped_matmul_into<float>(a2, b2, c2, true, false),
                      Contains("grouped_matmul_into: group 0: a [2, 3]^T x b [3, 5]: the inner dims differ"));
  const std::vector<Tensor<float, 2>> undefined{a0, Tensor<float, 2>{}};
  REQUIRE_THROWS_WITH(local::grouped_matmul_into<float>(undefined, b2, c2),
                      Contains("grouped_matmul_into: group 1: an operand is an undefined tensor"));
}

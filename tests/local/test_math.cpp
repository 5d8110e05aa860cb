// The float exp and erf of local/math.hpp against the C library in double (correctly rounded to far
// below a float ulp), and the host block and lane paths of local/pointwise.hpp against the element
// function and in-order references. One process, no communication.
//
// The ulp bounds pinned here are the maxima of an exhaustive run over every float (exp 0.9886 ulp at
// -0x1.769da2p+2, erf 1.1939 ulp at 0x1.c2c11p-1); the test sweeps every 251st float of each domain, every
// float in windows around the places where the formulas change (erf's 0.875 and 4, exp's overflow and
// subnormal thresholds), and those two worst points.
#include <catch2/catch.hpp>

#include <dtensor/local/math.hpp>
#include <dtensor/local/pointwise.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

using namespace dtensor;

namespace {

/// The size of one float ulp at the (real) value r: of the binade r falls in, or of the subnormals.
double ulp_of(double r) {
  const double a = std::fabs(r);
  if (a < 0x1p-126) {
    return 0x1p-149;
  }
  int e = 0;
  std::frexp(a, &e);
  return std::ldexp(1.0, e - 24);
}

struct Worst {
  double ulp = 0;
  float at = 0;
  void add(float x, float got, double want) {
    double e = 0;
    if (std::isnan(want)) {
      e = std::isnan(got) ? 0 : 1e9;
    } else if (std::fabs(want) >= 0x1.ffffffp127) { // rounds to inf in float
      e = got == float(want > 0 ? INFINITY : -INFINITY) ? 0 : 1e9;
    } else {
      e = std::fabs(double(got) - want) / ulp_of(want);
    }
    if (e > ulp) {
      ulp = e;
      at = x;
    }
  }
};

/// Every `step`-th float with bit patterns in [lo, hi] (both signs when `both`), and f against ref there.
template <class F, class Ref>
void sweep(Worst& w, F f, Ref ref, std::uint32_t lo, std::uint32_t hi, std::uint32_t step, bool both) {
  for (std::uint64_t b = lo; b <= hi; b += step) {
    for (int s = 0; s < (both ? 2 : 1); ++s) {
      const float x = std::bit_cast<float>(std::uint32_t(b) | (s ? 0x80000000u : 0u));
      w.add(x, f(x), ref(double(x)));
    }
  }
}

std::uint32_t bits(float x) {
  return std::bit_cast<std::uint32_t>(x);
}

} // namespace

TEST_CASE("math::exp is within 1 ulp of exp on floats", "[ops][math]") {
  Worst w;
  auto f = [](float x) { return local::math::exp_float(x); };
  auto ref = [](double x) { return std::exp(x); };
  sweep(w, f, ref, 0, bits(110.0f), 251, true);                                      // the domain, both signs
  sweep(w, f, ref, bits(88.0f), bits(89.0f), 1, false);                              // near overflow (88.72)
  sweep(w, f, ref, bits(87.0f) | 0x80000000u, bits(105.0f) | 0x80000000u, 1, false); // subnormal results
  sweep(w, f, ref, 0, bits(0x1p-20f), 64, true);                                     // tiny arguments
  w.add(-0x1.769da2p+2f, f(-0x1.769da2p+2f), ref(-0x1.769da2p+2)); // the exhaustive run's worst
  INFO("worst " << w.ulp << " ulp at " << w.at);
  CHECK(w.ulp <= 1.0);
  CHECK(w.ulp > 0.9); // the worst point is in the sweep: the bound is tight, not vacuous

  CHECK(std::isnan(local::math::exp_float(std::numeric_limits<float>::quiet_NaN())));
  CHECK(local::math::exp_float(INFINITY) == INFINITY);
  CHECK(local::math::exp_float(-INFINITY) == 0.0f);
  CHECK(local::math::exp_float(0.0f) == 1.0f);
  CHECK(local::math::exp_float(-0.0f) == 1.0f);
  CHECK(local::math::exp_float(88.72283f) == std::exp(88.72283f)); // the largest finite result
  CHECK(local::math::exp_float(88.7229f) == INFINITY);
  CHECK(local::math::exp_float(-103.0f) == std::exp(-103.0f)); // subnormal
  CHECK(local::math::exp_float(-104.0f) == 0.0f);
  CHECK(local::math::exp_float(-1e30f) == 0.0f);
  CHECK(local::math::exp_float(1e30f) == INFINITY);
}

TEST_CASE("math::erf is within 1.2 ulp of erf on floats", "[ops][math]") {
  Worst w;
  auto f = [](float x) { return local::math::erf_float(x); };
  auto ref = [](double x) { return std::erf(x); };
  sweep(w, f, ref, 0, 0x7f800000u, 251, true);               // every finite float and inf
  sweep(w, f, ref, bits(0.8f), bits(0.95f), 1, true);        // the formulas meet at 0.875
  sweep(w, f, ref, bits(3.8f), bits(4.2f), 1, true);         // the clamp at 4
  sweep(w, f, ref, 0, bits(0x1p-120f), 4096, true);          // subnormal and tiny x
  w.add(0x1.c2c11p-1f, f(0x1.c2c11p-1f), ref(0x1.c2c11p-1)); // the exhaustive run's worst
  INFO("worst " << w.ulp << " ulp at " << w.at);
  CHECK(w.ulp <= 1.2);
  CHECK(w.ulp > 1.1);

  CHECK(std::isnan(local::math::erf_float(std::numeric_limits<float>::quiet_NaN())));
  CHECK(local::math::erf_float(INFINITY) == 1.0f);
  CHECK(local::math::erf_float(-INFINITY) == -1.0f);
  CHECK(local::math::erf_float(10.0f) == 1.0f);
  CHECK(std::signbit(local::math::erf_float(-0.0f)));
  CHECK(local::math::erf_float(0.0f) == 0.0f);
  CHECK(local::math::erf_float(-2.0f) == -local::math::erf_float(2.0f));
}

TEST_CASE("math::select and the generic forms", "[ops][math]") {
  CHECK(local::math::select(true, 1.5f, -2.0f) == 1.5f);
  CHECK(local::math::select(false, 1.5f, -2.0f) == -2.0f);
  CHECK(local::math::select(true, 1.5, -2.0) == 1.5);
  CHECK(std::isnan(local::math::select(false, 1.0f, std::numeric_limits<float>::quiet_NaN())));
  CHECK(local::math::choose(false, std::int64_t(3), std::int64_t(4)) == 4);
  // double goes to the C library
  CHECK(local::math::exp(0.5) == std::exp(0.5));
  CHECK(local::math::erf(0.5) == std::erf(0.5));
  CHECK(local::math::exp(0.5f) == local::math::exp_float(0.5f));
}

namespace {

/// x = a spread of values over [-6, 6] with the special ones in it.
Tensor<float, 2> inputs(std::int64_t rows, std::int64_t cols) {
  Tensor<float, 2> x({rows, cols});
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    x.data()[i] = float((i * 7919) % 2401) / 200.0f - 6.0f;
  }
  if (x.numel() > 3) {
    x.data()[1] = std::numeric_limits<float>::quiet_NaN();
    x.data()[2] = INFINITY;
    x.data()[3] = -INFINITY;
  }
  return x;
}

/// Whether a and b are the same float, NaN equal to NaN, or within `ulps` float ulps of each other.
bool close(float a, float b, double ulps) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::isnan(a) && std::isnan(b);
  }
  if (a == b) {
    return true;
  }
  return std::fabs(double(a) - double(b)) <= ulps * ulp_of(b);
}

} // namespace

TEST_CASE("host maps: the block path and the tail equal the element function", "[ops][math]") {
  // Widths below, at and across the block size; a strided view (runs of 5 in rows of 7) too.
  for (std::int64_t cols : {std::int64_t(1), std::int64_t(5), std::int64_t(31), std::int64_t(32),
                            std::int64_t(33), std::int64_t(100)}) {
    const auto x = inputs(3, cols);
    const auto g = inputs(3, cols);
    auto check = [&](const auto& y, auto&& element, const std::string& what) {
      for (std::int64_t i = 0; i < x.numel(); ++i) {
        const float want = element(x.data()[i], g.data()[i]);
        INFO(what << " cols " << cols << " element " << i << ": " << y.data()[i] << " vs " << want);
        // The vector and scalar code run the same IEEE operations (1 ulp allows a compiler's contraction).
        CHECK(close(y.data()[i], want, 1));
      }
    };
    check(
        local::map(local::Gelu{}, x), [](float a, float) { return local::Gelu{}(a); }, "gelu");
    check(
        local::map(local::BackwardOf<local::Gelu>{}, x, g),
        [](float a, float b) { return local::Gelu{}.backward(a, b); }, "gelu backward");
    check(
        local::map(local::Silu{}, x), [](float a, float) { return local::Silu{}(a); }, "silu");
    check(
        local::map(local::Exp{}, x), [](float a, float) { return local::math::exp_float(a); }, "exp");
    check(
        local::map(local::Add{}, x, g), [](float a, float b) { return a + b; }, "add");
    check(
        local::map(local::Relu{}, x), [](float a, float) { return a > 0 ? a : 0.0f; }, "relu");
  }
  const auto wide = inputs(4, 70);
  const auto view = wide.narrow(1, 3, 40); // rows of 40 in rows of 70
  const auto y = local::map(local::Gelu{}, view);
  for (std::int64_t r = 0; r < 4; ++r) {
    for (std::int64_t c = 0; c < 40; ++c) {
      CHECK(close(y.data()[r * 40 + c], local::Gelu{}(wide.data()[r * 70 + 3 + c]), 1));
    }
  }
}

TEST_CASE("host maps of gelu, silu and their backwards against double references", "[ops][math]") {
  const auto x = inputs(7, 300);
  const auto gelu = local::map(local::Gelu{}, x);
  const auto dgelu = local::map(local::BackwardOf<local::Gelu>{}, x, x);
  const auto silu = local::map(local::Silu{}, x);
  for (std::int64_t i = 4; i < x.numel(); ++i) {
    const double v = x.data()[i];
    const double ref = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    const double cdf = 0.5 * (1 + std::erf(v / std::sqrt(2.0)));
    const double dref = v * (cdf + v * std::exp(-0.5 * v * v) / std::sqrt(2 * M_PI));
    // Absolute bounds: for x < 0, 1 + erf(x / sqrt 2) cancels in float whatever erf rounds to (torch too).
    INFO("x = " << v);
    CHECK(std::fabs(gelu.data()[i] - ref) <= 4e-7 * std::max(1.0, std::fabs(ref)));
    CHECK(std::fabs(dgelu.data()[i] - dref) <= 4e-6 * std::max(1.0, std::fabs(dref)));
    CHECK(std::fabs(silu.data()[i] - v / (1 + std::exp(-v))) <= 4e-7 * std::max(1.0, std::fabs(v)));
  }
}

TEST_CASE("host reductions: lanes over the innermost dim, left to right over outer dims", "[ops][math]") {
  for (std::int64_t cols : {std::int64_t(0), std::int64_t(1), std::int64_t(31), std::int64_t(32),
                            std::int64_t(33), std::int64_t(257)}) {
    Tensor<float, 2> x({5, cols});
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      x.data()[i] = float((i * 37) % 19) - 9.0f; // integer valued: every order sums exactly
    }
    const auto sum = local::reduce(ReduceOp::sum, x, 1);
    const auto max = local::reduce(ReduceOp::max, x, 1);
    const auto min = local::reduce(ReduceOp::min, x, 1);
    const auto mean = local::reduce(ReduceOp::sum, x, 1, double(cols));
    for (std::int64_t r = 0; r < 5; ++r) {
      double s = 0;
      float mx = -INFINITY, mn = INFINITY;
      for (std::int64_t c = 0; c < cols; ++c) {
        s += x.data()[r * cols + c];
        mx = std::max(mx, x.data()[r * cols + c]);
        mn = std::min(mn, x.data()[r * cols + c]);
      }
      INFO("cols " << cols << " row " << r);
      CHECK(sum.data()[r] == float(s));
      CHECK(max.data()[r] == mx);
      CHECK(min.data()[r] == mn);
      if (cols > 0) {
        CHECK(mean.data()[r] == float(float(s) / float(cols)));
      }
    }
    // Over the outer dim: each column left to right, so equal to a plain loop bit for bit (non-integer data).
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      x.data()[i] = float(i % 13) * 0.1f + 1e-3f * float(i);
    }
    const auto col = local::reduce(ReduceOp::sum, x, 0);
    const auto colprod = local::reduce(ReduceOp::product, x, 0);
    for (std::int64_t c = 0; c < cols; ++c) {
      float s = x.data()[c], p = x.data()[c];
      for (std::int64_t r = 1; r < 5; ++r) {
        s += x.data()[r * cols + c];
        p *= x.data()[r * cols + c];
      }
      CHECK(col.data()[c] == s);
      CHECK(colprod.data()[c] == p);
    }
  }
  // A long row of non-integer values: the lane order is within float rounding of the exact sum.
  Tensor<float, 2> y({1, 5000});
  double exact = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    y.data()[i] = 1.0f / float(i + 1);
    exact += double(y.data()[i]);
  }
  CHECK(std::fabs(local::reduce(ReduceOp::sum, y, 1).data()[0] - exact) <= 1e-6 * exact);
  // NaN wins in max and min wherever it is: in a lane, in the tail, first.
  for (std::int64_t at : {std::int64_t(0), std::int64_t(7), std::int64_t(16), std::int64_t(4999)}) {
    Tensor<float, 2> z = y.clone();
    z.data()[at] = std::numeric_limits<float>::quiet_NaN();
    CHECK(std::isnan(local::reduce(ReduceOp::max, z, 1).data()[0]));
    CHECK(std::isnan(local::reduce(ReduceOp::min, z, 1).data()[0]));
  }
}

TEST_CASE("host maps of every element function against references written here, in the block path and the "
          "tail (float)",
          "[ops][math]") {
  // Rows of 67 (two blocks of 32 and a tail of 3) as the runs of a view into rows of 70, and the same
  // values contiguous (9 x 67 = 603: eighteen blocks and a tail of 27). Finite inputs over [-6, 6].
  Tensor<float, 2> wide_x({9, 70});
  Tensor<float, 2> wide_g({9, 70});
  for (std::int64_t i = 0; i < wide_x.numel(); ++i) {
    wide_x.data()[i] = float((i * 7919) % 2401) / 200.0f - 6.0f;
    wide_g.data()[i] = i % 5 == 0 ? wide_x.data()[i] : float((i * 104729) % 1201) / 100.0f - 6.0f;
  }
  const auto xv = wide_x.narrow(1, 2, 67);
  const auto gv = wide_g.narrow(1, 2, 67);
  const auto xc = xv.contiguous();
  const auto gc = gv.contiguous();
  // |got - want| <= ulps float ulps of want, or abs where a formula cancels (relative to the operands).
  auto check = [&](const char* what, const auto& map, auto&& want, double ulps, double abs = 0) {
    for (int form = 0; form < 2; ++form) {
      const Tensor<float, 2> y = form == 0 ? map(xv, gv) : map(xc, gc);
      for (std::int64_t r = 0; r < 9; ++r) {
        for (std::int64_t c = 0; c < 67; ++c) {
          const double x = xc.data()[r * 67 + c];
          const double g = gc.data()[r * 67 + c];
          const double w = want(x, g);
          const double got = y.data()[r * 67 + c];
          const double bound = std::max(ulps * ulp_of(w), abs * std::max({1.0, std::fabs(x), std::fabs(g)}));
          INFO(what << (form == 0 ? " (runs of 67)" : " (contiguous)") << " at (" << r << ", " << c
                    << "): x = " << x << ", g = " << g << ": " << got << " vs " << w);
          CHECK(std::fabs(got - w) <= bound);
        }
      }
    }
  };
  using T2 = Tensor<float, 2>;
  const double pi = 3.14159265358979323846;
  auto phi = [&](double x) { return std::exp(-0.5 * x * x) / std::sqrt(2 * pi); };
  auto cdf = [](double x) { return 0.5 * (1 + std::erf(x / std::sqrt(2.0))); };
  auto sigmoid = [](double x) { return 1 / (1 + std::exp(-x)); };
  check(
      "relu", [](const T2& x, const T2&) { return local::map(local::Relu{}, x); },
      [](double x, double) { return x > 0 ? x : 0.0; }, 0);
  check(
      "relu backward",
      [](const T2& x, const T2& g) { return local::map(local::BackwardOf<local::Relu>{}, x, g); },
      [](double x, double g) { return x > 0 ? g : 0.0; }, 0);
  check(
      "exp", [](const T2& x, const T2&) { return local::map(local::Exp{}, x); },
      [](double x, double) { return std::exp(x); }, 1);
  check(
      "exp backward",
      [](const T2& x, const T2& g) { return local::map(local::BackwardOf<local::Exp>{}, x, g); },
      [](double x, double g) { return g * std::exp(x); }, 2);
  // For x < 0, 1 + erf(x / sqrt 2) cancels in float whatever erf rounds to (torch too): absolute bounds.
  check(
      "gelu", [](const T2& x, const T2&) { return local::map(local::Gelu{}, x); },
      [&](double x, double) { return x * cdf(x); }, 4, 4e-7);
  check(
      "gelu backward",
      [](const T2& x, const T2& g) { return local::map(local::BackwardOf<local::Gelu>{}, x, g); },
      [&](double x, double g) { return g * (cdf(x) + x * phi(x)); }, 4, 4e-6);
  check(
      "silu", [](const T2& x, const T2&) { return local::map(local::Silu{}, x); },
      [&](double x, double) { return x * sigmoid(x); }, 4, 4e-7);
  // silu' = s + x s (1 - s) crosses 0 near x = -1.28, where the float form cancels: absolute bounds.
  check(
      "silu backward",
      [](const T2& x, const T2& g) { return local::map(local::BackwardOf<local::Silu>{}, x, g); },
      [&](double x, double g) { return g * (sigmoid(x) + x * sigmoid(x) * (1 - sigmoid(x))); }, 4, 4e-6);
  check(
      "scale", [](const T2& x, const T2&) { return local::map(local::Scale{-2.5}, x); },
      [](double x, double) { return -2.5 * x; }, 0.5);
  check(
      "scale backward",
      [](const T2& x, const T2& g) { return local::map(local::BackwardOf<local::Scale>{{-2.5}}, x, g); },
      [](double, double g) { return -2.5 * g; }, 0.5);
  check(
      "x + 1.25", [](const T2& x, const T2&) { return local::map(local::AddScalar{1.25}, x); },
      [](double x, double) { return x + 1.25; }, 0.5);
  check(
      "add", [](const T2& x, const T2& g) { return local::map(local::Add{}, x, g); },
      [](double x, double g) { return x + g; }, 0.5);
  check(
      "sub", [](const T2& x, const T2& g) { return local::map(local::Sub{}, x, g); },
      [](double x, double g) { return x - g; }, 0.5);
  check(
      "mul", [](const T2& x, const T2& g) { return local::map(local::Mul{}, x, g); },
      [](double x, double g) { return x * g; }, 0.5);
  // Divisors g + 7 in [1, 13]. (Every fifth g equals x: "attained" finds both answers.)
  auto shifted = [](const T2& g) { return local::map(local::AddScalar{7}, g); };
  check(
      "div", [&](const T2& x, const T2& g) { return local::map(local::Div{}, x, shifted(g)); },
      [](double x, double g) { return x / double(float(g + 7)); }, 0.51);
  check(
      "divisor gradient",
      [&](const T2& x, const T2& g) { return local::map(local::DivisorGrad{}, g, x, shifted(g)); },
      [](double x, double g) {
        const double b = double(float(g + 7));
        return -g * x / (b * b);
      },
      3);
  check(
      "attained", [](const T2& x, const T2& g) { return local::map(local::Attained{}, x, g); },
      [](double x, double g) { return x == g ? 1.0 : 0.0; }, 0);
}

TEST_CASE("host products over the innermost dim: the 16 lanes and the tail against a plain loop",
          "[ops][math]") {
  // Values +-1 and a few +-2, so that every order of multiplication is exact.
  for (std::int64_t cols : {std::int64_t(31), std::int64_t(67), std::int64_t(257)}) {
    Tensor<float, 2> x({3, cols});
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      x.data()[i] = (i % 3 == 0 ? -1.0f : 1.0f) * (i % 29 == 0 ? 2.0f : 1.0f);
    }
    const auto prod = local::reduce(ReduceOp::product, x, 1);
    for (std::int64_t r = 0; r < 3; ++r) {
      double p = 1;
      for (std::int64_t c = 0; c < cols; ++c) {
        p *= x.data()[r * cols + c];
      }
      INFO("cols " << cols << " row " << r);
      CHECK(prod.data()[r] == float(p));
    }
  }
}

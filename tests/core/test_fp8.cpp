// The 8-bit floats float8_e4m3 (E4M3FN) and float8_e5m2: type facts, every bit pattern to float and back,
// hand-checked conversions (ties, max, subnormals, NaN, overflow), and float -> fp8 over a sweep of float
// bit patterns against an independent nearest-value search.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/core/element_type.hpp"

using dtensor::DType;
using dtensor::float8_e4m3;
using dtensor::float8_e5m2;

namespace {

float float_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

constexpr float inf = std::numeric_limits<float>::infinity();
const float qnan = std::numeric_limits<float>::quiet_NaN();

bool is_nan_e4m3(std::uint8_t b) {
  return (b & 0x7f) == 0x7f;
}
bool is_nan_e5m2(std::uint8_t b) {
  return (b & 0x7f) > 0x7c;
}

/// The value of an fp8 bit pattern from the format's definition (independent of the conversions).
double reference_value(std::uint8_t b, int exponent_bits, int mantissa_bits) {
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int e = (b >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int m = b & ((1 << mantissa_bits) - 1);
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  if (e == 0) {
    return sign * std::ldexp(m, 1 - bias - mantissa_bits);
  }
  return sign * std::ldexp((1 << mantissa_bits) + m, e - bias - mantissa_bits);
}

/// float -> fp8 by search: the nearest of the positive finite values (ties to the even bit pattern),
/// where `overflow_value` stands for the first value beyond the largest finite one and converts to
/// `overflow_bits` (e4m3: 480 -> NaN; e5m2: 65536 -> inf).
struct SearchReference {
  std::vector<std::pair<double, std::uint8_t>> values; // ascending
  double overflow_value;
  std::uint8_t overflow_bits;
  std::uint8_t nan_bits;

  std::uint8_t operator()(float f) const {
    if (std::isnan(f)) {
      return static_cast<std::uint8_t>(nan_bits | (std::signbit(f) ? 0x80 : 0));
    }
    const double a = std::fabs(static_cast<double>(f));
    std::uint8_t bits = overflow_bits;
    if (a < overflow_value) {
      auto hi = std::lower_bound(values.begin(), values.end(), std::make_pair(a, std::uint8_t{0}),
                                 [](const auto& x, const auto& y) { return x.first < y.first; });
      if (hi == values.end()) { // between the largest finite value and overflow_value
        const double top = values.back().first;
        const double mid = (top + overflow_value) / 2;
        bits =
            a < mid || (a == mid && (values.back().second & 1) == 0) ? values.back().second : overflow_bits;
      } else if (hi->first == a || hi == values.begin()) {
        bits = hi->second;
      } else {
        const auto lo = std::prev(hi);
        const double dl = a - lo->first;
        const double dh = hi->first - a;
        bits = dl < dh || (dl == dh && (lo->second & 1) == 0) ? lo->second : hi->second;
      }
    }
    return static_cast<std::uint8_t>(bits | (std::signbit(f) ? 0x80 : 0));
  }
};

SearchReference e4m3_reference() {
  SearchReference r{{}, 480.0, 0x7f, 0x7f};
  for (int b = 0; b < 0x7f; ++b) {
    r.values.emplace_back(reference_value(static_cast<std::uint8_t>(b), 4, 3), static_cast<std::uint8_t>(b));
  }
  return r;
}

SearchReference e5m2_reference() {
  SearchReference r{{}, 65536.0, 0x7c, 0x7f};
  for (int b = 0; b < 0x7c; ++b) {
    r.values.emplace_back(reference_value(static_cast<std::uint8_t>(b), 5, 2), static_cast<std::uint8_t>(b));
  }
  return r;
}

struct Case {
  float in;
  std::uint8_t out;
  const char* why;
};

} // namespace

TEST_CASE("fp8 type facts", "[element_type][fp8]") {
  STATIC_REQUIRE(sizeof(float8_e4m3) == 1);
  STATIC_REQUIRE(sizeof(float8_e5m2) == 1);
  STATIC_REQUIRE(std::is_trivially_copyable_v<float8_e4m3>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<float8_e5m2>);
  STATIC_REQUIRE(dtensor::Element<float8_e4m3>);
  STATIC_REQUIRE(dtensor::Element<float8_e5m2>);
  STATIC_REQUIRE(dtensor::dtype_v<float8_e4m3> == DType::float8_e4m3);
  STATIC_REQUIRE(dtensor::dtype_v<float8_e5m2> == DType::float8_e5m2);
  STATIC_REQUIRE(std::is_same_v<dtensor::element_type_t<DType::float8_e4m3>, float8_e4m3>);
  STATIC_REQUIRE(std::is_same_v<dtensor::element_type_t<DType::float8_e5m2>, float8_e5m2>);
  STATIC_REQUIRE(dtensor::dtype_size(DType::float8_e4m3) == 1);
  STATIC_REQUIRE(dtensor::dtype_size(DType::float8_e5m2) == 1);
  STATIC_REQUIRE(dtensor::dtype_name(DType::float8_e4m3) == "float8_e4m3fn");
  STATIC_REQUIRE(dtensor::dtype_name(DType::float8_e5m2) == "float8_e5m2");
  STATIC_REQUIRE(dtensor::detail::is_reduced_float_v<float8_e4m3>);
  // Conversions are constexpr.
  STATIC_REQUIRE(float8_e4m3(1.0f).bits == 0x38);
  STATIC_REQUIRE(float8_e5m2(1.0f).bits == 0x3c);
  STATIC_REQUIRE(static_cast<float>(float8_e4m3::from_bits(0x7e)) == 448.0f);
  STATIC_REQUIRE(static_cast<float>(float8_e5m2::from_bits(0x7b)) == 57344.0f);
}

TEST_CASE("every fp8 bit pattern converts to its value and back", "[element_type][fp8]") {
  for (int i = 0; i < 256; ++i) {
    const auto b = static_cast<std::uint8_t>(i);
    INFO("bits 0x" << std::hex << i);
    const float v4 = float8_e4m3::from_bits(b);
    if (is_nan_e4m3(b)) {
      CHECK(std::isnan(v4));
      CHECK(float8_e4m3(v4).bits == b); // the only NaNs, sign kept
    } else {
      CHECK(static_cast<double>(v4) == reference_value(b, 4, 3));
      CHECK(std::signbit(v4) == ((b & 0x80) != 0));
      CHECK(float8_e4m3(v4).bits == b);
    }
    const float v5 = float8_e5m2::from_bits(b);
    if (is_nan_e5m2(b)) {
      CHECK(std::isnan(v5));
      CHECK(is_nan_e5m2(float8_e5m2(v5).bits));
      CHECK((float8_e5m2(v5).bits & 0x80) == (b & 0x80));
    } else if ((b & 0x7f) == 0x7c) {
      CHECK(v5 == ((b & 0x80) ? -inf : inf));
      CHECK(float8_e5m2(v5).bits == b);
    } else {
      CHECK(static_cast<double>(v5) == reference_value(b, 5, 2));
      CHECK(std::signbit(v5) == ((b & 0x80) != 0));
      CHECK(float8_e5m2(v5).bits == b);
    }
  }
  // Positive patterns are ordered like their values.
  for (int b = 1; b < 0x7f; ++b) {
    CHECK(float(float8_e4m3::from_bits(static_cast<std::uint8_t>(b - 1))) <
          float(float8_e4m3::from_bits(static_cast<std::uint8_t>(b))));
  }
  for (int b = 1; b <= 0x7c; ++b) {
    CHECK(float(float8_e5m2::from_bits(static_cast<std::uint8_t>(b - 1))) <
          float(float8_e5m2::from_bits(static_cast<std::uint8_t>(b))));
  }
}

TEST_CASE("float -> float8_e4m3 on hand-checked values", "[element_type][fp8]") {
  const Case cases[] = {
      {0.0f, 0x00, "zero"},
      {-0.0f, 0x80, "negative zero"},
      {1.0f, 0x38, "one: 0.0111.000"},
      {-2.0f, 0xc0, "minus two"},
      {1.0625f, 0x38, "tie between 1 and 1.125: even (1)"},
      {1.1875f, 0x3a, "tie between 1.125 and 1.25: even (1.25)"},
      {1.07f, 0x39, "above the tie: 1.125"},
      {0.1f, 0x1d, "0.1 -> 0.1015625"},
      {300.0f, 0x79, "300 -> 288"},
      {448.0f, 0x7e, "max"},
      {-448.0f, 0xfe, "-max"},
      {460.0f, 0x7e, "below the tie with 480: 448"},
      {464.0f, 0x7e, "tie between 448 and 480 (the NaN pattern): even (448)"},
      {464.5f, 0x7f, "rounds to 480, which is NaN: no saturation, as PyTorch"},
      {480.0f, 0x7f, "480: NaN"},
      {1e9f, 0x7f, "far out of range: NaN"},
      {-1e9f, 0xff, "far out of range, negative: NaN with the sign"},
      {inf, 0x7f, "inf: NaN (no infinities)"},
      {-inf, 0xff, "-inf: NaN"},
      {qnan, 0x7f, "NaN"},
      {-qnan, 0xff, "-NaN keeps its sign"},
      {0x1p-6f, 0x08, "smallest normal"},
      {0x1p-9f, 0x01, "smallest subnormal"},
      {-0x1p-9f, 0x81, "smallest subnormal, negative"},
      {7 * 0x1p-9f, 0x07, "largest subnormal"},
      {7.5f * 0x1p-9f, 0x08, "tie between the largest subnormal and the smallest normal: even (normal)"},
      {0x1p-10f, 0x00, "half the smallest subnormal: tie, even (zero)"},
      {0x1.0002p-10f, 0x01, "just above half the smallest subnormal"},
      {3 * 0x1p-10f, 0x02, "1.5 subnormal units: tie, even (2)"},
      {5 * 0x1p-10f, 0x02, "2.5 subnormal units: tie, even (2)"},
      {1e-30f, 0x00, "tiny: zero"},
      {-1e-30f, 0x80, "tiny negative: negative zero"},
      {float_from_bits(1), 0x00, "float subnormal: zero"},
  };
  for (const Case& c : cases) {
    INFO(c.why << " (" << c.in << ")");
    CHECK(static_cast<int>(float8_e4m3(c.in).bits) == static_cast<int>(c.out));
  }
  CHECK(float(float8_e4m3::from_bits(0x78)) == 256.0f);
  CHECK(float(float8_e4m3::from_bits(0x01)) == 0x1p-9f);
  CHECK(std::isnan(float(float8_e4m3::from_bits(0xff))));
  const float negative_zero = float8_e4m3::from_bits(0x80);
  CHECK(negative_zero == 0.0f);
  CHECK(std::signbit(negative_zero));
}

TEST_CASE("float -> float8_e5m2 on hand-checked values", "[element_type][fp8]") {
  const Case cases[] = {
      {0.0f, 0x00, "zero"},
      {-0.0f, 0x80, "negative zero"},
      {1.0f, 0x3c, "one: 0.01111.00"},
      {1.125f, 0x3c, "tie between 1 and 1.25: even (1)"},
      {1.375f, 0x3e, "tie between 1.25 and 1.5: even (1.5)"},
      {1.2f, 0x3d, "nearest: 1.25"},
      {0.1f, 0x2e, "0.1 -> 0.09375"},
      {11.0f, 0x4a, "tie between 10 and 12: even (12)"},
      {57344.0f, 0x7b, "max"},
      {61439.0f, 0x7b, "below the tie with 2^16: max"},
      {61440.0f, 0x7c, "tie between max and 2^16: even (inf)"},
      {65536.0f, 0x7c, "2^16: inf"},
      {1e9f, 0x7c, "far out of range: inf"},
      {-1e9f, 0xfc, "-inf"},
      {inf, 0x7c, "inf"},
      {-inf, 0xfc, "-inf"},
      {qnan, 0x7f, "NaN"},
      {-qnan, 0xff, "-NaN keeps its sign"},
      {0x1p-14f, 0x04, "smallest normal"},
      {0x1p-16f, 0x01, "smallest subnormal"},
      {3 * 0x1p-16f, 0x03, "largest subnormal"},
      {3.5f * 0x1p-16f, 0x04, "tie between the largest subnormal and the smallest normal: even (normal)"},
      {0x1p-17f, 0x00, "half the smallest subnormal: tie, even (zero)"},
      {0x1.0002p-17f, 0x01, "just above half the smallest subnormal"},
      {3 * 0x1p-17f, 0x02, "1.5 subnormal units: tie, even (2)"},
      {1e-30f, 0x00, "tiny: zero"},
  };
  for (const Case& c : cases) {
    INFO(c.why << " (" << c.in << ")");
    CHECK(static_cast<int>(float8_e5m2(c.in).bits) == static_cast<int>(c.out));
  }
  CHECK(float(float8_e5m2::from_bits(0x01)) == 0x1p-16f);
  CHECK(float(float8_e5m2::from_bits(0xfc)) == -inf);
  CHECK(std::isnan(float(float8_e5m2::from_bits(0x7d))));
  CHECK(std::isnan(float(float8_e5m2::from_bits(0xfe))));
}

TEST_CASE("float -> fp8 matches a nearest-value search over a sweep of float bit patterns",
          "[element_type][fp8]") {
  const SearchReference e4m3 = e4m3_reference();
  const SearchReference e5m2 = e5m2_reference();
  int wrong4 = 0;
  int wrong5 = 0;
  auto check = [&](float f) {
    if (float8_e4m3(f).bits != e4m3(f) && ++wrong4 <= 5) {
      FAIL_CHECK("e4m3 of " << f << ": got 0x" << std::hex << int(float8_e4m3(f).bits) << ", expected 0x"
                            << int(e4m3(f)));
    }
    if (float8_e5m2(f).bits != e5m2(f) && ++wrong5 <= 5) {
      FAIL_CHECK("e5m2 of " << f << ": got 0x" << std::hex << int(float8_e5m2(f).bits) << ", expected 0x"
                            << int(e5m2(f)));
    }
  };
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4093) {
    check(float_from_bits(static_cast<std::uint32_t>(u)));
  }
  // Every float whose value lies in the fp8 range, at 1/64 of fp8's resolution: all ties and midpoints.
  for (int i = 0; i < 0x7f; ++i) {
    const double lo = reference_value(static_cast<std::uint8_t>(i), 4, 3);
    const double hi = i + 1 < 0x7f ? reference_value(static_cast<std::uint8_t>(i + 1), 4, 3) : 480.0;
    for (int k = 0; k <= 64; ++k) {
      check(static_cast<float>(lo + (hi - lo) * k / 64));
      check(-static_cast<float>(lo + (hi - lo) * k / 64));
    }
  }
  for (int i = 0; i < 0x7c; ++i) {
    const double lo = reference_value(static_cast<std::uint8_t>(i), 5, 2);
    const double hi = i + 1 < 0x7c ? reference_value(static_cast<std::uint8_t>(i + 1), 5, 2) : 65536.0;
    for (int k = 0; k <= 64; ++k) {
      check(static_cast<float>(lo + (hi - lo) * k / 64));
      check(-static_cast<float>(lo + (hi - lo) * k / 64));
    }
  }
  CHECK(wrong4 == 0);
  CHECK(wrong5 == 0);
}

TEMPLATE_TEST_CASE("fp8 computes through float", "[element_type][fp8]", float8_e4m3, float8_e5m2) {
  TestType a = 1.5f;
  const TestType b = 2.0f;
  CHECK(a + b == 3.5f);
  CHECK(a - b == -0.5f);
  CHECK(a * b == 3.0f);
  CHECK(-a == -1.5f);
  CHECK(a < b);
  CHECK(a == TestType(1.5f));
  CHECK(a != b);
  a += b;
  CHECK(a == 3.5f);
  a *= 2;
  CHECK(a == 7.0f);
  a -= 1.0f;
  CHECK(a == 6.0f);
  a /= 4;
  CHECK(a == 1.5f);
  const TestType from_int = 3;
  CHECK(static_cast<float>(from_int) == 3.0f);
  const TestType n = qnan;
  CHECK_FALSE(n == n);
}

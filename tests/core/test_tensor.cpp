// Local tensors: Device, element types (bfloat16/half conversions), Tensor<T, Rank> layout, views,
// copies, fills, from_blob/from_values, equality and printing; meta tensors (shapes without data). Host
// only; see test_tensor_cuda.cu.

#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/core/tensor_io.hpp"

using Catch::Contains;
using dtensor::bfloat16;
using dtensor::Device;
using dtensor::DType;
using dtensor::half;
using dtensor::Tensor;

namespace {

/// The message of the dtensor::Error `f` throws (other exceptions propagate and fail the test).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const dtensor::Error& e) {
    return e.what();
  }
  return "<no dtensor::Error thrown>";
}

float float_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

/// 0, 1, 2, ... in row-major order.
template <class T, int Rank>
Tensor<T, Rank> iota(std::array<std::int64_t, Rank> shape) {
  Tensor<T, Rank> t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = static_cast<T>(static_cast<float>(i));
  }
  return t;
}

} // namespace

TEST_CASE("Device values and names", "[device]") {
  STATIC_REQUIRE(Device{} == Device::cpu());
  STATIC_REQUIRE(Device::cuda() == Device::cuda(0));
  STATIC_REQUIRE(Device::cuda(1) != Device::cuda(0));
  STATIC_REQUIRE(Device::cpu() != Device::cuda(0));
  STATIC_REQUIRE(Device::cpu().is_cpu() && !Device::cpu().is_cuda());
  STATIC_REQUIRE(Device::cuda(3).is_cuda() && Device::cuda(3).index == 3);
  CHECK(Device::cpu().to_string() == "cpu");
  CHECK(Device::cuda().to_string() == "cuda:0");
  CHECK(Device::cuda(7).to_string() == "cuda:7");
  std::ostringstream os;
  os << Device::cuda(2) << ' ' << DType::bfloat16;
  CHECK(os.str() == "cuda:2 bfloat16");
}

TEST_CASE("DType tags, sizes and names", "[dtype]") {
  STATIC_REQUIRE(dtensor::dtype_v<float> == DType::float32);
  STATIC_REQUIRE(dtensor::dtype_v<double> == DType::float64);
  STATIC_REQUIRE(dtensor::dtype_v<bfloat16> == DType::bfloat16);
  STATIC_REQUIRE(dtensor::dtype_v<half> == DType::float16);
  STATIC_REQUIRE(dtensor::dtype_v<std::int32_t> == DType::int32);
  STATIC_REQUIRE(dtensor::dtype_v<std::int64_t> == DType::int64);
  STATIC_REQUIRE(dtensor::dtype_v<std::uint8_t> == DType::uint8);
  STATIC_REQUIRE(std::is_same_v<dtensor::element_type_t<DType::float16>, half>);
  STATIC_REQUIRE(std::is_same_v<dtensor::element_type_t<DType::int64>, std::int64_t>);

  STATIC_REQUIRE(dtensor::Element<float>);
  STATIC_REQUIRE(dtensor::Element<bfloat16>);
  STATIC_REQUIRE(dtensor::Element<std::uint8_t>);
  STATIC_REQUIRE_FALSE(dtensor::Element<std::int16_t>);
  STATIC_REQUIRE_FALSE(dtensor::Element<bool>);
  STATIC_REQUIRE_FALSE(dtensor::Element<const float>);
  STATIC_REQUIRE_FALSE(dtensor::Element<std::uint32_t>);

  STATIC_REQUIRE(dtensor::dtype_size(DType::float32) == 4);
  STATIC_REQUIRE(dtensor::dtype_size(DType::float64) == 8);
  STATIC_REQUIRE(dtensor::dtype_size(DType::bfloat16) == 2);
  STATIC_REQUIRE(dtensor::dtype_size(DType::float16) == 2);
  STATIC_REQUIRE(dtensor::dtype_size(DType::int32) == 4);
  STATIC_REQUIRE(dtensor::dtype_size(DType::int64) == 8);
  STATIC_REQUIRE(dtensor::dtype_size(DType::uint8) == 1);

  STATIC_REQUIRE(dtensor::dtype_name(DType::float32) == "float32");
  STATIC_REQUIRE(dtensor::dtype_name(DType::float64) == "float64");
  STATIC_REQUIRE(dtensor::dtype_name(DType::bfloat16) == "bfloat16");
  STATIC_REQUIRE(dtensor::dtype_name(DType::float16) == "float16");
  STATIC_REQUIRE(dtensor::dtype_name(DType::int32) == "int32");
  STATIC_REQUIRE(dtensor::dtype_name(DType::int64) == "int64");
  STATIC_REQUIRE(dtensor::dtype_name(DType::uint8) == "uint8");
}

// ---- bfloat16 / half ------------------------------------------------------------------------------

namespace {

struct Case {
  std::uint32_t in; // float bits
  std::uint16_t out;
  const char* why;
};

// Hand-checked float -> bfloat16 results (bfloat16 = top 16 bits of a float, 7 mantissa bits).
constexpr Case bfloat16_cases[] = {
    {0x00000000, 0x0000, "+0"},
    {0x80000000, 0x8000, "-0"},
    {0x3f800000, 0x3f80, "1"},
    {0xc0000000, 0xc000, "-2"},
    {0x40490000, 0x4049, "3.140625, exact"},
    {0x3f807fff, 0x3f80, "1 + just under half an ulp: down"},
    {0x3f808000, 0x3f80, "1 + half an ulp: tie, to even (down)"},
    {0x3f808001, 0x3f81, "1 + just over half an ulp: up"},
    {0x3f818000, 0x3f82, "1 + 3 half ulps: tie, to even (up)"},
    {0xbf818000, 0xbf82, "negative tie, to even (up in magnitude)"},
    {0x3dcccccd, 0x3dcd, "0.1f rounds up"},
    {0x7f7f0000, 0x7f7f, "largest bfloat16, exact"},
    {0x7f7f7fff, 0x7f7f, "below the overflow tie"},
    {0x7f7f8000, 0x7f80, "overflow tie: to even, inf"},
    {0x7f7fffff, 0x7f80, "largest float overflows to inf"},
    {0xff7fffff, 0xff80, "-largest float overflows to -inf"},
    {0x7f800000, 0x7f80, "inf"},
    {0xff800000, 0xff80, "-inf"},
    {0x00800000, 0x0080, "smallest normal float, exact"},
    {0x00000001, 0x0000, "smallest subnormal float rounds to 0"},
    {0x00008000, 0x0000, "subnormal tie, to even (0)"},
    {0x00018000, 0x0002, "subnormal tie, to even (2)"},
    {0x80000001, 0x8000, "tiny negative rounds to -0"},
};

// Hand-checked float -> half results (1 sign, 5 exponent, 10 mantissa bits; subnormal unit 2^-24).
constexpr Case half_cases[] = {
    {0x00000000, 0x0000, "+0"},
    {0x80000000, 0x8000, "-0"},
    {0x3f800000, 0x3c00, "1"},
    {0xc0000000, 0xc000, "-2"},
    {0x3f000000, 0x3800, "0.5"},
    {0x3dcccccd, 0x2e66, "0.1f rounds down to 0.0999755859375"},
    {0x3f801000, 0x3c00, "1 + 2^-11: tie, to even (down)"},
    {0x3f803000, 0x3c02, "1 + 3*2^-11: tie, to even (up)"},
    {0x3f801001, 0x3c01, "1 + just over half an ulp: up"},
    {0x44803000, 0x6402, "1025.5: tie, to even 1026"},
    {0x477fe000, 0x7bff, "65504, largest half"},
    {0x477fefff, 0x7bff, "just under the overflow tie"},
    {0x477ff000, 0x7c00, "65520, overflow tie: to even, inf"},
    {0x47800000, 0x7c00, "65536 overflows"},
    {0x49742400, 0x7c00, "1e6 overflows"},
    {0xc9742400, 0xfc00, "-1e6 overflows to -inf"},
    {0x7f7fffff, 0x7c00, "largest float overflows"},
    {0x7f800000, 0x7c00, "inf"},
    {0xff800000, 0xfc00, "-inf"},
    {0x38800000, 0x0400, "2^-14, smallest normal"},
    {0x387fc000, 0x03ff, "1023 * 2^-24, largest subnormal"},
    {0x387fe000, 0x0400, "1023.5 * 2^-24: tie, to even (smallest normal)"},
    {0x33800000, 0x0001, "2^-24, smallest subnormal"},
    {0x33000000, 0x0000, "2^-25: tie, to even (0)"},
    {0x33000001, 0x0001, "just over 2^-25: up"},
    {0x33400000, 0x0001, "1.5 * 2^-25: up"},
    {0x33c00000, 0x0002, "1.5 * 2^-24: tie, to even (2)"},
    {0x34400000, 0x0003, "3 * 2^-24, exact"},
    {0x34200000, 0x0002, "2.5 * 2^-24: tie, to even (2)"},
    {0x34600000, 0x0004, "3.5 * 2^-24: tie, to even (4)"},
    {0xb3c00000, 0x8002, "-1.5 * 2^-24: tie, to even (-2)"},
    {0x32800000, 0x0000, "2^-26 rounds to 0"},
    {0x00000001, 0x0000, "smallest float subnormal rounds to 0"},
    {0x80000001, 0x8000, "tiny negative rounds to -0"},
};

bool is_nan_bfloat16(std::uint16_t b) {
  return (b & 0x7f80) == 0x7f80 && (b & 0x007f) != 0;
}
bool is_nan_half(std::uint16_t h) {
  return (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
}

/// Reference float -> bfloat16: the nearer of the two neighbours, ties to even, computed in double
/// (where the neighbours and the distances are exact); 0x7f80 stands for 2^128 when rounding.
std::uint16_t reference_bfloat16(float f) {
  const std::uint32_t u = bits_of(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000);
  const std::uint16_t lo = static_cast<std::uint16_t>((u & 0x7fffffff) >> 16);
  const auto value = [](std::uint16_t m) {
    return m == 0x7f80 ? std::ldexp(1.0, 128) : static_cast<double>(float_from_bits(std::uint32_t{m} << 16));
  };
  const double x = std::fabs(static_cast<double>(f));
  const double down = x - value(lo);
  const double up = value(static_cast<std::uint16_t>(lo + 1)) - x;
  const bool round_up = up < down || (up == down && (lo & 1) != 0);
  return static_cast<std::uint16_t>(sign | (round_up ? lo + 1 : lo));
}

} // namespace

TEST_CASE("bfloat16 conversions", "[element_type][bfloat16]") {
  STATIC_REQUIRE(sizeof(bfloat16) == 2);
  STATIC_REQUIRE(std::is_trivially_copyable_v<bfloat16>);
  STATIC_REQUIRE(bfloat16(1.0f).bits == 0x3f80); // constexpr both ways
  STATIC_REQUIRE(static_cast<float>(bfloat16::from_bits(0x4049)) == 3.140625f);

  for (const Case& c : bfloat16_cases) {
    INFO(c.why << ": float bits 0x" << std::hex << c.in);
    CHECK(bfloat16(float_from_bits(c.in)).bits == c.out);
  }

  SECTION("NaN stays NaN, even with a payload only in the low bits") {
    for (std::uint32_t in : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fffffffu, 0xff800001u}) {
      INFO("float bits 0x" << std::hex << in);
      const bfloat16 b = float_from_bits(in);
      CHECK(is_nan_bfloat16(b.bits));
      CHECK((b.bits & 0x8000) == ((in >> 16) & 0x8000));
      CHECK(std::isnan(static_cast<float>(b)));
    }
  }

  SECTION("every bfloat16 converts to float and back exactly") {
    for (std::uint32_t b = 0; b <= 0xffff; ++b) {
      const auto bits = static_cast<std::uint16_t>(b);
      const float f = bfloat16::from_bits(bits);
      CHECK(bits_of(f) == (b << 16)); // bfloat16 -> float is exact: the top half of the float
      if (is_nan_bfloat16(bits)) {
        CHECK(is_nan_bfloat16(bfloat16(f).bits));
      } else if (bfloat16(f).bits != bits) {
        FAIL("round trip of 0x" << std::hex << b);
      }
    }
  }

  SECTION("matches a double-precision reference over a sweep of float bit patterns") {
    int mismatches = 0;
    for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
      const float f = float_from_bits(static_cast<std::uint32_t>(u));
      if (std::isnan(f) || std::isinf(f)) {
        continue;
      }
      if (bfloat16(f).bits != reference_bfloat16(f) && ++mismatches <= 5) {
        FAIL_CHECK("float bits 0x" << std::hex << u << ": got 0x" << bfloat16(f).bits << ", expected 0x"
                                   << reference_bfloat16(f));
      }
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("half conversions", "[element_type][half]") {
  STATIC_REQUIRE(sizeof(half) == 2);
  STATIC_REQUIRE(std::is_trivially_copyable_v<half>);
  STATIC_REQUIRE(half(1.0f).bits == 0x3c00);
  STATIC_REQUIRE(static_cast<float>(half::from_bits(0x0001)) == 0x1p-24f);

  for (const Case& c : half_cases) {
    INFO(c.why << ": float bits 0x" << std::hex << c.in);
    CHECK(half(float_from_bits(c.in)).bits == c.out);
  }

  SECTION("half -> float on special values") {
    CHECK(static_cast<float>(half::from_bits(0x7bff)) == 65504.0f);
    CHECK(static_cast<float>(half::from_bits(0x0400)) == 0x1p-14f);
    CHECK(static_cast<float>(half::from_bits(0x03ff)) == 1023 * 0x1p-24f);
    CHECK(static_cast<float>(half::from_bits(0x8001)) == -0x1p-24f);
    CHECK(std::isinf(static_cast<float>(half::from_bits(0x7c00))));
    CHECK(static_cast<float>(half::from_bits(0xfc00)) == -std::numeric_limits<float>::infinity());
    CHECK(std::isnan(static_cast<float>(half::from_bits(0x7e00))));
    CHECK(std::isnan(static_cast<float>(half::from_bits(0x7c01))));
    const float negative_zero = half::from_bits(0x8000);
    CHECK(negative_zero == 0.0f);
    CHECK(std::signbit(negative_zero));
  }

  SECTION("NaN stays NaN, even with a payload only in the low bits") {
    for (std::uint32_t in : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fffffffu, 0xff800001u}) {
      INFO("float bits 0x" << std::hex << in);
      const half h = float_from_bits(in);
      CHECK(is_nan_half(h.bits));
      CHECK((h.bits & 0x8000) == ((in >> 16) & 0x8000));
    }
  }

  SECTION("every half converts to float and back exactly") {
    for (std::uint32_t b = 0; b <= 0xffff; ++b) {
      const auto bits = static_cast<std::uint16_t>(b);
      const float f = half::from_bits(bits);
      if (is_nan_half(bits)) {
        CHECK(std::isnan(f));
        CHECK(is_nan_half(half(f).bits));
      } else if (half(f).bits != bits) {
        FAIL("round trip of 0x" << std::hex << b);
      }
    }
  }

#if defined(__FLT16_MAX__)
  SECTION("matches the compiler's _Float16 over all halves and a sweep of float bit patterns") {
    for (std::uint32_t b = 0; b <= 0xffff; ++b) {
      const auto bits = static_cast<std::uint16_t>(b);
      _Float16 ref;
      std::memcpy(&ref, &bits, sizeof ref);
      const float mine = half::from_bits(bits);
      if (!is_nan_half(bits) && bits_of(mine) != bits_of(static_cast<float>(ref))) {
        FAIL("half -> float of 0x" << std::hex << b);
      }
    }
    int mismatches = 0;
    for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
      const float f = float_from_bits(static_cast<std::uint32_t>(u));
      if (std::isnan(f)) {
        continue;
      }
      const _Float16 ref = static_cast<_Float16>(f);
      std::uint16_t ref_bits;
      std::memcpy(&ref_bits, &ref, sizeof ref_bits);
      if (half(f).bits != ref_bits && ++mismatches <= 5) {
        FAIL_CHECK("float bits 0x" << std::hex << u << ": got 0x" << half(f).bits << ", expected 0x"
                                   << ref_bits);
      }
    }
    CHECK(mismatches == 0);
  }
#endif
}

TEMPLATE_TEST_CASE("16-bit floats compute through float", "[element_type]", bfloat16, half) {
  TestType a = 1.5f;
  const TestType b = 2.0f;
  CHECK(a + b == 3.5f);
  CHECK(a - b == -0.5f);
  CHECK(a * b == 3.0f);
  CHECK(b / a == Approx(4.0f / 3.0f).epsilon(1e-2));
  CHECK(-a == -1.5f);
  CHECK(a < b);
  CHECK(b > a);
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
  const TestType c = a * b; // float result converts back implicitly
  CHECK(c.bits == TestType(3.0f).bits);
  const TestType from_int = 3;
  CHECK(static_cast<float>(from_int) == 3.0f);
  const TestType nan = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(nan == nan);
  std::ostringstream os;
  os << TestType(2.5f);
  CHECK(os.str() == "2.5");
}

// ---- Tensor layout ----------------------------------------------------------------------------------

TEST_CASE("shapes, strides and numel for ranks 0 to 4", "[tensor]") {
  STATIC_REQUIRE(Tensor<float, 3>::rank == 3);
  STATIC_REQUIRE(std::is_same_v<Tensor<half, 2>::value_type, half>);
  STATIC_REQUIRE(std::is_same_v<Tensor<float, 2>::Shape, std::array<std::int64_t, 2>>);
  STATIC_REQUIRE(Tensor<bfloat16, 1>::dtype() == DType::bfloat16);

  SECTION("rank 0 is a scalar") {
    Tensor<float, 0> s(Tensor<float, 0>::Shape{}); // ({}) would be ambiguous with the copy constructor
    CHECK(s.defined());
    CHECK(s.numel() == 1);
    CHECK(s.nbytes() == sizeof(float));
    CHECK(s.is_contiguous());
    s() = 2.5f;
    CHECK(s.item() == 2.5f);
    CHECK(Tensor<double, 0>::full({}, 4.0)() == 4.0);
    CHECK_THAT(error_of([&] { (void)s.shape(0); }), Contains("dim 0 is out of range for a rank-0 tensor"));
  }
  SECTION("rank 1") {
    auto t = Tensor<float, 1>::zeros({5});
    CHECK(t.shape() == std::array<std::int64_t, 1>{5});
    CHECK(t.strides() == std::array<std::int64_t, 1>{1});
    CHECK(t.numel() == 5);
    CHECK(t.shape(0) == 5);
    CHECK(t.shape(-1) == 5);
  }
  SECTION("rank 2") {
    auto t = Tensor<double, 2>::empty({2, 3});
    CHECK(t.strides() == std::array<std::int64_t, 2>{3, 1});
    CHECK(t.numel() == 6);
    CHECK(t.nbytes() == 48);
    CHECK(t.shape(-2) == 2);
    CHECK(t.device() == Device::cpu());
    CHECK_THAT(error_of([&] { (void)t.shape(2); }), Contains("dim 2 is out of range for a rank-2 tensor"));
    CHECK_THAT(error_of([&] { (void)t.shape(-3); }), Contains("-2 <= dim < 2"));
  }
  SECTION("rank 3") {
    Tensor<std::int32_t, 3> t({2, 3, 4});
    CHECK(t.strides() == std::array<std::int64_t, 3>{12, 4, 1});
    CHECK(t.numel() == 24);
    CHECK(t.shape(1) == 3);
  }
  SECTION("rank 4") {
    Tensor<half, 4> t({2, 1, 3, 2});
    CHECK(t.strides() == std::array<std::int64_t, 4>{6, 6, 2, 1});
    CHECK(t.numel() == 12);
    CHECK(t.nbytes() == 24);
    CHECK(t.is_contiguous());
  }
  SECTION("host memory is 64-byte aligned") {
    for (std::int64_t n : {1, 3, 17, 1000}) {
      Tensor<std::uint8_t, 1> t({n});
      CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
    }
  }
  SECTION("undefined tensors") {
    Tensor<float, 2> u;
    CHECK_FALSE(u.defined());
    CHECK(u.numel() == 0);
    CHECK(u.nbytes() == 0);
    CHECK(u.data() == nullptr);
    CHECK_FALSE(u.clone().defined());
    Tensor<float, 0> u0;
    CHECK(u0.numel() == 0);
    CHECK_FALSE(u0.defined());
  }
  SECTION("negative sizes are rejected") {
    CHECK_THAT(error_of([] { Tensor<float, 2>({2, -1}); }), Contains("negative size -1 in dim 1"));
  }
  SECTION("copies of a tensor share memory") {
    auto a = Tensor<int, 1>::zeros({3});
    auto b = a;
    b(1) = 5;
    CHECK(a(1) == 5);
    CHECK(a.storage() == b.storage());
  }
}

TEST_CASE("zero-size dims", "[tensor]") {
  auto a = Tensor<float, 2>::zeros({0, 3});
  CHECK(a.defined());
  CHECK(a.numel() == 0);
  CHECK(a.nbytes() == 0);
  CHECK(a.strides() == std::array<std::int64_t, 2>{3, 1});
  CHECK(a.is_contiguous());
  a.fill(1.0f);
  CHECK(a.clone().numel() == 0);
  CHECK(dtensor::equal(a, a.clone()));
  CHECK(a.narrow(0, 0, 0).numel() == 0);
  CHECK(dtensor::to_string(a) == "Tensor(float32, [0, 3], cpu) []");

  auto b = iota<float, 2>({3, 4});
  auto e = b.narrow(1, 4, 0); // empty view at the end
  CHECK(e.shape() == std::array<std::int64_t, 2>{3, 0});
  CHECK(e.numel() == 0);
  CHECK(e.is_contiguous());
  CHECK(dtensor::to_string(e.narrow(0, 1, 2)) == "Tensor(float32, [2, 0], cpu) [[], []]");
  CHECK(e.view<1>({0}).numel() == 0);
  CHECK(e.view<3>({0, 5, 7}).numel() == 0);
  auto c = Tensor<float, 2>::zeros({3, 0});
  c.copy_from(e);
  CHECK(Tensor<int, 1>::from_values({0}, {}).numel() == 0);
}

TEST_CASE("narrow gives views that share memory", "[tensor][narrow]") {
  auto a = iota<float, 2>({3, 4}); // [[0 1 2 3] [4 5 6 7] [8 9 10 11]]

  SECTION("along a non-leading dim: non-contiguous") {
    auto b = a.narrow(1, 1, 2);
    CHECK(b.shape() == std::array<std::int64_t, 2>{3, 2});
    CHECK(b.strides() == std::array<std::int64_t, 2>{4, 1});
    CHECK(b.numel() == 6);
    CHECK_FALSE(b.is_contiguous());
    CHECK(b.data() == a.data() + 1);
    CHECK(b(2, 1) == 10.0f);
    b(0, 0) = 100.0f;
    CHECK(a(0, 1) == 100.0f);
    CHECK(b.storage() == a.storage());
  }
  SECTION("along the leading dim: contiguous") {
    auto b = a.narrow(0, 1, 2);
    CHECK(b.is_contiguous());
    CHECK(b.data() == a.data() + 4);
    CHECK(b(1, 3) == 11.0f);
  }
  SECTION("negative dims count from the end; narrows compose") {
    auto b = a.narrow(-1, 3, 1);
    CHECK(b.shape() == std::array<std::int64_t, 2>{3, 1});
    CHECK_FALSE(b.is_contiguous()); // rows are 4 apart
    CHECK(b(2, 0) == 11.0f);
    auto c = a.narrow(1, 1, 3).narrow(1, 1, 2).narrow(0, 1, 1);
    CHECK(c.shape() == std::array<std::int64_t, 2>{1, 2});
    CHECK(c(0, 0) == 6.0f);
    CHECK(c(0, 1) == 7.0f);
    CHECK(c.is_contiguous()); // one row of adjacent elements
  }
  SECTION("rank 3, middle dim") {
    auto t = iota<int, 3>({2, 3, 4});
    auto v = t.narrow(1, 2, 1);
    CHECK(v.shape() == std::array<std::int64_t, 3>{2, 1, 4});
    CHECK(v.is_contiguous() == false);
    CHECK(v(1, 0, 3) == 12 + 8 + 3);
  }
  SECTION("errors name dim, start, length and size") {
    const std::string out = error_of([&] { (void)a.narrow(1, 3, 2); });
    CHECK_THAT(out, Contains("dim=1") && Contains("start=3") && Contains("length=2") && Contains("size 4"));
    CHECK_THAT(out, Contains("[3, 4]"));
    CHECK_THAT(error_of([&] { (void)a.narrow(0, -1, 1); }), Contains("start=-1"));
    CHECK_THAT(error_of([&] { (void)a.narrow(0, 0, -1); }), Contains("length=-1"));
    CHECK_THAT(error_of([&] { (void)a.narrow(0, 4, 0); }), Contains("size 3"));
    CHECK_THAT(error_of([&] { (void)a.narrow(2, 0, 1); }),
               Contains("dim 2 is out of range for a rank-2 tensor"));
    CHECK_THAT(error_of([&] { (void)a.narrow(-3, 0, 1); }), Contains("dim -3 is out of range"));
  }
}

TEST_CASE("view and reshape", "[tensor][view]") {
  auto a = iota<float, 2>({2, 6});
  SECTION("views share memory") {
    auto v = a.view<3>({2, 3, 2});
    CHECK(v.strides() == std::array<std::int64_t, 3>{6, 2, 1});
    CHECK(v.data() == a.data());
    CHECK(v(1, 2, 1) == 11.0f);
    v(0, 0, 1) = -1.0f;
    CHECK(a(0, 1) == -1.0f);
    auto flat = a.view<1>({-1});
    CHECK(flat.shape() == std::array<std::int64_t, 1>{12});
    CHECK(a.view<2>({-1, 4}).shape() == std::array<std::int64_t, 2>{3, 4});
    auto one = a.narrow(1, 5, 1).narrow(0, 1, 1);
    CHECK(one.view<0>({})() == 11.0f);
  }
  SECTION("errors") {
    CHECK_THAT(error_of([&] {
                 (void)a.view<2>({5, 2});
               }),
               Contains("has 10 elements but the tensor has 12") && Contains("[2, 6]"));
    CHECK_THAT(error_of([&] { (void)a.view<2>({-1, -1}); }), Contains("only one size may be -1"));
    CHECK_THAT(error_of([&] { (void)a.view<2>({-1, 5}); }), Contains("cannot infer"));
    CHECK_THAT(error_of([&] { (void)a.view<2>({-2, -6}); }), Contains("sizes must be >= 0"));
    CHECK_THAT(error_of([&] { (void)a.narrow(1, 0, 3).view<1>({6}); }),
               Contains("not contiguous") && Contains("strides [6, 1]"));
  }
  SECTION("reshape copies a non-contiguous tensor") {
    auto r = a.narrow(1, 0, 3).reshape<1>({6});
    CHECK(dtensor::equal(r, Tensor<float, 1>::from_values({6}, {0, 1, 2, 6, 7, 8})));
    CHECK(r.data() != a.data());
    CHECK(a.reshape<2>({3, 4}).data() == a.data());
    CHECK_THAT(error_of([&] { (void)a.narrow(1, 0, 3).reshape<1>({7}); }), Contains("has 7 elements"));
  }
}

TEST_CASE("copy_from between strided views", "[tensor][copy]") {
  SECTION("into a view of a view") {
    auto src = iota<int, 2>({4, 5});
    auto dst = Tensor<int, 2>::zeros({4, 6});
    dst.narrow(1, 2, 3).copy_from(src.narrow(1, 1, 3));
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 6; ++j) {
        INFO(i << ", " << j);
        CHECK(dst(i, j) == (j >= 2 && j < 5 ? src(i, j - 1) : 0));
      }
    }
  }
  SECTION("rank 3, different strides on each side") {
    auto src = iota<double, 3>({2, 3, 4});
    auto dst = Tensor<double, 3>::full({3, 2, 5}, -1.0);
    auto s = src.narrow(1, 1, 2).narrow(2, 0, 3); // (2, 2, 3), strides (12, 4, 1)
    auto d = dst.narrow(0, 1, 2).narrow(2, 2, 3); // (2, 2, 3), strides (10, 5, 1)
    d.copy_from(s);
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 2; ++j) {
        for (int k = 0; k < 3; ++k) {
          CHECK(d(i, j, k) == s(i, j, k));
        }
      }
    }
    CHECK(dst(0, 0, 0) == -1.0);
    CHECK(dst(1, 0, 1) == -1.0);
    CHECK(dtensor::equal(d, s));
  }
  SECTION("transposed and broadcast sources from from_blob") {
    std::array<float, 6> data{0, 1, 2, 3, 4, 5}; // (2, 3) row-major
    auto transposed = Tensor<float, 2>::from_blob(data.data(), {3, 2}, {1, 3}, Device::cpu());
    auto t = Tensor<float, 2>::zeros({3, 2});
    t.copy_from(transposed);
    CHECK(dtensor::equal(t, Tensor<float, 2>::from_values({3, 2}, {0, 3, 1, 4, 2, 5})));
    float v = 7.0f;
    auto broadcast = Tensor<float, 2>::from_blob(&v, {2, 3}, {0, 0});
    auto b = Tensor<float, 2>::zeros({2, 3});
    b.copy_from(broadcast);
    CHECK(dtensor::equal(b, Tensor<float, 2>::full({2, 3}, 7.0f)));
  }
  SECTION("shape mismatch") {
    auto a = Tensor<float, 2>::zeros({2, 3});
    auto b = Tensor<float, 2>::zeros({3, 2});
    CHECK_THAT(error_of([&] { a.copy_from(b); }),
               Contains("shape mismatch") && Contains("destination [2, 3]") && Contains("source [3, 2]"));
  }
}

TEST_CASE("clone, contiguous and to(cpu)", "[tensor][copy]") {
  auto a = iota<float, 2>({3, 4});
  auto c = a.clone();
  CHECK(dtensor::equal(a, c));
  CHECK(c.data() != a.data());
  c(0, 0) = 99.0f;
  CHECK(a(0, 0) == 0.0f);

  auto view = a.narrow(1, 1, 2);
  auto vc = view.clone();
  CHECK(vc.is_contiguous());
  CHECK(vc.strides() == std::array<std::int64_t, 2>{2, 1});
  CHECK(dtensor::equal(vc, view));

  CHECK(a.contiguous().data() == a.data()); // already contiguous: the same memory, as in PyTorch
  auto made = view.contiguous();
  CHECK(made.data() != a.data());
  CHECK(made.is_contiguous());
  CHECK(dtensor::equal(made, view));

  auto h = a.to(Device::cpu()); // always a copy
  CHECK(h.data() != a.data());
  CHECK(dtensor::equal(h, a));
}

TEST_CASE("fill on views", "[tensor][fill]") {
  auto a = Tensor<int, 2>::zeros({3, 4});
  a.narrow(1, 1, 2).fill(7);
  CHECK(dtensor::equal(a, Tensor<int, 2>::from_values({3, 4}, {0, 7, 7, 0, 0, 7, 7, 0, 0, 7, 7, 0})));
  a.narrow(0, 2, 1).fill(-1);
  CHECK(dtensor::equal(a, Tensor<int, 2>::from_values({3, 4}, {0, 7, 7, 0, 0, 7, 7, 0, -1, -1, -1, -1})));

  auto t = Tensor<float, 3>::zeros({2, 3, 2});
  t.narrow(1, 1, 1).fill(5.0f);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) {
      for (int k = 0; k < 2; ++k) {
        CHECK(t(i, j, k) == (j == 1 ? 5.0f : 0.0f));
      }
    }
  }
  auto s = Tensor<double, 0>::empty({});
  s.fill(3.0);
  CHECK(s() == 3.0);
}

TEST_CASE("from_blob wraps memory without owning it", "[tensor][from_blob]") {
  std::array<float, 6> buf{};
  auto t = Tensor<float, 2>::from_blob(buf.data(), {2, 3});
  CHECK(t.defined());
  CHECK(t.data() == buf.data());
  CHECK(t.is_contiguous());
  CHECK(t.storage() == nullptr);
  t(1, 2) = 5.0f;
  CHECK(buf[5] == 5.0f);
  t.fill(1.0f);
  CHECK(buf[0] == 1.0f);

  auto s = Tensor<float, 2>::from_blob(buf.data(), {2, 2}, {3, 2}, Device::cpu()); // columns 0 and 2
  CHECK_FALSE(s.is_contiguous());
  s.fill(9.0f);
  CHECK(buf == std::array<float, 6>{9, 1, 9, 9, 1, 9});

  CHECK_THAT(error_of([&] { (void)Tensor<float, 1>::from_blob(buf.data(), {-3}); }),
             Contains("negative size"));

  SECTION("a device pointer is carried without CUDA") {
    auto* fake = reinterpret_cast<float*>(std::uintptr_t{0x1000});
    auto d = Tensor<float, 1>::from_blob(fake, {4}, Device::cuda(1));
    CHECK(d.defined());
    CHECK(d.device() == Device::cuda(1));
    CHECK(d.data() == fake);
    CHECK(d.narrow(0, 1, 2).data() == fake + 1);
    CHECK_THAT(error_of([&] { (void)d(0); }), Contains("needs a host tensor") && Contains("cuda:1"));
#if !DTENSOR_HAS_CUDA
    CHECK_THAT(error_of([&] { (void)d.to(Device::cpu()); }), Contains("compiled without CUDA"));
    CHECK_THAT(error_of([&] { (void)d.clone(); }), Contains("compiled without CUDA"));
    CHECK_THAT(error_of([&] { d.fill(1.0f); }), Contains("compiled without CUDA"));
#endif
  }
}

TEST_CASE("from_values and element access", "[tensor]") {
  auto t = Tensor<std::int64_t, 2>::from_values({2, 3}, {1, 2, 3, 4, 5, 6});
  CHECK(t(0, 0) == 1);
  CHECK(t(1, 2) == 6);
  CHECK(t(std::size_t{1}, short{0}) == 4); // any integer types
  CHECK_THAT(error_of([] {
               (void)Tensor<float, 2>::from_values({2, 3}, {1, 2, 3, 4, 5});
             }),
             Contains("shape [2, 3] holds 6 elements but 5 values were given"));
  CHECK_THAT(error_of([] { (void)Tensor<float, 0>::from_values({}, {1, 2}); }), Contains("holds 1 elements"));
  CHECK_THAT(error_of([&] { (void)t(2, 0); }), Contains("index [2, 0] is out of bounds for shape [2, 3]"));
  CHECK_THAT(error_of([&] { (void)t(0, -1); }), Contains("out of bounds"));
  CHECK_THAT(error_of([&] { (void)t.item(); }), Contains("has 6 elements"));
  CHECK(t.narrow(0, 1, 1).narrow(1, 2, 1).item() == 6);
}

TEMPLATE_TEST_CASE("every element type", "[tensor][dtype]", float, double, bfloat16, half, std::int32_t,
                   std::int64_t, std::uint8_t, dtensor::float8_e4m3, dtensor::float8_e5m2) {
  using T = TestType;
  STATIC_REQUIRE(Tensor<T, 2>::dtype() == dtensor::dtype_v<T>);
  STATIC_REQUIRE(dtensor::dtype_size(dtensor::dtype_v<T>) == sizeof(T));
  const auto v = [](int i) { return static_cast<T>(static_cast<float>(i)); };

  auto z = Tensor<T, 2>::zeros({2, 3});
  CHECK(z.nbytes() == 6 * sizeof(T));
  for (std::int64_t i = 0; i < z.numel(); ++i) {
    CHECK(z.data()[i] == v(0));
  }
  auto f = Tensor<T, 2>::full({2, 3}, v(3));
  CHECK(f(1, 2) == v(3));

  auto a = Tensor<T, 2>::from_values({2, 3}, {v(1), v(2), v(3), v(4), v(5), v(6)});
  CHECK(a(1, 0) == v(4));
  auto c = a.clone();
  CHECK(dtensor::equal(a, c));
  c(0, 0) = v(9);
  CHECK_FALSE(dtensor::equal(a, c));
  CHECK(a(0, 0) == v(1));

  z.narrow(1, 1, 2).copy_from(a.narrow(1, 0, 2));
  CHECK(dtensor::equal(z, Tensor<T, 2>::from_values({2, 3}, {v(0), v(1), v(2), v(0), v(4), v(5)})));
  z.narrow(1, 0, 1).fill(v(7));
  CHECK(z(1, 0) == v(7));
  CHECK(z.narrow(1, 0, 1).narrow(0, 1, 1).item() == v(7));

  const std::string s = dtensor::to_string(a);
  CHECK_THAT(s, Contains(std::string(dtensor::dtype_name(dtensor::dtype_v<T>))) &&
                    Contains("[[1, 2, 3], [4, 5, 6]]"));
}

TEST_CASE("equal and to_string", "[tensor][io]") {
  auto a = Tensor<int, 2>::from_values({2, 2}, {1, 2, 3, 4});
  SECTION("equal compares shapes and values, not strides") {
    auto wide = iota<int, 2>({2, 4});
    auto view = wide.narrow(1, 1, 2); // [[1, 2], [5, 6]]
    CHECK_FALSE(dtensor::equal(a, view));
    wide(1, 1) = 3;
    wide(1, 2) = 4;
    CHECK(dtensor::equal(a, view));
    CHECK(dtensor::equal(view, a));
    CHECK_FALSE(dtensor::equal(a, Tensor<int, 2>::from_values({1, 4}, {1, 2, 3, 4})));
    auto nan = Tensor<float, 1>::full({2}, std::numeric_limits<float>::quiet_NaN());
    CHECK_FALSE(dtensor::equal(nan, nan));
    CHECK(dtensor::equal(Tensor<float, 2>{}, Tensor<float, 2>{}));
  }
  SECTION("to_string and operator<<") {
    CHECK(dtensor::to_string(a) == "Tensor(int32, [2, 2], cpu) [[1, 2], [3, 4]]");
    CHECK(dtensor::to_string(a.narrow(1, 1, 1)) == "Tensor(int32, [2, 1], cpu) [[2], [4]]");
    CHECK(dtensor::to_string(Tensor<float, 0>::full({}, 2.5f)) == "Tensor(float32, [], cpu) 2.5");
    CHECK(dtensor::to_string(Tensor<float, 3>{}) == "Tensor(float32, undefined)");
    CHECK(dtensor::to_string(Tensor<std::uint8_t, 1>::from_values({2}, {65, 200})) ==
          "Tensor(uint8, [2], cpu) [65, 200]");
    CHECK(dtensor::to_string(Tensor<bfloat16, 1>::from_values({2}, {1.5f, -0.25f})) ==
          "Tensor(bfloat16, [2], cpu) [1.5, -0.25]");
    std::ostringstream os;
    os << a;
    CHECK(os.str() == dtensor::to_string(a));
  }
  SECTION("long tensors are elided") {
    CHECK(dtensor::to_string(iota<int, 1>({64})).find("...") == std::string::npos);
    CHECK(dtensor::to_string(iota<int, 2>({8, 8})).find("...") == std::string::npos);
    CHECK(dtensor::to_string(iota<int, 1>({100})) == "Tensor(int32, [100], cpu) [0, 1, 2, ..., 97, 98, 99]");
    CHECK(dtensor::to_string(iota<int, 2>({10, 10}).narrow(1, 0, 7)) ==
          "Tensor(int32, [10, 7], cpu) [[0, 1, 2, ..., 4, 5, 6], [10, 11, 12, ..., 14, 15, 16], "
          "[20, 21, 22, ..., 24, 25, 26], ..., [70, 71, 72, ..., 74, 75, 76], [80, 81, 82, ..., 84, 85, 86], "
          "[90, 91, 92, ..., 94, 95, 96]]");
  }
}

TEST_CASE("a meta tensor has a shape, strides and addresses, and no data", "[tensor][meta]") {
  CHECK(Device::meta().is_meta());
  CHECK(!Device::meta().is_cpu());
  CHECK(!Device::meta().is_cuda());
  CHECK(Device::meta().to_string() == "meta");
  // 4 GiB of float64: addresses are reserved, nothing is held.
  const auto big = Tensor<double, 2>::zeros({1 << 16, 1 << 13}, Device::meta());
  CHECK(big.nbytes() == (std::size_t(1) << 32));
  CHECK(big.device() == Device::meta());
  CHECK(big.data() != nullptr);
  auto m = Tensor<float, 2>({4, 6}, Device::meta());
  CHECK(m.strides() == std::array<std::int64_t, 2>{6, 1});
  const auto other = Tensor<float, 2>({4, 6}, Device::meta());
  CHECK(other.data() != m.data());
  CHECK(other.storage() != m.storage());
  // Views keep their offsets, as on the host: pieces of one buffer are told apart by address.
  const auto cols = m.narrow(1, 2, 3);
  CHECK(cols.data() == m.data() + 2);
  CHECK(!cols.is_contiguous());
  CHECK(cols.storage() == m.storage());
  CHECK(m.view<1>({-1}).shape() == std::array<std::int64_t, 1>{24});
  // Copies are meta and new; copying or filling into a meta tensor is nothing to do.
  const auto c = cols.contiguous();
  CHECK(c.device().is_meta());
  CHECK(c.storage() != m.storage());
  CHECK(c.is_contiguous());
  const auto host = Tensor<float, 2>::full({4, 3}, 2.0f);
  const auto onto = host.to(Device::meta());
  CHECK(onto.device().is_meta());
  CHECK(onto.shape() == host.shape());
  Tensor<float, 2>(cols).copy_from(host);
  m.fill(1.0f);
  CHECK(host(3, 2) == 2.0f);
  // Reading is an error that says why; so is copying out.
  CHECK_THAT(error_of([&] { (void)m(0, 0); }),
             Contains("Tensor::operator()") && Contains("meta tensor") && Contains("[4, 6]"));
  CHECK_THAT(error_of([] { (void)Tensor<float, 0>::zeros({}, Device::meta()).item(); }),
             Contains("Tensor::item") && Contains("no data to read"));
  CHECK_THAT(error_of([&] { (void)cols.to(Device::cpu()); }), Contains("copy_from") && Contains("meta"));
  CHECK_THAT(error_of([&] { Tensor<float, 2>(host).copy_from(onto); }), Contains("meta tensor"));
  CHECK_THAT(error_of([&] { (void)dtensor::equal(host, onto); }), Contains("meta tensor"));
  // Printing gives the shape and the device, no values.
  CHECK(dtensor::to_string(m) == "Tensor(float32, [4, 6], meta)");
  // An empty meta tensor is a tensor like any other.
  const auto none = Tensor<float, 1>({0}, Device::meta());
  CHECK(none.defined());
  CHECK(none.numel() == 0);
}

#if !DTENSOR_HAS_CUDA
TEST_CASE("a CUDA tensor without CUDA throws", "[tensor][cuda]") {
  const auto message = error_of([] { Tensor<float, 1>({4}, Device::cuda(0)); });
  CHECK_THAT(message, Contains("cuda:0") && Contains("dtensor was compiled without CUDA"));
  CHECK_THAT(error_of([] {
               (void)Tensor<float, 2>::zeros({2, 2}, Device::cuda(1));
             }),
             Contains("cuda:1") && Contains("compiled without CUDA"));
  CHECK_THAT(error_of([] { (void)Tensor<int, 1>::empty({0}, Device::cuda()); }),
             Contains("compiled without CUDA"));
  CHECK_THAT(error_of([] { (void)Tensor<half, 1>::full({3}, 1.0f, Device::cuda()); }),
             Contains("compiled without CUDA"));
  CHECK_THAT(error_of([] { (void)Tensor<float, 1>::zeros({3}).to(Device::cuda()); }),
             Contains("compiled without CUDA"));
}
#endif

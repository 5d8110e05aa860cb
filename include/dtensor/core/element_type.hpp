#pragma once
// Element types: the 16-bit floats `bfloat16` and `half`, the 8-bit floats `float8_e4m3` and
// `float8_e5m2`, the `DType` tag, and the `Element` concept.
//
//   dtensor::bfloat16 b = 1.5f;             // round to nearest even; NaN stays NaN, overflow gives inf
//   float f = b * 2.0f;                      // arithmetic goes through float
//   dtensor::float8_e4m3 q = 300.0f;         // 288 (round to nearest even); 500.0f would give NaN
//   static_assert(dtensor::dtype_v<dtensor::half> == dtensor::DType::float16);
//   static_assert(dtensor::dtype_name(dtensor::DType::float8_e4m3) == "float8_e4m3fn");
//
// All four are trivially copyable structs holding the bit pattern in `bits`, so they have the size and
// layout of `__nv_bfloat16` / `__half` / `__nv_fp8_e4m3` / `__nv_fp8_e5m2` and of NCCL's ncclBfloat16 /
// ncclFloat16 / ncclFloat8e4m3 / ncclFloat8e5m2. Conversions are constexpr and usable in CUDA device code.
//
// The 8-bit floats follow the OCP 8-bit floating point spec (OFP8) and PyTorch's torch.float8_e4m3fn /
// torch.float8_e5m2, bit for bit, for float -> fp8 (round to nearest even, subnormals kept, sign kept):
//  - float8_e4m3 is E4M3 "fn" (finite): bias 7, no infinities, NaN = S.1111.111, max 448, smallest
//    subnormal 2^-9. Non-saturating like PyTorch: a value whose rounding exceeds 448 (|x| > 464), inf and
//    NaN all give NaN (sign kept). (CUDA's __nv_fp8_e4m3(float) saturates to 448 instead; convert with
//    std::clamp first for that behaviour.)
//  - float8_e5m2 is IEEE-like: bias 15, inf = S.11111.00, NaN = S.11111.{01,10,11}, max 57344, smallest
//    subnormal 2^-16. |x| >= 61440 (the tie between 57344 and 2^16, rounded to even) gives inf; NaN gives
//    S.11111.11. It is the top byte of an IEEE binary16.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "dtensor/core/config.hpp"
#include "dtensor/core/error.hpp"

namespace dtensor {
namespace detail {

DTENSOR_HOST_DEVICE constexpr std::uint32_t float_bits(float f) noexcept {
  return __builtin_bit_cast(std::uint32_t, f);
}
DTENSOR_HOST_DEVICE constexpr float bits_float(std::uint32_t u) noexcept {
  return __builtin_bit_cast(float, u);
}

/// `r` with its low `drop` bits rounded away, to nearest even (a carry into the exponent is what IEEE
/// rounding wants).
DTENSOR_HOST_DEVICE constexpr std::uint32_t round_bits_away(std::uint32_t r, int drop) noexcept {
  return (r + ((1u << (drop - 1)) - 1u) + ((r >> drop) & 1u)) >> drop;
}

/// A finite float below a narrower type's smallest normal (magnitude bits `a`, biased float exponent at
/// least base - 24) in units of that type's smallest subnormal, 2^(base - 150) (half: base 126, e5m2:
/// 134, e4m3: 141), rounded to nearest even. Rounding up may reach the smallest normal, whose encoding is
/// the same number.
DTENSOR_HOST_DEVICE constexpr std::uint32_t subnormal_units(std::uint32_t a, std::uint32_t base) noexcept {
  const std::uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = base - (a >> 23);
  std::uint32_t q = mantissa >> shift;
  const std::uint32_t rem = mantissa & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (q & 1u) != 0)) {
    ++q;
  }
  return q;
}

/// float -> bfloat16 bits, round to nearest even. NaN stays NaN (quietened, sign kept); values beyond
/// the largest bfloat16 round to inf as IEEE rounding says.
DTENSOR_HOST_DEVICE constexpr std::uint16_t float_to_bfloat16_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) { // NaN: truncating could turn a low-payload NaN into inf
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  return static_cast<std::uint16_t>(round_bits_away(u, 16));
}

DTENSOR_HOST_DEVICE constexpr float bfloat16_bits_to_float(std::uint16_t h) noexcept {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

/// float -> IEEE binary16 bits, round to nearest even, with subnormals. NaN stays NaN (quiet, sign
/// kept); |f| >= 65520 gives inf.
DTENSOR_HOST_DEVICE constexpr std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) { // NaN
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (a >= 0x477ff000u) { // >= 65520, the tie between 65504 and 2^16: rounds (to even) to inf
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  }
  if (a >= 0x38800000u) { // >= 2^-14: normal half; rebias the exponent (127 -> 15), round 13 bits away
    return static_cast<std::uint16_t>(sign | round_bits_away(a - 0x38000000u, 13));
  }
  const std::uint32_t exponent = a >> 23;
  if (exponent < 102) { // < 2^-25: rounds to zero
    return static_cast<std::uint16_t>(sign);
  }
  // Subnormal half (or the smallest normal, after rounding up): units of 2^-24.
  return static_cast<std::uint16_t>(sign | subnormal_units(a, 126));
}

DTENSOR_HOST_DEVICE constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) { // inf, NaN (payload kept)
    return bits_float(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) { // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/// float -> float8_e4m3 (E4M3FN) bits, as torch.float8_e4m3fn: round to nearest even, subnormals; a
/// value rounding beyond 448, inf and NaN give NaN (S.1111.111).
DTENSOR_HOST_DEVICE constexpr std::uint8_t float_to_e4m3_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a >= 0x43f00000u) { // >= 480 (S.1111.111 if it were a number), inf, NaN
    return static_cast<std::uint8_t>(sign | 0x7fu);
  }
  if (a >= 0x3c800000u) { // >= 2^-6: normal; rebias the exponent (127 -> 7), round 20 bits away. Values
                          // in (464, 480) round up to 0x7f, the NaN: non-saturating, as PyTorch.
    return static_cast<std::uint8_t>(sign | round_bits_away(a - (120u << 23), 20));
  }
  const std::uint32_t exponent = a >> 23;
  if (exponent < 117) { // < 2^-10, half the smallest subnormal: rounds to zero
    return sign;
  }
  // Subnormal (or the smallest normal, after rounding up): units of 2^-9.
  return static_cast<std::uint8_t>(sign | subnormal_units(a, 141));
}

DTENSOR_HOST_DEVICE constexpr float e4m3_bits_to_float(std::uint8_t b) noexcept {
  const std::uint32_t sign = (static_cast<std::uint32_t>(b) & 0x80u) << 24;
  const std::uint32_t exponent = (b >> 3) & 0xfu;
  const std::uint32_t mantissa = b & 0x7u;
  if ((b & 0x7fu) == 0x7fu) { // the only NaN (no infinities)
    return bits_float(sign | 0x7fc00000u);
  }
  if (exponent == 0) { // zero or subnormal: mantissa * 2^-9, exact in float
    const float magnitude = static_cast<float>(mantissa) * 0x1p-9f;
    return sign != 0 ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

/// float -> float8_e5m2 bits, as torch.float8_e5m2: round to nearest even, subnormals; |f| >= 61440
/// gives inf, NaN gives S.11111.11.
DTENSOR_HOST_DEVICE constexpr std::uint8_t float_to_e5m2_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) { // NaN
    return static_cast<std::uint8_t>(sign | 0x7fu);
  }
  if (a >= 0x47700000u) { // >= 61440, the tie between 57344 and 2^16: rounds (to even) to inf
    return static_cast<std::uint8_t>(sign | 0x7cu);
  }
  if (a >= 0x38800000u) { // >= 2^-14: normal; rebias the exponent (127 -> 15), round 21 bits away
    return static_cast<std::uint8_t>(sign | round_bits_away(a - (112u << 23), 21));
  }
  const std::uint32_t exponent = a >> 23;
  if (exponent < 110) { // < 2^-17, half the smallest subnormal: rounds to zero
    return sign;
  }
  // Subnormal (or the smallest normal, after rounding up): units of 2^-16.
  return static_cast<std::uint8_t>(sign | subnormal_units(a, 134));
}

/// float8_e5m2 is the top byte of a binary16, so its value is that half's.
DTENSOR_HOST_DEVICE constexpr float e5m2_bits_to_float(std::uint8_t b) noexcept {
  return half_bits_to_float(static_cast<std::uint16_t>(static_cast<std::uint16_t>(b) << 8));
}

} // namespace detail

namespace detail {

/// What every low-precision float storage type shares: construction from a bit pattern and compound
/// assignment through float. `Derived` has a `Bits bits` member and converts to and from float.
/// (An empty base: Derived stays standard-layout with the size of Bits.)
template <class Derived, class Bits>
struct FloatStorage {
  /// The value whose bit pattern is `b`.
  DTENSOR_HOST_DEVICE static constexpr Derived from_bits(Bits b) noexcept {
    Derived r{};
    r.bits = b;
    return r;
  }

  DTENSOR_HOST_DEVICE constexpr Derived& operator+=(float o) noexcept { return self() = float(self()) + o; }
  DTENSOR_HOST_DEVICE constexpr Derived& operator-=(float o) noexcept { return self() = float(self()) - o; }
  DTENSOR_HOST_DEVICE constexpr Derived& operator*=(float o) noexcept { return self() = float(self()) * o; }
  DTENSOR_HOST_DEVICE constexpr Derived& operator/=(float o) noexcept { return self() = float(self()) / o; }

private:
  DTENSOR_HOST_DEVICE constexpr Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

} // namespace detail

/// Brain floating point: 1 sign, 8 exponent, 7 mantissa bits (the top half of a float).
/// Converts implicitly from and to float; arithmetic and comparisons go through float.
struct bfloat16 : detail::FloatStorage<bfloat16, std::uint16_t> {
  std::uint16_t bits;

  bfloat16() = default; // uninitialised, like float
  DTENSOR_HOST_DEVICE constexpr bfloat16(float f) noexcept : bits(detail::float_to_bfloat16_bits(f)) {}
  DTENSOR_HOST_DEVICE constexpr operator float() const noexcept {
    return detail::bfloat16_bits_to_float(bits);
  }
};

/// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits, with subnormals.
/// Converts implicitly from and to float; arithmetic and comparisons go through float.
struct half : detail::FloatStorage<half, std::uint16_t> {
  std::uint16_t bits;

  half() = default; // uninitialised, like float
  DTENSOR_HOST_DEVICE constexpr half(float f) noexcept : bits(detail::float_to_half_bits(f)) {}
  DTENSOR_HOST_DEVICE constexpr operator float() const noexcept { return detail::half_bits_to_float(bits); }
};

/// OCP E4M3FN 8-bit float (torch.float8_e4m3fn): 1 sign, 4 exponent, 3 mantissa bits; no infinities,
/// max 448, NaN = S.1111.111. Converts implicitly from and to float (out of range gives NaN, see the top of
/// this file); arithmetic and comparisons go through float.
struct float8_e4m3 : detail::FloatStorage<float8_e4m3, std::uint8_t> {
  std::uint8_t bits;

  float8_e4m3() = default; // uninitialised, like float
  DTENSOR_HOST_DEVICE constexpr float8_e4m3(float f) noexcept : bits(detail::float_to_e4m3_bits(f)) {}
  DTENSOR_HOST_DEVICE constexpr operator float() const noexcept { return detail::e4m3_bits_to_float(bits); }
};

/// OCP E5M2 8-bit float (torch.float8_e5m2): 1 sign, 5 exponent, 2 mantissa bits, IEEE-like with
/// infinities and NaNs; max 57344. Converts implicitly from and to float; arithmetic and comparisons go
/// through float.
struct float8_e5m2 : detail::FloatStorage<float8_e5m2, std::uint8_t> {
  std::uint8_t bits;

  float8_e5m2() = default; // uninitialised, like float
  DTENSOR_HOST_DEVICE constexpr float8_e5m2(float f) noexcept : bits(detail::float_to_e5m2_bits(f)) {}
  DTENSOR_HOST_DEVICE constexpr operator float() const noexcept { return detail::e5m2_bits_to_float(bits); }
};

static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2);
static_assert(sizeof(half) == 2 && alignof(half) == 2);
static_assert(sizeof(float8_e4m3) == 1 && sizeof(float8_e5m2) == 1);
static_assert(std::is_standard_layout_v<bfloat16> && std::is_standard_layout_v<half> &&
              std::is_standard_layout_v<float8_e4m3> && std::is_standard_layout_v<float8_e5m2>);
static_assert(std::is_trivially_copyable_v<bfloat16> && std::is_trivially_copyable_v<float8_e4m3>);

/// Run-time tag of an element type (what backends switch on).
enum class DType : std::uint8_t {
  float32,
  float64,
  bfloat16,
  float16,
  int32,
  int64,
  uint8,
  float8_e4m3,
  float8_e5m2
};

/// The element types a Tensor may hold.
template <class T>
concept Element = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bfloat16> ||
    std::same_as<T, half> || std::same_as<T, float8_e4m3> || std::same_as<T, float8_e5m2> ||
    std::same_as<T, std::int32_t> || std::same_as<T, std::int64_t> || std::same_as<T, std::uint8_t>;

namespace detail {

template <class T>
inline constexpr bool always_false_v = false;

/// True for the floating types narrower than float (bfloat16, half, float8_e4m3, float8_e5m2): stored in
/// their own format, computed in float.
template <class T>
inline constexpr bool is_reduced_float_v = std::same_as<T, bfloat16> || std::same_as<T, half> ||
                                           std::same_as<T, float8_e4m3> || std::same_as<T, float8_e5m2>;

template <class T>
struct dtype_of {
  static_assert(always_false_v<T>, "dtensor: unsupported element type; the allowed ones are float, double, "
                                   "dtensor::bfloat16, dtensor::half, dtensor::float8_e4m3, "
                                   "dtensor::float8_e5m2, std::int32_t, std::int64_t and std::uint8_t");
  static constexpr DType value = DType::float32;
};
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::float32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::float64;
};
template <>
struct dtype_of<bfloat16> {
  static constexpr DType value = DType::bfloat16;
};
template <>
struct dtype_of<half> {
  static constexpr DType value = DType::float16;
};
template <>
struct dtype_of<float8_e4m3> {
  static constexpr DType value = DType::float8_e4m3;
};
template <>
struct dtype_of<float8_e5m2> {
  static constexpr DType value = DType::float8_e5m2;
};
template <>
struct dtype_of<std::int32_t> {
  static constexpr DType value = DType::int32;
};
template <>
struct dtype_of<std::int64_t> {
  static constexpr DType value = DType::int64;
};
template <>
struct dtype_of<std::uint8_t> {
  static constexpr DType value = DType::uint8;
};

template <DType D>
struct element_of;
template <>
struct element_of<DType::float32> {
  using type = float;
};
template <>
struct element_of<DType::float64> {
  using type = double;
};
template <>
struct element_of<DType::bfloat16> {
  using type = bfloat16;
};
template <>
struct element_of<DType::float16> {
  using type = half;
};
template <>
struct element_of<DType::float8_e4m3> {
  using type = float8_e4m3;
};
template <>
struct element_of<DType::float8_e5m2> {
  using type = float8_e5m2;
};
template <>
struct element_of<DType::int32> {
  using type = std::int32_t;
};
template <>
struct element_of<DType::int64> {
  using type = std::int64_t;
};
template <>
struct element_of<DType::uint8> {
  using type = std::uint8_t;
};

} // namespace detail

/// The DType of element type T; a static_assert names the allowed types when T is not one of them.
template <class T>
inline constexpr DType dtype_v = detail::dtype_of<T>::value;

/// The element type of DType D (the inverse of dtype_v).
template <DType D>
using element_type_t = typename detail::element_of<D>::type;

/// Bytes per element.
constexpr std::size_t dtype_size(DType d) noexcept {
  switch (d) {
  case DType::float32:
  case DType::int32:
    return 4;
  case DType::float64:
  case DType::int64:
    return 8;
  case DType::bfloat16:
  case DType::float16:
    return 2;
  case DType::uint8:
  case DType::float8_e4m3:
  case DType::float8_e5m2:
    return 1;
  }
  return 0;
}

/// PyTorch's name without the "torch." prefix: "float32", "float64", "bfloat16", "float16", "int32",
/// "int64", "uint8", "float8_e4m3fn", "float8_e5m2".
constexpr std::string_view dtype_name(DType d) noexcept {
  switch (d) {
  case DType::float32:
    return "float32";
  case DType::float64:
    return "float64";
  case DType::bfloat16:
    return "bfloat16";
  case DType::float16:
    return "float16";
  case DType::int32:
    return "int32";
  case DType::int64:
    return "int64";
  case DType::uint8:
    return "uint8";
  case DType::float8_e4m3:
    return "float8_e4m3fn";
  case DType::float8_e5m2:
    return "float8_e5m2";
  }
  return "unknown";
}

/// Calls f(T{}) with the element type T of `d` (the one place the run-time dtype list is spelled out).
template <class F>
constexpr decltype(auto) visit_dtype(DType d, F&& f) {
  switch (d) {
  case DType::float32:
    return f(float{});
  case DType::float64:
    return f(double{});
  case DType::bfloat16:
    return f(bfloat16{});
  case DType::float16:
    return f(half{});
  case DType::int32:
    return f(std::int32_t{});
  case DType::int64:
    return f(std::int64_t{});
  case DType::uint8:
    return f(std::uint8_t{});
  case DType::float8_e4m3:
    return f(float8_e4m3{});
  case DType::float8_e5m2:
    return f(float8_e5m2{});
  }
  throw Error("unknown dtype " + std::to_string(static_cast<int>(d)));
}

} // namespace dtensor

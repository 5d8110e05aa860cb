#pragma once
// Element types: the 16-bit floats `bfloat16` and `half`, the `DType` tag, and the `Element` concept.
//
//   dtensor::bfloat16 b = 1.5f;             // round to nearest even; NaN stays NaN, overflow gives inf
//   float f = b * 2.0f;                      // arithmetic goes through float
//   static_assert(dtensor::dtype_v<dtensor::half> == dtensor::DType::float16);
//   static_assert(dtensor::dtype_name(dtensor::DType::bfloat16) == "bfloat16");
//
// Both 16-bit types are trivially copyable structs holding the IEEE/bfloat16 bit pattern in `bits`, so
// they have the size and layout of `__nv_bfloat16` / `__half` and of NCCL's ncclBfloat16 / ncclFloat16.
// Conversions are constexpr and usable in CUDA device code.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dtensor/core/config.hpp"

namespace dtensor {
namespace detail {

DTENSOR_HOST_DEVICE constexpr std::uint32_t float_bits(float f) noexcept {
  return __builtin_bit_cast(std::uint32_t, f);
}
DTENSOR_HOST_DEVICE constexpr float bits_float(std::uint32_t u) noexcept {
  return __builtin_bit_cast(float, u);
}

/// float -> bfloat16 bits, round to nearest even. NaN stays NaN (quietened, sign kept); values beyond
/// the largest bfloat16 round to inf as IEEE rounding says.
DTENSOR_HOST_DEVICE constexpr std::uint16_t float_to_bfloat16_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) { // NaN: truncating could turn a low-payload NaN into inf
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
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
    const std::uint32_t r = a - 0x38000000u;
    return static_cast<std::uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  const std::uint32_t exponent = a >> 23;
  if (exponent < 102) { // < 2^-25: rounds to zero
    return static_cast<std::uint16_t>(sign);
  }
  // Subnormal half (or the smallest normal, after rounding up): count units of 2^-24.
  const std::uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126 - exponent; // 14..24
  std::uint32_t q = mantissa >> shift;
  const std::uint32_t rem = mantissa & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (q & 1u) != 0)) {
    ++q;
  }
  return static_cast<std::uint16_t>(sign | q);
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

} // namespace detail

/// Brain floating point: 1 sign, 8 exponent, 7 mantissa bits (the top half of a float).
/// Converts implicitly from and to float; arithmetic and comparisons go through float.
struct bfloat16 {
  std::uint16_t bits;

  bfloat16() = default; // uninitialised, like float
  DTENSOR_HOST_DEVICE constexpr bfloat16(float f) noexcept : bits(detail::float_to_bfloat16_bits(f)) {}
  DTENSOR_HOST_DEVICE constexpr operator float() const noexcept {
    return detail::bfloat16_bits_to_float(bits);
  }

  /// The value whose bit pattern is `b`.
  DTENSOR_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 r{};
    r.bits = b;
    return r;
  }

  DTENSOR_HOST_DEVICE constexpr bfloat16& operator+=(float o) noexcept { return *this = float(*this) + o; }
  DTENSOR_HOST_DEVICE constexpr bfloat16& operator-=(float o) noexcept { return *this = float(*this) - o; }
  DTENSOR_HOST_DEVICE constexpr bfloat16& operator*=(float o) noexcept { return *this = float(*this) * o; }
  DTENSOR_HOST_DEVICE constexpr bfloat16& operator/=(float o) noexcept { return *this = float(*this) / o; }
};

/// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits, with subnormals.
/// Converts implicitly from and to float; arithmetic and comparisons go through float.
struct half {
  std::uint16_t bits;

  half() = default; // uninitialised, like float
  DTENSOR_HOST_DEVICE constexpr half(float f) noexcept : bits(detail::float_to_half_bits(f)) {}
  DTENSOR_HOST_DEVICE constexpr operator float() const noexcept { return detail::half_bits_to_float(bits); }

  /// The value whose bit pattern is `b`.
  DTENSOR_HOST_DEVICE static constexpr half from_bits(std::uint16_t b) noexcept {
    half r{};
    r.bits = b;
    return r;
  }

  DTENSOR_HOST_DEVICE constexpr half& operator+=(float o) noexcept { return *this = float(*this) + o; }
  DTENSOR_HOST_DEVICE constexpr half& operator-=(float o) noexcept { return *this = float(*this) - o; }
  DTENSOR_HOST_DEVICE constexpr half& operator*=(float o) noexcept { return *this = float(*this) * o; }
  DTENSOR_HOST_DEVICE constexpr half& operator/=(float o) noexcept { return *this = float(*this) / o; }
};

static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2);
static_assert(sizeof(half) == 2 && alignof(half) == 2);

/// Run-time tag of an element type (what backends switch on).
enum class DType : std::uint8_t { float32, float64, bfloat16, float16, int32, int64, uint8 };

/// The element types a Tensor may hold.
template <class T>
concept Element =
    std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bfloat16> || std::same_as<T, half> ||
    std::same_as<T, std::int32_t> || std::same_as<T, std::int64_t> || std::same_as<T, std::uint8_t>;

namespace detail {

template <class T>
inline constexpr bool always_false_v = false;

template <class T>
struct dtype_of {
  static_assert(always_false_v<T>, "dtensor: unsupported element type; the allowed ones are float, double, "
                                   "dtensor::bfloat16, dtensor::half, std::int32_t, std::int64_t and "
                                   "std::uint8_t");
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
    return 1;
  }
  return 0;
}

/// PyTorch's name without the "torch." prefix: "float32", "float64", "bfloat16", "float16", "int32",
/// "int64", "uint8".
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
  }
  return "unknown";
}

} // namespace dtensor

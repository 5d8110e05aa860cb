#pragma once
// Counter-based random numbers on a rank's own tensors: uniform and normal fills and dropout, each element
// a function of (seed, offset, its flat index in the *global* tensor) only, so that any blocking of a
// tensor over ranks yields the same values, bit for bit, on the host and on CUDA. The sharded forms
// (ops/random.hpp) call these with each rank's block.
//
//   auto u = dtensor::local::rand<float, 2>({4, 6}, /*seed=*/42);          // the whole tensor, one rank
//   auto block = dtensor::Tensor<float, 2>({2, 6});
//   dtensor::local::rand_into(block, 42, 0, {{2, 0}, {4, 6}});             // rows 2..3 of the same: equal
//   auto z = dtensor::local::randn<double, 1>({1000}, 42, /*offset=*/1);   // another stream
//   auto y = dtensor::local::dropout(x, 0.1, 42);                          // x * mask / 0.9
//
// The generator: Random123's Philox4x32-10 (Debian's librandom123-dev), one call per element:
//   key     = {seed & 0xffffffff, seed >> 32}
//   counter = {i & 0xffffffff, i >> 32, offset & 0xffffffff, offset >> 32}
// with i the element's row-major flat index in the global tensor and `offset` a stream number (torch's
// philox offset: give successive calls different offsets). The call's four 32-bit words r0..r3 make one
// element (one call per element, rather than four elements sharing a call: a normal of double needs all
// four words, every element type then reads the same words of its own call, and a GPU thread computing
// one element would compute the other three and throw them away anyway):
//  - uniform, in (0, 1), never 0 or 1 (so within torch.rand's [0, 1)): float r123::u01fixedpt<float>(r0),
//    that is ((r0 >> 8) | 1) * 2^-24; double r123::u01fixedpt<double>(r0:r1), 53 bits; bfloat16 and half
//    the same construction at their own precision, ((r0 >> 24) | 1) * 2^-8 and ((r0 >> 21) | 1) * 2^-11,
//    so every value is exact in the type (rounding a float uniform could give 1).
//  - normal: Box-Muller, sqrt(-2 log u) * cos(2 pi t) with u the uniform above (float for float, bfloat16
//    and half, then rounded to the type once; double for double) and t = r1 / 2^32 (double: r2:r3 / 2^64).
//    Not r123::boxmuller: it calls the platform's logf / sincospif, whose last bits differ between glibc
//    and CUDA. Here log and cos are written out (detail::rng) from IEEE operations that are correctly
//    rounded everywhere: integer steps for the exponent and the angle's quadrant, + - * / and sqrt, and
//    every multiply-add an explicit fma (so neither nvcc's default --fmad=true nor a host -mfma can
//    contract them differently). Accuracy: a few ulp of float / double (tests/ops/test_random.cpp).
//    Bit equality between host and CUDA holds under the compilers' default floating-point modes; not
//    under nvcc --use_fast_math (approximate division and sqrt, flush to zero) or g++ -ffast-math.
//  - dropout keeps element i when its float uniform u_i >= p: the mask equals rand<float>(same seed,
//    offset) >= p, for any element type of x; kept elements are multiplied by 1 / (1 - p) (in float,
//    double for double), dropped ones by 0 (x * 0, as torch: NaN stays NaN). p = 1 drops everything.
//
// They run on local/copy.hpp's launcher (Thrust's cpp system on the host, a kernel on the tensor's
// stream in an nvcc TU). A fill of a CUDA tensor in a TU not compiled by nvcc is made on the host and
// copied (the same values); dropout of a CUDA tensor needs an nvcc TU.
//
// Random123 is needed only by code that uses these: without its headers (DTENSOR_HAS_RANDOM123 = 0,
// detected with __has_include unless the build defines it; the CMake target dtensor::random defines it)
// this header still compiles, and instantiating a random fill is a compile error naming the package.

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dtensor/core/config.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"

#ifndef DTENSOR_HAS_RANDOM123
#if __has_include(<Random123/philox.h>)
#define DTENSOR_HAS_RANDOM123 1
#else
#define DTENSOR_HAS_RANDOM123 0
#endif
#endif

#if DTENSOR_HAS_RANDOM123
// Random123 includes the x86 intrinsics headers for its AES and ARS generators when R123_USE_SSE is on
// (~0.5 s and 100 MB of compile per TU with g++ 12); Philox needs none of it, so it is off here unless the
// TU set it first (define R123_USE_SSE=1 before including dtensor to use those generators yourself).
#ifndef R123_USE_SSE
#define R123_USE_SSE 0
#endif
#include <Random123/philox.h>
#include <Random123/uniform.hpp>
#endif

namespace dtensor {
namespace detail {

/// The element types random fills support.
template <class T>
inline constexpr bool random_element_v = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                         std::is_same_v<T, bfloat16> || std::is_same_v<T, half>;

/// Whether this TU sees Random123; a template so that the static_assert fires only where a random fill is
/// instantiated.
template <class T>
inline constexpr bool random123_available_v = DTENSOR_HAS_RANDOM123 != 0;

} // namespace detail

/// Where a local block sits in its global tensor: element j of the block is the global element
/// offset + j, and its row-major flat index in `global_shape` keys its random value.
template <int R>
struct GlobalBlock {
  std::array<std::int64_t, R> offset{};
  std::array<std::int64_t, R> global_shape{};
};

} // namespace dtensor

#if DTENSOR_HAS_RANDOM123
namespace dtensor::detail::rng {

// ---- the element functions: the same IEEE operations on the host and on CUDA ----------------------------

DTENSOR_HOST_DEVICE inline float fma(float a, float b, float c) {
  return std::fma(a, b, c);
}
DTENSOR_HOST_DEVICE inline double fma(double a, double b, double c) {
  return std::fma(a, b, c);
}

/// floor(log2 n) for n > 0.
DTENSOR_HOST_DEVICE inline int leading_bit(std::uint64_t n) {
#if defined(__CUDA_ARCH__)
  return 63 - __clzll(static_cast<long long>(n));
#else
  return 63 - __builtin_clzll(static_cast<unsigned long long>(n));
#endif
}

/// 2^e, exactly (e within the type's normal exponents).
DTENSOR_HOST_DEVICE inline float pow2f(int e) {
  return __builtin_bit_cast(float, static_cast<std::uint32_t>(127 + e) << 23);
}
DTENSOR_HOST_DEVICE inline double pow2d(int e) {
  return __builtin_bit_cast(double, static_cast<std::uint64_t>(1023 + e) << 52);
}

/// Philox4x32-10 of element `index` in stream `offset` under `seed`.
DTENSOR_HOST_DEVICE inline r123::Philox4x32::ctr_type philox(std::uint64_t seed, std::uint64_t offset,
                                                             std::uint64_t index) {
  const r123::Philox4x32::ctr_type ctr = {
      {static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
       static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(offset >> 32)}};
  const r123::Philox4x32::key_type key = {
      {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)}};
  return r123::Philox4x32()(ctr, key);
}

/// log(n * 2^-24) for odd n in [1, 2^24) (the values of r123::u01fixedpt<float>): n = 2^e m with m in
/// (sqrt(1/2), sqrt(2)] from the integer, log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716, as
/// 2 s (1 + s^2/3 + ... + s^8/9) (the next term is below 2^-28 of the sum).
DTENSOR_HOST_DEVICE inline float log_fixedpt24(std::uint32_t n) {
  int e = leading_bit(n);
  float m = static_cast<float>(n) * pow2f(-e); // exact: n < 2^24
  if (m > 0x1.6a09e6p+0f) {                    // sqrt(2)
    m = m * 0.5f;
    ++e;
  }
  const float f = m - 1.0f; // exact (Sterbenz)
  const float s = f / (f + 2.0f);
  const float z = s * s;
  float p = 0x1.c71c72p-3f;      // 2/9
  p = fma(p, z, 0x1.24924ap-2f); // 2/7
  p = fma(p, z, 0x1.99999ap-2f); // 2/5
  p = fma(p, z, 0x1.555556p-1f); // 2/3
  p = fma(p, z, 2.0f);
  const float log_m = s * p;
  const auto k = static_cast<float>(e - 24);
  return fma(k, 0x1.62e4p-1f, fma(k, 0x1.7f7d1cp-20f, log_m)); // k * ln 2 in two parts, + log m
}

/// log(n * 2^-53) for odd n in [1, 2^53) (the values of r123::u01fixedpt<double>), as above with terms up
/// to s^20/21 (the next below 2^-60 of the sum).
DTENSOR_HOST_DEVICE inline double log_fixedpt53(std::uint64_t n) {
  int e = leading_bit(n);
  double m = static_cast<double>(n) * pow2d(-e); // exact: n < 2^53
  if (m > 0x1.6a09e667f3bcdp+0) {
    m = m * 0.5;
    ++e;
  }
  const double f = m - 1.0;
  const double s = f / (f + 2.0);
  const double z = s * s;
  double p = 0x1.8618618618618p-4;     // 2/21
  p = fma(p, z, 0x1.af286bca1af28p-4); // 2/19
  p = fma(p, z, 0x1.e1e1e1e1e1e1ep-4); // 2/17
  p = fma(p, z, 0x1.1111111111111p-3); // 2/15
  p = fma(p, z, 0x1.3b13b13b13b14p-3); // 2/13
  p = fma(p, z, 0x1.745d1745d1746p-3); // 2/11
  p = fma(p, z, 0x1.c71c71c71c71cp-3); // 2/9
  p = fma(p, z, 0x1.2492492492492p-2); // 2/7
  p = fma(p, z, 0x1.999999999999ap-2); // 2/5
  p = fma(p, z, 0x1.5555555555555p-1); // 2/3
  p = fma(p, z, 2.0);
  const double log_m = s * p;
  const auto k = static_cast<double>(e - 53);
  return fma(k, 0x1.62e42fefa3a00p-1, fma(k, -0x1.0ca86c3898d00p-49, log_m));
}

/// cos and sin of pi/2 * y for y in [-1/2, 1/2] (a quarter turn's fraction): Taylor series in y (the
/// coefficients (pi/2)^k / k! rounded to float; the first omitted term is below 2^-30).
struct SinCosF {
  float s;
  float c;
};
DTENSOR_HOST_DEVICE inline SinCosF sincos_quarter(float y) {
  const float w = y * y;
  float s = -0x1.e30750p-19f;
  s = fma(s, w, 0x1.507834p-13f);
  s = fma(s, w, -0x1.32d2ccp-8f);
  s = fma(s, w, 0x1.466bc6p-4f);
  s = fma(s, w, -0x1.4abbcep-1f);
  s = fma(s, w, 0x1.921fb6p+0f);
  float c = 0x1.f9d38ap-22f;
  c = fma(c, w, -0x1.a6d1f2p-16f);
  c = fma(c, w, 0x1.e1f506p-11f);
  c = fma(c, w, -0x1.55d3c8p-6f);
  c = fma(c, w, 0x1.03c1f0p-2f);
  c = fma(c, w, -0x1.3bd3ccp+0f);
  c = fma(c, w, 1.0f);
  return {y * s, c};
}
struct SinCosD {
  double s;
  double c;
};
DTENSOR_HOST_DEVICE inline SinCosD sincos_quarter(double y) {
  const double w = y * y;
  double s = -0x1.8a404211f9547p-45;
  s = fma(s, w, 0x1.aaec32af93359p-38);
  s = fma(s, w, -0x1.6fadb9f155744p-31);
  s = fma(s, w, 0x1.e8f434d018d63p-25);
  s = fma(s, w, -0x1.e3074fde8871fp-19);
  s = fma(s, w, 0x1.50783487ee782p-13);
  s = fma(s, w, -0x1.32d2cce62bd86p-8);
  s = fma(s, w, 0x1.466bc6775aae2p-4);
  s = fma(s, w, -0x1.4abbce625be53p-1);
  s = fma(s, w, 0x1.921fb54442d18p+0);
  double c = 0x1.ef6e308d6d1c4p-49;
  c = fma(c, w, -0x1.2a0c591af8314p-41);
  c = fma(c, w, 0x1.20c62c2f2d7f5p-34);
  c = fma(c, w, -0x1.b6e24f44b128fp-28);
  c = fma(c, w, 0x1.f9d38a3763cc3p-22);
  c = fma(c, w, -0x1.a6d1f2a204a8cp-16);
  c = fma(c, w, 0x1.e1f506891babbp-11);
  c = fma(c, w, -0x1.55d3c7e3cbffap-6);
  c = fma(c, w, 0x1.03c1f081b5ac4p-2);
  c = fma(c, w, -0x1.3bd3cc9be45dep+0);
  c = fma(c, w, 1.0);
  return {y * s, c};
}

/// cos(2 pi a / 2^32): the quadrant and the centred rest of the turn from the integer (exact), then the
/// quarter-turn series.
DTENSOR_HOST_DEVICE inline float cos_turn32(std::uint32_t a) {
  std::uint32_t q = a >> 30;
  auto rest = static_cast<std::int32_t>(a & 0x3fffffffu);
  if (rest >= 0x20000000) {
    rest -= 0x40000000;
    q = (q + 1) & 3u;
  }
  const SinCosF v = sincos_quarter(static_cast<float>(rest) * 0x1p-30f);
  return q == 0 ? v.c : q == 1 ? -v.s : q == 2 ? -v.c : v.s;
}
/// cos(2 pi a / 2^64).
DTENSOR_HOST_DEVICE inline double cos_turn64(std::uint64_t a) {
  std::uint64_t q = a >> 62;
  auto rest = static_cast<std::int64_t>(a & 0x3fffffffffffffffull);
  if (rest >= 0x2000000000000000ll) {
    rest -= 0x4000000000000000ll;
    q = (q + 1) & 3u;
  }
  const SinCosD v = sincos_quarter(static_cast<double>(rest) * 0x1p-62);
  return q == 0 ? v.c : q == 1 ? -v.s : q == 2 ? -v.c : v.s;
}

DTENSOR_HOST_DEVICE inline std::uint64_t join(std::uint32_t hi, std::uint32_t lo) {
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

/// The uniform in (0, 1) of Philox words r (see the header comment).
template <class T>
DTENSOR_HOST_DEVICE T uniform_of(const r123::Philox4x32::ctr_type& r) {
  if constexpr (std::is_same_v<T, double>) {
    return r123::u01fixedpt<double>(join(r[0], r[1]));
  } else if constexpr (std::is_same_v<T, float>) {
    return r123::u01fixedpt<float>(r[0]);
  } else { // u01fixedpt's construction at T's precision (8 bits for bfloat16, 11 for half): exact in T
    constexpr int bits = std::is_same_v<T, bfloat16> ? 8 : 11;
    return T(static_cast<float>((r[0] >> (32 - bits)) | 1u) * pow2f(-bits));
  }
}

/// The standard normal of Philox words r: Box-Muller, sqrt(-2 log u) cos(2 pi t).
template <class T>
DTENSOR_HOST_DEVICE T normal_of(const r123::Philox4x32::ctr_type& r) {
  if constexpr (std::is_same_v<T, double>) {
    const double radius = std::sqrt(-2.0 * log_fixedpt53((join(r[0], r[1]) >> 11) | 1u));
    return radius * cos_turn64(join(r[2], r[3])) + 0.0; // + 0: a -0 (cos of a right angle) becomes +0
  } else {
    const float radius = std::sqrt(-2.0f * log_fixedpt24((r[0] >> 8) | 1u));
    return T(radius * cos_turn32(r[1]) + 0.0f);
  }
}

} // namespace dtensor::detail::rng
#endif // DTENSOR_HAS_RANDOM123

namespace dtensor::local {

#if DTENSOR_HAS_RANDOM123
/// Element `index` (a global row-major flat index) of the uniform fill with `seed` and stream `offset`.
template <class T>
DTENSOR_HOST_DEVICE T uniform_at(std::uint64_t seed, std::uint64_t offset, std::uint64_t index) {
  return dtensor::detail::rng::uniform_of<T>(dtensor::detail::rng::philox(seed, offset, index));
}
/// Element `index` of the standard normal fill with `seed` and stream `offset`.
template <class T>
DTENSOR_HOST_DEVICE T normal_at(std::uint64_t seed, std::uint64_t offset, std::uint64_t index) {
  return dtensor::detail::rng::normal_of<T>(dtensor::detail::rng::philox(seed, offset, index));
}
/// Whether dropout with probability p keeps element `index`: uniform_at<float>(...) >= p.
DTENSOR_HOST_DEVICE inline bool dropout_keeps(std::uint64_t seed, std::uint64_t offset, std::uint64_t index,
                                              double p) {
  return static_cast<double>(uniform_at<float>(seed, offset, index)) >= p;
}

/// Element generators for the fill kernel.
template <class T>
struct UniformAt {
  std::uint64_t seed;
  std::uint64_t offset;
  DTENSOR_HOST_DEVICE T operator()(std::uint64_t index) const { return uniform_at<T>(seed, offset, index); }
};
template <class T>
struct NormalAt {
  std::uint64_t seed;
  std::uint64_t offset;
  DTENSOR_HOST_DEVICE T operator()(std::uint64_t index) const { return normal_at<T>(seed, offset, index); }
};

inline namespace DTENSOR_LOCAL_OPS_NS {

/// Index i fills tile i: operand 0 is the output, operand 1 the global flat index (the global tensor's
/// row-major strides, from `base`, the block's first element).
template <class T, int R, class Gen>
struct RandomRuns {
  RunLayout<R, 2> layout;
  T* out;
  std::int64_t base;
  Gen gen;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const Tile<2> t = layout.locate(i);
    for (std::int64_t r = 0; r < t.rows; ++r) {
      T* o = out + t.offset[0] + r * t.row_stride[0];
      const std::int64_t g = base + t.offset[1] + r * t.row_stride[1];
      for (std::int64_t k = 0; k < t.n; ++k) {
        o[k] = gen(static_cast<std::uint64_t>(g + k));
      }
    }
  }
};

/// Index i computes tile i of out = x * mask * scale: operand 0 the output, 1 the input, 2 the global
/// flat index.
template <class T, int R>
struct DropoutRuns {
  RunLayout<R, 3> layout;
  T* out;
  const T* in;
  std::int64_t base;
  std::uint64_t seed;
  std::uint64_t offset;
  double p;
  scale_type_t<T> scale;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    using C = scale_type_t<T>;
    const Tile<3> t = layout.locate(i);
    for (std::int64_t r = 0; r < t.rows; ++r) {
      T* o = out + t.offset[0] + r * t.row_stride[0];
      const T* x = in + t.offset[1] + r * t.row_stride[1];
      const std::int64_t g = base + t.offset[2] + r * t.row_stride[2];
      for (std::int64_t k = 0; k < t.n; ++k) {
        const C m = dropout_keeps(seed, offset, static_cast<std::uint64_t>(g + k), p) ? scale : C(0);
        o[k] = T(static_cast<C>(x[k]) * m);
      }
    }
  }
};

} // namespace DTENSOR_LOCAL_OPS_NS
#endif // DTENSOR_HAS_RANDOM123

} // namespace dtensor::local

namespace dtensor::detail {

/// The global row-major strides of `at`, and the flat index of the block's first element, after checking
/// that a block of `shape` fits at at.offset.
template <int R>
std::array<std::int64_t, R> global_strides(const std::array<std::int64_t, R>& shape, const GlobalBlock<R>& at,
                                           std::int64_t& base, const char* what) {
  std::array<std::int64_t, R> strides{};
  std::int64_t stride = 1;
  base = 0;
  for (int d = R - 1; d >= 0; --d) {
    DTENSOR_CHECK(at.offset[d] >= 0 && at.offset[d] + shape[d] <= at.global_shape[d],
                  std::string(what) + ": a block of shape " + shape_to_string(shape) + " at offset " +
                      shape_to_string(at.offset) + " does not fit in the global shape " +
                      shape_to_string(at.global_shape));
    strides[d] = stride;
    base += at.offset[d] * stride;
    stride *= at.global_shape[d];
  }
  return strides;
}

template <class T>
consteval bool check_random_element() {
  static_assert(random123_available_v<T>,
                "dtensor random numbers (rand, randn, dropout) need Random123's headers: install Debian's "
                "librandom123-dev (scripts/deps.sh does) and link the CMake target dtensor::random");
  static_assert(random_element_v<T>,
                "dtensor random numbers: the element type must be float, double, bfloat16 or half");
  return true;
}

} // namespace dtensor::detail

namespace dtensor::local {

inline namespace DTENSOR_LOCAL_OPS_NS {

#if DTENSOR_HAS_RANDOM123
/// Fills `out`, the block `at` of its global tensor, with gen(global flat index) (rand_into, randn_into).
template <class T, int R, class Gen>
void fill_random(const Tensor<T, R>& out, Gen gen, const GlobalBlock<R>& at, const char* what) {
  std::int64_t base = 0;
  const auto gstrides = dtensor::detail::global_strides<R>(out.shape(), at, base, what);
  if (out.numel() == 0 || out.device().is_meta()) {
    return;
  }
  const bool host = out.device().is_cpu();
#if !DTENSOR_LOCAL_OPS_CUDA
  if (!host) { // no kernels in this TU: the same values made on the host, then copied
    Tensor<T, R> staged(out.shape());
    fill_random(staged, gen, at, what);
    Tensor<T, R>(out).copy_from(staged);
    return;
  }
#endif
  RandomRuns<T, R, Gen> run{
      make_run_layout<R, 2>(out.shape(), {out.strides(), gstrides}, host ? host_tile : cuda_tile), out.data(),
      base, gen};
  launch(run, out.device(), out.stream_handle(), what);
}
#endif

/// Fills `out` (a tensor or view on any device) with uniform values in (0, 1): the block `at` of the
/// global fill with `seed` and stream `offset`. Synchronous.
template <class T, int R>
void rand_into(const Tensor<T, R>& out, std::uint64_t seed, std::uint64_t offset, const GlobalBlock<R>& at) {
  static_assert(dtensor::detail::check_random_element<T>());
#if DTENSOR_HAS_RANDOM123
  fill_random(out, UniformAt<T>{seed, offset}, at, "local::rand_into");
#endif
}

/// Fills `out` with standard normal values: the block `at` of the global fill. Synchronous.
template <class T, int R>
void randn_into(const Tensor<T, R>& out, std::uint64_t seed, std::uint64_t offset, const GlobalBlock<R>& at) {
  static_assert(dtensor::detail::check_random_element<T>());
#if DTENSOR_HAS_RANDOM123
  fill_random(out, NormalAt<T>{seed, offset}, at, "local::randn_into");
#endif
}

/// A new tensor of `shape` on `device`, uniform in (0, 1): the whole global fill (one rank's view).
template <class T, int R>
Tensor<T, R> rand(const std::array<std::int64_t, R>& shape, std::uint64_t seed, std::uint64_t offset = 0,
                  Device device = Device::cpu()) {
  Tensor<T, R> out(shape, device);
  rand_into(out, seed, offset, GlobalBlock<R>{{}, shape});
  return out;
}

/// A new tensor of `shape` on `device`, standard normal: the whole global fill.
template <class T, int R>
Tensor<T, R> randn(const std::array<std::int64_t, R>& shape, std::uint64_t seed, std::uint64_t offset = 0,
                   Device device = Device::cpu()) {
  Tensor<T, R> out(shape, device);
  randn_into(out, seed, offset, GlobalBlock<R>{{}, shape});
  return out;
}

/// x * mask / (1 - p) into `out` (x's shape; any strides), x being the block `at` of its global tensor:
/// the mask keeps global element i when dropout_keeps(seed, offset, i, p). 0 <= p <= 1. Synchronous; CUDA
/// tensors need an nvcc TU.
template <class T, int R>
void dropout_into(const Tensor<T, R>& out, const Tensor<T, R>& x, double p, std::uint64_t seed,
                  std::uint64_t offset, const GlobalBlock<R>& at) {
  static_assert(dtensor::detail::check_random_element<T>());
  DTENSOR_CHECK(p >= 0 && p <= 1, "dropout: p must be in [0, 1], not " + std::to_string(p));
  DTENSOR_CHECK(out.shape() == x.shape(),
                "dropout: output shape " + dtensor::detail::shape_to_string(out.shape()) +
                    " is not the input's " + dtensor::detail::shape_to_string(x.shape()));
  DTENSOR_CHECK(out.device() == x.device(), "dropout: input and output on different devices");
#if DTENSOR_HAS_RANDOM123
  std::int64_t base = 0;
  const auto gstrides = dtensor::detail::global_strides<R>(x.shape(), at, base, "local::dropout");
  const bool host = x.device().is_cpu();
  using C = scale_type_t<T>;
  DropoutRuns<T, R> run{
      make_run_layout<R, 3>(x.shape(), {out.strides(), x.strides(), gstrides}, host ? host_tile : cuda_tile),
      out.data(),
      x.data(),
      base,
      seed,
      offset,
      p,
      p < 1 ? static_cast<C>(1.0 / (1.0 - p)) : C(0)};
  launch(run, x.device(), x.stream_handle(), "local::dropout");
#endif
}

/// x * mask / (1 - p) as a new contiguous tensor (x: the block `at` of its global tensor).
template <class T, int R>
Tensor<T, R> dropout(const Tensor<T, R>& x, double p, std::uint64_t seed, std::uint64_t offset,
                     const GlobalBlock<R>& at) {
  Tensor<T, R> out = dtensor::detail::empty_like(x.shape(), x);
  dropout_into(out, x, p, seed, offset, at);
  return out;
}

/// x * mask / (1 - p), x being the whole global tensor.
template <class T, int R>
Tensor<T, R> dropout(const Tensor<T, R>& x, double p, std::uint64_t seed, std::uint64_t offset = 0) {
  return dropout(x, p, seed, offset, GlobalBlock<R>{{}, x.shape()});
}

} // namespace DTENSOR_LOCAL_OPS_NS

} // namespace dtensor::local

#pragma once
// Elementary functions for the local kernels, written so that the host loops calling them vectorise:
// float exp and erf within 2 ulp of the correctly rounded value (tests/local/test_math.cpp sweeps
// every float of their domains and pins the maximum), with no tables, no calls and no branches (a
// choice between two computed values is a bit-mask select), so GCC 12 vectorises a loop over them at
// -O2 and -O3 (local/pointwise.hpp runs its host maps in fixed-size blocks for that).
//
//   float y = dtensor::local::math::erf(x);     // float: the functions below; double: std::erf
//   float e = dtensor::local::math::exp(x);
//
// exp, erf, select, sqrt_block and the generic forms are the contract; for C other than float (double, the
// integer types) exp and erf are std::exp and std::erf, and in CUDA device code they are CUDA's own
// (std::exp, std::erf there; the C library's in emulated device code, core/config.hpp), so only host float
// results differ from the C library's, by at most the pinned ulps.
//
// How they work (the coefficients are minimax fits made for this file: a Remez exchange in double
// against mpmath references, each coefficient rounded to float in turn and the others refitted):
//  - exp(x) = 2^k exp(r): k = round(x / ln 2) by adding 1.5 * 2^23 (whose float has no fraction bits
//    left, so the sum rounds to an integer that the low mantissa bits hold), r = x - k ln 2 with ln 2 in
//    two parts (Cody and Waite) so the first product is exact, |r| <= ln 2 / 2; exp(r) = 1 + (r + r^2
//    q(r)), q of degree 4 (fit error 3.2e-9 relative). 2^k is applied as two powers of two, 2^(k/2) and
//    2^(k - k/2), each a normal float, so results near overflow and in the subnormal range round once.
//    x is clamped to [-104, 89] first (exp is 0 below and inf above in float); NaN stays NaN.
//  - erf(x): for |x| < 0.875, x + x p(x^2) with p of degree 5 (p(0) = 2/sqrt(pi) - 1; fit error 1.4e-8
//    relative); above, sign(x) (1 - exp(s(|x|) - x^2)) with s(a) ~ log(erfc(a)) + a^2 of degree 6 in
//    a - 1.5 on [0.875, 4] (fit error 2.4e-9 in erfc); |x| is clamped at 4, where 1 - erfc rounds to 1.

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "dtensor/core/config.hpp"

#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#endif

namespace dtensor::local::math {

/// c ? a : b, computed from both values with a bit mask (no branch: a loop over it vectorises).
inline float select(bool c, float a, float b) {
  const std::int32_t m = -static_cast<std::int32_t>(c);
  return std::bit_cast<float>((std::bit_cast<std::int32_t>(a) & m) | (std::bit_cast<std::int32_t>(b) & ~m));
}
inline double select(bool c, double a, double b) {
  const std::int64_t m = -static_cast<std::int64_t>(c);
  return std::bit_cast<double>((std::bit_cast<std::int64_t>(a) & m) | (std::bit_cast<std::int64_t>(b) & ~m));
}

/// e^x in float, within 1 ulp (0.98 measured) on every float; +inf above 88.72, 0 below -103.97.
inline float exp_float(float x) {
  constexpr float magic = 12582912.0f;              // 1.5 * 2^23
  const float lo = select(x > -104.0f, x, -104.0f); // NaN -> -104 here; restored at the end
  const float xc = select(lo < 89.0f, lo, 89.0f);
  const float kb = xc * 1.44269504088896341f + magic;
  const std::int32_t k = std::bit_cast<std::int32_t>(kb) - std::bit_cast<std::int32_t>(magic);
  const float kf = kb - magic;
  float r = xc - kf * 0.693145751953125f; // ln 2 = 0.693145751953125 + 1.428606765330187e-6
  r = r - kf * 1.428606765330187045e-06f;
  float q = 0.0013836434809491038f;
  q = q * r + 0.00836913101375103f;
  q = q * r + 0.041668105870485306f;
  q = q * r + 0.16666516661643982f;
  q = q * r + 0.4999999403953552f;
  const float p = 1.0f + (r + (r * r) * q);
  const std::int32_t k1 = k >> 1;
  const std::int32_t k2 = k - k1;
  const float y = p * std::bit_cast<float>((k1 + 127) << 23) * std::bit_cast<float>((k2 + 127) << 23);
  return select(x == x, y, x);
}

/// erf(x) in float, within 2 ulp (1.2 measured) on every float; erf(+-inf) = +-1, erf(-0) = -0.
inline float erf_float(float x) {
  const float ax = std::fabs(x);
  const float t = x * x;
  float p = -0.0006020491127856076f;
  p = p * t + 0.004998927935957909f;
  p = p * t + -0.026770485565066338f;
  p = p * t + 0.11281921714544296f;
  p = p * t + -0.3761250376701355f;
  p = p * t + 0.12837915122509003f;
  const float small = x + x * p;
  const float a = select(ax > 4.0f, 4.0f, ax); // NaN stays NaN
  const float u = a - 1.5f;
  float s = 0.00020798362675122917f;
  s = s * u + -0.001286619808524847f;
  s = s * u + 0.006005062256008387f;
  s = s * u + -0.025814754888415337f;
  s = s * u + 0.10736162215471268f;
  s = s * u + -0.5088012218475342f;
  s = s * u + -1.1344921588897705f;
  const float large = std::copysign(1.0f - exp_float(s - a * a), x);
  return select(ax < 0.875f, small, large);
}

/// v[j] = sqrt(v[j]) for j < n, the IEEE square root (what std::sqrt returns): packed sqrt instructions
/// on x86-64, where a loop calling std::sqrt does not vectorise (errno is kept for negative arguments);
/// std::sqrt elsewhere.
inline void sqrt_block(float* v, int n) {
  int j = 0;
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
  for (; j + 4 <= n; j += 4) {
    _mm_storeu_ps(v + j, _mm_sqrt_ps(_mm_loadu_ps(v + j)));
  }
#endif
  for (; j < n; ++j) {
    v[j] = std::sqrt(v[j]);
  }
}
inline void sqrt_block(double* v, int n) {
  int j = 0;
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
  for (; j + 2 <= n; j += 2) {
    _mm_storeu_pd(v + j, _mm_sqrt_pd(_mm_loadu_pd(v + j)));
  }
#endif
  for (; j < n; ++j) {
    v[j] = std::sqrt(v[j]);
  }
}

/// e^x: exp_float for float on the host, std::exp otherwise (and in CUDA device code).
template <class C>
DTENSOR_HOST_DEVICE C exp(C x) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<C, float>) {
    if (!DTENSOR_ON_DEVICE) {
      return exp_float(x);
    }
  }
#endif
  return std::exp(x);
}

/// erf(x): erf_float for float on the host, std::erf otherwise (and in CUDA device code).
template <class C>
DTENSOR_HOST_DEVICE C erf(C x) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<C, float>) {
    if (!DTENSOR_ON_DEVICE) {
      return erf_float(x);
    }
  }
#endif
  return std::erf(x);
}

/// c ? a : b for any C: the mask select for float and double on the host, a plain conditional otherwise.
template <class C>
DTENSOR_HOST_DEVICE C choose(bool c, C a, C b) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<C, float> || std::is_same_v<C, double>) {
    if (!DTENSOR_ON_DEVICE) {
      return select(c, a, b);
    }
  }
#endif
  return c ? a : b;
}

} // namespace dtensor::local::math

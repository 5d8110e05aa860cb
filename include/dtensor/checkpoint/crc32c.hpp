#pragma once
// CRC-32C (Castagnoli), the checksum of checkpoint chunks: the SSE4.2 crc32 instruction where the CPU has
// it (checked at run time), a table otherwise. Both give the standard value: crc32c("123456789") ==
// 0xe3069283 (RFC 3720), so other tools (Python's crc32c, google-crc32c) can check the files too.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define DTENSOR_CRC32C_SSE42 1
#else
#define DTENSOR_CRC32C_SSE42 0
#endif

namespace dtensor::checkpoint {

namespace detail {

inline constexpr std::array<std::uint32_t, 256> crc32c_table = [] {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) {
      c = (c & 1u) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    }
    t[i] = c;
  }
  return t;
}();

inline std::uint32_t crc32c_table_update(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    crc = crc32c_table[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
  }
  return crc;
}

#if DTENSOR_CRC32C_SSE42
__attribute__((target("sse4.2"))) inline std::uint32_t
crc32c_sse42_update(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  std::uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; --n, ++p) {
    c32 = _mm_crc32_u8(c32, *p);
  }
  return c32;
}
#endif

} // namespace detail

/// CRC-32C of `n` bytes at `data`, continuing from `crc` (0 for a fresh checksum).
inline std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if DTENSOR_CRC32C_SSE42
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  crc = has_sse42 ? detail::crc32c_sse42_update(crc, p, n) : detail::crc32c_table_update(crc, p, n);
#else
  crc = detail::crc32c_table_update(crc, p, n);
#endif
  return ~crc;
}

} // namespace dtensor::checkpoint

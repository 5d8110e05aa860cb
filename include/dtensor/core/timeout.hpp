#pragma once
// The range of every timeout dtensor takes (group timeouts, DTENSOR_TIMEOUT, store waits, a store wait's
// limit as it arrives from the network): at least 1 ms, at most kMaxTimeout (30 days), so a deadline
// `steady_clock::now() + timeout` never overflows and gloo never sees 0 ("no limit").
//
//   auto t = dtensor::detail::parse_timeout_seconds("DTENSOR_TIMEOUT", "2.5");   // 2500 ms

#include "dtensor/core/error.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

namespace dtensor {

/// The longest timeout dtensor accepts: 30 days.
inline constexpr std::chrono::milliseconds kMaxTimeout{std::int64_t{30} * 24 * 3600 * 1000};

namespace detail {

/// `text` as a number of seconds, in milliseconds within [1 ms, kMaxTimeout]; Error naming `name` (e.g.
/// "DTENSOR_TIMEOUT") and the accepted range otherwise (not a number, NaN, infinite, negative, too small,
/// too large).
inline std::chrono::milliseconds parse_timeout_seconds(std::string_view name, const std::string& text) {
  double s = 0;
  std::size_t used = 0;
  try {
    s = std::stod(text, &used);
  } catch (...) {
    used = 0;
  }
  const double max_s = static_cast<double>(kMaxTimeout.count()) / 1000.0;
  const std::string range =
      "a number of seconds from 0.001 to " + std::to_string(static_cast<long long>(max_s)) + " (30 days)";
  DTENSOR_CHECK(used == text.size() && !text.empty() && std::isfinite(s),
                std::string(name) + "='" + text + "' is not " + range);
  DTENSOR_CHECK(s * 1000.0 >= 1.0 && s <= max_s,
                std::string(name) + "='" + text + "' is out of range: use " + range);
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(s * 1000.0)));
}

/// Throws Error("<what>: the timeout must be positive ...") unless 1 ms <= timeout <= kMaxTimeout.
inline void check_timeout(std::chrono::milliseconds timeout, const std::string& what) {
  DTENSOR_CHECK(timeout.count() >= 1 && timeout <= kMaxTimeout,
                what + ": the timeout must be positive (at least 1 ms) and at most 30 days (" +
                    std::to_string(kMaxTimeout.count()) + " ms), got " + std::to_string(timeout.count()) +
                    " ms");
}

} // namespace detail

} // namespace dtensor

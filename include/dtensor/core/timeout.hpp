#pragma once
// Timeouts, in one place: the defaults, and the range of every timeout dtensor takes.
//
// Default policy (torch.distributed's, with one value for every backend):
//  - kDefaultOpTimeout, 10 minutes: the default limit of every op of a group -- collectives, point to
//    point, barriers, making groups -- on every backend (gloo, MPI, NCCL and any registered one:
//    GlooOptions, MpiOptions, NcclOptions, BackendOptions), and of init_process_group, which also bounds its
//    store connection and rendezvous with it (as torch's init_process_group passes its timeout to the
//    store). 10 minutes is torch's NCCL default (default_pg_nccl_timeout); torch keeps 30 minutes
//    (default_pg_timeout) for its other backends only for compatibility with THD, which had none. One value
//    for all backends means that switching DTENSOR_BACKEND never changes when a hang turns into an error.
//    Long enough for a first op that connects or warms up at scale; short enough that a stuck job ends.
//  - kDefaultStoreTimeout, 300 s: the default limit of a store's blocking calls (connecting, get, wait) for
//    a store made on its own (TcpStore, InProcessStore, MpiStore, PrefixStore without a base): torch's
//    c10d::Store::kDefaultTimeout.
// DTENSOR_TIMEOUT (seconds) or InitOptions::timeout replaces kDefaultOpTimeout for init_process_group; an
// options struct or a CommOptions::timeout replaces it per group or per op. Tests pass short limits
// explicitly (testing::run_ranks: 20 s) rather than relying on a default.
//
// Range: at least 1 ms, at most kMaxTimeout (30 days), for every timeout (group timeouts, DTENSOR_TIMEOUT,
// store waits, a store wait's limit as it arrives from the network), so a deadline
// `steady_clock::now() + timeout` never overflows and gloo never sees 0 ("no limit").
//
//   dtensor::GlooOptions o;                                                       // o.timeout: 10 min
//   auto t = dtensor::detail::parse_timeout_seconds("DTENSOR_TIMEOUT", "2.5");   // 2500 ms

#include "dtensor/core/env.hpp"
#include "dtensor/core/error.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

namespace dtensor {

/// The default limit of every op of every backend, and of init_process_group (see the top of this file).
inline constexpr std::chrono::milliseconds kDefaultOpTimeout = std::chrono::minutes(10);

/// The default limit of a store's blocking calls (see the top of this file).
inline constexpr std::chrono::milliseconds kDefaultStoreTimeout = std::chrono::seconds(300);

/// The longest timeout dtensor accepts: 30 days.
inline constexpr std::chrono::milliseconds kMaxTimeout{std::int64_t{30} * 24 * 3600 * 1000};

namespace detail {

/// `text` as a number of seconds, in milliseconds within [1 ms, kMaxTimeout]; Error naming `name` (e.g.
/// "DTENSOR_TIMEOUT") and the accepted range otherwise (not a number, NaN, infinite, negative, too small,
/// too large).
inline std::chrono::milliseconds parse_timeout_seconds(std::string_view name, const std::string& text) {
  double s = 0;
  std::size_t used = 0;
  if (is_decimal_number(text)) { // no hexadecimal, sign, spaces, inf or nan
    try {
      s = std::stod(text, &used);
    } catch (...) {
      used = text.size(); // out of double's range: "out of range" below
      s = HUGE_VAL;
    }
  }
  const double max_s = static_cast<double>(kMaxTimeout.count()) / 1000.0;
  const std::string range =
      "a number of seconds from 0.001 to " + std::to_string(static_cast<long long>(max_s)) + " (30 days)";
  DTENSOR_CHECK(used == text.size() && !text.empty(), std::string(name) + "='" + text + "' is not " + range);
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

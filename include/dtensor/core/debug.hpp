#pragma once
// The debug level of communication (torch's TORCH_DISTRIBUTED_DEBUG):
//
//   DTENSOR_DEBUG=off      (or unset, empty, 0) no checks beyond the arguments
//   DTENSOR_DEBUG=detail   before each collective the members of its group compare what they are about to
//                          run (sequence number, op, dtype, sizes, root, reduce op) through the group's
//                          store, and on a difference every member throws an Error listing each member's
//                          fields; nothing is sent (backends/desync.hpp, detail::DesyncCheck)
//
//   dtensor::set_debug_level(dtensor::DebugLevel::detail);   // the same from code, for every group
//
// The level is read from the environment at the first call of debug_level() (an unknown value is an Error
// naming the variable); set_debug_level overrides it. Every member of a group must use the same level.

#include "dtensor/core/error.hpp"

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <string>
#include <string_view>

namespace dtensor {

enum class DebugLevel : int { off = 0, detail = 2 };

namespace detail {

/// The level `value` of DTENSOR_DEBUG names (see the top of this file).
inline DebugLevel parse_debug_level(std::string_view value) {
  std::string v(value);
  for (char& c : v) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (v.empty() || v == "off" || v == "0") {
    return DebugLevel::off;
  }
  if (v == "detail") {
    return DebugLevel::detail;
  }
  throw Error("environment variable DTENSOR_DEBUG='" + std::string(value) +
              "' is not a debug level: use detail (check every collective's arguments across the group) or "
              "off");
}

/// -1 until the environment was read.
inline std::atomic<int>& debug_level_state() {
  static std::atomic<int> level{-1};
  return level;
}

} // namespace detail

/// The current level: set_debug_level's, else DTENSOR_DEBUG's (read once).
inline DebugLevel debug_level() {
  int v = detail::debug_level_state().load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("DTENSOR_DEBUG");
    v = static_cast<int>(detail::parse_debug_level(env != nullptr ? env : ""));
    int expected = -1;
    if (!detail::debug_level_state().compare_exchange_strong(expected, v)) {
      v = expected;
    }
  }
  return static_cast<DebugLevel>(v);
}

/// Sets the level for every group of this process (overrides DTENSOR_DEBUG).
inline void set_debug_level(DebugLevel level) {
  detail::debug_level_state().store(static_cast<int>(level), std::memory_order_relaxed);
}

} // namespace dtensor

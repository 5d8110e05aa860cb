#pragma once
// Boolean environment variables, one truth table for all of dtensor:
//
//   "1", "true", "yes", "on"     true          (any letter case)
//   "0", "false", "no", "off"    false
//   unset or empty               the caller's default
//   anything else                dtensor::Error naming the variable and its value
//
//   if (dtensor::detail::env_flag("DTENSOR_NCCL_BLOCKING_WAIT", false)) { ... }

#include "dtensor/core/error.hpp"

#include <cctype>
#include <cstdlib>
#include <string>
#include <string_view>

namespace dtensor::detail {

/// The truth value of `value`, the text of environment variable `name` (see the table above).
inline bool parse_flag(std::string_view name, std::string_view value, bool fallback) {
  if (value.empty()) {
    return fallback;
  }
  std::string v(value);
  for (char& c : v) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (v == "1" || v == "true" || v == "yes" || v == "on") {
    return true;
  }
  if (v == "0" || v == "false" || v == "no" || v == "off") {
    return false;
  }
  throw Error("environment variable " + std::string(name) + "='" + std::string(value) +
              "' is not a flag: use 1, true, yes or on to turn it on, 0, false, no or off to turn it off");
}

/// parse_flag of the process environment's `name`.
inline bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  return parse_flag(name, v != nullptr ? std::string_view(v) : std::string_view(), fallback);
}

} // namespace dtensor::detail

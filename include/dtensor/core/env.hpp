#pragma once
// Boolean environment variables, one truth table for all of dtensor:
//
//   "1", "true", "yes", "on"     true          (any letter case)
//   "0", "false", "no", "off"    false
//   unset or empty               the caller's default
//   anything else                dtensor::Error naming the variable and its value
//
//   if (dtensor::detail::env_flag("DTENSOR_NCCL_BLOCKING_WAIT", false)) { ... }
//
// Numbers: decimal only, as written (is_decimal_number, parse_decimal_int): no sign unless negative values
// are allowed, no spaces, no hexadecimal ("0x10"), no inf or nan; anything else is an Error naming the
// variable, its value and what it takes.

#include "dtensor/core/error.hpp"

#include <cctype>
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>

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

/// Whether `text` is a plain decimal number: digits with an optional fraction and exponent ("2", "2.5",
/// ".5", "1e3"); no sign, spaces, hexadecimal, inf or nan.
inline bool is_decimal_number(std::string_view text) {
  std::size_t i = 0, digits = 0;
  const auto run = [&] {
    std::size_t n = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      ++i, ++n;
    }
    return n;
  };
  digits += run();
  if (i < text.size() && text[i] == '.') {
    ++i;
    digits += run();
  }
  if (digits == 0) {
    return false;
  }
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) {
      ++i;
    }
    if (run() == 0) {
      return false;
    }
  }
  return i == text.size();
}

/// `text`, the value of `name`, as an integer in [lo, hi]: decimal digits only (and a leading '-' where lo
/// is negative); an Error naming the variable, its value and the range otherwise.
inline long long parse_decimal_int(std::string_view name, std::string_view text, long long lo, long long hi) {
  const std::string_view digits = lo < 0 && !text.empty() && text[0] == '-' ? text.substr(1) : text;
  long long x = 0;
  const auto [at, error] = std::from_chars(text.data(), text.data() + text.size(), x);
  const bool ok = !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos &&
                  error == std::errc() && at == text.data() + text.size();
  DTENSOR_CHECK(ok && x >= lo && x <= hi, std::string(name) + "='" + std::string(text) +
                                              "' is not an integer in [" + std::to_string(lo) + ", " +
                                              std::to_string(hi) + "] (decimal digits only)");
  return x;
}

/// parse_flag of the process environment's `name`.
inline bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  return parse_flag(name, v != nullptr ? std::string_view(v) : std::string_view(), fallback);
}

} // namespace dtensor::detail

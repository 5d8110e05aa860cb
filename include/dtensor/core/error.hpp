#pragma once
// Errors: one exception type for every run-time failure, with the context a user needs to act.

#include <stdexcept>
#include <string>
#include <utility>

namespace dtensor {

/// Thrown for every run-time error dtensor detects: bad arguments, timeouts, failed peers, backend
/// errors. The message names the rank, group, op and sizes where they are known.
class Error : public std::runtime_error {
public:
  explicit Error(std::string what) : std::runtime_error(std::move(what)) {}
};

/// A peer did not arrive (or a store key did not appear) within the configured timeout.
class TimeoutError : public Error {
public:
  using Error::Error;
};

namespace detail {

[[noreturn]] inline void throw_error(std::string what) {
  throw Error(std::move(what));
}

} // namespace detail
} // namespace dtensor

/// Throws dtensor::Error with the message `msg` (any expression convertible to std::string) when
/// `cond` is false. The message is only built on failure.
#define DTENSOR_CHECK(cond, msg)                                                                             \
  do {                                                                                                       \
    if (!(cond)) [[unlikely]] {                                                                              \
      ::dtensor::detail::throw_error(msg);                                                                   \
    }                                                                                                        \
  } while (false)

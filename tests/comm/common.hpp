#pragma once
// Helpers shared by the comm tests. Inside a rank (a thread of run_ranks) never use REQUIRE/CHECK (Catch2 is
// not thread-safe): throw dtensor::Error instead, run_ranks reports it.

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/functional.hpp"
#include "dtensor/comm/p2p.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/testing/run_ranks.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace comm_test {

using namespace dtensor;

#define DTENSOR_ALL_ELEMENT_TYPES                                                                            \
  float, double, dtensor::bfloat16, dtensor::half, std::int32_t, std::int64_t, std::uint8_t

template <class T>
double as_double(T v) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<double>(v);
  } else {
    return static_cast<double>(static_cast<float>(v));
  }
}

template <class T>
T from_int(long v) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(v);
  } else {
    return T(static_cast<float>(v));
  }
}

/// The value outputs are filled with before a collective, so untouched elements show.
template <class T>
T poison() {
  return from_int<T>(std::is_unsigned_v<T> ? 201 : -77);
}

/// Throws unless t(i) == expected(i) for every flat index i (t contiguous).
template <class T, int Rank>
void expect_values(const Tensor<T, Rank>& t, const std::function<T(std::int64_t)>& expected,
                   const std::string& what) {
  const T* p = t.data();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const T e = expected(i);
    if (!(as_double(p[i]) == as_double(e))) {
      throw Error(what + ": element " + std::to_string(i) + " is " + std::to_string(as_double(p[i])) +
                  ", expected " + std::to_string(as_double(e)));
    }
  }
}

/// Throws unless fn() throws an exception of type E whose message contains every one of `parts`.
template <class E = Error>
void expect_throws(const std::function<void()>& fn, const std::vector<std::string>& parts,
                   const std::string& what, bool enabled = true) {
  if (!enabled) {
    return;
  }
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        throw Error(what + ": the message lacks \"" + p + "\": " + msg);
      }
    }
    return;
  } catch (const std::exception& e) {
    throw Error(what + ": threw the wrong exception type: " + e.what());
  }
  throw Error(what + ": did not throw");
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

} // namespace comm_test

#pragma once
// Store: the key-value store processes (or threads) rendezvous through, with c10d's verbs
// (torch.distributed.Store). Backends take one to meet their peers: gloo exchanges its pair addresses
// through it, NCCL its unique id, and both the colours and keys of split().
//
//   std::shared_ptr<dtensor::Store> store = std::make_shared<dtensor::TcpStore>(addr, port, options);
//   store->set("addr/3", bytes);
//   std::vector<char> v = store->get("addr/0");           // waits (up to timeout()) until someone sets it
//   std::int64_t n = store->add("joined", 1);             // atomic counter: the new value
//
// Contract (every implementation)
//  - Keys are strings, values bytes. set() overwrites and wakes the waiters of the key.
//  - get(), wait() and multi_get() block until the key(s) exist; after the timeout they throw
//    dtensor::TimeoutError naming the missing key(s). Other failures (a closed connection, an aborted
//    store, a value that is not an integer for add()) throw dtensor::Error naming the key.
//  - add() treats a missing key as 0 and stores the decimal text of the sum.
//  - compare_set(key, expected, desired) is atomic and follows c10d: when the key is missing and `expected`
//    is empty, or the key holds exactly `expected`, it stores `desired` and returns it; when the key is
//    missing and `expected` is not empty it returns `expected` and stores nothing; otherwise it returns the
//    current value and stores nothing.
//  - check() and try_get() never wait. num_keys() counts every key of the store.
//  - Implementations are thread safe.
//
// An implementation writes set, get, add, compare_set, delete_key, check, wait (with a timeout) and
// num_keys; try_get, multi_get and multi_set have defaults built from those, which it may replace when it
// can do better (one round trip, one lock). Derived classes re-export the convenience overloads with
// `using Store::set; using Store::wait;`.

#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor {

/// Abstract key-value store (see the top of this file).
class Store {
public:
  /// Default limit of every blocking call: kDefaultStoreTimeout (core/timeout.hpp).
  static constexpr std::chrono::milliseconds kDefaultTimeout = kDefaultStoreTimeout;

  explicit Store(std::chrono::milliseconds timeout = kDefaultTimeout) : timeout_ms_(timeout.count()) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  /// Stores `value` under `key` (overwrites) and wakes the waiters of `key`.
  virtual void set(const std::string& key, const std::vector<char>& value) = 0;
  void set(const std::string& key, std::string_view value) {
    set(key, std::vector<char>(value.begin(), value.end()));
  }

  /// The value of `key`, waiting up to timeout() for it to be set (then TimeoutError naming the key).
  virtual std::vector<char> get(const std::string& key) = 0;

  /// Atomically adds `delta` to the integer under `key` (missing: 0), stores and returns the sum.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;

  /// Atomic compare-and-set with c10d's semantics (see the top of this file); returns the value the key
  /// holds afterwards, or `expected` when the key is missing and `expected` is not empty.
  virtual std::vector<char> compare_set(const std::string& key, const std::vector<char>& expected,
                                        const std::vector<char>& desired) = 0;

  /// Removes `key`; true when it existed.
  virtual bool delete_key(const std::string& key) = 0;

  /// True when every one of `keys` exists now; never waits.
  virtual bool check(const std::vector<std::string>& keys) = 0;

  /// Blocks until every one of `keys` exists; TimeoutError naming the missing ones after `timeout`
  /// (default: timeout()).
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

  /// Number of keys in the store.
  virtual std::int64_t num_keys() = 0;

  /// The value of `key` if it is set now, else nullopt; never waits for a missing key.
  /// Default: check() then get().
  virtual std::optional<std::vector<char>> try_get(const std::string& key) {
    if (!check({key})) {
      return std::nullopt;
    }
    return get(key);
  }

  /// The values of `keys`, in order, waiting up to timeout() for all of them. Default: wait, then get each.
  virtual std::vector<std::vector<char>> multi_get(const std::vector<std::string>& keys) {
    wait(keys);
    std::vector<std::vector<char>> out;
    out.reserve(keys.size());
    for (const auto& k : keys) {
      out.push_back(get(k));
    }
    return out;
  }

  /// Sets keys[i] to values[i] for every i. Default: set each in order.
  virtual void multi_set(const std::vector<std::string>& keys, const std::vector<std::vector<char>>& values) {
    check_same_size(keys, values, "multi_set");
    for (std::size_t i = 0; i < keys.size(); ++i) {
      set(keys[i], values[i]);
    }
  }

  /// The store, for messages (e.g. "dtensor TcpStore 10.0.0.1:29500").
  virtual std::string describe() const { return "dtensor store"; }

  /// Limit of get(), wait(keys) and multi_get().
  std::chrono::milliseconds timeout() const noexcept { return std::chrono::milliseconds(timeout_ms_.load()); }
  void set_timeout(std::chrono::milliseconds timeout) {
    DTENSOR_CHECK(timeout.count() > 0, describe() + ": set_timeout: the timeout must be positive, got " +
                                           std::to_string(timeout.count()) + " ms");
    timeout_ms_.store(timeout.count());
  }

protected:
  void check_same_size(const std::vector<std::string>& keys, const std::vector<std::vector<char>>& values,
                       const char* what) const {
    DTENSOR_CHECK(keys.size() == values.size(), describe() + ": " + what + ": " +
                                                    std::to_string(keys.size()) + " keys but " +
                                                    std::to_string(values.size()) + " values");
  }

private:
  std::atomic<std::int64_t> timeout_ms_;
};

namespace detail {

/// "'a', 'b'" for messages.
inline std::string quoted_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) {
    s += (s.empty() ? "'" : ", '") + k + "'";
  }
  return s;
}

/// The message of a wait that timed out.
inline std::string store_timeout_message(const std::string& store, std::chrono::milliseconds timeout,
                                         const std::vector<std::string>& missing) {
  return store + ": timed out after " + std::to_string(timeout.count()) + " ms waiting for key(s) " +
         quoted_keys(missing);
}

} // namespace detail
} // namespace dtensor

#pragma once
// Key-value stores for gloo's rendezvous.
//
//  - InProcessStore: a thread-safe map shared by the ranks of one process (dtensor::testing::run_ranks).
//    Blocking reads wait for the key with a timeout, and abort(reason) wakes every waiter with an error,
//    so a failing rank releases the others at once.
//  - detail::PrefixedStore: a view of another store under "prefix/", holding it by shared_ptr (gloo's
//    PrefixStore holds a reference). Sub-groups rendezvous through one of these per creation.

#include "dtensor/core/error.hpp"

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace dtensor {

/// gloo::rendezvous::Store for ranks that are threads of one process.
class InProcessStore final : public ::gloo::rendezvous::Store {
public:
  explicit InProcessStore(std::chrono::milliseconds timeout = std::chrono::seconds(30)) : timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    {
      std::lock_guard lock(m_);
      map_[key] = data;
    }
    cv_.notify_all();
  }

  /// Waits (up to the store's timeout) for `key`, then returns its value.
  std::vector<char> get(const std::string& key) override {
    std::unique_lock lock(m_);
    wait_locked(lock, {key}, timeout_);
    return map_.at(key);
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::unique_lock lock(m_);
    wait_locked(lock, keys, timeout);
  }

  /// The value of `key` if it is set; never blocks, works after abort().
  std::optional<std::vector<char>> try_get(const std::string& key) const {
    std::lock_guard lock(m_);
    auto it = map_.find(key);
    if (it == map_.end()) {
      return std::nullopt;
    }
    return it->second;
  }

  /// Every current and future wait for a missing key throws dtensor::Error(reason). set() and
  /// try_get() keep working (failing ranks still leave their reason for the others).
  void abort(std::string reason) {
    {
      std::lock_guard lock(m_);
      if (!aborted_) {
        aborted_ = std::move(reason);
      }
    }
    cv_.notify_all();
  }

  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

private:
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout) {
    auto ready = [&] {
      for (const auto& k : keys) {
        if (!map_.contains(k)) {
          return false;
        }
      }
      return true;
    };
    bool ok = cv_.wait_for(lock, timeout, [&] { return aborted_.has_value() || ready(); });
    if (ready()) {
      return;
    }
    if (aborted_) {
      throw Error("store aborted: " + *aborted_);
    }
    if (!ok) {
      std::string missing;
      for (const auto& k : keys) {
        if (!map_.contains(k)) {
          missing += (missing.empty() ? "" : ", ") + k;
        }
      }
      throw TimeoutError("store: timed out after " + std::to_string(timeout.count()) +
                         " ms waiting for key(s) " + missing);
    }
  }

  std::chrono::milliseconds timeout_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::unordered_map<std::string, std::vector<char>> map_;
  std::optional<std::string> aborted_;
};

namespace detail {

/// `base` seen under "prefix/". Keeps `base` alive.
class PrefixedStore final : public ::gloo::rendezvous::Store {
public:
  PrefixedStore(std::string prefix, std::shared_ptr<::gloo::rendezvous::Store> base)
      : prefix_(std::move(prefix) + "/"), base_(std::move(base)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    base_->set(prefix_ + key, data);
  }
  std::vector<char> get(const std::string& key) override { return base_->get(prefix_ + key); }
  void wait(const std::vector<std::string>& keys) override { base_->wait(join(keys)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    base_->wait(join(keys), timeout);
  }

  const std::string& prefix() const noexcept { return prefix_; }
  const std::shared_ptr<::gloo::rendezvous::Store>& base() const noexcept { return base_; }

private:
  std::vector<std::string> join(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) {
      out.push_back(prefix_ + k);
    }
    return out;
  }

  std::string prefix_;
  std::shared_ptr<::gloo::rendezvous::Store> base_;
};

/// Reads `key` from `store` without waiting long: non-blocking on an InProcessStore, otherwise a wait of
/// `patience`. Returns nullopt when the key is not (yet) there or the store failed.
inline std::optional<std::vector<char>> store_peek(::gloo::rendezvous::Store& store, const std::string& key,
                                                   std::chrono::milliseconds patience) {
  if (auto* local = dynamic_cast<InProcessStore*>(&store)) {
    return local->try_get(key);
  }
  if (auto* prefixed = dynamic_cast<PrefixedStore*>(&store)) {
    return store_peek(*prefixed->base(), prefixed->prefix() + key, patience);
  }
  try {
    store.wait({key}, patience);
    return store.get(key);
  } catch (...) {
    return std::nullopt;
  }
}

} // namespace detail
} // namespace dtensor

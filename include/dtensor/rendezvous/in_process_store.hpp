#pragma once
// InProcessStore: a Store whose clients are threads of one process (dtensor::testing::run_ranks runs its
// ranks this way).
//
//   auto store = std::make_shared<dtensor::InProcessStore>(std::chrono::seconds(10));
//   std::thread peer([&] { store->set("ready", std::string_view("1")); });
//   store->wait({"ready"});                      // TimeoutError naming 'ready' after 10 s
//
// Besides the Store contract: abort(reason) makes every current and future wait for a missing key throw
// dtensor::Error carrying `reason` (a failing rank releases the others at once), while set(), try_get()
// and reads of existing keys keep working, so failing ranks can still leave their reasons for the others.

#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dtensor {

/// Store for ranks that are threads of one process (see the top of this file).
class InProcessStore final : public Store {
public:
  explicit InProcessStore(std::chrono::milliseconds timeout = kDefaultStoreTimeout) : Store(timeout) {}

  using Store::set;
  using Store::wait;

  void set(const std::string& key, const std::vector<char>& value) override {
    {
      std::lock_guard lock(m_);
      map_[key] = value;
    }
    cv_.notify_all();
  }

  std::vector<char> get(const std::string& key) override {
    std::unique_lock lock(m_);
    wait_locked(lock, {key}, timeout());
    return map_.at(key);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    std::int64_t value = 0;
    {
      std::lock_guard lock(m_);
      auto it = map_.find(key);
      if (it != map_.end()) {
        value = parse_int(key, it->second);
      }
      value =
          static_cast<std::int64_t>(static_cast<std::uint64_t>(value) + static_cast<std::uint64_t>(delta));
      const std::string text = std::to_string(value);
      map_[key] = std::vector<char>(text.begin(), text.end());
    }
    cv_.notify_all();
    return value;
  }

  std::vector<char> compare_set(const std::string& key, const std::vector<char>& expected,
                                const std::vector<char>& desired) override {
    std::vector<char> result;
    {
      std::lock_guard lock(m_);
      auto it = map_.find(key);
      if (it == map_.end() && !expected.empty()) {
        return expected;
      }
      if (it != map_.end() && it->second != expected) {
        return it->second;
      }
      map_[key] = desired;
      result = desired;
    }
    cv_.notify_all();
    return result;
  }

  bool delete_key(const std::string& key) override {
    std::lock_guard lock(m_);
    return map_.erase(key) > 0;
  }

  bool check(const std::vector<std::string>& keys) override {
    std::lock_guard lock(m_);
    return has_all(keys);
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(m_);
    wait_locked(lock, keys, timeout);
  }

  std::int64_t num_keys() override {
    std::lock_guard lock(m_);
    return static_cast<std::int64_t>(map_.size());
  }

  /// The value of `key` if it is set; never blocks, works after abort().
  std::optional<std::vector<char>> try_get(const std::string& key) override {
    std::lock_guard lock(m_);
    auto it = map_.find(key);
    if (it == map_.end()) {
      return std::nullopt;
    }
    return it->second;
  }

  std::vector<std::vector<char>> multi_get(const std::vector<std::string>& keys) override {
    std::unique_lock lock(m_);
    wait_locked(lock, keys, timeout());
    std::vector<std::vector<char>> out;
    out.reserve(keys.size());
    for (const auto& k : keys) {
      out.push_back(map_.at(k));
    }
    return out;
  }

  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::vector<char>>& values) override {
    check_same_size(keys, values, "multi_set");
    {
      std::lock_guard lock(m_);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        map_[keys[i]] = values[i];
      }
    }
    cv_.notify_all();
  }

  std::string describe() const override { return "dtensor InProcessStore"; }

  /// Every current and future wait for a missing key throws dtensor::Error("store aborted: " + reason).
  /// The first reason stays. set(), try_get() and reads of existing keys keep working.
  void abort(std::string reason) {
    {
      std::lock_guard lock(m_);
      if (!aborted_) {
        aborted_ = std::move(reason);
      }
    }
    cv_.notify_all();
  }

private:
  bool has_all(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (!map_.contains(k)) {
        return false;
      }
    }
    return true;
  }

  std::int64_t parse_int(const std::string& key, const std::vector<char>& v) const {
    const std::string text(v.begin(), v.end());
    std::size_t used = 0;
    std::int64_t x = 0;
    try {
      x = std::stoll(text, &used);
    } catch (...) {
      used = 0;
    }
    DTENSOR_CHECK(used == text.size() && !text.empty(),
                  describe() + ": add('" + key + "'): the current value is not an integer");
    return x;
  }

  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout) {
    const bool in_time = cv_.wait_for(lock, timeout, [&] { return aborted_.has_value() || has_all(keys); });
    if (has_all(keys)) {
      return;
    }
    if (aborted_) {
      throw Error("store aborted: " + *aborted_);
    }
    if (!in_time) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!map_.contains(k)) {
          missing.push_back(k);
        }
      }
      throw TimeoutError(detail::store_timeout_message(describe(), timeout, missing));
    }
  }

  mutable std::mutex m_;
  std::condition_variable cv_;
  std::unordered_map<std::string, std::vector<char>> map_;
  std::optional<std::string> aborted_;
};

} // namespace dtensor

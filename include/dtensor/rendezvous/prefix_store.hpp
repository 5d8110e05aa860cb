#pragma once
// PrefixStore: another Store seen under "<prefix>/" (c10d's PrefixStore). Each process group rendezvouses
// through one, so groups sharing the job's store never see each other's keys.
//
//   auto job = std::make_shared<dtensor::TcpStore>(addr, port, options);
//   auto group = std::make_shared<dtensor::PrefixStore>("dtensor/world/g0", job);
//   group->set("connected/1", std::string_view("ok"));          // job key "dtensor/world/g0/connected/1"
//
// Contract: every verb acts on the base store's key "<prefix>/<key>"; messages name those full keys.
// Blocking calls use this view's own timeout (initially the base's, see set_timeout()). num_keys() counts
// every key of the base store, as c10d's does. Holds the base store alive; views may be nested.

#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtensor {

/// `base` seen under "<prefix>/" (see the top of this file).
class PrefixStore final : public Store {
public:
  /// Throws Error when `base` is null.
  PrefixStore(std::string prefix, std::shared_ptr<Store> base)
      : Store(base != nullptr ? base->timeout() : kDefaultStoreTimeout), prefix_(std::move(prefix)),
        base_(std::move(base)) {
    DTENSOR_CHECK(base_ != nullptr, "PrefixStore('" + prefix_ + "'): the base store is null");
  }

  using Store::set;
  using Store::wait;

  void set(const std::string& key, const std::vector<char>& value) override { base_->set(full(key), value); }

  std::vector<char> get(const std::string& key) override {
    const std::string k = full(key);
    base_->wait({k}, timeout());
    return base_->get(k);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    return base_->add(full(key), delta);
  }

  std::vector<char> compare_set(const std::string& key, const std::vector<char>& expected,
                                const std::vector<char>& desired) override {
    return base_->compare_set(full(key), expected, desired);
  }

  bool delete_key(const std::string& key) override { return base_->delete_key(full(key)); }

  bool check(const std::vector<std::string>& keys) override { return base_->check(full(keys)); }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    base_->wait(full(keys), timeout);
  }

  std::int64_t num_keys() override { return base_->num_keys(); }

  std::optional<std::vector<char>> try_get(const std::string& key) override {
    return base_->try_get(full(key));
  }

  std::vector<std::vector<char>> multi_get(const std::vector<std::string>& keys) override {
    const auto ks = full(keys);
    base_->wait(ks, timeout());
    return base_->multi_get(ks);
  }

  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::vector<char>>& values) override {
    check_same_size(keys, values, "multi_set");
    base_->multi_set(full(keys), values);
  }

  std::string describe() const override { return base_->describe() + " (prefix '" + prefix_ + "')"; }

  /// The prefix, without the separating '/'.
  const std::string& prefix() const noexcept { return prefix_; }
  /// The store the keys live in.
  const std::shared_ptr<Store>& base() const noexcept { return base_; }

private:
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }

  std::vector<std::string> full(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) {
      out.push_back(full(k));
    }
    return out;
  }

  std::string prefix_;
  std::shared_ptr<Store> base_;
};

} // namespace dtensor

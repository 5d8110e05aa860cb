#pragma once
// GlooTcpStore: a dtensor::TcpStore seen as gloo's rendezvous store, so gloo's rendezvous (and the gloo
// backend's error reports) go through the TCP store of a multi-process job.
//
//   auto tcp = std::make_shared<dtensor::TcpStore>("10.0.0.1", 29500, dtensor::TcpStoreOptions{});
//   dtensor::ProcessGroup world(dtensor::make_gloo_backend(std::make_shared<dtensor::GlooTcpStore>(tcp), r,
//   n));

#include "dtensor/comm/tcp_store.hpp"

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtensor {

/// gloo::rendezvous::Store over a shared dtensor::TcpStore (which it keeps alive). Blocking calls use the
/// TcpStore's timeout unless one is given; they throw dtensor::TimeoutError / dtensor::Error.
class GlooTcpStore final : public ::gloo::rendezvous::Store {
public:
  explicit GlooTcpStore(std::shared_ptr<TcpStore> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<char>& data) override { store_->set(key, data); }
  std::vector<char> get(const std::string& key) override { return store_->get(key); }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

  const std::shared_ptr<TcpStore>& tcp_store() const noexcept { return store_; }

private:
  std::shared_ptr<TcpStore> store_;
};

} // namespace dtensor

#pragma once
// How the gloo backend meets its peers: a dtensor::Store seen as gloo's rendezvous store, for
// gloo::rendezvous::Context::connectFullMesh (the counterpart of backends/nccl/rendezvous.hpp).
//
//   auto store = std::make_shared<dtensor::PrefixStore>("bench/raw", job_store);
//   dtensor::GlooStoreAdapter gs(store);
//   context->connectFullMesh(gs, device);

#include "dtensor/rendezvous/store.hpp"

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtensor {

/// gloo::rendezvous::Store over a shared dtensor::Store (which it keeps alive). Every call forwards to the
/// same verb: blocking calls use the dtensor store's timeout unless one is given, and throw
/// dtensor::TimeoutError / dtensor::Error naming the keys.
class GlooStoreAdapter final : public ::gloo::rendezvous::Store {
public:
  explicit GlooStoreAdapter(std::shared_ptr<dtensor::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<char>& data) override { store_->set(key, data); }
  std::vector<char> get(const std::string& key) override { return store_->get(key); }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

  const std::shared_ptr<dtensor::Store>& store() const noexcept { return store_; }

private:
  std::shared_ptr<dtensor::Store> store_;
};

} // namespace dtensor

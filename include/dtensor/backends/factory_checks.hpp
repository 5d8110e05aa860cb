#pragma once
// What the backend factories (make_gloo_backend, make_nccl_backend) check and set up before they make the
// world group, written once:
//
//   detail::check_world_rank(rank, size, "make_gloo_backend");        // 0 <= rank < size
//   std::shared_ptr<Store> root = detail::prefixed_store(options.prefix, store);  // null for a null store
//   ... Impl(..., detail::world_ranks(size), rank, ...);              // the world: global ranks 0..size-1
//
// What differs stays in the factory: gloo requires a store and checks the timeout; NCCL takes a null store
// for a one-rank job and picks a CUDA device.

#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace dtensor::detail {

/// Throws Error("<what>: rank <rank> is out of range for size <size>") unless 0 <= rank < size.
inline void check_world_rank(int rank, int size, const char* what) {
  DTENSOR_CHECK(size > 0 && rank >= 0 && rank < size, std::string(what) + ": rank " + std::to_string(rank) +
                                                          " is out of range for size " +
                                                          std::to_string(size));
}

/// The global ranks of a world group of `size` ranks: 0, 1, ..., size - 1.
inline std::vector<int> world_ranks(int size) {
  std::vector<int> all(static_cast<std::size_t>(size));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

/// `store` under `prefix` (a PrefixStore), or null when `store` is null.
inline std::shared_ptr<Store> prefixed_store(std::string prefix, std::shared_ptr<Store> store) {
  if (store == nullptr) {
    return nullptr;
  }
  return std::make_shared<PrefixStore>(std::move(prefix), std::move(store));
}

} // namespace dtensor::detail

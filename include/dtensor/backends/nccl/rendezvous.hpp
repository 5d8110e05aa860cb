#pragma once
// How the NCCL backend meets its peers: the unique id of the world communicator, exchanged through a
// dtensor::Store (the counterpart of backends/gloo/rendezvous.hpp). Sub-communicators need no id
// (ncclCommSplit); their colours and keys meet in the store too (backends/split.hpp).

#include "dtensor/backends/nccl/types.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <nccl.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace dtensor::detail {

/// Rank 0 creates the id and publishes it under `key`; the others wait for it (TimeoutError after
/// `timeout`, naming the key), and the last of them to read it deletes it. With one rank the store may be
/// null: the id stays local.
inline ncclUniqueId exchange_nccl_unique_id(Store* store, const std::string& key, int rank, int size,
                                            std::chrono::milliseconds timeout) {
  ncclUniqueId id{};
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    DTENSOR_CHECK(r == ncclSuccess, "NCCL backend: ncclGetUniqueId failed: " + nccl_error_text(r));
    if (size > 1) {
      DTENSOR_CHECK(store != nullptr, "NCCL backend: a store is needed to share the unique id of " +
                                          std::to_string(size) + " ranks");
      store->set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    }
    return id;
  }
  DTENSOR_CHECK(store != nullptr,
                "NCCL backend: rank " + std::to_string(rank) + " has no store to read the unique id from");
  store->wait({key}, timeout);
  const std::vector<char> v = store->get(key);
  DTENSOR_CHECK(v.size() == sizeof(id.internal), "NCCL backend: the unique id under '" + key + "' has " +
                                                     std::to_string(v.size()) + " bytes, expected " +
                                                     std::to_string(sizeof(id.internal)));
  std::memcpy(id.internal, v.data(), v.size());
  delete_after_all_read(*store, key + "/read", size - 1, {key});
  return id;
}

} // namespace dtensor::detail

#pragma once
// store_barrier: processes meet at a named point through any Store (torch's store-based barrier);
// delete_after_all_read: rendezvous keys removed once every reader is done with them.
//
//   dtensor::store_barrier(*store, "init/ready", world_size, std::chrono::seconds(60));
//   dtensor::delete_after_all_read(*store, "split3/read", size, keys);   // after this caller's last read
//
// Contract: every one of `world_size` callers of one name returns once all of them have called it, or
// throws dtensor::TimeoutError saying how many arrived after `timeout`. Each name is single use (it leaves
// the keys "<name>/arrived", "<name>/done", "<name>/left", "<name>/all_left"). With wait_for_all_to_leave,
// a caller returns only after every caller has been released, so the process hosting the store (a
// TcpStore server) may exit right after it without cutting the others off.

#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor {

/// See the top of this file.
inline void store_barrier(Store& store, const std::string& name, int world_size,
                          std::chrono::milliseconds timeout, bool wait_for_all_to_leave = false) {
  const std::int64_t arrived = store.add(name + "/arrived", 1);
  if (arrived == world_size) {
    store.set(name + "/done", std::string_view("1"));
  }
  try {
    store.wait({name + "/done"}, timeout);
    if (store.add(name + "/left", 1) == world_size) {
      store.set(name + "/all_left", std::string_view("1"));
    }
    if (wait_for_all_to_leave) {
      store.wait({name + "/all_left"}, timeout);
    }
  } catch (const TimeoutError&) {
    std::int64_t now = -1;
    try {
      now = store.add(name + "/arrived", 0);
    } catch (...) {
    }
    throw TimeoutError(store.describe() + ": barrier '" + name + "' timed out after " +
                       std::to_string(timeout.count()) + " ms: " + std::to_string(now) + " of " +
                       std::to_string(world_size) + " processes arrived");
  }
}

/// Deletes `keys` once each of `readers` callers has read them: every reader calls this after its last read
/// of them, and the last one deletes them with the counter `counter`. (Each group creation's rendezvous
/// keys would otherwise stay in the job's store for the job's whole life.)
inline void delete_after_all_read(Store& store, const std::string& counter, int readers,
                                  const std::vector<std::string>& keys) {
  if (store.add(counter, 1) < readers) {
    return;
  }
  for (const auto& k : keys) {
    store.delete_key(k);
  }
  store.delete_key(counter);
}

} // namespace dtensor

#pragma once
// store_barrier: processes meet at a named point through any Store (torch's store-based barrier).
//
//   dtensor::store_barrier(*store, "init/ready", world_size, std::chrono::seconds(60));
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

} // namespace dtensor

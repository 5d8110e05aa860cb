#pragma once
// torch's monitored_barrier (wait_all_ranks=True), through a group's store rather than its communicator,
// so it also works when the communicator is stuck. Backend::monitored_barrier (backends/backend.hpp) counts
// the calls and calls this for a group of several members.
//
//   detail::monitored_barrier(store, n, rank, global_ranks, limit, where);   // n: this group's calls so far
//
// Protocol: each member leaves "mbarrier/<n>/<rank>" in the store and waits up to `limit` for every other
// member's. At the deadline, TimeoutError names the members missing, e.g. "<where> #2: ranks 1, 3 (global
// 5, 7) did not arrive within 500 ms". Each member deletes its key of #n-2 once it passed #n.

#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor::detail {

/// Monitored barrier #n of the group whose members are `global_ranks` (this member: `rank`), through
/// `store` (Error when it is null), waiting up to `limit`. `where` ("<describe()>: monitored_barrier")
/// heads the messages. See the top of this file.
inline void monitored_barrier(Store* store, std::int64_t n, int rank, std::span<const int> global_ranks,
                              std::chrono::milliseconds limit, const std::string& where) {
  const int size = static_cast<int>(global_ranks.size());
  DTENSOR_CHECK(store != nullptr, where + ": this backend has no store to meet through");
  check_timeout(limit, where);
  const auto key = [](std::int64_t k, int r) {
    return "mbarrier/" + std::to_string(k) + "/" + std::to_string(r);
  };
  store->set(key(n, rank), std::string_view("arrived"));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    keys.push_back(key(n, r));
  }
  try {
    store->wait(keys, limit);
  } catch (const std::exception& e) {
    std::vector<int> missing;
    std::vector<int> missing_global;
    for (int r = 0; r < size; ++r) {
      bool there = false;
      try {
        there = store->check({keys[static_cast<std::size_t>(r)]});
      } catch (...) {
      }
      if (!there) {
        missing.push_back(r);
        missing_global.push_back(global_ranks[static_cast<std::size_t>(r)]);
      }
    }
    if (missing.empty()) { // every member came, but the wait did not see it in time (the store failed)
      throw TimeoutError(where + " #" + std::to_string(n) + ": " + e.what());
    }
    throw TimeoutError(where + " #" + std::to_string(n) + ": " + (missing.size() == 1 ? "rank " : "ranks ") +
                       format_list(missing, ", ", "", "") + " (global " +
                       format_list(missing_global, ", ", "", "") + ") did not arrive within " +
                       std::to_string(limit.count()) + " ms");
  }
  if (n >= 2) { // every member passed #n-2 before arriving at #n-1, which this rank saw
    try {
      store->delete_key(key(n - 2, rank));
    } catch (...) {
    }
  }
}

} // namespace dtensor::detail

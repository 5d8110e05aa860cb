#pragma once
// What each rank is creating, so that a group creation that fails can say why: members that create their
// groups in different orders wait for each other until the timeout, and the message then says so on every
// member. Backend::new_group and Backend::split (backends/backend.hpp) wrap their hooks in it.
//
//   auto g = detail::report_group_creation(rank_store, my_global_rank, "new_group([0,2])", {0, 2},
//                                          [&] { return do_new_group(...); });
//
// Protocol: before `make` runs, this rank leaves "creating <desc>" under "creating/<global rank>" in the
// store shared by every group of the job, and "created <desc>" once `make` returned (best effort: a store
// that fails is ignored). When `make` throws Error, each member of `members` (global ranks) whose entry is
// not "creating <desc>" is named with what it was doing, e.g. "... [while this rank (global 0) was making
// new_group([0,2]): global rank 2 is at: creating split #1 of group [0,1,2]; do the members create their
// groups in different orders?]"; a TimeoutError stays one. When every member is making the same group, the
// error passes unchanged.

#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor::detail {

/// make(), reported under "creating/<me>" in `store` (may be null: then only make()); see the top of this
/// file. `desc` is the same text on every member that makes the same group.
template <class Make>
auto report_group_creation(Store* store, int me, const std::string& desc, const std::vector<int>& members,
                           Make&& make) -> decltype(make()) {
  const auto note = [&](const std::string& what) {
    if (store != nullptr) {
      try {
        store->set("creating/" + std::to_string(me), std::string_view(what));
      } catch (...) { // the report is best effort: the store may be gone with a failed process
      }
    }
  };
  note("creating " + desc);
  std::string elsewhere;
  try {
    auto group = make();
    note("created " + desc);
    return group;
  } catch (const Error& e) {
    for (int m : members) {
      std::optional<std::vector<char>> v;
      try {
        v = m == me || store == nullptr ? std::nullopt : store->try_get("creating/" + std::to_string(m));
      } catch (...) {
      }
      const std::string theirs = v ? std::string(v->begin(), v->end()) : "";
      if (m != me && store != nullptr && theirs != "creating " + desc) {
        elsewhere += (elsewhere.empty() ? "" : "; ") + std::string("global rank ") + std::to_string(m) +
                     (theirs.empty() ? " has made no group yet" : " is at: " + theirs);
      }
    }
    if (elsewhere.empty()) {
      throw;
    }
    const std::string msg = std::string(e.what()) + " [while this rank (global " + std::to_string(me) +
                            ") was making " + desc + ": " + elsewhere +
                            "; do the members create their groups in different orders?]";
    if (dynamic_cast<const TimeoutError*>(&e) != nullptr) {
      throw TimeoutError(msg);
    }
    throw Error(msg);
  }
}

} // namespace dtensor::detail

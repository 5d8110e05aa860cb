#pragma once
// How new groups find their members, written once for every backend (Backend::split and the backends'
// new_group hooks use it), and SplitGroup, what Backend::split hands a backend's do_split hook.
//
//   auto all = detail::exchange_split_colors(*store, "split3", rank, size, color, key, timeout, what);
//   auto [members, me] = detail::split_members(all, color, rank);   // members: old group ranks
//
// Contract: every member of the old group calls exchange_split_colors with the same `name` (unique per
// split of that group) and gets every member's (colour, key), in old-group rank order; the last member to
// read them deletes the keys. Members with one
// colour >= 0 form a group ordered by (key, old rank), as ncclCommSplit orders it. new_group is made by
// its members only: they meet under a name made of their global ranks and how many groups over that list
// this rank made before (GroupGenerations, backends/group_generations.hpp), so ranks outside the list never
// take part.

#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <algorithm>
#include <chrono>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace dtensor {

/// What split() hands its hook (Backend::do_split): the new group as every member computed it.
struct SplitGroup {
  int color = 0;
  int key = 0;
  /// How many splits of this group came before (every member counts the same): names the new group's
  /// rendezvous, e.g. under "s<index>c<color>".
  int index = 0;
  /// The new group's members as global ranks, in new-group order (empty when color < 0).
  std::vector<int> global_ranks;
  /// This member's rank in the new group; -1 when color < 0.
  int rank = -1;
};

/// One member's arguments to split(): its colour and key.
struct SplitEntry {
  int color = 0;
  int key = 0;
  friend constexpr bool operator==(const SplitEntry&, const SplitEntry&) noexcept = default;
};

} // namespace dtensor

namespace dtensor::detail {

using dtensor::SplitEntry;

/// The members of one colour: their old-group ranks in new-group order, and this member's new rank
/// (-1 when it is not one of them).
struct SplitMembers {
  std::vector<int> ranks;
  int me = -1;
};

/// A decimal int with an optional '-', nothing else; false when `text` is not one or overflows.
constexpr bool parse_int(std::string_view text, int& out) {
  const bool negative = !text.empty() && text.front() == '-';
  if (negative) {
    text.remove_prefix(1);
  }
  if (text.empty() || text.size() > 10) {
    return false;
  }
  long long v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') {
      return false;
    }
    v = v * 10 + (c - '0');
  }
  v = negative ? -v : v;
  if (v < -2147483648LL || v > 2147483647LL) {
    return false;
  }
  out = static_cast<int>(v);
  return true;
}

/// Every member's (colour, key), in old-group rank order. Member `rank` of `size` sets
/// "<name>/<rank>" to "<colour> <key>" and waits up to `timeout` for the others: TimeoutError starting
/// with `what` ("rank 1 of gloo group [0,1]: split(color 0, key 1) #2") and naming the missing keys.
inline std::vector<SplitEntry> exchange_split_colors(Store& store, const std::string& name, int rank,
                                                     int size, int color, int key,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& what) {
  const std::string mine = std::to_string(color) + " " + std::to_string(key);
  store.set(name + "/" + std::to_string(rank), std::string_view(mine));
  std::vector<std::string> keys;
  keys.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    keys.push_back(name + "/" + std::to_string(r));
  }
  try {
    store.wait(keys, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(what + ": not every member called split in time: " + e.what());
  }
  const auto values = store.multi_get(keys);
  delete_after_all_read(store, name + "/read", size, keys);
  std::vector<SplitEntry> out(values.size());
  for (std::size_t r = 0; r < values.size(); ++r) {
    const std::string_view text(values[r].data(), values[r].size());
    const auto space = text.find(' ');
    const bool ok = space != std::string_view::npos && parse_int(text.substr(0, space), out[r].color) &&
                    parse_int(text.substr(space + 1), out[r].key);
    DTENSOR_CHECK(ok, what + ": member " + std::to_string(r) + " left a malformed entry '" +
                          std::string(text) + "' under '" + keys[r] +
                          "' (another job shares this store and prefix?)");
  }
  return out;
}

/// The members of colour `color` (see SplitMembers); empty with me = -1 when color < 0.
inline SplitMembers split_members(std::span<const SplitEntry> all, int color, int rank) {
  SplitMembers m;
  if (color < 0) {
    return m;
  }
  std::vector<std::tuple<int, int>> order; // (key, old rank)
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[static_cast<std::size_t>(r)].color == color) {
      order.emplace_back(all[static_cast<std::size_t>(r)].key, r);
    }
  }
  std::sort(order.begin(), order.end());
  for (auto [k, r] : order) {
    if (r == rank) {
      m.me = static_cast<int>(m.ranks.size());
    }
    m.ranks.push_back(r);
  }
  return m;
}

} // namespace dtensor::detail

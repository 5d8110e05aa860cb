#pragma once
// How many groups one rank made over each member list, which names the rendezvous of the next one:
//
//   std::string name = generations.next_name({0, 2});   // "members[0,2]#0", then #1, ...
//
// The backends' new_group hooks use it (backends/split.hpp says why groups are named this way).

#include "dtensor/core/format.hpp"

#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dtensor::detail {

/// How many groups one rank made over each member list (global ranks, in group order). One per rank,
/// shared by all its groups: the members of a list make its groups in the same order, so the count names
/// the rendezvous of the next one.
class GroupGenerations {
public:
  /// "members[0,2]#1": the rendezvous name of the next group over `global` (counts this call).
  std::string next_name(const std::vector<int>& global) {
    int generation = 0;
    {
      std::lock_guard lock(m_);
      generation = counts_[global]++;
    }
    return "members" + format_list(global) + "#" + std::to_string(generation);
  }

private:
  std::mutex m_;
  std::map<std::vector<int>, int> counts_;
};

} // namespace dtensor::detail

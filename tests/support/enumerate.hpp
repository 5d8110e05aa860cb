#pragma once
// Enumerations shared by the exhaustive tests.

#include <dtensor/layout/placement.hpp>

#include <functional>
#include <vector>

namespace dtensor::test_support {

/// Every placement list of `axes` entries drawn from `options`, in lexicographic order of the options.
inline std::vector<PlacementList> all_placement_lists(int axes, const std::vector<Placement>& options) {
  std::vector<PlacementList> out;
  std::function<void(PlacementList)> rec = [&](PlacementList l) {
    if (l.size() == axes) {
      out.push_back(l);
      return;
    }
    for (const Placement& p : options) {
      PlacementList next = l;
      next.push_back(p);
      rec(next);
    }
  };
  rec({});
  return out;
}

} // namespace dtensor::test_support

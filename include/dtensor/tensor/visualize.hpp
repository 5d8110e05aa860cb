#pragma once
// visualize_sharding: which mesh coordinates hold which block of a 1-D or 2-D DTensor, as a table.
//
//   [S(0),S(1)] of global (7, 5) on (dp=2, tp=2)
//   rows  cols  coordinates
//   0:4   0:3   (0, 0)
//   0:4   3:5   (0, 1)
//   ...
//
// Computed from the layout alone (no communication); every rank prints the same table.

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/core/extents.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {

/// The table for a layout: one row per distinct block (in global order), with the coordinates holding it.
inline std::string sharding_table(const Extents& global, const ShardSpec& spec, const MeshSizes& sizes,
                                  const std::string& title) {
  std::map<std::vector<std::int64_t>, std::pair<Block, std::string>> rows; // key: offsets then shape
  for (int r = 0; r < mesh_numel(sizes); ++r) {
    const MeshCoord c = rank_to_coord(r, sizes);
    const Block b = spec_block(global, spec, sizes, c);
    std::vector<std::int64_t> key(b.offset.begin(), b.offset.end());
    key.insert(key.end(), b.shape.begin(), b.shape.end());
    std::string coord = "(";
    for (int a = 0; a < c.size(); ++a) {
      coord += (a ? ", " : "") + std::to_string(c[a]);
    }
    coord += ")";
    auto& row = rows[key];
    row.first = b;
    row.second += (row.second.empty() ? "" : " ") + coord;
  }
  static const char* dim_names[] = {"rows", "cols"};
  std::string s = title + "\n";
  char buf[64];
  for (int d = 0; d < global.size(); ++d) {
    std::snprintf(buf, sizeof buf, "%-10s", global.size() == 1 ? "elements" : dim_names[d]);
    s += buf;
  }
  s += "coordinates\n";
  for (const auto& [key, row] : rows) {
    for (int d = 0; d < global.size(); ++d) {
      const Block& b = row.first;
      std::snprintf(buf, sizeof buf, "%lld:%lld", static_cast<long long>(b.offset[d]),
                    static_cast<long long>(b.offset[d] + b.shape[d]));
      std::string cell = buf;
      cell.resize(10, ' ');
      s += cell;
    }
    s += row.second + (numel(row.first.shape) == 0 ? "  (empty)" : "") + "\n";
  }
  return s;
}

} // namespace detail

/// The sharding table of a 1-D or 2-D DTensor.
template <class DT>
std::string visualize_sharding(const DT& x) {
  static_assert(DT::rank == 1 || DT::rank == 2, "visualize_sharding: only 1-D and 2-D tensors have a table");
  const Extents global = detail::to_extents(x.global_shape());
  std::string title = to_string(DT::placements) + " of global " + detail::shape_string(global) + " on " +
                      mesh_to_string(DT::mesh_type::shape_type::names, x.mesh().sizes());
  return detail::sharding_table(global, DT::spec, x.mesh().sizes(), title);
}

} // namespace dtensor

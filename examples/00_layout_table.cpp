// 00: where each rank's shard of a global tensor lives, for a few placement lists on a 2-D mesh.
//
// No communication: this is the layout algebra alone. For a (dp=2, tp=3) mesh and a 7x5 tensor it prints,
// for each placement list, every rank's mesh coordinate, local shape and global offset (uneven and empty
// shards included), and checks that the blocks tile the tensor.

#include <dtensor/layout/algebra.hpp>
#include <dtensor/layout/placement_check.hpp>
#include <dtensor/mesh/mesh_shape.hpp>

#include <cstdio>
#include <string>
#include <vector>

using namespace dtensor;

using Mesh = MeshShape<Axis<"dp", 2>, Axis<"tp", 3>>;

namespace {

std::string extents_to_string(const Extents& e) {
  std::string s = "(";
  for (int i = 0; i < e.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(e[i]);
  }
  return s + ")";
}

// Prints the table for one placement list; returns false if the blocks do not tile the tensor the way
// the placements say (each element held by exactly as many ranks as there are non-sharding coordinates).
template <class... P>
bool print_table(const Extents& global) {
  static_assert(validate_placements<Mesh, 2, P...>());
  constexpr PlacementList placements = placement_list_v<P...>;
  constexpr MeshSizes sizes = Mesh::sizes();
  std::printf("\n%s on mesh %s, global shape %s\n", to_string(placements).c_str(), Mesh::to_string().c_str(),
              extents_to_string(global).c_str());
  std::printf("  %-5s %-8s %-12s %-12s\n", "rank", "coord", "local shape", "offset");
  std::vector<int> holders(numel(global), 0);
  int replication = 1;
  for (int a = 0; a < sizes.size(); ++a) {
    replication *= placements[a].is_shard() ? 1 : sizes[a];
  }
  for (int r = 0; r < mesh_numel(sizes); ++r) {
    const MeshCoord c = rank_to_coord(r, sizes);
    const Block b = local_block(global, placements, sizes, c);
    std::printf("  %-5d (%d, %d)   %-12s %-12s%s\n", r, c[0], c[1], extents_to_string(b.shape).c_str(),
                extents_to_string(b.offset).c_str(), numel(b.shape) == 0 ? "  empty" : "");
    for (std::int64_t i = 0; i < b.shape[0]; ++i) {
      for (std::int64_t j = 0; j < b.shape[1]; ++j) {
        ++holders[(b.offset[0] + i) * global[1] + b.offset[1] + j];
      }
    }
  }
  for (int h : holders) {
    if (h != replication) {
      std::printf("  ERROR: an element is held by %d ranks, expected %d\n", h, replication);
      return false;
    }
  }
  return true;
}

} // namespace

int main() {
  const Extents global{7, 5};
  bool ok = true;
  ok &= print_table<Shard<0>, Replicate>(global);
  ok &= print_table<Shard<0>, Shard<1>>(global);
  ok &= print_table<Shard<0>, Shard<0>>(global);
  ok &= print_table<Replicate, Shard<-1>>(global);
  ok &= print_table<Partial<>, Shard<1>>(global);
  std::printf("\n%s\n", ok ? "all layouts tile the tensor" : "LAYOUT ERROR");
  return ok ? 0 : 1;
}

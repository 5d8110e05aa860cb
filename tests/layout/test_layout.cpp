// Property tests of the layout algebra against an independent brute-force reference.
//
// Ranges covered exhaustively: every mesh of 1-3 axes with sizes 1-4 (84 meshes; 1-4 axes for the rank
// and group functions), tensor ranks 1-3 with every dim size 0-9, and every placement list drawn from
// {R, P(sum), S(0), ..., S(rank-1), S(-1)} per axis.

#include <catch2/catch.hpp>

#include "../support/enumerate.hpp"

#include <dtensor/layout/algebra.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

using namespace dtensor;

namespace {

// Every mesh with 1..max_axes axes of sizes 1..4.
std::vector<MeshSizes> all_meshes(int max_axes) {
  std::vector<MeshSizes> out;
  std::function<void(MeshSizes)> rec = [&](MeshSizes m) {
    if (m.size() > 0) {
      out.push_back(m);
    }
    if (m.size() == max_axes) {
      return;
    }
    for (int s = 1; s <= 4; ++s) {
      MeshSizes next = m;
      next.push_back(s);
      rec(next);
    }
  };
  rec({});
  return out;
}

// Reference coordinate of a rank: count up an odometer (last axis fastest) `rank` times.
std::vector<int> reference_coord(int rank, const MeshSizes& sizes) {
  std::vector<int> c(sizes.size(), 0);
  for (int r = 0; r < rank; ++r) {
    for (int a = sizes.size() - 1; a >= 0; --a) {
      if (++c[a] < sizes[a]) {
        break;
      }
      c[a] = 0;
    }
  }
  return c;
}

// Reference split of a list of global indices into k torch.chunk pieces, by building the pieces: each
// piece takes ceil(len/k) items from the front of what is left.
std::vector<std::vector<std::int64_t>> reference_chunks(const std::vector<std::int64_t>& items, int k) {
  std::int64_t per = 0;
  while (per * k < static_cast<std::int64_t>(items.size())) {
    ++per;
  }
  std::vector<std::vector<std::int64_t>> pieces(k);
  std::size_t next = 0;
  for (int i = 0; i < k; ++i) {
    for (std::int64_t j = 0; j < per && next < items.size(); ++j) {
      pieces[i].push_back(items[next++]);
    }
  }
  return pieces;
}

// The global indices along `dim` (of size n) that the rank at `coord` owns, found by simulating the
// splits one mesh axis at a time; `end` receives the position just past the owning parent block (the
// offset an empty block reports).
std::vector<std::int64_t> reference_owned(std::int64_t n, int dim, int tensor_rank, const PlacementList& pl,
                                          const MeshSizes& sizes, const std::vector<int>& coord,
                                          std::int64_t& empty_offset) {
  std::vector<std::int64_t> items(n);
  for (std::int64_t i = 0; i < n; ++i) {
    items[i] = i;
  }
  empty_offset = 0;
  for (int a = 0; a < pl.size(); ++a) {
    const bool shards = pl[a].is_shard() && (pl[a].dim == dim || pl[a].dim + tensor_rank == dim);
    if (!shards) {
      continue;
    }
    const auto pieces = reference_chunks(items, sizes[a]);
    if (pieces[coord[a]].empty()) {
      // An empty piece sits just after the last non-empty piece before it, or at the parent's start.
      std::int64_t at = items.empty() ? empty_offset : items.front();
      for (int i = 0; i < coord[a]; ++i) {
        if (!pieces[i].empty()) {
          at = pieces[i].back() + 1;
        }
      }
      empty_offset = at;
    }
    items = pieces[coord[a]];
  }
  return items;
}

void check_layouts(int tensor_rank, const std::vector<MeshSizes>& meshes) {
  std::vector<Placement> options{Placement::replicate(), Placement::partial(), Placement::shard(-1)};
  for (int d = 0; d < tensor_rank; ++d) {
    options.push_back(Placement::shard(d));
  }
  std::int64_t checked = 0;
  for (const MeshSizes& sizes : meshes) {
    const int world = mesh_numel(sizes);
    for (const PlacementList& pl : test_support::all_placement_lists(sizes.size(), options)) {
      REQUIRE(check_placements(pl, sizes.size(), tensor_rank) == PlacementError::none);
      // ref[rank][dim][n]: owned index list, computed once per (mesh, placement list).
      std::vector<std::vector<std::vector<std::vector<std::int64_t>>>> ref(
          world, std::vector<std::vector<std::vector<std::int64_t>>>(
                     tensor_rank, std::vector<std::vector<std::int64_t>>(10)));
      std::vector<std::vector<std::vector<std::int64_t>>> ref_empty_offset(
          world, std::vector<std::vector<std::int64_t>>(tensor_rank, std::vector<std::int64_t>(10)));
      for (int r = 0; r < world; ++r) {
        const auto coord = reference_coord(r, sizes);
        for (int d = 0; d < tensor_rank; ++d) {
          for (int n = 0; n < 10; ++n) {
            ref[r][d][n] = reference_owned(n, d, tensor_rank, pl, sizes, coord, ref_empty_offset[r][d][n]);
          }
        }
      }
      // Coverage: along every dim, each index is owned by exactly world / (product of the sizes of the
      // axes that shard the dim) ranks: the blocks tile the tensor.
      for (int d = 0; d < tensor_rank; ++d) {
        int splitters = 1;
        for (int a = 0; a < pl.size(); ++a) {
          const Placement p = normalize(pl[a], tensor_rank);
          splitters *= p.is_shard(d) ? sizes[a] : 1;
        }
        for (int n = 0; n < 10; ++n) {
          std::vector<int> owners(n, 0);
          for (int r = 0; r < world; ++r) {
            for (std::int64_t i : ref[r][d][n]) {
              ++owners[i];
            }
          }
          for (int c : owners) {
            REQUIRE(c == world / splitters);
          }
        }
      }
      // Every shape with dims in 0..9, every rank.
      Extents shape(tensor_rank, 0);
      while (true) {
        for (int r = 0; r < world; ++r) {
          const Block b = local_block(shape, pl, sizes, r);
          for (int d = 0; d < tensor_rank; ++d) {
            const auto& owned = ref[r][d][shape[d]];
            const bool ok_shape = b.shape[d] == static_cast<std::int64_t>(owned.size());
            const std::int64_t want_offset = owned.empty() ? ref_empty_offset[r][d][shape[d]] : owned.front();
            const bool contiguous = owned.empty() || owned.back() - owned.front() + 1 == b.shape[d];
            if (!ok_shape || b.offset[d] != want_offset || !contiguous) {
              FAIL_CHECK("mesh " << mesh_to_string(std::vector<std::string>(sizes.size(), "a"), sizes)
                                 << " placements " << to_string(pl) << " rank " << r << " dim " << d
                                 << " size " << shape[d] << ": got shape " << b.shape[d] << " offset "
                                 << b.offset[d] << ", reference owns " << owned.size() << " from "
                                 << want_offset);
              return;
            }
          }
          ++checked;
        }
        int d = tensor_rank - 1;
        while (d >= 0 && ++shape[d] == 10) {
          shape[d--] = 0;
        }
        if (d < 0) {
          break;
        }
      }
    }
  }
  INFO("blocks checked: " << checked);
  CHECK(checked > 0);
}

std::vector<MeshSizes> meshes_with_axes(int lo, int hi) {
  std::vector<MeshSizes> out;
  for (const MeshSizes& m : all_meshes(hi)) {
    if (m.size() >= lo) {
      out.push_back(m);
    }
  }
  return out;
}

} // namespace

TEST_CASE("torch.chunk sizes and offsets", "[layout]") {
  // The examples of docs/design.md, Vocabulary (local shard layout).
  CHECK(std::vector<std::int64_t>{chunk_size(9, 4, 0), chunk_size(9, 4, 1), chunk_size(9, 4, 2),
                                  chunk_size(9, 4, 3)} == std::vector<std::int64_t>{3, 3, 3, 0});
  CHECK(std::vector<std::int64_t>{chunk_size(5, 4, 0), chunk_size(5, 4, 1), chunk_size(5, 4, 2),
                                  chunk_size(5, 4, 3)} == std::vector<std::int64_t>{2, 2, 1, 0});
  CHECK(chunk_offset(5, 4, 3) == 5);
  CHECK(chunk_offset(0, 3, 1) == 0);
  for (int k = 1; k <= 6; ++k) {
    for (int n = 0; n <= 40; ++n) {
      std::vector<std::int64_t> items(n);
      for (int i = 0; i < n; ++i) {
        items[i] = i;
      }
      const auto pieces = reference_chunks(items, k);
      for (int i = 0; i < k; ++i) {
        REQUIRE(chunk_size(n, k, i) == static_cast<std::int64_t>(pieces[i].size()));
        if (!pieces[i].empty()) {
          REQUIRE(chunk_offset(n, k, i) == pieces[i].front());
        } else {
          REQUIRE(chunk_offset(n, k, i) == std::min<std::int64_t>(n, full_chunk_size(n, k) * i));
        }
      }
    }
  }
}

TEST_CASE("layout functions fold at compile time", "[layout]") {
  constexpr MeshSizes mesh{2, 3};
  STATIC_REQUIRE(mesh_numel(mesh) == 6);
  STATIC_REQUIRE(rank_to_coord(4, mesh) == MeshCoord{1, 1});
  STATIC_REQUIRE(coord_to_rank(MeshCoord{1, 2}, mesh) == 5);
  STATIC_REQUIRE(axis_group_rank(4, 0, 0, mesh) == 1);
  STATIC_REQUIRE(axis_color(4, 1, mesh) == 1);
  STATIC_REQUIRE(axis_key(4, 1, mesh) == 1);
  constexpr Block b = local_block(Extents{7, 5}, PlacementList{Shard<0>::value, Shard<-1>::value}, mesh, 5);
  STATIC_REQUIRE(b.shape == Extents{3, 1});
  STATIC_REQUIRE(b.offset == Extents{4, 4});
  // Two axes sharding one dim: left to right. 9 rows over (2, 3): the dp halves are 5 and 4 rows.
  constexpr PlacementList ss{Shard<0>::value, Shard<0>::value};
  STATIC_REQUIRE(local_block(Extents{9}, ss, mesh, 2).shape == Extents{1}); // (0,2): rows 4..4
  STATIC_REQUIRE(local_block(Extents{9}, ss, mesh, 2).offset == Extents{4});
  STATIC_REQUIRE(local_block(Extents{9}, ss, mesh, 5).shape == Extents{0}); // (1,2): empty, at 9
  STATIC_REQUIRE(local_block(Extents{9}, ss, mesh, 5).offset == Extents{9});
}

TEST_CASE("rank <-> coordinate, axis groups, colour and key match brute force", "[layout]") {
  for (const MeshSizes& sizes : all_meshes(4)) {
    const int world = mesh_numel(sizes);
    for (int r = 0; r < world; ++r) {
      const auto want = reference_coord(r, sizes);
      const MeshCoord got = rank_to_coord(r, sizes);
      REQUIRE(std::vector<int>(got.begin(), got.end()) == want);
      REQUIRE(coord_to_rank(got, sizes) == r);
    }
    for (int a = 0; a < sizes.size(); ++a) {
      for (int r = 0; r < world; ++r) {
        // Brute force: the ranks whose coordinates differ from r's at most on axis a, in rank order
        // (which is the order of their coordinate on a).
        std::vector<int> group;
        const auto cr = reference_coord(r, sizes);
        for (int s = 0; s < world; ++s) {
          auto cs = reference_coord(s, sizes);
          cs[a] = cr[a];
          if (cs == cr) {
            group.push_back(s);
          }
        }
        const auto got = axis_group_ranks(r, a, sizes);
        REQUIRE(std::vector<int>(got.begin(), got.end()) == group);
        REQUIRE(axis_key(r, a, sizes) == cr[a]);
        REQUIRE(group[axis_key(r, a, sizes)] == r);
        const int color = axis_color(r, a, sizes);
        REQUIRE(color >= 0);
        REQUIRE(color < world / sizes[a]);
        for (int s = 0; s < world; ++s) {
          const bool same_group = std::find(group.begin(), group.end(), s) != group.end();
          REQUIRE((axis_color(s, a, sizes) == color) == same_group);
        }
      }
    }
  }
}

TEST_CASE("local blocks match brute force: tensor rank 1", "[layout][exhaustive]") {
  check_layouts(1, all_meshes(3));
}

TEST_CASE("local blocks match brute force: tensor rank 2", "[layout][exhaustive]") {
  check_layouts(2, all_meshes(3));
}

TEST_CASE("local blocks match brute force: tensor rank 3, meshes of 1-2 axes", "[layout][exhaustive]") {
  check_layouts(3, meshes_with_axes(1, 2));
}

TEST_CASE("local blocks match brute force: tensor rank 3, meshes of 3 axes", "[layout][exhaustive]") {
  check_layouts(3, meshes_with_axes(3, 3));
}

TEST_CASE("placement lists are validated", "[layout]") {
  using P = PlacementList;
  STATIC_REQUIRE(check_placements(P{Shard<0>::value, Replicate::value}, 2, 2) == PlacementError::none);
  STATIC_REQUIRE(check_placements(P{Shard<0>::value}, 2, 2) == PlacementError::count_mismatch);
  STATIC_REQUIRE(check_placements(P{Shard<2>::value}, 1, 2) == PlacementError::shard_dim_out_of_range);
  STATIC_REQUIRE(check_placements(P{Shard<-3>::value}, 1, 2) == PlacementError::shard_dim_out_of_range);
  STATIC_REQUIRE(check_placements(P{Shard<-2>::value}, 1, 2) == PlacementError::none);
  STATIC_REQUIRE(check_placements(P{Partial<ReduceOp::sum>::value, Partial<ReduceOp::avg>::value}, 2, 1) ==
                 PlacementError::none);
  STATIC_REQUIRE(check_placements(P{Partial<ReduceOp::max>::value, Partial<ReduceOp::max>::value}, 2, 1) ==
                 PlacementError::none);
  STATIC_REQUIRE(check_placements(P{Partial<ReduceOp::sum>::value, Partial<ReduceOp::max>::value}, 2, 1) ==
                 PlacementError::mixed_partial_ops);
}

TEST_CASE("placements print like PyTorch's short forms", "[layout]") {
  CHECK(to_string(Shard<0>::value) == "S(0)");
  CHECK(to_string(Shard<-1>::value) == "S(-1)");
  CHECK(to_string(Replicate::value) == "R");
  CHECK(to_string(Partial<>::value) == "P(sum)");
  CHECK(to_string(Partial<ReduceOp::max>::value) == "P(max)");
  CHECK(to_string(placement_list_v<Shard<0>, Replicate>) == "[S(0),R]");
  CHECK(mesh_to_string(std::vector<std::string>{"dp", "tp"}, MeshSizes{2, 4}) == "(dp=2, tp=4)");
}

#pragma once
// The brute-force exchange geometry and cost: the test oracles of exchange_pieces and bytes_per_rank
// (tests/plan/test_exchange.cpp, tests/plan/test_cost.cpp) and the reference rows of their cost
// (bench/overhead).

#include <dtensor/plan/cost.hpp>

#include <vector>

namespace dtensor::test_support {

/// The oracle: the blocks of every member of the group, every pair intersected; each target takes each
/// distinct source block from the holder that shares the most mesh coordinates with it (itself first).
inline void reference_pieces(const Step& st, const Extents& global, const MeshSizes& sizes,
                             const MeshCoord& me, std::vector<Piece>& sends, std::vector<Piece>& recvs) {
  sends.clear();
  recvs.clear();
  const int k = group_size(st.axes, sizes);
  const int my_q = group_rank(me, st.axes, sizes);
  std::vector<Block> before(k), after(k);
  std::vector<MeshCoord> coords(k);
  for (int q = 0; q < k; ++q) {
    coords[q] = group_member(me, st.axes, sizes, q);
    before[q] = spec_block(global, st.before, sizes, coords[q]);
    after[q] = spec_block(global, st.after, sizes, coords[q]);
  }
  auto source_for = [&](int target, int holder) {
    if (before[target] == before[holder]) {
      return target;
    }
    int best = holder, best_differing = 1 << 30;
    for (int q = 0; q < k; ++q) {
      if (!(before[q] == before[holder])) {
        continue;
      }
      int d = 0;
      for (int a = 0; a < coords[q].size(); ++a) {
        d += coords[q][a] != coords[target][a];
      }
      if (d < best_differing) {
        best = q;
        best_differing = d;
      }
    }
    return best;
  };
  for (int t = 0; t < k; ++t) {
    const Block piece = intersect(before[my_q], after[t]);
    if (numel(piece.shape) > 0 && source_for(t, my_q) == my_q) {
      sends.push_back({t, piece});
    }
  }
  for (int q = 0; q < k; ++q) {
    const Block piece = intersect(before[q], after[my_q]);
    if (numel(piece.shape) > 0 && source_for(my_q, q) == q) {
      recvs.push_back({q, piece});
    }
  }
}

/// The oracle of bytes_per_rank: for each step the largest step_elements_received over every rank of the
/// mesh (each exchange's pieces found rank by rank), summed over the steps.
inline std::int64_t reference_bytes_per_rank(const Plan& plan, const Extents& global, const MeshSizes& sizes,
                                             std::int64_t element_size) {
  std::int64_t total = 0;
  for (const Step& st : plan.steps) {
    std::int64_t most = 0;
    for (int r = 0; r < mesh_numel(sizes); ++r) {
      const std::int64_t e = step_elements_received(st, global, sizes, rank_to_coord(r, sizes));
      most = e > most ? e : most;
    }
    total += most * element_size;
  }
  return total;
}

} // namespace dtensor::test_support

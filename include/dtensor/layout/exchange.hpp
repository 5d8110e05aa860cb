#pragma once
// Exchange geometry: how the blocks of one layout (a ShardSpec: one dim may be split by several mesh axes,
// in any order) map onto the blocks of another. Which piece of which block goes between which ranks of a
// group of axes (exchange_pieces), and the most elements a rank lacks of its new block (most_lacking), in
// closed form, without visiting the ranks, so it also runs in constant expressions. The executor moves
// exactly these pieces; the planner's cost model (plan/cost.hpp, bytes_per_rank) counts them per step.
//
// Blocks of a layout tile the tensor: two ranks' blocks are identical (replicas) or disjoint. An exchange
// over a group of axes sends every rank the intersection of its target block with each distinct source
// block of its group, from exactly one holder (see exchange_pieces).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dtensor/core/extents.hpp"
#include "dtensor/core/static_vector.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/shard_spec.hpp"

namespace dtensor {

/// The common part of two blocks (empty shape where they do not meet).
constexpr Block intersect(const Block& a, const Block& b) {
  Block r{Extents(a.shape.size(), 0), Extents(a.shape.size(), 0)};
  for (int d = 0; d < a.shape.size(); ++d) {
    const std::int64_t lo = a.offset[d] > b.offset[d] ? a.offset[d] : b.offset[d];
    const std::int64_t ea = a.offset[d] + a.shape[d];
    const std::int64_t eb = b.offset[d] + b.shape[d];
    const std::int64_t hi = ea < eb ? ea : eb;
    r.offset[d] = lo;
    r.shape[d] = hi > lo ? hi - lo : 0;
  }
  return r;
}

/// Number of ranks in the group over `axes`.
constexpr int group_size(AxisMask axes, const MeshSizes& sizes) noexcept {
  int n = 1;
  for (int a = 0; a < sizes.size(); ++a) {
    if (axes & axis_bit(a)) {
      n *= sizes[a];
    }
  }
  return n;
}

/// Rank of `coord` in its group over `axes` (row-major over those axes, in axis order).
constexpr int group_rank(const MeshCoord& coord, AxisMask axes, const MeshSizes& sizes) noexcept {
  int q = 0;
  for (int a = 0; a < sizes.size(); ++a) {
    if (axes & axis_bit(a)) {
      q = q * sizes[a] + coord[a];
    }
  }
  return q;
}

/// The coordinate of member `q` of the group over `axes` that contains `coord`.
constexpr MeshCoord group_member(MeshCoord coord, AxisMask axes, const MeshSizes& sizes, int q) noexcept {
  for (int a = sizes.size() - 1; a >= 0; --a) {
    if (axes & axis_bit(a)) {
      coord[a] = q % sizes[a];
      q /= sizes[a];
    }
  }
  return coord;
}

/// One piece an exchange moves: `block` (global coordinates) to or from group rank `peer`.
struct Piece {
  int peer;
  Block block;
};

namespace detail {

/// Finds the coordinates whose block under `spec` meets `box`: the axes in `free` vary, the others keep
/// their value in `coord`. Walks the nested torch.chunk splits of each dim, outermost first, visiting only
/// chunks that meet `box`, so the cost is proportional to the number of blocks found, not to the mesh.
template <class F>
struct MeetingBlocks {
  const Extents& global;
  const ShardSpec& spec;
  const MeshSizes& sizes;
  AxisMask free;
  const Block& box;
  MeshCoord& coord;
  F& f;

  /// Dim d, its i-th splitting axis next, the current chunk of dim d being [off, off + len).
  void visit(int d, int i, std::int64_t off, std::int64_t len) {
    if (d == global.size()) {
      f();
      return;
    }
    if (i == spec.order[d].size()) {
      if (d + 1 < global.size()) {
        visit(d + 1, 0, 0, global[d + 1]);
      } else {
        f();
      }
      return;
    }
    const int a = spec.order[d][i];
    const int k = sizes[a];
    const std::int64_t lo = box.offset[d];
    const std::int64_t hi = box.offset[d] + box.shape[d];
    auto descend = [&](int c) {
      const std::int64_t o = off + chunk_offset(len, k, c);
      const std::int64_t n = chunk_size(len, k, c);
      if (n > 0 && o < hi && lo < o + n) {
        coord[a] = c;
        visit(d, i + 1, o, n);
      }
    };
    if (!(free & axis_bit(a))) {
      descend(coord[a]);
      return;
    }
    const std::int64_t full = full_chunk_size(len, k);
    if (full == 0 || hi <= off || off + len <= lo) {
      return;
    }
    const int first = lo <= off ? 0 : static_cast<int>((lo - off) / full);
    const int last = static_cast<int>(std::min<std::int64_t>(k - 1, (hi - 1 - off) / full));
    const int saved = coord[a];
    for (int c = first; c <= last; ++c) {
      descend(c);
    }
    coord[a] = saved;
  }
};

/// Calls f() for every coordinate (written into `coord`; restored afterwards) whose block under `spec`
/// meets `box`, the axes in `free` varying and the others fixed. A free axis that splits no dim of `spec`
/// takes every value.
template <class F>
void for_each_meeting(const Extents& global, const ShardSpec& spec, const MeshSizes& sizes, AxisMask free,
                      const Block& box, MeshCoord& coord, F&& f) {
  for (int d = 0; d < global.size(); ++d) {
    if (box.shape[d] == 0) {
      return;
    }
  }
  AxisMask splitting = 0;
  for (int d = 0; d < spec.tensor_rank(); ++d) {
    for (std::int8_t a : spec.order[d]) {
      splitting |= axis_bit(a);
    }
  }
  const AxisMask loose = free & static_cast<AxisMask>(~splitting); // every value
  auto inner = [&] {
    MeetingBlocks<decltype(f)> walk{global, spec, sizes, free, box, coord, f};
    if (global.size() == 0) {
      f();
    } else {
      walk.visit(0, 0, 0, global[0]);
    }
  };
  // Loop over the loose axes (row-major), then walk the splitting ones.
  int loose_axes[max_mesh_rank];
  int count = 0;
  for (int a = 0; a < sizes.size(); ++a) {
    if (loose & axis_bit(a)) {
      loose_axes[count++] = a;
    }
  }
  const MeshCoord saved = coord;
  for (int a = 0; a < count; ++a) {
    coord[loose_axes[a]] = 0;
  }
  for (;;) {
    inner();
    int a = count - 1;
    for (; a >= 0; --a) {
      if (++coord[loose_axes[a]] < sizes[loose_axes[a]]) {
        break;
      }
      coord[loose_axes[a]] = 0;
    }
    if (a < 0) {
      break;
    }
  }
  coord = saved;
}

/// The axes of `mask` that split some dim under `spec`.
constexpr AxisMask splitting_axes(const ShardSpec& spec, AxisMask mask) {
  AxisMask m = 0;
  for (int d = 0; d < spec.tensor_rank(); ++d) {
    for (std::int8_t a : spec.order[d]) {
      m |= axis_bit(a);
    }
  }
  return m & mask;
}

} // namespace detail

/// The pieces the rank at `me` sends and receives when a group over the mesh axes `axes` goes from layout
/// `before` to layout `after` (an all_to_all or permute step of a plan), ordered by peer (its rank in the
/// group); a piece with peer == its own group rank is a local copy.
/// @pre every group over `axes` holds all the data its members need under `after`.
///
/// Which copy sends a replicated block: a target receives each source block from the holder that shares
/// its coordinates on every group axis the source does not split (itself, if it holds the block), so
/// copies of a replicated source share the sending. The cost is proportional to the pieces found: the
/// source blocks meeting this rank's target block, and the target blocks meeting its source block.
inline void exchange_pieces(const ShardSpec& before, const ShardSpec& after, AxisMask axes,
                            const Extents& global, const MeshSizes& sizes, const MeshCoord& me,
                            std::vector<Piece>& sends, std::vector<Piece>& recvs) {
  sends.clear();
  recvs.clear();
  const Block mine_before = spec_block(global, before, sizes, me);
  const Block mine_after = spec_block(global, after, sizes, me);
  const AxisMask sharded = detail::splitting_axes(before, axes); // group axes that split the source
  MeshCoord c = me;
  // What I receive: the source blocks meeting my target block, each from the holder that has my
  // coordinates on the group axes the source does not split.
  detail::for_each_meeting(global, before, sizes, sharded, mine_after, c, [&] {
    recvs.push_back(
        {group_rank(c, axes, sizes), intersect(spec_block(global, before, sizes, c), mine_after)});
  });
  // What I send: to every target whose block meets mine and that has my coordinates on the group axes
  // the source does not split (on group axes the source splits and the target does not, every value).
  detail::for_each_meeting(global, after, sizes, sharded, mine_before, c, [&] {
    sends.push_back(
        {group_rank(c, axes, sizes), intersect(mine_before, spec_block(global, after, sizes, c))});
  });
  auto by_peer = [](const Piece& a, const Piece& b) { return a.peer < b.peer; };
  std::sort(sends.begin(), sends.end(), by_peer);
  std::sort(recvs.begin(), recvs.end(), by_peer);
}

namespace detail {

/// A part [offset, offset + size) of a dim.
struct Span {
  std::int64_t offset = 0;
  std::int64_t size = 0;
};

/// Chunk `c` of `k` (torch.chunk) of a span.
constexpr Span chunk_of(const Span& s, int k, int c) noexcept {
  const std::int64_t full = (s.size + k - 1) / k;
  const std::int64_t begin = full * c;
  const std::int64_t end = begin + full < s.size ? begin + full : s.size;
  return {s.offset + (begin < s.size ? begin : s.size), end > begin ? end - begin : 0};
}

constexpr std::int64_t overlap(const Span& a, const Span& b) noexcept {
  const std::int64_t lo = a.offset > b.offset ? a.offset : b.offset;
  const std::int64_t hi = a.offset + a.size < b.offset + b.size ? a.offset + a.size : b.offset + b.size;
  return hi > lo ? hi - lo : 0;
}

/// The span of a dim of `n` items that the axes of `order` (outermost first) leave at `coord`.
constexpr Span nested_chunk(std::int64_t n, const AxisOrder& order, const MeshSizes& sizes,
                            const MeshCoord& coord) noexcept {
  Span s{0, n};
  for (std::int8_t a : order) {
    s = chunk_of(s, sizes[a], coord[a]);
  }
  return s;
}

/// One coordinate's elements of its target block (`target`) and of the part of it it already holds
/// (`kept`), over some dims.
struct Held {
  std::int64_t target = 0;
  std::int64_t kept = 0;
};

/// The Pareto front of Held values: a value with no smaller target and no larger kept part than another
/// makes it redundant, for target - kept and for every product with other non-negative Held values.
/// `overflow` says that a value was dropped for lack of room (the front is then not to be used).
template <int Capacity>
struct HeldFront {
  static constexpr int capacity = Capacity;
  StaticVector<Held, Capacity> points;
  bool overflow = false;

  constexpr void insert(Held h) {
    int n = 0; // the points h does not make redundant, moved to the front
    for (int i = 0; i < points.size(); ++i) {
      const Held& p = points[i];
      if (p.target >= h.target && p.kept <= h.kept) {
        return;
      }
      if (!(h.target >= p.target && h.kept <= p.kept)) {
        points[n++] = p;
      }
    }
    while (points.size() > n) {
      points.pop_back();
    }
    if (points.size() == capacity) {
      overflow = true;
      return;
    }
    points.push_back(h);
  }
};

/// Calls f(Held) for every value of the mesh axes in `axes`: the target (under `after`) and kept (also
/// under `before`) elements of that coordinate over the dims in `dims` (a bit per dim), whose splitting
/// axes must all be in `axes`.
///
/// Depth first over the axes in increasing order, carrying the spans down: an axis advances the (at most
/// two) spans it splits by one chunk step, a span whose order is not increasing is computed whole once
/// its last axis has a value, and a dim enters the running products once all its axes have one. So a
/// coordinate costs a few chunk steps, not a walk over every dim's splits.
template <class F>
struct HeldWalk {
  static constexpr int max_sides = 2 * max_tensor_rank; ///< side 2d: dim d before the step, 2d + 1: after

  const ShardSpec& before;
  const ShardSpec& after;
  const Extents& global;
  const MeshSizes& sizes;
  F& f;
  int axes[max_mesh_rank]{}; ///< increasing
  int count = 0;
  MeshCoord coord{};
  Span span[max_sides]{};
  int steps[max_mesh_rank][2]{}; ///< per depth, the sides its axis advances by one chunk step
  int num_steps[max_mesh_rank]{};
  int whole[max_mesh_rank][max_sides]{}; ///< per depth, the sides computed whole
  int num_whole[max_mesh_rank]{};
  int done[max_mesh_rank][max_tensor_rank]{}; ///< per depth, the dims complete there
  int num_done[max_mesh_rank]{};

  constexpr const AxisOrder& order(int side) const {
    return side % 2 ? after.order[side / 2] : before.order[side / 2];
  }

  constexpr void run(AxisMask axis_set, unsigned dims) {
    int depth_of[max_mesh_rank]{};
    for (int a = 0; a < sizes.size(); ++a) {
      if (axis_set & axis_bit(a)) {
        depth_of[a] = count;
        axes[count++] = a;
      }
    }
    coord = MeshCoord(sizes.size(), 0);
    Held h{1, 1}; // the dims no axis splits
    for (int d = 0; d < global.size(); ++d) {
      if (!(dims & (1u << d))) {
        continue;
      }
      int complete = -1; // the depth where the dim's last axis gets its value
      for (int side : {2 * d, 2 * d + 1}) {
        const AxisOrder& o = order(side);
        span[side] = {0, global[d]};
        bool increasing = true;
        int last = -1;
        for (int i = 0; i < o.size(); ++i) {
          increasing = increasing && (i == 0 || o[i - 1] < o[i]);
          last = depth_of[o[i]] > last ? depth_of[o[i]] : last;
        }
        if (increasing) {
          for (std::int8_t a : o) {
            steps[depth_of[a]][num_steps[depth_of[a]]++] = side;
          }
        } else {
          whole[last][num_whole[last]++] = side;
        }
        complete = last > complete ? last : complete;
      }
      if (complete < 0) {
        h.target *= global[d];
        h.kept *= global[d];
      } else {
        done[complete][num_done[complete]++] = d;
      }
    }
    visit(0, h);
  }

  constexpr void visit(int i, const Held& h) {
    if (i == count || i == max_mesh_rank) { // (count <= max_mesh_rank: the second test tells the compiler)
      f(h);
      return;
    }
    const int a = axes[i];
    const int k = sizes[a];
    Span parent[2]{};
    for (int t = 0; t < num_steps[i]; ++t) {
      parent[t] = span[steps[i][t]];
    }
    for (int c = 0; c < k; ++c) {
      coord[a] = c;
      for (int t = 0; t < num_steps[i]; ++t) {
        span[steps[i][t]] = chunk_of(parent[t], k, c);
      }
      for (int w = 0; w < num_whole[i]; ++w) {
        const int side = whole[i][w];
        span[side] = nested_chunk(global[side / 2], order(side), sizes, coord);
      }
      Held g = h;
      for (int j = 0; j < num_done[i]; ++j) {
        const int d = done[i][j];
        g.target *= span[2 * d + 1].size;
        g.kept *= overlap(span[2 * d], span[2 * d + 1]);
      }
      visit(i + 1, g);
    }
    for (int t = 0; t < num_steps[i]; ++t) { // as found, for the next visit from above
      span[steps[i][t]] = parent[t];
    }
  }
};

template <class F>
constexpr void for_each_held(const ShardSpec& before, const ShardSpec& after, const Extents& global,
                             const MeshSizes& sizes, AxisMask axes, unsigned dims, F&& f) {
  HeldWalk<F> walk{before, after, global, sizes, f};
  walk.run(axes, dims);
}

/// The most any rank lacks of its block under `after` when the layout goes from `before` to `after`: max
/// over coordinates of numel(after block) - numel(intersect(after block, before block)).
///
/// A dim's extents depend only on the axes that split it before or after the step, so the dims fall into
/// components joined by shared axes (an axis splitting dim i before and dim j after joins i and j). Each
/// component's coordinates (the values of its axes only) give (target, kept) pairs over its dims; the
/// total of a rank is prod target - prod kept over the components, maximised over the product of the
/// components' Pareto fronts. A component where target == kept everywhere (a dim that the step leaves
/// alone) only scales the result, by its largest value. The cost: for each component, the product of its
/// axes' sizes times a few chunk steps (HeldWalk), plus the products of the fronts (a few points each);
/// at most the mesh's size times a few steps. Where a front outgrows `FrontCapacity` points, every
/// coordinate of the varying components' axes is visited at once instead.
template <int FrontCapacity = 64>
constexpr std::int64_t most_lacking(const ShardSpec& before, const ShardSpec& after, const Extents& global,
                                    const MeshSizes& sizes) {
  const int rank = global.size();
  // Union-find over dims: parent[d] == d for a component's root.
  int parent[max_tensor_rank]{};
  for (int d = 0; d < rank; ++d) {
    parent[d] = d;
  }
  auto root = [&](int d) {
    while (parent[d] != d) {
      d = parent[d];
    }
    return d;
  };
  int dim_before[max_mesh_rank]{};
  int dim_after[max_mesh_rank]{};
  for (int a = 0; a < sizes.size(); ++a) {
    dim_before[a] = dim_after[a] = -1;
  }
  for (int d = 0; d < rank; ++d) {
    for (std::int8_t a : before.order[d]) {
      dim_before[a] = d;
    }
    for (std::int8_t a : after.order[d]) {
      dim_after[a] = d;
    }
  }
  for (int a = 0; a < sizes.size(); ++a) {
    if (dim_before[a] >= 0 && dim_after[a] >= 0) {
      parent[root(dim_before[a])] = root(dim_after[a]);
    }
  }
  std::int64_t scale = 1;            // the components that only scale the result
  HeldFront<FrontCapacity> combined; // the products over the other components so far
  combined.insert({1, 1});
  bool overflow = false; // a front ran out of room: fall back to every coordinate (below)
  AxisMask varying = 0;  // the axes and dims of the components that do not only scale
  unsigned varying_dims = 0;
  for (int r = 0; r < rank; ++r) {
    if (root(r) != r) {
      continue;
    }
    unsigned dims = 0;
    AxisMask axes = 0;
    for (int d = 0; d < rank; ++d) {
      if (root(d) == r) {
        dims |= 1u << d;
        for (std::int8_t a : before.order[d]) {
          axes |= axis_bit(a);
        }
        for (std::int8_t a : after.order[d]) {
          axes |= axis_bit(a);
        }
      }
    }
    HeldFront<FrontCapacity> front;
    bool diagonal = true;
    std::int64_t largest = 0;
    for_each_held(before, after, global, sizes, axes, dims, [&](const Held& h) {
      diagonal = diagonal && h.target == h.kept;
      largest = h.target > largest ? h.target : largest;
      front.insert(h);
    });
    if (diagonal) {
      scale *= largest;
      continue;
    }
    varying |= axes;
    varying_dims |= dims;
    overflow = overflow || front.overflow;
    if (!overflow) {
      HeldFront<FrontCapacity> next;
      for (const Held& p : combined.points) {
        for (const Held& q : front.points) {
          next.insert({p.target * q.target, p.kept * q.kept});
        }
      }
      combined = next;
      overflow = combined.overflow;
    }
  }
  std::int64_t most = 0;
  if (!overflow) {
    for (const Held& p : combined.points) {
      most = p.target - p.kept > most ? p.target - p.kept : most;
    }
  } else { // too many points to keep: every coordinate of the varying components' axes
    for_each_held(before, after, global, sizes, varying, varying_dims,
                  [&](const Held& h) { most = h.target - h.kept > most ? h.target - h.kept : most; });
  }
  return scale * most;
}

} // namespace detail

} // namespace dtensor

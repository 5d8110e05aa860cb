// Exchange geometry (layout/exchange.hpp, run per plan step through plan/cost.hpp): every member's pieces
// tile what it must receive, sends and receives agree pairwise, copies of a replicated source share the
// sending, and the O(pieces) geometry equals a brute-force one that looks at every member of the group; the
// pieces are also checked element by element against an oracle that shares no layout code with the
// library (support/owner_oracle.hpp).

#include <catch2/catch.hpp>

#include <dtensor/plan/cost.hpp>
#include <dtensor/plan/planner.hpp>

#include "../support/enumerate.hpp"
#include "../support/exchange_reference.hpp"
#include "../support/owner_oracle.hpp"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

using namespace dtensor;

namespace {

const Placement R = Placement::replicate();
constexpr Placement S(int d) {
  return Placement::shard(d);
}

struct Traffic {
  std::int64_t most_sent = 0;     ///< elements, the largest over members (pieces kept locally excluded)
  std::int64_t most_received = 0; ///< elements, the largest over members
};

/// Runs exchange_pieces for every member of the one exchange step of src -> dst and checks that sends and
/// receives match pair by pair.
Traffic traffic(std::initializer_list<Placement> src, std::initializer_list<Placement> dst,
                const MeshSizes& sizes, const Extents& global) {
  const Plan plan = make_plan(PlacementList(src), PlacementList(dst), global.size());
  REQUIRE(plan.size() == 1);
  const Step& st = plan.steps[0];
  REQUIRE((st.kind == StepKind::permute || st.kind == StepKind::all_to_all));
  const int n = mesh_numel(sizes);
  std::vector<std::vector<Piece>> sends(n), recvs(n);
  for (int r = 0; r < n; ++r) {
    exchange_pieces(st, global, sizes, rank_to_coord(r, sizes), sends[r], recvs[r]);
  }
  Traffic t;
  for (int r = 0; r < n; ++r) {
    const MeshCoord me = rank_to_coord(r, sizes);
    std::int64_t sent = 0, received = 0;
    const int my_q = group_rank(me, st.axes, sizes);
    for (const Piece& p : sends[r]) {
      const int peer = coord_to_rank(group_member(me, st.axes, sizes, p.peer), sizes);
      const auto& theirs = recvs[peer];
      const bool matched = std::any_of(theirs.begin(), theirs.end(),
                                       [&](const Piece& q) { return q.peer == my_q && q.block == p.block; });
      INFO("rank " << r << " sends to group rank " << p.peer);
      CHECK(matched);
      sent += peer == r ? 0 : numel(p.block.shape);
    }
    for (const Piece& p : recvs[r]) {
      received += p.peer == my_q ? 0 : numel(p.block.shape);
    }
    t.most_sent = std::max(t.most_sent, sent);
    t.most_received = std::max(t.most_received, received);
  }
  return t;
}

/// Checks rank `r`'s pieces of step `st` against the independent oracle (support/owner_oracle.hpp, which
/// shares no layout code with the library or with reference_pieces): the received pieces cover every
/// element of the block it must hold after the step exactly once and nothing else, each received piece is
/// held by its source before the step, and each sent piece is held by this rank before and by its target
/// after. Returns what is wrong, or an empty string.
std::string check_against_oracle(const Step& st, const Extents& global, const MeshSizes& sizes, int r,
                                 const std::vector<Piece>& sends, const std::vector<Piece>& recvs) {
  using namespace test_support;
  const MeshCoord me = coord_of(r, sizes);
  const auto target = holds(global, st.after, sizes, me);
  const auto mine = holds(global, st.before, sizes, me);
  std::map<std::vector<std::int64_t>, int> covered;
  for (const Piece& p : recvs) {
    const auto source = holds(global, st.before, sizes, member_coord(me, st.axes, sizes, p.peer));
    for (const Extents& idx : indices_of(p.block)) {
      if (!held_at(source, idx)) {
        return "a piece received from group rank " + std::to_string(p.peer) +
               " holds an element its source " + "does not";
      }
      if (!held_at(target, idx)) {
        return "a piece received from group rank " + std::to_string(p.peer) +
               " lies outside the target block";
      }
      ++covered[std::vector<std::int64_t>(idx.begin(), idx.end())];
    }
  }
  std::int64_t want = 1;
  for (const auto& dim : target) {
    want *= static_cast<std::int64_t>(dim.size());
  }
  if (static_cast<std::int64_t>(covered.size()) != want) {
    return "the received pieces cover " + std::to_string(covered.size()) + " elements of a target block of " +
           std::to_string(want);
  }
  for (const auto& [idx, times] : covered) {
    if (times != 1) {
      return "an element of the target block is received " + std::to_string(times) + " times";
    }
  }
  for (const Piece& p : sends) {
    const auto theirs = holds(global, st.after, sizes, member_coord(me, st.axes, sizes, p.peer));
    for (const Extents& idx : indices_of(p.block)) {
      if (!held_at(mine, idx) || !held_at(theirs, idx)) {
        return "a piece sent to group rank " + std::to_string(p.peer) +
               " holds an element this rank does not hold or the target does not need";
      }
    }
  }
  return {};
}

bool same_pieces(const std::vector<Piece>& a, const std::vector<Piece>& b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].peer != b[i].peer || !(a[i].block == b[i].block)) {
      return false;
    }
  }
  return true;
}

} // namespace

TEST_CASE("exchange geometry equals the brute-force one and tiles every target block", "[plan][exchange]") {
  using test_support::all_placement_lists;
  const std::vector<MeshSizes> meshes{{1}, {3}, {4}, {2, 2}, {2, 3}, {3, 1}, {2, 2, 2}, {1, 2, 3}};
  std::int64_t checked = 0;
  for (const MeshSizes& sizes : meshes) {
    const auto lists = all_placement_lists(sizes.size(), {R, S(0), S(1)});
    for (const PlacementList& src : lists) {
      for (const PlacementList& dst : lists) {
        // The exact fallback (one permute over every axis) and the planner's exchange steps.
        std::vector<Step> steps;
        const Plan fallback = make_exchange_plan(src, dst, 2);
        const Plan planned = make_plan(src, dst, 2);
        for (const Plan* p : {&fallback, &planned}) {
          for (const Step& st : p->steps) {
            if (st.kind == StepKind::permute || st.kind == StepKind::all_to_all) {
              steps.push_back(st);
            }
          }
        }
        for (const Step& st : steps) {
          for (std::int64_t rows : {0, 1, 3, 5}) {
            for (std::int64_t cols : {2, 7}) {
              const Extents global{rows, cols};
              for (int r = 0; r < mesh_numel(sizes); ++r) {
                const MeshCoord me = rank_to_coord(r, sizes);
                std::vector<Piece> sends, recvs, ref_sends, ref_recvs;
                exchange_pieces(st, global, sizes, me, sends, recvs);
                test_support::reference_pieces(st, global, sizes, me, ref_sends, ref_recvs);
                INFO(to_string(src) << " -> " << to_string(dst) << " step " << to_string(st.kind)
                                    << " on rank " << r << " of a mesh of " << mesh_numel(sizes)
                                    << ", global " << rows << "x" << cols);
                REQUIRE(same_pieces(sends, ref_sends));
                REQUIRE(same_pieces(recvs, ref_recvs));
                // The pieces received tile this rank's target block: disjoint, inside it, all of it.
                const Block target = spec_block(global, st.after, sizes, me);
                std::int64_t covered = 0;
                for (std::size_t i = 0; i < recvs.size(); ++i) {
                  REQUIRE(intersect(recvs[i].block, target) == recvs[i].block);
                  for (std::size_t j = 0; j < i; ++j) {
                    REQUIRE(numel(intersect(recvs[i].block, recvs[j].block).shape) == 0);
                  }
                  covered += numel(recvs[i].block.shape);
                }
                REQUIRE(covered == numel(target.shape));
                const std::string oracle = check_against_oracle(st, global, sizes, r, sends, recvs);
                INFO(oracle);
                REQUIRE(oracle.empty());
                ++checked;
              }
            }
          }
        }
      }
    }
  }
  CHECK(checked > 10000);
}

TEST_CASE("copies of a replicated source share the sending", "[plan][exchange]") {
  // (pp, dp, tp) = (2, 2, 2): rows are split over pp and dp, each block held by both tp ranks; the target
  // splits columns over dp and tp. Each member receives 3/4 of its block; with the sending shared, no
  // member sends more than that (before, the tp = 0 copy sent everything: twice as much).
  const Traffic t = traffic({S(0), S(0), R}, {R, S(1), S(1)}, MeshSizes{2, 2, 2}, Extents{512, 256});
  CHECK(t.most_received == 512 * 64 * 3 / 4);
  CHECK(t.most_sent == t.most_received);
}

TEST_CASE("a permute of unique blocks sends what it receives", "[plan][exchange]") {
  const Traffic t = traffic({S(0), S(1)}, {S(1), S(0)}, MeshSizes{2, 2}, Extents{8, 6});
  CHECK(t.most_sent == t.most_received);
  const Traffic u = traffic({S(0), S(0), S(0)}, {S(1), S(1), S(1)}, MeshSizes{2, 2, 2}, Extents{16, 8});
  CHECK(u.most_sent == u.most_received);
}

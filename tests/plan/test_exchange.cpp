// Exchange geometry (plan/exchange.hpp): every member's pieces tile what it must receive, sends and
// receives agree pairwise, and copies of a replicated source share the sending.

#include <catch2/catch.hpp>

#include <dtensor/plan/exchange.hpp>
#include <dtensor/plan/planner.hpp>

#include <algorithm>
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

} // namespace

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

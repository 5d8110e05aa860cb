#pragma once
// ProcessGroup: a cheap, copyable handle to one communicator (torch.distributed.ProcessGroup).
//
//   dtensor::ProcessGroup world = ...;                 // e.g. from dtensor::testing::run_ranks
//   auto pair = world.new_group(std::vector{0, 1});    // every member of `world` calls it
//   auto row  = world.split(world.rank() / 2, world.rank());   // ncclCommSplit semantics
//   if (pair.is_member()) dtensor::all_reduce(t, dtensor::ReduceOp::sum, pair);
//
// Copies share the communicator; it is destroyed with the last copy (after its pending ops ran).

#include "dtensor/backends/backend.hpp"
#include "dtensor/core/error.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtensor {

class ProcessGroup {
public:
  /// An empty handle: not a member of any group.
  ProcessGroup() = default;

  /// Wraps a backend communicator (e.g. `make_gloo_backend(store, rank, size)`); nullptr = not a member.
  explicit ProcessGroup(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {
    if (backend_) {
      auto g = backend_->global_ranks();
      ranks_.assign(g.begin(), g.end());
    }
  }

  /// False for the handle new_group/split give ranks outside the new group.
  bool is_member() const noexcept { return backend_ != nullptr; }
  explicit operator bool() const noexcept { return is_member(); }

  /// This rank's position in the group; -1 when not a member (torch's get_rank).
  int rank() const noexcept { return backend_ ? backend_->rank() : -1; }
  /// Number of members; -1 when not a member.
  int size() const noexcept { return backend_ ? backend_->size() : -1; }
  /// "gloo" or "nccl" ("" when not a member).
  std::string_view backend() const noexcept { return backend_ ? backend_->name() : std::string_view{}; }
  /// Global (world) rank of each member, indexed by group rank. For a non-member handle from new_group,
  /// the ranks of the group it is not part of.
  std::span<const int> ranks() const noexcept { return ranks_; }

  /// Default limit of every op of this group (and of new groups created from it).
  std::chrono::milliseconds timeout() const { return impl("timeout").timeout(); }
  void set_timeout(std::chrono::milliseconds timeout) { impl("set_timeout").set_timeout(timeout); }

  /// A sub-group of the members whose *global* ranks are `ranks` (group rank i = ranks[i]; pass them sorted
  /// to match torch). Every member of this group calls it, with the same list, in the same order relative to
  /// other new_group/split calls. Ranks outside the list get a handle with is_member() == false.
  ProcessGroup new_group(std::span<const int> ranks) const {
    auto& b = impl("new_group");
    std::vector<int> local;
    local.reserve(ranks.size());
    for (int g : ranks) {
      auto it = std::find(ranks_.begin(), ranks_.end(), g);
      DTENSOR_CHECK(it != ranks_.end(), b.describe() + ": new_group: global rank " + std::to_string(g) +
                                            " is not a member of this group");
      local.push_back(static_cast<int>(it - ranks_.begin()));
    }
    ProcessGroup out(b.new_group(local));
    if (!out.is_member()) {
      out.ranks_.assign(ranks.begin(), ranks.end());
    }
    return out;
  }
  ProcessGroup new_group(std::initializer_list<int> ranks) const {
    return new_group(std::span<const int>(ranks.begin(), ranks.size()));
  }

  /// ncclCommSplit: every member calls it; members with the same color >= 0 form one group, ordered by
  /// (key, rank); color < 0 gives a non-member handle.
  ProcessGroup split(int color, int key) const { return ProcessGroup(impl("split").split(color, key)); }

  /// Fails every pending and future op of this group and releases peers blocked on this rank.
  void abort(std::string_view reason) const { impl("abort").abort(reason); }

  /// e.g. "rank 1 (global 3) of gloo group [2,3]".
  std::string to_string() const {
    if (backend_) {
      return backend_->describe();
    }
    std::string s = "non-member handle of group [";
    for (std::size_t i = 0; i < ranks_.size(); ++i) {
      s += (i ? "," : "") + std::to_string(ranks_[i]);
    }
    return s + "]";
  }

  /// The backend; throws when not a member.
  Backend& impl(std::string_view op = "op") const {
    DTENSOR_CHECK(backend_ != nullptr,
                  std::string(op) + ": this rank is not a member of the group (" + to_string() + ")");
    return *backend_;
  }
  const std::shared_ptr<Backend>& backend_ptr() const noexcept { return backend_; }

  /// Same communicator.
  friend bool operator==(const ProcessGroup& a, const ProcessGroup& b) noexcept {
    return a.backend_ == b.backend_ && a.ranks_ == b.ranks_;
  }

private:
  std::shared_ptr<Backend> backend_;
  std::vector<int> ranks_;
};

} // namespace dtensor

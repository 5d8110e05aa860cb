#pragma once
// What the members of a group tell each other about the op they are stuck in, through the group's store:
// a member whose op times out leaves the op's description under "op/<rank>" and reads the others' (up to
// a second), so the timeout says what each member ran ("the members disagree: rank 0: all_reduce #3 (16 x
// float32, op sum); rank 1: all_reduce #3 (32 x float32, op sum)") instead of only that it timed out.
// Nothing is written while ops succeed. Used by the gloo backend's failure board and by the NCCL watchdog.
//
//   OpBoard board(group_store, rank, size);
//   board.publish_op(describe_op("all_reduce", 3, 16, DType::float32, -1, 0));   // on a timeout only
//   msg += board.members_ops(mine, {}, std::chrono::seconds(1));

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace dtensor::detail {

/// "<name> #<seq> (<count> x <dtype>[, op <reduce>][, root|peer <root>])": an op as each member reports it
/// (reduce < 0: none; root < 0: none; send and recv name their peer).
inline std::string describe_op(std::string_view name, std::uint32_t seq, std::int64_t count, DType dtype,
                               int root, int reduce) {
  std::string s = std::string(name) + " #" + std::to_string(seq) + " (" + std::to_string(count) + " x " +
                  std::string(dtype_name(dtype));
  if (reduce >= 0) {
    s += ", op " + std::string(dtensor::to_string(static_cast<ReduceOp>(reduce)));
  }
  if (root >= 0) {
    s += (name == "send" || name == "recv" ? ", peer " : ", root ") + std::to_string(root);
  }
  return s + ")";
}

/// The "op/<rank>" entries of one group's store (see the top of this file). A store request that fails
/// (the store may be gone with a failed process) is remembered: members_ops() then says so instead of
/// waiting, and store_lost() tells the caller.
class OpBoard {
public:
  OpBoard(std::shared_ptr<Store> store, int rank, int size)
      : store_(std::move(store)), rank_(rank), size_(size) {}

  /// Leaves the op this member failed in under "op/<rank>" (the first one only).
  void publish_op(const std::string& desc) {
    if (store_ == nullptr || published_.exchange(true)) {
      return;
    }
    ask([&] { store_->set("op/" + std::to_string(rank_), std::string_view(desc)); });
  }

  /// What the members in `members` (group ranks; all when empty) published, waiting up to `patience` for
  /// all of them: "; the members disagree: rank 0: ...; rank 1: ...", or "; what each member reported:
  /// ..." when they agree; a member that published nothing (it never arrived, or is in no op, or finished
  /// the op) is "rank 2: no report"; when the store is gone, says so instead.
  std::string members_ops(const std::string& mine, std::vector<int> members,
                          std::chrono::milliseconds patience) {
    if (members.empty()) {
      for (int r = 0; r < size_; ++r) {
        members.push_back(r);
      }
    }
    std::vector<std::optional<std::string>> ops(members.size());
    const auto deadline = std::chrono::steady_clock::now() + patience;
    for (;;) {
      bool all = true;
      for (std::size_t i = 0; i < members.size(); ++i) {
        if (members[i] == rank_) {
          ops[i] = mine;
        }
        if (!ops[i] && store_ != nullptr) {
          ask([&] {
            if (auto v = store_->try_get("op/" + std::to_string(members[i]))) {
              ops[i] = std::string(v->begin(), v->end());
            }
          });
        }
        all = all && ops[i].has_value();
      }
      if (all || std::chrono::steady_clock::now() >= deadline || store_lost()) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (auto lost = store_lost()) {
      return "; what the other members ran is unknown, the job's store is unreachable: " + *lost;
    }
    bool differ = false;
    std::string list;
    for (std::size_t i = 0; i < members.size(); ++i) {
      differ = differ || (ops[i] && *ops[i] != mine);
      list += (i == 0 ? "" : "; ") + std::string("rank ") + std::to_string(members[i]) + ": " +
              (ops[i] ? *ops[i] : std::string("no report"));
    }
    return differ ? "; the members disagree: " + list : "; what each member reported: " + list;
  }

  /// Why a store request of this board failed, if one did.
  std::optional<std::string> store_lost() const {
    std::lock_guard lock(m_);
    return lost_;
  }

private:
  template <class F>
  void ask(F&& request) {
    try {
      request();
    } catch (const std::exception& e) {
      std::lock_guard lock(m_);
      if (!lost_) {
        lost_ = e.what();
      }
    }
  }

  std::shared_ptr<Store> store_;
  int rank_;
  int size_;
  std::atomic<bool> published_{false};
  mutable std::mutex m_;
  std::optional<std::string> lost_;
};

} // namespace dtensor::detail

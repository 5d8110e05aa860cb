#pragma once
// CommDebugMode: counts the communication of everything dtensor runs (collectives, point-to-point,
// redistribute, distribute_tensor, full_tensor), with its bytes, per op and group label.
//
//   dtensor::CommDebugMode comm;                 // active on this thread until it goes out of scope
//   auto y = x.redistribute<Replicate, Shard<1>>();
//   comm.count("all_gather");                    // 1
//   comm.count("all_gather", "dp");              // 1
//   comm.count("all_reduce", "tp", ReduceOp::max);   // all_reduce(max) over tp only
//   std::puts(comm.to_string().c_str());         // a table: op, group, count, bytes, reduce ops
//
// Every op passes the ProcessGroup front end (comm/process_group.hpp), which records it here: the op's
// name (a redistribution's point-to-point exchange is "permute") and the group's label (a mesh axis group
// is labelled with its axis name, "dp"; a flattened one "dp*tp"; other groups ""). A mode is per thread
// (each in-process rank of run_ranks counts its own); modes nest, and every active one records. Bytes are
// what this rank receives from other ranks in the op, from the sizes passed to the backend (all_reduce
// counts the 2(n-1)/n of a ring, the least any all_reduce moves; reduce and reduce_scatter the n-1
// partial copies of the result). The ops that reduce (all_reduce, reduce, reduce_scatter) also record
// their ReduceOp: count(op, axes, ReduceOp::max) and bytes(...) of the same form select by it.
//
// The op log: a mode made with {.log_ops = true} also keeps every op in order (ops()): its name and axes,
// its size as nccl-tests gives it, the group's size and how many nodes its members sit on
// (`gpus_per_node` ranks a node, global ranks in order): what a time model needs of each op
// (plan/comm_time.hpp estimates them on a ClusterModel).
//
//   dtensor::CommDebugMode comm({.log_ops = true, .gpus_per_node = 8});
//   ... a training step (or its dry run on the fake backend) ...
//   for (const auto& op : comm.ops()) { op.op; op.axes; op.size; op.ranks; op.nodes; }
//
// The log also places each op on the step's timeline, measured in compute: this thread's flop clock
// (core/flop_counter.hpp) when the op was issued, and when its completion was first waited for (a
// synchronous op: at once; an async one: after the compute it overlaps). Those two marks, and the order of
// every issue and wait, are what plan/comm_time.hpp's estimate_step_time needs to tell the communication a
// schedule hides from what it exposes.

#include "dtensor/backends/work.hpp"
#include "dtensor/core/flop_counter.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/thread_scope.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtensor {

class CommDebugMode : public detail::ThreadScope<CommDebugMode> {
public:
  /// The ops recorded under one (op, axes): how many, their bytes, and the same split by the reduce op of
  /// those that reduce (by_reduce[static_cast<int>(ReduceOp::max)], ...).
  struct Entry {
    struct Counts {
      std::int64_t count = 0;
      std::int64_t bytes = 0;
    };
    std::int64_t count = 0;
    std::int64_t bytes = 0;
    std::array<Counts, 5> by_reduce{};
  };

  struct Options {
    /// Keep every op in order (ops()).
    bool log_ops = false;
    /// Ranks a node for the log's node counts: global rank g sits on node g / gpus_per_node.
    int gpus_per_node = 8;
  };

  /// One op of the log, as issued on this rank.
  struct Op {
    std::string op, axes;
    std::int64_t bytes = 0; ///< what this rank received (as entries() count it)
    /// nccl-tests' size: the buffer of all_reduce, broadcast and reduce, the output of all_gather, the
    /// input of reduce_scatter, what this rank sends in all_to_all, the root's blocks of gather and
    /// scatter; for point-to-point, what this rank sends and receives (the larger).
    std::int64_t size = 0;
    std::optional<ReduceOp> reduce{};
    int ranks = 1; ///< members of the group (point-to-point: this rank and its peers)
    int nodes = 1; ///< nodes those members sit on
    /// The timeline: this thread's flop clock when the op was issued, and the op's place in the order of
    /// this thread's issues and waits.
    double issued_flops = 0;
    std::int64_t issued_seq = 0;
    /// When its completion was first waited for (flops < 0: never, e.g. a completion only polled or
    /// dropped; its end then counts at the end of the step). Shared: the completion fills it in.
    struct Waited {
      double flops = -1;
      std::int64_t seq = -1;
    };
    std::shared_ptr<Waited> waited{};
  };

  /// What the front end knows of an op beyond its received bytes (for the log).
  struct Shape {
    std::int64_t size = 0;
    std::span<const int> members; ///< the global ranks taking part
  };

  CommDebugMode() = default;
  explicit CommDebugMode(Options options) : options_(options) {}

  /// Number of ops called `op` (all axes, or the axes printed as `axes`, e.g. "tp" or "dp*tp").
  std::int64_t count(std::string_view op, std::string_view axes = {}) const { return sum(op, axes).count; }
  /// Bytes this rank received in ops called `op` (all axes or `axes`).
  std::int64_t bytes(std::string_view op, std::string_view axes = {}) const { return sum(op, axes).bytes; }
  /// Number of ops called `op` that reduced by `reduce` (axes as above; {} for all).
  std::int64_t count(std::string_view op, std::string_view axes, ReduceOp reduce) const {
    return sum(op, axes, reduce).count;
  }
  /// Bytes this rank received in ops called `op` that reduced by `reduce`.
  std::int64_t bytes(std::string_view op, std::string_view axes, ReduceOp reduce) const {
    return sum(op, axes, reduce).bytes;
  }
  /// Every communicating op.
  std::int64_t total_count() const { return sum({}, {}).count; }
  std::int64_t total_bytes() const { return sum({}, {}).bytes; }
  const std::map<std::pair<std::string, std::string>, Entry>& entries() const noexcept { return entries_; }
  /// Every op in order (empty unless made with Options::log_ops).
  const std::vector<Op>& ops() const noexcept { return ops_; }
  void reset() {
    entries_.clear();
    ops_.clear();
  }
  /// Whether some mode active on this thread keeps an op log (the front end then passes each op's Shape).
  static bool any_logging() noexcept {
    for (const CommDebugMode* m = innermost(); m != nullptr; m = m->enclosing()) {
      if (m->options_.log_ops) {
        return true;
      }
    }
    return false;
  }

  /// One row per (op, axes): "op  axes  count  bytes  reduce", the last the counts per reduce op of the
  /// ops that reduce ("max 1, sum 2").
  std::string to_string() const {
    std::string s;
    char line[200];
    std::snprintf(line, sizeof line, "%-16s %-10s %6s %12s  %s\n", "op", "axes", "count", "bytes", "reduce");
    s += line;
    for (const auto& [key, e] : entries_) {
      std::string reduce;
      for (int r = 0; r < static_cast<int>(e.by_reduce.size()); ++r) {
        if (e.by_reduce[r].count > 0) {
          reduce += (reduce.empty() ? "" : ", ") + std::string(dtensor::to_string(static_cast<ReduceOp>(r))) +
                    " " + std::to_string(e.by_reduce[r].count);
        }
      }
      std::snprintf(line, sizeof line, "%-16s %-10s %6lld %12lld  %s", key.first.c_str(), key.second.c_str(),
                    static_cast<long long>(e.count), static_cast<long long>(e.bytes), reduce.c_str());
      // No trailing blanks on rows without reduce ops.
      std::string row = line;
      row.erase(row.find_last_not_of(' ') + 1);
      s += row + "\n";
    }
    return s;
  }

  /// Records one op in every mode active on this thread (`reduce`: the op's reduction, for those that
  /// reduce).
  static void record(std::string_view op, std::string_view axes, std::int64_t bytes,
                     std::optional<ReduceOp> reduce = std::nullopt, const Shape* shape = nullptr) {
    pending().clear(); // an op whose submission threw leaves nothing for the next one
    for (CommDebugMode* m = innermost(); m != nullptr; m = m->enclosing()) {
      Entry& e = m->entries_[{std::string(op), std::string(axes)}];
      ++e.count;
      e.bytes += bytes;
      if (reduce) {
        Entry::Counts& c = e.by_reduce[static_cast<std::size_t>(*reduce)];
        ++c.count;
        c.bytes += bytes;
      }
      if (m->options_.log_ops) {
        Op o{std::string(op), std::string(axes), bytes, shape ? shape->size : bytes, reduce, 1, 1};
        if (shape != nullptr && !shape->members.empty()) {
          o.ranks = static_cast<int>(shape->members.size());
          o.nodes = count_nodes(shape->members, m->options_.gpus_per_node);
        }
        o.issued_flops = detail::thread_flops();
        o.issued_seq = ++event_seq();
        o.waited = std::make_shared<Op::Waited>();
        pending().push_back(o.waited);
        m->ops_.push_back(std::move(o));
      }
    }
  }

  /// The completion of the op just recorded, with its wait marked in the op logs that logged it (the front
  /// end passes every submitted op's completion through here while some mode logs ops).
  static std::shared_ptr<WorkImpl> watch(std::shared_ptr<WorkImpl> work);

  /// The order of this thread's issues and waits.
  static std::int64_t& event_seq() noexcept {
    thread_local std::int64_t seq = 0;
    return seq;
  }

private:
  /// The wait marks of the op being submitted, until watch() takes them.
  static std::vector<std::shared_ptr<Op::Waited>>& pending() noexcept {
    thread_local std::vector<std::shared_ptr<Op::Waited>> marks;
    return marks;
  }

  /// Distinct nodes among `members` (global ranks), `per_node` ranks a node.
  static int count_nodes(std::span<const int> members, int per_node) {
    std::vector<int> nodes(members.begin(), members.end());
    for (int& g : nodes) {
      g /= std::max(per_node, 1);
    }
    std::sort(nodes.begin(), nodes.end());
    return static_cast<int>(std::unique(nodes.begin(), nodes.end()) - nodes.begin());
  }

  Entry::Counts sum(std::string_view op, std::string_view axes,
                    std::optional<ReduceOp> reduce = std::nullopt) const {
    Entry::Counts total;
    for (const auto& [key, e] : entries_) {
      if ((op.empty() || key.first == op) && (axes.empty() || key.second == axes)) {
        const Entry::Counts& c =
            reduce ? e.by_reduce[static_cast<std::size_t>(*reduce)] : Entry::Counts{e.count, e.bytes};
        total.count += c.count;
        total.bytes += c.bytes;
      }
    }
    return total;
  }

  Options options_{};
  std::map<std::pair<std::string, std::string>, Entry> entries_;
  std::vector<Op> ops_;
};

namespace detail {

/// A completion that marks, on its first wait, the flop clock and the order of the waiting thread in its
/// op's log entries (CommDebugMode::watch).
class LoggedWork final : public WorkImpl {
public:
  LoggedWork(std::shared_ptr<WorkImpl> inner, std::vector<std::shared_ptr<CommDebugMode::Op::Waited>> marks)
      : inner_(std::move(inner)), marks_(std::move(marks)) {}
  bool is_completed() override { return inner_->is_completed(); }
  void wait() override {
    inner_->wait();
    for (const auto& m : marks_) {
      if (m->seq < 0) {
        m->flops = thread_flops();
        m->seq = ++CommDebugMode::event_seq();
      }
    }
  }

private:
  std::shared_ptr<WorkImpl> inner_;
  std::vector<std::shared_ptr<CommDebugMode::Op::Waited>> marks_;
};

} // namespace detail

inline std::shared_ptr<WorkImpl> CommDebugMode::watch(std::shared_ptr<WorkImpl> work) {
  if (pending().empty()) {
    return work;
  }
  auto marks = std::move(pending());
  pending().clear();
  return std::make_shared<detail::LoggedWork>(std::move(work), std::move(marks));
}

} // namespace dtensor

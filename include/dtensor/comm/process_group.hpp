#pragma once
// ProcessGroup: a cheap, copyable handle to one communicator (torch.distributed.ProcessGroup).
//
//   dtensor::ProcessGroup world = ...;                 // e.g. from dtensor::testing::run_ranks
//   auto pair = world.new_group(std::vector{0, 1});    // every member of `world` calls it
//   auto row  = world.split(world.rank() / 2, world.rank());   // ncclCommSplit semantics
//   if (pair.is_member()) dtensor::all_reduce(t, dtensor::ReduceOp::sum, pair);
//
// Copies share the communicator; it is destroyed with the last copy (after its pending ops ran).
//
// The untyped members (all_reduce(BufferRef, ...), p2p(...), ...) are the one entry through which every
// byte dtensor moves passes: the typed collectives, redistribute, distribute_tensor. Each records the op
// in the active CommDebugMode(s), times it for the active CommWaitTimer(s) (comm/wait_timer.hpp), orders
// it on its CUDA stream (comm/stream.hpp) and submits it to the backend, which checks its arguments before
// any communication and returns the op's completion.

#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/split.hpp"
#include "dtensor/comm/comm_debug.hpp"
#include "dtensor/comm/stream.hpp"
#include "dtensor/comm/wait_timer.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/reduce_op.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
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
  /// The registered name of the backend, e.g. "gloo" or "nccl" ("" when not a member).
  std::string_view backend_name() const noexcept { return backend_ ? backend_->name() : std::string_view{}; }
  /// Whether this member plays the group alone (Backend::dry_run).
  bool dry_run() const noexcept { return backend_ && backend_->dry_run(); }
  /// The backend (torch's ProcessGroup._get_backend); throws when not a member.
  Backend& backend() const { return impl("backend"); }
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
    std::vector<std::pair<int, int>> by_global; // (global rank, group rank), sorted: O(n log n) at any size
    by_global.reserve(ranks_.size());
    for (std::size_t i = 0; i < ranks_.size(); ++i) {
      by_global.emplace_back(ranks_[i], static_cast<int>(i));
    }
    std::sort(by_global.begin(), by_global.end());
    std::vector<int> local;
    local.reserve(ranks.size());
    for (int g : ranks) {
      const auto it = std::lower_bound(by_global.begin(), by_global.end(), std::pair{g, 0});
      DTENSOR_CHECK(it != by_global.end() && it->first == g, b.describe() + ": new_group: global rank " +
                                                                 std::to_string(g) +
                                                                 " is not a member of this group");
      local.push_back(it->second);
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
  /// split(color, key) where every member passes every member's (colour, key), `every[r]` member r's (a
  /// mesh's axis groups, which each rank computes): nothing is exchanged first.
  ProcessGroup split(int color, int key, std::span<const SplitEntry> every) const {
    return ProcessGroup(impl("split").split(color, key, every));
  }

  /// Fails every pending and future op of this group and releases peers blocked on this rank.
  void abort(std::string_view reason) const { impl("abort").abort(reason); }

  /// This rank's last `last` ops on the group, oldest first, with their state and timings (the flight
  /// recorder, backends/flight_recorder.hpp): "#4 all_reduce (16 x float32, op sum) completed in 0.081 ms;
  /// ...".
  std::string flight_record(std::size_t last = 8) const {
    return impl("flight_record").flight_recorder().dump(last);
  }

  /// e.g. "rank 1 (global 3) of gloo group [2,3]".
  std::string to_string() const {
    if (backend_) {
      return backend_->describe();
    }
    return "non-member handle of group " + detail::format_list(ranks_);
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

  /// The name CommDebugMode files this group's ops under ("" unless set; a DeviceMesh labels its axis
  /// groups with the axis names).
  const std::string& label() const noexcept { return label_; }
  /// The same communicator under another label.
  ProcessGroup with_label(std::string label) const {
    ProcessGroup g = *this;
    g.label_ = std::move(label);
    return g;
  }

  // ---- the untyped front end (see the top of this file); ranks and roots are group ranks ---------------

  using WorkPtr = std::shared_ptr<WorkImpl>;

  WorkPtr all_reduce(BufferRef buf, ReduceOp op, const CommOptions& opts,
                     std::string_view what = "all_reduce") const {
    auto& b = impl(what);
    check_reduce(what, op, buf.dtype);
    const std::int64_t n = b.size();
    record(what, n > 1 ? (2 * (n - 1) * buf.count + n - 1) / n : 0, buf.dtype, op, buf.count);
    return on_stream(what, opts, detail::each_buffer(buf),
                     [&](const CommOptions& o) { return b.all_reduce(buf, op, o); });
  }
  WorkPtr reduce(BufferRef buf, int root, ReduceOp op, const CommOptions& opts) const {
    auto& b = impl("reduce");
    check_reduce("reduce", op, buf.dtype);
    record("reduce", b.rank() == root ? (b.size() - 1) * buf.count : 0, buf.dtype, op, buf.count);
    return on_stream("reduce", opts, detail::each_buffer(buf),
                     [&](const CommOptions& o) { return b.reduce(buf, root, op, o); });
  }
  WorkPtr broadcast(BufferRef buf, int root, const CommOptions& opts) const {
    auto& b = impl("broadcast");
    record("broadcast", b.rank() == root ? 0 : buf.count, buf.dtype, std::nullopt, buf.count);
    return on_stream("broadcast", opts, detail::each_buffer(buf),
                     [&](const CommOptions& o) { return b.broadcast(buf, root, o); });
  }
  WorkPtr all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                     std::span<const std::int64_t> displs, const CommOptions& opts,
                     std::string_view what = "all_gather") const {
    auto& b = impl(what);
    record(what, sum_except(counts, b.rank()), out.dtype, std::nullopt, sum_except(counts, -1));
    return on_stream(what, opts, detail::each_buffer(in, out),
                     [&](const CommOptions& o) { return b.all_gather(in, out, counts, displs, o); });
  }
  WorkPtr reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                         std::span<const std::int64_t> displs, ReduceOp op, const CommOptions& opts,
                         std::string_view what = "reduce_scatter") const {
    auto& b = impl(what);
    check_reduce(what, op, out.dtype);
    record(what, (b.size() - 1) * out.count, out.dtype, op, sum_except(counts, -1));
    return on_stream(what, opts, detail::each_buffer(in, out),
                     [&](const CommOptions& o) { return b.reduce_scatter(in, out, counts, displs, op, o); });
  }
  WorkPtr all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                     std::span<const std::int64_t> send_displs, BufferRef out,
                     std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                     const CommOptions& opts, std::string_view what = "all_to_all") const {
    auto& b = impl(what);
    record(what, sum_except(recv_counts, b.rank()), out.dtype, std::nullopt, sum_except(send_counts, -1));
    return on_stream(what, opts, detail::each_buffer(in, out), [&](const CommOptions& o) {
      return b.all_to_all(in, send_counts, send_displs, out, recv_counts, recv_displs, o);
    });
  }
  WorkPtr gather(BufferRef in, std::span<const BufferRef> blocks, int root, const CommOptions& opts) const {
    auto& b = impl("gather");
    std::int64_t received = 0;
    for (std::size_t i = 0; b.rank() == root && i < blocks.size(); ++i) {
      received += static_cast<int>(i) == root ? 0 : blocks[i].count;
    }
    record("gather", received, in.dtype, std::nullopt, in.count * b.size());
    return on_stream("gather", opts, detail::each_buffer(in, blocks),
                     [&](const CommOptions& o) { return b.gather(in, blocks, root, o); });
  }
  WorkPtr scatter(std::span<const BufferRef> blocks, BufferRef out, int root, const CommOptions& opts,
                  std::string_view what = "scatter") const {
    auto& b = impl(what);
    record(what, b.rank() == root ? 0 : out.count, out.dtype, std::nullopt, out.count * b.size());
    return on_stream(what, opts, detail::each_buffer(out, blocks),
                     [&](const CommOptions& o) { return b.scatter(blocks, out, root, o); });
  }
  WorkPtr barrier(const CommOptions& opts) const {
    auto& b = impl("barrier");
    record("barrier", 0, DType::uint8);
    return on_stream(
        "barrier", opts, [](auto&&) {}, [&](const CommOptions& o) { return b.barrier(o); });
  }
  /// The store-based barrier of comm/collectives.hpp's monitored_barrier (recorded, moves no bytes).
  void monitored_barrier(std::chrono::milliseconds timeout) const {
    auto& b = impl("monitored_barrier");
    record("monitored_barrier", 0, DType::uint8);
    CommWaitTimer::time("monitored_barrier", label_, [&] { b.monitored_barrier(timeout); });
    if (CommDebugMode::any_logging()) { // synchronous: waited for where it was issued
      CommDebugMode::watch(std::make_shared<detail::DoneWork>())->wait();
    }
  }
  /// A batch of point-to-point ops (recorded as one op called `what`). An empty batch is recorded and
  /// completes at once (a rank with nothing to move in a redistribution's exchange).
  WorkPtr p2p(std::span<const P2PRequest> requests, const CommOptions& opts,
              std::string_view what = "p2p") const {
    auto& b = impl(what);
    if (CommDebugMode::any_active()) {
      std::int64_t received = 0, sent = 0;
      std::vector<int> members;
      const bool log = CommDebugMode::any_logging();
      if (log) {
        members.push_back(ranks_[static_cast<std::size_t>(b.rank())]);
      }
      for (const P2PRequest& r : requests) {
        (r.kind == P2PRequest::Kind::recv ? received : sent) += static_cast<std::int64_t>(r.buffer.nbytes());
        if (log && std::find(members.begin(), members.end(), ranks_[static_cast<std::size_t>(r.peer)]) ==
                       members.end()) {
          members.push_back(ranks_[static_cast<std::size_t>(r.peer)]);
        }
      }
      const CommDebugMode::Shape shape{std::max(sent, received), members};
      CommDebugMode::record(what, label_, received, std::nullopt, &shape);
    }
    if (requests.empty()) { // complete at once; the op log marks its wait like any other op's
      WorkPtr done = std::make_shared<detail::DoneWork>();
      return CommDebugMode::any_logging() ? CommDebugMode::watch(std::move(done)) : done;
    }
    auto each = [requests](auto&& f) {
      for (const P2PRequest& r : requests) {
        f(r.buffer);
      }
    };
    return on_stream(what, opts, each, [&](const CommOptions& o) { return b.p2p(requests, o); });
  }

private:
  /// A bitwise op (band, bor, bxor) reduces integer tensors only: an Error before any communication, as
  /// torch.distributed refuses BAND, BOR and BXOR on floating tensors.
  void check_reduce(std::string_view what, ReduceOp op, DType dtype) const {
    if (is_bitwise(op) && dtype != DType::int32 && dtype != DType::int64 && dtype != DType::uint8) {
      throw Error(
          std::string(what) + " on " + to_string() + ": ReduceOp " + std::string(dtensor::to_string(op)) +
          " is bitwise and reduces int32, int64 and uint8 tensors, not " + std::string(dtype_name(dtype)));
    }
  }

  /// Submits on the op's stream (comm/stream.hpp); `each_buffer(f)` passes the op's buffers to f. While a
  /// CommWaitTimer is active on this thread, the submission is timed and so is the completion's wait().
  template <class EachBuffer, class Submit>
  WorkPtr on_stream(std::string_view what, const CommOptions& opts, EachBuffer&& each_buffer,
                    Submit&& submit) const {
    CommOptions o = opts;
    std::vector<void*> others = detail::choose_stream(o, each_buffer);
    WorkPtr w = CommWaitTimer::time(what, label_, [&] { return submit(o); });
    if (!others.empty()) {
      w = std::make_shared<detail::StreamSyncedWork>(std::move(w), o.stream, std::move(others));
    }
    if (CommWaitTimer::any_active()) {
      w = std::make_shared<detail::TimedWork>(std::move(w), what, label_);
    }
    if (CommDebugMode::any_logging()) { // the op log's wait mark
      w = CommDebugMode::watch(std::move(w));
    }
    return w;
  }

  /// Records an op in the active CommDebugMode(s): `elements` this rank receives; `size_elements` the op's
  /// size for the op log (CommDebugMode::Op::size).
  void record(std::string_view op, std::int64_t elements, DType dtype,
              std::optional<ReduceOp> reduce = std::nullopt, std::int64_t size_elements = 0) const {
    if (CommDebugMode::any_active()) {
      const auto bytes = static_cast<std::int64_t>(dtype_size(dtype));
      const CommDebugMode::Shape shape{size_elements * bytes, ranks_};
      CommDebugMode::record(op, label_, elements * bytes, reduce, &shape);
    }
  }
  /// The sum of `counts` but entry `me` (-1: all of them).
  static std::int64_t sum_except(std::span<const std::int64_t> counts, int me) {
    std::int64_t s = 0;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      s += static_cast<int>(i) == me ? 0 : counts[i];
    }
    return s;
  }

  std::shared_ptr<Backend> backend_;
  std::vector<int> ranks_;
  std::string label_;
};

} // namespace dtensor

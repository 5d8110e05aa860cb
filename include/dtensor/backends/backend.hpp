#pragma once
// The narrow runtime interface between the collectives front end (comm/) and a communication backend
// (backends/gloo/, backends/nccl/, or any backend registered by name: backends/registry.hpp). Everything
// here is untyped: raw buffers described by (pointer, element count, DType, Device), per-op options, and
// an asynchronous completion object.
//
// Backend is a validating front over protected hooks (c10d's Backend; thrust's system/detail/generic):
//  - The public ops (all_reduce ... split, abort) are not virtual. Each checks what every backend needs
//    checked, once, with one set of messages naming describe(), the op and the sizes: element counts and
//    data pointers, the backend's memory rule (check_memory), dtype agreement, counts against
//    displacements against buffer sizes, roots and peers in range, tags in range, one block per member,
//    no in-place all_to_all, and a communicator that was not aborted. Then it calls its do_* hook.
//  - Every do_* hook has a default that throws Error("<name> does not support <op>"), so a backend that
//    implements a subset of the ops is still a valid one.
//  - A backend writes only what its engine does differently: the hooks, check_memory (gloo: host memory;
//    NCCL: device memory on its GPU), do_abort, and split_store (or exchange_split) when split() should
//    work.
//
// Contract shared by every backend:
//  - Every op is asynchronous at this level: it is *submitted* and returns a WorkImpl. The synchronous
//    front end submits and waits. A host backend (gloo) runs ops on a per-group worker; a device backend
//    (NCCL) enqueues them on a stream and completes the WorkImpl with an event.
//  - Ops of one group execute in submission order. Every member submits the same collectives in the same
//    order with matching arguments (torch.distributed's rule).
//  - Argument errors a single rank can see (sizes, ranks out of range, wrong device) are thrown by the
//    submitting call, before any communication. Errors that happen during communication (timeouts, dead
//    peers) are stored in the WorkImpl and rethrown by wait().
//  - Variable-size ops (all_gather of uneven blocks, all_to_all with splits) take element counts and
//    displacements per rank, so a device backend can run them as grouped send/recv. gather and scatter take
//    one buffer per member on the root, like torch's lists, so the root needs no staging copy.
//
// The pieces, one idea each: buffer.hpp (BufferRef, P2PRequest), work.hpp (CommOptions, WorkImpl),
// split.hpp (SplitGroup), arg_checks.hpp (the checks and their messages), desync.hpp (DebugLevel::detail's
// desync check), monitored_barrier.hpp, group_creation.hpp (what each rank is creating, for messages).

#include "dtensor/backends/arg_checks.hpp"
#include "dtensor/backends/buffer.hpp"
#include "dtensor/backends/desync.hpp"
#include "dtensor/backends/flight_recorder.hpp"
#include "dtensor/backends/group_creation.hpp"
#include "dtensor/backends/monitored_barrier.hpp"
#include "dtensor/backends/split.hpp"
#include "dtensor/backends/work.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtensor {

/// One communicator: the members of a group, as seen from one of them.
class Backend {
public:
  using WorkPtr = std::shared_ptr<WorkImpl>;

  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // ---- identity ---------------------------------------------------------------------------------------

  /// The name it is registered under, e.g. "gloo" or "nccl".
  virtual std::string_view name() const noexcept = 0;
  /// This member's rank in the group, in [0, size()).
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  /// The global (world) rank of every member, indexed by group rank.
  virtual std::span<const int> global_ranks() const noexcept = 0;
  /// Human-readable name for messages, e.g. "rank 1 (global 2) of gloo group [0,2]".
  virtual std::string describe() const = 0;
  /// Whether this member plays its group alone, the others not running (a dry run, backends/fake): every
  /// op completes at once and nothing arrives from a peer, so a protocol that waits for a peer's message
  /// must supply what it expects itself.
  virtual bool dry_run() const noexcept { return false; }

  /// Default limit of every op (and of groups created from this one).
  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeout_ms_.load()); }
  void set_timeout(std::chrono::milliseconds timeout) {
    detail::check_timeout(timeout, where("set_timeout"));
    timeout_ms_.store(timeout.count());
  }

  // ---- collectives (every member submits; root/ranks are group ranks) -----------------------------------

  /// In place: buf = op(buf of every member).
  WorkPtr all_reduce(BufferRef buf, ReduceOp op, const CommOptions& opts) {
    check_buffer("all_reduce", buf, "tensor");
    check_not_aborted("all_reduce");
    desync_check(opts, {"all_reduce", buf.dtype, buf.count, -1, static_cast<int>(op)});
    return do_all_reduce(buf, op, opts);
  }

  /// In place on `root`; other members' buf is left unchanged.
  WorkPtr reduce(BufferRef buf, int root, ReduceOp op, const CommOptions& opts) {
    check_buffer("reduce", buf, "tensor");
    detail::check_root(head("reduce"), root, size(), "dst");
    check_not_aborted("reduce");
    desync_check(opts, {"reduce", buf.dtype, buf.count, root, static_cast<int>(op)});
    return do_reduce(buf, root, op, opts);
  }

  /// In place: buf = buf of `root`.
  WorkPtr broadcast(BufferRef buf, int root, const CommOptions& opts) {
    check_buffer("broadcast", buf, "tensor");
    detail::check_root(head("broadcast"), root, size(), "src");
    check_not_aborted("broadcast");
    desync_check(opts, {"broadcast", buf.dtype, buf.count, root});
    return do_broadcast(buf, root, opts);
  }

  /// out[displs[i] .. + counts[i]) = in of member i; in.count == counts[rank()].
  WorkPtr all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                     std::span<const std::int64_t> displs, const CommOptions& opts) {
    check_in_out("all_gather", in, out);
    detail::check_layout(head("all_gather"), "counts", counts, displs, out, size());
    detail::check_own_count(head("all_gather"), "input", in, counts, rank());
    check_not_aborted("all_gather");
    desync_check(opts, {"all_gather", in.dtype, out.count, -1, -1, counts});
    return do_all_gather(in, out, counts, displs, opts);
  }

  /// out = op over members m of in_m[displs[rank()] .. + counts[rank()]); out.count == counts[rank()].
  WorkPtr reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                         std::span<const std::int64_t> displs, ReduceOp op, const CommOptions& opts) {
    check_in_out("reduce_scatter", in, out);
    detail::check_layout(head("reduce_scatter"), "counts", counts, displs, in, size());
    detail::check_own_count(head("reduce_scatter"), "output", out, counts, rank());
    check_not_aborted("reduce_scatter");
    desync_check(opts, {"reduce_scatter", in.dtype, in.count, -1, static_cast<int>(op), counts});
    return do_reduce_scatter(in, out, counts, displs, op, opts);
  }

  /// Member i receives in[send_displs[i] .. + send_counts[i]) into its out[recv_displs[me] .. + ...).
  /// `in` and `out` must not overlap.
  WorkPtr all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                     std::span<const std::int64_t> send_displs, BufferRef out,
                     std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                     const CommOptions& opts) {
    const auto at = head("all_to_all");
    check_in_out("all_to_all", in, out);
    detail::check_layout(at, "input split sizes", send_counts, send_displs, in, size());
    detail::check_layout(at, "output split sizes", recv_counts, recv_displs, out, size());
    detail::check_all_to_all(at, in, send_counts, out, recv_counts, rank());
    check_not_aborted("all_to_all");
    desync_check(opts, {"all_to_all", in.dtype, -1, -1, -1, {}, send_counts, recv_counts});
    return do_all_to_all(in, send_counts, send_displs, out, recv_counts, recv_displs, opts);
  }

  /// On root: blocks[i] = in of member i (one block per member, blocks[i].count == that member's
  /// in.count; the blocks may be separate tensors or parts of one buffer, see split_buffer). blocks is
  /// ignored elsewhere.
  WorkPtr gather(BufferRef in, std::span<const BufferRef> blocks, int root, const CommOptions& opts) {
    check_buffer("gather", in, "input");
    detail::check_root(head("gather"), root, size(), "dst");
    check_blocks("gather", blocks, in, root);
    check_not_aborted("gather");
    if (detail::DesyncCheck::on(size())) {
      const auto recvs = rank() == root ? detail::block_counts(blocks) : std::vector<std::int64_t>{};
      desync_check(opts, {"gather", in.dtype, -1, root, -1, {}, {&in.count, 1}, recvs});
    }
    return do_gather(in, blocks, root, opts);
  }

  /// Member i receives root's blocks[i] into out (out.count == blocks[i].count). blocks is ignored off
  /// root.
  WorkPtr scatter(std::span<const BufferRef> blocks, BufferRef out, int root, const CommOptions& opts) {
    check_buffer("scatter", out, "output");
    detail::check_root(head("scatter"), root, size(), "src");
    check_blocks("scatter", blocks, out, root);
    check_not_aborted("scatter");
    if (detail::DesyncCheck::on(size())) {
      const auto sends = rank() == root ? detail::block_counts(blocks) : std::vector<std::int64_t>{};
      desync_check(opts, {"scatter", out.dtype, -1, root, -1, {}, sends, {&out.count, 1}});
    }
    return do_scatter(blocks, out, root, opts);
  }

  WorkPtr barrier(const CommOptions& opts) {
    check_not_aborted("barrier");
    desync_check(opts, {"barrier", DType::uint8, 0});
    return do_barrier(opts);
  }

  /// A barrier that names the members that did not come (torch's monitored_barrier, wait_all_ranks=True),
  /// through the group's store, so it also works when the communicator is stuck: waits up to `timeout`
  /// (zero: the group's) and throws TimeoutError naming the members missing at the deadline, e.g.
  /// "monitored_barrier #2: ranks 1, 3 (global 5, 7) did not arrive within 500 ms"
  /// (backends/monitored_barrier.hpp). Synchronous; a no-op on a group of one.
  void monitored_barrier(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
    check_not_aborted("monitored_barrier");
    const std::int64_t n = monitored_.fetch_add(1);
    if (size() > 1) {
      do_monitored_barrier(n, timeout.count() > 0 ? timeout : this->timeout());
    }
  }

  // ---- point to point ---------------------------------------------------------------------------------

  /// Posts every request of the batch before waiting on any (so opposite exchanges never deadlock);
  /// one WorkImpl completes when all of them did. Successive sends from a to b with one tag match
  /// successive receives on b from a with that tag, in order. A rank never sends to itself.
  WorkPtr p2p(std::span<const P2PRequest> requests, const CommOptions& opts) {
    for (const P2PRequest& r : requests) {
      const char* op = r.kind == P2PRequest::Kind::send ? "send" : "recv";
      check_buffer(op, r.buffer, "tensor");
      detail::check_peer_and_tag(head(op), r, rank(), size());
    }
    check_not_aborted("p2p");
    return do_p2p(requests, opts);
  }

  // ---- groups -----------------------------------------------------------------------------------------

  /// Every member of the new group calls it with the same list of *group* ranks (distinct, in range); the
  /// others need not call. Members of the list get a backend whose rank i is ranks[i]; the others get
  /// nullptr.
  std::shared_ptr<Backend> new_group(std::span<const int> ranks) {
    detail::check_group_ranks(head("new_group"), ranks, size());
    check_not_aborted("new_group");
    const auto it = std::find(ranks.begin(), ranks.end(), rank());
    if (it == ranks.end()) {
      return nullptr;
    }
    std::vector<int> global;
    for (int r : ranks) {
      global.push_back(global_ranks()[static_cast<std::size_t>(r)]);
    }
    const std::vector<int> members = global;
    return creating("new_group(" + detail::format_list(global) + ")", members,
                    [&] { return do_new_group(std::move(global), static_cast<int>(it - ranks.begin())); });
  }

  /// ncclCommSplit: every member calls it; members with equal color >= 0 form one group, ordered by
  /// (key, rank); color < 0 gives nullptr. The members learn each other's colour and key through
  /// split_store() (backends/split.hpp).
  std::shared_ptr<Backend> split(int color, int key) { return split_impl(color, key, {}); }

  /// split(color, key) where every member knows every member's colour and key (a mesh's axis groups, pure
  /// functions of the rank): `every[r]` is member r's, the same list on every member, so nothing is
  /// exchanged first. The fake backend (backends/fake/backend.hpp) splits only this way.
  std::shared_ptr<Backend> split(int color, int key, std::span<const SplitEntry> every) {
    DTENSOR_CHECK(every.size() == static_cast<std::size_t>(size()),
                  where("split") + ": " + std::to_string(every.size()) +
                      " colours and keys given for a group of " + std::to_string(size()));
    const SplitEntry& mine = every[static_cast<std::size_t>(rank())];
    DTENSOR_CHECK(mine.color == color && mine.key == key,
                  where("split") + ": the list gives this member colour " + std::to_string(mine.color) +
                      " and key " + std::to_string(mine.key) + ", but it passes colour " +
                      std::to_string(color) + " and key " + std::to_string(key));
    return split_impl(color, key, every);
  }

  /// Fails every pending and future op of this communicator with `reason`, and releases peers blocked
  /// on this member within seconds (do_abort: gloo closes the connections; NCCL: ncclCommAbort). Later
  /// calls do nothing.
  void abort(std::string_view reason) {
    {
      std::lock_guard lock(abort_m_);
      if (aborted_) {
        return;
      }
      aborted_ = std::string(reason);
    }
    do_abort(reason);
  }

  /// The reason abort() was given; nullopt while the communicator was not aborted.
  std::optional<std::string> aborted() const {
    std::lock_guard lock(abort_m_);
    return aborted_;
  }

  /// This group's last ops as this rank submitted them (backends/flight_recorder.hpp); a backend records
  /// into it and appends its dump to timeout and peer-failure messages (gloo does).
  FlightRecorder& flight_recorder() noexcept { return *flight_; }
  const FlightRecorder& flight_recorder() const noexcept { return *flight_; }
  /// The same recorder, for what outlives this backend (the NCCL watchdog finishes ops after it is gone).
  std::shared_ptr<FlightRecorder> shared_flight_recorder() const noexcept { return flight_; }

  /// The store every group of this rank's job shares (rank_store()), for what ranks coordinate off the
  /// groups' ops (checkpoint/async_save.hpp: an asynchronous save finishes through it while the training's
  /// ops go on); nullptr when there is none.
  Store* job_store() { return rank_store(); }

protected:
  /// `timeout`: the default limit of every op (see timeout()).
  explicit Backend(std::chrono::milliseconds timeout) : timeout_ms_(timeout.count()) {}

  // ---- hooks: called with checked arguments; the defaults say the op is not supported ---------------------

  virtual WorkPtr do_all_reduce(BufferRef, ReduceOp, const CommOptions&) { unsupported("all_reduce"); }
  virtual WorkPtr do_reduce(BufferRef, int /*root*/, ReduceOp, const CommOptions&) { unsupported("reduce"); }
  virtual WorkPtr do_broadcast(BufferRef, int /*root*/, const CommOptions&) { unsupported("broadcast"); }
  virtual WorkPtr do_all_gather(BufferRef /*in*/, BufferRef /*out*/, std::span<const std::int64_t> /*counts*/,
                                std::span<const std::int64_t> /*displs*/, const CommOptions&) {
    unsupported("all_gather");
  }
  virtual WorkPtr do_reduce_scatter(BufferRef /*in*/, BufferRef /*out*/, std::span<const std::int64_t>,
                                    std::span<const std::int64_t>, ReduceOp, const CommOptions&) {
    unsupported("reduce_scatter");
  }
  virtual WorkPtr do_all_to_all(BufferRef /*in*/, std::span<const std::int64_t>,
                                std::span<const std::int64_t>, BufferRef /*out*/,
                                std::span<const std::int64_t>, std::span<const std::int64_t>,
                                const CommOptions&) {
    unsupported("all_to_all");
  }
  /// `blocks` is only meaningful (and checked) on the root.
  virtual WorkPtr do_gather(BufferRef /*in*/, std::span<const BufferRef> /*blocks*/, int /*root*/,
                            const CommOptions&) {
    unsupported("gather");
  }
  virtual WorkPtr do_scatter(std::span<const BufferRef> /*blocks*/, BufferRef /*out*/, int /*root*/,
                             const CommOptions&) {
    unsupported("scatter");
  }
  virtual WorkPtr do_barrier(const CommOptions&) { unsupported("barrier"); }
  virtual WorkPtr do_p2p(std::span<const P2PRequest>, const CommOptions&) { unsupported("p2p"); }
  /// Called by the members only: `global` are the new group's members (global ranks, in group order),
  /// `rank` this member's position among them.
  virtual std::shared_ptr<Backend> do_new_group(std::vector<int> /*global*/, int /*rank*/) {
    unsupported("new_group");
  }
  /// Called by every member, also those with colour < 0 (group.rank == -1; return nullptr for them).
  virtual std::shared_ptr<Backend> do_split(const SplitGroup& /*group*/) { unsupported("split"); }
  /// Every member's (colour, key) for split #g.index, in group rank order (a group of several members;
  /// `what` heads the messages). Default: through split_store() (backends/split.hpp); a backend that
  /// can exchange them itself (MPI: an allgather) overrides it.
  virtual std::vector<SplitEntry> exchange_split(const SplitGroup& g, const std::string& what) {
    Store* store = split_store();
    DTENSOR_CHECK(store != nullptr, what + ": no store to exchange the colours and keys through");
    return detail::exchange_split_colors(*store, "split" + std::to_string(g.index), rank(), size(), g.color,
                                         g.key, timeout(), what);
  }
  /// monitored_barrier #n on a group of several members, waiting at most `limit`. Default: through
  /// split_store() (backends/monitored_barrier.hpp); the fake backend, whose members never wait, returns.
  virtual void do_monitored_barrier(std::int64_t n, std::chrono::milliseconds limit) {
    detail::monitored_barrier(split_store(), n, rank(), global_ranks(), limit, where("monitored_barrier"));
  }
  /// The communication side of abort(); the front already fails later ops. Default: nothing more.
  virtual void do_abort(std::string_view /*reason*/) {}

  /// The backend's rule for where buffers live (gloo: host memory; NCCL: its GPU). Throws Error with
  /// where(op) + ": the " + what + ...; the default accepts any device.
  virtual void check_memory(const char* /*op*/, const BufferRef& /*b*/, const char* /*what*/) const {}

  /// A backend's own reason to refuse every op (e.g. NCCL: the watchdog failed the communicator): throws
  /// it. Called after the abort check; the default accepts.
  virtual void check_usable(const char* /*op*/) const {}

  /// The store split() exchanges colours and keys through (this group's view, so keys of different groups
  /// never meet), and desync checks and monitored_barrier meet in; nullptr when there is none (then split()
  /// works only for one member).
  virtual Store* split_store() { return nullptr; }

  /// The store shared by every group of this rank's job (the backend's root store), through which
  /// new_group and split report what each rank is creating (backends/group_creation.hpp); nullptr when
  /// there is none.
  virtual Store* rank_store() { return nullptr; }

  /// "<describe()>: <op>", the head of every message about an op.
  std::string where(std::string_view op) const { return describe() + ": " + std::string(op); }

  [[noreturn]] void unsupported(const char* op) const {
    throw Error(where(op) + ": " + std::string(name()) + " does not support " + op);
  }

private:
  /// where(op), built only when it is called (when a check fails: backends/arg_checks.hpp).
  struct Head {
    const Backend* self;
    const char* op;
    std::string operator()() const { return self->where(op); }
  };
  Head head(const char* op) const { return {this, op}; }

  /// The backend's memory rule (check_memory), then what every buffer needs (backends/arg_checks.hpp).
  void check_buffer(const char* op, const BufferRef& b, const char* what) const {
    check_buffer_memory(op, b, what);
    detail::check_buffer(head(op), b, what);
  }

  /// Meta buffers (no data) only in a dry run; then the backend's own rule.
  void check_buffer_memory(const char* op, const BufferRef& b, const char* what) const {
    DTENSOR_CHECK(!b.device.is_meta() || dry_run(),
                  where(op) + ": the " + what + " (" + std::to_string(b.count) +
                      " elements) is a meta tensor, which has no data to communicate; run meta tensors on "
                      "the fake backend (a dry run: DTENSOR_BACKEND=fake, backends/fake/backend.hpp)");
    check_memory(op, b, what);
  }

  /// An input and an output of one dtype.
  void check_in_out(const char* op, const BufferRef& in, const BufferRef& out) const {
    check_buffer(op, in, "input");
    check_buffer(op, out, "output");
    detail::check_same_dtype(head(op), in, out);
  }

  /// gather's / scatter's blocks, on the root only (elsewhere they are ignored).
  void check_blocks(const char* op, std::span<const BufferRef> blocks, const BufferRef& mine,
                    int root) const {
    if (rank() == root) {
      const bool is_gather = std::string_view(op) == "gather";
      detail::check_blocks(head(op), is_gather, blocks, mine, rank(), size(),
                           [&](const BufferRef& b) { check_buffer_memory(op, b, "block"); });
    }
  }

  /// An aborted communicator (or one the backend refuses, check_usable) takes no more ops.
  void check_not_aborted(const char* op) const {
    if (auto reason = aborted()) {
      throw Error(where(op) + ": the group was aborted: " + *reason);
    }
    check_usable(op);
  }

  /// DebugLevel::detail: the members compare `f` through split_store() before any data moves
  /// (backends/desync.hpp); nothing without a store or on a group of one.
  void desync_check(const CommOptions& opts, const detail::CollectiveFields& f) {
    if (!detail::DesyncCheck::on(size())) {
      return;
    }
    if (Store* store = split_store()) {
      desync_.check(*store, rank(), size(), opts.timeout.count() > 0 ? opts.timeout : timeout(), where(f.op),
                    f);
    }
  }

  /// Runs `make`, reporting it in rank_store() (backends/group_creation.hpp).
  template <class Make>
  std::shared_ptr<Backend> creating(const std::string& desc, const std::vector<int>& members, Make&& make) {
    const int me = global_ranks()[static_cast<std::size_t>(rank())];
    return detail::report_group_creation(rank_store(), me, desc, members, std::forward<Make>(make));
  }

  /// split's body; `every` empty: the colours and keys are exchanged (exchange_split).
  std::shared_ptr<Backend> split_impl(int color, int key, std::span<const SplitEntry> every) {
    check_not_aborted("split");
    SplitGroup g;
    g.color = color;
    g.key = key;
    g.index = splits_.fetch_add(1);
    const std::string what = describe() + ": split(color " + std::to_string(color) + ", key " +
                             std::to_string(key) + ") #" + std::to_string(g.index);
    const auto old = global_ranks();
    return creating("split #" + std::to_string(g.index) + " of group " + detail::format_list(old),
                    std::vector<int>(old.begin(), old.end()), [&] { return split_hook(g, what, every); });
  }

  std::shared_ptr<Backend> split_hook(SplitGroup& g, const std::string& what,
                                      std::span<const SplitEntry> every) {
    std::vector<SplitEntry> exchanged;
    if (every.empty()) {
      exchanged = size() > 1 ? exchange_split(g, what) : std::vector<SplitEntry>{{g.color, g.key}};
      every = exchanged;
    }
    const detail::SplitMembers members = detail::split_members(every, g.color, rank());
    const auto ranks = global_ranks();
    for (int r : members.ranks) {
      g.global_ranks.push_back(ranks[static_cast<std::size_t>(r)]);
    }
    g.rank = members.me;
    return do_split(g);
  }

  std::atomic<std::int64_t> timeout_ms_;
  std::atomic<int> splits_{0};             // split() calls, which every member makes in the same order
  std::atomic<std::int64_t> monitored_{0}; // monitored_barrier calls
  detail::DesyncCheck desync_;             // collectives checked by desync_check
  std::shared_ptr<FlightRecorder> flight_ = std::make_shared<FlightRecorder>();
  mutable std::mutex abort_m_;
  std::optional<std::string> aborted_;
};

} // namespace dtensor

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

#include "dtensor/backends/flight_recorder.hpp"
#include "dtensor/backends/split.hpp"
#include "dtensor/core/debug.hpp"
#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
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

/// `count` elements of `dtype` starting at `data`, in the memory of `device`. Never owns.
struct BufferRef {
  void* data = nullptr;
  std::int64_t count = 0;
  DType dtype = DType::float32;
  Device device = Device::cpu();
  /// The CUDA stream (cudaStream_t) the memory is ordered on: work on it wrote the data, and its release
  /// is enqueued there. nullptr: the legacy default stream, or host memory.
  void* stream = nullptr;

  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(count) * dtype_size(dtype); }
};

/// The blocks buf[displs[i] .. + counts[i]) of one buffer, e.g. for gather and scatter.
inline std::vector<BufferRef> split_buffer(BufferRef buf, std::span<const std::int64_t> counts,
                                           std::span<const std::int64_t> displs) {
  std::vector<BufferRef> blocks(counts.size(), buf);
  for (std::size_t i = 0; i < counts.size(); ++i) {
    blocks[i].data =
        static_cast<char*>(buf.data) + static_cast<std::size_t>(displs[i]) * dtype_size(buf.dtype);
    blocks[i].count = counts[i];
  }
  return blocks;
}

/// Whether the blocks (counts[i] elements at displs[i]) lie back to back in member order from 0.
inline bool packed_in_order(std::span<const std::int64_t> counts, std::span<const std::int64_t> displs) {
  std::int64_t at = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (displs[i] != at) {
      return false;
    }
    at += counts[i];
  }
  return true;
}

/// Options of one submitted op.
struct CommOptions {
  /// End-to-end limit for this op; zero means the group's timeout.
  std::chrono::milliseconds timeout{0};
  /// Device backends: the stream (cudaStream_t) the op is ordered after and that wait() makes wait on the
  /// op's completion event; nullptr = the group's internal stream ordered after the current stream.
  /// Host backends ignore it.
  void* stream = nullptr;
  /// The caller waits for the op right after submitting it (the synchronous front end). A host backend may
  /// then run it on the calling thread when nothing else of the group is pending (no thread hop).
  bool blocking = false;
};

/// Completion of one submitted op (or one batch of point-to-point ops).
class WorkImpl {
public:
  virtual ~WorkImpl() = default;
  /// Non-blocking: true once the op finished, successfully or not.
  virtual bool is_completed() = 0;
  /// Makes the op's results visible to the caller and rethrows its error (dtensor::Error or
  /// dtensor::TimeoutError). Host backends block until the op finished; device backends make the caller's
  /// stream wait on the op's event (and block the host only on error checks).
  virtual void wait() = 0;
};

/// One point-to-point operation of a batch.
struct P2PRequest {
  enum class Kind : std::uint8_t { send, recv };
  Kind kind = Kind::send;
  BufferRef buffer;
  int peer = 0; ///< rank in the group, not this rank
  int tag = 0;  ///< user tag, 0 <= tag < kMaxP2PTag
};

/// Largest user tag + 1 accepted by point-to-point ops.
inline constexpr int kMaxP2PTag = 1 << 23;

/// What split() hands its hook: the new group as every member computed it (backends/split.hpp).
struct SplitGroup {
  int color = 0;
  int key = 0;
  /// How many splits of this group came before (every member counts the same): names the new group's
  /// rendezvous, e.g. under "s<index>c<color>".
  int index = 0;
  /// The new group's members as global ranks, in new-group order (empty when color < 0).
  std::vector<int> global_ranks;
  /// This member's rank in the new group; -1 when color < 0.
  int rank = -1;
};

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
    desync_check(opts, "all_reduce", buf.dtype, buf.count, -1, static_cast<int>(op));
    return do_all_reduce(buf, op, opts);
  }

  /// In place on `root`; other members' buf is left unchanged.
  WorkPtr reduce(BufferRef buf, int root, ReduceOp op, const CommOptions& opts) {
    check_buffer("reduce", buf, "tensor");
    check_root("reduce", root, "dst");
    check_not_aborted("reduce");
    desync_check(opts, "reduce", buf.dtype, buf.count, root, static_cast<int>(op));
    return do_reduce(buf, root, op, opts);
  }

  /// In place: buf = buf of `root`.
  WorkPtr broadcast(BufferRef buf, int root, const CommOptions& opts) {
    check_buffer("broadcast", buf, "tensor");
    check_root("broadcast", root, "src");
    check_not_aborted("broadcast");
    desync_check(opts, "broadcast", buf.dtype, buf.count, root, -1);
    return do_broadcast(buf, root, opts);
  }

  /// out[displs[i] .. + counts[i]) = in of member i; in.count == counts[rank()].
  WorkPtr all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                     std::span<const std::int64_t> displs, const CommOptions& opts) {
    check_buffer("all_gather", in, "input");
    check_buffer("all_gather", out, "output");
    check_same_dtype("all_gather", in, out);
    check_layout("all_gather", "counts", counts, displs, out);
    check_own_count("all_gather", "input", in, counts);
    check_not_aborted("all_gather");
    desync_check(opts, "all_gather", in.dtype, out.count, -1, -1, counts);
    return do_all_gather(in, out, counts, displs, opts);
  }

  /// out = op over members m of in_m[displs[rank()] .. + counts[rank()]); out.count == counts[rank()].
  WorkPtr reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                         std::span<const std::int64_t> displs, ReduceOp op, const CommOptions& opts) {
    check_buffer("reduce_scatter", in, "input");
    check_buffer("reduce_scatter", out, "output");
    check_same_dtype("reduce_scatter", in, out);
    check_layout("reduce_scatter", "counts", counts, displs, in);
    check_own_count("reduce_scatter", "output", out, counts);
    check_not_aborted("reduce_scatter");
    desync_check(opts, "reduce_scatter", in.dtype, in.count, -1, static_cast<int>(op), counts);
    return do_reduce_scatter(in, out, counts, displs, op, opts);
  }

  /// Member i receives in[send_displs[i] .. + send_counts[i]) into its out[recv_displs[me] .. + ...).
  /// `in` and `out` must not overlap.
  WorkPtr all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                     std::span<const std::int64_t> send_displs, BufferRef out,
                     std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                     const CommOptions& opts) {
    check_buffer("all_to_all", in, "input");
    check_buffer("all_to_all", out, "output");
    check_same_dtype("all_to_all", in, out);
    check_layout("all_to_all", "input split sizes", send_counts, send_displs, in);
    check_layout("all_to_all", "output split sizes", recv_counts, recv_displs, out);
    const auto me = static_cast<std::size_t>(rank());
    DTENSOR_CHECK(send_counts[me] == recv_counts[me],
                  where("all_to_all") + ": this rank sends itself " + std::to_string(send_counts[me]) +
                      " elements but expects " + std::to_string(recv_counts[me]));
    const auto ib = reinterpret_cast<std::uintptr_t>(in.data);
    const auto ob = reinterpret_cast<std::uintptr_t>(out.data);
    DTENSOR_CHECK(in.nbytes() == 0 || out.nbytes() == 0 || ib + in.nbytes() <= ob || ob + out.nbytes() <= ib,
                  where("all_to_all") + ": the input (" + std::to_string(in.count) +
                      " elements) and the output (" + std::to_string(out.count) +
                      " elements) overlap; all_to_all does not run in place: use separate buffers");
    check_not_aborted("all_to_all");
    desync_check(opts, "all_to_all", in.dtype, -1, -1, -1, {}, send_counts, recv_counts);
    return do_all_to_all(in, send_counts, send_displs, out, recv_counts, recv_displs, opts);
  }

  /// On root: blocks[i] = in of member i (one block per member, blocks[i].count == that member's
  /// in.count; the blocks may be separate tensors or parts of one buffer, see split_buffer). blocks is
  /// ignored elsewhere.
  WorkPtr gather(BufferRef in, std::span<const BufferRef> blocks, int root, const CommOptions& opts) {
    check_buffer("gather", in, "input");
    check_root("gather", root, "dst");
    if (rank() == root) { // blocks only matter on the root
      check_blocks("gather", blocks, in);
    }
    check_not_aborted("gather");
    if (desync_on()) {
      desync_check(opts, "gather", in.dtype, -1, root, -1, {}, std::span<const std::int64_t>(&in.count, 1),
                   rank() == root ? block_counts(blocks) : std::vector<std::int64_t>{});
    }
    return do_gather(in, blocks, root, opts);
  }

  /// Member i receives root's blocks[i] into out (out.count == blocks[i].count). blocks is ignored off
  /// root.
  WorkPtr scatter(std::span<const BufferRef> blocks, BufferRef out, int root, const CommOptions& opts) {
    check_buffer("scatter", out, "output");
    check_root("scatter", root, "src");
    if (rank() == root) {
      check_blocks("scatter", blocks, out);
    }
    check_not_aborted("scatter");
    if (desync_on()) {
      desync_check(opts, "scatter", out.dtype, -1, root, -1, {},
                   rank() == root ? block_counts(blocks) : std::vector<std::int64_t>{},
                   std::span<const std::int64_t>(&out.count, 1));
    }
    return do_scatter(blocks, out, root, opts);
  }

  WorkPtr barrier(const CommOptions& opts) {
    check_not_aborted("barrier");
    desync_check(opts, "barrier", DType::uint8, 0, -1, -1);
    return do_barrier(opts);
  }

  /// A barrier that names the members that did not come (torch's monitored_barrier, wait_all_ranks=True):
  /// each member leaves "mbarrier/<n>/<rank>" in the group's store (n: this group's monitored barriers so
  /// far) and waits up to `timeout` (zero: the group's) for every other member's. Throws TimeoutError
  /// naming the members missing at the deadline, e.g. "monitored_barrier #2: ranks 1, 3 (global 5, 7) did not
  /// arrive within 500 ms". Through the store, not the backend, so it also works when the communicator is
  /// stuck. Synchronous; a no-op on a group of one.
  void monitored_barrier(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
    check_not_aborted("monitored_barrier");
    const std::int64_t n = monitored_.fetch_add(1);
    if (size() == 1) {
      return;
    }
    Store* store = split_store();
    DTENSOR_CHECK(store != nullptr,
                  where("monitored_barrier") + ": this backend has no store to meet through");
    const auto limit = timeout.count() > 0 ? timeout : this->timeout();
    detail::check_timeout(limit, where("monitored_barrier"));
    const auto key = [](std::int64_t k, int r) {
      return "mbarrier/" + std::to_string(k) + "/" + std::to_string(r);
    };
    store->set(key(n, rank()), std::string_view("arrived"));
    std::vector<std::string> keys;
    for (int r = 0; r < size(); ++r) {
      keys.push_back(key(n, r));
    }
    try {
      store->wait(keys, limit);
    } catch (const std::exception& e) {
      std::vector<int> missing;
      std::vector<int> missing_global;
      for (int r = 0; r < size(); ++r) {
        bool there = false;
        try {
          there = store->check({keys[static_cast<std::size_t>(r)]});
        } catch (...) {
        }
        if (!there) {
          missing.push_back(r);
          missing_global.push_back(global_ranks()[static_cast<std::size_t>(r)]);
        }
      }
      if (missing.empty()) { // every member came, but the wait did not see it in time (the store failed)
        throw TimeoutError(where("monitored_barrier") + " #" + std::to_string(n) + ": " + e.what());
      }
      throw TimeoutError(where("monitored_barrier") + " #" + std::to_string(n) + ": " +
                         (missing.size() == 1 ? "rank " : "ranks ") +
                         detail::format_list(missing, ", ", "", "") + " (global " +
                         detail::format_list(missing_global, ", ", "", "") + ") did not arrive within " +
                         std::to_string(limit.count()) + " ms");
    }
    if (n >= 2) { // every member passed #n-2 before arriving at #n-1, which this rank saw
      try {
        store->delete_key(key(n - 2, rank()));
      } catch (...) {
      }
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
      DTENSOR_CHECK(r.peer >= 0 && r.peer < size() && r.peer != rank(),
                    where(op) + ": peer " + std::to_string(r.peer) +
                        (r.peer == rank() ? " is this rank itself" : " is out of range") +
                        " for a group of " + std::to_string(size()));
      DTENSOR_CHECK(r.tag >= 0 && r.tag < kMaxP2PTag, where(op) + ": tag " + std::to_string(r.tag) +
                                                          " is outside [0, " + std::to_string(kMaxP2PTag) +
                                                          ")");
    }
    check_not_aborted("p2p");
    return do_p2p(requests, opts);
  }

  // ---- groups -----------------------------------------------------------------------------------------

  /// Every member of the new group calls it with the same list of *group* ranks (distinct, in range); the
  /// others need not call. Members of the list get a backend whose rank i is ranks[i]; the others get
  /// nullptr.
  std::shared_ptr<Backend> new_group(std::span<const int> ranks) {
    std::vector<int> sorted(ranks.begin(), ranks.end());
    std::sort(sorted.begin(), sorted.end());
    DTENSOR_CHECK(!ranks.empty() && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() &&
                      sorted.front() >= 0 && sorted.back() < size(),
                  where("new_group") + ": ranks " + detail::format_list(ranks) +
                      " must be distinct group ranks in [0, " + std::to_string(size()) + ")");
    check_not_aborted("new_group");
    const auto it = std::find(ranks.begin(), ranks.end(), rank());
    if (it == ranks.end()) {
      return nullptr;
    }
    const auto all = global_ranks();
    std::vector<int> global;
    global.reserve(ranks.size());
    for (int r : ranks) {
      global.push_back(all[static_cast<std::size_t>(r)]);
    }
    const std::string desc = "new_group(" + detail::format_list(global) + ")";
    std::vector<int> members = global;
    return creating(desc, members,
                    [&] { return do_new_group(std::move(global), static_cast<int>(it - ranks.begin())); });
  }

  /// ncclCommSplit: every member calls it; members with equal color >= 0 form one group, ordered by
  /// (key, rank); color < 0 gives nullptr. The members learn each other's colour and key through
  /// split_store() (backends/split.hpp).
  std::shared_ptr<Backend> split(int color, int key) {
    check_not_aborted("split");
    SplitGroup g;
    g.color = color;
    g.key = key;
    g.index = splits_.fetch_add(1);
    const std::string what = describe() + ": split(color " + std::to_string(color) + ", key " +
                             std::to_string(key) + ") #" + std::to_string(g.index);
    const auto old_members = global_ranks();
    return creating("split #" + std::to_string(g.index) + " of group " + detail::format_list(old_members),
                    std::vector<int>(old_members.begin(), old_members.end()),
                    [&] { return split_hook(g, what); });
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

  /// This group's last ops as this rank submitted them (backends/flight_recorder.hpp); a backend records
  /// into it and appends its dump to timeout and peer-failure messages (gloo does).
  FlightRecorder& flight_recorder() noexcept { return *flight_; }
  const FlightRecorder& flight_recorder() const noexcept { return *flight_; }
  /// The same recorder, for what outlives this backend (the NCCL watchdog finishes ops after it is gone).
  std::shared_ptr<FlightRecorder> shared_flight_recorder() const noexcept { return flight_; }

  /// The reason abort() was given; nullopt while the communicator was not aborted.
  std::optional<std::string> aborted() const {
    std::lock_guard lock(abort_m_);
    return aborted_;
  }

private:
  std::shared_ptr<Backend> split_hook(SplitGroup& g, const std::string& what) {
    const std::vector<detail::SplitEntry> all =
        size() > 1 ? exchange_split(g, what) : std::vector<detail::SplitEntry>{{g.color, g.key}};
    const detail::SplitMembers members = detail::split_members(all, g.color, rank());
    const auto ranks = global_ranks();
    for (int r : members.ranks) {
      g.global_ranks.push_back(ranks[static_cast<std::size_t>(r)]);
    }
    g.rank = members.me;
    return do_split(g);
  }

  /// Runs `make` (a group creation this rank calls `desc`, the same text on every member that makes the
  /// same group) after leaving "creating <desc>" under "creating/<global rank>" in rank_store(), and
  /// "created <desc>" once it returned. When it fails, the error says what each member of `members` (global
  /// ranks) that is not making the same group was doing: members that make groups in different orders wait
  /// for each other until the timeout, and the message then says so on every member.
  template <class Make>
  std::shared_ptr<Backend> creating(const std::string& desc, const std::vector<int>& members, Make&& make) {
    Store* store = rank_store();
    const int me = global_ranks()[static_cast<std::size_t>(rank())];
    const auto note = [&](const std::string& what) {
      if (store != nullptr) {
        try {
          store->set("creating/" + std::to_string(me), std::string_view(what));
        } catch (...) { // the report is best effort: the store may be gone with a failed process
        }
      }
    };
    note("creating " + desc);
    std::string elsewhere;
    try {
      auto group = make();
      note("created " + desc);
      return group;
    } catch (const Error& e) {
      for (int m : members) {
        std::optional<std::vector<char>> v;
        try {
          v = m == me || store == nullptr ? std::nullopt : store->try_get("creating/" + std::to_string(m));
        } catch (...) {
        }
        const std::string theirs = v ? std::string(v->begin(), v->end()) : "";
        if (m != me && store != nullptr && theirs != "creating " + desc) {
          elsewhere += (elsewhere.empty() ? "" : "; ") + std::string("global rank ") + std::to_string(m) +
                       (theirs.empty() ? " has made no group yet" : " is at: " + theirs);
        }
      }
      if (elsewhere.empty()) {
        throw;
      }
      const std::string msg = std::string(e.what()) + " [while this rank (global " + std::to_string(me) +
                              ") was making " + desc + ": " + elsewhere +
                              "; do the members create their groups in different orders?]";
      if (dynamic_cast<const TimeoutError*>(&e) != nullptr) {
        throw TimeoutError(msg);
      }
      throw Error(msg);
    }
  }

protected:
  /// The store shared by every group of this rank's job (the backend's root store), through which
  /// creating() reports what each rank is creating; nullptr when there is none.
  virtual Store* rank_store() { return nullptr; }

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
  virtual std::vector<detail::SplitEntry> exchange_split(const SplitGroup& g, const std::string& what) {
    Store* store = split_store();
    DTENSOR_CHECK(store != nullptr, what + ": no store to exchange the colours and keys through");
    return detail::exchange_split_colors(*store, "split" + std::to_string(g.index), rank(), size(), g.color,
                                         g.key, timeout(), what);
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
  /// never meet); nullptr when there is none (then split() works only for one member).
  virtual Store* split_store() { return nullptr; }

  /// "<describe()>: <op>", the head of every message about an op.
  std::string where(std::string_view op) const { return describe() + ": " + std::string(op); }

  [[noreturn]] void unsupported(const char* op) const {
    throw Error(where(op) + ": " + std::string(name()) + " does not support " + op);
  }

private:
  /// Whether desync_check does anything (DebugLevel::detail on a group of several members).
  bool desync_on() const { return debug_level() == DebugLevel::detail && size() > 1; }

  static std::vector<std::int64_t> block_counts(std::span<const BufferRef> blocks) {
    std::vector<std::int64_t> c;
    for (const BufferRef& b : blocks) {
      c.push_back(b.count);
    }
    return c;
  }

  /// DebugLevel::detail (core/debug.hpp): the members compare what they are about to run before any data
  /// moves. Each leaves "desync/<n>/<rank>" in split_store() -- the group's op number n, the op, dtype,
  /// count (-1: the members' counts may differ), root, reduce op, the counts every member passes
  /// (all_gather, reduce_scatter), and what it sends to / receives from each member (`sends`, `recvs`:
  /// all_to_all's splits; gather's and scatter's one block, or the root's list) -- and reads the others'.
  /// A difference, or a send that does not match its receive, throws Error on every member naming the
  /// fields per member (the group stays usable: nothing was sent); a member that does not come within the
  /// op's timeout gives TimeoutError naming it and the last op it checked. Costs a store set, a wait, a
  /// multi_get and a delete per collective.
  void desync_check(const CommOptions& opts, const char* op, DType dtype, std::int64_t count, int root,
                    int reduce, std::span<const std::int64_t> counts = {},
                    std::span<const std::int64_t> sends = {}, std::span<const std::int64_t> recvs = {}) {
    if (!desync_on()) {
      return;
    }
    Store* store = split_store();
    if (store == nullptr) {
      return;
    }
    const std::int64_t n = desync_seq_.fetch_add(1);
    const auto key = [](std::int64_t k, int r) {
      return "desync/" + std::to_string(k) + "/" + std::to_string(r);
    };
    // Fields, '|'-separated: op, dtype, count, root, reduce op, counts, sends, recvs.
    const std::string mine = std::string(op) + "|" + std::string(dtype_name(dtype)) + "|" +
                             std::to_string(count) + "|" + std::to_string(root) + "|" +
                             (reduce >= 0 ? std::string(to_string(static_cast<ReduceOp>(reduce))) : "-") +
                             "|" + (counts.empty() ? "-" : detail::format_list(counts)) + "|" +
                             (sends.empty() ? "-" : detail::format_list(sends)) + "|" +
                             (recvs.empty() ? "-" : detail::format_list(recvs));
    store->set(key(n, rank()), std::string_view(mine));
    std::vector<std::string> keys;
    for (int r = 0; r < size(); ++r) {
      keys.push_back(key(n, r));
    }
    const auto limit = opts.timeout.count() > 0 ? opts.timeout : timeout();
    const std::string head = where(op) + ": desync check of collective #" + std::to_string(n);
    try {
      store->wait(keys, limit);
    } catch (const std::exception&) {
      std::string missing;
      for (int r = 0; r < size(); ++r) {
        if (!store->check({keys[static_cast<std::size_t>(r)]})) {
          std::optional<std::vector<char>> last;
          try {
            last = n > 0 ? store->try_get(key(n - 1, r)) : std::nullopt;
          } catch (...) {
          }
          missing += (missing.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) +
                     (last ? " (its last checked collective: #" + std::to_string(n - 1) + " " +
                                 describe_fields(std::string(last->begin(), last->end())) + ")"
                           : "");
        }
      }
      throw TimeoutError(head + ": not every member reached it within " + std::to_string(limit.count()) +
                         " ms; missing: " + missing + "; this rank: " + describe_fields(mine));
    }
    const auto values = store->multi_get(keys);
    if (n >= 2) {
      try { // every member read #n-2 before setting #n-1, which this rank has read
        store->delete_key(key(n - 2, rank()));
      } catch (...) {
      }
    }
    std::vector<std::vector<std::string>> fields;
    for (const auto& v : values) {
      fields.push_back(split_fields(std::string(v.begin(), v.end())));
    }
    static constexpr const char* names[] = {"op", "dtype", "count", "root", "reduce op", "counts"};
    std::string differ;
    for (std::size_t f = 0; f < 6; ++f) {
      for (const auto& other : fields) {
        if (other[f] != fields[0][f] && (f != 2 || (other[f] != "-1" && fields[0][f] != "-1"))) {
          differ += (differ.empty() ? "" : ", ") + std::string(names[f]);
          break;
        }
      }
    }
    // What member i sends member j must be what j expects from i (all_to_all, gather, scatter).
    if (differ.empty()) {
      for (int i = 0; i < size() && differ.empty(); ++i) {
        for (int j = 0; j < size(); ++j) {
          const auto s = parse_counts(fields[static_cast<std::size_t>(i)][6]);
          const auto r = parse_counts(fields[static_cast<std::size_t>(j)][7]);
          const auto sent = s.size() == 1                    ? s[0]
                            : j < static_cast<int>(s.size()) ? s[static_cast<std::size_t>(j)]
                                                             : -1;
          const auto got = r.size() == 1                    ? r[0]
                           : i < static_cast<int>(r.size()) ? r[static_cast<std::size_t>(i)]
                                                            : -1;
          if (sent >= 0 && got >= 0 && (s.size() != 1 || r.size() != 1) && sent != got) {
            differ = "sizes (rank " + std::to_string(i) + " sends " + std::to_string(sent) + " to rank " +
                     std::to_string(j) + ", which expects " + std::to_string(got) + ")";
            break;
          }
        }
      }
    }
    if (differ.empty()) {
      return;
    }
    std::string list;
    for (int r = 0; r < size(); ++r) {
      list += (r == 0 ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " +
              describe_fields(std::string(values[static_cast<std::size_t>(r)].begin(),
                                          values[static_cast<std::size_t>(r)].end()));
    }
    throw Error(head + ": the members disagree on the " + differ + " (nothing was sent): " + list);
  }

  static std::vector<std::string> split_fields(const std::string& v) {
    std::vector<std::string> f;
    std::size_t at = 0;
    for (;;) {
      const auto bar = v.find('|', at);
      f.push_back(v.substr(at, bar == std::string::npos ? std::string::npos : bar - at));
      if (bar == std::string::npos) {
        break;
      }
      at = bar + 1;
    }
    f.resize(8, "-");
    return f;
  }

  /// "[1, 2, 3]" -> {1, 2, 3}; "-" -> {}.
  static std::vector<std::int64_t> parse_counts(const std::string& list) {
    std::vector<std::int64_t> out;
    std::int64_t v = 0;
    bool in_number = false;
    for (char c : list) {
      if (c >= '0' && c <= '9') {
        v = v * 10 + (c - '0');
        in_number = true;
      } else if (in_number) {
        out.push_back(v);
        v = 0;
        in_number = false;
      }
    }
    if (in_number) {
      out.push_back(v);
    }
    return out;
  }

  /// "all_reduce (16 x float32, op sum)" from desync_check's fields.
  static std::string describe_fields(const std::string& value) {
    const auto f = split_fields(value);
    std::string s = f[0] + " (" + (f[2] != "-1" ? f[2] + " x " : "") + f[1];
    if (f[4] != "-") {
      s += ", op " + f[4];
    }
    if (f[3] != "-1") {
      s += ", root " + f[3];
    }
    if (f[5] != "-") {
      s += ", counts " + f[5];
    }
    if (f[6] != "-") {
      s += ", sends " + f[6];
    }
    if (f[7] != "-") {
      s += ", receives " + f[7];
    }
    return s + ")";
  }

  /// An aborted communicator (or one the backend refuses, check_usable) takes no more ops.
  void check_not_aborted(const char* op) const {
    if (auto reason = aborted()) {
      throw Error(where(op) + ": the group was aborted: " + *reason);
    }
    check_usable(op);
  }

  void check_buffer(const char* op, const BufferRef& b, const char* what) const {
    check_memory(op, b, what);
    DTENSOR_CHECK(b.count >= 0,
                  where(op) + ": the " + what + " has a negative element count " + std::to_string(b.count));
    DTENSOR_CHECK(b.count == 0 || b.data != nullptr, where(op) + ": the " + what + " has no data (" +
                                                         std::to_string(b.count) + " elements at nullptr)");
  }

  void check_same_dtype(const char* op, const BufferRef& in, const BufferRef& out) const {
    DTENSOR_CHECK(in.dtype == out.dtype, where(op) + ": input is " + std::string(dtype_name(in.dtype)) +
                                             " but output is " + std::string(dtype_name(out.dtype)));
  }

  /// `what`: "dst" (reduce, gather) or "src" (broadcast, scatter), torch's names for the root.
  void check_root(const char* op, int root, const char* what) const {
    DTENSOR_CHECK(root >= 0 && root < size(), where(op) + ": " + what + " " + std::to_string(root) +
                                                  " is out of range for a group of " +
                                                  std::to_string(size()));
  }

  /// One count and displacement per member, each block inside `buf`.
  void check_layout(const char* op, const char* what, std::span<const std::int64_t> counts,
                    std::span<const std::int64_t> displs, const BufferRef& buf) const {
    DTENSOR_CHECK(counts.size() == static_cast<std::size_t>(size()) && displs.size() == counts.size(),
                  where(op) + ": " + what + " has " + std::to_string(counts.size()) +
                      " entries (displacements " + std::to_string(displs.size()) + ") for a group of " +
                      std::to_string(size()));
    for (std::size_t i = 0; i < counts.size(); ++i) {
      DTENSOR_CHECK(counts[i] >= 0 && displs[i] >= 0, where(op) + ": negative size in " + what + " " +
                                                          detail::format_list(counts) + " / displacements " +
                                                          detail::format_list(displs));
      DTENSOR_CHECK(displs[i] <= buf.count && counts[i] <= buf.count - displs[i],
                    where(op) + ": " + what + " " + detail::format_list(counts) + " at displacements " +
                        detail::format_list(displs) + " do not fit a buffer of " + std::to_string(buf.count) +
                        " elements");
    }
  }

  /// all_gather's input / reduce_scatter's output holds this rank's block: counts[rank()] elements.
  void check_own_count(const char* op, const char* what, const BufferRef& mine,
                       std::span<const std::int64_t> counts) const {
    const auto me = static_cast<std::size_t>(rank());
    DTENSOR_CHECK(mine.count == counts[me],
                  where(op) + ": the " + what + " has " + std::to_string(mine.count) +
                      " elements but counts[" + std::to_string(rank()) + "] is " +
                      std::to_string(counts[me]) + "; counts " + detail::format_list(counts));
  }

  /// gather's/scatter's blocks on the root: one per member; this rank's block matches `mine` (gather's
  /// input, scatter's output).
  void check_blocks(const char* op, std::span<const BufferRef> blocks, const BufferRef& mine) const {
    const bool is_gather = std::string_view(op) == "gather";
    DTENSOR_CHECK(blocks.size() == static_cast<std::size_t>(size()),
                  where(op) + ": the root needs one block per member (" + std::to_string(size()) + "), got " +
                      std::to_string(blocks.size()));
    for (const BufferRef& b : blocks) {
      check_buffer(op, b, "block");
      if (is_gather) {
        check_same_dtype(op, mine, b);
      } else {
        check_same_dtype(op, b, mine);
      }
    }
    const BufferRef& own = blocks[static_cast<std::size_t>(rank())];
    DTENSOR_CHECK(own.count == mine.count, where(op) + ": the root's own block has " +
                                               std::to_string(own.count) + " elements but its " +
                                               (is_gather ? "input" : "output") + " has " +
                                               std::to_string(mine.count));
  }

  std::atomic<std::int64_t> timeout_ms_;
  std::atomic<int> splits_{0};              // split() calls, which every member makes in the same order
  std::atomic<std::int64_t> desync_seq_{0}; // collectives checked by desync_check
  std::atomic<std::int64_t> monitored_{0};  // monitored_barrier calls
  std::shared_ptr<FlightRecorder> flight_ = std::make_shared<FlightRecorder>();
  mutable std::mutex abort_m_;
  std::optional<std::string> aborted_;
};

} // namespace dtensor

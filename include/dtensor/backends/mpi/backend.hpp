#pragma once
// The MPI backend: dtensor::Backend over MPI communicators, registered as "mpi".
//
//   // mpirun -np 4 ./prog   (DTENSOR_BACKEND=mpi, or auto: under an MPI launcher on a CPU machine)
//   auto world = dtensor::init_process_group();
//   // or directly, without init_process_group: MPI_COMM_WORLD (rank and size -1: MPI's), no store
//   dtensor::ProcessGroup world(dtensor::make_mpi_backend(nullptr, -1, -1, {.timeout = 10s}));
//
// Design (see also backends/backend.hpp, whose front checks every argument before a hook here runs):
//  - Every op is one or more non-blocking MPI calls posted on the calling thread, in submission order
//    (MPI matches collectives by their order on a communicator), returning an MpiWork (work.hpp) that
//    tests its requests until they completed or the op's deadline passed: a synchronous op is an
//    asynchronous one waited for at once, on its caller's thread. Asynchronous ops (async_op) are also
//    tested by a progress thread (MpiProgress, work.hpp) so that they move while the caller computes.
//  - all_reduce, reduce, broadcast, barrier: MPI_Iallreduce, _Ireduce, _Ibcast, _Ibarrier (in place).
//    all_gather: MPI_Iallgather for equal packed blocks, else MPI_Iallgatherv. reduce_scatter:
//    MPI_Ireduce_scatter_block / _Ireduce_scatter (blocks not packed in rank order are packed into scratch
//    memory first). all_to_all: MPI_Ialltoall / _Ialltoallv. gather and scatter: one MPI_Isend / _Irecv
//    per member on the group's second communicator (their blocks may be separate tensors, which
//    MPI_Igatherv cannot address). Point to point: MPI_Isend / _Irecv on the group's communicator with the
//    user's tag and the dtype in the MPI tag, so a float32 send never matches an int32 receive.
//  - avg is sum, then a division by the group size once the op completed (as gloo). The reduced floats
//    (bfloat16, float16, float8) reduce with user ops in float (types.hpp).
//  - Counts are MPI's int: all_reduce, reduce, broadcast and point-to-point messages above INT_MAX
//    elements are split into several MPI calls; the variable-size collectives take blocks and
//    displacements up to INT_MAX elements (above: an Error naming the op and the size).
//  - Groups: each has two communicators, one for the collectives and the user's point-to-point messages,
//    one for gather / scatter and group making. split() exchanges colours and keys by an MPI_Iallgather
//    (with a timeout) and then calls MPI_Comm_split; new_group's members (only they call) first meet
//    through messages to the first member (a member that does not come within the timeout is named, a
//    member making another group is an Error), then call MPI_Comm_create_group.
//  - Timeouts: every op has a deadline (the group's timeout or the op's); at it, wait() throws
//    TimeoutError naming the op, its sizes, this rank's last ops (the flight recorder) and, when the
//    group has a store, what every member was running (backends/stuck_op_board.hpp); the group is then
//    aborted (later ops fail at once). MPI cannot cancel a collective: after a timeout, end the job
//    (work.hpp). A member that dies ends the job: mpirun kills the others (MPI's own rule).
//  - Memory: host tensors; CUDA tensors too when the library is CUDA-aware (MpiRuntime::cuda_aware(): the
//    tensor's stream is synchronised before MPI reads or writes it); reductions of CUDA tensors are an
//    Error (OpenMPI's non-blocking reductions read device memory on the host): use NCCL for them.
//  - The store is optional (make_mpi_backend's first argument; init_process_group passes the job's): with
//    one, monitored_barrier, DTENSOR_DEBUG=detail's desync checks and the timeout reports work as on gloo.

#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/factory_checks.hpp"
#include "dtensor/backends/generic/reduce.hpp"
#include "dtensor/backends/group_generations.hpp"
#include "dtensor/backends/mpi/types.hpp"
#include "dtensor/backends/mpi/work.hpp"
#include "dtensor/backends/registry.hpp"
#include "dtensor/backends/split.hpp"
#include "dtensor/backends/stuck_op_board.hpp"
#include "dtensor/core/config.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/env.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/detail/mpi.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <mpi.h>
#if DTENSOR_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtensor {

/// Options of make_mpi_backend.
struct MpiOptions {
  /// Default timeout of every op (and of making the world group): core/timeout.hpp's policy.
  std::chrono::milliseconds timeout = kDefaultOpTimeout;
  /// Key prefix in the store.
  std::string prefix = "dtensor";
};

namespace detail {

/// Tags on a group's second communicator.
inline constexpr int kMpiGatherTag = 1;      // gather / scatter blocks
inline constexpr int kMpiMeetTag = 2;        // new_group's meeting of the members
inline constexpr int kMpiCreateGroupTag = 3; // MPI_Comm_create_group

/// Elements per MPI call of the ops that split large buffers: INT_MAX, or DTENSOR_MPI_MAX_COUNT when set
/// (tests use a small value to run the splitting on small buffers).
inline std::int64_t mpi_max_count() {
  static const std::int64_t n = [] {
    const char* v = std::getenv("DTENSOR_MPI_MAX_COUNT");
    return v != nullptr && *v != '\0'
               ? static_cast<std::int64_t>(parse_decimal_int("DTENSOR_MPI_MAX_COUNT", v, 1, INT_MAX))
               : static_cast<std::int64_t>(INT_MAX);
  }();
  return n;
}

/// What the groups of one rank share.
struct MpiRankState {
  std::shared_ptr<Store> store; ///< the job's store; may be null
  std::string prefix;
  std::shared_ptr<Store> rank_store; ///< `store` under `prefix` (Backend::rank_store); null without one
  int global_rank = 0;
  GroupGenerations generations;
};

/// Whether this process was started by an MPI launcher (OpenMPI's mpirun, MPICH's / Intel's, srun with
/// PMI or PMIx), or has MPI initialised already.
inline bool mpi_launched() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(v) != nullptr) {
      return true;
    }
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0 && !MpiRuntime::finalized();
}

class MpiBackendImpl final : public Backend,
                             public MpiOpOwner,
                             public std::enable_shared_from_this<MpiBackendImpl> {
public:
  /// Takes ownership of `comm` and `internal` (two communicators over the same members).
  MpiBackendImpl(std::shared_ptr<MpiRankState> state, MPI_Comm comm, MPI_Comm internal,
                 std::vector<int> global_ranks, int rank, std::string prefix,
                 std::chrono::milliseconds timeout)
      : Backend(timeout), state_(std::move(state)), comm_(comm), internal_(internal),
        global_ranks_(std::move(global_ranks)), rank_(rank), prefix_(std::move(prefix)) {
    if (state_->store != nullptr) {
      store_ = std::make_shared<PrefixStore>(prefix_, state_->store);
      board_ = std::make_unique<OpBoard>(store_, rank_, size());
    }
    const int ub = MpiRuntime::instance().tag_ub();
    tag_shift_ = static_cast<std::int64_t>(kMaxP2PTag) * 16 - 1 <= ub ? 4 : 0;
    tag_limit_ = tag_shift_ > 0 ? kMaxP2PTag : std::min(kMaxP2PTag, ub + 1);
  }

  ~MpiBackendImpl() override {
    if (!MpiRuntime::finalized()) {
      auto lock = MpiRuntime::instance().lock();
      MPI_Comm_free(&comm_);
      MPI_Comm_free(&internal_);
    }
  }

  // ---- identity ---------------------------------------------------------------------------------------
  std::string_view name() const noexcept override { return "mpi"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return static_cast<int>(global_ranks_.size()); }
  std::span<const int> global_ranks() const noexcept override { return global_ranks_; }
  std::string describe() const override {
    return "rank " + std::to_string(rank_) + " (global " + std::to_string(state_->global_rank) +
           ") of mpi group " + format_list(global_ranks_);
  }

  // ---- MpiOpOwner: what an op's completion reports ----------------------------------------------------

  std::exception_ptr timed_out(const MpiOpInfo& info) override {
    const std::string mine = op_text(info);
    const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(MpiClock::now() - info.start);
    std::string ops;
    if (board_ != nullptr) {
      board_->publish_op(mine);
      std::vector<int> members;
      const std::string_view n(info.name);
      if ((n == "send" || n == "recv") && info.root >= 0) {
        members = {std::min(rank_, info.root), std::max(rank_, info.root)};
      }
      ops =
          board_->members_ops(mine, std::move(members), std::min(timeout(), std::chrono::milliseconds(1000)));
    } else {
      ops = "; what the other members ran is unknown (this group has no store)";
    }
    const std::string msg =
        where(mine) + " timed out after " + std::to_string(limit.count()) +
        " ms: a member did not arrive, or the members disagree on the sizes (counts), dtypes "
        "or arguments" +
        ops + " [flight recorder, this rank's last ops on the group: " + flight_recorder().dump() + "]";
    abort(msg);
    return std::make_exception_ptr(TimeoutError(msg));
  }

  std::exception_ptr failed(const MpiOpInfo& info, const std::string& what) override {
    const std::string msg =
        where(op_text(info)) + " failed: " + what +
        " [flight recorder, this rank's last ops on the group: " + flight_recorder().dump() + "]";
    abort(msg);
    return std::make_exception_ptr(Error(msg));
  }

  std::optional<std::string> released() const override { return aborted(); }

  void finished(const MpiOpInfo& info, bool ok) override { flight_recorder().finished(info.flight, ok); }

protected:
  // ---- collectives ------------------------------------------------------------------------------------

  WorkPtr do_all_reduce(BufferRef buf, ReduceOp op, const CommOptions& opts) override {
    check_host_reduction("all_reduce", buf);
    return submit({"all_reduce", 0, buf.count, buf.dtype, -1, static_cast<int>(op)}, opts, [&](MpiWork& w) {
      const MPI_Datatype t = mpi_type(buf.dtype);
      const MPI_Op o = mpi_op(buf.dtype, op);
      for_chunks(buf, [&](void* p, int n) {
        check(MPI_Iallreduce(MPI_IN_PLACE, p, n, t, o, comm_, &w.request()), "MPI_Iallreduce");
      });
      if (op == ReduceOp::avg) {
        w.then([buf, n = size()] { divide_in_place(buf.data, buf.count, buf.dtype, n); });
      }
    });
  }

  WorkPtr do_reduce(BufferRef buf, int root, ReduceOp op, const CommOptions& opts) override {
    check_host_reduction("reduce", buf);
    return submit({"reduce", 0, buf.count, buf.dtype, root, static_cast<int>(op)}, opts, [&](MpiWork& w) {
      const MPI_Datatype t = mpi_type(buf.dtype);
      const MPI_Op o = mpi_op(buf.dtype, op);
      const bool me = rank_ == root;
      for_chunks(buf, [&](void* p, int n) {
        check(MPI_Ireduce(me ? MPI_IN_PLACE : p, me ? p : nullptr, n, t, o, root, comm_, &w.request()),
              "MPI_Ireduce");
      });
      if (op == ReduceOp::avg && me) {
        w.then([buf, n = size()] { divide_in_place(buf.data, buf.count, buf.dtype, n); });
      }
    });
  }

  WorkPtr do_broadcast(BufferRef buf, int root, const CommOptions& opts) override {
    return submit({"broadcast", 0, buf.count, buf.dtype, root}, opts, [&](MpiWork& w) {
      sync_stream(buf);
      const MPI_Datatype t = mpi_type(buf.dtype);
      for_chunks(
          buf, [&](void* p, int n) { check(MPI_Ibcast(p, n, t, root, comm_, &w.request()), "MPI_Ibcast"); });
    });
  }

  WorkPtr do_all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                        std::span<const std::int64_t> displs, const CommOptions& opts) override {
    return submit({"all_gather", 0, in.count, in.dtype}, opts, [&](MpiWork& w) {
      sync_stream(in);
      sync_stream(out);
      const MPI_Datatype t = mpi_type(in.dtype);
      const void* send = send_buffer(w, in, out, displs[static_cast<std::size_t>(rank_)]);
      if (uniform(counts) && packed_in_order(counts, displs)) {
        const int n = int_count("all_gather", counts[0]);
        check(MPI_Iallgather(send, n, t, out.data, n, t, comm_, &w.request()), "MPI_Iallgather");
        return;
      }
      auto& c = w.keep(int_counts("all_gather", counts));
      auto& d = w.keep(int_counts("all_gather", displs));
      check(MPI_Iallgatherv(send, int_count("all_gather", in.count), t, out.data, c.data(), d.data(), t,
                            comm_, &w.request()),
            "MPI_Iallgatherv");
    });
  }

  WorkPtr do_reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                            std::span<const std::int64_t> displs, ReduceOp op,
                            const CommOptions& opts) override {
    check_host_reduction("reduce_scatter", in);
    return submit({"reduce_scatter", 0, in.count, in.dtype, -1, static_cast<int>(op)}, opts, [&](MpiWork& w) {
      const MPI_Datatype t = mpi_type(in.dtype);
      const MPI_Op o = mpi_op(in.dtype, op);
      const void* send = in.data;
      if (!packed_in_order(counts, displs) || overlap(in, out)) { // MPI reads the blocks packed in rank order
        std::int64_t total = 0;
        for (std::int64_t c : counts) {
          total += c;
        }
        auto& staged = w.keep(std::vector<char>(static_cast<std::size_t>(total) * dtype_size(in.dtype)));
        std::size_t at = 0;
        for (std::size_t i = 0; i < counts.size(); ++i) {
          const std::size_t bytes = static_cast<std::size_t>(counts[i]) * dtype_size(in.dtype);
          if (bytes > 0) {
            std::memcpy(staged.data() + at,
                        static_cast<const char*>(in.data) +
                            static_cast<std::size_t>(displs[i]) * dtype_size(in.dtype),
                        bytes);
          }
          at += bytes;
        }
        send = staged.data();
      }
      if (uniform(counts)) {
        check(MPI_Ireduce_scatter_block(send, out.data, int_count("reduce_scatter", counts[0]), t, o, comm_,
                                        &w.request()),
              "MPI_Ireduce_scatter_block");
      } else {
        auto& c = w.keep(int_counts("reduce_scatter", counts));
        check(MPI_Ireduce_scatter(send, out.data, c.data(), t, o, comm_, &w.request()),
              "MPI_Ireduce_scatter");
      }
      if (op == ReduceOp::avg) {
        w.then([out, n = size()] { divide_in_place(out.data, out.count, out.dtype, n); });
      }
    });
  }

  WorkPtr do_all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                        std::span<const std::int64_t> send_displs, BufferRef out,
                        std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                        const CommOptions& opts) override {
    return submit({"all_to_all", 0, in.count, in.dtype}, opts, [&](MpiWork& w) {
      sync_stream(in);
      sync_stream(out);
      const MPI_Datatype t = mpi_type(in.dtype);
      if (uniform(send_counts) && packed_in_order(send_counts, send_displs) && uniform(recv_counts) &&
          packed_in_order(recv_counts, recv_displs) && send_counts[0] == recv_counts[0]) {
        const int n = int_count("all_to_all", send_counts[0]);
        check(MPI_Ialltoall(in.data, n, t, out.data, n, t, comm_, &w.request()), "MPI_Ialltoall");
        return;
      }
      auto& sc = w.keep(int_counts("all_to_all", send_counts));
      auto& sd = w.keep(int_counts("all_to_all", send_displs));
      auto& rc = w.keep(int_counts("all_to_all", recv_counts));
      auto& rd = w.keep(int_counts("all_to_all", recv_displs));
      check(MPI_Ialltoallv(in.data, sc.data(), sd.data(), t, out.data, rc.data(), rd.data(), t, comm_,
                           &w.request()),
            "MPI_Ialltoallv");
    });
  }

  WorkPtr do_gather(BufferRef in, std::span<const BufferRef> blocks, int root,
                    const CommOptions& opts) override {
    return submit({"gather", 0, in.count, in.dtype, root}, opts, [&](MpiWork& w) {
      w.point_to_point();
      sync_stream(in);
      if (rank_ != root) {
        post_send(w, internal_, in, root, kMpiGatherTag);
        return;
      }
      for (int i = 0; i < size(); ++i) {
        const BufferRef& b = blocks[static_cast<std::size_t>(i)];
        sync_stream(b);
        if (i == rank_) {
          copy_block(b, in);
        } else {
          post_recv(w, internal_, b, i, kMpiGatherTag);
        }
      }
    });
  }

  WorkPtr do_scatter(std::span<const BufferRef> blocks, BufferRef out, int root,
                     const CommOptions& opts) override {
    return submit({"scatter", 0, out.count, out.dtype, root}, opts, [&](MpiWork& w) {
      w.point_to_point();
      sync_stream(out);
      if (rank_ != root) {
        post_recv(w, internal_, out, root, kMpiGatherTag);
        return;
      }
      for (int i = 0; i < size(); ++i) {
        const BufferRef& b = blocks[static_cast<std::size_t>(i)];
        sync_stream(b);
        if (i == rank_) {
          copy_block(out, b);
        } else {
          post_send(w, internal_, b, i, kMpiGatherTag);
        }
      }
    });
  }

  WorkPtr do_barrier(const CommOptions& opts) override {
    return submit({"barrier", 0, 0, DType::uint8}, opts,
                  [&](MpiWork& w) { check(MPI_Ibarrier(comm_, &w.request()), "MPI_Ibarrier"); });
  }

  // ---- point to point ---------------------------------------------------------------------------------

  WorkPtr do_p2p(std::span<const P2PRequest> requests, const CommOptions& opts) override {
    for (const P2PRequest& r : requests) {
      DTENSOR_CHECK(r.tag < tag_limit_, where(r.kind == P2PRequest::Kind::send ? "send" : "recv") + ": tag " +
                                            std::to_string(r.tag) +
                                            " is above this MPI library's MPI_TAG_UB (" +
                                            std::to_string(tag_limit_ - 1) + ")");
    }
    const bool one = requests.size() == 1;
    MpiOpInfo info{one ? (requests[0].kind == P2PRequest::Kind::send ? "send" : "recv") : "batch_isend_irecv",
                   0, requests.empty() ? 0 : requests[0].buffer.count,
                   requests.empty() ? DType::uint8 : requests[0].buffer.dtype, one ? requests[0].peer : -1};
    return submit(info, opts, [&](MpiWork& w) {
      w.point_to_point();
      for (const P2PRequest& r : requests) {
        sync_stream(r.buffer);
        const int tag = static_cast<int>((static_cast<std::int64_t>(r.tag) << tag_shift_) |
                                         (tag_shift_ > 0 ? static_cast<std::int64_t>(r.buffer.dtype) : 0));
        if (r.kind == P2PRequest::Kind::send) {
          post_send(w, comm_, r.buffer, r.peer, tag);
        } else {
          post_recv(w, comm_, r.buffer, r.peer, tag);
        }
      }
    });
  }

  // ---- groups -----------------------------------------------------------------------------------------

  std::vector<SplitEntry> exchange_split(const SplitGroup& g, const std::string& what) override {
    // One buffer for what this member sends and what it receives; left to MPI after a timeout (a late
    // member completes the allgather into it).
    auto buf = std::make_unique<int[]>(2 * static_cast<std::size_t>(size()) + 2);
    buf[0] = g.color;
    buf[1] = g.key;
    MPI_Request r = MPI_REQUEST_NULL;
    {
      auto lock = MpiRuntime::instance().lock();
      check(MPI_Iallgather(buf.get(), 2, MPI_INT, buf.get() + 2, 2, MPI_INT, internal_, &r),
            "MPI_Iallgather");
    }
    if (!mpi_wait_all({&r, 1}, MpiClock::now() + timeout(), [&] { return what; })) {
      (void)buf.release();
      const std::string msg = what + ": not every member called split within " +
                              std::to_string(timeout().count()) + " ms (the group is aborted)";
      abort(msg);
      throw TimeoutError(msg);
    }
    std::vector<SplitEntry> out(static_cast<std::size_t>(size()));
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = {buf[2 + 2 * i], buf[3 + 2 * i]};
    }
    return out;
  }

  std::shared_ptr<Backend> do_split(const SplitGroup& g) override {
    MPI_Comm nc = MPI_COMM_NULL;
    {
      auto lock = MpiRuntime::instance().lock();
      check(MPI_Comm_split(internal_, g.color < 0 ? MPI_UNDEFINED : g.color, g.key, &nc), "MPI_Comm_split");
    }
    if (g.rank < 0) {
      return nullptr;
    }
    return make_group(nc, g.global_ranks, g.rank,
                      prefix_ + "/s" + std::to_string(g.index) + "c" + std::to_string(g.color), "split");
  }

  std::shared_ptr<Backend> do_new_group(std::vector<int> global, int rank) override {
    const std::string name = state_->generations.next_name(global);
    meet_members(global, rank, name);
    std::vector<int> parent(global.size());
    for (std::size_t i = 0; i < global.size(); ++i) {
      parent[i] = static_cast<int>(std::find(global_ranks_.begin(), global_ranks_.end(), global[i]) -
                                   global_ranks_.begin());
    }
    MPI_Comm nc = MPI_COMM_NULL;
    {
      auto lock = MpiRuntime::instance().lock();
      MPI_Group all = MPI_GROUP_NULL;
      MPI_Group members = MPI_GROUP_NULL;
      check(MPI_Comm_group(internal_, &all), "MPI_Comm_group");
      check(MPI_Group_incl(all, static_cast<int>(parent.size()), parent.data(), &members), "MPI_Group_incl");
      const int rc = MPI_Comm_create_group(internal_, members, kMpiCreateGroupTag, &nc);
      MPI_Group_free(&members);
      MPI_Group_free(&all);
      check(rc, "MPI_Comm_create_group");
    }
    return make_group(nc, std::move(global), rank, state_->prefix + "/" + name, "new_group");
  }

  Store* split_store() override { return store_.get(); }
  Store* rank_store() override { return state_->rank_store.get(); }

  void check_memory(const char* op, const BufferRef& b, const char* what) const override {
    if (b.device.is_cpu()) {
      return;
    }
    DTENSOR_CHECK(b.device.is_cuda() && MpiRuntime::cuda_aware(),
                  where(op) + ": the " + what + " is on " + b.device.to_string() +
                      ", but this MPI library is not CUDA-aware (MPIX_Query_cuda_support() is 0): use host "
                      "tensors, or the NCCL backend for CUDA tensors");
  }

private:
  /// Posts `post(work)` under MPI's lock, in submission order, and returns the work.
  template <class Post>
  WorkPtr submit(MpiOpInfo info, const CommOptions& opts, Post&& post) {
    const auto limit = opts.timeout.count() > 0 ? opts.timeout : timeout();
    std::lock_guard order(m_);
    const std::string_view n(info.name);
    info.seq = n == "send" || n == "recv" || n == "batch_isend_irecv" ? p2p_seq_++ : seq_++;
    info.start = MpiClock::now();
    info.flight = flight_recorder().submitted(info.name, info.count, info.dtype, info.root, info.reduce,
                                              /*running=*/true, info.start);
    auto work = std::make_shared<MpiWork>(shared_from_this(), info, info.start + limit);
    try {
      auto lock = MpiRuntime::instance().lock();
      post(*work);
    } catch (...) {
      flight_recorder().finished(info.flight, false);
      throw;
    }
    if (!opts.blocking) {
      MpiProgress::instance().watch(work);
    }
    return work;
  }

  static std::string op_text(const MpiOpInfo& info) {
    return describe_op(info.name, info.seq, info.count, info.dtype, info.root, info.reduce);
  }

  /// Throws Error(where(call) + MPI's text) unless rc is MPI_SUCCESS.
  void check(int rc, const char* call) const {
    check_mpi(rc, call, [&] { return describe(); });
  }

  /// `fn(pointer, count)` for each piece of at most mpi_max_count() elements of `buf` (none when empty).
  template <class Fn>
  static void for_chunks(const BufferRef& buf, Fn&& fn) {
    const std::int64_t max = mpi_max_count();
    for (std::int64_t at = 0; at < buf.count; at += max) {
      fn(static_cast<char*>(buf.data) + static_cast<std::size_t>(at) * dtype_size(buf.dtype),
         static_cast<int>(std::min(max, buf.count - at)));
    }
  }

  /// Sends `buf` to `peer` as messages of at most mpi_max_count() elements (one empty message when `buf`
  /// is: the receiver then gets what it expects, or an Error).
  void post_send(MpiWork& w, MPI_Comm comm, const BufferRef& buf, int peer, int tag) const {
    const MPI_Datatype t = mpi_type(buf.dtype);
    const std::int64_t max = mpi_max_count();
    std::int64_t at = 0;
    do {
      const int n = static_cast<int>(std::min(max, buf.count - at));
      check(MPI_Isend(static_cast<char*>(buf.data) + static_cast<std::size_t>(at) * dtype_size(buf.dtype), n,
                      t, peer, tag, comm, &w.request()),
            "MPI_Isend");
      at += n;
    } while (at < buf.count);
  }

  /// Receives into `buf` what post_send sends; each message must fill its part exactly.
  void post_recv(MpiWork& w, MPI_Comm comm, const BufferRef& buf, int peer, int tag) const {
    const MPI_Datatype t = mpi_type(buf.dtype);
    const std::int64_t max = mpi_max_count();
    std::int64_t at = 0;
    do {
      const int n = static_cast<int>(std::min(max, buf.count - at));
      check(MPI_Irecv(static_cast<char*>(buf.data) + static_cast<std::size_t>(at) * dtype_size(buf.dtype), n,
                      t, peer, tag, comm, &w.request()),
            "MPI_Irecv");
      w.expect_last(n, t, peer);
      at += n;
    } while (at < buf.count);
  }

  /// MPI's count for `n` elements; Error when it does not fit MPI's int.
  int int_count(const char* op, std::int64_t n) const {
    DTENSOR_CHECK(n <= INT_MAX, where(op) + ": " + std::to_string(n) +
                                    " elements do not fit MPI's int counts (at most 2147483647 per block "
                                    "and displacement): split the tensor");
    return static_cast<int>(n);
  }

  std::vector<int> int_counts(const char* op, std::span<const std::int64_t> v) const {
    std::vector<int> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      out[i] = int_count(op, v[i]);
    }
    return out;
  }

  static bool uniform(std::span<const std::int64_t> counts) {
    return std::all_of(counts.begin(), counts.end(), [&](std::int64_t c) { return c == counts[0]; });
  }

  static bool overlap(const BufferRef& a, const BufferRef& b) {
    const auto pa = reinterpret_cast<std::uintptr_t>(a.data);
    const auto pb = reinterpret_cast<std::uintptr_t>(b.data);
    return a.nbytes() > 0 && b.nbytes() > 0 && pa < pb + b.nbytes() && pb < pa + a.nbytes();
  }

  /// What all_gather sends: MPI_IN_PLACE when `in` is this member's block of `out` already, a copy when it
  /// overlaps `out` elsewhere (MPI forbids aliased buffers), else `in`.
  static const void* send_buffer(MpiWork& w, const BufferRef& in, const BufferRef& out,
                                 std::int64_t my_displ) {
    if (in.data ==
        static_cast<char*>(out.data) + static_cast<std::size_t>(my_displ) * dtype_size(out.dtype)) {
      return MPI_IN_PLACE;
    }
    if (!overlap(in, out)) {
      return in.data;
    }
    auto& copy = w.keep(std::vector<char>(static_cast<const char*>(in.data),
                                          static_cast<const char*>(in.data) + in.nbytes()));
    return copy.data();
  }

  /// dst = src for a member's own block of gather / scatter (host memory, or device memory by cudaMemcpy).
  static void copy_block(const BufferRef& dst, const BufferRef& src) {
    if (dst.data == src.data || src.nbytes() == 0) {
      return;
    }
#if DTENSOR_HAS_CUDA
    if (!dst.device.is_cpu() || !src.device.is_cpu()) {
      detail::count_host_sync("MPI backend: cudaMemcpy of a gather / scatter block");
      const cudaError_t e = cudaMemcpy(dst.data, src.data, src.nbytes(), cudaMemcpyDefault);
      DTENSOR_CHECK(e == cudaSuccess,
                    std::string("MPI backend: cudaMemcpy of a gather / scatter block failed: ") +
                        cudaGetErrorString(e));
      return;
    }
#endif
    std::memmove(dst.data, src.data, src.nbytes());
  }

  /// Makes the work on a CUDA buffer's stream finish before MPI reads or writes the buffer.
  static void sync_stream([[maybe_unused]] const BufferRef& b) {
#if DTENSOR_HAS_CUDA
    if (b.device.is_cuda()) {
      detail::host_sync(static_cast<cudaStream_t>(b.stream), "MPI backend: before an op on a CUDA buffer");
    }
#endif
  }

  /// Reductions run on the host (MPI's ops, and the user ops of the reduced floats).
  void check_host_reduction(const char* op, const BufferRef& b) const {
    DTENSOR_CHECK(b.device.is_cpu(), where(op) +
                                         ": the MPI backend reduces host tensors only; this one is on " +
                                         b.device.to_string() + " (use the NCCL backend for CUDA tensors)");
  }

  /// The members of a new group (global ranks, in group order; this one is `me`) meet before
  /// MPI_Comm_create_group, which waits for them with no limit: each sends the first member a fingerprint
  /// of `name` (the list and how many groups over it this rank made) and waits for its answer; the first
  /// member answers once every other member came, with its own fingerprint, or 0 when one came with
  /// another. TimeoutError names who did not come; Error says who is making another group.
  void meet_members(const std::vector<int>& global, int me, const std::string& name) {
    const auto parent_of = [&](int g) {
      return static_cast<int>(std::find(global_ranks_.begin(), global_ranks_.end(), g) -
                              global_ranks_.begin());
    };
    std::uint64_t fp = 0xcbf29ce484222325ULL;
    for (char c : name) {
      fp = (fp ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
    }
    fp |= 1; // never 0, the refusal
    const std::string what = where("new_group(" + format_list(global) + ")");
    const auto deadline = MpiClock::now() + timeout();
    const int k = static_cast<int>(global.size());
    if (k == 1) {
      return;
    }
    if (me != 0) {
      std::uint64_t answer = 0;
      MPI_Request r[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
      {
        auto lock = MpiRuntime::instance().lock();
        check(MPI_Isend(&fp, 1, MPI_UINT64_T, parent_of(global[0]), kMpiMeetTag, internal_, &r[0]),
              "MPI_Isend");
        check(MPI_Irecv(&answer, 1, MPI_UINT64_T, parent_of(global[0]), kMpiMeetTag, internal_, &r[1]),
              "MPI_Irecv");
      }
      if (!mpi_wait_all(r, deadline, [&] { return what; })) {
        mpi_cancel_p2p(r);
        throw TimeoutError(what + ": the group's first member (global rank " + std::to_string(global[0]) +
                           ") did not confirm that every member came within " +
                           std::to_string(timeout().count()) + " ms");
      }
      DTENSOR_CHECK(answer == fp,
                    what + ": " +
                        (answer == 0 ? "a member came to make another group"
                                     : "the group's first member (global rank " + std::to_string(global[0]) +
                                           ") is making another group") +
                        " (do the members create their groups in different orders?)");
      return;
    }
    std::vector<std::uint64_t> got(static_cast<std::size_t>(k), 0);
    std::vector<MPI_Request> r(static_cast<std::size_t>(k - 1), MPI_REQUEST_NULL);
    {
      auto lock = MpiRuntime::instance().lock();
      for (int i = 1; i < k; ++i) {
        check(MPI_Irecv(&got[static_cast<std::size_t>(i)], 1, MPI_UINT64_T,
                        parent_of(global[static_cast<std::size_t>(i)]), kMpiMeetTag, internal_,
                        &r[static_cast<std::size_t>(i - 1)]),
              "MPI_Irecv");
      }
    }
    if (!mpi_wait_all(r, deadline, [&] { return what; })) {
      std::vector<int> missing;
      {
        auto lock = MpiRuntime::instance().lock();
        for (int i = 1; i < k; ++i) {
          int done = 0;
          MPI_Test(&r[static_cast<std::size_t>(i - 1)], &done, MPI_STATUS_IGNORE);
          if (!done) {
            missing.push_back(global[static_cast<std::size_t>(i)]);
          }
        }
      }
      mpi_cancel_p2p(r);
      throw TimeoutError(what + ": global rank" + (missing.size() == 1 ? " " : "s ") +
                         format_list(missing, ", ", "", "") + " did not come within " +
                         std::to_string(timeout().count()) + " ms");
    }
    std::vector<int> other;
    for (int i = 1; i < k; ++i) {
      if (got[static_cast<std::size_t>(i)] != fp) {
        other.push_back(global[static_cast<std::size_t>(i)]);
      }
    }
    const std::uint64_t answer = other.empty() ? fp : 0;
    {
      auto lock = MpiRuntime::instance().lock();
      for (int i = 1; i < k; ++i) {
        check(MPI_Isend(&answer, 1, MPI_UINT64_T, parent_of(global[static_cast<std::size_t>(i)]), kMpiMeetTag,
                        internal_, &r[static_cast<std::size_t>(i - 1)]),
              "MPI_Isend");
      }
    }
    if (!mpi_wait_all(r, deadline, [&] { return what; })) {
      mpi_cancel_p2p(r);
      throw TimeoutError(what + ": a member did not take the first member's answer within " +
                         std::to_string(timeout().count()) + " ms");
    }
    DTENSOR_CHECK(other.empty(), what + ": global rank" + (other.size() == 1 ? " " : "s ") +
                                     format_list(other, ", ", "", "") +
                                     " came to make another group (do the members create their groups in "
                                     "different orders?)");
  }

  /// A group over `nc` (this rank's new communicator; MPI_COMM_NULL is an Error), with its second
  /// communicator duplicated from it.
  std::shared_ptr<Backend> make_group(MPI_Comm nc, std::vector<int> global, int rank, std::string prefix,
                                      const char* how) {
    DTENSOR_CHECK(nc != MPI_COMM_NULL, where(how) + ": MPI gave this member no communicator");
    MPI_Comm ni = MPI_COMM_NULL;
    int r = -1;
    {
      auto lock = MpiRuntime::instance().lock();
      check(MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
      check(MPI_Comm_dup(nc, &ni), "MPI_Comm_dup");
      check(MPI_Comm_set_errhandler(ni, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
      MPI_Comm_rank(nc, &r);
    }
    DTENSOR_CHECK(r == rank, where(how) + ": MPI made this member rank " + std::to_string(r) + ", expected " +
                                 std::to_string(rank));
    return std::make_shared<MpiBackendImpl>(state_, nc, ni, std::move(global), rank, std::move(prefix),
                                            timeout());
  }

  std::shared_ptr<MpiRankState> state_;
  MPI_Comm comm_;     // collectives and the user's point-to-point messages
  MPI_Comm internal_; // gather / scatter blocks, split and new_group
  std::vector<int> global_ranks_;
  int rank_;
  std::string prefix_;
  std::shared_ptr<PrefixStore> store_;
  std::unique_ptr<OpBoard> board_;
  int tag_shift_ = 0;
  int tag_limit_ = kMaxP2PTag;

  std::mutex m_; // submission order
  std::uint32_t seq_ = 0;
  std::uint32_t p2p_seq_ = 0;
};

/// A communicator of `comm`'s members, made by all of them with MPI_Comm_idup (waited for until `deadline`:
/// a process that does not come gives TimeoutError), returning MPI errors instead of aborting.
inline MPI_Comm mpi_dup_with_timeout(MPI_Comm comm, MpiClock::time_point deadline, const std::string& what,
                                     std::chrono::milliseconds limit) {
  auto out =
      std::make_unique<MPI_Comm>(MPI_COMM_NULL); // MPI writes it at completion: left to MPI on a timeout
  MPI_Request r = MPI_REQUEST_NULL;
  {
    auto lock = MpiRuntime::instance().lock();
    check_mpi(MPI_Comm_idup(comm, out.get(), &r), "MPI_Comm_idup", what);
  }
  if (!mpi_wait_all({&r, 1}, deadline, what)) {
    (void)out.release();
    throw TimeoutError(what + ": not every process of MPI_COMM_WORLD came within " +
                       std::to_string(limit.count()) + " ms");
  }
  auto lock = MpiRuntime::instance().lock();
  check_mpi(MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", what);
  return *out;
}

/// The world group: MPI_COMM_WORLD's processes, in its rank order; `store` may be null.
inline std::shared_ptr<Backend> make_mpi_world(std::shared_ptr<Store> store, const MpiOptions& options) {
  check_timeout(options.timeout, "make_mpi_backend");
  MpiRuntime& mpi = MpiRuntime::instance();
  mpi.ensure_initialized();
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::string what = "rank " + std::to_string(rank) + " of the mpi world group";
  const auto deadline = MpiClock::now() + options.timeout;
  MPI_Comm comm = mpi_dup_with_timeout(MPI_COMM_WORLD, deadline, what, options.timeout);
  MPI_Comm internal = mpi_dup_with_timeout(MPI_COMM_WORLD, deadline, what, options.timeout);
  auto state = std::make_shared<MpiRankState>();
  state->store = std::move(store);
  state->prefix = options.prefix;
  state->global_rank = rank;
  state->rank_store = prefixed_store(options.prefix, state->store); // null without a store
  return std::make_shared<MpiBackendImpl>(std::move(state), comm, internal, world_ranks(size), rank,
                                          options.prefix + "/world", options.timeout);
}

/// MPI_COMM_WORLD's rank and size of this process (initialising MPI when nobody did).
inline std::pair<int, int> mpi_world_rank_size() {
  MpiRuntime::instance().ensure_initialized();
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return {rank, size};
}

} // namespace detail

/// An MPI communicator over every process of MPI_COMM_WORLD; this process is `rank` of `size`, which must
/// be MPI_COMM_WORLD's (-1 and -1: take them from MPI, as torch's init_process_group("mpi") does).
/// Initialises MPI when nobody did (it is then finalised at exit). `store` is optional (null: none): with
/// one, monitored_barrier, DTENSOR_DEBUG=detail's desync checks and the reports of what each member ran
/// when an op times out meet there, under options.prefix (without one, those say they cannot).
/// Collective over MPI_COMM_WORLD; TimeoutError when a process does not come within options.timeout.
/// Wrap it in a ProcessGroup: `ProcessGroup world(make_mpi_backend(store, rank, size));`.
inline std::shared_ptr<Backend> make_mpi_backend(std::shared_ptr<Store> store, int rank, int size,
                                                 MpiOptions options = {}) {
  const auto [mpi_rank, mpi_size] = detail::mpi_world_rank_size();
  DTENSOR_CHECK((rank < 0 && size < 0) || (rank == mpi_rank && size == mpi_size),
                "make_mpi_backend: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                    " is not this process's place in MPI_COMM_WORLD, rank " + std::to_string(mpi_rank) +
                    " of " + std::to_string(mpi_size) + " (pass -1, -1 to take MPI's)");
  return detail::make_mpi_world(std::move(store), options);
}

/// Deprecated: make_mpi_backend(store, rank, size, options), the shape of every backend factory; rank =
/// size = -1 take MPI_COMM_WORLD's.
[[deprecated("use make_mpi_backend(store, rank, size, options)")]] inline std::shared_ptr<Backend>
make_mpi_backend(MpiOptions options = {}) {
  return make_mpi_backend(nullptr, -1, -1, std::move(options));
}

namespace detail {

/// The "mpi" entry of the backend registry (what init_process_group makes): the launcher's rank and size
/// must be MPI_COMM_WORLD's (processes started by mpirun or srun, not by dtensor-run or torchrun).
inline std::shared_ptr<Backend> make_mpi_backend_for_job(std::shared_ptr<Store> store, int rank, int size,
                                                         const BackendOptions& options) {
  const auto [mpi_rank, mpi_size] = mpi_world_rank_size();
  DTENSOR_CHECK(mpi_rank == rank && mpi_size == size,
                "MPI backend: the launcher's variables make this process rank " + std::to_string(rank) +
                    " of " + std::to_string(size) + ", but MPI_COMM_WORLD has it as rank " +
                    std::to_string(mpi_rank) + " of " + std::to_string(mpi_size) +
                    ": start the processes with mpirun (or srun --mpi=pmix), not dtensor-run or torchrun");
  MpiOptions mo;
  mo.timeout = options.timeout;
  mo.prefix = options.prefix;
  return make_mpi_backend(std::move(store), rank, size, std::move(mo));
}

/// "auto" picks MPI under an MPI launcher (above gloo, below NCCL on a machine with a GPU).
inline const bool mpi_backend_registered = [] {
  register_backend("mpi", make_mpi_backend_for_job, BackendTraits{[] { return mpi_launched(); }, 5});
  return true;
}();

} // namespace detail

} // namespace dtensor

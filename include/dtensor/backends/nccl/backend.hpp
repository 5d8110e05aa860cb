#pragma once
// The NCCL backend: dtensor::Backend over an NCCL communicator, registered as "nccl" (the counterpart of
// backends/gloo/backend.hpp).
//
//   dtensor::TcpStoreOptions so;
//   so.is_server = rank == 0;
//   auto store = std::make_shared<dtensor::TcpStore>(addr, port, so);
//   dtensor::ProcessGroup world(dtensor::make_nccl_backend(store, rank, size, {.device = local_rank}));
//   // usually: auto world = dtensor::init_process_group();   (DTENSOR_BACKEND=nccl or a visible GPU)
//
// Design (see also backends/backend.hpp, whose front checks every argument before a hook here runs, and
// work.hpp):
//  - The world communicator comes from ncclCommInitRankConfig with the unique id rank 0 publishes in the
//    store (any dtensor::Store). new_group is made by its members only (torch's use_local_synchronization):
//    its first member publishes a unique id under a key made of the members' global ranks and how many
//    groups over that list this rank made before, and the members ncclCommInitRankConfig with it, so ranks
//    outside the group never take part. split() is ncclCommSplit (collective on the parent; DeviceMesh
//    splits with colour = the other coordinates, key = the coordinate on the axis); the front learns every
//    member's colour and key through the store, under the communicator's prefix and its split count
//    (backends/split.hpp), so it needs no device memory and no collective besides ncclCommSplit itself.
//  - Communicators are nonblocking by default (ncclConfig_t::blocking = 0): every NCCL call returns at once
//    (ncclInProgress) and the backend polls ncclCommGetAsyncError against the op's deadline, so a member
//    that never arrives -- in ncclCommInitRankConfig, ncclCommSplit, or the connection set-up NCCL 2.28 does
//    lazily in a first op -- gives a TimeoutError and the communicator is aborted, instead of a hang
//    (PyTorch's RFC pytorch#137007 for the same reason). NcclOptions::nonblocking = false (or
//    DTENSOR_NCCL_NONBLOCKING=0) makes them blocking, as PyTorch does since NCCL 2.26 hung in nonblocking
//    mode (pytorch#153960): a call returns once the op is enqueued, and one stuck inside NCCL cannot be
//    interrupted (ncclCommAbort must not run under a call, backends/nccl/comm_guard.hpp). Either way the
//    watchdog fails and aborts a communicator whose op runs past its timeout or that reports an
//    asynchronous error; pending and later ops, and every wait on its works, then throw
//    dtensor::TimeoutError / dtensor::Error instead of hanging or passing partly written data off as done.
//  - Each group has its own CUDA stream. An op waits for the caller's stream (CommOptions::stream; the
//    legacy default stream when none is given, which is where Tensor allocates and copies), runs on the
//    group's stream, and records an event; Work::wait() makes the caller's stream wait for that event and
//    does not block the host (barrier does, and every op does with DTENSOR_NCCL_BLOCKING_WAIT=1).
//  - Fixed-size ops map to one NCCL collective. Variable-size ops are grouped point-to-point calls inside
//    ncclGroupStart/End: uneven all_gather, all_to_all with splits, gather, scatter; uneven reduce_scatter is
//    a group of ncclReduce calls, one per root. This rank's own block is a cudaMemcpyAsync on the group's
//    stream (a plain device copy needs no kernel: Thrust is not used here, so this header compiles with
//    any C++20 compiler that sees the CUDA runtime headers).
//  - Buffers must be CUDA memory on this rank's device (check_memory); a host buffer is rejected with a
//    message that says so before anything is enqueued. Point-to-point ops between a pair of ranks match in
//    posting order; NCCL has no tags, so tags are checked for range (by the front) and otherwise ignored
//    (as in torch's NCCL backend).

#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/factory_checks.hpp"
#include "dtensor/backends/group_generations.hpp"
#include "dtensor/backends/nccl/comm_guard.hpp"
#include "dtensor/backends/nccl/rendezvous.hpp"
#include "dtensor/backends/nccl/types.hpp"
#include "dtensor/backends/nccl/watchdog.hpp"
#include "dtensor/backends/nccl/work.hpp"
#include "dtensor/backends/registry.hpp"
#include "dtensor/backends/split.hpp"
#include "dtensor/backends/stuck_op_board.hpp"
#include "dtensor/core/env.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtensor {

/// Options of make_nccl_backend.
struct NcclOptions {
  /// Default timeout of every op (and of the rendezvous): core/timeout.hpp's policy.
  std::chrono::milliseconds timeout = kDefaultOpTimeout;
  /// This rank's CUDA device; taken modulo the number of visible devices (several ranks may share one GPU
  /// for testing, each process with its own NCCL_HOSTID). It becomes the calling thread's current device.
  int device = 0;
  /// Key prefix in the store (the world communicator's keys live under "<prefix>/world").
  std::string prefix = "dtensor/nccl";
  /// Nonblocking communicators (ncclConfig_t::blocking = 0, the default): every NCCL call returns at once and
  /// the backend polls it against the op's deadline, so a member that never arrives in the communicator's
  /// creation or in the first op's connection set-up gives a TimeoutError. false (or
  /// DTENSOR_NCCL_NONBLOCKING=0, core/env.hpp's flags) makes them blocking (PyTorch's default since NCCL
  /// 2.26 hung in nonblocking mode, pytorch#153960): a call then returns once NCCL enqueued the op, and a
  /// call stuck inside NCCL cannot be interrupted (ncclCommAbort must not run under it): the watchdog fails
  /// the communicator at the deadline, so works and other threads raise, but the stuck thread stays.
  bool nonblocking = true;
  /// Work::wait() blocks the host until the op completed (DTENSOR_NCCL_BLOCKING_WAIT overrides it).
  bool blocking_wait = false;
};

namespace detail {

/// What the communicators of one rank share: the job's store (under NcclOptions::prefix; null for a
/// one-rank job without one) and the new_group rendezvous counts (backends/split.hpp).
struct NcclRankState {
  std::shared_ptr<Store> root;
  GroupGenerations generations;
};

/// A new communicator of `size` ranks, this one `rank`, on `device`: the unique id of rank 0 through
/// `store` (under "unique_id"), ncclCommInitRankConfig, a stream of its own. `what` names it in messages.
/// The timeout covers both steps: a nonblocking communicator is polled until NCCL finished making it, and
/// aborted with a TimeoutError (naming ncclCommInitRankConfig) when a member has not come by then; a
/// blocking one waits inside NCCL for as long as it takes (see NcclOptions::nonblocking).
inline std::shared_ptr<NcclCommState> init_nccl_comm(Store* store, int rank, int size, int device,
                                                     const NcclOptions& options,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& what) {
  const auto deadline = CommClock::now() + timeout;
  const ncclUniqueId id = exchange_nccl_unique_id(store, "unique_id", rank, size, timeout);
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = options.nonblocking ? 0 : 1;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string text = nccl_error_text(r);
    if (comm != nullptr) {
      ncclCommAbort(comm);
    }
    (void)cudaStreamDestroy(stream);
    throw Error(what + ": ncclCommInitRankConfig failed on rank " + std::to_string(rank) + " of " +
                std::to_string(size) + ": " + text);
  }
  auto state = std::make_shared<NcclCommState>(comm, device, stream, what, options.nonblocking);
  // A nonblocking init goes on in NCCL's thread: poll it against the deadline (aborted when it passes).
  state->wait_ready(r, deadline,
                    "ncclCommInitRankConfig (rank " + std::to_string(rank) + " of " + std::to_string(size) +
                        ")");
  return state;
}

class NcclBackendImpl final : public Backend, public std::enable_shared_from_this<NcclBackendImpl> {
public:
  /// `store`: this communicator's view of the job's store (may be null for a one-rank communicator).
  NcclBackendImpl(std::shared_ptr<NcclCommState> state, std::vector<int> global, int rank,
                  std::chrono::milliseconds timeout, NcclOptions options, std::shared_ptr<Store> store,
                  std::shared_ptr<NcclRankState> rank_state)
      : Backend(timeout), state_(std::move(state)), global_(std::move(global)), rank_(rank),
        options_(std::move(options)), store_(std::move(store)), rank_state_(std::move(rank_state)) {
    nccl_watchdog().watch(state_->guard());
    scratch_buffer(); // now, not in the first barrier: an op must not allocate (CUDA graph capture)
  }

  std::string_view name() const noexcept override { return "nccl"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return static_cast<int>(global_.size()); }
  std::span<const int> global_ranks() const noexcept override { return global_; }
  std::string describe() const override {
    return "rank " + std::to_string(rank_) + " (global " + std::to_string(global_[rank_]) +
           ") of nccl group " + format_list(global_) + " on cuda:" + std::to_string(state_->device());
  }

  /// The communicator's shared state (for tests and the mesh layer).
  const std::shared_ptr<NcclCommState>& state() const noexcept { return state_; }

protected:
  // ---- collectives --------------------------------------------------------------------------------------

  WorkPtr do_all_reduce(BufferRef buf, ReduceOp op, const CommOptions& opts) override {
    const auto t = nccl_type(buf.dtype);
    const auto o = nccl_op(op);
    return submit({"all_reduce", buf.count, buf.dtype, -1, static_cast<int>(op)}, opts, false,
                  [&](ncclComm_t c, cudaStream_t s) {
                    return ncclAllReduce(buf.data, buf.data, count(buf), t, o, c, s);
                  });
  }

  WorkPtr do_reduce(BufferRef buf, int root, ReduceOp op, const CommOptions& opts) override {
    const auto t = nccl_type(buf.dtype);
    const auto o = nccl_op(op);
    return submit({"reduce", buf.count, buf.dtype, root, static_cast<int>(op)}, opts, false,
                  [&](ncclComm_t c, cudaStream_t s) {
                    return ncclReduce(buf.data, buf.data, count(buf), t, o, root, c, s);
                  });
  }

  WorkPtr do_broadcast(BufferRef buf, int root, const CommOptions& opts) override {
    const auto t = nccl_type(buf.dtype);
    return submit({"broadcast", buf.count, buf.dtype, root}, opts, false, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(buf.data, buf.data, count(buf), t, root, c, s);
    });
  }

  WorkPtr do_all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                        std::span<const std::int64_t> displs, const CommOptions& opts) override {
    const auto t = nccl_type(in.dtype);
    if (equal_packed(counts, displs)) {
      return submit({"all_gather", in.count, in.dtype}, opts, false, [&](ncclComm_t c, cudaStream_t s) {
        return ncclAllGather(in.data, out.data, static_cast<std::size_t>(counts[0]), t, c, s);
      });
    }
    const std::size_t es = dtype_size(in.dtype);
    return submit(
        {"all_gather (uneven)", in.count, in.dtype}, opts, false, [&](ncclComm_t c, cudaStream_t s) {
          copy_async(at(out, displs[rank_], es), in.data, in.nbytes(), s);
          return grouped([&] {
            for (int p = 0; p < size(); ++p) {
              if (p == rank_) {
                continue;
              }
              if (ncclResult_t r = send(in.data, counts[rank_], t, p, c, s); r != ncclSuccess) {
                return r;
              }
              if (ncclResult_t r = recv(at(out, displs[p], es), counts[p], t, p, c, s); r != ncclSuccess) {
                return r;
              }
            }
            return ncclSuccess;
          });
        });
  }

  WorkPtr do_reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                            std::span<const std::int64_t> displs, ReduceOp op,
                            const CommOptions& opts) override {
    const auto t = nccl_type(in.dtype);
    const auto o = nccl_op(op);
    if (equal_packed(counts, displs)) {
      return submit({"reduce_scatter", in.count, in.dtype, -1, static_cast<int>(op)}, opts, false,
                    [&](ncclComm_t c, cudaStream_t s) {
                      return ncclReduceScatter(in.data, out.data, static_cast<std::size_t>(counts[0]), t, o,
                                               c, s);
                    });
    }
    const std::size_t es = dtype_size(in.dtype);
    return submit({"reduce_scatter (uneven)", in.count, in.dtype, -1, static_cast<int>(op)}, opts, false,
                  [&](ncclComm_t c, cudaStream_t s) {
                    return grouped([&] {
                      for (int root = 0; root < size(); ++root) {
                        if (counts[root] == 0) {
                          continue;
                        }
                        // recvbuff is only used on the root; elsewhere `out` is a valid device pointer NCCL
                        // ignores.
                        const ncclResult_t r =
                            ncclReduce(at(in, displs[root], es), out.data,
                                       static_cast<std::size_t>(counts[root]), t, o, root, c, s);
                        if (r != ncclSuccess) {
                          return r;
                        }
                      }
                      return ncclSuccess;
                    });
                  });
  }

  WorkPtr do_all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                        std::span<const std::int64_t> send_displs, BufferRef out,
                        std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                        const CommOptions& opts) override {
    const auto t = nccl_type(in.dtype);
    const std::size_t es = dtype_size(in.dtype);
    return submit({"all_to_all", in.count, in.dtype}, opts, false, [&](ncclComm_t c, cudaStream_t s) {
      copy_async(at(out, recv_displs[rank_], es), at(in, send_displs[rank_], es),
                 static_cast<std::size_t>(send_counts[rank_]) * es, s);
      return grouped([&] {
        for (int p = 0; p < size(); ++p) {
          if (p == rank_) {
            continue;
          }
          if (ncclResult_t r = send(at(in, send_displs[p], es), send_counts[p], t, p, c, s);
              r != ncclSuccess) {
            return r;
          }
          if (ncclResult_t r = recv(at(out, recv_displs[p], es), recv_counts[p], t, p, c, s);
              r != ncclSuccess) {
            return r;
          }
        }
        return ncclSuccess;
      });
    });
  }

  WorkPtr do_gather(BufferRef in, std::span<const BufferRef> blocks, int root,
                    const CommOptions& opts) override {
    const auto t = nccl_type(in.dtype);
    return submit({"gather", in.count, in.dtype, root}, opts, false, [&](ncclComm_t c, cudaStream_t s) {
      if (rank_ != root) {
        return grouped([&] { return send(in.data, in.count, t, root, c, s); });
      }
      copy_async(blocks[rank_].data, in.data, in.nbytes(), s);
      return grouped([&] {
        for (int p = 0; p < size(); ++p) {
          if (p == rank_) {
            continue;
          }
          if (ncclResult_t r = recv(blocks[p].data, blocks[p].count, t, p, c, s); r != ncclSuccess) {
            return r;
          }
        }
        return ncclSuccess;
      });
    });
  }

  WorkPtr do_scatter(std::span<const BufferRef> blocks, BufferRef out, int root,
                     const CommOptions& opts) override {
    const auto t = nccl_type(out.dtype);
    return submit({"scatter", out.count, out.dtype, root}, opts, false, [&](ncclComm_t c, cudaStream_t s) {
      if (rank_ != root) {
        return grouped([&] { return recv(out.data, out.count, t, root, c, s); });
      }
      copy_async(out.data, blocks[rank_].data, out.nbytes(), s);
      return grouped([&] {
        for (int p = 0; p < size(); ++p) {
          if (p == rank_) {
            continue;
          }
          if (ncclResult_t r = send(blocks[p].data, blocks[p].count, t, p, c, s); r != ncclSuccess) {
            return r;
          }
        }
        return ncclSuccess;
      });
    });
  }

  /// An all_reduce of one int32 on the group's scratch buffer; wait() blocks the host (torch's barrier).
  WorkPtr do_barrier(const CommOptions& opts) override {
    void* scratch = scratch_buffer();
    return submit({"barrier", 0, DType::uint8}, opts, true, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(scratch, scratch, 1, ncclInt32, ncclSum, c, s);
    });
  }

  // ---- point to point -----------------------------------------------------------------------------------

  WorkPtr do_p2p(std::span<const P2PRequest> requests, const CommOptions& opts) override {
    std::vector<P2PRequest> reqs(requests.begin(), requests.end());
    NcclOp op{requests.size() == 1 ? (requests[0].kind == P2PRequest::Kind::send ? "send" : "recv")
                                   : "batch_isend_irecv",
              requests.empty() ? 0 : requests[0].buffer.count,
              requests.empty() ? DType::uint8 : requests[0].buffer.dtype};
    for (const auto& r : requests) {
      if (std::find(op.peers.begin(), op.peers.end(), r.peer) == op.peers.end()) {
        op.peers.push_back(r.peer);
      }
    }
    if (requests.size() == 1) {
      op.root = requests[0].peer;
    }
    return submit(std::move(op), opts, false, [&](ncclComm_t c, cudaStream_t s) {
      return grouped([&] {
        for (const auto& r : reqs) {
          const auto t = nccl_type(r.buffer.dtype);
          const ncclResult_t res = r.kind == P2PRequest::Kind::send
                                       ? send(r.buffer.data, r.buffer.count, t, r.peer, c, s)
                                       : recv(r.buffer.data, r.buffer.count, t, r.peer, c, s);
          if (res != ncclSuccess) {
            return res;
          }
        }
        return ncclSuccess;
      });
    });
  }

  // ---- groups -------------------------------------------------------------------------------------------

  /// Called by the members only; they meet under the name GroupGenerations gives their list.
  std::shared_ptr<Backend> do_new_group(std::vector<int> global, int mine) override {
    const std::string name = rank_state_->generations.next_name(global);
    std::shared_ptr<Store> store = prefixed_store(name, rank_state_->root);
    CudaDeviceGuard guard(state_->device());
    auto child = init_nccl_comm(store.get(), mine, static_cast<int>(global.size()), state_->device(),
                                options_, timeout(),
                                "nccl group " + format_list(global) + " (rank " + std::to_string(mine) + ")");
    return std::make_shared<NcclBackendImpl>(std::move(child), std::move(global), mine, timeout(), options_,
                                             std::move(store), rank_state_);
  }

  /// ncclCommSplit, by every member (also those with colour < 0, which get nullptr).
  std::shared_ptr<Backend> do_split(const SplitGroup& g) override {
    return split_to(g.color >= 0 ? g.color : NCCL_SPLIT_NOCOLOR, g.key, g.rank, g.global_ranks,
                    child_store("s" + std::to_string(g.index) + "c" + std::to_string(g.color)));
  }

  Store* split_store() override { return store_.get(); }
  Store* rank_store() override { return rank_state_->root.get(); }

  void do_abort(std::string_view reason) override {
    state_->fail(describe() + ": aborted: " + std::string(reason), false);
  }

  /// A communicator that failed (watchdog, asynchronous error) takes no more ops.
  void check_usable(const char* /*op*/) const override { state_->rethrow_if_failed(); }

  void check_memory(const char* op, const BufferRef& b, const char* what) const override {
    DTENSOR_CHECK(b.device.is_cuda(),
                  where(op) + ": the " + what + " is in host memory (" + b.device.to_string() +
                      "); the NCCL backend needs CUDA tensors on cuda:" + std::to_string(state_->device()) +
                      " (move it with .to(dtensor::Device::cuda(" + std::to_string(state_->device()) +
                      ")), or use the gloo backend for host tensors)");
    DTENSOR_CHECK(b.device.index == state_->device(),
                  where(op) + ": the " + what + " is on " + b.device.to_string() +
                      " but this rank's communicator is on cuda:" + std::to_string(state_->device()));
  }

private:
  static std::size_t count(const BufferRef& b) { return static_cast<std::size_t>(b.count); }

  static void* at(const BufferRef& b, std::int64_t displ, std::size_t es) {
    return static_cast<char*>(b.data) + static_cast<std::size_t>(displ) * es;
  }

  static ncclResult_t send(const void* p, std::int64_t n, ncclDataType_t t, int peer, ncclComm_t c,
                           cudaStream_t s) {
    return n > 0 ? ncclSend(p, static_cast<std::size_t>(n), t, peer, c, s) : ncclSuccess;
  }
  static ncclResult_t recv(void* p, std::int64_t n, ncclDataType_t t, int peer, ncclComm_t c,
                           cudaStream_t s) {
    return n > 0 ? ncclRecv(p, static_cast<std::size_t>(n), t, peer, c, s) : ncclSuccess;
  }

  /// ncclGroupStart; body(); ncclGroupEnd (the group is always closed).
  template <class Body>
  static ncclResult_t grouped(Body&& body) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) {
      return r;
    }
    const ncclResult_t b = body();
    const ncclResult_t e = ncclGroupEnd();
    return b != ncclSuccess ? b : e;
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, cudaStream_t s) const {
    if (bytes > 0 && dst != src) {
      check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync",
                 describe());
    }
  }

  static bool equal_packed(std::span<const std::int64_t> counts, std::span<const std::int64_t> displs) {
    for (std::size_t i = 0; i < counts.size(); ++i) {
      if (counts[i] != counts[0] || displs[i] != static_cast<std::int64_t>(i) * counts[0]) {
        return false;
      }
    }
    return true;
  }

  /// What the flight recorder and a timeout's report say about an op.
  struct NcclOp {
    const char* name;
    std::int64_t count = 0; ///< this rank's elements (its input; a scatter's output)
    DType dtype = DType::uint8;
    int root = -1; ///< the root, or the peer of a single send or recv
    int reduce = -1;
    std::vector<int> peers = {}; ///< point-to-point: the members it exchanges with (empty: a collective)
  };

  /// One op: ordered after the caller's stream, enqueued on the group's stream, an event after it. The
  /// deadline starts here and covers the enqueue (on a nonblocking communicator NCCL may set up the
  /// connections of a first op meanwhile: polled, a TimeoutError when it passes) and the op on the GPU (the
  /// watchdog).
  template <class Enqueue>
  WorkPtr submit(NcclOp op, const CommOptions& opts, bool host_wait, Enqueue&& enqueue) {
    state_->rethrow_if_failed();
    CudaDeviceGuard guard(state_->device());
    const auto limit = opts.timeout.count() > 0 ? opts.timeout : timeout();
    const auto deadline = CommClock::now() + limit;
    auto user = static_cast<cudaStream_t>(opts.stream);
    const std::string what = std::string(op.name);
    // Under CUDA graph capture (of the caller's stream) the op is recorded, not run: its events must not be
    // queried (that would invalidate the capture), so the watchdog does not see it and wait() only joins
    // the streams; an op that must block the host (barrier, blocking wait) cannot be captured.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(user, &capture), "cudaStreamIsCapturing",
               [&] { return describe() + ": " + what; });
    const bool captured = capture == cudaStreamCaptureStatusActive;
    const bool host = host_wait || options_.blocking_wait;
    DTENSOR_CHECK(!(captured && host), describe() + ": " + what +
                                           " blocks the host until it is done, which a CUDA graph capture "
                                           "cannot record (barrier, or DTENSOR_NCCL_BLOCKING_WAIT=1)");
    const auto order = state_->lock_submissions();
    // Numbered like the members' matching ops: collectives in group order, messages per peer and direction.
    std::uint32_t seq = 0;
    if (op.peers.empty()) {
      seq = collective_seq_++;
    } else if (op.root >= 0) {
      seq = p2p_seq_[{op.root, std::string_view(op.name) == "send"}]++;
    }
    auto ready = std::make_shared<CudaEvent>(state_->device());
    check_cuda(cudaEventRecord(ready->get(), user), "cudaEventRecord",
               [&] { return describe() + ": " + what; });
    check_cuda(cudaStreamWaitEvent(state_->stream(), ready->get(), 0), "cudaStreamWaitEvent",
               [&] { return describe() + ": " + what; });
    const ncclResult_t r =
        state_->call(what, deadline, [&](ncclComm_t c) { return enqueue(c, state_->stream()); });
    if (r != ncclSuccess && r != ncclInProgress && r != ncclUnhandledCudaError && r != ncclSystemError &&
        r != ncclInternalError && r != ncclRemoteError) {
      // An argument error: the communicator is fine, report it to the caller only.
      throw Error(describe() + ": " + what + ": NCCL rejected the call: " + nccl_error_text(r));
    }
    state_->wait_ready(r, deadline, what);
    auto done = std::make_shared<CudaEvent>(state_->device());
    check_cuda(cudaEventRecord(done->get(), state_->stream()), "cudaEventRecord",
               [&] { return describe() + ": " + what; });
    if (!captured) { // a captured op is recorded into a graph, not run: nothing to watch or record
      OpTrace trace{shared_flight_recorder(),
                    0,
                    board_,
                    describe_op(op.name, seq, op.count, op.dtype, op.root, op.reduce),
                    {},
                    std::min(limit, std::chrono::milliseconds(1000))};
      trace.id = trace.recorder->submitted(op.name, op.count, op.dtype, op.root, op.reduce, /*running=*/true);
      if (!op.peers.empty()) {
        trace.members = std::move(op.peers);
        trace.members.push_back(rank_);
        std::sort(trace.members.begin(), trace.members.end());
      }
      nccl_watchdog().watch_op(state_->guard(), done, deadline, what, std::move(trace));
    }
    return std::make_shared<NcclWork>(state_, std::move(done), user, host, deadline, what, captured);
  }

  /// A small device buffer owned by the group (barrier), allocated with the communicator, stream-ordered on
  /// the group's stream: cudaMallocAsync there, and cudaFreeAsync there when the group goes, after every op
  /// queued before (the deleter holds the communicator's state, so the stream outlives the free).
  void* scratch_buffer() {
    if (!scratch_) {
      CudaDeviceGuard guard(state_->device());
      cudaStream_t s = state_->stream();
      void* p = nullptr;
      check_cuda(cudaMallocAsync(&p, 64, s), "cudaMallocAsync", describe() + ": barrier scratch");
      scratch_ = std::shared_ptr<void>(p, [state = state_](void* q) {
        try {
          CudaDeviceGuard g(state->device());
          (void)cudaFreeAsync(q, state->stream());
        } catch (const std::exception&) { // the device is gone: nothing to free
        }
      });
      check_cuda(cudaMemsetAsync(p, 0, 64, s), "cudaMemsetAsync", describe() + ": barrier scratch");
    }
    return scratch_.get();
  }

  /// The store view of a child communicator: "<this communicator's prefix>/<name>" (null without a store).
  std::shared_ptr<Store> child_store(const std::string& name) const { return prefixed_store(name, store_); }

  /// ncclCommSplit into a new backend whose rank `mine` maps to `global` (nullptr when mine < 0). The
  /// group's timeout covers the split (polled on a nonblocking parent, then the child's own set-up).
  std::shared_ptr<Backend> split_to(int color, int key, int mine, std::vector<int> global,
                                    std::shared_ptr<Store> store) {
    state_->rethrow_if_failed();
    CudaDeviceGuard guard(state_->device());
    const auto deadline = CommClock::now() + timeout();
    const auto order = state_->lock_submissions();
    // Pending ops on the parent finish first (ncclCommSplit is collective on the parent).
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = options_.nonblocking ? 0 : 1;
    ncclComm_t child = nullptr;
    const ncclResult_t r = state_->call("ncclCommSplit", deadline, [&](ncclComm_t c) {
      return ncclCommSplit(c, color, key, &child, &config);
    });
    state_->wait_ready(r, deadline, "ncclCommSplit");
    if (child == nullptr || mine < 0) {
      return nullptr;
    }
    cudaStream_t stream = nullptr;
    const cudaError_t made = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (made != cudaSuccess) {
      ncclCommAbort(child);
      check_cuda(made, "cudaStreamCreateWithFlags", describe());
    }
    auto child_state = std::make_shared<NcclCommState>(
        child, state_->device(), stream,
        "nccl group " + format_list(global) + " (rank " + std::to_string(mine) + ")", options_.nonblocking);
    // A nonblocking child may still be initialising.
    child_state->wait_ready(ncclInProgress, deadline, "ncclCommSplit (new communicator)");
    return std::make_shared<NcclBackendImpl>(std::move(child_state), std::move(global), mine, timeout(),
                                             options_, std::move(store), rank_state_);
  }

  std::shared_ptr<NcclCommState> state_;
  std::vector<int> global_;
  int rank_;
  NcclOptions options_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<NcclRankState> rank_state_;
  std::shared_ptr<void> scratch_;
  /// What each member was running when an op timed out (null without a store).
  std::shared_ptr<OpBoard> board_ =
      store_ != nullptr ? std::make_shared<OpBoard>(store_, rank_, size()) : nullptr;
  std::uint32_t collective_seq_ = 0;                      // under the submit mutex
  std::map<std::pair<int, bool>, std::uint32_t> p2p_seq_; // (peer, is send) -> messages so far
};

} // namespace detail

/// An NCCL communicator over all `size` ranks of the job; this process is `rank`. Rank 0 publishes the
/// unique id in `store` under options.prefix (the store may be null for size 1); sub-groups exchange their
/// split colours there too. Blocks until every rank joined or options.timeout passed
/// (dtensor::TimeoutError; the half-built communicator is aborted). Throws dtensor::Error when no CUDA
/// device is visible. Wrap it in a ProcessGroup: `ProcessGroup world(make_nccl_backend(store, r, n));`.
inline std::shared_ptr<Backend> make_nccl_backend(std::shared_ptr<Store> store, int rank, int size,
                                                  NcclOptions options = {}) {
  detail::check_world_rank(rank, size, "make_nccl_backend");
  const CudaDevices visible = probe_cuda_devices();
  DTENSOR_CHECK(!visible.unusable(), "make_nccl_backend: rank " + std::to_string(rank) +
                                         " has a GPU that CUDA cannot use: " + visible.reason());
  const int devices = visible.count;
  DTENSOR_CHECK(devices > 0,
                "make_nccl_backend: no CUDA device is visible to rank " + std::to_string(rank) + " (" +
                    visible.reason() +
                    "; check CUDA_VISIBLE_DEVICES and the driver), so NCCL cannot run; use the gloo "
                    "backend (DTENSOR_BACKEND=gloo) on machines without GPUs");
  options.nonblocking = detail::env_flag("DTENSOR_NCCL_NONBLOCKING", options.nonblocking);
  options.blocking_wait = detail::env_flag("DTENSOR_NCCL_BLOCKING_WAIT", options.blocking_wait);
  const int device = ((options.device % devices) + devices) % devices;
  detail::check_cuda(cudaSetDevice(device), "cudaSetDevice",
                     "make_nccl_backend (rank " + std::to_string(rank) + ")");

  auto rank_state = std::make_shared<detail::NcclRankState>();
  rank_state->root = detail::prefixed_store(options.prefix, std::move(store)); // null without a store
  std::shared_ptr<Store> world = detail::prefixed_store("world", rank_state->root);
  auto state = detail::init_nccl_comm(world.get(), rank, size, device, options, options.timeout,
                                      "nccl world of " + std::to_string(size) + " (rank " +
                                          std::to_string(rank) + ")");
  return std::make_shared<detail::NcclBackendImpl>(std::move(state), detail::world_ranks(size), rank,
                                                   options.timeout, std::move(options), std::move(world),
                                                   std::move(rank_state));
}

namespace detail {

/// The "nccl" entry of the backend registry (what init_process_group makes): this rank's device is
/// BackendOptions::device (LOCAL_RANK unless InitOptions::device says otherwise).
inline std::shared_ptr<Backend> make_nccl_backend_for_job(std::shared_ptr<Store> store, int rank, int size,
                                                          const BackendOptions& options) {
  NcclOptions no;
  no.timeout = options.timeout;
  no.prefix = options.prefix;
  no.device = options.device;
  return make_nccl_backend(std::move(store), rank, size, no);
}

/// "auto" prefers NCCL whenever a CUDA device is visible.
inline const bool nccl_backend_registered = [] {
  register_backend("nccl", make_nccl_backend_for_job,
                   BackendTraits{[] { return nccl_device_count() > 0; }, 10});
  return true;
}();

} // namespace detail

} // namespace dtensor

#pragma once
// The narrow runtime interface between the collectives front end (comm/) and a communication backend
// (backends/gloo/ now, backends/nccl/ next). Everything here is untyped: raw buffers described by
// (pointer, element count, DType, Device), per-op options, and an asynchronous completion object.
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

#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/reduce_op.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
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
  int peer = 0; ///< rank in the group
  int tag = 0;  ///< user tag, 0 <= tag < kMaxP2PTag
};

/// Largest user tag + 1 accepted by point-to-point ops.
inline constexpr int kMaxP2PTag = 1 << 23;

/// One communicator: the members of a group, as seen from one of them.
class Backend {
public:
  using WorkPtr = std::shared_ptr<WorkImpl>;

  virtual ~Backend() = default;

  /// "gloo" or "nccl".
  virtual std::string_view name() const noexcept = 0;
  /// This member's rank in the group, in [0, size()).
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  /// The global (world) rank of every member, indexed by group rank.
  virtual std::span<const int> global_ranks() const noexcept = 0;
  /// Human-readable name for messages, e.g. "gloo group [0,2] (rank 1 of 2)".
  virtual std::string describe() const = 0;

  virtual std::chrono::milliseconds timeout() const = 0;
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;

  // ---- collectives (every member submits; root/ranks are group ranks) -----------------------------------

  /// In place: buf = op(buf of every member).
  virtual WorkPtr all_reduce(BufferRef buf, ReduceOp op, const CommOptions& opts) = 0;
  /// In place on `root`; other members' buf is left unchanged.
  virtual WorkPtr reduce(BufferRef buf, int root, ReduceOp op, const CommOptions& opts) = 0;
  /// In place: buf = buf of `root`.
  virtual WorkPtr broadcast(BufferRef buf, int root, const CommOptions& opts) = 0;
  /// out[displs[i] .. + counts[i]) = in of member i; in.count == counts[rank()].
  virtual WorkPtr all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                             std::span<const std::int64_t> displs, const CommOptions& opts) = 0;
  /// out = op over members m of in_m[displs[rank()] .. + counts[rank()]); out.count == counts[rank()].
  virtual WorkPtr reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                                 std::span<const std::int64_t> displs, ReduceOp op,
                                 const CommOptions& opts) = 0;
  /// Member i receives in[send_displs[i] .. + send_counts[i]) into its out[recv_displs[me] .. + ...).
  virtual WorkPtr all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                             std::span<const std::int64_t> send_displs, BufferRef out,
                             std::span<const std::int64_t> recv_counts,
                             std::span<const std::int64_t> recv_displs, const CommOptions& opts) = 0;
  /// On root: blocks[i] = in of member i (one block per member, blocks[i].count == that member's
  /// in.count; the blocks may be separate tensors or parts of one buffer, see split_buffer). blocks is
  /// ignored elsewhere.
  virtual WorkPtr gather(BufferRef in, std::span<const BufferRef> blocks, int root,
                         const CommOptions& opts) = 0;
  /// Member i receives root's blocks[i] into out (out.count == blocks[i].count). blocks is ignored off
  /// root.
  virtual WorkPtr scatter(std::span<const BufferRef> blocks, BufferRef out, int root,
                          const CommOptions& opts) = 0;
  virtual WorkPtr barrier(const CommOptions& opts) = 0;

  // ---- point to point ---------------------------------------------------------------------------------

  /// Posts every request of the batch before waiting on any (so opposite exchanges never deadlock);
  /// one WorkImpl completes when all of them did. Successive sends from a to b with one tag match
  /// successive receives on b from a with that tag, in order.
  virtual WorkPtr p2p(std::span<const P2PRequest> requests, const CommOptions& opts) = 0;

  // ---- groups -----------------------------------------------------------------------------------------

  /// Every member calls it with the same list of *group* ranks (distinct, in range). Members of the list
  /// get a backend whose rank i is ranks[i]; the others get nullptr.
  virtual std::shared_ptr<Backend> new_group(std::span<const int> ranks) = 0;
  /// ncclCommSplit: every member calls it; members with equal color >= 0 form one group, ordered by
  /// (key, rank); color < 0 gives nullptr.
  virtual std::shared_ptr<Backend> split(int color, int key) = 0;

  /// Fails every pending and future op of this communicator with `reason`, and releases peers blocked
  /// on this member within seconds (gloo: closes the connections; NCCL: ncclCommAbort).
  virtual void abort(std::string_view reason) = 0;
};

} // namespace dtensor

#pragma once
// What submitting a backend op takes besides its data, and what it returns: CommOptions (the op's
// timeout, stream, and whether the caller waits at once) and WorkImpl, the completion every backend
// implements (backends/gloo/work.hpp, backends/mpi/work.hpp, backends/nccl/work.hpp). The typed front's
// Work (comm/work.hpp) wraps one.
//
//   std::shared_ptr<dtensor::WorkImpl> w = backend.all_reduce(buf, dtensor::ReduceOp::sum, {});
//   w->wait();   // rethrows the op's Error or TimeoutError

#include <chrono>

namespace dtensor {

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

namespace detail {

/// A WorkImpl that is complete when made.
class DoneWork final : public WorkImpl {
public:
  bool is_completed() override { return true; }
  void wait() override {}
};

} // namespace detail

} // namespace dtensor

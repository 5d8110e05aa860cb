#pragma once
// Device-side asynchrony for the NCCL backend (the counterpart of backends/gloo/executor.hpp):
//  - NcclCommState: one communicator with its own CUDA stream; the engine behind its CommGuard
//    (ncclCommGetAsyncError, ncclCommAbort), which orders every NCCL call on it, records its failure and
//    aborts it only while no call is in flight (backends/nccl/comm_guard.hpp);
//  - CudaEvent: completion of one op, the event recorded on the group's stream after it;
//  - NcclWork: the Work of one op (or one batch);
//  - nccl_watchdog(): the process's CommWatchdog (backends/nccl/watchdog.hpp), a thread that fails and aborts
//    a communicator whose op runs past its timeout, whose call is stuck in NCCL past its deadline, or that
//    reports an asynchronous error, so nothing hangs. Its CUDA calls run in thread-local stream-capture
//    mode (they cannot invalidate another thread's CUDA graph capture), and it holds guards only: a
//    communicator is finalized or aborted by its owner, on the thread that drops the last reference to it.

#include "dtensor/backends/nccl/comm_guard.hpp"
#include "dtensor/backends/nccl/types.hpp"
#include "dtensor/backends/nccl/watchdog.hpp"
#include "dtensor/backends/work.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/env.hpp"
#include "dtensor/core/error.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

namespace dtensor::detail {

/// NCCL's result as the guard's progress: ncclSuccess done, ncclInProgress in progress, else failed.
inline CommStatus nccl_status(ncclResult_t r) {
  if (r == ncclSuccess) {
    return CommStatus::done();
  }
  if (r == ncclInProgress) {
    return CommStatus::in_progress();
  }
  return CommStatus::failed(nccl_error_text(r));
}

/// One NCCL communicator, its stream, and its guard (shared with its works and the watchdog).
class NcclCommState final : public CommEngine {
public:
  NcclCommState(ncclComm_t comm, int device, cudaStream_t stream, std::string name, bool nonblocking)
      : comm_(comm), device_(device), stream_(stream), nonblocking_(nonblocking),
        guard_(std::make_shared<CommGuard>(std::move(name), *this)) {}

  NcclCommState(const NcclCommState&) = delete;
  NcclCommState& operator=(const NcclCommState&) = delete;

  /// Waits up to 60 s for the communicator's pending ops (less when it fails meanwhile: the watchdog still
  /// watches it), closes the guard, then finalizes and destroys it (up to 10 s more), or aborts it when it
  /// failed, an op failed or a wait ran out. Then releases the stream. Runs on the thread that drops the last
  /// reference (never the watchdog's).
  ~NcclCommState() {
    std::optional<CudaDeviceGuard> on_device;
    try {
      on_device.emplace(device_);
    } catch (const std::exception&) { // the device is gone; the calls below fail harmlessly
    }
    bool drained = false;
    const auto drain_until = CommClock::now() + std::chrono::seconds(60);
    while (!guard_->failed()) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q != cudaErrorNotReady) {
        drained = q == cudaSuccess;
        break;
      }
      if (CommClock::now() > drain_until) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    const bool aborted = guard_->close(); // from here on nothing else touches comm_
    if (!aborted) {
      bool clean = drained && !guard_->failed();
      if (clean) {
        ncclResult_t r = ncclCommFinalize(comm_);
        const auto until = CommClock::now() + std::chrono::seconds(10);
        while (r == ncclInProgress && CommClock::now() < until) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) {
            r = ncclInternalError;
          }
        }
        clean = r == ncclSuccess;
        if (clean) {
          ncclCommDestroy(comm_);
        }
      }
      if (!clean) {
        ncclCommAbort(comm_);
      }
    }
    (void)cudaStreamDestroy(stream_);
  }

  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  bool nonblocking() const noexcept { return nonblocking_; }
  /// Orders whole submissions (CommGuard::lock_order).
  CommGuard::Turn lock_submissions() { return guard_->lock_order(); }

  /// The guard: failure, calls, abort (what the works and the watchdog hold).
  const std::shared_ptr<CommGuard>& guard() const noexcept { return guard_; }
  const std::string& name() const noexcept { return guard_->name(); }
  bool failed() const noexcept { return guard_->failed(); }
  void rethrow_if_failed() const { guard_->rethrow_if_failed(); }
  /// Records the failure and aborts the communicator (CommGuard::fail).
  void fail(const std::string& message, bool is_timeout) { guard_->fail(message, is_timeout); }

  /// Runs one NCCL call on the communicator as the guard's call in flight (named `what`, expected back by
  /// `deadline`); throws the communicator's failure.
  template <class Call>
  ncclResult_t call(std::string_view what, CommClock::time_point deadline, Call&& c) {
    return guard_->call(what, deadline, [&] { return c(comm_); });
  }

  /// Polls a call that returned `first` until NCCL finished it (nonblocking communicators; CommGuard::
  /// wait_ready: a TimeoutError after `deadline`, the NCCL error when one shows).
  void wait_ready(ncclResult_t first, CommClock::time_point deadline, std::string_view what) {
    guard_->wait_ready(nccl_status(first), deadline, what);
  }

  // ---- CommEngine: called by the guard only -------------------------------------------------------------

  CommStatus status() override {
    ncclResult_t r = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &r);
    return nccl_status(q != ncclSuccess ? q : r);
  }

  void abort() noexcept override {
    std::optional<CudaDeviceGuard> on_device;
    try {
      on_device.emplace(device_);
    } catch (const std::exception&) {
    }
    ncclCommAbort(comm_);
  }

private:
  ncclComm_t comm_;
  int device_;
  cudaStream_t stream_;
  bool nonblocking_;
  std::shared_ptr<CommGuard> guard_;
};

/// An owned CUDA event (timing disabled); as an OpProbe, the completion of the op recorded before it.
class CudaEvent final : public OpProbe {
public:
  explicit CudaEvent(int device) : device_(device) {
    CudaDeviceGuard guard(device);
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags",
               "NCCL backend");
  }
  ~CudaEvent() override {
    if (event_ != nullptr) {
      (void)cudaEventDestroy(event_);
    }
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const noexcept { return event_; }
  int device() const noexcept { return device_; }

  /// cudaEventQuery on the event's device.
  State query(std::string& why) override {
    try {
      CudaDeviceGuard guard(device_);
      const cudaError_t q = cudaEventQuery(event_);
      if (q == cudaSuccess) {
        return State::done;
      }
      if (q == cudaErrorNotReady) {
        return State::pending;
      }
      why = std::string("CUDA error: ") + cudaGetErrorName(q) + ": " + cudaGetErrorString(q);
    } catch (const std::exception& e) {
      why = e.what();
    }
    return State::failed;
  }

private:
  cudaEvent_t event_ = nullptr;
  int device_;
};

/// The watchdog's polling period: DTENSOR_NCCL_WATCHDOG_MS (1 to 10000, decimal; 100 by default).
inline std::chrono::milliseconds nccl_watchdog_period() {
  const char* v = std::getenv("DTENSOR_NCCL_WATCHDOG_MS");
  return std::chrono::milliseconds(
      v != nullptr && *v != '\0' ? parse_decimal_int("DTENSOR_NCCL_WATCHDOG_MS", v, 1, 10000) : 100);
}

/// The process's NCCL watchdog (started at its first watch, stopped at exit; never deleted, so exit order
/// cannot bite).
inline CommWatchdog& nccl_watchdog() {
  static CommWatchdog* w = [] {
    auto* p = new CommWatchdog(nccl_watchdog_period(), [] {
      // Event queries and aborts from this thread must not invalidate a CUDA graph that another thread
      // captures in cudaStreamCaptureModeGlobal (PyTorch's watchdog does the same); it never captures.
      cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
      (void)cudaThreadExchangeStreamCaptureMode(&mode);
    });
    std::atexit([] { nccl_watchdog().stop(); });
    return p;
  }();
  return *w;
}

/// Completion of one NCCL op (or one batch): the event recorded on the group's stream after it.
class NcclWork final : public WorkImpl {
public:
  /// `captured`: recorded into a CUDA graph capture, not run (its event is never queried).
  NcclWork(std::shared_ptr<NcclCommState> comm, std::shared_ptr<CudaEvent> done, cudaStream_t user_stream,
           bool host_wait, CommClock::time_point deadline, std::string what, bool captured = false)
      : comm_(std::move(comm)), done_(std::move(done)), user_stream_(user_stream), host_wait_(host_wait),
        deadline_(deadline), what_(std::move(what)), captured_(captured) {}

  /// True once the op finished, or its communicator failed.
  bool is_completed() override {
    if (comm_->failed() || captured_) {
      return true;
    }
    std::string why;
    return done_->query(why) != OpProbe::State::pending;
  }

  /// Makes the caller's stream (CommOptions::stream; the legacy default stream when none was given) wait
  /// for the op; with host_wait (barrier, DTENSOR_NCCL_BLOCKING_WAIT=1) first blocks the host until it is
  /// done. Throws the communicator's failure whenever it failed, even after this op completed (see
  /// watchdog.hpp's wait_for_op): without host_wait, an op aborted after wait() returned is reported by the
  /// next wait() and the group's next op.
  void wait() override {
    CommGuard& comm = *comm_->guard();
    if (host_wait_) {
      detail::count_host_sync("NCCL: a host wait (barrier, DTENSOR_NCCL_BLOCKING_WAIT=1)");
      wait_for_op(comm, *done_, deadline_, what_);
    } else {
      comm.rethrow_if_failed();
    }
    CudaDeviceGuard guard(comm_->device());
    check_cuda(cudaStreamWaitEvent(user_stream_, done_->get(), 0), "cudaStreamWaitEvent", comm.name());
    comm.rethrow_if_failed();
  }

private:
  std::shared_ptr<NcclCommState> comm_;
  std::shared_ptr<CudaEvent> done_;
  cudaStream_t user_stream_;
  bool host_wait_;
  CommClock::time_point deadline_;
  std::string what_;
  bool captured_ = false;
};

} // namespace dtensor::detail

#pragma once
// Device-side asynchrony for the NCCL backend (the counterpart of backends/gloo/executor.hpp):
//  - NcclCommState: one communicator with its own CUDA stream, its failure state, and the locks that keep
//    NCCL calls on it ordered and abortable;
//  - NcclWork: completion of one op = a CUDA event recorded on the group's stream after the op;
//  - NcclWatchdog: one thread per process that turns ncclCommGetAsyncError errors and ops running past
//    their timeout into errors on the communicator and aborts it (ncclCommAbort), so nothing hangs.
//
// Locking: `submit_m` serialises whole submissions (a nonblocking communicator must reach ncclSuccess
// before the next op is issued); `call_m` guards each single NCCL call and is held only briefly (calls on
// a nonblocking communicator return at once), so abort() -- which takes `call_m` -- is never stuck
// behind a submission that waits for the communicator.

#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/nccl/types.hpp"
#include "dtensor/backends/op_board.hpp"
#include "dtensor/core/error.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dtensor::detail {

using NcclClock = std::chrono::steady_clock;

/// One NCCL communicator and what the ops on it share.
class NcclCommState {
public:
  NcclCommState(ncclComm_t comm, int device, cudaStream_t stream, std::string name, bool nonblocking)
      : comm_(comm), device_(device), stream_(stream), name_(std::move(name)), nonblocking_(nonblocking) {}

  NcclCommState(const NcclCommState&) = delete;
  NcclCommState& operator=(const NcclCommState&) = delete;

  /// Waits up to 60 s for the communicator's pending ops, finalizes it (up to 10 s more) and destroys it;
  /// aborts it instead when either wait runs out or an op failed. Then releases the stream.
  ~NcclCommState() {
    CudaDeviceGuard guard(device_);
    if (!aborted_.load()) {
      // Pending ops first; a peer that never joins one cannot hang the destructor (nothing watches a
      // communicator being destroyed), so after 60 s it is aborted instead.
      bool clean = false;
      const auto drain_until = NcclClock::now() + std::chrono::seconds(60);
      for (;;) {
        const cudaError_t q = cudaStreamQuery(stream_);
        if (q != cudaErrorNotReady) {
          clean = q == cudaSuccess;
          break;
        }
        if (NcclClock::now() > drain_until) {
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
      if (clean) {
        std::lock_guard lock(call_m_);
        ncclResult_t r = ncclCommFinalize(comm_);
        const auto until = NcclClock::now() + std::chrono::seconds(10);
        while (r == ncclInProgress && NcclClock::now() < until) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          ncclCommGetAsyncError(comm_, &r);
        }
        clean = r == ncclSuccess;
        if (clean) {
          ncclCommDestroy(comm_);
        }
      }
      if (!clean) {
        std::lock_guard lock(call_m_);
        ncclCommAbort(comm_);
      }
    }
    (void)cudaStreamDestroy(stream_);
  }

  ncclComm_t comm() const noexcept { return comm_; }
  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  const std::string& name() const noexcept { return name_; }
  bool nonblocking() const noexcept { return nonblocking_; }
  std::mutex& submit_mutex() noexcept { return submit_m_; }

  bool failed() const noexcept { return failed_.load(); }

  /// The stored failure (TimeoutError or Error); nullptr when healthy.
  std::exception_ptr error() const {
    std::lock_guard lock(error_m_);
    return error_;
  }
  void rethrow_if_failed() const {
    if (failed_.load()) {
      std::rethrow_exception(error());
    }
  }

  /// Records the failure and aborts the communicator (ncclCommAbort), which makes every pending op on it
  /// end and every later op fail with `message`. A later, different failure is appended ("...; then: ..."),
  /// so an explicit abort's reason is not lost when a peer's error arrived first; the first one decides
  /// the type (TimeoutError or Error).
  void fail(const std::string& message, bool is_timeout) {
    {
      std::lock_guard lock(error_m_);
      if (error_) {
        if (message_.find(message) == std::string::npos) {
          message_ += "; then: " + message;
          error_ = first_is_timeout_ ? std::make_exception_ptr(TimeoutError(message_))
                                     : std::make_exception_ptr(Error(message_));
        }
        return;
      }
      message_ = message;
      first_is_timeout_ = is_timeout;
      error_ = is_timeout ? std::make_exception_ptr(TimeoutError(message))
                          : std::make_exception_ptr(Error(message));
      failed_.store(true);
    }
    abort_comm();
  }

  /// Runs one NCCL call on the communicator under the call lock; fails when it was aborted.
  template <class Call>
  ncclResult_t call(Call&& c) {
    std::lock_guard lock(call_m_);
    if (aborted_.load()) {
      rethrow_if_failed();
      throw Error(name_ + ": the communicator was aborted");
    }
    return c(comm_);
  }

  /// ncclCommGetAsyncError; ncclSuccess once aborted or when the lock is busy and `try_only`.
  ncclResult_t async_error(bool try_only = false) {
    std::unique_lock lock(call_m_, std::defer_lock);
    if (try_only) {
      if (!lock.try_lock()) {
        return ncclSuccess;
      }
    } else {
      lock.lock();
    }
    if (aborted_.load()) {
      return ncclSuccess;
    }
    ncclResult_t r = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &r);
    return q != ncclSuccess ? q : r;
  }

  /// Polls until the communicator left ncclInProgress (nonblocking communicators), failing it with a
  /// TimeoutError after `deadline` and with the NCCL error when one appears. `what` names the op.
  void wait_ready(ncclResult_t first, NcclClock::time_point deadline, const std::string& what) {
    ncclResult_t r = first;
    auto nap = std::chrono::microseconds(20);
    while (r == ncclInProgress) {
      if (NcclClock::now() > deadline) {
        fail(name_ + ": " + what +
                 " did not get past NCCL's setup before the timeout (a peer is missing or "
                 "stuck); the communicator was aborted",
             true);
        rethrow_if_failed();
      }
      std::this_thread::sleep_for(nap);
      nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::microseconds(2000));
      rethrow_if_failed();
      r = async_error();
    }
    if (r != ncclSuccess) {
      fail(name_ + ": " + what + " failed: " + nccl_error_text(r, aborted_.load() ? nullptr : comm_), false);
      rethrow_if_failed();
    }
    rethrow_if_failed();
  }

private:
  void abort_comm() {
    // A blocking communicator may sit inside a call holding call_m_; NCCL allows aborting it from
    // another thread, so after a short wait we abort without the lock.
    std::unique_lock lock(call_m_, std::defer_lock);
    for (int i = 0; i < 100 && !lock.try_lock(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (aborted_.exchange(true)) {
      return;
    }
    CudaDeviceGuard guard(device_);
    ncclCommAbort(comm_);
  }

  ncclComm_t comm_;
  int device_;
  cudaStream_t stream_;
  std::string name_;
  bool nonblocking_;
  std::mutex submit_m_;
  std::mutex call_m_;
  mutable std::mutex error_m_;
  std::exception_ptr error_;
  std::string message_;
  bool first_is_timeout_ = false;
  std::atomic<bool> failed_{false};
  std::atomic<bool> aborted_{false};
};

/// An owned CUDA event (timing disabled).
class CudaEvent {
public:
  explicit CudaEvent(int device) : device_(device) {
    CudaDeviceGuard guard(device);
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags",
               "NCCL backend");
  }
  ~CudaEvent() {
    if (event_ != nullptr) {
      (void)cudaEventDestroy(event_);
    }
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const noexcept { return event_; }
  int device() const noexcept { return device_; }

private:
  cudaEvent_t event_ = nullptr;
  int device_;
};

/// What the watchdog keeps about an op besides its name: its entry in the group's flight recorder (marked
/// completed or failed when the watchdog sees the op end), and the group's op board, through which a timed
/// out op says what each member was running (backends/op_board.hpp).
struct NcclOpTrace {
  std::shared_ptr<FlightRecorder> recorder;
  std::uint64_t id = 0;
  std::shared_ptr<OpBoard> board; ///< null without a store
  std::string desc;               ///< the op as the members report it (describe_op)
  std::vector<int> members;       ///< the members to ask (empty: all)
  std::chrono::milliseconds patience{1000};

  void finished(bool ok) const {
    if (recorder) {
      recorder->finished(id, ok);
    }
  }

  /// The members' ops and this rank's last ops, appended to a timeout's message (waits up to `patience`
  /// for the members' reports).
  std::string report() const {
    std::string s;
    if (board) {
      board->publish_op(desc);
      s += board->members_ops(desc, members, patience);
    }
    if (recorder) {
      s += " [flight recorder, this rank's last ops on the group: " + recorder->dump() + "]";
    }
    return s;
  }
};

/// Watches communicators and pending ops; see the top of this file. One per process, started lazily.
class NcclWatchdog {
public:
  static NcclWatchdog& instance() {
    static NcclWatchdog* w = [] {
      auto* p = new NcclWatchdog(); // never deleted: stopped by atexit, so exit order cannot bite
      std::atexit([] { instance().stop(); });
      return p;
    }();
    return *w;
  }

  void watch(const std::shared_ptr<NcclCommState>& comm) {
    std::lock_guard lock(m_);
    comms_.push_back(comm);
    start_locked();
  }

  void watch_op(const std::shared_ptr<NcclCommState>& comm, std::shared_ptr<CudaEvent> done,
                NcclClock::time_point deadline, std::string what, NcclOpTrace trace = {}) {
    std::lock_guard lock(m_);
    ops_.push_back(Op{comm, std::move(done), deadline, std::move(what), std::move(trace)});
    start_locked();
  }

private:
  struct Op {
    std::weak_ptr<NcclCommState> comm;
    std::shared_ptr<CudaEvent> done;
    NcclClock::time_point deadline;
    std::string what;
    NcclOpTrace trace;
  };

  NcclWatchdog() = default;

  void start_locked() {
    if (!thread_.joinable() && !stop_.load()) {
      thread_ = std::thread([this] { loop(); });
    }
  }

  void stop() {
    stop_.store(true);
    if (thread_.joinable()) {
      thread_.join();
    }
  }

  static std::chrono::milliseconds interval() {
    const char* v = std::getenv("DTENSOR_NCCL_WATCHDOG_MS");
    const long ms = v != nullptr ? std::atol(v) : 100;
    return std::chrono::milliseconds(std::clamp(ms, 1L, 10000L));
  }

  void loop() {
    const auto period = interval();
    while (!stop_.load()) {
      std::this_thread::sleep_for(period);
      std::vector<std::shared_ptr<NcclCommState>> comms;
      std::vector<Op> ops;
      {
        std::lock_guard lock(m_);
        std::erase_if(comms_, [](const auto& w) { return w.expired(); });
        for (const auto& w : comms_) {
          if (auto c = w.lock()) {
            comms.push_back(std::move(c));
          }
        }
        ops.swap(ops_);
      }
      for (const auto& c : comms) {
        if (c->failed()) {
          continue;
        }
        const ncclResult_t r = c->async_error(/*try_only=*/true);
        if (r != ncclSuccess && r != ncclInProgress) {
          c->fail(c->name() + ": NCCL reported an asynchronous error: " + nccl_error_text(r) +
                      " (a peer failed or the network broke); the communicator was aborted",
                  false);
        }
      }
      std::vector<Op> keep;
      const auto now = NcclClock::now();
      for (auto& op : ops) {
        auto c = op.comm.lock();
        if (!c || c->failed()) {
          op.trace.finished(false);
          continue;
        }
        CudaDeviceGuard guard(op.done->device());
        const cudaError_t q = cudaEventQuery(op.done->get());
        if (q == cudaSuccess) {
          op.trace.finished(true);
          continue;
        }
        if (q != cudaErrorNotReady) {
          op.trace.finished(false);
          c->fail(c->name() + ": " + op.what + ": CUDA error while waiting: " + cudaGetErrorName(q) + ": " +
                      cudaGetErrorString(q),
                  false);
          continue;
        }
        if (now > op.deadline) {
          // Every member whose op timed out publishes it first, then reads the others' (up to a second).
          op.trace.finished(false);
          c->fail(c->name() + ": " + op.what +
                      " did not complete within its timeout (a member did not join it or is stuck, or the "
                      "members disagree on its sizes or dtype); the communicator was aborted" +
                      op.trace.report(),
                  true);
          continue;
        }
        keep.push_back(std::move(op));
      }
      std::lock_guard lock(m_);
      ops_.insert(ops_.end(), std::make_move_iterator(keep.begin()), std::make_move_iterator(keep.end()));
    }
  }

  std::mutex m_;
  std::vector<std::weak_ptr<NcclCommState>> comms_;
  std::vector<Op> ops_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// Completion of one NCCL op (or one batch): the event recorded on the group's stream after it.
class NcclWork final : public WorkImpl {
public:
  /// `captured`: recorded into a CUDA graph capture, not run (its event is never queried).
  NcclWork(std::shared_ptr<NcclCommState> comm, std::shared_ptr<CudaEvent> done, cudaStream_t user_stream,
           bool host_wait, NcclClock::time_point deadline, std::string what, std::shared_ptr<void> keep = {},
           bool captured = false)
      : comm_(std::move(comm)), done_(std::move(done)), user_stream_(user_stream), host_wait_(host_wait),
        deadline_(deadline), what_(std::move(what)), keep_(std::move(keep)), captured_(captured) {}

  bool is_completed() override {
    if (comm_->failed() || captured_) {
      return true;
    }
    CudaDeviceGuard guard(comm_->device());
    const cudaError_t q = cudaEventQuery(done_->get());
    return q != cudaErrorNotReady;
  }

  /// Makes the caller's stream (CommOptions::stream; the legacy default stream when none was given) wait
  /// for the op; with host_wait (barrier, DTENSOR_NCCL_BLOCKING_WAIT=1) blocks the host until it is done.
  /// Rethrows the communicator's failure.
  void wait() override {
    comm_->rethrow_if_failed();
    CudaDeviceGuard guard(comm_->device());
    if (host_wait_) {
      auto nap = std::chrono::microseconds(10);
      for (;;) {
        const cudaError_t q = cudaEventQuery(done_->get());
        if (q == cudaSuccess) {
          break;
        }
        if (q != cudaErrorNotReady) {
          comm_->fail(comm_->name() + ": " + what_ + ": " + cudaGetErrorName(q) + ": " +
                          cudaGetErrorString(q),
                      false);
        }
        comm_->rethrow_if_failed();
        if (NcclClock::now() > deadline_ + std::chrono::seconds(1)) { // the watchdog normally comes first
          comm_->fail(comm_->name() + ": " + what_ +
                          " did not complete within its timeout; the communicator "
                          "was aborted",
                      true);
          comm_->rethrow_if_failed();
        }
        std::this_thread::sleep_for(nap);
        nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::microseconds(1000));
      }
    }
    check_cuda(cudaStreamWaitEvent(user_stream_, done_->get(), 0), "cudaStreamWaitEvent", comm_->name());
    comm_->rethrow_if_failed();
  }

private:
  std::shared_ptr<NcclCommState> comm_;
  std::shared_ptr<CudaEvent> done_;
  cudaStream_t user_stream_;
  bool host_wait_;
  NcclClock::time_point deadline_;
  std::string what_;
  std::shared_ptr<void> keep_;
  bool captured_ = false;
};

} // namespace dtensor::detail

#pragma once
// The life of one NCCL communicator as the host sees it, written without CUDA or NCCL so that it runs, and
// is tested, on any machine (tests/backends/test_nccl_watchdog.cpp drives it with a fake engine; the NCCL
// backend's NcclCommState is the real engine, backends/nccl/work.hpp):
//
//  - Calls. Every call into the communicator (an enqueue, ncclCommGetAsyncError, ncclCommSplit, ...) runs
//    through call(), one at a time, and the guard knows while one is in flight, what it is and until when it
//    may take (its deadline). lock_order() orders whole submissions (an enqueue and its polls).
//  - Failure. fail() records the first failure (a TimeoutError or an Error; later, different ones are
//    appended to its message) and aborts the communicator. Every later call, and every wait on one of its
//    ops, rethrows it: once a communicator failed, no op of it reports success (as in PyTorch, where every
//    work of a communicator with an asynchronous error raises).
//  - Abort coordination. The engine's abort (ncclCommAbort) never runs while a call is in flight: NCCL frees
//    the communicator in it, under a thread that may still be inside NCCL. A failure that arrives during a
//    call (the watchdog finding a blocking call stuck in NCCL's connection set-up past its deadline) leaves
//    the abort pending; the thread in the call performs it when the call returns and then throws the
//    failure, so it learns that the communicator was aborted under it. No thread ever waits for another
//    thread's call to end before it can record a failure, and threads waiting to make a call or for their
//    turn to submit give up at once with the failure. The abort runs once.
//  - Deadlines. wait_ready() polls an asynchronous call (a nonblocking communicator's init, enqueue or split:
//    NCCL returns ncclInProgress and completes it on its own thread) until it is done, and fails the
//    communicator with a TimeoutError at the deadline; check_call() is the watchdog's check of a call still
//    in flight past its deadline (a blocking communicator stuck inside NCCL).
//  - Close. close() is the owner's last step before it releases the engine: it waits for a call in flight
//    (only the watchdog's short polls can be), and later calls are refused; a failure is still recorded but
//    aborts nothing.

#include "dtensor/core/error.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

namespace dtensor::detail {

using CommClock = std::chrono::steady_clock;

/// How far an asynchronous call got (NCCL: ncclSuccess, ncclInProgress, an error).
struct CommStatus {
  enum class Progress { done, in_progress, failed };
  Progress progress = Progress::done;
  std::string error; ///< why it failed (NCCL's error name and last error text)

  static CommStatus done() { return {}; }
  static CommStatus in_progress() { return {Progress::in_progress, {}}; }
  static CommStatus failed(std::string why) { return {Progress::failed, std::move(why)}; }
};

/// What a CommGuard asks of the communicator it guards.
class CommEngine {
public:
  /// The communicator's asynchronous state (ncclCommGetAsyncError). The guard calls it inside a call.
  virtual CommStatus status() = 0;
  /// Ends every pending op and releases the communicator (ncclCommAbort). The guard calls it at most once,
  /// never while a call is in flight, and never after close().
  virtual void abort() noexcept = 0;

protected:
  ~CommEngine() = default;
};

/// Polls fast first, then backs off: a few yields (an NCCL op usually leaves ncclInProgress within
/// microseconds), then sleeps from 20 us doubling up to 2 ms.
class PollBackoff {
public:
  void wait() {
    if (polls_++ < 32) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(nap_);
    nap_ = std::min<std::chrono::microseconds>(nap_ * 2, std::chrono::microseconds(2000));
  }

private:
  int polls_ = 0;
  std::chrono::microseconds nap_{20};
};

/// See the top of this file. Shared by the communicator's owner, its works and the watchdog; the engine
/// must outlive it or be closed first.
class CommGuard {
public:
  CommGuard(std::string name, CommEngine& engine) : name_(std::move(name)), engine_(&engine) {}
  CommGuard(const CommGuard&) = delete;
  CommGuard& operator=(const CommGuard&) = delete;

  /// The communicator in messages ("nccl group [0,2] (rank 1)").
  const std::string& name() const noexcept { return name_; }

  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  /// Whether the engine's abort ran.
  bool aborted() const {
    std::lock_guard lock(m_);
    return aborted_;
  }

  /// The recorded failure (TimeoutError or Error); nullptr while healthy.
  std::exception_ptr error() const {
    std::lock_guard lock(m_);
    return error_;
  }
  void rethrow_if_failed() const {
    if (failed()) {
      std::rethrow_exception(error());
    }
  }

  /// Runs `f` as the communicator's one call in flight, named `what`, which should return by `deadline`
  /// (only the watchdog's check_call looks at it). Waits for another thread's call to end first. Throws the
  /// failure when the communicator failed before or during the call (having performed an abort that came
  /// during the call), and Error when it was closed.
  template <class F>
  std::invoke_result_t<F&> call(std::string_view what, CommClock::time_point deadline, F&& f) {
    enter(what, deadline);
    Leave leave{this};
    if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
      f();
      leave.now();
      rethrow_if_failed();
    } else {
      auto r = f();
      leave.now();
      rethrow_if_failed();
      return r;
    }
  }

  /// One thread's turn to submit (lock_order); ends when destroyed.
  class Turn {
  public:
    Turn(Turn&& o) noexcept : g_(std::exchange(o.g_, nullptr)) {}
    Turn& operator=(Turn&&) = delete;
    ~Turn() {
      if (g_ != nullptr) {
        g_->end_turn();
      }
    }

  private:
    friend class CommGuard;
    explicit Turn(CommGuard* g) : g_(g) {}
    CommGuard* g_;
  };

  /// Orders whole submissions, each several calls (a nonblocking communicator must finish one op -- its
  /// enqueue, then the polls until NCCL enqueued it -- before the next is issued). A thread waiting for its
  /// turn gives up with the failure as soon as there is one, instead of queueing behind a call stuck in NCCL.
  Turn lock_order() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return !ordered_ || failed(); });
    if (failed()) {
      lock.unlock();
      rethrow_if_failed();
    }
    ordered_ = true;
    return Turn(this);
  }

  /// The engine's status, when no call is in flight and the communicator is neither failed nor closed;
  /// nullopt otherwise. Never waits (the watchdog's poll).
  std::optional<CommStatus> try_status() {
    {
      std::lock_guard lock(m_);
      if (busy_ || failed() || closed_) {
        return std::nullopt;
      }
      busy_ = true;
      call_what_ = "a status poll";
      call_deadline_ = CommClock::time_point::max();
    }
    Leave leave{this};
    try {
      return engine_->status();
    } catch (const std::exception& e) {
      return CommStatus::failed(e.what());
    }
  }

  /// Records `message` as the failure (TimeoutError when `is_timeout`; the first failure decides the type, a
  /// later one is appended: "...; then: ...") and aborts the communicator: now, or when the call in flight
  /// returns. Never waits for another thread's call.
  void fail(const std::string& message, bool is_timeout) {
    {
      std::lock_guard lock(m_);
      record(message, is_timeout);
      if (aborted_ || aborting_ || abort_pending_ || closed_) {
        cv_.notify_all();
        return;
      }
      if (busy_) {
        abort_pending_ = true; // the thread in the call aborts when it returns
        cv_.notify_all();
        return;
      }
      busy_ = true; // the abort is the call in flight now: no call starts under it
      aborting_ = true;
      call_what_ = "the abort";
      call_deadline_ = CommClock::time_point::max();
    }
    cv_.notify_all(); // threads waiting for a call or a turn give up now, not after the abort
    engine_->abort();
    {
      std::lock_guard lock(m_);
      aborted_ = true;
      aborting_ = false;
      busy_ = false;
    }
    cv_.notify_all();
  }

  /// Polls until an asynchronous call left CommStatus::in_progress: returns when it is done; fails the
  /// communicator and throws when it failed, when the communicator failed meanwhile, or (TimeoutError) when
  /// `deadline` passed first. `first` is what the call itself returned.
  void wait_ready(CommStatus first, CommClock::time_point deadline, std::string_view what) {
    CommStatus s = std::move(first);
    PollBackoff backoff;
    while (s.progress == CommStatus::Progress::in_progress) {
      rethrow_if_failed();
      if (CommClock::now() > deadline) {
        fail(name_ + ": " + std::string(what) +
                 " did not complete before its timeout (a member is missing or stuck, e.g. in setting up "
                 "its connections); the communicator was aborted",
             true);
        rethrow_if_failed();
      }
      backoff.wait();
      s = call(what, deadline, [&] { return engine_->status(); });
    }
    if (s.progress == CommStatus::Progress::failed) {
      fail(name_ + ": " + std::string(what) + " failed: " + s.error, false);
    }
    rethrow_if_failed();
  }

  /// The watchdog's check: when a call is still in flight after its deadline, fails the communicator with a
  /// TimeoutError (the abort then waits for the call to return). Returns whether it did.
  bool check_call(CommClock::time_point now) {
    std::string what;
    {
      std::lock_guard lock(m_);
      if (!busy_ || failed() || closed_ || now <= call_deadline_) {
        return false;
      }
      what = call_what_;
    }
    fail(name_ + ": " + what +
             " is still inside NCCL after its timeout (a member did not join it, or is stuck); the "
             "communicator fails now and is aborted when the call returns (ncclCommAbort cannot interrupt a "
             "call of a blocking communicator)",
         true);
    return true;
  }

  /// The owner's last step before it releases the engine: waits for the call in flight, then refuses every
  /// later call and abort. Returns whether the engine was aborted (else the owner finalizes it).
  bool close() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return !busy_; });
    closed_ = true;
    return aborted_;
  }

private:
  /// Ends the call in flight once (on return or unwinding): performs an abort that arrived during it.
  struct Leave {
    CommGuard* g;
    void now() noexcept {
      if (g != nullptr) {
        std::exchange(g, nullptr)->leave();
      }
    }
    ~Leave() { now(); }
  };

  void enter(std::string_view what, CommClock::time_point deadline) {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return !busy_ || failed(); });
    if (failed()) {
      lock.unlock();
      rethrow_if_failed();
    }
    if (closed_) {
      throw Error(name_ + ": " + std::string(what) + ": the communicator was closed");
    }
    busy_ = true;
    call_what_ = std::string(what);
    call_deadline_ = deadline;
  }

  void end_turn() noexcept {
    {
      std::lock_guard lock(m_);
      ordered_ = false;
    }
    cv_.notify_all();
  }

  void leave() noexcept {
    std::unique_lock lock(m_);
    if (abort_pending_) {
      abort_pending_ = false;
      aborting_ = true;
      call_what_ = "the abort";
      lock.unlock();
      engine_->abort();
      lock.lock();
      aborting_ = false;
      aborted_ = true;
    }
    busy_ = false;
    call_what_.clear();
    lock.unlock();
    cv_.notify_all();
  }

  void record(const std::string& message, bool is_timeout) { // under m_
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
    error_ =
        is_timeout ? std::make_exception_ptr(TimeoutError(message)) : std::make_exception_ptr(Error(message));
    failed_.store(true, std::memory_order_release);
  }

  const std::string name_;
  CommEngine* const engine_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool ordered_ = false;  // a submission holds its turn (lock_order)
  bool busy_ = false;     // a call (or the abort) is in flight
  std::string call_what_; // what it is
  CommClock::time_point call_deadline_{};
  bool abort_pending_ = false; // a failure came during the call: its thread aborts when it returns
  bool aborting_ = false;      // the abort is the call in flight
  bool aborted_ = false;
  bool closed_ = false;
  std::exception_ptr error_;
  std::string message_;
  bool first_is_timeout_ = false;
  std::atomic<bool> failed_{false};
};

} // namespace dtensor::detail

#pragma once
// Host-side asynchrony for the gloo backend. gloo's calls block the calling thread, so each group owns
//  - a SerialExecutor that runs its ops one at a time in submission order (async collectives on one group
//    stay ordered, and tags never race), on the caller's thread when the group is idle (no thread hop for
//    synchronous ops) and on a lazily started worker thread otherwise;
//  - HostWork, the completion object wait()/is_completed() look at;
//  - DeferredWork, the completion of a posted point-to-point batch: its last step (waiting for the
//    transport) runs on the first thread that waits for it, or on a second per-group SerialExecutor
//    (the completer) when the work is polled or dropped, never on the ordered executor.

#include "dtensor/backends/backend.hpp"

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace dtensor::detail {

/// The completion flag and error of one host-side op, under one mutex that derived works share for their
/// own state.
class Completion {
public:
  /// Marks the op finished (with `error` if it failed). Only the first call counts.
  void finish(std::exception_ptr error = nullptr) {
    {
      std::lock_guard lock(m_);
      if (done_) {
        return;
      }
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

protected:
  /// Blocks (on `lock`, holding m_) until finished; rethrows the op's error.
  void wait_finished(std::unique_lock<std::mutex>& lock) {
    cv_.wait(lock, [&] { return done_; });
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

/// A host-side op finished by whoever runs it (finish()).
class HostWork final : public WorkImpl, public Completion {
public:
  bool is_completed() override {
    std::lock_guard lock(m_);
    return done_;
  }

  void wait() override {
    std::unique_lock lock(m_);
    wait_finished(lock);
  }
};

/// Runs tasks one at a time, in submission order. Tasks must not throw.
class SerialExecutor {
public:
  using Task = std::function<void()>;

  SerialExecutor() = default;
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  /// Runs what is queued, then stops the worker.
  ~SerialExecutor() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) {
      worker_.join();
    }
  }

  /// Runs `task` after every task submitted before it. When `inline_if_idle` and nothing is queued or
  /// running, runs it on the calling thread before returning; otherwise queues it and returns at once.
  void submit(Task task, bool inline_if_idle) {
    if (inline_if_idle && run_inline_if_idle(task)) {
      return;
    }
    std::unique_lock lock(m_);
    queue_.push_back(std::move(task));
    if (!worker_.joinable()) {
      worker_ = std::thread([this] { run(); });
    }
    lock.unlock();
    cv_.notify_all();
  }

  /// When nothing is queued or running, runs `f` on the calling thread (ordered like a task submitted
  /// now) and returns true; otherwise runs nothing and returns false. Allocates nothing. `f` must not
  /// throw.
  template <class F>
  bool run_inline_if_idle(F&& f) {
    {
      std::lock_guard lock(m_);
      if (!queue_.empty() || busy_) {
        return false;
      }
      busy_ = true;
    }
    f();
    bool wake = false;
    {
      std::lock_guard lock(m_);
      busy_ = false;
      wake = !queue_.empty();
    }
    if (wake) {
      cv_.notify_all();
    }
    return true;
  }

private:
  void run() {
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return (!queue_.empty() && !busy_) || (stop_ && queue_.empty()); });
      if (queue_.empty()) {
        return; // stop_
      }
      Task task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      task();
      lock.lock();
      busy_ = false;
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread worker_;
};

/// Completion of an op that was posted in order but whose last step -- waiting for the transport -- may
/// run on any thread (point-to-point batches). That step runs exactly once:
///  - in the first wait() (the usual post-then-wait runs on the caller's thread: no thread hop);
///  - on `completer` once is_completed() was called (polling makes progress without a waiter);
///  - on `completer` when the work is dropped before anyone waited (its buffers live until the transfers
///    end).
/// Waiting for one batch never waits for another, so batches complete in any order.
class DeferredWork final : public WorkImpl,
                           public Completion,
                           public std::enable_shared_from_this<DeferredWork> {
public:
  /// The last step: waits for the transport and returns the op's error (nullptr on success).
  using Complete = std::function<std::exception_ptr()>;

  /// `completer` must outlive every Complete this work holds (each holds its group).
  explicit DeferredWork(SerialExecutor& completer) : completer_(&completer) {}

  ~DeferredWork() override {
    if (complete_) {
      completer_->submit([c = std::move(complete_)] { (void)c(); }, /*inline_if_idle=*/false);
    }
  }

  /// The op was posted; `complete` finishes it.
  void posted(Complete complete) {
    bool hand = false;
    {
      std::lock_guard lock(m_);
      complete_ = std::move(complete);
      posted_ = true;
      hand = want_completer_;
    }
    cv_.notify_all();
    if (hand) {
      hand_off();
    }
  }

  bool is_completed() override {
    {
      std::lock_guard lock(m_);
      if (done_) {
        return true;
      }
      if (!posted_) {
        want_completer_ = true; // posted() hands it over
        return false;
      }
    }
    hand_off();
    return false;
  }

  void wait() override {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return posted_ || done_; });
    if (!done_ && complete_) {
      Complete c = std::exchange(complete_, nullptr);
      lock.unlock();
      finish(c());
      lock.lock();
    }
    wait_finished(lock);
  }

private:
  void hand_off() {
    {
      std::lock_guard lock(m_);
      if (!complete_ || handed_) {
        return;
      }
      handed_ = true;
    }
    completer_->submit(
        [self = shared_from_this()] {
          Complete c;
          {
            std::lock_guard lock(self->m_);
            c = std::exchange(self->complete_, nullptr);
          }
          if (c) {
            self->finish(c());
          }
        },
        /*inline_if_idle=*/false);
  }

  SerialExecutor* completer_;
  Complete complete_;
  bool posted_ = false;
  bool want_completer_ = false;
  bool handed_ = false;
};

} // namespace dtensor::detail

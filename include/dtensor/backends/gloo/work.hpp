#pragma once
// Completion objects of the gloo backend's ops (the counterpart of backends/nccl/work.hpp):
//  - HostWork: the completion of an op run by the group's executor (executor.hpp), finished by whoever
//    runs it; completed_work() is the one shared, successful work of every synchronous op that ran inline;
//  - DeferredWork: the completion of a posted point-to-point batch: its last step (waiting for the
//    transport) runs on the first thread that waits for it, or on a second per-group SerialExecutor (the
//    completer) when the work is polled or dropped, never on the ordered executor.

#include "dtensor/backends/gloo/executor.hpp"
#include "dtensor/backends/work.hpp"

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
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

/// A finished, successful work, shared by every synchronous op that ran inline (nothing allocated).
inline std::shared_ptr<WorkImpl> completed_work() {
  static const std::shared_ptr<WorkImpl> done = [] {
    auto w = std::make_shared<HostWork>();
    w->finish();
    return w;
  }();
  return done;
}

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

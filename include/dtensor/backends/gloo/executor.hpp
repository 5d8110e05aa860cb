#pragma once
// Host-side asynchrony for the gloo backend. gloo's calls block the calling thread, so each group owns
//  - a SerialExecutor that runs its ops one at a time in submission order (async collectives on one group
//    stay ordered, and tags never race), on the caller's thread when the group is idle (no thread hop for
//    synchronous ops) and on a lazily started worker thread otherwise;
//  - HostWork, the completion object wait()/is_completed() look at.

#include "dtensor/backends/backend.hpp"

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace dtensor::detail {

/// Completion flag + error of one host-side op.
class HostWork final : public WorkImpl {
public:
  bool is_completed() override {
    std::lock_guard lock(m_);
    return done_;
  }

  void wait() override {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

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

private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
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
    std::unique_lock lock(m_);
    if (inline_if_idle && queue_.empty() && !busy_) {
      busy_ = true;
      lock.unlock();
      task();
      lock.lock();
      busy_ = false;
      bool wake = !queue_.empty();
      lock.unlock();
      if (wake) {
        cv_.notify_all();
      }
      return;
    }
    queue_.push_back(std::move(task));
    if (!worker_.joinable()) {
      worker_ = std::thread([this] { run(); });
    }
    lock.unlock();
    cv_.notify_all();
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

} // namespace dtensor::detail

#pragma once
// Ordered host-side execution for the gloo backend. gloo's calls block the calling thread, so each group
// owns a SerialExecutor that runs its ops one at a time in submission order (async collectives on one
// group stay ordered, and tags never race), on the caller's thread when the group is idle (no thread hop
// for synchronous ops) and on a lazily started worker thread otherwise. OpArrays are the per-member
// arrays an op reads, viewed in place while it runs on the caller's thread and copied when it is queued.

#include "dtensor/backends/buffer.hpp"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <utility>

namespace dtensor::detail {

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

/// The arrays of group size an op reads: up to four of counts and displacements, and gather's/scatter's
/// blocks. They view the caller's arrays while the op runs on the caller's thread; own() copies them
/// before it is queued.
struct OpArrays {
  std::array<std::span<const std::int64_t>, 4> v{};
  std::span<const BufferRef> blocks;
  std::shared_ptr<std::int64_t[]> storage;
  std::shared_ptr<BufferRef[]> block_storage;

  OpArrays() = default;
  OpArrays(std::initializer_list<std::span<const std::int64_t>> l) {
    std::copy(l.begin(), l.end(), v.begin());
  }
  std::span<const std::int64_t> operator[](std::size_t i) const { return v[i]; }

  void own() {
    if (!blocks.empty()) {
      block_storage = std::make_shared<BufferRef[]>(blocks.size());
      std::copy(blocks.begin(), blocks.end(), block_storage.get());
      blocks = {block_storage.get(), blocks.size()};
    }
    std::size_t total = 0;
    for (auto& a : v) {
      total += a.size();
    }
    if (total == 0) {
      return;
    }
    storage = std::make_shared_for_overwrite<std::int64_t[]>(total);
    std::int64_t* at = storage.get();
    for (auto& a : v) {
      std::copy(a.begin(), a.end(), at);
      a = {at, a.size()};
      at += a.size();
    }
  }
};

} // namespace dtensor::detail

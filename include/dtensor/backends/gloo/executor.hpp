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

/// Runs tasks one at a time, in submission order. Tasks must not throw. The queue lives in a state the
/// worker shares, so a task may destroy the executor (the last reference to the group that owns it, held
/// by a completion that runs on the worker): the worker is then detached and stops after that task.
class SerialExecutor {
public:
  using Task = std::function<void()>;

  SerialExecutor() = default;
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  /// Runs what is queued, then stops the worker.
  ~SerialExecutor() {
    {
      std::lock_guard lock(state_->m);
      state_->stop = true;
    }
    state_->cv.notify_all();
    if (worker_.joinable()) {
      if (worker_.get_id() == std::this_thread::get_id()) {
        worker_.detach(); // destroyed by one of its own tasks: it finishes the queue on its own
      } else {
        worker_.join();
      }
    }
  }

  /// Runs `task` after every task submitted before it. When `inline_if_idle` and nothing is queued or
  /// running, runs it on the calling thread before returning; otherwise queues it and returns at once.
  void submit(Task task, bool inline_if_idle) {
    if (inline_if_idle && run_inline_if_idle(task)) {
      return;
    }
    std::unique_lock lock(state_->m);
    state_->queue.push_back(std::move(task));
    if (!worker_.joinable()) {
      worker_ = std::thread([state = state_] { run(*state); });
    }
    lock.unlock();
    state_->cv.notify_all();
  }

  /// When nothing is queued or running, runs `f` on the calling thread (ordered like a task submitted
  /// now) and returns true; otherwise runs nothing and returns false. Allocates nothing. `f` must not
  /// throw.
  template <class F>
  bool run_inline_if_idle(F&& f) {
    State& st = *state_;
    {
      std::lock_guard lock(st.m);
      if (!st.queue.empty() || st.busy) {
        return false;
      }
      st.busy = true;
    }
    f();
    bool wake = false;
    {
      std::lock_guard lock(st.m);
      st.busy = false;
      wake = !st.queue.empty();
    }
    if (wake) {
      st.cv.notify_all();
    }
    return true;
  }

private:
  struct State {
    std::mutex m;
    std::condition_variable cv;
    std::deque<Task> queue;
    bool busy = false;
    bool stop = false;
  };

  static void run(State& st) {
    std::unique_lock lock(st.m);
    for (;;) {
      st.cv.wait(lock, [&] { return (!st.queue.empty() && !st.busy) || (st.stop && st.queue.empty()); });
      if (st.queue.empty()) {
        return; // stop
      }
      Task task = std::move(st.queue.front());
      st.queue.pop_front();
      st.busy = true;
      lock.unlock();
      task();
      task = nullptr; // what the task held goes before the lock is taken again (it may destroy the executor)
      lock.lock();
      st.busy = false;
    }
  }

  std::shared_ptr<State> state_ = std::make_shared<State>();
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

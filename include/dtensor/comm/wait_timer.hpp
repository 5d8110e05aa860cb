#pragma once
// CommWaitTimer: how long this thread was blocked in communication while the timer was in scope: inside
// the calls that submit ops (a host backend runs a synchronous op in its call) and in waiting for them
// (Work::wait, and the waits inside redistribute, collective matmul, the overlapped FSDP and DDP schedules,
// the pipeline). Time the thread spends computing while an op is in flight is not counted, so over a
// training step seconds() is the step's exposed communication.
//
//   dtensor::CommWaitTimer blocked;              // active on this thread until it goes out of scope
//   trainer.step(ids, targets, opt);
//   double exposed = blocked.seconds() / step_seconds;
//
// Every op passes the ProcessGroup front end (comm/process_group.hpp), which times its submission and, while
// some timer is active on the submitting thread, hands out a completion whose wait() is timed on the thread
// that waits. Timers nest (every active one counts, like CommDebugMode); a wait inside a timed call is
// counted once. On a device backend wait() orders the caller's stream after the op and returns: the timer
// measures the host's blocked time, not the stream's.

#include "dtensor/backends/work.hpp"

#include <chrono>
#include <memory>
#include <utility>

namespace dtensor {

class CommWaitTimer {
public:
  CommWaitTimer() : parent_(active()) { active() = this; }
  ~CommWaitTimer() { active() = parent_; }
  CommWaitTimer(const CommWaitTimer&) = delete;
  CommWaitTimer& operator=(const CommWaitTimer&) = delete;

  /// Seconds this thread was blocked in communication since the timer began (or since reset()).
  double seconds() const noexcept { return seconds_; }
  void reset() noexcept { seconds_ = 0; }

  /// True when some timer is active on this thread.
  static bool any_active() noexcept { return active() != nullptr; }

  /// Runs f() and adds its wall time to every timer active on this thread, unless this thread is already
  /// inside a timed call (nested calls count once).
  template <class F>
  static decltype(auto) time(F&& f) {
    if (!any_active() || inside()) {
      return f();
    }
    struct Timed {
      std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
      Timed() { inside() = true; }
      ~Timed() {
        inside() = false;
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        for (CommWaitTimer* t = active(); t != nullptr; t = t->parent_) {
          t->seconds_ += s;
        }
      }
    } timed;
    return f();
  }

private:
  static CommWaitTimer*& active() noexcept {
    thread_local CommWaitTimer* timer = nullptr;
    return timer;
  }
  static bool& inside() noexcept {
    thread_local bool in = false;
    return in;
  }

  CommWaitTimer* parent_;
  double seconds_ = 0;
};

namespace detail {

/// A completion whose wait() is timed on the waiting thread (ProcessGroup hands it out while a
/// CommWaitTimer is active on the submitting thread).
class TimedWork final : public WorkImpl {
public:
  explicit TimedWork(std::shared_ptr<WorkImpl> inner) : inner_(std::move(inner)) {}
  bool is_completed() override { return inner_->is_completed(); }
  void wait() override {
    CommWaitTimer::time([&] { inner_->wait(); });
  }

private:
  std::shared_ptr<WorkImpl> inner_;
};

} // namespace detail

} // namespace dtensor

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
//   blocked.seconds("all_gather", "tp");         // per op and group label, as CommDebugMode names them
//   std::puts(blocked.to_string().c_str());      // a table: op, axes, ms, the most blocked first
//
// Every op passes the ProcessGroup front end (comm/process_group.hpp), which times its submission and, while
// some timer is active on the submitting thread, hands out a completion whose wait() is timed on the thread
// that waits. Timers nest (every active one counts, like CommDebugMode); a wait inside a timed call is
// counted once. On a device backend wait() orders the caller's stream after the op and returns: the timer
// measures the host's blocked time, not the stream's.

#include "dtensor/backends/work.hpp"
#include "dtensor/core/thread_scope.hpp"

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

namespace dtensor {

class CommWaitTimer : public detail::ThreadScope<CommWaitTimer> {
public:
  CommWaitTimer() = default;

  /// Seconds this thread was blocked in communication since the timer began (or since reset()).
  double seconds() const noexcept {
    double s = 0;
    for (const auto& [key, v] : by_op_) {
      s += v;
    }
    return s;
  }
  /// The same for the ops called `op` (CommDebugMode's names: "all_gather", "permute", ...) on the groups
  /// labelled `axes` ("tp", "dp*tp"; {} for all).
  double seconds(std::string_view op, std::string_view axes = {}) const {
    double s = 0;
    for (const auto& [key, v] : by_op_) {
      s += (key.first == op && (axes.empty() || key.second == axes)) ? v : 0;
    }
    return s;
  }
  /// Seconds per (op, axes).
  const std::map<std::pair<std::string, std::string>, double>& entries() const noexcept { return by_op_; }
  void reset() noexcept { by_op_.clear(); }

  /// One row per (op, axes), the most blocked first: "op  axes  ms".
  std::string to_string() const {
    std::multimap<double, const std::pair<std::string, std::string>*, std::greater<>> order;
    for (const auto& [key, v] : by_op_) {
      order.emplace(v, &key);
    }
    std::string s;
    char line[160];
    std::snprintf(line, sizeof line, "%-20s %-10s %10s\n", "op", "axes", "ms");
    s += line;
    for (const auto& [v, key] : order) {
      std::snprintf(line, sizeof line, "%-20s %-10s %10.3f\n", key->first.c_str(), key->second.c_str(),
                    v * 1e3);
      s += line;
    }
    return s;
  }

  /// Runs f() and adds its wall time, under (op, axes), to every timer active on this thread, unless this
  /// thread is already inside a timed call (nested calls count once).
  template <class F>
  static decltype(auto) time(std::string_view op, std::string_view axes, F&& f) {
    if (!any_active() || inside()) {
      return f();
    }
    struct Timed {
      std::string_view op, axes;
      std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
      Timed(std::string_view o, std::string_view a) : op(o), axes(a) { inside() = true; }
      ~Timed() {
        inside() = false;
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        for (CommWaitTimer* t = innermost(); t != nullptr; t = t->enclosing()) {
          t->by_op_[{std::string(op), std::string(axes)}] += s;
        }
      }
    } timed(op, axes);
    return f();
  }

private:
  static bool& inside() noexcept {
    thread_local bool in = false;
    return in;
  }

  std::map<std::pair<std::string, std::string>, double> by_op_;
};

namespace detail {

/// A completion whose wait() is timed, under its op's name and group label, on the waiting thread
/// (ProcessGroup hands it out while a CommWaitTimer is active on the submitting thread).
class TimedWork final : public WorkImpl {
public:
  TimedWork(std::shared_ptr<WorkImpl> inner, std::string_view op, std::string_view axes)
      : inner_(std::move(inner)), op_(op), axes_(axes) {}
  bool is_completed() override { return inner_->is_completed(); }
  void wait() override {
    CommWaitTimer::time(op_, axes_, [&] { inner_->wait(); });
  }

private:
  std::shared_ptr<WorkImpl> inner_;
  std::string op_, axes_;
};

} // namespace detail

} // namespace dtensor

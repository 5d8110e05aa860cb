#pragma once
// The flight recorder of one group: its last kCapacity ops (op, sizes, state, timings) in a ring, so an
// error about a hang or a failed peer can say what this rank did last (torch's flight recorder).
//
//   auto id = recorder.submitted("all_reduce", 16, DType::float32, -1, 0);   // when the op is submitted
//   recorder.started(id);                                                   // when its transfers begin
//   recorder.finished(id, ok);                                              // when it completed / failed
//   std::string s = recorder.dump();   // "#7 all_reduce (16 x float32, op sum) completed in 0.081 ms; ..."
//
// A backend records its ops (gloo: every collective and point-to-point batch; NCCL: what it enqueues) and
// appends dump() to its timeout and peer-failure messages. Thread-safe; each call costs a short critical
// section and one clock read.

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/reduce_op.hpp"

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>

namespace dtensor {

class FlightRecorder {
public:
  using Clock = std::chrono::steady_clock;
  /// How many of the last ops are kept.
  static constexpr std::size_t kCapacity = 32;

  enum class State : std::uint8_t { submitted, started, completed, failed };

  /// Records a new op (`op` must outlive the recorder: a string literal); returns its id (0, 1, ...).
  /// `running`: it starts now (an op run on the submitting thread), no started() call needed.
  /// `at`: the current time when the caller has it (saves a clock read).
  std::uint64_t submitted(const char* op, std::int64_t count, DType dtype, int root = -1, int reduce = -1,
                          bool running = false, std::optional<Clock::time_point> at = std::nullopt) {
    const auto now = at ? *at : Clock::now();
    std::lock_guard lock(m_);
    const std::uint64_t id = next_++;
    entries_[id % kCapacity] =
        Entry{id, op, count, dtype, root, reduce, running ? State::started : State::submitted, now, now, now};
    return id;
  }

  void started(std::uint64_t id) { set(id, State::started); }
  void finished(std::uint64_t id, bool ok) { set(id, ok ? State::completed : State::failed); }

  /// The last `last` ops, oldest first: "#<id> <op> (<count> x <dtype>[, op <reduce>][, root <r>]) <state>"
  /// with the time it spent queued and running, or how long ago it started for one still running.
  std::string dump(std::size_t last = 8) const {
    const auto now = Clock::now();
    std::lock_guard lock(m_);
    std::string s;
    const std::uint64_t n = next_ < last ? next_ : last;
    for (std::uint64_t id = next_ - n; id < next_; ++id) {
      const Entry& e = entries_[id % kCapacity];
      s += (s.empty() ? "" : "; ") + std::string("#") + std::to_string(e.id) + " " + e.op + " (" +
           std::to_string(e.count) + " x " + std::string(dtype_name(e.dtype));
      if (e.reduce >= 0) {
        s += ", op " + std::string(to_string(static_cast<ReduceOp>(e.reduce)));
      }
      if (e.root >= 0) {
        s += ", root " + std::to_string(e.root);
      }
      s += ") ";
      switch (e.state) {
      case State::submitted:
        s += "queued for " + ms(now - e.submit);
        break;
      case State::started:
        s += "running for " + ms(now - e.start) + " (queued " + ms(e.start - e.submit) + ")";
        break;
      case State::completed:
        s += "completed in " + ms(e.end - e.start);
        break;
      case State::failed:
        s += "failed after " + ms(e.end - e.start);
        break;
      }
    }
    return s.empty() ? "no ops yet" : s;
  }

  /// How many ops were recorded.
  std::uint64_t count() const {
    std::lock_guard lock(m_);
    return next_;
  }

private:
  struct Entry {
    std::uint64_t id = 0;
    const char* op = "";
    std::int64_t count = 0;
    DType dtype = DType::float32;
    int root = -1;
    int reduce = -1;
    State state = State::submitted;
    Clock::time_point submit, start, end;
  };

  void set(std::uint64_t id, State state) {
    const auto now = Clock::now();
    std::lock_guard lock(m_);
    Entry& e = entries_[id % kCapacity];
    if (e.id != id) { // overwritten by a later op
      return;
    }
    e.state = state;
    (state == State::started ? e.start : e.end) = now;
  }

  static std::string ms(Clock::duration d) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f ms", std::chrono::duration<double, std::milli>(d).count());
    return buf;
  }

  mutable std::mutex m_;
  std::uint64_t next_ = 0;
  std::array<Entry, kCapacity> entries_{};
};

} // namespace dtensor

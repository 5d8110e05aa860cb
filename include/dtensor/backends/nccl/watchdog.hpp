#pragma once
// The NCCL backend's watchdog and the wait for an op, written without CUDA or NCCL (like comm_guard.hpp) so
// that their policy runs, and is tested, on any machine (tests/backends/test_nccl_watchdog.cpp, with fake
// communicators and ops; backends/nccl/work.hpp plugs in ncclCommGetAsyncError, ncclCommAbort and CUDA
// events):
//
//  - One thread polls every watched communicator (CommGuard::check_call for a call stuck past its deadline,
//    CommGuard::try_status for an asynchronous error) and every pending op (OpProbe::query: its CUDA event),
//    and fails the communicator -- which aborts it -- when an op runs past its deadline or an error shows.
//    An op counts as completed only when its completion is seen while its communicator has not failed (an
//    abort completes the ops it kills too); the flight recorder then marks it completed, else failed.
//  - The thread holds communicators only through their guards (weak_ptr<CommGuard>), never their owners, so
//    no communicator is ever finalized or destroyed on it: the owner does that on its own thread, after
//    CommGuard::close(), which also keeps the watchdog off an engine that is going away.
//  - `on_thread_start` runs on the thread before its first poll (the NCCL watchdog sets its thread's CUDA
//    stream-capture mode to thread-local there, so its event queries cannot invalidate a CUDA graph another
//    thread captures in global mode).
//  - wait_for_op blocks until an op finished or its communicator failed, and rethrows the failure: once a
//    communicator failed, waiting on any of its ops raises (also on one that finished before; PyTorch does
//    the same), so a partly written result never passes as a success.

#include "dtensor/backends/flight_recorder.hpp"
#include "dtensor/backends/nccl/comm_guard.hpp"
#include "dtensor/backends/stuck_op_board.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace dtensor::detail {

/// Completion of one submitted op (NCCL: the CUDA event recorded after it).
class OpProbe {
public:
  enum class State { pending, done, failed };
  virtual ~OpProbe() = default;
  /// Non-blocking. On State::failed, `why` says what went wrong.
  virtual State query(std::string& why) = 0;
};

/// What the watchdog keeps about an op besides its name: its entry in the group's flight recorder (marked
/// completed or failed when the watchdog sees the op end), and the group's op board, through which a timed
/// out op says what each member was running (backends/stuck_op_board.hpp).
struct OpTrace {
  std::shared_ptr<FlightRecorder> recorder; ///< null: not recorded
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

/// Blocks until `done` reports the op finished, failing the communicator when the op reports an error or
/// is still running a second after `deadline` (the watchdog normally comes first); rethrows the
/// communicator's failure, before, during and after the wait (see the top of this file).
inline void wait_for_op(CommGuard& comm, OpProbe& done, CommClock::time_point deadline,
                        std::string_view what) {
  comm.rethrow_if_failed();
  PollBackoff backoff;
  for (;;) {
    std::string why;
    const OpProbe::State q = done.query(why);
    if (q == OpProbe::State::done) {
      break;
    }
    if (q == OpProbe::State::failed) {
      comm.fail(comm.name() + ": " + std::string(what) + ": " + why, false);
    }
    comm.rethrow_if_failed();
    if (CommClock::now() > deadline + std::chrono::seconds(1)) {
      comm.fail(comm.name() + ": " + std::string(what) +
                    " did not complete within its timeout; the communicator was aborted",
                true);
      comm.rethrow_if_failed();
    }
    backoff.wait();
  }
  comm.rethrow_if_failed(); // an abort ends the ops it kills too: done counts only while healthy
}

/// See the top of this file. The NCCL backend uses one per process (nccl_watchdog() in work.hpp); tests
/// make their own.
class CommWatchdog {
public:
  explicit CommWatchdog(std::chrono::milliseconds period, std::function<void()> on_thread_start = {})
      : period_(period), on_thread_start_(std::move(on_thread_start)) {}
  CommWatchdog(const CommWatchdog&) = delete;
  CommWatchdog& operator=(const CommWatchdog&) = delete;
  ~CommWatchdog() { stop(); }

  /// Polls `comm` (stuck calls, asynchronous errors) while it lives.
  void watch(const std::shared_ptr<CommGuard>& comm) {
    std::lock_guard lock(m_);
    comms_.push_back(comm);
    start_locked();
  }

  /// Watches one op of `comm` until `done` reports it finished or its communicator failed; past `deadline`
  /// fails the communicator with a TimeoutError naming `what` and `trace.report()`.
  void watch_op(const std::shared_ptr<CommGuard>& comm, std::shared_ptr<OpProbe> done,
                CommClock::time_point deadline, std::string what, OpTrace trace = {}) {
    std::lock_guard lock(m_);
    ops_.push_back(Op{comm, std::move(done), deadline, std::move(what), std::move(trace)});
    start_locked();
  }

  /// Ends the thread (at exit; later watches are ignored).
  void stop() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    }
  }

  /// The polling thread's id (default-constructed before the first watch).
  std::thread::id thread_id() const {
    std::lock_guard lock(m_);
    return thread_.get_id();
  }

private:
  struct Op {
    std::weak_ptr<CommGuard> comm;
    std::shared_ptr<OpProbe> done;
    CommClock::time_point deadline;
    std::string what;
    OpTrace trace;
  };

  void start_locked() {
    if (!thread_.joinable() && !stop_) {
      thread_ = std::thread([this] { loop(); });
    }
  }

  void loop() {
    if (on_thread_start_) {
      on_thread_start_();
    }
    std::unique_lock lock(m_);
    while (!stop_) {
      cv_.wait_for(lock, period_, [&] { return stop_; });
      if (stop_) {
        break;
      }
      std::vector<std::shared_ptr<CommGuard>> comms;
      std::erase_if(comms_, [](const auto& w) { return w.expired(); });
      for (const auto& w : comms_) {
        if (auto c = w.lock()) {
          comms.push_back(std::move(c));
        }
      }
      std::vector<Op> ops;
      ops.swap(ops_);
      lock.unlock();
      poll(comms, ops);
      comms.clear(); // guards only: releasing the last reference destroys no communicator
      lock.lock();
      ops_.insert(ops_.end(), std::make_move_iterator(ops.begin()), std::make_move_iterator(ops.end()));
    }
  }

  /// One round; `ops` keeps the ops still pending.
  static void poll(const std::vector<std::shared_ptr<CommGuard>>& comms, std::vector<Op>& ops) {
    const auto now = CommClock::now();
    for (const auto& c : comms) {
      if (c->failed() || c->check_call(now)) {
        continue;
      }
      const std::optional<CommStatus> s = c->try_status();
      if (s && s->progress == CommStatus::Progress::failed) {
        c->fail(c->name() + ": NCCL reported an asynchronous error: " + s->error +
                    " (a peer failed or the network broke); the communicator was aborted",
                false);
      }
    }
    std::vector<Op> keep;
    for (auto& op : ops) {
      const std::shared_ptr<CommGuard> c = op.comm.lock();
      if (c && c->failed()) {
        op.trace.finished(false);
        continue;
      }
      std::string why;
      const OpProbe::State q = op.done->query(why);
      if (q == OpProbe::State::done) {
        op.trace.finished(c == nullptr || !c->failed()); // an abort right before the query ended it
        continue;
      }
      if (c == nullptr) { // its communicator is gone (aborted or drained) and the op did not finish
        op.trace.finished(false);
        continue;
      }
      if (q == OpProbe::State::failed) {
        op.trace.finished(false);
        c->fail(c->name() + ": " + op.what + ": error while waiting: " + why, false);
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
    ops.swap(keep);
  }

  const std::chrono::milliseconds period_;
  const std::function<void()> on_thread_start_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<CommGuard>> comms_;
  std::vector<Op> ops_;
  bool stop_ = false;
  std::thread thread_;
};

} // namespace dtensor::detail

// The NCCL backend's host-side policy without a GPU (backends/nccl/comm_guard.hpp, watchdog.hpp): the same
// CommGuard and CommWatchdog the backend runs, driven by a fake communicator engine (its status scripted,
// its calls blocking until released, like a blocking NCCL call stuck in connection set-up) and fake ops.
//
//  - a call that never completes is a TimeoutError at its deadline, and the communicator is aborted once;
//  - an abort never runs while a call is in flight: it waits for the call, which performs it and throws;
//  - the watchdog fails a communicator whose op passes its deadline, whose call is stuck past its deadline,
//    or that reports an asynchronous error; every wait on its ops and every later call then raise;
//  - the watchdog never destroys a communicator and never calls an engine that was closed;
//  - its thread-start hook (CUDA's thread-local capture mode on the NCCL watchdog) runs before any poll.

#include <catch2/catch.hpp>

#include "dtensor/backends/flight_recorder.hpp"
#include "dtensor/backends/nccl/comm_guard.hpp"
#include "dtensor/backends/nccl/watchdog.hpp"
#include "dtensor/core/error.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using Catch::Contains;
using dtensor::Error;
using dtensor::FlightRecorder;
using dtensor::TimeoutError;
using dtensor::detail::CommClock;
using dtensor::detail::CommEngine;
using dtensor::detail::CommGuard;
using dtensor::detail::CommStatus;
using dtensor::detail::CommWatchdog;
using dtensor::detail::OpProbe;
using dtensor::detail::OpTrace;
using dtensor::detail::wait_for_op;
using namespace std::chrono_literals;

namespace {

/// An op's trace in `recorder`: its flight-recorder entry only.
OpTrace traced(const std::shared_ptr<FlightRecorder>& recorder, const char* op, std::int64_t count,
               dtensor::DType dtype, int root, int reduce) {
  OpTrace t;
  t.recorder = recorder;
  t.id = recorder->submitted(op, count, dtype, root, reduce, /*running=*/true);
  return t;
}

/// Set on a thread by the watchdog's thread-start hook (stands for CUDA's per-thread capture mode).
thread_local bool capture_mode_set = false;

/// A fake communicator: status() returns the scripted progress; calls made through the test's own lambdas
/// count themselves in `in_call`, so abort() can tell whether it ran under one.
struct FakeEngine final : CommEngine {
  std::atomic<CommStatus::Progress> progress{CommStatus::Progress::done};
  std::string error = "ncclRemoteError: remote process exited or there was a network error";
  std::atomic<int> in_call{0};
  std::atomic<int> aborts{0};
  std::atomic<int> status_calls{0};
  std::atomic<bool> abort_under_call{false};
  std::atomic<bool> overlapping_calls{false};
  std::atomic<bool> status_without_capture_mode{false};
  std::atomic<bool> closed{false};
  std::atomic<bool> used_after_close{false};
  std::atomic<std::thread::id> abort_thread{};
  std::chrono::microseconds status_time{0};

  /// What a call does inside the library: marks itself in flight for `d`.
  void inside(std::chrono::microseconds d = 0us) {
    if (in_call.fetch_add(1) != 0) {
      overlapping_calls = true;
    }
    if (d.count() > 0) {
      std::this_thread::sleep_for(d);
    }
    in_call.fetch_sub(1);
  }

  CommStatus status() override {
    ++status_calls;
    used_after_close = used_after_close || closed.load();
    if (!capture_mode_set) {
      status_without_capture_mode = true;
    }
    inside(status_time);
    const auto p = progress.load();
    return p == CommStatus::Progress::failed ? CommStatus::failed(error) : CommStatus{p, {}};
  }

  void abort() noexcept override {
    used_after_close = used_after_close || closed.load();
    if (in_call.load() != 0) {
      abort_under_call = true;
    }
    abort_thread = std::this_thread::get_id();
    ++aborts;
  }
};

/// A fake op: pending until done() or failed(); query() may run a hook first (an abort that completes it).
struct FakeOp final : OpProbe {
  std::atomic<State> state{State::pending};
  std::function<void()> before_query;
  std::atomic<bool> queried_without_capture_mode{false};
  std::atomic<int> queries{0};

  State query(std::string& why) override {
    ++queries;
    if (!capture_mode_set) {
      queried_without_capture_mode = true;
    }
    if (before_query) {
      before_query();
    }
    const State s = state.load();
    if (s == State::failed) {
      why = "CUDA error: cudaErrorLaunchFailure: unspecified launch failure";
    }
    return s;
  }
};

/// A call stuck inside the library until released (a blocking NCCL call waiting for a missing peer).
struct StuckCall {
  std::atomic<bool> inside{false};
  std::atomic<bool> release{false};

  int operator()(FakeEngine& e) {
    e.in_call.fetch_add(1);
    inside = true;
    while (!release.load()) {
      std::this_thread::sleep_for(1ms);
    }
    e.in_call.fetch_sub(1);
    return 0;
  }
  void wait_inside() const {
    while (!inside.load()) {
      std::this_thread::sleep_for(1ms);
    }
  }
};

template <class Pred>
bool eventually(Pred&& pred, std::chrono::milliseconds limit = 5s) {
  const auto until = CommClock::now() + limit;
  while (!pred()) {
    if (CommClock::now() > until) {
      return false;
    }
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

/// The message of the exception `f` throws, with its type checked.
template <class Exception, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  }
  FAIL("no " << (std::is_same_v<Exception, TimeoutError> ? "TimeoutError" : "Error") << " was thrown");
  return {};
}

std::string error_text(const CommGuard& g) {
  return message_of<Error>([&] { g.rethrow_if_failed(); });
}

constexpr auto far = CommClock::time_point::max();

} // namespace

TEST_CASE("a nonblocking call that never completes fails with a TimeoutError at its deadline",
          "[nccl][guard]") {
  FakeEngine e;
  e.progress = CommStatus::Progress::in_progress; // a member never arrives: NCCL stays in ncclInProgress
  CommGuard g("nccl group [0,1] (rank 0)", e);
  const auto t0 = CommClock::now();
  const std::string msg = message_of<TimeoutError>(
      [&] { g.wait_ready(CommStatus::in_progress(), t0 + 150ms, "ncclCommInitRankConfig (rank 0 of 2)"); });
  const auto took = CommClock::now() - t0;
  CHECK(took >= 150ms);
  CHECK(took < 3s);
  CHECK_THAT(msg, Contains("nccl group [0,1] (rank 0): ncclCommInitRankConfig (rank 0 of 2) did not complete "
                           "before its timeout") &&
                      Contains("aborted"));
  CHECK(e.aborts == 1);
  CHECK(g.aborted());
  CHECK(e.status_calls > 0);
  // The next call, and a wait on any op, raise the same TimeoutError without touching the engine again.
  const int polls = e.status_calls;
  CHECK_THAT(message_of<TimeoutError>([&] { g.call("all_reduce", far, [] { return 0; }); }),
             Contains("ncclCommInitRankConfig"));
  FakeOp done;
  done.state = OpProbe::State::done;
  CHECK_THROWS_AS(wait_for_op(g, done, far, "all_reduce"), TimeoutError);
  CHECK(e.status_calls == polls);
  CHECK(e.aborts == 1);
}

TEST_CASE("an error NCCL reports while a call is polled fails the communicator with that error",
          "[nccl][guard]") {
  FakeEngine e;
  e.progress = CommStatus::Progress::failed;
  CommGuard g("g", e);
  const std::string msg = message_of<Error>(
      [&] { g.wait_ready(CommStatus::in_progress(), CommClock::now() + 10s, "ncclCommSplit"); });
  CHECK_THAT(msg, Contains("g: ncclCommSplit failed: ncclRemoteError"));
  CHECK_THROWS_AS(g.rethrow_if_failed(), Error);
  bool is_timeout = false;
  try {
    g.rethrow_if_failed();
  } catch (const TimeoutError&) {
    is_timeout = true;
  } catch (const Error&) {
  }
  CHECK(!is_timeout);
  CHECK(e.aborts == 1);
  // A later, different failure is appended; the first decides the type.
  g.fail("g: aborted: by the user", true);
  CHECK_THAT(error_text(g), Contains("ncclRemoteError") && Contains("; then: g: aborted: by the user"));
  CHECK(e.aborts == 1);
}

TEST_CASE("a failure during a call leaves the abort to the calling thread, which then throws",
          "[nccl][guard]") {
  FakeEngine e;
  CommGuard g("g", e);
  StuckCall stuck;
  std::string outcome;
  std::thread::id caller_id;
  std::thread caller([&] {
    caller_id = std::this_thread::get_id();
    try {
      g.call("all_reduce", far, [&] { return stuck(e); });
      outcome = "returned";
    } catch (const TimeoutError& ex) {
      outcome = std::string("TimeoutError: ") + ex.what();
    } catch (const std::exception& ex) {
      outcome = std::string("other: ") + ex.what();
    }
  });
  stuck.wait_inside();
  const auto t0 = CommClock::now();
  g.fail("g: all_reduce did not complete within its timeout", true);
  CHECK(CommClock::now() - t0 < 500ms); // the failing thread does not wait for the call
  CHECK(g.failed());
  CHECK(e.aborts == 0); // never under the call
  CHECK(!g.aborted());
  // Another thread's call gives up at once with the failure instead of queueing behind the stuck one.
  const auto t1 = CommClock::now();
  CHECK_THROWS_AS(g.call("broadcast", far, [] { return 0; }), TimeoutError);
  CHECK(CommClock::now() - t1 < 500ms);
  CHECK(!g.try_status());
  std::this_thread::sleep_for(20ms);
  CHECK(e.aborts == 0);
  stuck.release = true;
  caller.join();
  CHECK_THAT(outcome, Contains("TimeoutError: g: all_reduce did not complete within its timeout"));
  CHECK(e.aborts == 1);
  CHECK(e.abort_thread.load() == caller_id);
  CHECK(!e.abort_under_call);
  CHECK(g.aborted());
}

TEST_CASE("a submission waiting behind a stuck one gives up with the failure", "[nccl][guard]") {
  FakeEngine e;
  CommGuard g("g", e);
  StuckCall stuck;
  std::thread first([&] {
    const auto order = g.lock_order(); // a whole submission: its enqueue is stuck in NCCL
    try {
      g.call("all_reduce", far, [&] { return stuck(e); });
    } catch (const Error&) {
    }
  });
  stuck.wait_inside();
  std::atomic<bool> gave_up{false};
  std::thread second([&] {
    try {
      const auto order = g.lock_order();
    } catch (const TimeoutError&) {
      gave_up = true;
    }
  });
  std::this_thread::sleep_for(30ms);
  CHECK(!gave_up); // waits its turn while the communicator is healthy
  g.fail("g: all_reduce is still inside NCCL after its timeout", true);
  CHECK(eventually([&] { return gave_up.load(); }, 2s));
  second.join();
  stuck.release = true;
  first.join();
  CHECK(e.aborts == 1);
}

TEST_CASE("the watchdog fails a blocking call stuck past its deadline and aborts when it returns",
          "[nccl][watchdog]") {
  FakeEngine e;
  auto g = std::make_shared<CommGuard>("nccl world of 2 (rank 0)", e);
  CommWatchdog watchdog(5ms);
  watchdog.watch(g);
  StuckCall stuck;
  std::optional<std::string> caller_error;
  std::thread::id caller_id;
  std::thread caller([&] {
    caller_id = std::this_thread::get_id();
    try {
      g->call("all_reduce", CommClock::now() + 100ms, [&] { return stuck(e); });
    } catch (const TimeoutError& ex) {
      caller_error = ex.what();
    }
  });
  stuck.wait_inside();
  REQUIRE(eventually([&] { return g->failed(); }));
  CHECK_THAT(message_of<TimeoutError>([&] { g->rethrow_if_failed(); }),
             Contains("nccl world of 2 (rank 0): all_reduce is still inside NCCL after its timeout"));
  std::this_thread::sleep_for(30ms); // several watchdog rounds: still no abort under the call
  CHECK(e.aborts == 0);
  stuck.release = true;
  caller.join();
  REQUIRE(caller_error);
  CHECK_THAT(*caller_error, Contains("all_reduce is still inside NCCL"));
  CHECK(e.aborts == 1);
  CHECK(e.abort_thread.load() == caller_id);
  CHECK(!e.abort_under_call);
}

TEST_CASE("an op past its deadline makes the watchdog abort its communicator, and every wait then raises",
          "[nccl][watchdog]") {
  FakeEngine e;
  auto g = std::make_shared<CommGuard>("g", e);
  auto recorder = std::make_shared<FlightRecorder>();
  CommWatchdog watchdog(5ms);
  watchdog.watch(g);
  auto finished = std::make_shared<FakeOp>();
  auto stuck = std::make_shared<FakeOp>();
  OpTrace t1 = traced(recorder, "all_reduce", 16, dtensor::DType::float32, -1, 0);
  OpTrace t2 = traced(recorder, "broadcast", 4, dtensor::DType::int32, 1, -1);
  const auto now = CommClock::now();
  watchdog.watch_op(g, finished, now + 60s, "all_reduce", t1);
  watchdog.watch_op(g, stuck, now + 100ms, "broadcast", t2);
  finished->state = OpProbe::State::done;
  // The group fails first (so waits give up at once), then the watchdog's thread aborts the engine: wait
  // for the abort's end, not for the failure, before counting aborts.
  REQUIRE(eventually([&] { return g->aborted(); }));
  CHECK(g->failed());
  const std::string msg = message_of<TimeoutError>([&] { g->rethrow_if_failed(); });
  CHECK_THAT(msg, Contains("g: broadcast did not complete within its timeout") &&
                      Contains("flight recorder, this rank's last ops on the group") &&
                      Contains("#1 broadcast (4 x int32, root 1) failed"));
  CHECK_THAT(recorder->dump(), Contains("#0 all_reduce (16 x float32, op sum) completed"));
  CHECK(e.aborts == 1);
  CHECK(e.abort_thread.load() == watchdog.thread_id());
  // Waiting on either op raises the TimeoutError, also on the one that completed before the abort (a
  // communicator that failed may have written part of any result: PyTorch raises there too).
  CHECK_THROWS_AS(wait_for_op(*g, *finished, far, "all_reduce"), TimeoutError);
  CHECK_THROWS_AS(wait_for_op(*g, *stuck, far, "broadcast"), TimeoutError);
  // So does the group's next op, before it reaches the engine.
  CHECK_THROWS_AS(g->call("all_gather", far, [] { return 0; }), TimeoutError);
  CHECK(e.aborts == 1);
}

TEST_CASE("an op that ends only because its communicator was aborted never counts as completed",
          "[nccl][watchdog]") {
  FakeEngine e;
  auto g = std::make_shared<CommGuard>("g", e);
  auto recorder = std::make_shared<FlightRecorder>();
  CommWatchdog watchdog(5ms);
  auto op = std::make_shared<FakeOp>();
  // Between the watchdog's failure check and its event query, another thread aborts the communicator,
  // which also completes the op's event.
  op->before_query = [&] {
    if (op->queries == 2) {
      g->fail("g: aborted: by the user", false);
      op->state = OpProbe::State::done;
    }
  };
  watchdog.watch_op(g, op, CommClock::now() + 60s, "reduce_scatter",
                    traced(recorder, "reduce_scatter", 8, dtensor::DType::float32, -1, 0));
  REQUIRE(eventually([&] { return recorder->dump().find("failed") != std::string::npos; }));
  CHECK_THAT(recorder->dump(), !Contains("completed"));
  // The host wait sees the same: the event is done, but the communicator failed.
  CHECK_THROWS_AS(wait_for_op(*g, *op, far, "reduce_scatter"), Error);
}

TEST_CASE("an asynchronous error reported by NCCL fails the communicator and its pending ops",
          "[nccl][watchdog]") {
  FakeEngine e;
  auto g = std::make_shared<CommGuard>("g", e);
  CommWatchdog watchdog(5ms);
  watchdog.watch(g);
  auto op = std::make_shared<FakeOp>();
  watchdog.watch_op(g, op, CommClock::now() + 60s, "send");
  std::this_thread::sleep_for(20ms);
  CHECK(!g->failed());
  e.progress = CommStatus::Progress::failed; // a peer died
  REQUIRE(eventually([&] { return g->failed(); }));
  const std::string msg = error_text(*g);
  CHECK_THAT(msg, Contains("g: NCCL reported an asynchronous error: ncclRemoteError"));
  // The watchdog records the failure, then aborts (CommGuard::fail): failed() may be seen in between.
  CHECK(eventually([&] { return e.aborts == 1; }));
  CHECK_THROWS_AS(wait_for_op(*g, *op, far, "send"), Error);
  // An op whose event reports a CUDA error fails its communicator the same way.
  FakeEngine e2;
  auto g2 = std::make_shared<CommGuard>("g2", e2);
  auto bad = std::make_shared<FakeOp>();
  bad->state = OpProbe::State::failed;
  watchdog.watch_op(g2, bad, CommClock::now() + 60s, "all_to_all");
  REQUIRE(eventually([&] { return g2->failed(); }));
  CHECK_THAT(error_text(*g2),
             Contains("g2: all_to_all: error while waiting: CUDA error: cudaErrorLaunchFailure"));
  CHECK(eventually([&] { return e2.aborts == 1; }));
}

TEST_CASE("a host wait past the deadline fails the communicator itself when no watchdog does",
          "[nccl][guard]") {
  FakeEngine e;
  CommGuard g("g", e);
  FakeOp pending;
  const std::string msg =
      message_of<TimeoutError>([&] { wait_for_op(g, pending, CommClock::now() - 2s, "barrier"); });
  CHECK_THAT(msg, Contains("g: barrier did not complete within its timeout"));
  CHECK(e.aborts == 1);
}

TEST_CASE("the watchdog never destroys a communicator and never calls an engine that was closed",
          "[nccl][watchdog]") {
  /// A communicator's owner: destroys (closes) its engine when the last reference goes, like NcclCommState.
  struct Owner {
    FakeEngine engine;
    std::shared_ptr<CommGuard> guard = std::make_shared<CommGuard>("owned", engine);
    std::atomic<std::thread::id>* destroyed_on;
    explicit Owner(std::atomic<std::thread::id>* d) : destroyed_on(d) { engine.status_time = 200us; }
    ~Owner() {
      (void)guard->close(); // waits for the watchdog's poll in flight; none after it
      engine.closed = true;
      *destroyed_on = std::this_thread::get_id();
    }
  };
  CommWatchdog watchdog(1ms);
  std::mt19937 rng(7);
  std::vector<std::shared_ptr<CommGuard>> guards;
  for (int i = 0; i < 40; ++i) {
    std::atomic<std::thread::id> destroyed_on{};
    auto owner = std::make_shared<Owner>(&destroyed_on);
    watchdog.watch(owner->guard);
    watchdog.watch_op(owner->guard, std::make_shared<FakeOp>(), CommClock::now() + 60s, "all_reduce");
    guards.push_back(owner->guard); // outlives the owner, like a guard in the watchdog's hands
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
    owner.reset();
    CHECK(destroyed_on.load() == std::this_thread::get_id());
  }
  // Every guard is closed: polls and failures no longer reach an engine (which is gone).
  std::this_thread::sleep_for(20ms);
  for (const auto& g : guards) {
    CHECK(!g->try_status());
    g->fail("owned: late failure", true); // recorded, aborts nothing
    CHECK(g->failed());
    CHECK(!g->aborted());
    CHECK_THROWS_AS(g->call("all_reduce", far, [] { return 0; }), Error);
  }
}

TEST_CASE("the watchdog's thread-start hook runs before its first poll", "[nccl][watchdog]") {
  std::atomic<std::thread::id> hook_thread{};
  CommWatchdog watchdog(2ms, [&] {
    std::this_thread::sleep_for(20ms); // a slow hook must still come first
    capture_mode_set = true;
    hook_thread = std::this_thread::get_id();
  });
  FakeEngine e;
  auto g = std::make_shared<CommGuard>("g", e);
  watchdog.watch(g);
  auto op = std::make_shared<FakeOp>();
  watchdog.watch_op(g, op, CommClock::now() + 60s, "all_reduce");
  REQUIRE(eventually([&] { return op->queries > 3 && e.status_calls > 3; }));
  CHECK(hook_thread.load() == watchdog.thread_id());
  CHECK(!op->queried_without_capture_mode);
  CHECK(!e.status_without_capture_mode);
}

TEST_CASE("calls, polls and failures from many threads never abort under a call and abort once",
          "[nccl][guard]") {
  for (int round = 0; round < 20; ++round) {
    FakeEngine e;
    e.status_time = 50us;
    auto g = std::make_shared<CommGuard>("g", e);
    CommWatchdog watchdog(1ms);
    watchdog.watch(g);
    std::atomic<int> raised{0};
    std::vector<std::thread> callers;
    for (int t = 0; t < 3; ++t) {
      callers.emplace_back([&, t] {
        std::mt19937 rng(static_cast<unsigned>(round * 10 + t));
        try {
          for (;;) {
            g->call("op", far, [&] {
              e.inside(std::chrono::microseconds(rng() % 200));
              return 0;
            });
          }
        } catch (const Error&) {
          ++raised;
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2 + round % 5));
    std::thread failer([&] { g->fail("g: failed from another thread", round % 2 == 0); });
    g->fail("g: failed from this thread", false);
    failer.join();
    for (auto& c : callers) {
      c.join();
    }
    // The call in flight when the failures came may have been the watchdog's status poll: its thread then
    // performs the abort when the poll returns (fail() never waits for another thread's call), possibly
    // after the callers are gone. Join it before counting aborts.
    watchdog.stop();
    CHECK(raised == 3);
    CHECK(e.aborts == 1);
    CHECK(!e.abort_under_call);
    CHECK(!e.overlapping_calls);
  }
}

#pragma once
// Completion of one op of the MPI backend (the counterpart of backends/gloo/work.hpp and
// backends/nccl/work.hpp's NcclWork): the MPI requests of one submitted op, the memory they use, and what
// runs once they completed.
//
//   auto work = std::make_shared<MpiWork>(group, info, deadline);
//   MPI_Iallreduce(..., &work->request());                // post, under MpiRuntime::lock()
//   work->then([=] { divide_in_place(...); });             // avg's last step, once, after completion
//   work->wait();                                          // tests until done, or fails at the deadline
//
// Contract:
//  - wait() tests the requests (MpiRuntime: each test is a step of MPI's progress) until they all
//    completed, then runs the `then` step once, on the first thread that sees the completion, and
//    returns; or, at the deadline, asks the group for the error (MpiOpOwner::timed_out: a TimeoutError
//    naming the op and what every member ran; the group is aborted) and throws it, as every later wait()
//    does. An MPI error code throws Error with MPI's text. is_completed() tests once and never blocks.
//  - Receives are checked: a message shorter than its buffer (a peer sent fewer elements) is an Error
//    naming both counts, not silently short data.
//  - After a timeout, point-to-point transfers are cancelled, so nothing uses their buffers later. A
//    collective cannot be cancelled in MPI: its requests and scratch memory are left to MPI (never freed),
//    and the caller's buffers stay MPI's until the job ends (the group is aborted; end the job, as after
//    an NCCL timeout).
//  - abort() of the group fails every wait() at once (released(): the reason), without cancelling
//    anything either.

#include "dtensor/backends/work.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/detail/mpi.hpp"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace dtensor::detail {

/// What an op is, for messages and the flight recorder.
struct MpiOpInfo {
  const char* name = "";
  std::uint32_t seq = 0;
  std::int64_t count = 0;
  DType dtype = DType::float32;
  int root = -1; ///< root, or the peer of a single send / recv
  int reduce = -1;
  std::uint64_t flight = 0; ///< its id in the group's FlightRecorder
  MpiClock::time_point start{};
};

/// The group side of an op's completion (MpiBackendImpl).
class MpiOpOwner {
public:
  virtual ~MpiOpOwner() = default;
  /// The error of op `info`, which did not complete by its deadline (the group aborts itself).
  virtual std::exception_ptr timed_out(const MpiOpInfo& info) = 0;
  /// The error of op `info`, which failed with `what`.
  virtual std::exception_ptr failed(const MpiOpInfo& info, const std::string& what) = 0;
  /// The reason the group was aborted, if it was (pending waits then fail at once).
  virtual std::optional<std::string> released() const = 0;
  /// Records the op's end in the flight recorder.
  virtual void finished(const MpiOpInfo& info, bool ok) = 0;
};

/// One expected receive: request `index` must bring `count` elements of `type` (else an Error).
struct MpiExpectedReceive {
  std::size_t index = 0;
  int count = 0;
  MPI_Datatype type = MPI_BYTE;
  int peer = 0;
};

class MpiWork final : public WorkImpl {
public:
  MpiWork(std::shared_ptr<MpiOpOwner> owner, MpiOpInfo info, MpiClock::time_point deadline)
      : owner_(std::move(owner)), info_(info), deadline_(deadline) {}

  /// A fresh request slot to post into (call only while posting, before wait()).
  MPI_Request& request() { return requests_.emplace_back(MPI_REQUEST_NULL); }

  /// The receive posted last must bring exactly `count` elements of `type` from `peer`.
  void expect_last(int count, MPI_Datatype type, int peer) {
    expected_.push_back({requests_.size() - 1, count, type, peer});
  }

  /// Every request of this op is a point-to-point one: a timeout or abort cancels them.
  void point_to_point() { cancellable_ = true; }

  /// Memory the requests use, kept until they completed (a vector of any element type).
  template <class T>
  T& keep(T value) {
    auto p = std::make_shared<T>(std::move(value));
    T& ref = *p;
    kept_.push_back(std::move(p));
    return ref;
  }

  /// Runs once after the requests completed successfully, before wait() returns.
  void then(std::function<void()> step) { then_ = std::move(step); }

  /// Whether the op was seen completed (by a wait, a test or the progress thread); tests nothing itself.
  bool done() const { return done_.load(std::memory_order_acquire); }

  bool is_completed() override {
    if (done_.load(std::memory_order_acquire)) {
      return true;
    }
    std::unique_lock lock(m_, std::try_to_lock);
    if (!lock.owns_lock() || done_.load(std::memory_order_relaxed)) {
      return done_.load(std::memory_order_acquire);
    }
    try {
      statuses_.resize(requests_.size());
      if (mpi_test_all(requests_, statuses_, [&] { return std::string(info_.name); })) {
        complete();
      }
    } catch (...) {
      fail(std::current_exception());
    }
    return done_.load(std::memory_order_acquire);
  }

  void wait() override {
    std::lock_guard lock(m_);
    if (!done_.load(std::memory_order_relaxed)) {
      try {
        poll();
      } catch (...) {
        fail(std::current_exception());
      }
    }
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

private:
  /// Tests until done, the deadline, or the group's abort (m_ held).
  void poll() {
    statuses_.resize(requests_.size());
    const auto context = [&] { return std::string(info_.name); };
    for (int spins = 0;; ++spins) {
      if (mpi_test_all(requests_, statuses_, context)) {
        complete();
        return;
      }
      if ((spins & 63) == 63) {
        if (auto reason = owner_->released()) {
          give_up();
          throw Error("the group was aborted: " + *reason);
        }
        if (MpiClock::now() >= deadline_) {
          give_up();
          error_ = owner_->timed_out(info_);
          owner_->finished(info_, false);
          done_.store(true, std::memory_order_release);
          return;
        }
      }
      if (spins >= 16) {
        std::this_thread::yield();
      }
    }
  }

  /// All requests completed (m_ held): check the receives, run `then`, mark done.
  void complete() {
    for (const MpiExpectedReceive& e : expected_) {
      int got = 0;
      MPI_Get_count(&statuses_[e.index], e.type, &got);
      if (got != e.count) {
        throw Error("received " +
                    (got == MPI_UNDEFINED ? std::string("a partial element") : std::to_string(got)) +
                    " elements from rank " + std::to_string(e.peer) + " but expected " +
                    std::to_string(e.count) + " (the members disagree on the sizes)");
      }
    }
    if (then_) {
      auto step = std::exchange(then_, nullptr);
      step();
    }
    kept_.clear();
    owner_->finished(info_, true);
    done_.store(true, std::memory_order_release);
  }

  /// Ends the op's hold on its memory after a timeout or an abort (m_ held): point-to-point requests are
  /// cancelled; a collective's requests and kept memory are left to MPI, never freed.
  void give_up() {
    if (cancellable_) {
      mpi_cancel_p2p(requests_);
      kept_.clear();
      return;
    }
    for (auto& k : kept_) {
      new std::shared_ptr<void>(std::move(k)); // MPI may still write it: never freed
    }
    kept_.clear();
  }

  void fail(std::exception_ptr e) {
    if (done_.load(std::memory_order_relaxed)) {
      return;
    }
    std::string what;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
      what = "unknown error";
    }
    error_ = owner_->failed(info_, what);
    owner_->finished(info_, false);
    done_.store(true, std::memory_order_release);
  }

  std::shared_ptr<MpiOpOwner> owner_;
  MpiOpInfo info_;
  MpiClock::time_point deadline_;
  std::mutex m_;
  std::vector<MPI_Request> requests_;
  std::vector<MPI_Status> statuses_;
  std::vector<MpiExpectedReceive> expected_;
  std::vector<std::shared_ptr<void>> kept_;
  std::function<void()> then_;
  bool cancellable_ = false;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

/// Progress for asynchronous ops: MPI moves a non-blocking op's data only inside MPI calls, so an op
/// submitted with async_op would otherwise wait until its wait() before most of its transfer happens, and
/// compute could not overlap it. One thread per process tests the pending asynchronous ops (each test is
/// a step of MPI's progress, MpiWork::is_completed) until they completed, yielding the core between
/// rounds and sleeping 50 us between rounds once an op has been pending for 1 ms; it sleeps on a
/// condition variable while none is pending. DTENSOR_MPI_PROGRESS=0 turns it off (ops then progress in
/// wait()). Synchronous ops never go through it: their caller tests them.
class MpiProgress {
public:
  static MpiProgress& instance() {
    static MpiProgress p;
    return p;
  }

  /// Tests `work` in the background until it completed (the work is held weakly: a dropped one is
  /// forgotten).
  void watch(const std::shared_ptr<MpiWork>& work) {
    if (!enabled_) {
      return;
    }
    {
      std::lock_guard lock(m_);
      pending_.push_back(work);
      if (!thread_.joinable()) {
        thread_ = std::thread([this] { loop(); });
        hook_ = MpiRuntime::instance().add_finalize_hook([this] { stop(); });
      }
    }
    cv_.notify_one();
  }

  ~MpiProgress() {
    stop();
    if (hook_ >= 0) {
      MpiRuntime::instance().remove_finalize_hook(hook_);
    }
  }

private:
  MpiProgress() {
    const char* v = std::getenv("DTENSOR_MPI_PROGRESS");
    enabled_ = v == nullptr || std::string_view(v) != "0";
  }

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

  void loop() {
    auto busy_since = MpiClock::now();
    for (;;) {
      std::vector<std::weak_ptr<MpiWork>> round;
      {
        std::unique_lock lock(m_);
        if (pending_.empty()) {
          cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
          busy_since = MpiClock::now();
        }
        if (stop_) {
          return;
        }
        round.swap(pending_);
      }
      std::vector<std::weak_ptr<MpiWork>> left;
      for (auto& w : round) {
        if (auto work = w.lock(); work && !work->is_completed()) {
          left.push_back(std::move(w));
        }
      }
      {
        std::lock_guard lock(m_);
        pending_.insert(pending_.end(), left.begin(), left.end());
        if (pending_.empty()) {
          continue;
        }
      }
      if (MpiClock::now() - busy_since < std::chrono::milliseconds(1)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  bool enabled_ = true;
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<MpiWork>> pending_;
  std::thread thread_;
  bool stop_ = false;
  int hook_ = -1;
};

} // namespace dtensor::detail

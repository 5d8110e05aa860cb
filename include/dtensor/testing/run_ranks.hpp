#pragma once
// run_ranks: n ranks as n threads of this process, meeting through one InProcessStore, so every multi-rank
// test runs under plain ctest. The backend is gloo on 127.0.0.1 unless RunRanksOptions::make_backend
// names another (any backend that rendezvouses through a dtensor::Store).
//
//   dtensor::testing::run_ranks(4, [](dtensor::ProcessGroup& world) {
//     auto t = dtensor::Tensor<float, 1>::full({8}, float(world.rank()));
//     dtensor::all_reduce(t, dtensor::ReduceOp::sum, world);
//     DTENSOR_CHECK(t(0) == 6.0f, "rank " + std::to_string(world.rank()) + ": wrong sum");
//   });
//
// When a rank throws, its message is recorded, its groups are aborted (peers blocked on it fail within
// seconds, as if its process had died) and the store is aborted; ranks still running after `grace` are
// aborted too. run_ranks then throws one dtensor::Error naming the first failing rank and its message,
// followed by the other ranks' errors. Catch2's assertions are not thread-safe: inside `fn`, throw
// (DTENSOR_CHECK) instead of REQUIRE.
//
// Needs the gloo backend (target dtensor::gloo), the default.
//
// Compiled once: every translation unit that includes this header makes the gloo backend (its vtable and
// every inline function it reaches, about 5 s of a -O0 compile). A test suite of many TUs can compile
// run_ranks once instead: define DTENSOR_RUN_RANKS_COMPILED in every TU of the program (this header then
// declares run_ranks and includes no backend), and DTENSOR_RUN_RANKS_IMPLEMENTATION as well in the one
// .cpp that defines it (this repository's tests: tests/support/run_ranks.cpp, target dtensor_test_run_ranks).

#include "dtensor/backends/backend.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <chrono>
#include <functional>
#include <memory>

#if defined(DTENSOR_RUN_RANKS_COMPILED) && !defined(DTENSOR_RUN_RANKS_IMPLEMENTATION)
#define DTENSOR_RUN_RANKS_DECLARE_ONLY 1
#define DTENSOR_RUN_RANKS_INLINE
#elif defined(DTENSOR_RUN_RANKS_COMPILED)
#define DTENSOR_RUN_RANKS_DECLARE_ONLY 0
#define DTENSOR_RUN_RANKS_INLINE
#else
#define DTENSOR_RUN_RANKS_DECLARE_ONLY 0
#define DTENSOR_RUN_RANKS_INLINE inline
#endif

#if !DTENSOR_RUN_RANKS_DECLARE_ONLY
#if !DTENSOR_HAS_GLOO
#error "dtensor/testing/run_ranks.hpp needs the gloo backend: link the target dtensor::gloo"
#endif
#include "dtensor/backends/gloo/backend.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/in_process_store.hpp"

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#endif

namespace dtensor::testing {

/// Makes rank `rank` of a world of `size` that rendezvouses through `store`, with `timeout` as its
/// default op timeout (e.g. make_gloo_backend or make_nccl_backend).
using BackendFactory = std::function<std::shared_ptr<Backend>(std::shared_ptr<Store> store, int rank,
                                                              int size, std::chrono::milliseconds timeout)>;

struct RunRanksOptions {
  /// Default timeout of every op and of the rendezvous.
  std::chrono::milliseconds timeout = std::chrono::seconds(20);
  /// After the first failure, ranks still running this long are aborted.
  std::chrono::milliseconds grace = std::chrono::seconds(3);
  /// The backend of every rank; empty: gloo on 127.0.0.1.
  BackendFactory make_backend;
};

/// Runs fn(world) on `n` ranks (threads), world being a group over all of them (gloo unless
/// options.make_backend says otherwise). Throws dtensor::Error when any rank throws (see above).
DTENSOR_RUN_RANKS_INLINE void run_ranks(int n, const std::function<void(ProcessGroup&)>& fn,
                                        RunRanksOptions options = {})
#if DTENSOR_RUN_RANKS_DECLARE_ONLY
    ;
#else
{
  DTENSOR_CHECK(n >= 1, "run_ranks: the number of ranks must be >= 1, got " + std::to_string(n));
  if (!options.make_backend) {
    options.make_backend = [](std::shared_ptr<Store> store, int rank, int size,
                              std::chrono::milliseconds timeout) {
      GlooOptions go;
      go.timeout = timeout;
      return make_gloo_backend(std::move(store), rank, size, go);
    };
  }
  auto store = std::make_shared<InProcessStore>(options.timeout);
  std::vector<ProcessGroup> worlds(n);
  std::mutex m;
  std::condition_variable cv;
  int finished = 0;
  struct Failure {
    int rank;
    std::string message;
  };
  std::vector<Failure> failures;
  std::chrono::steady_clock::time_point first_failure;

  auto abort_rank = [&](int r, const std::string& reason) {
    std::shared_ptr<Backend> b;
    {
      std::lock_guard lock(m);
      b = worlds[r].backend_ptr();
    }
    if (b) {
      abort_gloo_rank(*b, reason);
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::string error;
      bool failed = false;
      try {
        ProcessGroup world(options.make_backend(store, r, n, options.timeout));
        {
          std::lock_guard lock(m);
          worlds[r] = world;
        }
        fn(world);
      } catch (const std::exception& e) {
        failed = true;
        error = e.what();
      } catch (...) {
        failed = true;
        error = "unknown exception";
      }
      if (failed) {
        {
          std::lock_guard lock(m);
          if (failures.empty()) {
            first_failure = std::chrono::steady_clock::now();
          }
          failures.push_back({r, error});
        }
        const std::string reason = "rank " + std::to_string(r) + " failed: " + error;
        abort_rank(r, reason);
        store->abort(reason);
      }
      {
        std::lock_guard lock(m);
        ++finished;
      }
      cv.notify_all();
    });
  }

  {
    std::unique_lock lock(m);
    bool forced = false;
    while (finished < n) {
      if (failures.empty() || forced) {
        cv.wait(lock);
        continue;
      }
      if (cv.wait_until(lock, first_failure + options.grace, [&] { return finished == n; })) {
        break;
      }
      forced = true; // safety net: release ranks the failure did not reach
      const std::string reason = "rank " + std::to_string(failures.front().rank) + " failed first";
      lock.unlock();
      for (int r = 0; r < n; ++r) {
        abort_rank(r, reason);
      }
      store->abort(reason);
      lock.lock();
    }
  }
  for (auto& t : threads) {
    t.join();
  }
  worlds.clear(); // every rank done: now the groups may close their connections

  if (!failures.empty()) {
    std::string msg = "run_ranks(" + std::to_string(n) + "): rank " + std::to_string(failures[0].rank) +
                      " failed: " + failures[0].message;
    for (std::size_t i = 1; i < failures.size(); ++i) {
      msg += "\n  then rank " + std::to_string(failures[i].rank) + ": " + failures[i].message;
    }
    throw Error(msg);
  }
}
#endif

} // namespace dtensor::testing

#undef DTENSOR_RUN_RANKS_DECLARE_ONLY
#undef DTENSOR_RUN_RANKS_INLINE

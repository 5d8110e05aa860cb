// Faults on the MPI backend, as real processes: `mpirun -np 2 mpi_fault_program <case>` with a short
// DTENSOR_TIMEOUT. Each case makes the ranks disagree; the rank(s) named in the case must get a
// dtensor::Error (or TimeoutError) whose message holds the expected words, and the others must finish.
// Exit 0 when that happens, 1 when an expected error did not come or its message is wrong.
//   never_arrives   rank 1 skips an all_reduce: rank 0 times out naming the op and "rank 1: no report"
//   send_longer     rank 0 sends 32 floats, rank 1 receives 16: rank 1 gets MPI's truncation error
//   send_shorter    rank 0 sends 8 floats, rank 1 receives 16: rank 1 is told 8 came, 16 expected
//   recv_dtype      rank 0 sends float32, rank 1 receives int32 (one size): rank 1 times out
//   gather_count    the root's block for rank 1 is longer than what rank 1 sends: the root is told
//   desync_count    (DTENSOR_DEBUG=detail) all_reduce of 16 vs 32 floats: both told the counts differ
//   desync_dtype    (DTENSOR_DEBUG=detail) broadcast of float32 vs int32: both told the dtypes differ
//   group_order     rank 0 makes a new group first, rank 1 splits first: both told "different orders"
//   monitored       rank 1 skips a monitored_barrier: rank 0 is told rank 1 did not arrive
//   timeout_aborts  after rank 0's timeout, its next op on the group fails at once (aborted)
//   kill_rank       rank 1 SIGKILLs itself mid-loop: mpirun ends the job (the test expects a nonzero exit)
#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/comm/p2p.hpp"
#include "dtensor/core/timeout.hpp"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

using namespace dtensor;

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  InitOptions options;
  options.backend = "mpi";
  ProcessGroup world = init_process_group(options);
  const int r = world.rank();
  const auto limit = detail::init_timeout();
  // Which ranks must fail, and with what words.
  std::vector<int> failing = {1};
  std::vector<std::string> expect;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    if (what == "never_arrives") {
      failing = {0};
      expect = {"all_reduce #0 (16 x float32, op sum)", "timed out", "rank 1: no report"};
      if (r == 0) {
        all_reduce(Tensor<float, 1>::full({16}, 1.0f), ReduceOp::sum, world);
      } else {
        std::this_thread::sleep_for(2 * limit);
      }
    } else if (what == "send_longer" || what == "send_shorter") {
      expect = {"recv",
                what == "send_longer" ? "truncated" : "received 8 elements from rank 0 but expected 16"};
      if (r == 0) {
        send(Tensor<float, 1>::full({what == "send_longer" ? 32 : 8}, 1.0f), 1, world);
      } else {
        auto t = Tensor<float, 1>::full({16}, 0.0f);
        recv(t, 0, world);
      }
    } else if (what == "recv_dtype") {
      expect = {"recv #0 (16 x int32, peer 0)", "timed out"};
      if (r == 0) {
        send(Tensor<float, 1>::full({16}, 1.0f), 1, world);
      } else {
        auto t = Tensor<std::int32_t, 1>::full({16}, 0);
        recv(t, 0, world);
      }
    } else if (what == "gather_count") {
      failing = {0};
      expect = {"gather", "received 3 elements from rank 1 but expected 4"};
      auto own = Tensor<float, 1>::full({3}, 1.0f);
      std::vector<Tensor<float, 1>> list{Tensor<float, 1>::full({3}, 2.0f),
                                         Tensor<float, 1>::full({4}, 2.0f)};
      gather(own, &list, 0, world);
    } else if (what == "desync_count") {
      failing = {0, 1};
      expect = {"the members disagree on the count", "nothing was sent"};
      auto t = Tensor<float, 1>::full({r == 0 ? 16 : 32}, 1.0f);
      all_reduce(t, ReduceOp::sum, world);
    } else if (what == "desync_dtype") {
      failing = {0, 1};
      expect = {"the members disagree on the dtype"};
      if (r == 0) {
        broadcast(Tensor<float, 1>::full({16}, 1.0f), 0, world);
      } else {
        broadcast(Tensor<std::int32_t, 1>::full({16}, 1), 0, world);
      }
    } else if (what == "group_order") {
      failing = {0, 1};
      expect = {"different orders"};
      if (r == 0) {
        auto a = world.new_group({0, 1});
        auto b = world.split(0, r);
      } else {
        auto b = world.split(0, r);
        auto a = world.new_group({0, 1});
      }
    } else if (what == "monitored") {
      failing = {0};
      expect = {"monitored_barrier #0: rank 1 (global 1) did not arrive"};
      if (r == 0) {
        world.monitored_barrier(limit);
      } else {
        std::this_thread::sleep_for(2 * limit);
      }
    } else if (what == "timeout_aborts") {
      failing = {0};
      expect = {"the group was aborted", "all_reduce #0 (4 x float32, op sum)"};
      if (r == 0) {
        try {
          all_reduce(Tensor<float, 1>::full({4}, 1.0f), ReduceOp::sum, world);
        } catch (const TimeoutError&) {
        }
        const auto t1 = std::chrono::steady_clock::now();
        try {
          barrier(world);
        } catch (const Error&) {
          if (std::chrono::steady_clock::now() - t1 > limit / 2) {
            std::fprintf(stderr, "rank 0: the op after the timeout did not fail at once\n");
            return 1;
          }
          throw;
        }
      } else {
        std::this_thread::sleep_for(2 * limit);
      }
    } else if (what == "kill_rank") {
      auto t = Tensor<float, 1>::full({1024}, 1.0f);
      for (int i = 0;; ++i) {
        if (i == 20 && r == 1) {
          std::raise(SIGKILL);
        }
        all_reduce(t, ReduceOp::max, world);
      }
    } else {
      std::fprintf(stderr, "mpi_fault_program: unknown case '%s'\n", what.c_str());
      return 2;
    }
  } catch (const Error& e) {
    const std::string msg = e.what();
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    std::printf("rank %d after %lld ms: %s\n", r, static_cast<long long>(ms.count()), msg.c_str());
    std::fflush(stdout);
    if (std::find(failing.begin(), failing.end(), r) == failing.end()) {
      std::fprintf(stderr, "rank %d should not have failed\n", r);
      return 1;
    }
    for (const auto& words : expect) {
      if (msg.find(words) == std::string::npos) {
        std::fprintf(stderr, "rank %d: the message lacks '%s'\n", r, words.c_str());
        return 1;
      }
    }
    return 0;
  }
  if (std::find(failing.begin(), failing.end(), r) != failing.end()) {
    std::fprintf(stderr, "rank %d: %s did not fail\n", r, what.c_str());
    return 1;
  }
  return 0;
}

// Mismatches between real processes (issue 18, defects 1 and 6), one per collective and point-to-point:
// `dtensor-run --nproc-per-node 2 fault_program <case>`. Each rank runs a call its peer disagrees with and
// must get a dtensor::Error whose message says the members disagree (gloo used to abort the process with
// SIGABRT, EnforceNotMet at pair.cc:510, or return stale data); exit 0 then, 1 when the call succeeded or the
// message is wrong. Run with a short DTENSOR_TIMEOUT.
//
// Dead and missing peers (run by launcher_test's fault scenarios, which check every survivor's line):
//   kill_store_host  rank 0 (hosting the store: --rank0-store) SIGKILLs itself mid-loop of all_reduces
//   kill_rank        the last rank SIGKILLs itself mid-loop
//   stop_rank        the last rank stops in the loop (prints "stopped <pid>"; the test sends it SIGTERM)
//   never_joins      the last rank never calls init_process_group (it sleeps 3 timeouts, then exits)
// FAULT_VICTIM=<rank> picks another rank to fail (kill_rank, stop_rank). Survivors ignore SIGTERM (the
// launcher sends it once a rank died) and print "fault error on rank R after MS ms: <message>" for the Error
// they got (MS: from the start of the op or init that failed).
#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/comm/p2p.hpp"

#include "dtensor/core/timeout.hpp"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

using namespace dtensor;

namespace {

int dead_peer(const std::string& what) {
  const int size = std::atoi(std::getenv("WORLD_SIZE"));
  const int rank = std::atoi(std::getenv("RANK"));
  const char* chosen = std::getenv("FAULT_VICTIM");
  const int victim = chosen != nullptr ? std::atoi(chosen) : what == "kill_store_host" ? 0 : size - 1;
  if (what == "never_joins" && rank == victim) {
    std::this_thread::sleep_for(3 * detail::init_timeout());
    return 0;
  }
  if (rank != victim || what == "never_joins") {
    std::signal(SIGTERM, SIG_IGN);
  }
  auto start = std::chrono::steady_clock::now();
  try {
    InitOptions options;
    options.backend = "gloo";
    ProcessGroup world = init_process_group(options);
    auto t = Tensor<float, 1>::full({1024}, 1.0f);
    for (int i = 0;; ++i) {
      if (i == 20 && rank == victim) {
        if (what == "stop_rank") {
          std::printf("stopped %d\n", int(::getpid()));
          std::fflush(stdout);
          std::this_thread::sleep_for(std::chrono::hours(1));
        }
        ::raise(SIGKILL);
      }
      start = std::chrono::steady_clock::now();
      all_reduce(t, ReduceOp::max, world);
    }
  } catch (const Error& e) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start)
            .count();
    std::printf("fault error on rank %d after %lld ms: %s\n", rank, static_cast<long long>(ms), e.what());
    return 0;
  }
}

} // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  if (what == "kill_store_host" || what == "kill_rank" || what == "stop_rank" || what == "never_joins") {
    return dead_peer(what);
  }
  InitOptions options;
  options.backend = "gloo";
  ProcessGroup world = init_process_group(options);
  const int r = world.rank();
  std::string expect = "the members disagree: rank 0: ";
  try {
    if (what == "all_reduce_count") {
      auto t = Tensor<float, 1>::full({r == 0 ? 16 : 32}, 1.0f);
      all_reduce(t, ReduceOp::sum, world);
    } else if (what == "all_reduce_dtype") {
      if (r == 0) {
        all_reduce(Tensor<float, 1>::full({16}, 1.0f), ReduceOp::sum, world);
      } else {
        all_reduce(Tensor<double, 1>::full({16}, 1.0), ReduceOp::sum, world);
      }
    } else if (what == "send_recv") { // the sender's message is longer than the receive
      if (r == 0) {
        send(Tensor<float, 1>::full({32}, 1.0f), 1, world);
      } else {
        auto t = Tensor<float, 1>::full({16}, 0.0f);
        recv(t, 0, world);
      }
    } else if (what == "reduce_count") {
      auto t = Tensor<float, 1>::full({r == 0 ? 16 : 32}, 1.0f);
      reduce(t, 0, ReduceOp::sum, world);
    } else if (what == "broadcast_count") {
      auto t = Tensor<float, 1>::full({r == 0 ? 16 : 32}, 1.0f);
      broadcast(t, 0, world);
    } else if (what == "broadcast_dtype") { // one byte size: float32 vs int32
      if (r == 0) {
        broadcast(Tensor<float, 1>::full({16}, 1.0f), 0, world);
      } else {
        broadcast(Tensor<std::int32_t, 1>::full({16}, 1), 0, world);
      }
    } else if (what == "different_ops") { // one count and dtype, another op
      auto t = Tensor<float, 1>::full({16}, 1.0f);
      if (r == 0) {
        all_reduce(t, ReduceOp::sum, world);
      } else {
        broadcast(t, 0, world);
      }
    } else if (what == "all_gather_count") {
      auto in = Tensor<float, 1>::full({r == 0 ? 4 : 8}, 1.0f);
      auto out = Tensor<float, 1>::full({2 * in.numel()}, -1.0f);
      all_gather_into_tensor(out, in, world);
    } else if (what == "reduce_scatter_count") {
      expect = "reduce_scatter";
      auto out = Tensor<float, 1>::full({r == 0 ? 4 : 8}, -1.0f);
      auto in = Tensor<float, 1>::full({2 * out.numel()}, 1.0f);
      reduce_scatter_tensor(out, in, ReduceOp::sum, world);
    } else if (what == "all_to_all_count") {
      expect = "all_to_all";
      auto in = Tensor<float, 1>::full({r == 0 ? 4 : 8}, 1.0f);
      auto out = Tensor<float, 1>::full({in.numel()}, -1.0f);
      all_to_all_single(out, in, world);
    } else if (what == "gather_count" || what == "scatter_count") { // the root's list is wrong for rank 1
      expect = what.substr(0, what.find('_'));
      auto own = Tensor<float, 1>::full({3}, 1.0f);
      std::vector<Tensor<float, 1>> list{Tensor<float, 1>::full({3}, 2.0f),
                                         Tensor<float, 1>::full({4}, 2.0f)};
      if (what == "gather_count") {
        gather(own, &list, 0, world);
      } else {
        scatter(own, list, 0, world);
      }
    } else if (what == "recv_dtype") { // one byte size: float32 sent, int32 received
      if (r == 0) {
        send(Tensor<float, 1>::full({16}, 1.0f), 1, world);
      } else {
        auto t = Tensor<std::int32_t, 1>::full({16}, 0);
        recv(t, 0, world);
      }
    } else if (what == "group_order") { // rank 0 makes a new group first, rank 1 splits first
      expect = "different orders";
      if (r == 0) {
        auto a = world.new_group({0, 1});
        auto b = world.split(0, r);
      } else {
        auto b = world.split(0, r);
        auto a = world.new_group({0, 1});
      }
    } else {
      std::fprintf(stderr, "fault_program: unknown case '%s'\n", what.c_str());
      return 2;
    }
  } catch (const Error& e) {
    const std::string msg = e.what();
    std::printf("rank %d: %s\n", r, msg.c_str());
    if (msg.find(expect) == std::string::npos) {
      std::fprintf(stderr, "rank %d: the message lacks '%s'\n", r, expect.c_str());
      return 1;
    }
    return 0;
  }
  std::fprintf(stderr, "rank %d: %s did not fail\n", r, what.c_str());
  return 1;
}

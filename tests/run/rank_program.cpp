// The program dtensor-run starts in the launcher tests (no backend needed):
//   rank_program env            checks and prints the launcher's variables
//   rank_program store          rendezvous through the job's TcpStore: every rank publishes a key, reads
//                               everybody's, counts with add() and meets at a barrier
//   rank_program fail R CODE    rank R exits with CODE after 200 ms; the others print their pid and sleep
//   rank_program sleep          prints "ready <pid>" and sleeps (for the signal tests)
//   rank_program restart R K [S]  prints "start <DTENSOR_RESTART_COUNT> rank <r> of <n>"; rank R kills
//                               itself (SIGKILL) in starts 0 .. K-1. With the launcher's store, every rank
//                               checks that no key of an earlier start is visible in its part of the store,
//                               leaves one there, and meets the others at a barrier; then sleeps (S ms in
//                               start 0, default 500) and meets them at a last barrier (a rank whose peers
//                               died times out there: DTENSOR_TIMEOUT)
// Errors are printed as "rank_program error: <message>" with exit code 1.
#include "dtensor/comm/init.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/tcp_store.hpp"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

int run(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "env";
  const dtensor::DistEnv env = dtensor::read_dist_env();
  if (mode == "env") {
    std::printf("rank %d of %d local %d/%d master %s:%d source %s agent_store %d\n", env.rank, env.world_size,
                env.local_rank, env.local_world_size, env.master_addr.c_str(), env.master_port,
                env.source.c_str(), int(env.agent_store));
    DTENSOR_CHECK(env.source == "torchrun", "not started by a launcher");
    DTENSOR_CHECK(env.rank == std::stoi(env_or("GROUP_RANK", "0")) * env.local_world_size + env.local_rank,
                  "RANK != GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK");
    std::fprintf(stderr, "stderr of rank %d\n", env.rank);
    return 0;
  }
  if (mode == "store") {
    auto store = dtensor::connect_store(env, dtensor::detail::init_timeout());
    const std::string me = std::to_string(env.rank);
    store->set("rank/" + me, "hello from " + me);
    for (int r = 0; r < env.world_size; ++r) {
      auto v = store->get("rank/" + std::to_string(r));
      DTENSOR_CHECK(std::string(v.begin(), v.end()) == "hello from " + std::to_string(r), "wrong value");
    }
    store->add("count", 1);
    store->barrier("all-counted", env.world_size, store->timeout());
    const std::int64_t count = store->add("count", 0);
    DTENSOR_CHECK(count == env.world_size, "count " + std::to_string(count));
    std::printf("store ok on rank %d (%s)\n", env.rank, store->is_server() ? "hosting" : "client");
    store->barrier("done", env.world_size, store->timeout()); // rank 0 may host: nobody leaves early
    return 0;
  }
  if (mode == "fail") {
    const int who = argc > 2 ? std::atoi(argv[2]) : 1;
    const int code = argc > 3 ? std::atoi(argv[3]) : 3;
    std::printf("pid %d\n", int(::getpid()));
    std::fflush(stdout);
    if (env.rank == who) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::fprintf(stderr, "rank %d giving up with %d\n", env.rank, code);
      return code;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (mode == "restart") {
    const int who = argc > 2 ? std::atoi(argv[2]) : 1;
    const int fails = argc > 3 ? std::atoi(argv[3]) : 1;
    std::printf("start %d rank %d of %d\n", env.restart_count, env.rank, env.world_size);
    std::fflush(stdout);
    std::shared_ptr<dtensor::Store> store;
    if (env.agent_store) { // this start's part of the launcher's store, as init_process_group sees it
      store = dtensor::connect_store(env, dtensor::detail::init_timeout());
      if (!env.store_prefix.empty()) {
        store = std::make_shared<dtensor::PrefixStore>(env.store_prefix, store);
      }
      DTENSOR_CHECK(!store->check({"started"}), "a key of an earlier start is visible");
      dtensor::store_barrier(*store, "checked", env.world_size, store->timeout());
      store->set("started", std::string_view("1"));
    }
    if (env.rank == who && env.restart_count < fails) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      ::raise(SIGKILL);
    }
    const int pause = argc > 4 && env.restart_count == 0 ? std::atoi(argv[4]) : 500;
    std::this_thread::sleep_for(std::chrono::milliseconds(pause));
    if (store) {
      dtensor::store_barrier(*store, "finished", env.world_size, store->timeout());
    }
    return 0;
  }
  if (mode == "sleep") {
    std::printf("ready %d\n", int(::getpid()));
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  std::fprintf(stderr, "rank_program: unknown mode %s\n", mode.c_str());
  return 2;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank_program error: %s\n", e.what());
    return 1;
  }
}

// The collective suite over NCCL, on CUDA tensors, plus what only NCCL has: host tensors are rejected,
// the caller's stream is respected, abort, and a TimeoutError instead of a hang wherever a member is missing.
//
//   nccl_suite                     one process: every case on one-rank communicators
//   dtensor-run --nproc-per-node N nccl_suite          the same as N processes (N GPUs, or one GPU with
//                                                      DTENSOR_TEST_HOSTID_PER_RANK=1 NCCL_IB_DISABLE=1)
//   dtensor-run --nproc-per-node 2 nccl_suite timeout
//       after a warm-up, rank 1 skips a collective: rank 0 gets a TimeoutError within seconds; then every
//       wait on the group's works and its next op raise
//   ... nccl_suite connect_timeout
//       the same without the warm-up: the missing member is missed while NCCL sets up the first op's
//       connections
//   ... nccl_suite init_timeout
//       rank 1 never makes a new_group rank 0 makes: rank 0 gets a TimeoutError naming
//       ncclCommInitRankConfig, and the world still works afterwards
//   ... nccl_suite mismatch
//       rank 0 reduces 16 floats, rank 1 a million: every rank gets an Error (the one stuck in the
//       mismatched op a TimeoutError listing what it ran; one whose op NCCL completed, from its next ops);
//       a completed op is no pass
//   ... nccl_suite mismatch_detail
//       the same mismatches under DTENSOR_DEBUG=detail: every rank gets the desync Error before anything is
//       sent, and the group stays usable
//   nccl_suite capture_watchdog
//       one process: the watchdog polls a pending op while this thread captures a CUDA graph in global mode
//       on another stream; the capture must survive
//   mpirun -np 2 nccl_suite
//       the suite, the ranks meeting through MPI (MpiStore; built with the MPI backend where it is found)
// Exits 77 (ctest's skip code) only where the machine has no CUDA device or driver; a GPU that CUDA cannot
// use (an old driver) is a failure (tests/support/cuda_device.hpp).
#include "collective_suite.hpp"

#include "../support/cuda_device.hpp"

#include "dtensor/backends/nccl/backend.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/core/debug.hpp"
#include "dtensor/testing/validate_only.hpp"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

namespace {

using namespace dtensor;
using WorkPtr = std::shared_ptr<WorkImpl>;

void host_tensor_rejected(const suite::Ctx& c) {
  auto t = Tensor<float, 1>::full({4}, 1.0f); // host
  try {
    all_reduce(t, ReduceOp::sum, c.world);
  } catch (const Error& e) {
    const std::string msg = e.what();
    suite::check(msg.find("host memory") != std::string::npos &&
                     msg.find("CUDA tensors") != std::string::npos,
                 c, "the host-tensor message does not say what to do: " + msg);
    return;
  }
  throw Error("an all_reduce of a host tensor was accepted by the NCCL backend");
}

/// The op waits for work the caller queued on its own stream before the op.
void user_stream_respected(const suite::Ctx& c) {
  cudaStream_t user = nullptr;
  detail::check_cuda(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking), "cudaStreamCreate", "test");
  const std::int64_t n = 1 << 20;
  auto t = suite::make<std::int32_t>(c, n, [](std::int64_t) { return 5.0; });
  auto big = suite::make<std::int32_t>(c, 16 * n, [](std::int64_t) { return 0.0; });
  // Queue a slow-ish copy chain and then overwrite t with 0x01010101 on the user stream.
  for (int i = 0; i < 8; ++i) {
    detail::check_cuda(cudaMemcpyAsync(big.data(), big.data() + 8 * n, 8 * n * sizeof(std::int32_t),
                                       cudaMemcpyDeviceToDevice, user),
                       "cudaMemcpyAsync", "test");
  }
  detail::check_cuda(cudaMemsetAsync(t.data(), 1, n * sizeof(std::int32_t), user), "cudaMemsetAsync", "test");
  CommOptions o;
  o.stream = user;
  auto w = c.world.impl().all_reduce(suite::buf(t), ReduceOp::sum, o);
  w->wait(); // the user stream waits for the op
  detail::check_cuda(cudaStreamSynchronize(user), "cudaStreamSynchronize", "test");
  suite::check(w->is_completed(), c, "the op is not complete after its stream was synchronised");
  suite::expect(
      c, t, [&](std::int64_t) { return 16843009.0 * c.size; }, "all_reduce after the user stream's memset");
  detail::check_cuda(cudaStreamDestroy(user), "cudaStreamDestroy", "test");
}

/// A collective issued under CUDA graph capture is recorded, not run, and replays correctly; a tensor on its
/// own stream is ordered on that stream (the front end passes it).
void graph_capture(const suite::Ctx& c) {
  cudaStream_t s = nullptr;
  detail::check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate", "test");
  Tensor<float, 1> t({256}, c.device, s);
  t.fill(1.0f);
  all_reduce(t, ReduceOp::sum, c.world); // warm-up outside the capture (connections, plans)
  t.fill(1.0f);
  cudaGraph_t graph = nullptr;
  detail::check_cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture",
                     "test");
  all_reduce(t, ReduceOp::sum, c.world);
  detail::check_cuda(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture", "test");
  cudaGraphExec_t exec = nullptr;
  detail::check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate", "test");
  for (int replay = 0; replay < 2; ++replay) {
    detail::check_cuda(cudaGraphLaunch(exec, s), "cudaGraphLaunch", "test");
  }
  detail::check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize", "test");
  const double want = double(c.size) * c.size; // two replays of a sum of ones
  suite::expect(
      c, t, [&](std::int64_t) { return want; }, "all_reduce captured in a CUDA graph, replayed twice");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  detail::check_cuda(cudaStreamDestroy(s), "cudaStreamDestroy", "test");
}

void abort_fails_later_ops(const suite::Ctx& c) {
  auto g = c.world.split(0, c.rank); // a copy of the world to abort
  auto t = suite::make<float>(c, 3, [](std::int64_t) { return 1.0; });
  all_reduce(t, ReduceOp::sum, g);
  suite::expect(
      c, t, [&](std::int64_t) { return double(c.size); }, "all_reduce before abort");
  g.abort("test abort");
  try {
    all_reduce(t, ReduceOp::sum, g);
  } catch (const Error& e) {
    suite::check(std::string(e.what()).find("test abort") != std::string::npos, c,
                 std::string("the error after abort does not carry the reason: ") + e.what());
    return;
  }
  throw Error("an op on an aborted communicator succeeded");
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// How one op on the group ended: `error` holds its error's text (nullopt when it completed; `timeout` says
/// whether it was a TimeoutError), `hung` that it still ran after the limit.
struct OpEnd {
  std::optional<std::string> error;
  bool timeout = false;
  bool hung = false;
};

/// An all_reduce of `t` on the world with `o`: polls is_completed() up to `limit`, then wait() and a device
/// synchronisation. `work` receives its Work when the submission did not throw.
OpEnd run_op(const suite::Ctx& c, Tensor<float, 1>& t, const CommOptions& o, std::chrono::seconds limit,
             WorkPtr* work = nullptr) {
  const auto t0 = Clock::now();
  OpEnd end;
  try {
    auto w = c.world.impl().all_reduce(suite::buf(t), ReduceOp::sum, o);
    if (work != nullptr) {
      *work = w;
    }
    while (!w->is_completed()) {
      if (Clock::now() - t0 > limit) {
        end.hung = true;
        return end;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    w->wait();
    detail::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", "nccl_suite");
  } catch (const TimeoutError& e) {
    end.error = e.what();
    end.timeout = true;
  } catch (const Error& e) {
    end.error = e.what();
  }
  return end;
}

/// After the group failed: a second wait on `failed` (when there is one) and on `earlier` (an op that
/// completed before the failure) raise, and so does the group's next op, at once. Returns the failures.
int after_abort_checks(const suite::Ctx& c, const WorkPtr& failed, const WorkPtr& earlier, const char* mode) {
  int bad = 0;
  const auto raises = [](const WorkPtr& w) {
    try {
      w->wait();
    } catch (const Error&) {
      return true;
    }
    return false;
  };
  if (failed && (!failed->is_completed() || !raises(failed))) {
    std::printf("FAIL %s: the op that failed does not stay failed (is_completed, or a second wait())\n",
                mode);
    ++bad;
  }
  if (earlier && !raises(earlier)) {
    std::printf("FAIL %s: wait() on an op that completed before the abort did not raise\n", mode);
    ++bad;
  }
  auto t = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
  const auto t0 = Clock::now();
  try {
    all_reduce(t, ReduceOp::sum, c.world);
    std::printf("FAIL %s: the group's next op was accepted after the abort\n", mode);
    ++bad;
  } catch (const Error& e) {
    if (seconds_since(t0) > 2) {
      std::printf("FAIL %s: the group's next op took %.1f s to fail\n", mode, seconds_since(t0));
      ++bad;
    }
  }
  return bad;
}

/// Rank 1 skips an all_reduce (after a warm-up when `warm_up`, else it is the group's first op and NCCL
/// misses rank 1 while setting up the connections): rank 0 gets a TimeoutError within seconds, not a hang.
int timeout_mode(const suite::Ctx& c, bool warm_up) {
  const char* mode = warm_up ? "timeout" : "connect_timeout";
  auto t = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
  WorkPtr earlier;
  if (warm_up) {
    earlier = c.world.impl().all_reduce(suite::buf(t), ReduceOp::sum, CommOptions{});
    earlier->wait();
    detail::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", "nccl_suite");
  }
  if (c.rank == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(8)); // never joins the all_reduce
    std::printf("rank 1: skipped the collective\n");
    return 0;
  }
  CommOptions o;
  o.timeout = std::chrono::seconds(2);
  const auto t0 = Clock::now();
  WorkPtr w;
  const OpEnd end = run_op(c, t, o, std::chrono::seconds(30), &w);
  const double s = seconds_since(t0);
  if (end.hung) {
    std::printf("FAIL %s: the op still hangs after 30 s\n", mode);
    return 1;
  }
  if (!end.error) {
    std::printf("FAIL %s: the op completed without its peer\n", mode);
    return 1;
  }
  if (!end.timeout || end.error->find("all_reduce") == std::string::npos) {
    std::printf("FAIL %s: expected a TimeoutError naming the all_reduce, got: %s\n", mode,
                end.error->c_str());
    return 1;
  }
  std::printf("%s %s: TimeoutError after %.1f s: %s\n", s < 15 ? "PASS" : "FAIL", mode, s,
              end.error->c_str());
  return (s < 15 ? 0 : 1) + after_abort_checks(c, w, earlier, mode);
}

/// Rank 0 makes a new_group([0, 1]) that rank 1 does not make (for 8 s): rank 0 waits in
/// ncclCommInitRankConfig and must get a TimeoutError after the group's timeout, not hang; the half-made
/// communicator is aborted and the world is unaffected (an all_reduce with rank 1 once it is back).
int init_timeout_mode(const suite::Ctx& c) {
  const auto world_timeout = c.world.impl().timeout();
  int bad = 0;
  if (c.rank == 0) {
    c.world.impl().set_timeout(std::chrono::seconds(2)); // the new group's timeout
    const auto t0 = Clock::now();
    try {
      auto pair = c.world.new_group({0, 1});
      std::printf("FAIL init_timeout: new_group returned without rank 1\n");
      bad = 1;
    } catch (const TimeoutError& e) {
      const double s = seconds_since(t0);
      const bool named = std::string(e.what()).find("ncclCommInitRankConfig") != std::string::npos;
      std::printf("%s init_timeout: TimeoutError after %.1f s: %s\n", named && s < 15 ? "PASS" : "FAIL", s,
                  e.what());
      bad = named && s < 15 ? 0 : 1;
    } catch (const Error& e) {
      std::printf("FAIL init_timeout: expected a TimeoutError, got: %s\n", e.what());
      bad = 1;
    }
    c.world.impl().set_timeout(world_timeout);
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(8));
  }
  auto t = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
  all_reduce(t, ReduceOp::sum, c.world);
  suite::expect(
      c, t, [&](std::int64_t) { return double(c.size); }, "world all_reduce after the failed new_group");
  if (c.rank == 0 && bad == 0) {
    std::printf("PASS init_timeout: the world still works\n");
  }
  return bad;
}

/// Members that disagree on an all_reduce's count. NCCL cannot tell: a member may stall in the op (then the
/// watchdog times it out, and its TimeoutError says what it ran and what the others reported) or NCCL may
/// complete it with wrong data; then that member's next ops on the group must fail once the stalled peer
/// aborted. Passes only when every member gets an Error within 30 s, never on a completed op alone.
int mismatch_mode(const suite::Ctx& c) {
  auto warm = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
  all_reduce(warm, ReduceOp::sum, c.world);
  detail::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", "nccl_suite");
  const std::int64_t n = c.rank == 0 ? 16 : (1 << 20);
  auto t = suite::make<float>(c, n, [](std::int64_t) { return 1.0; });
  CommOptions o;
  o.timeout = std::chrono::seconds(3);
  const auto t0 = Clock::now();
  const OpEnd end = run_op(c, t, o, std::chrono::seconds(30));
  if (end.hung) {
    std::printf("FAIL mismatch: rank %d still hangs after 30 s\n", c.rank);
    return 1;
  }
  if (end.error) {
    const std::string& msg = *end.error;
    const std::string mine = " (" + std::to_string(n) + " x float32";
    const bool named =
        !end.timeout ||
        (msg.find("did not complete within its timeout") != std::string::npos &&
         msg.find(mine) != std::string::npos && msg.find("flight recorder") != std::string::npos);
    std::printf("%s mismatch: rank %d: %s after %.1f s: %s\n", named ? "PASS" : "FAIL", c.rank,
                end.timeout ? "TimeoutError" : "Error", seconds_since(t0), msg.c_str());
    return named ? 0 : 1;
  }
  std::printf("rank %d: NCCL completed the mismatched all_reduce; its next ops on the group must fail\n",
              c.rank);
  auto next = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
  for (int i = 0; seconds_since(t0) < 30; ++i) {
    const OpEnd e = run_op(c, next, o, std::chrono::seconds(30));
    if (e.hung) {
      break;
    }
    if (e.error) {
      std::printf("PASS mismatch: rank %d: op %d after the mismatched one failed after %.1f s: %s\n", c.rank,
                  i + 1, seconds_since(t0), e.error->c_str());
      return 0;
    }
  }
  std::printf("FAIL mismatch: rank %d: no op on the group failed within 30 s of the mismatched all_reduce\n",
              c.rank);
  return 1;
}

/// Under DTENSOR_DEBUG=detail (set here) every member catches the mismatches NCCL cannot see -- a count, and
/// a dtype of the same size NCCL would complete with wrong data -- before anything is sent, and the group
/// stays usable.
int mismatch_detail_mode(const suite::Ctx& c) {
  set_debug_level(DebugLevel::detail);
  int bad = 0;
  const auto expect_desync = [&](const char* what, const char* field, auto&& op) {
    try {
      op();
      std::printf("FAIL mismatch_detail: rank %d: the %s mismatch was not detected\n", c.rank, what);
      ++bad;
    } catch (const TimeoutError& e) {
      std::printf("FAIL mismatch_detail: rank %d: %s: a TimeoutError instead of the desync Error: %s\n",
                  c.rank, what, e.what());
      ++bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      const bool named = msg.find("the members disagree on the " + std::string(field)) != std::string::npos &&
                         msg.find("nothing was sent") != std::string::npos;
      std::printf("%s mismatch_detail: rank %d: %s: %s\n", named ? "PASS" : "FAIL", c.rank, what,
                  msg.c_str());
      bad += named ? 0 : 1;
    }
  };
  auto counts = suite::make<float>(c, c.rank == 0 ? 16 : 32, [](std::int64_t) { return 1.0; });
  expect_desync("count", "count", [&] { all_reduce(counts, ReduceOp::sum, c.world); });
  if (c.rank == 0) {
    auto f = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
    expect_desync("dtype", "dtype", [&] { all_reduce(f, ReduceOp::sum, c.world); });
  } else {
    auto i = suite::make<std::int32_t>(c, 16, [](std::int64_t) { return 1.0; });
    expect_desync("dtype", "dtype", [&] { all_reduce(i, ReduceOp::sum, c.world); });
  }
  auto t = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
  all_reduce(t, ReduceOp::sum, c.world);
  suite::expect(
      c, t, [&](std::int64_t) { return double(c.size); }, "all_reduce after the detected mismatches");
  return bad;
}

void host_sleep(void*) {
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
}

/// The watchdog polls a pending op (cudaEventQuery every 100 ms) while this thread captures a CUDA graph in
/// cudaStreamCaptureModeGlobal on another stream. An event query from another thread in global mode would
/// invalidate that capture; the watchdog's thread is in thread-local mode, so the capture must end cleanly
/// and its graph replay, and the op must complete.
int capture_watchdog_mode(const suite::Ctx& c) {
  cudaStream_t user = nullptr;
  cudaStream_t cap = nullptr;
  detail::check_cuda(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking), "cudaStreamCreate", "test");
  detail::check_cuda(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking), "cudaStreamCreate", "test");
  auto t = suite::make<float>(c, 256, [](std::int64_t) { return 1.0; });
  auto scratch = suite::make<std::int32_t>(c, 256, [](std::int64_t) { return 0.0; });
  all_reduce(t, ReduceOp::sum, c.world); // warm-up
  detail::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", "test");
  // Hold the op back for 1.5 s behind a host function on the caller's stream: the watchdog polls it.
  detail::check_cuda(cudaLaunchHostFunc(user, &host_sleep, nullptr), "cudaLaunchHostFunc", "test");
  CommOptions o;
  o.stream = user;
  auto w = c.world.impl().all_reduce(suite::buf(t), ReduceOp::sum, o);
  detail::check_cuda(cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture",
                     "test");
  detail::check_cuda(cudaMemsetAsync(scratch.data(), 1, 256 * sizeof(std::int32_t), cap), "cudaMemsetAsync",
                     "test");
  std::this_thread::sleep_for(std::chrono::milliseconds(700)); // several watchdog rounds inside the capture
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(cap, &graph);
  if (ended != cudaSuccess) {
    std::printf(
        "FAIL capture_watchdog: the global-mode capture ended with %s: %s (the watchdog's event queries "
        "invalidated it)\n",
        cudaGetErrorName(ended), cudaGetErrorString(ended));
    return 1;
  }
  cudaGraphExec_t exec = nullptr;
  detail::check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate", "test");
  detail::check_cuda(cudaGraphLaunch(exec, cap), "cudaGraphLaunch", "test");
  detail::check_cuda(cudaStreamSynchronize(cap), "cudaStreamSynchronize", "test");
  suite::expect(
      c, scratch, [](std::int64_t) { return 16843009.0; }, "the graph captured while the watchdog polled");
  w->wait();
  detail::check_cuda(cudaStreamSynchronize(user), "cudaStreamSynchronize", "test");
  suite::check(w->is_completed(), c, "the op is not complete after its stream was synchronised");
  suite::expect(
      c, t, [&](std::int64_t) { return double(c.size) * c.size; }, "the all_reduce the watchdog polled");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  detail::check_cuda(cudaStreamDestroy(cap), "cudaStreamDestroy", "test");
  detail::check_cuda(cudaStreamDestroy(user), "cudaStreamDestroy", "test");
  std::printf("PASS capture_watchdog: a global-mode capture survived the watchdog's polls\n");
  return 0;
}

/// The modes (argv[1]) and the ranks each needs at least.
struct Mode {
  const char* name;
  int min_ranks;
};
constexpr Mode kModes[] = {{"suite", 1},           {"timeout", 2},  {"connect_timeout", 2},
                           {"init_timeout", 2},    {"mismatch", 2}, {"mismatch_detail", 2},
                           {"capture_watchdog", 1}};

/// The launch check (dtensor/testing/validate_only.hpp): one mode, known, on enough ranks.
int validate_launch(int argc, char** argv) {
  if (argc > 2) {
    return testing::invalid("nccl_suite",
                            "one argument (the mode) expected, got " + std::to_string(argc - 1));
  }
  const std::string mode = argc > 1 ? argv[1] : "suite";
  const Mode* m = nullptr;
  for (const Mode& k : kModes) {
    m = mode == k.name ? &k : m;
  }
  if (m == nullptr) {
    return testing::invalid("nccl_suite", "unknown mode '" + mode + "'");
  }
  const DistEnv env = read_dist_env();
  if (env.world_size < m->min_ranks) {
    return testing::invalid("nccl_suite", "mode " + mode + " needs " + std::to_string(m->min_ranks) +
                                              " processes, the launch has " + std::to_string(env.world_size));
  }
  return testing::validated("nccl_suite", "mode " + mode + ", rank " + std::to_string(env.rank) + " of " +
                                              std::to_string(env.world_size));
}

} // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "suite";
  if (testing::validate_only()) {
    try {
      return validate_launch(argc, argv);
    } catch (const std::exception& e) {
      return testing::invalid("nccl_suite", e.what());
    }
  }
  try {
    test_support::require_cuda_device("nccl_suite " + mode); // exits 77 where there is no GPU at all
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_suite error: %s\n", e.what());
    return 1;
  }
  try {
    const DistEnv env = read_dist_env();
    if (std::getenv("DTENSOR_TEST_HOSTID_PER_RANK") != nullptr) {
      // Several ranks on one GPU: NCCL must see them as different hosts (socket transport over loopback).
      const std::string id = "dtensor-test-host-" + std::to_string(env.rank);
      ::setenv("NCCL_HOSTID", id.c_str(), 1);
    }
    InitOptions options;
    options.backend = "nccl";
    auto world = init_process_group(options);
    int device = 0;
    detail::check_cuda(cudaGetDevice(&device), "cudaGetDevice", "nccl_suite");
    suite::Ctx c{world, Device::cuda(device), world.rank(), world.size()};
    const auto two_ranks = [&](const char* m) {
      if (c.size < 2) {
        std::printf("nccl_suite %s needs 2 processes (dtensor-run --nproc-per-node 2)\n", m);
      }
      return c.size >= 2;
    };
    if (mode == "timeout" || mode == "connect_timeout") {
      return two_ranks(mode.c_str()) ? timeout_mode(c, mode == "timeout") : 1;
    }
    if (mode == "init_timeout") {
      return two_ranks("init_timeout") ? init_timeout_mode(c) : 1;
    }
    if (mode == "mismatch") {
      return two_ranks("mismatch") ? mismatch_mode(c) : 1;
    }
    if (mode == "mismatch_detail") {
      return two_ranks("mismatch_detail") ? mismatch_detail_mode(c) : 1;
    }
    if (mode == "capture_watchdog") {
      return capture_watchdog_mode(c);
    }
    if (mode != "suite") {
      std::fprintf(stderr, "nccl_suite: unknown mode '%s'\n", mode.c_str());
      return 2;
    }
    if (c.rank == 0) {
      int version = 0;
      ncclGetVersion(&version);
      std::printf("nccl suite: %d process(es), NCCL %d, cuda:%d\n", c.size, version, device);
    }
    suite::run_suite(c);
    struct Case {
      const char* name;
      void (*fn)(const suite::Ctx&);
    };
    const Case cases[] = {{"NCCL: host tensors are rejected", &host_tensor_rejected},
                          {"NCCL: the caller's stream is respected", &user_stream_respected},
                          {"NCCL: a collective under CUDA graph capture replays", &graph_capture},
                          {"NCCL: abort fails later ops", &abort_fails_later_ops}};
    for (const Case& k : cases) {
      k.fn(c);
      if (c.rank == 0) {
        std::printf("PASS %s\n", k.name);
      }
    }
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_suite error: %s\n", e.what());
    return 1;
  }
}

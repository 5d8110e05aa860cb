// The collective suite over NCCL, on CUDA tensors, plus what only NCCL has: host tensors are rejected,
// the caller's stream is respected, abort, and a watchdog timeout instead of a hang.
//
//   nccl_suite                     one process: every case on one-rank communicators
//   dtensor-run --nproc-per-node N nccl_suite          the same as N processes (N GPUs, or one GPU with
//                                                      DTENSOR_TEST_HOSTID_PER_RANK=1 NCCL_IB_DISABLE=1)
//   dtensor-run --nproc-per-node 2 nccl_suite timeout  rank 1 skips a collective: rank 0 gets a
//                                                      TimeoutError within seconds, not a hang
//   dtensor-run --nproc-per-node 2 nccl_suite mismatch rank 0 reduces 16 floats, rank 1 a million: each
//                                                      gets a TimeoutError listing what each member ran
//   mpirun -np 2 nccl_suite                            the suite, the ranks meeting through MPI (MpiStore;
//                                                      built with the MPI backend where it is found)
// Exits 77 (ctest's skip code) when no CUDA device is visible.
#include "collective_suite.hpp"

#include "dtensor/backends/nccl/backend.hpp"
#include "dtensor/comm/init.hpp"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

using namespace dtensor;

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

int timeout_mode(const suite::Ctx& c) {
  auto t = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
  // NCCL 2.28 connects lazily on the first collective: warm up on both ranks, so the op below fails for
  // its missing peer and not in connection set-up.
  all_reduce(t, ReduceOp::sum, c.world);
  cudaDeviceSynchronize();
  if (c.rank == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(8)); // never joins the all_reduce
    std::printf("rank 1: skipped the collective\n");
    return 0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  CommOptions o;
  o.timeout = std::chrono::seconds(2);
  try {
    auto w = c.world.impl().all_reduce(suite::buf(t), ReduceOp::sum, o);
    while (!w->is_completed()) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) {
        std::printf("FAIL timeout: the op still hangs after 30 s\n");
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    w->wait();
  } catch (const TimeoutError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("PASS timeout: TimeoutError after %.1f s: %s\n", s, e.what());
    return s < 15 ? 0 : 1;
  }
  std::printf("FAIL timeout: the op completed without its peer\n");
  return 1;
}

/// Members that disagree on an all_reduce's count: NCCL cannot tell, but once the op times out, every
/// member's error says what each member ran (the op board) and what this rank did last (flight recorder).
int mismatch_mode(const suite::Ctx& c) {
  auto warm = suite::make<float>(c, 16, [](std::int64_t) { return 1.0; });
  all_reduce(warm, ReduceOp::sum, c.world);
  cudaDeviceSynchronize();
  const std::int64_t n = c.rank == 0 ? 16 : (1 << 20);
  auto t = suite::make<float>(c, n, [](std::int64_t) { return 1.0; });
  CommOptions o;
  o.timeout = std::chrono::seconds(3);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    auto w = c.world.impl().all_reduce(suite::buf(t), ReduceOp::sum, o);
    while (!w->is_completed()) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) {
        std::printf("FAIL mismatch: rank %d still hangs after 30 s\n", c.rank);
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    w->wait();
  } catch (const Error& e) {
    const std::string msg = e.what();
    const bool named = msg.find("the members disagree") != std::string::npos &&
                       msg.find(" (16 x float32") != std::string::npos &&
                       msg.find(" (1048576 x float32") != std::string::npos &&
                       msg.find("flight recorder") != std::string::npos;
    std::printf("%s mismatch: rank %d: %s\n", named ? "PASS" : "FAIL", c.rank, msg.c_str());
    return named ? 0 : 1;
  }
  // NCCL may finish a mismatched op with wrong data instead of hanging; then nothing can be said.
  std::printf("SKIP mismatch: rank %d: NCCL completed the mismatched all_reduce\n", c.rank);
  return 77;
}

} // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "suite";
  if (nccl_device_count() == 0) {
    std::printf("nccl_suite: no CUDA device visible: skipped\n");
    return 77;
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
    if (mode == "timeout") {
      return c.size >= 2 ? timeout_mode(c) : 77;
    }
    if (mode == "mismatch") {
      return c.size >= 2 ? mismatch_mode(c) : 77;
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

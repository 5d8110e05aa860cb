// NCCL sweep: dtensor's collectives on CUDA tensors (ours) next to the same NCCL calls made directly on a
// communicator of our own (raw), in the same run, interleaved sample by sample. Exits 77 without a GPU.
//
//   build/bench/bench_nccl                                                     # one-rank communicator
//   NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo DTENSOR_TEST_HOSTID_PER_RANK=1
//     dtensor-run --standalone --nproc-per-node 2 build/bench/bench_nccl      # processes sharing the GPU
//
// Sizes 4 B .. --max-bytes (default 16 MiB) in x4 steps, float32, nccl-tests' size and bus factors as in
// bench_collectives. A sample is a batch of back-to-back calls followed by cudaDeviceSynchronize, divided by
// the batch (ours: the front end's synchronous call, which orders the caller's stream after the op;
// raw: ncclXxx on a stream of ours). all_to_all raw is ncclSend/ncclRecv pairs in one group (NCCL has no
// all_to_all). Writes bench/results/collectives_nccl_n<ranks>.json (or --out DIR).
// DTENSOR_TEST_HOSTID_PER_RANK=1 gives each process its own NCCL_HOSTID (several ranks on one GPU).

#include "../common/harness.hpp"

#if DTENSOR_HAS_NCCL
#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/core/cuda_devices.hpp>
#include <dtensor/core/timeout.hpp>
#include <dtensor/testing/validate_only.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, ncclGetErrorString(r));
    std::exit(1);
  }
}

} // namespace

int main(int argc, char** argv) {
  const bench::Options opt = bench::parse_options(argc, argv);
  if (!opt.args.empty()) {
    std::fprintf(stderr, "bench_nccl: unknown argument '%s' (--scale S, --smoke, --out DIR, --max-bytes N)\n",
                 opt.args.front().c_str());
    return 2;
  }
  if (testing::validate_only()) { // gpu_check.sh --dry-run: the flags and the launch, nothing run
    const DistEnv env = read_dist_env();
    return testing::validated("bench_nccl", "up to " + std::to_string(opt.max_bytes) + " B, rank " +
                                                std::to_string(env.rank) + " of " +
                                                std::to_string(env.world_size));
  }
  const CudaDevices visible = probe_cuda_devices();
  if (visible.unusable()) { // a GPU CUDA cannot use (an old driver) is an error, never a skip
    std::fprintf(stderr, "bench_nccl: CUDA cannot use this machine's GPU: %s\n", visible.reason().c_str());
    return 1;
  }
  if (visible.count == 0) {
    std::printf("bench_nccl: no CUDA device visible (%s), skipping\n", visible.reason().c_str());
    return 77;
  }
  const int devices = visible.count;
  const DistEnv env = read_dist_env();
  if (const char* h = std::getenv("DTENSOR_TEST_HOSTID_PER_RANK"); h && std::string(h) == "1") {
    ::setenv("NCCL_HOSTID", ("bench-rank-" + std::to_string(env.rank)).c_str(), 1);
  }
  const int dev = env.local_rank % devices;
  check_cuda(cudaSetDevice(dev), "cudaSetDevice");
  auto store = connect_store(env, kDefaultStoreTimeout);
  InitOptions io;
  io.store = store;
  io.backend = "nccl";
  io.device = dev;
  ProcessGroup world = init_process_group(io);
  const int rank = world.rank();
  const int n = world.size();

  // The raw communicator: unique id through the job's store.
  ncclUniqueId id;
  if (rank == 0) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    store->set("bench/nccl_raw_id",
               std::vector<char>(reinterpret_cast<char*>(&id), reinterpret_cast<char*>(&id) + sizeof id));
  }
  const auto v = store->get("bench/nccl_raw_id");
  std::memcpy(&id, v.data(), sizeof id);
  ncclComm_t comm;
  check_nccl(ncclCommInitRank(&comm, n, id, rank), "ncclCommInitRank");
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  const double f1 = n > 1 ? double(n - 1) / n : 0.0;
  struct Op {
    const char* name;
    double bus;
  };
  const std::vector<Op> ops = {{"all_reduce", 2 * f1}, {"broadcast", 1},       {"reduce", 1},
                               {"all_gather", f1},     {"reduce_scatter", f1}, {"all_to_all", f1}};
  bench::Results results;
  bench::Table table({"op", "bytes", "ours us [min-max]", "raw nccl us [min-max]", "ours/raw", "busbw GB/s"});
  for (const Op& op : ops) {
    const std::string name = op.name;
    for (std::int64_t nominal = 4; nominal <= (opt.smoke ? 1024 : opt.max_bytes); nominal *= 4) {
      const std::int64_t total = nominal / 4;
      const std::int64_t block = std::max<std::int64_t>(1, total / n);
      const bool blocked = name == "all_gather" || name == "reduce_scatter" || name == "all_to_all";
      const std::int64_t elems = blocked ? block * n : std::max<std::int64_t>(1, total);
      const std::int64_t bytes = elems * 4;
      Tensor<float, 1> big({elems}, Device::cuda(dev));
      Tensor<float, 1> big2({elems}, Device::cuda(dev));
      Tensor<float, 1> small({block}, Device::cuda(dev));
      check_cuda(cudaMemset(big.data(), 0, big.nbytes()), "cudaMemset");
      check_cuda(cudaMemset(big2.data(), 0, big2.nbytes()), "cudaMemset");
      check_cuda(cudaMemset(small.data(), 0, small.nbytes()), "cudaMemset");
      check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      float* bp = big.data();
      float* bp2 = big2.data();
      float* sp = small.data();
      const auto ne = static_cast<size_t>(elems);
      const auto nb = static_cast<size_t>(block);
      std::function<void()> ours;
      std::function<void()> raw;
      if (name == "all_reduce") {
        ours = [&] { all_reduce(big, ReduceOp::sum, world); };
        raw = [&] { ncclAllReduce(bp, bp, ne, ncclFloat, ncclSum, comm, stream); };
      } else if (name == "broadcast") {
        ours = [&] { broadcast(big, 0, world); };
        raw = [&] { ncclBroadcast(bp, bp, ne, ncclFloat, 0, comm, stream); };
      } else if (name == "reduce") {
        ours = [&] { reduce(big, 0, ReduceOp::sum, world); };
        raw = [&] { ncclReduce(bp, bp, ne, ncclFloat, ncclSum, 0, comm, stream); };
      } else if (name == "all_gather") {
        ours = [&] { all_gather_into_tensor(big, small, world); };
        raw = [&] { ncclAllGather(sp, bp, nb, ncclFloat, comm, stream); };
      } else if (name == "reduce_scatter") {
        ours = [&] { reduce_scatter_tensor(small, big, ReduceOp::sum, world); };
        raw = [&] { ncclReduceScatter(bp, sp, nb, ncclFloat, ncclSum, comm, stream); };
      } else if (name == "all_to_all") {
        ours = [&] { all_to_all_single(big2, big, world); };
        raw = [&] {
          ncclGroupStart();
          for (int q = 0; q < n; ++q) {
            ncclSend(bp + q * block, nb, ncclFloat, q, comm, stream);
            ncclRecv(bp2 + q * block, nb, ncclFloat, q, comm, stream);
          }
          ncclGroupEnd();
        };
      }
      bench::SamplePlan p;
      p.warmup = opt.smoke ? 0 : 2;
      p.samples = bench::scaled(opt, 9);
      p.batch = opt.smoke ? 1 : (bytes <= (1 << 20) ? 20 : 5);
      // A batch ends with a device synchronization (both sides alike).
      int left = 0;
      auto with_sync = [&](std::function<void()>& f) {
        return [&f, &left, &p] {
          f();
          if (++left == p.batch) {
            left = 0;
            cudaDeviceSynchronize();
          }
        };
      };
      auto a = with_sync(ours);
      auto b = with_sync(raw);
      const auto [s_ours, s_raw] = bench::compare(p, a, b);
      const double busbw = bytes / (s_ours.median * 1e-6) / 1e9 * op.bus;
      bench::Record r{"collectives", name, "nccl", n, bytes, s_ours, "nccl_raw", s_raw, {}};
      r.add_num("nominal_bytes", double(nominal)).add_num("busbw_GBps", busbw).add_str("dtype", "float32");
      table.row({name, bench::size_string(bytes), bench::range(s_ours), bench::range(s_raw),
                 bench::fmt("%.3f", r.ratio()), bench::fmt("%.3f", busbw)});
      results.add(std::move(r));
      if (rank == 0) { // every row as it finishes: a run cut short by its time limit keeps what it measured
        results.write(opt, "collectives_nccl_n" + std::to_string(n) + ".json", true);
      }
    }
  }
  if (rank == 0) {
    std::printf("collectives on NCCL, %d process(es) (float32; rank 0; ours = dtensor front end, raw = NCCL "
                "called directly, interleaved)\n",
                n);
    table.print();
    results.write(opt, "collectives_nccl_n" + std::to_string(n) + ".json");
  }
  barrier(world);
  ncclCommDestroy(comm);
  cudaStreamDestroy(stream);
  return 0;
}

#else
#include <cstdio>
int main() {
  std::printf("bench_nccl: built without NCCL (DTENSOR_HAS_NCCL), skipping\n");
  return 77;
}
#endif

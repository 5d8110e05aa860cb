// 06: a small language model trained for a number of steps in a chosen parallel layout by the library's
// trainers, checked against the same training on one rank.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_06_train --layout fsdp_tp --steps 50
// On GPUs (examples/06_train_cuda.cu: this file compiled by nvcc, NCCL and cuBLAS), one process per GPU:
//                     dtensor-run --nproc-per-node 4 ./example_06_train_cuda --layout fsdp_tp
//   --layout tp|tp_cm|ddp|fsdp|hsdp|fsdp_tp   how the parameters are held and reduced (default fsdp_tp;
//                                        tp_cm: tp with collective matmuls, ops/collective_matmul.hpp)
//   --mesh REP,DP,TP                     the mesh (default: from the layout, see below)
//   --steps N                            training steps (default 50)
//   --batch B --seq S --hidden H --ffn F --vocab V   the sizes (default 3, 13, 18, 30, 37: uneven on 4)
//   --checkpoint                         tp and ddp: every block checkpointed (it keeps its input only and
//                                        runs again in the backward; the FSDP layouts recompute anyway)
//   --no-check                           skip the one-rank reference
//
// The model is nn::LanguageModel of nn::MlpBlock (nn/): a vocab-parallel embedding, 3 blocks of
// h + W2 gelu(W1 rms_norm(h)) in tensor + sequence parallel, a final rms_norm and the vocab-parallel head
// with its loss (the logits stay sharded on the vocabulary). One mesh (rep, dp, tp) for every layout: the
// batch is sharded over rep and dp, the sequence over tp between the tensor-parallel regions, the weights
// over tp.
//   tp       (1, 1, n)    nn::DdpTrainer: replicated parameters, DDP's buckets over dp (here of one rank)
//   ddp      (1, n, 1)    the same trainer, DDP over n ranks
//   fsdp     (1, n, 1)    nn::FsdpTrainer<Fsdp<"dp">>: a flat group per block (and the embedding, and the
//                         norm + head), the next group's all_gather in flight while one computes, each
//                         resharded after its forward and gathered again for its backward
//   hsdp     (2, n/2, 1)  nn::FsdpTrainer<Hsdp<"rep", "dp">>: sharded over dp, replicated over rep
//   fsdp_tp  (1, n/2, 2)  FSDP over dp of parameters that are tensor-parallel over tp
// Each step then clips by the global norm (0.5) and runs AdamW on the local shards. The weights come from
// the sharding-invariant RNG, so every layout starts from the one-rank weights; the tokens of a step are a
// function of the step (the targets a fixed map of the ids: a pattern the model learns). The check trains the
// same model on one rank in this process (a one-rank group of the world's backend) and compares the loss of
// every step and every final parameter (relative, 1e-4 in float); the program exits 1 otherwise.
// tests/train/test_trainer.cpp runs the same model in double against one rank within 1e-10 and pins the
// collectives of a step in every layout; bench/train measures it against torch.
//
// On CUDA every tensor of the model lives on the rank's GPU (NCCL gives it: cuda:(LOCAL_RANK mod the visible
// devices)); the GEMMs are cuBLAS, the rest the library's kernels, the collectives NCCL's. Exits 77 (ctest's
// skip) without a visible CUDA device. Several ranks on one GPU (a test setup) need their own NCCL_HOSTID:
// DTENSOR_TEST_HOSTID_PER_RANK=1 sets it from RANK.
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/mlp_block.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/testing/validate_only.hpp>
#include <dtensor/train/data_layout.hpp>
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/trainer.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#if DTENSOR_LOCAL_OPS_CUDA && DTENSOR_HAS_NCCL // the nvcc build (06_train_cuda.cu)
#define DTENSOR_TRAIN_CUDA 1
#include <cuda_runtime_api.h>
#include <dtensor/core/cuda_devices.hpp>
#else
#define DTENSOR_TRAIN_CUDA 0
#endif

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
/// --layout tp_cm: tp with each region's all_gather and reduce_scatter overlapped with its GEMMs.
using Lcm = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::CollectiveMatmul>;
template <class T, class Layout>
using CheckpointedBlock = nn::Checkpointed<nn::MlpBlock<T, Layout>>;
template <template <class, class> class Block>
using Model = nn::LanguageModel<float, L, Block>;

struct Options {
  std::string layout = "fsdp_tp", mesh;
  int steps = 50;
  std::int64_t batch = 3, seq = 13;
  nn::TransformerConfig model{.vocab = 37, .hidden = 18, .ffn = 30, .norm_eps = 1e-6, .init_std = 0.5};
  bool check = true, checkpoint = false;
  Device device = Device::cpu();
};

/// Step `step`'s ids, or its targets (3 id + 1 mod vocab), as the layout places them.
nn::ids_t<L> tokens(const DeviceMesh<Mesh>& mesh, const Options& o, int step, bool targets) {
  return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
    return from_global_index<std::int64_t, Q...>(
        mesh, {o.batch, o.seq},
        [&](const auto& i) {
          const std::uint64_t z =
              (std::uint64_t(step) * 1000003u + std::uint64_t(i[0] * o.seq + i[1]) * 7919u) * 2654435761u;
          const std::int64_t id = std::int64_t((z >> 16) % std::uint64_t(o.model.vocab));
          return targets ? (3 * id + 1) % o.model.vocab : id;
        },
        o.device);
  }(static_cast<nn::ids_t<L>*>(nullptr));
}

/// What a run gives: the loss of every step, the final parameters (full, on the host), the time.
struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  double seconds = 0, blocked = 0; ///< the steps after the first, and their waits on data parallelism
};

void sync_device(const Device& device) {
#if DTENSOR_TRAIN_CUDA
  if (device.is_cuda()) {
    detail::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", "06_train");
  }
#endif
  (void)device;
}

template <class Trainer>
Run train(Trainer& trainer, const Options& o, bool print) {
  optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
  Run run;
  for (int s = 0; s < o.steps; ++s) {
    const auto ids = tokens(trainer.mesh(), o, s, false), targets = tokens(trainer.mesh(), o, s, true);
    const auto t0 = std::chrono::steady_clock::now();
    const nn::StepResult r = trainer.step(ids, targets, opt);
    sync_device(o.device);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0 || o.steps == 1) { // the first step warms up
      run.seconds += took / std::max(1, o.steps - 1);
      run.blocked += r.blocked_seconds / std::max(1, o.steps - 1);
    }
    run.losses.push_back(r.loss);
    if (print && (s % 10 == 0 || s + 1 == o.steps)) {
      std::printf("step %3d/%d  loss %.6f  grad norm %.4f  %6.1f ms\n", s + 1, o.steps, r.loss, r.grad_norm,
                  took * 1e3);
      std::fflush(stdout);
    }
  }
  trainer.with_gathered([&](auto& m) {
    nn::for_each_tensor(m.parameters(), [&](const auto& w) {
      const auto full = w.full_tensor().to(Device::cpu());
      run.params.emplace_back(full.data(), full.data() + full.numel());
    });
  });
  return run;
}

/// tp_cm trains as tp (with the collective matmuls in the model's layout): the data layout of a --layout.
nn::DataLayout data_layout(const std::string& layout) {
  return nn::parse_data_layout(layout == "tp_cm" ? "tp" : layout);
}

/// Trains in `layout` on `mesh`: builds the model and the layout's trainer (train/data_layout.hpp).
Run train_layout(const DeviceMesh<Mesh>& mesh, const std::string& layout, const Options& o, bool print) {
  init::InitKeys keys(2024);
  const nn::TrainerOptions options{.max_norm = 0.5,
                                   .ddp = {.bucket_cap_bytes = 4096, .first_bucket_cap_bytes = 2048}};
  if (o.checkpoint) { // tp or ddp: replicated parameters
    nn::DdpTrainer<Model<CheckpointedBlock>> t(mesh, {mesh, o.model, 3, keys, o.device}, options);
    return train(t, o, print);
  }
  if (layout == "tp_cm") {
    using Overlapped = nn::LanguageModel<float, Lcm, nn::MlpBlock>;
    nn::DdpTrainer<Overlapped> t(mesh, {mesh, o.model, 3, keys, o.device}, options);
    return train(t, o, print);
  }
  return nn::with_trainer(data_layout(layout), mesh, Model<nn::MlpBlock>(mesh, o.model, 3, keys, o.device),
                          options, [&](auto& trainer) { return train(trainer, o, print); });
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "06_train: %s\nusage: 06_train [--layout tp|tp_cm|ddp|fsdp|hsdp|fsdp_tp] [--mesh REP,DP,TP] "
               "[--steps N] "
               "[--batch B] [--seq S] [--hidden H] [--ffn F] [--vocab V] [--checkpoint] [--no-check]\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-check") {
      o.check = false;
      continue;
    }
    if (a == "--checkpoint") {
      o.checkpoint = true;
      continue;
    }
    if (i + 1 >= argc) {
      usage(a + " needs a value");
    }
    const std::string v = argv[++i];
    if (a == "--layout") {
      o.layout = v;
    } else if (a == "--mesh") {
      o.mesh = v;
    } else if (a == "--steps") {
      o.steps = std::atoi(v.c_str());
    } else if (a == "--batch" || a == "--seq" || a == "--hidden" || a == "--ffn" || a == "--vocab") {
      std::int64_t& x = a == "--batch"    ? o.batch
                        : a == "--seq"    ? o.seq
                        : a == "--hidden" ? o.model.hidden
                        : a == "--ffn"    ? o.model.ffn
                                          : o.model.vocab;
      x = std::atoll(v.c_str());
    } else {
      usage("unknown flag " + a);
    }
  }
  return o;
}

/// The (rep, dp, tp) mesh of `o`'s layout on n ranks (--mesh, or the layout's); exits 2 (usage) when there is
/// none.
std::array<int, 3> mesh_for(const Options& o, int n) {
  std::array<int, 3> m{};
  try {
    m = nn::data_layout_mesh(data_layout(o.layout), n);
  } catch (const Error& e) {
    usage(e.what());
  }
  if (o.checkpoint && o.layout != "tp" && o.layout != "ddp") {
    usage("--checkpoint is for tp and ddp (the FSDP layouts recompute a block's forward anyway)");
  }
  if (!o.mesh.empty() && std::sscanf(o.mesh.c_str(), "%d,%d,%d", &m[0], &m[1], &m[2]) != 3) {
    usage("--mesh takes REP,DP,TP, not " + o.mesh);
  }
  if (m[0] * m[1] * m[2] != n || o.steps < 1) {
    usage("the mesh (" + std::to_string(m[0]) + ", " + std::to_string(m[1]) + ", " + std::to_string(m[2]) +
          ") does not have the " + std::to_string(n) + " ranks, or --steps < 1");
  }
  return m;
}

} // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  if (testing::validate_only()) { // gpu_check.sh --dry-run: the flags and the launch, nothing run
    const auto [rep, dp, tp] = mesh_for(o, read_dist_env().world_size);
    return testing::validated("06_train", "layout " + o.layout + " on (rep=" + std::to_string(rep) +
                                              ", dp=" + std::to_string(dp) + ", tp=" + std::to_string(tp) +
                                              "), " + std::to_string(o.steps) + " steps");
  }
  InitOptions init; // the host build: the backend init_process_group picks (gloo; MPI under mpirun)
#if DTENSOR_TRAIN_CUDA
  if (const CudaDevices visible = probe_cuda_devices(); visible.count == 0) {
    if (visible.unusable()) { // a GPU CUDA cannot use (an old driver) is an error, never a skip
      std::fprintf(stderr, "06_train: CUDA cannot use this machine's GPU: %s\n", visible.reason().c_str());
      return 1;
    }
    std::printf("06_train: no CUDA device visible (%s): skipped\n", visible.reason().c_str());
    return 77; // ctest's skip code
  }
  if (std::getenv("DTENSOR_TEST_HOSTID_PER_RANK") != nullptr) {
    const std::string id = "dtensor-06-train-host-" + std::to_string(read_dist_env().rank);
    ::setenv("NCCL_HOSTID", id.c_str(), 1);
  }
  init.backend = "nccl"; // on cuda:(LOCAL_RANK mod the visible devices), which becomes the current device
#endif
  ProcessGroup world = init_process_group(init);
#if DTENSOR_TRAIN_CUDA
  int index = 0;
  detail::check_cuda(cudaGetDevice(&index), "cudaGetDevice", "06_train");
  o.device = Device::cuda(index);
#endif
  const int n = world.size();
  const bool print = world.rank() == 0;
  const auto [rep, dp, tp] = mesh_for(o, n);
  if (print) {
    std::printf(
        "training 3 blocks (hidden %lld, ffn %lld, vocab %lld, %lld x %lld tokens a step, float on %s) "
        "for %d steps, layout %s on (rep=%d, dp=%d, tp=%d) over %s, AdamW, clip at 0.5\n",
        (long long)o.model.hidden, (long long)o.model.ffn, (long long)o.model.vocab, (long long)o.batch,
        (long long)o.seq, o.device.to_string().c_str(), o.steps, o.layout.c_str(), rep, dp, tp,
        std::string(world.backend_name()).c_str());
  }
  const Run got = train_layout(init_device_mesh<Mesh>(world, rep, dp, tp), o.layout, o, print);
  if (print) {
    std::printf("%.2f ms a step on rank 0, of which %.2f ms waiting on the data-parallel communication\n",
                got.seconds * 1e3, got.blocked * 1e3);
  }
  if (!o.check) {
    return 0;
  }
  // The same training on one rank: a group of this rank alone, a (1, 1, 1) mesh, replicated parameters.
  const ProcessGroup one = world.new_group({world.rank()});
  const Run want = train_layout(init_device_mesh<Mesh>(one, 1, 1, 1), "ddp", o, false);
  double loss_diff = 0, param_diff = 0;
  for (std::size_t s = 0; s < want.losses.size(); ++s) {
    loss_diff = std::max(loss_diff, std::abs(got.losses[s] - want.losses[s]) / std::abs(want.losses[s]));
  }
  for (std::size_t i = 0; i < want.params.size(); ++i) {
    for (std::size_t e = 0; e < want.params[i].size(); ++e) {
      const double x = got.params[i][e], y = want.params[i][e];
      param_diff = std::max(param_diff, std::abs(x - y) / std::max(1.0, std::abs(y)));
    }
  }
  const bool ok = got.params.size() == want.params.size() && loss_diff <= 1e-4 && param_diff <= 1e-4;
  if (print || !ok) {
    std::printf(
        "rank %d against one rank: max relative difference of the losses %.1e, of the final parameters "
        "%.1e (tolerance 1e-4): %s\n",
        world.rank(), loss_diff, param_diff, ok ? "OK" : "MISMATCH");
  }
  return ok ? 0 : 1;
}

// No host synchronisation per op (issue 52, item 4): a training step on CUDA tensors of the emulated device
// (tests/support/emulated_cuda) blocks the host only where it reads a value, and the count is pinned.
// The model of examples/06_train.cpp (nn::LanguageModel of nn::MlpBlock: embedding, blocks, norm and the
// vocab-parallel head with its loss) under nn::DdpTrainer and nn::FsdpTrainer with AdamW and clipping, on a
// one-rank mesh of the fake backend (its collectives move CUDA buffers as emulated kernels). The second
// step is counted (the first creates the optimizer's state):
//  - dtensor's own count (core/cuda_sync.hpp's host_sync_counts) equals the emulated runtime's count of
//    cudaStreamSynchronize and cudaDeviceSynchronize calls: no wait bypasses the counted wrapper;
//  - it is pinned, site by site (printed on a mismatch), and is far below the kernels the step runs;
//  - the same steps on host tensors give the same losses (the device paths compute what the host's do).
// A change that adds a host wait to the step fails here and says where.

#include <catch2/catch.hpp>

#include "dtensor/comm/init.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/nn/mlp_block.hpp"
#include "dtensor/nn/model.hpp"
#include "dtensor/tensor/distribute.hpp"
#include "dtensor/train/fsdp.hpp"
#include "dtensor/train/optim.hpp"
#include "dtensor/train/trainer.hpp"

#include "../support/emulated_cuda/emulated_cuda.hpp"

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace {

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp">>;
using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using Model = nn::LanguageModel<float, L, nn::MlpBlock>;

constexpr std::int64_t kBatch = 3, kSeq = 13;
const nn::TransformerConfig kConfig{.vocab = 37, .hidden = 18, .ffn = 30, .norm_eps = 1e-6, .init_std = 0.5};

nn::ids_t<L> tokens(const DeviceMesh<Mesh>& mesh, int step, bool targets, Device device) {
  return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
    return from_global_index<std::int64_t, Q...>(
        mesh, {kBatch, kSeq},
        [&](const auto& i) {
          const std::int64_t id = (step * 31 + i[0] * kSeq * 7 + i[1] * 11) % kConfig.vocab;
          return targets ? (3 * id + 1) % kConfig.vocab : id;
        },
        device);
  }(static_cast<nn::ids_t<L>*>(nullptr));
}

/// What a counted step did: its loss, the host waits (dtensor's and the runtime's count), the kernels.
struct Counted {
  std::vector<double> losses;
  HostSyncCounts syncs;
  std::int64_t runtime_syncs = 0;
  std::int64_t kernels = 0;
};

template <class Trainer>
Counted train(Trainer& trainer, Device device) {
  optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
  Counted c;
  for (int s = 0; s < 2; ++s) {
    const auto ids = tokens(trainer.mesh(), s, false, device),
               targets = tokens(trainer.mesh(), s, true, device);
    const HostSyncCounts before = host_sync_counts();
    const emulated_cuda::Counters runtime_before = emulated_cuda::counters();
    c.losses.push_back(trainer.step(ids, targets, opt).loss);
    if (s == 1) {
      const emulated_cuda::Counters runtime = emulated_cuda::counters();
      c.syncs = host_sync_counts() - before;
      c.runtime_syncs = runtime.stream_syncs + runtime.device_syncs - runtime_before.stream_syncs -
                        runtime_before.device_syncs;
      c.kernels = runtime.kernels - runtime_before.kernels;
    }
  }
  return c;
}

const nn::TrainerOptions kOptions{.max_norm = 0.5,
                                  .ddp = {.bucket_cap_bytes = 4096, .first_bucket_cap_bytes = 2048}};

template <class Trainer>
Counted run(Device device) {
  const auto mesh = init_device_mesh<Mesh>(fake_world(0, 1), 1, 1);
  init::InitKeys keys(2024);
  Trainer trainer(mesh, {mesh, kConfig, 3, keys, device}, kOptions);
  return train(trainer, device);
}

template <class Trainer>
void check_step(const std::map<std::string, std::uint64_t>& pinned) {
  const Counted host = run<Trainer>(Device::cpu());
  CHECK(host.syncs.total == 0); // host tensors: nothing to wait for
  const Counted cuda = run<Trainer>(Device::cuda(0));
  INFO("host waits of the step: " << cuda.syncs.to_string() << "; " << cuda.kernels << " kernels");
  for (std::size_t s = 0; s < host.losses.size(); ++s) {
    CHECK(std::abs(cuda.losses[s] - host.losses[s]) <= 1e-4 * std::abs(host.losses[s]));
  }
  CHECK(static_cast<std::int64_t>(cuda.syncs.total) == cuda.runtime_syncs); // every wait is counted
  CHECK(cuda.syncs.by_site == pinned);
  CHECK(cuda.kernels >= 8 * static_cast<std::int64_t>(cuda.syncs.total));
}

} // namespace

// The step's host waits: the loss's rows and sums read for its value (4) and the value itself (1); the
// global norm's clip: one local norm per gradient (12 parameters: embedding, 3 blocks of norm + 2 weights,
// the final norm, the head); on this mesh of one rank no total (its all_reduce, over axes of size 1, does
// not run). Nothing per kernel: the step runs 160-190 of them.
const std::map<std::string, std::uint64_t> kStepWaits{
    {"clip_grad_norm: a gradient's local norm: Tensor::copy_from (to the host)", 12},
    {"cross_entropy: the loss's sum and count: Tensor::copy_from (to the host)", 1},
    {"cross_entropy: the rows' maxima, sums and targets: Tensor::copy_from (to the host)", 3},
    {"the loss's value: Tensor::copy_from (to the host)", 1}};

TEST_CASE("a DDP training step on CUDA tensors waits on the device only to read values",
          "[emulated][syncs]") {
  check_step<nn::DdpTrainer<Model>>(kStepWaits);
}

TEST_CASE("an FSDP training step on CUDA tensors waits on the device only to read values",
          "[emulated][syncs]") {
  check_step<nn::FsdpTrainer<Model, Fsdp<"dp">>>(kStepWaits);
}

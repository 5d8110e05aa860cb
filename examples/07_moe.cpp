// 07: a mixture-of-experts layer (nn::Moe) on a (dp, ep) mesh of 4 processes, 2 x 2: 8 experts sharded over
// ep (4 per rank), replicated over dp; top-2 routing with a capacity factor, the load-balancing loss;
// dispatch and combine by all_to_all_single with variable splits over ep, the counts all_gathered over the
// batch. Forward and backward; every rank checks the output, the input's gradient and every parameter's
// gradient (full tensors) against the same layer run in one process on the whole batch. Then the MoE GPT
// (nn::LanguageModel of nn::MoeBlock: GQA attention and the mixture in every block) trained three AdamW steps
// by nn::DdpTrainer on the same mesh (EP x DP): every step's loss and the final parameters against the same
// training in one process.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_07_moe

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/block.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/nn/moe.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"ep">>;
using L = nn::Layout<Mesh, nn::ExpertParallel<"ep">>;

constexpr std::int64_t kBatch = 6, kSeq = 8, kHidden = 16;
constexpr nn::MoeConfig kConfig{
    .experts = 8, .top_k = 2, .ffn = 32, .capacity_factor = 1.25, .aux_loss_coeff = 0.01, .init_std = 0.3};

struct Result {
  std::vector<std::vector<double>> tensors; ///< y, dx, the router's, W1's, W3's, W2's gradients (full)
  nn::MoeStats stats;
  std::string comm;
};

Result run(const DeviceMesh<Mesh>& mesh) {
  init::InitKeys keys(1);
  nn::Moe<double, L> moe(mesh, kHidden, kConfig, keys);
  const auto x =
      from_global_index<double, Shard<0>, Shard<0>>(mesh, {kBatch, kSeq, kHidden}, [](const auto& i) {
        return std::sin(double(i[0] * 131 + i[1] * 17 + i[2]));
      });
  Result r;
  CommDebugMode comm;
  auto [y, back] = moe.forward(x, with_backward);
  auto [dx, grads] = back(y); // the gradient of 0.5 * |y|^2 (+ 0.01 * the load-balancing loss)
  r.comm = comm.to_string();
  r.stats = moe.stats();
  const auto keep = [&](const auto& t) {
    const auto full = t.full_tensor();
    r.tensors.emplace_back(full.data(), full.data() + full.numel());
  };
  keep(y);
  keep(dx);
  std::apply([&](const auto&... g) { (keep(g), ...); }, grads);
  return r;
}

using Gpt = nn::LanguageModel<double, L, nn::MoeBlock>;
const nn::TransformerConfig kGpt{.vocab = 29,
                                 .hidden = 16,
                                 .heads = 4,
                                 .kv_heads = 2,
                                 .ffn = 24,
                                 .norm_eps = 1e-6,
                                 .init_std = 0.3,
                                 .moe = kConfig};

/// Three AdamW steps of the MoE GPT: the losses, then every parameter (full tensors).
std::pair<std::vector<double>, std::vector<double>> train_gpt(const DeviceMesh<Mesh>& mesh) {
  init::InitKeys keys(5);
  nn::DdpTrainer<Gpt, "dp"> trainer(mesh, Gpt(mesh, kGpt, /*layers=*/2, keys), {.max_norm = 1.0});
  optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
  std::vector<double> losses, params;
  for (int step = 0; step < 3; ++step) {
    const auto ids = [&](int shift) {
      return from_global_index<std::int64_t, Shard<0>, Shard<0>>(mesh, {kBatch, kSeq}, [&](const auto& i) {
        return (i[0] * 11 + i[1] * 5 + step * 3 + shift + i[1] * i[1]) % kGpt.vocab;
      });
    };
    losses.push_back(trainer.step(ids(0), ids(1), opt).loss);
  }
  trainer.with_gathered([&](auto& m) {
    nn::for_each_tensor(m.parameters(), [&](const auto& w) {
      const auto full = w.full_tensor();
      params.insert(params.end(), full.data(), full.data() + full.numel());
    });
  });
  return {losses, params};
}

} // namespace

int main() {
  ProcessGroup world = init_process_group();
  const auto mesh = init_device_mesh<Mesh>(world, 2, world.size() / 2);
  const Result got = run(mesh);
  Result want;
  testing::run_ranks(1, [&](ProcessGroup& one) { want = run(init_device_mesh<Mesh>(one, 1, 1)); });
  double diff = 0;
  for (std::size_t t = 0; t < want.tensors.size(); ++t) {
    for (std::size_t e = 0; e < want.tensors[t].size(); ++e) {
      diff = std::max(diff,
                      std::abs(got.tensors[t][e] - want.tensors[t][e]) / (1 + std::abs(want.tensors[t][e])));
    }
  }
  const bool ok = diff <= 1e-12 && got.stats.dropped == want.stats.dropped &&
                  std::abs(got.stats.aux_loss - want.stats.aux_loss) <= 1e-12;
  std::printf(
      "rank %d: %lld tokens in the batch, %lld of %lld assignments dropped (capacity %lld per expert), "
      "load-balancing loss %.6f, max relative difference from one process %.1e%s\n",
      world.rank(), static_cast<long long>(got.stats.tokens), static_cast<long long>(got.stats.dropped),
      static_cast<long long>(got.stats.tokens * kConfig.top_k), static_cast<long long>(got.stats.capacity),
      got.stats.aux_loss, diff, ok ? "" : "  MISMATCH");
  if (world.rank() == 0) {
    std::printf("rank 0's communication (forward and backward):\n%s", got.comm.c_str());
  }
  // The MoE GPT on (dp=2, ep=2), against one process.
  const auto [losses, params] = train_gpt(mesh);
  std::pair<std::vector<double>, std::vector<double>> one;
  testing::run_ranks(1, [&](ProcessGroup& p) { one = train_gpt(init_device_mesh<Mesh>(p, 1, 1)); });
  double gpt_diff = 0;
  for (std::size_t i = 0; i < losses.size(); ++i) {
    gpt_diff = std::max(gpt_diff, std::abs(losses[i] - one.first[i]) / std::abs(one.first[i]));
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    gpt_diff =
        std::max(gpt_diff, std::abs(params[i] - one.second[i]) / std::max(1.0, std::abs(one.second[i])));
  }
  const bool gpt_ok = params.size() == one.second.size() && gpt_diff <= 1e-10;
  if (world.rank() == 0 || !gpt_ok) {
    std::printf(
        "rank %d: the MoE GPT on (dp=2, ep=2), 3 steps: losses %.6f %.6f %.6f, max relative difference "
        "from one process (losses, %zu parameters) %.1e%s\n",
        world.rank(), losses[0], losses[1], losses[2], params.size(), gpt_diff, gpt_ok ? "" : "  MISMATCH");
  }
  return ok && gpt_ok ? 0 : 1;
}

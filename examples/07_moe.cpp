// 07: a mixture-of-experts layer (nn::Moe) on a (dp, ep) mesh of 4 processes, 2 x 2: 8 experts sharded over
// ep (4 per rank), replicated over dp; top-2 routing with a capacity factor, the load-balancing loss;
// dispatch and combine by all_to_all_single with variable splits over ep, the counts all_gathered over the
// batch. Forward and backward; every rank checks the output, the input's gradient and every parameter's
// gradient (full tensors) against the same layer run in one process on the whole batch.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_07_moe

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/parallel/layers/moe.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
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
  return ok ? 0 : 1;
}

// 07: a mixture-of-experts layer on an expert-parallel group of 4 processes: 8 experts (2 per rank), top-2
// routing with a capacity factor, dispatch and combine by all_to_all_single with variable splits, forward and
// backward; each rank checks its outputs and its experts' gradients against the same mixture run in one
// process over every rank's tokens.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_07_moe

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/parallel/moe.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

constexpr MoEConfig kConfig{16, 32, 8, 2, 1.25};

Tensor<double, 2> tokens(int rank) {
  return local::randn<double, 2>({10 + 3 * rank, kConfig.hidden}, 42, static_cast<std::uint64_t>(rank));
}

double max_difference(const Tensor<double, 2>& a, const Tensor<double, 2>& b) {
  double d = 0;
  for (std::int64_t e = 0; e < a.numel(); ++e) {
    d = std::max(d, std::abs(a.data()[e] - b.data()[e]));
  }
  return d;
}

} // namespace

int main() {
  ProcessGroup ep = init_process_group();
  const int r = ep.rank();
  MoE<double> moe(ep, kConfig, 1);
  const Tensor<double, 2> x = tokens(r);
  CommDebugMode comm;
  auto [y, back] = moe.forward(x, with_backward);
  const MoEGrads<double> g = back(y); // the gradient of 0.5 * |y|^2
  const std::string traffic = comm.to_string();
  // The same mixture in one process: every rank's tokens through all 8 experts (an in-process group of 1).
  double diff = 0;
  std::int64_t dropped_one = 0;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    MoE<double> all(one, kConfig, 1);
    for (int q = 0; q < ep.size(); ++q) {
      auto [yq, bq] = all.forward(tokens(q), with_backward);
      const MoEGrads<double> gq = bq(yq);
      if (q == r) {
        diff = std::max(diff, max_difference(y, yq));
        diff = std::max(diff, max_difference(g.dx, gq.dx));
        dropped_one = bq.dropped();
      }
    }
  });
  // The experts' gradients sum over every rank's tokens: compare this rank's experts with one process.
  testing::run_ranks(1, [&](ProcessGroup& one) {
    MoE<double> all(one, kConfig, 1);
    std::vector<Tensor<double, 2>> w1(moe.local_experts());
    for (int q = 0; q < ep.size(); ++q) {
      auto [yq, bq] = all.forward(tokens(q), with_backward);
      const MoEGrads<double> gq = bq(yq);
      for (int j = 0; j < moe.local_experts(); ++j) {
        const auto& part = gq.w1[static_cast<std::size_t>(r * moe.local_experts() + j)];
        w1[j] = q == 0 ? part.clone() : local::map(local::Add{}, w1[j], part);
      }
    }
    for (int j = 0; j < moe.local_experts(); ++j) {
      diff = std::max(diff, max_difference(g.w1[j], w1[j]));
    }
  });
  Tensor<std::int64_t, 1> dropped({1});
  dropped(0) = back.dropped();
  all_reduce(dropped, ReduceOp::sum, ep);
  const bool ok = diff <= 1e-12 && back.dropped() == dropped_one;
  std::printf(
      "rank %d: %lld tokens, %lld of its assignments dropped, max |difference from one process| %.1e%s\n", r,
      static_cast<long long>(x.shape()[0]), static_cast<long long>(back.dropped()), diff,
      ok ? "" : "  MISMATCH");
  if (r == 0) {
    std::printf("dropped over all ranks: %lld; rank 0's communication:\n%s",
                static_cast<long long>(dropped(0)), comm.to_string().c_str());
  }
  return ok ? 0 : 1;
}

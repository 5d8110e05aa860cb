// 08: a 4-stage pipeline, one stage per process, trained one step with the 1F1B schedule over 8
// micro-batches (every neighbour exchange one batch_isend_irecv); each stage checks its weight gradient and
// the last stage the losses against the same model run unpipelined in one process, and prints the measured
// idle fraction next to the bubble formula (p - 1) / (m + p - 1).
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_08_pipeline

#include <dtensor/comm/init.hpp>
#include <dtensor/local/gemm.hpp>
#include <dtensor/local/pointwise.hpp>
#include <dtensor/local/random.hpp>
#include <dtensor/parallel/pipeline.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <utility>

using namespace dtensor;
using M = Tensor<double, 2>;

namespace {

constexpr std::int64_t kRows = 16, kHidden = 64;
constexpr int kMicrobatches = 8;

M weight(int s) {
  return local::map(local::Scale{1.0 / 8},
                    local::randn<double, 2>({kHidden, kHidden}, 1, static_cast<std::uint64_t>(s)));
}
M data(int mb) {
  return local::randn<double, 2>({kRows, kHidden}, 2, static_cast<std::uint64_t>(mb));
}

/// y = gelu(x W); the last stage's loss is 0.5 |y|^2.
struct Stage {
  int s = 0;
  bool last = false;
  M w, dw;
  std::map<int, std::pair<M, M>> saved;
  std::map<int, double> loss;

  M forward(int mb, const M& in) {
    const M x = s == 0 ? data(mb) : in;
    const M pre = local::matmul(x, w);
    M y = local::map(local::Gelu{}, pre);
    saved[mb] = {x, pre};
    if (last) {
      double l = 0;
      for (std::int64_t e = 0; e < y.numel(); ++e) {
        l += 0.5 * y.data()[e] * y.data()[e];
      }
      loss[mb] = l;
    }
    return y;
  }
  M backward(int mb, const M& dout) {
    auto [x, pre] = saved.at(mb);
    saved.erase(mb);
    const M dy = last ? local::map(local::Gelu{}, pre) : dout;
    const M dpre = local::map(local::BackwardOf<local::Gelu>{}, pre, dy);
    const M g = local::matmul(x, dpre, true, false);
    dw = dw.numel() == 0 ? g : local::map(local::Add{}, dw, g);
    return local::matmul(dpre, w, false, true);
  }
};

} // namespace

int main() {
  ProcessGroup pp = init_process_group();
  const int p = pp.size();
  Stage st;
  st.s = pp.rank();
  st.last = st.s == p - 1;
  st.w = weight(st.s);
  PipelineStage<double> stage;
  stage.forward = [&](int mb, const M& in) { return st.forward(mb, in); };
  stage.backward = [&](int mb, const M& g) { return st.backward(mb, g); };
  stage.input_shape = {kRows, kHidden};
  stage.output_shape = {kRows, kHidden};
  const PipelineStats stats = run_pipeline(pp, stage, kMicrobatches, {Schedule::one_f_one_b});

  // The unpipelined model in this process.
  std::vector<Stage> all(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s) {
    all[s].s = s;
    all[s].last = s == p - 1;
    all[s].w = weight(s);
  }
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    M a;
    for (auto& s : all) {
      a = s.forward(mb, a);
    }
    M g;
    for (int s = p - 1; s >= 0; --s) {
      g = all[s].backward(mb, g);
    }
  }
  double diff = 0;
  for (std::int64_t e = 0; e < st.dw.numel(); ++e) {
    diff = std::max(diff, std::abs(st.dw.data()[e] - all[st.s].dw.data()[e]));
  }
  if (st.last) {
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      diff = std::max(diff, std::abs(st.loss[mb] - all[p - 1].loss[mb]));
    }
  }
  const bool ok = diff <= 1e-12;
  std::printf(
      "stage %d: %d forwards, %d backwards, idle %.0f%% of %.1f ms (bubble formula %.0f%%), max |difference "
      "from unpipelined| %.1e%s\n",
      st.s, stats.forwards, stats.backwards, 100 * stats.idle_fraction(), 1e3 * stats.total_s,
      100 * pipeline_bubble(p, kMicrobatches), diff, ok ? "" : "  MISMATCH");
  return ok ? 0 : 1;
}

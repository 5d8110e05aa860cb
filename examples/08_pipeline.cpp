// 08: a pipeline of DTensor stages. Four processes as a (pp = 2, tp = 2) mesh: each pp rank is a pipeline
// stage whose blocks (nn::MlpBlock: RMSNorm and a SwiGLU MLP, tensor + sequence parallel over its tp pair)
// run on its (tp) sub-mesh, and the activations cross the stages as DTensors with their placements
// (run_pipeline, train/pipeline_run.hpp). The same 4 micro-batches run under GPipe, 1F1B (2 model stages,
// one per pp rank) and interleaved 1F1B (4 model stages, 2 chunks per pp rank); every micro-batch's output,
// its input gradient and every block's parameter gradients are checked against the same blocks run one
// after the other in this process, and each rank prints its order and idle fraction next to the bubble
// formula (p - 1) / (v m + p - 1) (the formula holds for equal stage times and free transfers; on a machine
// with fewer cores than processes the idle time also holds the waits for a core).
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_08_pipeline

#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/mlp_block.hpp>
#include <dtensor/train/pipeline_run.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"pp">, Axis<"tp">>;
using StageMesh = MeshShape<Axis<"tp">>;
using L = nn::Layout<StageMesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using Block = nn::MlpBlock<double, L>;
using Act = nn::act_t<L, double>; // (batch, sequence, hidden): the sequence sharded over tp
constexpr int kMicrobatches = 4;
constexpr std::int64_t kRows = 2, kSeq = 6, kHidden = 16;
const nn::TransformerConfig config{.hidden = kHidden, .ffn = 24, .norm_eps = 1e-6, .init_std = 0.3};

/// Micro-batch mb's input (salt 0), and the gradient the last stage's loss gives its output (salt 1).
Act pattern(const DeviceMesh<StageMesh>& mesh, int mb, int salt) {
  return from_global_index<double, Shard<1>>(mesh, {kRows, kSeq, kHidden}, [&](const auto& i) {
    return std::sin(0.37 * double(i[0] * 53 + i[1] * 11 + i[2]) + mb + 5.0 * salt);
  });
}
Block block_of(const DeviceMesh<StageMesh>& mesh, int stage) {
  init::InitKeys keys(7 + static_cast<std::uint64_t>(stage)); // the same weights on any mesh
  return Block(mesh, config, keys);
}
std::vector<double> full_of(const auto& t) {
  const auto f = t.full_tensor();
  return {f.data(), f.data() + f.numel()};
}

/// Per micro-batch the output and the input gradient; per model stage its blocks' gradients (summed).
struct Result {
  std::map<int, std::vector<double>> y, dx;
  std::map<int, std::vector<std::vector<double>>> grads;
};

void add_into(std::vector<std::vector<double>>& sum, const auto& grads) {
  std::vector<std::vector<double>> g;
  std::apply([&](const auto&... w) { (g.push_back(full_of(w)), ...); }, grads);
  if (sum.empty()) {
    sum = std::move(g);
    return;
  }
  for (std::size_t i = 0; i < g.size(); ++i) {
    for (std::size_t e = 0; e < g[i].size(); ++e) {
      sum[i][e] += g[i][e];
    }
  }
}

/// The `stages` blocks one after the other on this process alone.
Result sequential(const DeviceMesh<StageMesh>& one, int stages) {
  std::vector<Block> blocks;
  for (int g = 0; g < stages; ++g) {
    blocks.push_back(block_of(one, g));
  }
  using Back = decltype(blocks[0].forward(std::declval<const Act&>(), with_backward).backward);
  Result r;
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    Act h = pattern(one, mb, 0);
    std::vector<Back> backs;
    for (const Block& b : blocks) {
      auto [y, back] = b.forward(h, with_backward);
      backs.push_back(std::move(back));
      h = std::move(y);
    }
    r.y[mb] = full_of(h);
    Act d = pattern(one, mb, 1);
    for (int g = stages - 1; g >= 0; --g) {
      auto [dx, grads] = backs[std::size_t(g)](d);
      add_into(r.grads[g], grads);
      d = std::move(dx);
    }
    r.dx[mb] = full_of(d);
  }
  return r;
}

/// The pipeline under `schedule` with v chunks per pp rank; checks this rank's part against `want`.
bool pipelined(const DeviceMesh<Mesh>& mesh, Schedule schedule, int v, const ProcessGroup& alone) {
  const auto stage = mesh.slice<"tp">();
  const int p = mesh.size<"pp">(), s = mesh.local_rank<"pp">(), stages = p * v;
  std::vector<Block> blocks; // chunk c is model stage c p + s
  for (int c = 0; c < v; ++c) {
    blocks.push_back(block_of(stage, c * p + s));
  }
  using Back = decltype(blocks[0].forward(std::declval<const Act&>(), with_backward).backward);
  std::map<std::pair<int, int>, Back> saved;
  Result got;
  PipelineChunks<Act> chunks;
  chunks.forward = [&](int c, int mb, std::optional<Act> in) {
    auto [y, back] = blocks[std::size_t(c)].forward(in ? *in : pattern(stage, mb, 0), with_backward);
    saved.emplace(std::pair{c, mb}, std::move(back));
    if (c * p + s == stages - 1) {
      got.y[mb] = full_of(y);
    }
    return y;
  };
  chunks.backward = [&](int c, int mb, std::optional<Act> dout) -> std::optional<Act> {
    const int g = c * p + s;
    const auto it = saved.find({c, mb});
    auto [dx, grads] = it->second(dout ? *dout : pattern(stage, mb, 1));
    saved.erase(it);
    add_into(got.grads[g], grads);
    if (g == 0) {
      got.dx[mb] = full_of(dx);
      return std::nullopt;
    }
    return dx;
  };
  const PipelineRunStats stats = run_pipeline(
      mesh.group<"pp">(), stage, chunks,
      {.schedule = schedule, .shape = {.stages = p, .microbatches = kMicrobatches, .chunks = v}});

  const Result want = sequential(init_device_mesh<StageMesh>(alone, 1), stages);
  double diff = 0;
  const auto compare = [&](const std::vector<double>& a, const std::vector<double>& b) {
    for (std::size_t e = 0; e < a.size(); ++e) {
      diff = std::max(diff, std::abs(a[e] - b[e]));
    }
  };
  for (const auto& [mb, y] : got.y) {
    compare(y, want.y.at(mb));
  }
  for (const auto& [mb, dx] : got.dx) {
    compare(dx, want.dx.at(mb));
  }
  for (const auto& [g, gs] : got.grads) {
    for (std::size_t i = 0; i < gs.size(); ++i) {
      compare(gs[i], want.grads.at(g)[i]);
    }
  }
  const bool ok = diff <= 1e-12;
  std::string order;
  for (const PipelineAction& a : stats.order) {
    order += (order.empty() ? "" : " ") + a.to_string(v > 1);
  }
  if (mesh.local_rank<"tp">() == 0) {
    std::printf("%-16s pp rank %d: %s\n%16s idle %.0f%% of %.1f ms (bubble formula %.0f%%), max |difference "
                "from the blocks in one process| %.1e%s\n",
                schedule_name(schedule), s, order.c_str(), "", 100 * stats.idle_fraction(),
                1e3 * stats.total_s, 100 * pipeline_bubble(p, kMicrobatches, v), diff,
                ok ? "" : "  MISMATCH");
    std::fflush(stdout);
  }
  return ok;
}

} // namespace

int main() {
  ProcessGroup world = init_process_group();
  if (world.size() % 2 != 0) {
    std::fprintf(stderr, "08_pipeline: run on an even number of processes (pp = n / 2, tp = 2)\n");
    return 2;
  }
  const auto mesh = init_device_mesh<Mesh>(world, world.size() / 2, 2);
  const ProcessGroup alone = world.new_group({world.rank()});
  bool ok = true;
  ok = pipelined(mesh, Schedule::gpipe, 1, alone) && ok;
  ok = pipelined(mesh, Schedule::one_f_one_b, 1, alone) && ok;
  ok = pipelined(mesh, Schedule::interleaved_one_f_one_b, 2, alone) && ok;
  return ok ? 0 : 1;
}

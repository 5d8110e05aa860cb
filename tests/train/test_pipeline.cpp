// Pipeline parallelism. The schedules as value code (pipeline_order, simulate_pipeline: orders pinned, every
// step once, forward before backward, the micro-batches held at once (GPipe m, 1F1B min(p - s, m)), the
// bubble against the formula); run_pipeline on DTensors with nn::MlpBlock chunks on (pp, dp, tp) meshes
// against one rank; and nn::PipelineTrainer: the GPT of nn:: layers pipelined with FSDP and TP inside each
// stage (PP x FSDP x TP on 8 ranks, 1F1B; interleaved 1F1B on (pp 2, dp 2), 5 layers over 4 model stages;
// GPipe on 4 stages): two AdamW steps of 4 micro-batches equal nn::DdpTrainer on one rank over the same
// micro-batches (losses, gradient norms, every parameter, within 1e-10).
#include <catch2/catch.hpp>

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/core/flop_counter.hpp>
#include <dtensor/local/gemm.hpp>
#include <dtensor/local/pointwise.hpp>
#include <dtensor/local/random.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/block.hpp>
#include <dtensor/nn/mlp_block.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/plan/dry_run.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/pipeline_run.hpp>
#include <dtensor/train/pipeline_trainer.hpp>
#include <dtensor/train/trainer.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using namespace dtensor;

namespace {

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

std::string order_string(const std::vector<PipelineAction>& order, bool chunks) {
  std::string s;
  for (const PipelineAction& a : order) {
    s += (s.empty() ? "" : " ") + a.to_string(chunks);
  }
  return s;
}

} // namespace

TEST_CASE("pipeline_order: interleaved 1F1B's order is Megatron's (2 stages, 2 chunks, 4 micro-batches)",
          "[pipeline]") {
  const PipelineShape shape{.stages = 2, .microbatches = 4, .chunks = 2};
  CHECK(order_string(pipeline_order(Schedule::interleaved_one_f_one_b, shape, 0), true) ==
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0");
  CHECK(order_string(pipeline_order(Schedule::interleaved_one_f_one_b, shape, 1), true) ==
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0");
  CHECK(order_string(pipeline_order(Schedule::one_f_one_b, {.stages = 4, .microbatches = 6}, 1), false) ==
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5");
  CHECK(order_string(pipeline_order(Schedule::gpipe, {.stages = 2, .microbatches = 3}, 0), false) ==
        "F0 F1 F2 B2 B1 B0");
}

TEST_CASE("pipeline_order: every schedule runs each step once, never deadlocks, and its bubble is the "
          "formula",
          "[pipeline]") {
  for (Schedule schedule : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved_one_f_one_b}) {
    for (int p = 1; p <= 4; ++p) {
      for (int v = 1; v <= (schedule == Schedule::interleaved_one_f_one_b ? 3 : 1); ++v) {
        for (int m = 1; m <= 8; ++m) {
          if (schedule == Schedule::interleaved_one_f_one_b && m % p != 0) {
            continue;
          }
          const PipelineShape shape{.stages = p, .microbatches = m, .chunks = v};
          INFO(schedule_name(schedule) << " p " << p << " v " << v << " m " << m);
          for (int r = 0; r < p; ++r) {
            const auto order = pipeline_order(schedule, shape, r);
            std::map<std::pair<int, int>, int> forwards, backwards; // (mb, chunk) -> position
            for (std::size_t i = 0; i < order.size(); ++i) {
              auto& seen = order[i].kind == PipelineAction::Kind::forward ? forwards : backwards;
              CHECK(seen.emplace(std::pair{order[i].microbatch, order[i].chunk}, int(i)).second);
            }
            CHECK(forwards.size() == std::size_t(m * v));
            CHECK(backwards.size() == std::size_t(m * v));
            // The micro-batches whose activations a rank holds at once: m under GPipe; the warm-up
            // forwards plus one under 1F1B (min(p - r, m)) and interleaved 1F1B.
            int held = 0, peak = 0;
            for (const PipelineAction& a : order) {
              held += a.kind == PipelineAction::Kind::forward ? 1 : -1;
              peak = std::max(peak, held);
            }
            const int warmup =
                schedule == Schedule::one_f_one_b ? std::min(p - r - 1, m) : (p - r - 1) * 2 + (v - 1) * p;
            CHECK(peak == (schedule == Schedule::gpipe ? m : std::min(warmup + 1, m * v)));
            for (const auto& [key, at] : backwards) {
              CHECK(forwards.at(key) < at);
            }
          }
          // Forwards as long as backwards: every rank idles the bubble; backwards twice as long: a
          // schedule still runs (the timeline is the check that it cannot deadlock).
          const PipelineTimeline t = simulate_pipeline(schedule, shape);
          for (int r = 0; r < p; ++r) {
            CHECK(t.idle_fraction(r) == Approx(pipeline_bubble(p, m, v)).margin(1e-12));
          }
          (void)simulate_pipeline(schedule, shape, 1.0, 2.0);
        }
      }
    }
  }
}

TEST_CASE("pipeline_order: ZB-H1 and ZB-V run each F, B and W once, in that order, never deadlock, hold at "
          "most their bound, and ZB-H1's bubble is the formula, a third of 1F1B's idle time",
          "[pipeline]") {
  using K = PipelineAction::Kind;
  // ZB-H1 on 4 ranks, 8 micro-batches: rank r is 1F1B with its first r W's deferred.
  CHECK(order_string(pipeline_order(Schedule::zero_bubble_h1, {.stages = 4, .microbatches = 8}, 0), false) ==
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7");
  CHECK(order_string(pipeline_order(Schedule::zero_bubble_h1, {.stages = 4, .microbatches = 8}, 3), false) ==
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7");
  for (Schedule schedule : {Schedule::zero_bubble_h1, Schedule::zero_bubble_v}) {
    const int v = schedule == Schedule::zero_bubble_v ? 2 : 1;
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 8; ++m) {
        const PipelineShape shape{.stages = p, .microbatches = m, .chunks = v};
        INFO(schedule_name(schedule) << " p " << p << " m " << m);
        for (int r = 0; r < p; ++r) {
          std::map<std::tuple<int, int, int>, int> seen; // (kind, mb, chunk) -> position
          const auto order = pipeline_order(schedule, shape, r);
          for (std::size_t i = 0; i < order.size(); ++i) {
            CHECK(seen.emplace(std::tuple{int(order[i].kind), order[i].microbatch, order[i].chunk}, int(i))
                      .second);
          }
          CHECK(order.size() == std::size_t(3 * m * v));
          for (int mb = 0; mb < m; ++mb) {
            for (int c = 0; c < v; ++c) {
              CHECK(seen.at({int(K::forward), mb, c}) < seen.at({int(K::backward), mb, c}));
              CHECK(seen.at({int(K::backward), mb, c}) < seen.at({int(K::weight), mb, c}));
            }
          }
        }
        // At 1F1B's memory: p micro-batches from F to W (ZB-V: 2p chunks of half the layers).
        for (const auto& [f, b, w] : {std::tuple{1.0, 1.0, 1.0}, {1.0, 2.0, 1.5}, {2.0, 1.0, 0.5}}) {
          const PipelineTimeline t = simulate_pipeline(schedule, shape, f, b, w);
          for (int r = 0; r < p; ++r) {
            CHECK(t.peak_activations[std::size_t(r)] <= p * v);
          }
        }
        const PipelineTimeline zb = simulate_pipeline(schedule, shape, 1.0 / v, 1.0 / v, 1.0 / v);
        const PipelineTimeline one =
            simulate_pipeline(Schedule::one_f_one_b, {.stages = p, .microbatches = m}, 1, 1, 1);
        CHECK(zb.bubble() <= one.bubble() + 1e-12);
        if (schedule == Schedule::zero_bubble_h1 && m >= p) { // fewer W's than p - 1 cannot fill the waits
          CHECK(zb.bubble() == Approx(zero_bubble_h1_bubble(p, m)).margin(1e-12));
          CHECK(3 * (zb.makespan - zb.busy[0]) == Approx(one.makespan - one.busy[0]).margin(1e-12));
        } else if (m >= 2 * p) {
          // Only the fill: the last rank's first input comes after p - 1 chunk forwards.
          const double fill = (p - 1) * 0.5, busy = 3.0 * m;
          CHECK(zb.makespan == Approx(busy + fill).margin(1e-12));
          CHECK(zb.bubble() <= zero_bubble_h1_bubble(p, m) + 1e-12);
        }
      }
    }
  }
  // p = 4, m = 8, f = b = w: 1F1B 0.273, ZB-H1 0.111 (the goal: at most a third of 1F1B's + 0.05).
  const PipelineTimeline one =
      simulate_pipeline(Schedule::one_f_one_b, {.stages = 4, .microbatches = 8}, 1, 1, 1);
  const PipelineTimeline h1 =
      simulate_pipeline(Schedule::zero_bubble_h1, {.stages = 4, .microbatches = 8}, 1, 1, 1);
  CHECK(h1.bubble() <= one.bubble() / 3 + 0.05);
  CHECK_THROWS_WITH(pipeline_order(Schedule::zero_bubble_v, {.stages = 2, .microbatches = 4}, 0),
                    Catch::Contains("ZB-V runs exactly 2"));
  CHECK_THROWS_WITH(
      pipeline_order(Schedule::zero_bubble_h1, {.stages = 2, .microbatches = 4, .chunks = 2}, 0),
      Catch::Contains("ZB-H1 on 2 stages, 2 chunks per stage"));
}

TEST_CASE("simulate_pipeline: model stages of unequal cost (a timeline worked by hand)", "[pipeline]") {
  // 1F1B, 2 ranks, 2 micro-batches; stage 1 three times stage 0's cost. Rank 0 runs F0 F1 B0 B1, rank 1 F0
  // B0 F1 B1: F0 [0, 1] F1 [1, 2] on rank 0; F0 [1, 4] B0 [4, 10] F1 [10, 13] B1 [13, 19] on rank 1; then
  // B0 [10, 12] and B1 [19, 21] on rank 0.
  const PipelineShape shape{.stages = 2, .microbatches = 2};
  const PipelineTimeline t = simulate_pipeline(Schedule::one_f_one_b, shape, {1.0, 3.0}, {2.0, 6.0});
  CHECK(t.makespan == 21);
  CHECK(t.busy == std::vector<double>{6, 18});
  // Equal costs: the same timeline as the one-number form.
  const PipelineShape il{.stages = 2, .microbatches = 4, .chunks = 2};
  const PipelineTimeline a = simulate_pipeline(Schedule::interleaved_one_f_one_b, il, 1.0, 2.0);
  const PipelineTimeline b =
      simulate_pipeline(Schedule::interleaved_one_f_one_b, il, std::vector<double>(4, 1.0), {2, 2, 2, 2});
  CHECK(a.makespan == b.makespan);
  CHECK(a.busy == b.busy);
  CHECK_THROWS_WITH(
      simulate_pipeline(Schedule::interleaved_one_f_one_b, il, {1.0, 1.0}, {1.0, 1.0}),
      Catch::Contains(
          "2 forward, 2 backward and 0 weight-gradient times for 4 model stages (2 ranks x 2 chunks)"));
  CHECK_THROWS_WITH(simulate_pipeline(Schedule::one_f_one_b, shape, {1.0, -3.0}, {2.0, 6.0}),
                    Catch::Contains("model stage 1's forward time -3") && Catch::Contains("is negative"));
}

TEST_CASE("pipeline_order: shapes a schedule cannot run are errors naming them", "[pipeline]") {
  CHECK_THROWS_WITH(
      pipeline_order(Schedule::interleaved_one_f_one_b, {.stages = 4, .microbatches = 6, .chunks = 2}, 0),
      Catch::Contains("interleaved 1F1B on 4 stages, 2 chunks per stage, 6 micro-batches") &&
          Catch::Contains("use a multiple of it"));
  CHECK_THROWS_WITH(pipeline_order(Schedule::one_f_one_b, {.stages = 2, .microbatches = 4, .chunks = 2}, 0),
                    Catch::Contains("only interleaved 1F1B runs several chunks per stage"));
  CHECK_THROWS_WITH(pipeline_order(Schedule::gpipe, {.stages = 2, .microbatches = 4}, 2),
                    Catch::Contains("rank 2 of 2 stages"));
}

// ---- the typed pipeline (train/pipeline_run.hpp): nn::MlpBlock chunks on (dp, tp) sub-meshes
// ---------------

namespace {

using PMesh = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>;
using SMesh = MeshShape<Axis<"dp">, Axis<"tp">>;
using SL = nn::Layout<SMesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using SBlock = nn::MlpBlock<double, SL>;
using Act = nn::act_t<SL, double>;
using Vec = std::vector<double>;
constexpr std::int64_t kSeq = 4, kWidth = 8;
const nn::TransformerConfig block_config{.hidden = kWidth, .ffn = 12, .norm_eps = 1e-6, .init_std = 0.4};

/// Micro-batch mb's batch: 1 + mb % 3 rows (uneven; a dp rank may hold none).
std::int64_t rows_of(int mb) {
  return 1 + mb % 3;
}
Act pattern_act(const DeviceMesh<SMesh>& mesh, int mb, int salt) {
  return from_global_index<double, Shard<0>, Shard<1>>(mesh, {rows_of(mb), kSeq, kWidth}, [&](const auto& i) {
    return std::sin(0.3 * double(i[0] * 31 + i[1] * 7 + i[2]) + mb + salt);
  });
}
Vec full_of(const auto& t) {
  const auto f = t.full_tensor();
  return Vec(f.data(), f.data() + f.numel());
}
SBlock block_of(const DeviceMesh<SMesh>& mesh, int stage) {
  init::InitKeys keys(100 + static_cast<std::uint64_t>(stage));
  return SBlock(mesh, block_config, keys);
}

/// Per micro-batch: the last stage's output and the first stage's input gradient; per model stage: every
/// parameter's gradient summed over the micro-batches (full tensors).
struct PipeResult {
  std::map<int, Vec> y, dx;
  std::map<int, std::vector<Vec>> grads;
  std::vector<std::string> calls; ///< this rank's chunk calls in order: "F<mb>.<chunk>"
};

void add_into(std::vector<Vec>& sum, const std::vector<Vec>& g) {
  if (sum.empty()) {
    sum = g;
    return;
  }
  for (std::size_t i = 0; i < g.size(); ++i) {
    for (std::size_t e = 0; e < g[i].size(); ++e) {
      sum[i][e] += g[i][e];
    }
  }
}

/// The model of `stages` blocks on one rank, micro-batch by micro-batch, without the pipeline.
PipeResult sequential(int stages, int m) {
  PipeResult r;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const auto mesh = init_device_mesh<PMesh>(one, 1, 1, 1).slice<"dp", "tp">();
    std::vector<SBlock> blocks;
    for (int g = 0; g < stages; ++g) {
      blocks.push_back(block_of(mesh, g));
    }
    using Back = decltype(blocks[0].forward(std::declval<const Act&>(), with_backward).backward);
    for (int mb = 0; mb < m; ++mb) {
      Act h = pattern_act(mesh, mb, 0);
      std::vector<Back> backs;
      for (const SBlock& b : blocks) {
        auto [y, back] = b.forward(h, with_backward);
        backs.push_back(std::move(back));
        h = std::move(y);
      }
      r.y[mb] = full_of(h);
      Act d = pattern_act(mesh, mb, 50);
      for (int g = stages - 1; g >= 0; --g) {
        auto [dx, grads] = backs[std::size_t(g)](d);
        std::vector<Vec> gs;
        std::apply([&](const auto&... w) { (gs.push_back(full_of(w)), ...); }, grads);
        add_into(r.grads[g], gs);
        d = std::move(dx);
      }
      r.dx[mb] = full_of(d);
    }
  });
  return r;
}

/// The pipeline of blocks under `o`. bad_stage_mb >= 0: stage 0's output (dp rank 1's shard) of that
/// micro-batch goes out with another global shape; bad_gradient_mb >= 0: the last stage's input gradient of
/// that micro-batch does; bad_forward_mb >= 0: the last stage's forward of it throws.
PipeResult pipelined(const DeviceMesh<PMesh>& mesh, const PipelineRunOptions& o, int bad_stage_mb = -1,
                     int bad_gradient_mb = -1, int bad_forward_mb = -1) {
  const auto stage = mesh.slice<"dp", "tp">();
  const int p = o.shape.stages, v = o.shape.chunks, s = mesh.local_rank<"pp">();
  const int stages = p * v;
  std::vector<SBlock> blocks;
  for (int c = 0; c < v; ++c) {
    blocks.push_back(block_of(stage, c * p + s));
  }
  using Back = decltype(blocks[0].forward(std::declval<const Act&>(), with_backward).backward);
  std::map<std::pair<int, int>, Back> saved;
  PipeResult r;
  std::vector<double> forward_flops(std::size_t(v), 0.0), backward_flops(std::size_t(v), 0.0);
  PipelineChunks<Act> chunks;
  chunks.forward = [&](int c, int mb, std::optional<Act> in) {
    const int g = c * p + s;
    const FlopCounter flops;
    r.calls.push_back("F" + std::to_string(mb) + "." + std::to_string(c));
    expect(in.has_value() == (g > 0), "stage " + std::to_string(g) + ": an input iff not the first stage");
    const Act x = in ? *in : pattern_act(stage, mb, 0);
    auto [y, back] = blocks[std::size_t(c)].forward(x, with_backward);
    forward_flops[std::size_t(c)] += flops.flops();
    saved.emplace(std::pair{c, mb}, std::move(back));
    if (g == stages - 1) {
      r.y[mb] = full_of(y);
    }
    DTENSOR_CHECK(g != stages - 1 || mb != bad_forward_mb, "the chunk's own error");
    if (g == 0 && mb == bad_stage_mb && stage.local_rank<"dp">() == 1) { // a shard of another global shape
      return Act(stage, y.local(), {y.global_shape()[0], y.global_shape()[1], kWidth + 1});
    }
    return y;
  };
  chunks.backward = [&](int c, int mb, std::optional<Act> dout) -> std::optional<Act> {
    const int g = c * p + s;
    r.calls.push_back("B" + std::to_string(mb) + "." + std::to_string(c));
    const Act d = dout ? *dout : pattern_act(stage, mb, 50);
    const auto it = saved.find({c, mb});
    const FlopCounter flops;
    auto [dx, grads] = it->second(d);
    backward_flops[std::size_t(c)] += flops.flops();
    saved.erase(it);
    std::vector<Vec> gs;
    std::apply([&](const auto&... w) { (gs.push_back(full_of(w)), ...); }, grads);
    add_into(r.grads[g], gs);
    if (g == 0) {
      r.dx[mb] = full_of(dx);
      return std::nullopt;
    }
    if (g == stages - 1 && mb == bad_gradient_mb) {
      return Act(stage, dx.local(), {dx.global_shape()[0], dx.global_shape()[1], kWidth + 1});
    }
    return dx;
  };
  const PipelineRunStats st = run_pipeline(mesh.group<"pp">(), stage, chunks, o);
  std::vector<std::string> want;
  for (const PipelineAction& a : pipeline_order(o.schedule, o.shape, s)) {
    want.push_back(a.to_string(true));
  }
  expect(r.calls == want, "the chunk calls are not the schedule's order");
  expect(st.order.size() == want.size(), "the stats' order");
  // The stats' flops per chunk are its calls' (the GEMMs of an MLP block: its backward twice its forward).
  expect(st.forward_flops == forward_flops && st.backward_flops == backward_flops, "the stats' flops");
  for (int c = 0; c < v; ++c) {
    expect(forward_flops[std::size_t(c)] > 0 &&
               backward_flops[std::size_t(c)] == 2 * forward_flops[std::size_t(c)],
           "chunk " + std::to_string(c) + ": forward " + std::to_string(forward_flops[std::size_t(c)]) +
               ", backward " + std::to_string(backward_flops[std::size_t(c)]) + " flops");
  }
  return r;
}

void close_vec(const Vec& got, const Vec& want, const std::string& what) {
  expect(got.size() == want.size(), what + ": size");
  for (std::size_t e = 0; e < want.size(); ++e) {
    expect(std::abs(got[e] - want[e]) <= 1e-12 * (1 + std::abs(want[e])),
           what + ": element " + std::to_string(e) + " is " + std::to_string(got[e]) + ", want " +
               std::to_string(want[e]));
  }
}

void typed_case(int pp, int dp, int tp, Schedule schedule, int v, int m) {
  const PipelineRunOptions o{.schedule = schedule, .shape = {.stages = pp, .microbatches = m, .chunks = v}};
  const int stages = pp * v;
  const PipeResult want = sequential(stages, m);
  const std::string name = std::string(schedule_name(schedule)) + " (pp " + std::to_string(pp) + ", dp " +
                           std::to_string(dp) + ", tp " + std::to_string(tp) + "), " + std::to_string(v) +
                           " chunks, " + std::to_string(m) + " micro-batches";
  testing::run_ranks(pp * dp * tp, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<PMesh>(world, pp, dp, tp);
    const PipeResult got = pipelined(mesh, o);
    const int s = mesh.local_rank<"pp">();
    const std::string at = name + ", rank " + std::to_string(world.rank());
    for (int mb = 0; mb < m; ++mb) {
      if ((stages - 1) % pp == s) {
        close_vec(got.y.at(mb), want.y.at(mb), at + ": micro-batch " + std::to_string(mb) + "'s output");
      }
      if (s == 0) {
        close_vec(got.dx.at(mb), want.dx.at(mb),
                  at + ": micro-batch " + std::to_string(mb) + "'s input gradient");
      }
    }
    for (int c = 0; c < v; ++c) {
      const int g = c * pp + s;
      for (std::size_t i = 0; i < want.grads.at(g).size(); ++i) {
        close_vec(got.grads.at(g)[i], want.grads.at(g)[i],
                  at + ": stage " + std::to_string(g) + "'s parameter " + std::to_string(i));
      }
    }
  });
}

} // namespace

TEST_CASE(
    "run_pipeline on DTensors: GPipe, 1F1B and interleaved 1F1B over (pp, dp, tp) equal the model on one "
    "rank",
    "[pipeline]") {
  typed_case(2, 1, 1, Schedule::gpipe, 1, 3);
  typed_case(2, 1, 1, Schedule::one_f_one_b, 1, 5);
  typed_case(3, 1, 1, Schedule::one_f_one_b, 1, 4);
  typed_case(4, 1, 1, Schedule::one_f_one_b, 1, 3);
  typed_case(1, 1, 1, Schedule::interleaved_one_f_one_b, 3, 2); // one rank, three chunks: in memory
  typed_case(2, 1, 1, Schedule::interleaved_one_f_one_b, 2, 4);
  typed_case(2, 2, 1, Schedule::interleaved_one_f_one_b, 2, 4); // micro-batches of 1-3 rows over dp 2
  typed_case(2, 1, 2, Schedule::one_f_one_b, 1, 3);             // tensor + sequence parallel stages
  typed_case(2, 2, 2, Schedule::interleaved_one_f_one_b, 2, 2); // 8 ranks: pp x dp x tp
}

TEST_CASE("run_pipeline: a dry run of each stage alone (the fake backend) communicates what it does in the "
          "real run",
          "[pipeline][fake]") {
  for (auto [pp, dp, tp, schedule, v] :
       {std::tuple{2, 2, 1, Schedule::interleaved_one_f_one_b, 2},
        std::tuple{3, 1, 1, Schedule::one_f_one_b, 1}, std::tuple{2, 1, 2, Schedule::gpipe, 1}}) {
    const PipelineRunOptions plain{.schedule = schedule,
                                   .shape = {.stages = pp, .microbatches = 4, .chunks = v}};
    PipelineRunOptions o = plain;
    o.boundary_shape = [](int mb) { return std::vector<std::int64_t>{rows_of(mb), kSeq, kWidth}; };
    const int n = pp * dp * tp;
    std::vector<std::string> real(static_cast<std::size_t>(n));
    std::mutex m;
    testing::run_ranks(n, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<PMesh>(world, pp, dp, tp);
      CommDebugMode comm;
      (void)pipelined(mesh, plain);
      std::lock_guard lock(m);
      real[static_cast<std::size_t>(world.rank())] = comm.to_string();
    });
    for (int r = 0; r < n; ++r) {
      INFO(schedule_name(schedule) << " (pp " << pp << ", dp " << dp << ", tp " << tp << "), rank " << r);
      const auto mesh = init_device_mesh<PMesh>(fake_world(r, n), pp, dp, tp);
      CommDebugMode comm;
      (void)pipelined(mesh, o);
      CHECK(comm.to_string() == real[static_cast<std::size_t>(r)]);
      // Without the shapes a neighbour would send, a dry run cannot start.
      CHECK_THROWS_WITH(pipelined(mesh, plain), Catch::Contains("set PipelineRunOptions::boundary_shape"));
    }
  }
  // The zero-bubble schedules run each backward as B and W: chunks without a weight function cannot.
  PipelineRunOptions zb{.schedule = Schedule::zero_bubble_h1, .shape = {.stages = 2, .microbatches = 4}};
  zb.boundary_shape = [](int mb) { return std::vector<std::int64_t>{rows_of(mb), kSeq, kWidth}; };
  CHECK_THROWS_WITH(
      pipelined(init_device_mesh<PMesh>(fake_world(0, 2), 2, 1, 1), zb),
      Catch::Contains("ZB-H1 runs each backward as B and W apart: PipelineChunks needs weight"));
}

TEST_CASE(
    "run_pipeline on DTensors: a shard of another shape is an error on both stages naming stage, micro-batch "
    "and shapes",
    "[pipeline]") {
  const PipelineRunOptions o{.schedule = Schedule::one_f_one_b, .shape = {.stages = 2, .microbatches = 3}};
  CHECK_THROWS_WITH(
      testing::run_ranks(4,
                         [&](ProcessGroup& world) {
                           (void)pipelined(init_device_mesh<PMesh>(world, 2, 2, 1), o,
                                           /*bad_stage_mb=*/1);
                         }),
      Catch::Contains(
          "stage 1 (pp rank 1), micro-batch 1, the activation from stage 0: global "
          "shape [2, 4, 9] arrives as a shard of [1, 4, 8], but [S(0),S(1)] gives this rank's coordinate a "
          "shard of [1, 4, 9]") &&
          // the sending stage learns it too (the abort header on the link it waits on), and so does every
          // other rank: none waits for its timeout
          Catch::Contains(
              "stage 0 (pp rank 0) stopped: stage 1 (pp rank 1) refused the activation of "
              "micro-batch 1 from stage 0: global shape [2, 4, 9] as this rank's shard of [1, 4, 8], "
              "where its placements give its coordinate a shard of [1, 4, 9]"));
  // A gradient refused after its sender's last send (the last micro-batch): the sender learns it from the
  // done header of that link, which comes as an abort; three stages of one rank each, so every rank's
  // error is the pipeline's (no collective inside a stage to fail first). Every rank's error names where
  // it started: from an abort header, or, when the stopping peer's abort of the pp group failed a shard
  // this rank was receiving, from the peer's reason that the group passes on.
  const PipelineRunOptions three{.schedule = Schedule::one_f_one_b,
                                 .shape = {.stages = 3, .microbatches = 2}};
  const auto per_rank = [](const std::function<void()>& f) {
    std::vector<std::string> parts;
    try {
      f();
    } catch (const std::exception& e) {
      std::string m = e.what();
      for (std::size_t at; (at = m.find("\n  then rank ")) != std::string::npos; m.erase(0, at + 13)) {
        parts.push_back(m.substr(0, at));
      }
      parts.push_back(m);
    }
    return parts;
  };
  const auto gradient = per_rank([&] {
    testing::run_ranks(3, [&](ProcessGroup& world) {
      (void)pipelined(init_device_mesh<PMesh>(world, 3, 1, 1), three, -1, /*bad_gradient_mb=*/1);
    });
  });
  REQUIRE(gradient.size() == 3);
  const std::string refused =
      "stage 1 (pp rank 1) refused the gradient of micro-batch 1 from stage 2: "
      "global shape [2, 4, 9] as this rank's shard of [2, 4, 8], where its placements "
      "give its coordinate a shard of [2, 4, 9]";
  for (const std::string& part : gradient) {
    INFO(part);
    CHECK((part.find("stage 1 (pp rank 1), micro-batch 1, the gradient from stage 2: global shape [2, 4, 9] "
                     "arrives as a shard of [2, 4, 8]") != std::string::npos ||
           part.find("stage 1 (pp rank 1) refused the gradient of micro-batch 1") != std::string::npos));
  }
  CHECK_THAT(gradient[0] + gradient[1] + gradient[2],
             Catch::Contains("stage 2 (pp rank 2) stopped: " + refused));
  // A chunk that throws: its neighbours stop with its stage and micro-batch, not a timeout.
  const auto failed = per_rank([&] {
    testing::run_ranks(3, [&](ProcessGroup& world) {
      (void)pipelined(init_device_mesh<PMesh>(world, 3, 1, 1), three, -1, -1, /*bad_forward_mb=*/1);
    });
  });
  REQUIRE(failed.size() == 3);
  for (const std::string& part : failed) {
    INFO(part);
    CHECK((part.find("the chunk's own error") != std::string::npos ||
           part.find("stage 2 (pp rank 2) failed in its forward of micro-batch 1") != std::string::npos));
  }
}

// ---- PP x FSDP x TP: the GPT of nn:: layers under nn::PipelineTrainer, FSDP and TP inside each stage
// ----------------------

namespace {

using GL = nn::Layout<SMesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using GModel = nn::LanguageModel<double, GL, nn::TransformerBlock>;
constexpr int kGptLayers = 5, kGptMicro = 4, kGptSteps = 2;
constexpr std::int64_t kGptRows = 2, kGptSeq = 6;
constexpr double kGptMaxNorm = 0.8; // below the first steps' norms: the clip by the norm over every stage
const nn::TransformerConfig gpt_config{
    .vocab = 23, .hidden = 16, .heads = 4, .kv_heads = 2, .ffn = 24, .norm_eps = 1e-6, .init_std = 0.3};

nn::ids_t<GL> gpt_ids(const DeviceMesh<SMesh>& mesh, int step, int mb, int shift) {
  return from_global_index<std::int64_t, Shard<0>, Replicate>(mesh, {kGptRows, kGptSeq}, [&](const auto& i) {
    return (i[0] * 7 + i[1] * 5 + step * 3 + mb * 11 + shift + i[1] * i[1]) % gpt_config.vocab;
  });
}

std::vector<std::pair<nn::ids_t<GL>, nn::ids_t<GL>>> gpt_micro(const DeviceMesh<SMesh>& mesh, int step) {
  std::vector<std::pair<nn::ids_t<GL>, nn::ids_t<GL>>> micro;
  for (int mb = 0; mb < kGptMicro; ++mb) {
    micro.emplace_back(gpt_ids(mesh, step, mb, 0), gpt_ids(mesh, step, mb, 1));
  }
  return micro;
}

struct GptRun {
  std::vector<double> losses, norms, val_losses;
  std::map<int, Vec> params; ///< by position in the one-rank model's parameter order
  /// Per step: isend and (i)recv over pp, all_gather and reduce_scatter over dp; and what the layout implies.
  std::vector<std::array<std::int64_t, 4>> comms;
  std::array<std::int64_t, 4> expected{};
};

GptRun gpt_one_rank() {
  GptRun run;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const auto mesh = init_device_mesh<PMesh>(one, 1, 1, 1).slice<"dp", "tp">();
    init::InitKeys keys(17);
    nn::DdpTrainer<GModel, "dp"> trainer(mesh, GModel(mesh, gpt_config, kGptLayers, keys),
                                         {.max_norm = kGptMaxNorm});
    optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
    for (int step = 0; step < kGptSteps; ++step) {
      const auto micro = gpt_micro(mesh, step);
      const nn::StepResult r = trainer.step(std::span(micro), opt);
      run.losses.push_back(r.loss);
      run.norms.push_back(r.grad_norm);
      run.val_losses.push_back(trainer.loss(gpt_ids(mesh, 9, step, 0), gpt_ids(mesh, 9, step, 1)));
    }
    int at = 0;
    trainer.with_gathered([&](auto& m) {
      nn::for_each_tensor(m.parameters(), [&](const auto& w) { run.params[at++] = full_of(w); });
    });
  });
  return run;
}

/// This rank's part of the GPT under nn::PipelineTrainer, trained kGptSteps steps.
GptRun gpt_pipelined(const DeviceMesh<PMesh>& mesh, Schedule schedule, int v) {
  const auto stage = mesh.slice<"dp", "tp">();
  init::InitKeys keys(17);
  nn::PipelineTrainer<GModel, Fsdp<"dp">> trainer(
      mesh.group<"pp">(), stage, GModel(stage, gpt_config, kGptLayers, keys),
      {.schedule = schedule, .chunks = v, .max_norm = kGptMaxNorm});
  optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
  GptRun run;
  // Derived from the layout: each boundary a chunk crosses sends (and receives) a header and a shard per
  // micro-batch, forward and backward, and each link to another rank (peer, direction) one done header at
  // the end; each FSDP group is gathered and reduce_scattered once a step.
  const int p = mesh.size<"pp">(), s = mesh.local_rank<"pp">(), stages = p * v;
  const auto rank_of = [&](int g) { return pipeline_rank(schedule, p, g); };
  std::set<std::pair<int, int>> links; // (peer, direction): the same number sent on as received on
  for (const auto& [g, first, last] : trainer.stages()) {
    const std::int64_t crossings = (g > 0 && rank_of(g - 1) != s ? 1 : 0) +
                                   (g < stages - 1 && rank_of(g + 1) != s ? 1 : 0); // same-rank: in memory
    run.expected[0] += 2 * kGptMicro * crossings;
    run.expected[1] += 2 * kGptMicro * crossings;
    if (g > 0 && rank_of(g - 1) != s) {
      links.insert({rank_of(g - 1), 1});
    }
    if (g < stages - 1 && rank_of(g + 1) != s) {
      links.insert({rank_of(g + 1), 0});
    }
    // FSDP's gathers and reductions over dp (none over a dp of one rank: a size-1 axis costs nothing)
    const std::int64_t groups =
        stage.size<"dp">() > 1 ? (last - first) + (g == 0 ? 1 : 0) + (g == stages - 1 ? 1 : 0) : 0;
    run.expected[2] += groups;
    run.expected[3] += groups;
  }
  run.expected[0] += std::int64_t(links.size());
  run.expected[1] += std::int64_t(links.size());
  for (int step = 0; step < kGptSteps; ++step) {
    const auto micro = gpt_micro(stage, step);
    CommDebugMode comm;
    const nn::StepResult r = trainer.step(std::span(micro), opt);
    run.comms.push_back({comm.count("isend", "pp"), comm.count("recv", "pp") + comm.count("irecv", "pp"),
                         comm.count("all_gather", "dp"), comm.count("reduce_scatter", "dp")});
    run.losses.push_back(r.loss);
    run.norms.push_back(r.grad_norm);
    run.val_losses.push_back(trainer.loss(gpt_ids(stage, 9, step, 0), gpt_ids(stage, 9, step, 1)));
  }
  trainer.for_each_parameter([&](int i, const auto& w) { run.params[i] = full_of(w); });
  return run;
}

void gpt_case(int pp, int dp, int tp, Schedule schedule, int v, const GptRun& want) {
  const std::string name = std::string(schedule_name(schedule)) + " GPT (pp " + std::to_string(pp) + ", dp " +
                           std::to_string(dp) + ", tp " + std::to_string(tp) + "), " + std::to_string(v) +
                           " chunks";
  testing::run_ranks(pp * dp * tp, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<PMesh>(world, pp, dp, tp);
    const GptRun got = gpt_pipelined(mesh, schedule, v);
    const std::string at = name + ", rank " + std::to_string(world.rank());
    close_vec(got.losses, want.losses, at + ": losses");
    close_vec(got.norms, want.norms, at + ": gradient norms");
    close_vec(got.val_losses, want.val_losses, at + ": forward-only losses");
    for (const auto& c : got.comms) {
      expect(c == got.expected, at + ": isend/recv over pp, all_gather/reduce_scatter over dp per step " +
                                    std::to_string(c[0]) + "/" + std::to_string(c[1]) + "/" +
                                    std::to_string(c[2]) + "/" + std::to_string(c[3]) +
                                    ", the layout gives " + std::to_string(got.expected[0]) + "/" +
                                    std::to_string(got.expected[1]) + "/" + std::to_string(got.expected[2]) +
                                    "/" + std::to_string(got.expected[3]));
    }
    expect(!got.params.empty(), at + ": this rank holds parameters");
    for (const auto& [i, w] : got.params) {
      expect(want.params.count(i) == 1 && want.params.at(i).size() == w.size(),
             at + ": parameter " + std::to_string(i) + "'s size");
      for (std::size_t e = 0; e < w.size(); ++e) {
        expect(std::abs(w[e] - want.params.at(i)[e]) <= 1e-10 * std::max(1.0, std::abs(want.params.at(i)[e])),
               at + ": parameter " + std::to_string(i) + " element " + std::to_string(e));
      }
    }
  });
}

} // namespace

TEST_CASE(
    "PP x FSDP x TP: nn::PipelineTrainer trains the GPT over stages of FSDP + TP blocks as one rank does",
    "[pipeline]") {
  CHECK(pipeline_layers(5, 4, 0) == std::pair{0, 2});
  CHECK(pipeline_layers(5, 4, 3) == std::pair{4, 5});
  CHECK_THROWS_WITH(pipeline_layers(3, 4, 0), Catch::Contains("3 layers over 4 stages"));
  const GptRun want = gpt_one_rank();
  CHECK(want.norms[0] > kGptMaxNorm);                            // the clip acts
  gpt_case(2, 2, 2, Schedule::one_f_one_b, 1, want);             // 8 ranks: 3 + 2 layers
  gpt_case(2, 2, 1, Schedule::interleaved_one_f_one_b, 2, want); // 4 model stages: 2, 1, 1, 1 layers
  gpt_case(4, 1, 1, Schedule::gpipe, 1, want);                   // 4 stages, one rank each
}

TEST_CASE("PP x FSDP x TP: ZB-H1 and ZB-V (B and W apart) train the GPT as one rank does, ZB-H1 as 1F1B bit "
          "for bit",
          "[pipeline]") {
  const GptRun want = gpt_one_rank();
  gpt_case(2, 2, 2, Schedule::zero_bubble_h1, 1, want); // 8 ranks
  gpt_case(2, 2, 1, Schedule::zero_bubble_v, 2, want);  // stages 0 and 3 on pp rank 0, 1 and 2 on rank 1
  // The same arithmetic as 1F1B (each W right where 1F1B's backward would add the weights' gradients, in
  // micro-batch order): the same losses and parameters bit for bit.
  testing::run_ranks(8, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<PMesh>(world, 2, 2, 2);
    const GptRun one = gpt_pipelined(mesh, Schedule::one_f_one_b, 1);
    const GptRun zb = gpt_pipelined(mesh, Schedule::zero_bubble_h1, 1);
    expect(zb.losses == one.losses && zb.norms == one.norms, "ZB-H1's losses and norms are 1F1B's");
    expect(zb.params == one.params, "ZB-H1's parameters are 1F1B's bit for bit");
  });
}

TEST_CASE("nn::PipelineTrainer in mixed precision (double shards, float compute), with and without "
          "recomputation, trains as nn::FsdpTrainer does",
          "[pipeline]") {
  // The compute type C of the planner's pipelines (dtensor-plan: float shards, bfloat16 compute), run for
  // real: the gathered parameters and the activations crossing the stages in float; and the blocks'
  // recomputation. Against nn::FsdpTrainer in the same precision on one rank, to float's rounding (the two
  // sum in other orders).
  struct Steps {
    std::vector<double> losses, norms;
  };
  Steps want;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const auto mesh = init_device_mesh<PMesh>(one, 1, 1, 1).slice<"dp", "tp">();
    init::InitKeys keys(17);
    nn::FsdpTrainer<GModel, Fsdp<"dp">, float> trainer(mesh, GModel(mesh, gpt_config, kGptLayers, keys),
                                                       {.max_norm = kGptMaxNorm});
    optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
    for (int step = 0; step < kGptSteps; ++step) {
      const auto micro = gpt_micro(mesh, step);
      const nn::StepResult r = trainer.step(std::span(micro), opt);
      want.losses.push_back(r.loss);
      want.norms.push_back(r.grad_norm);
    }
  });
  for (auto [pp, dp, tp, schedule, v, recompute] :
       {std::tuple{2, 2, 1, Schedule::interleaved_one_f_one_b, 2, false},
        std::tuple{2, 1, 2, Schedule::one_f_one_b, 1, false},
        std::tuple{2, 2, 1, Schedule::one_f_one_b, 1, true},
        std::tuple{2, 1, 2, Schedule::interleaved_one_f_one_b, 2, true}}) {
    testing::run_ranks(pp * dp * tp, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<PMesh>(world, pp, dp, tp);
      const auto stage = mesh.slice<"dp", "tp">();
      init::InitKeys keys(17);
      nn::PipelineTrainer<GModel, Fsdp<"dp">, float> trainer(
          mesh.group<"pp">(), stage, GModel(stage, gpt_config, kGptLayers, keys),
          {.schedule = schedule, .chunks = v, .max_norm = kGptMaxNorm, .recompute = recompute});
      optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
      const std::string at = std::string(schedule_name(schedule)) + " (pp " + std::to_string(pp) + ", dp " +
                             std::to_string(dp) + ", tp " + std::to_string(tp) + ")" +
                             (recompute ? " recomputing" : "") + ", rank " + std::to_string(world.rank());
      for (int step = 0; step < kGptSteps; ++step) {
        const auto micro = gpt_micro(stage, step);
        const nn::StepResult r = trainer.step(std::span(micro), opt);
        const std::size_t k = std::size_t(step);
        expect(std::abs(r.loss - want.losses[k]) <= 1e-5 * want.losses[k] &&
                   std::abs(r.grad_norm - want.norms[k]) <= 1e-4 * want.norms[k],
               at + ", step " + std::to_string(step) + ": loss " + std::to_string(r.loss) + " norm " +
                   std::to_string(r.grad_norm) + ", want " + std::to_string(want.losses[k]) + " and " +
                   std::to_string(want.norms[k]));
      }
    });
  }
}

TEST_CASE("nn::PipelineTrainer's recomputation holds less activation memory on every stage (dry runs)",
          "[pipeline][fake]") {
  // Each stage of (pp 2) alone on the fake backend with meta tensors (plan/dry_run.hpp: the same memory as
  // the real run's): one 1F1B step of 4 micro-batches; the activations' own peak over the step.
  const auto activations = [](int rank, bool recompute) {
    const DryRun r = dry_run({.rank = rank, .world_size = 2}, [&](DryRunContext& ctx) {
      const auto mesh = init_device_mesh<PMesh>(ctx.world(), 2, 1, 1);
      const auto stage = mesh.slice<"dp", "tp">();
      init::InitKeys keys(17);
      nn::PipelineTrainer<GModel, Fsdp<"dp">> trainer(
          mesh.group<"pp">(), stage, GModel(stage, gpt_config, kGptLayers, keys, ctx.device()),
          {.schedule = Schedule::one_f_one_b, .recompute = recompute});
      optim::AdamW opt({.lr = 1e-2});
      std::vector<std::pair<nn::ids_t<GL>, nn::ids_t<GL>>> micro;
      for (int mb = 0; mb < kGptMicro; ++mb) {
        const auto ids = zeros<std::int64_t, Shard<0>, Replicate>(stage, {kGptRows, kGptSeq}, ctx.device());
        micro.emplace_back(ids, ids);
      }
      ctx.begin_step();
      (void)trainer.step(std::span(micro), opt);
    });
    return r.memory.peak[std::size_t(MemoryCategory::activations)];
  };
  for (int rank : {0, 1}) {
    INFO("stage " << rank);
    const std::int64_t kept = activations(rank, false), recomputed = activations(rank, true);
    CHECK(recomputed > 0);
    CHECK(recomputed < kept);
  }
}

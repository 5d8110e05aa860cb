// The pipeline bubble of run_pipeline on DTensors (train/pipeline_run.hpp: a header and a shard per
// boundary crossing, asynchronous sends) measured against the formula: 4 stages (in-process rank threads,
// gloo), 1-16 micro-batches, each stage's forward a fixed 10 ms and its backward 20 ms of sleep (a stand-in
// for compute that does not compete for this machine's 2 cores, so what is measured is the schedule), tiny
// activations; GPipe, 1F1B and interleaved 1F1B with 2 chunks per stage (each chunk half of the stage's
// sleep), and the zero-bubble schedules with the backward split into B 10 ms and W 10 ms: ZB-H1, and ZB-V with
// 2 chunks per stage. The measured bubble is the last stage's idle fraction (the stage that waits longest to start),
// next to the formula (p - 1) / (v m + p - 1) and the timeline simulate_pipeline predicts for these times.
// bench/pipeline/pipeline_vs_torch.sh measures the step over processes next to torch 1.13.
//
//   bench_pipeline [--scale S] [--smoke] [--out DIR]     # writes DIR/pipeline.json (default bench/results)

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/testing/run_ranks.hpp"
#include "dtensor/train/pipeline_run.hpp"

#include "../common/harness.hpp"

namespace {

/// After one warm-up run (groups, connections), the shortest of `reps` runs: its idle fraction and seconds.
template <class Run>
std::pair<double, double> best_run(int reps, Run&& run) {
  run();
  double idle = 1;
  double total = 1e9;
  for (int r = 0; r < reps; ++r) {
    const auto s = run();
    if (s.total_s < total) {
      total = s.total_s;
      idle = s.idle_fraction();
    }
  }
  return {idle, total};
}

} // namespace

int main(int argc, char** argv) {
  using namespace dtensor;
  const bench::Options opt = bench::parse_options(argc, argv);
  const int stages = 4;
  const auto fwd = std::chrono::milliseconds(10);
  const auto bwd = std::chrono::milliseconds(20);
  bench::Table typed{{"schedule", "chunks", "micro-batches", "bubble measured", "simulated",
                      "formula: (p-1)/(vm+p-1); ZB-H1 (p-1)(f+b-w)/(m(f+b+w)+(p-1)(f+b-w))", "step ms"}};
  bench::Results results;
  using PMesh = MeshShape<Axis<"pp">, Axis<"dp">>;
  using Act = DTensor<float, 2, MeshShape<Axis<"dp">>, Shard<0>>;
  const auto wgt = std::chrono::milliseconds(10); // of the backward's 20: B 10 ms and W 10 ms when split
  for (Schedule schedule : {Schedule::one_f_one_b, Schedule::interleaved_one_f_one_b, Schedule::gpipe,
                            Schedule::zero_bubble_h1, Schedule::zero_bubble_v}) {
    const int v =
        schedule == Schedule::interleaved_one_f_one_b || schedule == Schedule::zero_bubble_v ? 2 : 1;
    const bool split = splits_backward(schedule);
    for (int m : {1, 2, 4, 8, 16}) {
      if ((opt.smoke && m > 4) || (schedule == Schedule::interleaved_one_f_one_b && m % stages != 0)) {
        continue; // interleaved 1F1B runs the micro-batches in groups of the stage count
      }
      const PipelineRunOptions o{.schedule = schedule,
                                 .shape = {.stages = stages, .microbatches = m, .chunks = v}};
      std::mutex mu;
      double idle = 0;
      double step = 0;
      testing::run_ranks(stages, [&](ProcessGroup& world) {
        const auto mesh = init_device_mesh<PMesh>(world, stages, 1);
        const auto stage = mesh.slice<"dp">();
        PipelineChunks<Act> chunks;
        chunks.forward = [&](int, int, std::optional<Act>) {
          std::this_thread::sleep_for(fwd / v);
          return Act::from_local(stage, Tensor<float, 2>({1, 4}));
        };
        chunks.backward = [&](int, int, std::optional<Act>) -> std::optional<Act> {
          std::this_thread::sleep_for((split ? bwd - wgt : bwd) / v);
          return Act::from_local(stage, Tensor<float, 2>({1, 4}));
        };
        if (split) {
          chunks.weight = [&](int, int) { std::this_thread::sleep_for(wgt / v); };
        }
        const auto [best_idle, best_total] =
            best_run(opt.smoke ? 1 : 3, [&] { return run_pipeline(mesh.group<"pp">(), stage, chunks, o); });
        if (world.rank() == stages - 1) {
          std::lock_guard lock(mu);
          idle = best_idle;
          step = best_total * 1e3;
        }
      });
      // B and W half of the backward each (a fused backward runs both).
      const double simulated =
          simulate_pipeline(schedule, o.shape, 2.0 / v, 2.0 / v, 2.0 / v).idle_fraction(stages - 1);
      // ZB-V has no closed form (its order is a list scheduler's), ZB-H1's holds from m = p on.
      const bool has_formula =
          schedule != Schedule::zero_bubble_v && (schedule != Schedule::zero_bubble_h1 || m >= stages);
      const double formula = schedule == Schedule::zero_bubble_h1 ? zero_bubble_h1_bubble(stages, m)
                                                                  : pipeline_bubble(stages, m, v);
      typed.row({schedule_name(schedule), std::to_string(v), std::to_string(m), bench::fmt("%.3f", idle),
                 bench::fmt("%.3f", simulated), has_formula ? bench::fmt("%.3f", formula) : std::string("-"),
                 bench::fmt("%.1f", step)});
      bench::Stats st{};
      st.median = step * 1e3;
      st.min = st.median;
      st.max = st.median;
      bench::Record rec{"pipeline_dtensor",
                        std::string(schedule_name(schedule)) + " v=" + std::to_string(v) +
                            " m=" + std::to_string(m),
                        "gloo",
                        stages,
                        0,
                        st,
                        "formula",
                        bench::Stats{},
                        {}};
      rec.add_num("bubble", idle)
          .add_num("simulated", simulated)
          .add_num("microbatches", m)
          .add_num("chunks", v)
          .add_num("step_ms", step);
      if (has_formula) {
        rec.add_num("formula", formula);
      }
      results.add(std::move(rec));
    }
  }
  std::printf(
      "pipeline bubble: 4 stages (rank threads), forward 10 ms and backward 20 ms of sleep per "
      "micro-batch (split: B 10 ms, W 10 ms); bubble = the last stage's idle fraction, best of 3 steps\n");
  typed.print();
  results.write(opt, "pipeline.json");
  return 0;
}

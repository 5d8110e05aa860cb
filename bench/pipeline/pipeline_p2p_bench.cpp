// A 1F1B step over p processes (one pipeline stage each, gloo), through run_pipeline on DTensors, and 1F1B,
// ZB-H1 and ZB-V at stages 5x longer (DIR/pipeline_p2p_zb_n<p>.json: their bubbles); the same
// step hand-written over torch 1.13's point-to-point calls is bench/pipeline/torch_pipeline.py, and
// bench/pipeline/pipeline_vs_torch.sh runs both in one go. Each stage's forward is 2 ms and its backward
// 4 ms of sleep (a stand-in for compute that does not compete for the cores, so what differs is the
// schedule and the transfers), the activations and gradients (rows, hidden) float tensors of real size.
// Per (size, micro-batches): the step's median over the samples (a barrier before each), the slowest
// rank's; the step the schedule's timeline gives with free transfers (simulate_pipeline); and the exposed
// communication, their difference.
//
//   dtensor-run --standalone --nproc-per-node 4 bench_pipeline_p2p [--smoke] [--scale S] [--out DIR]
//   # writes DIR/pipeline_p2p_n<p>.json (rank 0)

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/train/pipeline_run.hpp"

#include "../common/harness.hpp"

int main(int argc, char** argv) {
  using namespace dtensor;
  const bench::Options opt = bench::parse_options(argc, argv);
  ProcessGroup world = init_process_group();
  const int p = world.size();
  using Mesh = MeshShape<Axis<"pp">, Axis<"dp">>;
  using Act = DTensor<float, 2, MeshShape<Axis<"dp">>, Shard<0>>;
  const auto mesh = init_device_mesh<Mesh>(world, p, 1);
  const auto stage = mesh.slice<"dp">();
  const double f_ms = opt.smoke ? 0.2 : 2.0, b_ms = 2 * f_ms;
  struct Size {
    std::int64_t rows, hidden;
  };
  const std::vector<Size> sizes =
      opt.smoke ? std::vector<Size>{{2, 8}} : std::vector<Size>{{8, 256}, {64, 1024}, {256, 1024}};
  const std::vector<int> ms = opt.smoke ? std::vector<int>{2} : std::vector<int>{4, 8, 16};
  // The slowest rank's median step of `schedule` on micro-batches of z, m of them, forward f ms and backward
  // b ms of sleep per stage (a chunk's share under ZB-V's two; B and W half of b each where split).
  const auto measure = [&](Schedule schedule, const Size& z, int m, double f, double b) {
    const bool split = splits_backward(schedule);
    const int v = schedule == Schedule::zero_bubble_v ? 2 : 1;
    PipelineChunks<Act> chunks;
    const auto sleep = [v](double ms_) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms_ / v));
    };
    const auto work = [&](double ms_) {
      sleep(ms_);
      return Act::from_local(stage, Tensor<float, 2>::zeros({z.rows, z.hidden}));
    };
    chunks.forward = [&](int, int, std::optional<Act>) { return work(f); };
    chunks.backward = [&](int, int, std::optional<Act>) -> std::optional<Act> {
      return work(split ? b / 2 : b);
    };
    if (split) {
      chunks.weight = [&](int, int) { sleep(b / 2); };
    }
    const PipelineRunOptions o{.schedule = schedule, .shape = {.stages = p, .microbatches = m, .chunks = v}};
    std::vector<double> times;
    const int samples = bench::scaled(opt, 15);
    for (int s = 0; s < samples + (opt.smoke ? 0 : 2); ++s) {
      barrier(world);
      const auto t0 = std::chrono::steady_clock::now();
      (void)run_pipeline(mesh.group<"pp">(), stage, chunks, o);
      const double t =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (s >= (opt.smoke ? 0 : 2)) { // two warm-up steps
        times.push_back(t);
      }
    }
    std::sort(times.begin(), times.end());
    Tensor<double, 1> med = Tensor<double, 1>::full({1}, times[times.size() / 2]);
    all_reduce(med, ReduceOp::max, world);
    const double c = 1.0 / v;
    const PipelineTimeline t = split ? simulate_pipeline(schedule, o.shape, f * c, b / 2 * c, b / 2 * c)
                                     : simulate_pipeline(schedule, o.shape, f, b);
    return std::pair{med.item(), t};
  };
  const auto size_name = [](const Size& z) {
    return std::to_string(z.rows) + " x " + std::to_string(z.hidden);
  };
  bench::Table table{{"rows x hidden", "KiB", "micro-batches", "step ms", "free-transfer ms", "exposed ms"}};
  std::string json = "[";
  for (const Size& z : sizes) {
    for (int m : ms) {
      const auto [step, t] = measure(Schedule::one_f_one_b, z, m, f_ms, b_ms);
      const double ideal = t.makespan;
      const double kib = double(z.rows * z.hidden * 4) / 1024;
      table.row({size_name(z), bench::fmt("%.0f", kib), std::to_string(m), bench::fmt("%.1f", step),
                 bench::fmt("%.1f", ideal), bench::fmt("%.1f", step - ideal)});
      json += std::string(json.size() > 1 ? ",\n " : "\n ") + "{\"size\": \"" + size_name(z) +
              "\", \"microbatches\": " + std::to_string(m) + ", \"step_ms\": " + bench::fmt("%.3f", step) +
              ", \"ideal_ms\": " + bench::fmt("%.3f", ideal) + "}";
    }
  }
  // The zero-bubble schedules against 1F1B at stages 5x longer (10 ms forward, 20 ms backward: B and W 10 ms
  // each where split), where the exchanges are a small part of a stage: the bubble, 1 - a stage's compute
  // over the step, measured and simulated.
  const double zf = 5 * f_ms, zb = 5 * b_ms;
  const std::vector<Size> zb_sizes = opt.smoke ? sizes : std::vector<Size>{{64, 1024}, {256, 1024}};
  const int zb_m = opt.smoke ? 2 : 8;
  bench::Table zb_table{{"schedule", "rows x hidden", "micro-batches", "step ms", "free-transfer ms",
                         "bubble measured", "simulated"}};
  std::string zb_json = "[";
  for (const Size& z : zb_sizes) {
    for (Schedule schedule : {Schedule::one_f_one_b, Schedule::zero_bubble_h1, Schedule::zero_bubble_v}) {
      const auto [step, t] = measure(schedule, z, zb_m, zf, zb);
      const double bubble = 1 - zb_m * (zf + zb) / step;
      zb_table.row({schedule_name(schedule), size_name(z), std::to_string(zb_m), bench::fmt("%.1f", step),
                    bench::fmt("%.1f", t.makespan), bench::fmt("%.3f", bubble),
                    bench::fmt("%.3f", t.bubble())});
      zb_json +=
          std::string(zb_json.size() > 1 ? ",\n " : "\n ") + "{\"schedule\": \"" + schedule_name(schedule) +
          "\", \"size\": \"" + size_name(z) + "\", \"microbatches\": " + std::to_string(zb_m) +
          ", \"step_ms\": " + bench::fmt("%.3f", step) + ", \"ideal_ms\": " + bench::fmt("%.3f", t.makespan) +
          ", \"bubble\": " + bench::fmt("%.4f", bubble) +
          ", \"simulated\": " + bench::fmt("%.4f", t.bubble()) + "}";
    }
  }
  zb_json += "\n]\n";
  json += "\n]\n";
  if (world.rank() == 0) {
    std::printf("1F1B over %d processes (gloo), forward %.1f ms and backward %.1f ms of sleep per stage; the "
                "slowest rank's median step\n",
                p, f_ms, b_ms);
    table.print();
    std::printf("1F1B, ZB-H1 and ZB-V, forward %.1f ms and backward %.1f ms of sleep per stage (B and W half "
                "of it each where split); bubble = 1 - a stage's compute over the step\n",
                zf, zb);
    zb_table.print();
    for (const auto& [name, text] : {std::pair{std::string("/pipeline_p2p_n"), json},
                                     std::pair{std::string("/pipeline_p2p_zb_n"), zb_json}}) {
      if (opt.out.empty()) {
        continue;
      }
      const std::string path = opt.out + name + std::to_string(p) + ".json";
      std::FILE* f = std::fopen(path.c_str(), "w");
      if (f == nullptr) {
        std::fprintf(stderr, "bench_pipeline_p2p: cannot write %s\n", path.c_str());
        return 1;
      }
      std::fputs(text.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}

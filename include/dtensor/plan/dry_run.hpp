#pragma once
// dry_run: one rank of a large world runs a training step alone, in seconds, to learn what the real step
// would hold, communicate and take on a cluster. The step is the program's own code: it gets a world on
// the fake backend (backends/fake/backend.hpp) and the meta device (core/device.hpp), builds its mesh and
// model there and runs; nothing is allocated but address ranges and nothing computes.
//
//   dtensor::DryRun r = dtensor::dry_run({.rank = 0, .world_size = 1024, .cluster = dtensor::dgx_h100()},
//       [&](dtensor::DryRunContext& ctx) {
//         auto mesh = dtensor::init_device_mesh<Mesh>(ctx.world(), 128, 8);
//         nn::FsdpTrainer<Model, Fsdp<"dp">> trainer(mesh, Model(mesh, config, layers, keys, ctx.device()));
//         trainer.step(ids, targets, opt);          // ids, targets made on ctx.device() too; this step
//         ctx.begin_step();                         // makes the optimizer's state: measure the next one
//         trainer.step(ids, targets, opt);
//       });
//   r.memory.peak_total;         // bytes this rank's tensors hold at the peak, by category in r.memory
//   r.time.seconds;              // the step on the cluster; r.time.exposed: the communication it waits on
//   std::puts(r.to_string().c_str());
//
// What it measures, from ctx.begin_step() on (from the start without it): MemoryTracker (the peak starts at
// what is live then), CommDebugMode's op log (every op with its group, size and place on the timeline), the
// flops of the GEMMs and attention (FlopCounter); and the wall time of the whole dry run; what it estimates:
// the step's time on the cluster (plan/comm_time.hpp's estimate_step_time), its hardware flops utilisation,
// and the bytes each link tier carries. A rank stands for the ranks of its role (the fake backend's premise):
// dry-run one rank per role, e.g. the first and the last pipeline stage.

#include "dtensor/comm/comm_debug.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/core/device.hpp"
#include "dtensor/core/flop_counter.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/plan/comm_time.hpp"
#include "dtensor/plan/time_model.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dtensor {

struct DryRunOptions {
  int rank = 0;
  int world_size = 1;
  ClusterModel cluster = dgx_h100();
};

/// What dry_run measured and estimated for one rank.
struct DryRun {
  int rank = 0;
  int world_size = 1;
  MemoryStats memory;                 ///< this rank's tensors over the step, by category
  std::vector<CommDebugMode::Op> ops; ///< every op, in order
  std::string comm_table;             ///< CommDebugMode's table: per (op, axes), count and bytes received
  double flops = 0;                   ///< the GEMMs' and attention's
  StepTime time;                      ///< on the cluster
  std::int64_t bytes_nvlink = 0;      ///< received in ops whose group sits on one node
  std::int64_t bytes_network = 0;     ///< received in ops whose group spans nodes
  double wall_seconds = 0;            ///< what the dry run itself took
  bool fits = true;                   ///< the peak within the cluster's memory per GPU
  double hfu = 0; ///< flops / (step seconds x peak): of the flops run, recomputation included (not MFU)

  /// The memory table, the time table, and a summary line.
  std::string to_string() const {
    char line[256];
    std::snprintf(line, sizeof line,
                  "rank %d of %d: peak %.3f GiB (%s), %.3g TFLOP, step %.3f ms (compute %.3f, exposed "
                  "communication %.3f), HFU %.1f %%; %.3f GB over NVLink, %.3f GB over the network; dry run "
                  "%.2f s\n",
                  rank, world_size, double(memory.peak_total) / double(1 << 30),
                  fits ? "fits" : "does not fit", flops * 1e-12, 1e3 * time.seconds, 1e3 * time.compute,
                  1e3 * time.exposed, 100 * hfu, double(bytes_nvlink) * 1e-9, double(bytes_network) * 1e-9,
                  wall_seconds);
    return memory.to_string() + time.to_string() + line;
  }

  /// The same as one JSON object (bytes, seconds, flops; memory per category at the peak; the communication
  /// per (op, axes): count, bytes received, seconds, exposed seconds).
  std::string to_json() const {
    std::string s = "{\"rank\": " + std::to_string(rank) + ", \"world_size\": " + std::to_string(world_size) +
                    ", \"peak_bytes\": " + std::to_string(memory.peak_total) +
                    ", \"fits\": " + (fits ? "true" : "false") + ", \"at_peak\": {";
    for (std::size_t i = 0; i < kMemoryCategoryCount; ++i) {
      s += (i ? ", \"" : "\"") + std::string(dtensor::to_string(MemoryCategory(i))) +
           "\": " + std::to_string(memory.at_peak[i]);
    }
    char nums[320];
    std::snprintf(nums, sizeof nums,
                  "}, \"flops\": %.6g, \"step_seconds\": %.6g, \"compute_seconds\": %.6g, "
                  "\"comm_seconds\": %.6g, \"exposed_seconds\": %.6g, \"hfu\": %.4f, \"bytes_nvlink\": %lld, "
                  "\"bytes_network\": %lld, \"ops\": %zu, \"dry_run_seconds\": %.4f}",
                  flops, time.seconds, time.compute, time.comm, time.exposed, hfu,
                  static_cast<long long>(bytes_nvlink), static_cast<long long>(bytes_network), ops.size(),
                  wall_seconds);
    s += nums;
    // the communication per (op, axes): count, bytes received, seconds and the exposed part
    std::map<std::pair<std::string, std::string>, std::int64_t> bytes;
    for (const CommDebugMode::Op& op : ops) {
      bytes[{op.op, op.axes}] += op.bytes;
    }
    s.back() = ',';
    s += " \"comm\": [";
    bool first = true;
    for (const auto& [key, row] : time.rows) {
      char item[256];
      std::snprintf(
          item, sizeof item,
          "%s{\"op\": \"%s\", \"axes\": \"%s\", \"count\": %lld, \"bytes\": %lld, \"seconds\": %.6g, "
          "\"exposed_seconds\": %.6g}",
          first ? "" : ", ", key.first.c_str(), key.second.c_str(), static_cast<long long>(row.count),
          static_cast<long long>(bytes[key]), row.seconds, row.exposed);
      s += item;
      first = false;
    }
    return s + "]}";
  }
};

/// What a dry run's step gets: its world, its device, and the start of what is measured.
class DryRunContext {
public:
  DryRunContext(ProcessGroup world, int gpus_per_node)
      : world_(std::move(world)), comm_({.log_ops = true, .gpus_per_node = gpus_per_node}),
        begin_(FlopCounter::clock()) {}

  /// Rank `rank` of `world_size` on the fake backend.
  const ProcessGroup& world() const noexcept { return world_; }
  /// Meta: shapes, no data.
  static Device device() noexcept { return Device::meta(); }
  /// Measures from here: what came before (building the model, a first step that makes the optimizer's
  /// state) is dropped, and the memory's peak starts at what is live now.
  void begin_step() {
    comm_.reset();
    memory_.reset_peak();
    begin_ = FlopCounter::clock();
  }

private:
  template <class Step>
  friend DryRun dry_run(const DryRunOptions& o, Step&& step);

  ProcessGroup world_;
  CommDebugMode comm_;
  MemoryTracker memory_;
  double begin_;
};

/// Runs `step(ctx)` (a DryRunContext&) as rank `o.rank` of a fake world of `o.world_size` on meta tensors,
/// and reports it (see the top of this file). Exceptions of the step propagate.
template <class Step>
DryRun dry_run(const DryRunOptions& o, Step&& step) {
  DryRun r;
  r.rank = o.rank;
  r.world_size = o.world_size;
  const auto t0 = std::chrono::steady_clock::now();
  {
    DryRunContext ctx(fake_world(o.rank, o.world_size), o.cluster.gpus_per_node);
    step(ctx);
    const double end = FlopCounter::clock();
    r.memory = ctx.memory_.stats();
    r.ops = ctx.comm_.ops();
    r.comm_table = ctx.comm_.to_string();
    r.flops = end - ctx.begin_;
    r.time = estimate_step_time(r.ops, ctx.begin_, end, o.cluster);
  }
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const CommDebugMode::Op& op : r.ops) {
    (op.nodes > 1 ? r.bytes_network : r.bytes_nvlink) += op.bytes;
  }
  r.fits = o.cluster.gpu_memory_bytes <= 0 || double(r.memory.peak_total) <= o.cluster.gpu_memory_bytes;
  r.hfu = r.time.seconds > 0 ? r.flops / (r.time.seconds * o.cluster.peak_tflops * 1e12) : 0;
  return r;
}

} // namespace dtensor

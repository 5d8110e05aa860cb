#pragma once
// nn::plan_layouts: which training layout of a model fits on a cluster, what it moves over each link tier
// and how long its step takes, from dry runs (plan/dry_run.hpp) of the trainers' real step: for every layout
// a representative rank of the whole world runs two steps alone on the fake backend with meta tensors and
// the second is measured. Any model of the contract (nn/contract.hpp) whose units hold one run of blocks is
// planned; dtensor-plan plans the GPT presets with it.
//
//   struct MyFamily {                                   // what the planner needs of the model
//     using model_type = MyModel<nn::PlanLayout>;       // on DeviceMesh<nn::PlanStageMesh>
//     model_type make(const DeviceMesh<nn::PlanStageMesh>& stage, Device device) const;
//     auto micro_batch(const DeviceMesh<nn::PlanStageMesh>& stage, std::int64_t samples, Device device)
//         const;                                        // an (input, target) pair of `samples` (all dp's)
//     std::int64_t blocks() const;                      // the run's length: the pipeline cuts it
//     bool admits(int tp, int cp, int ep) const;        // the degrees the model divides
//     double model_flops(std::int64_t samples) const;   // optional: a step's flops as papers count them
//   };
//   std::vector<nn::PlannedLayout> plan = nn::plan_layouts(MyFamily{...}, {.nodes = 16, .global_batch = 512});
//
// The layouts: FSDP over dp (HSDP: replicas of FSDP; DDP where the replicas are all of dp), experts over ep
// of the dp ranks, pipeline stages over pp (nn::PipelineTrainer: 1F1B, or interleaved 1F1B with v model
// stages per pp rank), context parallel over cp, tensor parallel over tp (within a node), and the micro-batch
// (the local batch split into accumulation steps, the pipeline's micro-batches). The mesh is (rep, dp, ep,
// pp, cp, tp), outermost to innermost (Llama 3's order); the batch is sharded over rep x dp x ep. With
// PlanOptions::zero_bubble the pipelines are also planned under ZB-H1 and ZB-V (their B and W flops
// measured apart by the dry run, train/pipeline_schedule.hpp). Without a
// pipeline nn::FsdpTrainer runs the step (prefetching the next unit's gather, resharding after the forward
// and recomputing it in the backward: torchtitan's default).
//
// The representative ranks: ranks of the same pipeline stage do the same work and move the same bytes
// (each degree divides what it splits), except along cp, where ring attention's causal mask gives the rank
// with the sequence's last block the most work. So the first stage's rank at the last cp coordinate stands
// for the first stage and, with a pipeline, the last stage's for the last (the middle stages hold blocks
// only). A representative's step is its timeline (compute at the cluster's GEMM rate plus the communication
// its schedule does not hide: plan/comm_time.hpp) plus the time its stage idles in the pipeline
// (simulate_pipeline over every model stage: a block's flops from the first stage's first chunk, counting
// the units before the run as its blocks' (the GPT's embedding has no flops), the units after the run from
// the last stage's last chunk); the layout's step is the slower one's. A pipeline recomputes its blocks
// only where it does not fit without. The layouts come back sorted by the step, those that fit first, those
// that cannot run (an error) last.
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/nn/contract.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/plan/dry_run.hpp"
#include "dtensor/plan/time_model.hpp"
#include "dtensor/train/fsdp.hpp"
#include "dtensor/train/optim.hpp"
#include "dtensor/train/pipeline_schedule.hpp"
#include "dtensor/train/pipeline_trainer.hpp"
#include "dtensor/train/trainer.hpp"

namespace dtensor::nn {

/// The mesh of every planned layout, Llama 3's order with tp innermost: rep (HSDP's replicas), dp (the FSDP
/// shards within one), ep (the experts' shards; the batch over all three), pp, cp, tp.
using PlanMesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"ep">, Axis<"pp">, Axis<"cp">, Axis<"tp">>;
/// One pipeline stage's mesh: where the model lives.
using PlanStageMesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"ep">, Axis<"cp">, Axis<"tp">>;

/// What nn::plan_layouts tries.
struct PlanOptions {
  int nodes = 1;
  ClusterModel cluster = dgx_h100();
  std::int64_t global_batch = 1; ///< samples a step (all dp ranks together)
  std::vector<int> tp{1, 2, 4, 8}, cp{1, 2, 4, 8}, pp{1, 2, 4, 8};
  std::vector<int> chunks{1, 2}; ///< model stages per pp rank
  /// With pp > 1, also the zero-bubble schedules: ZB-H1 (one chunk per pp rank) and ZB-V (two), beside
  /// 1F1B and interleaved 1F1B.
  bool zero_bubble = false;
  std::vector<int> micro_batch{1, 2, 4}; ///< samples a micro-batch per dp rank
  std::vector<int> replicas{1};          ///< HSDP: dp as this many replicas of FSDP (1: FSDP over all of dp)
  std::vector<int> ep{1};                ///< the experts sharded over this many of the dp ranks
  DType compute = DType::bfloat16; ///< the gathered parameters and activations (float shards); or float32
  bool recompute = false;          ///< pipelines recompute their blocks even where they fit without
};

/// One layout and what its dry runs found.
struct PlannedLayout {
  int dp = 1, pp = 1, chunks = 1, cp = 1, tp = 1;
  /// With pp > 1: 1F1B (chunks 1), interleaved 1F1B (more), or with PlanOptions::zero_bubble ZB-H1 (1),
  /// ZB-V (2).
  Schedule schedule = Schedule::one_f_one_b;
  int replicas = 1; ///< HSDP: dp is this many replicas of FSDP over dp / (replicas ep) (1: no replicas)
  int ep = 1;       ///< the experts sharded over this many of the dp ranks
  std::int64_t micro_batch = 1;  ///< samples a micro-batch, per dp rank
  std::int64_t accumulation = 1; ///< micro-batches a step (the pipeline's m when pp > 1)
  /// The blocks' forward again in their backward: always under nn::FsdpTrainer (it reshards each unit after
  /// its forward); in a pipeline only where the layout does not fit without.
  bool recompute = true;
  /// The representatives' dry runs: the first pipeline stage's rank at the last cp coordinate, and with
  /// pp > 1 the last stage's.
  std::vector<DryRun> runs{};
  double step = 0;       ///< the estimated step: the slowest representative's timeline plus its pipeline idle
  double bubble = 0;     ///< of which the pipeline's idle time (simulate_pipeline)
  double hfu = 0;        ///< the flops run (a stage's mean) over the step at the cluster's peak
  double mfu = 0;        ///< the model's flops (the family's model_flops, where it has one) likewise
  std::size_t worst = 0; ///< the representative with the highest memory peak
  std::size_t slowest = 0; ///< the representative whose step is the layout's
  std::string error{};     ///< the dry run failed (the layout cannot exist): why

  bool fits() const {
    return std::all_of(runs.begin(), runs.end(), [](const DryRun& r) { return r.fits; });
  }
  /// The most a representative receives a step, over the network or over NVLink.
  std::int64_t bytes(bool network) const {
    std::int64_t b = 0;
    for (const DryRun& r : runs) {
      b = std::max(b, network ? r.bytes_network : r.bytes_nvlink);
    }
    return b;
  }
};

namespace detail {

template <class F>
concept HasModelType = requires {
  typename F::model_type;
};
template <class F>
concept FamilyMakes = requires(const F& f, const DeviceMesh<PlanStageMesh>& stage) {
  { f.make(stage, Device::meta()) } -> std::same_as<typename F::model_type>;
};
template <class F>
concept FamilyBatches = requires(const F& f, const DeviceMesh<PlanStageMesh>& stage) {
  f.micro_batch(stage, std::int64_t(1), Device::meta());
};
template <class F>
concept FamilyBlocks = requires(const F& f) {
  { f.blocks() } -> std::convertible_to<std::int64_t>;
};
template <class F>
concept FamilyAdmits = requires(const F& f) {
  { f.admits(1, 1, 1) } -> std::convertible_to<bool>;
};

} // namespace detail

/// A model family nn::plan_layouts can plan (see the top of the file).
template <class F>
concept PlannableModel = detail::HasModelType<F> && detail::FamilyMakes<F> && detail::FamilyBatches<F> &&
    detail::FamilyBlocks<F> && detail::FamilyAdmits<F>;

/// @post true: F is a model family nn::plan_layouts plans; each missing piece is its own static_assert.
template <class F>
consteval bool check_plannable() {
  static_assert(detail::HasModelType<F>, "nn::plan_layouts: the family names its model: `using model_type = "
                                         "MyModel<nn::PlanStageMesh layout>;`");
  if constexpr (detail::HasModelType<F>) {
    static_assert(check_model<typename F::model_type>());
    static_assert(detail::FamilyMakes<F>, "nn::plan_layouts: the family builds its model: `model_type "
                                          "make(const DeviceMesh<nn::PlanStageMesh>&, Device) const`");
  }
  static_assert(
      detail::FamilyBatches<F>,
      "nn::plan_layouts: the family gives a micro-batch: `auto micro_batch(const "
      "DeviceMesh<nn::PlanStageMesh>&, std::int64_t samples, Device) const`, an (input, target) pair");
  static_assert(detail::FamilyBlocks<F>, "nn::plan_layouts: the family counts the blocks the pipeline cuts: "
                                         "`std::int64_t blocks() const`");
  static_assert(detail::FamilyAdmits<F>, "nn::plan_layouts: the family says which degrees its model divides: "
                                         "`bool admits(int tp, int cp, int ep) const`");
  return true;
}

/// The layouts to dry-run: dp x pp x cp x tp = every GPU, tp within a node, the degrees the family admits,
/// the global batch over dp, each micro-batch size that divides the local batch; with pp > 1 each chunk
/// count v (1F1B with one, interleaved 1F1B with more) that leaves every model stage a block and whose
/// schedule can run the micro-batches (interleaved: a multiple of pp).
template <class Family>
std::vector<PlannedLayout> enumerate_layouts(const Family& family, const PlanOptions& o) {
  static_assert(check_plannable<Family>());
  const int world = o.nodes * o.cluster.gpus_per_node;
  std::vector<PlannedLayout> out;
  for (int tp : o.tp) {
    for (int pp : o.pp) {
      for (int cp : o.cp) {
        if (tp < 1 || pp < 1 || cp < 1 || tp > o.cluster.gpus_per_node || world % (tp * cp * pp)) {
          continue;
        }
        const int dp = world / (tp * cp * pp);
        if (o.global_batch % dp) {
          continue;
        }
        const std::int64_t local = o.global_batch / dp;
        for (int mb : o.micro_batch) {
          if (mb < 1 || local % mb) {
            continue;
          }
          const std::int64_t m = local / mb;
          std::vector<std::pair<int, Schedule>> schedules; // (v, schedule)
          for (int v : pp == 1 ? std::vector<int>{1} : o.chunks) {
            if (v >= 1 && family.blocks() >= std::int64_t(pp) * v && (v == 1 || m % pp == 0)) {
              schedules.emplace_back(v, v > 1 ? Schedule::interleaved_one_f_one_b : Schedule::one_f_one_b);
            }
          }
          if (pp > 1 && o.zero_bubble && family.blocks() >= std::int64_t(pp)) {
            schedules.emplace_back(1, Schedule::zero_bubble_h1);
            if (family.blocks() >= 2 * std::int64_t(pp)) {
              schedules.emplace_back(2, Schedule::zero_bubble_v);
            }
          }
          for (const auto& [v, schedule] : schedules) {
            for (int r : o.replicas) {
              for (int e : o.ep) {
                if (r < 1 || e < 1 || dp % (r * e) || !family.admits(tp, cp, e)) {
                  continue;
                }
                out.push_back({.dp = dp,
                               .pp = pp,
                               .chunks = v,
                               .cp = cp,
                               .tp = tp,
                               .schedule = schedule,
                               .replicas = r,
                               .ep = e,
                               .micro_batch = mb,
                               .accumulation = m});
              }
            }
          }
        }
      }
    }
  }
  return out;
}

namespace detail {

/// Two steps of layout `l` in the dry run `ctx` under FSDP or HSDP `Policy` in compute type C, the second
/// measured: it holds the optimizer's state the first one made. With pp > 1, the second step's pipeline
/// run (its chunks' flops).
template <class Policy, class C, class Family>
PipelineRunStats planned_steps(const Family& family, const PlannedLayout& l, DryRunContext& ctx) {
  using Model = typename Family::model_type;
  const Device device = ctx.device();
  const auto mesh =
      init_device_mesh<PlanMesh>(ctx.world(), l.replicas, l.dp / (l.replicas * l.ep), l.ep, l.pp, l.cp, l.tp);
  const auto stage = mesh.template slice<"rep", "dp", "ep", "cp", "tp">();
  optim::AdamW opt({.lr = 1e-4});
  using Batch = decltype(family.micro_batch(stage, 1, device));
  std::vector<Batch> micro;
  for (std::int64_t k = 0; k < l.accumulation; ++k) {
    micro.push_back(family.micro_batch(stage, l.micro_batch * l.dp, device));
  }
  if (l.pp == 1) {
    FsdpTrainer<Model, Policy, C, float> trainer(
        stage, family.make(stage, device),
        {.schedule = {.prefetch = 1, .reshard_after_forward = true, .max_reductions = 2}});
    (void)trainer.step(std::span(micro), opt);
    ctx.begin_step();
    (void)trainer.step(std::span(micro), opt);
    return {};
  }
  PipelineTrainer<Model, Policy, C, float> trainer(
      mesh.template group<"pp">(), stage, family.make(stage, device),
      {.schedule = l.schedule, .chunks = l.chunks, .recompute = l.recompute});
  (void)trainer.step(std::span(micro), opt);
  ctx.begin_step();
  (void)trainer.step(std::span(micro), opt);
  return trainer.last_run();
}

/// planned_steps in the policy (FSDP or HSDP) of layout `l` and compute type `compute`.
template <class Family>
PipelineRunStats planned_steps(const Family& family, const PlannedLayout& l, DType compute,
                               DryRunContext& ctx) {
  const bool hsdp = l.replicas > 1;
  if (compute == DType::float32) {
    return hsdp ? planned_steps<Hsdp<"rep", "dp">, float>(family, l, ctx)
                : planned_steps<Fsdp<"dp">, float>(family, l, ctx);
  }
  return hsdp ? planned_steps<Hsdp<"rep", "dp">, bfloat16>(family, l, ctx)
              : planned_steps<Fsdp<"dp">, bfloat16>(family, l, ctx);
}

/// Dry-runs layout `l` as its representative ranks and estimates its step (see the top of the file).
template <class Family>
void plan_once(const Family& family, const PlanOptions& o, PlannedLayout& l) {
  const int world = o.nodes * o.cluster.gpus_per_node;
  const double rate = o.cluster.peak_tflops * 1e12 * o.cluster.gemm_efficiency;
  std::vector<PipelineRunStats> stats;
  for (int s : l.pp == 1 ? std::vector<int>{0} : std::vector<int>{0, l.pp - 1}) {
    const int rank = (s * l.cp + l.cp - 1) * l.tp; // (rep 0, dp 0, ep 0, pp s, cp cp - 1, tp 0)
    l.runs.push_back(
        dry_run({.rank = rank, .world_size = world, .cluster = o.cluster},
                [&](DryRunContext& ctx) { stats.push_back(planned_steps(family, l, o.compute, ctx)); }));
  }
  std::vector<double> idle(l.runs.size(), 0.0);
  double flops_per_rank = l.runs.front().flops; // the HFU's: the mean over the pipeline's stages
  if (l.pp > 1) {
    const int p = l.pp, v = l.chunks, stages = p * v, layers = int(family.blocks());
    const double m = double(l.accumulation);
    const auto blocks = [&](int g) {
      const auto [first, last] = pipeline_layers(layers, stages, g);
      return double(last - first);
    };
    // A block's forward, backward (B under a splitting schedule) and W flops from the first stage's first
    // chunk; the units after the run from the last model stage's chunk (under ZB-V pp rank 0's second).
    const bool split = splits_backward(l.schedule);
    const auto weight_flops = [&](const PipelineRunStats& st, int c) {
      return split ? st.weight_flops[std::size_t(c)] : 0.0;
    };
    const double block_f = stats[0].forward_flops[0] / m / blocks(0);
    const double block_b = stats[0].backward_flops[0] / m / blocks(0);
    const double block_w = weight_flops(stats[0], 0) / m / blocks(0);
    const bool v_shape = l.schedule == Schedule::zero_bubble_v;
    const PipelineRunStats& tail = v_shape ? stats[0] : stats[1];
    const int tail_chunk = v_shape ? 1 : v - 1;
    const double tail_f = tail.forward_flops[std::size_t(tail_chunk)] / m - blocks(stages - 1) * block_f;
    const double tail_b = tail.backward_flops[std::size_t(tail_chunk)] / m - blocks(stages - 1) * block_b;
    const double tail_w = weight_flops(tail, tail_chunk) / m - blocks(stages - 1) * block_w;
    std::vector<double> forward(static_cast<std::size_t>(stages)), backward(forward.size()),
        weight(forward.size());
    for (int g = 0; g < stages; ++g) {
      const bool last = g == stages - 1;
      forward[std::size_t(g)] = (blocks(g) * block_f + (last ? tail_f : 0)) / rate;
      backward[std::size_t(g)] = (blocks(g) * block_b + (last ? tail_b : 0)) / rate;
      weight[std::size_t(g)] = (blocks(g) * block_w + (last ? tail_w : 0)) / rate;
    }
    const PipelineTimeline t =
        simulate_pipeline(l.schedule, {.stages = p, .microbatches = int(l.accumulation), .chunks = v},
                          forward, backward, weight);
    idle = {t.makespan - t.busy.front(), t.makespan - t.busy.back()};
    double busy = 0; // every stage's compute, in flops
    for (double b : t.busy) {
      busy += b * rate;
    }
    flops_per_rank = busy / p;
  }
  for (std::size_t i = 0; i < l.runs.size(); ++i) {
    const DryRun& r = l.runs[i];
    if (r.time.seconds + idle[i] > l.step) {
      l.step = r.time.seconds + idle[i];
      l.bubble = idle[i];
      l.slowest = i;
    }
    if (r.memory.peak_total > l.runs[l.worst].memory.peak_total) {
      l.worst = i;
    }
  }
  l.hfu = flops_per_rank / (l.step * o.cluster.peak_tflops * 1e12);
  if constexpr (requires { family.model_flops(o.global_batch); }) {
    l.mfu = family.model_flops(o.global_batch) / world / (l.step * o.cluster.peak_tflops * 1e12);
  }
}

} // namespace detail

/// Layout `l` planned: a pipeline without recomputation, and with it where that does not fit. An error of
/// the dry run (the layout cannot exist) goes to l.error, its first line.
template <class Family>
void plan_layout(const Family& family, const PlanOptions& o, PlannedLayout& l) {
  static_assert(check_plannable<Family>());
  try {
    l.recompute = l.pp == 1 || o.recompute;
    detail::plan_once(family, o, l);
    if (l.pp > 1 && !l.fits() && !l.recompute) {
      PlannedLayout again = l;
      again.runs.clear();
      again.step = again.bubble = again.hfu = again.mfu = 0;
      again.worst = again.slowest = 0;
      again.recompute = true;
      detail::plan_once(family, o, again);
      l = std::move(again);
    }
  } catch (const std::exception& e) {
    l.error = e.what();
    l.error = l.error.substr(0, l.error.find('\n'));
  }
}

/// Every layout of enumerate_layouts planned, sorted: those that fit by their step, then those that do not,
/// then those that cannot run.
template <class Family>
std::vector<PlannedLayout> plan_layouts(const Family& family, const PlanOptions& o) {
  std::vector<PlannedLayout> layouts = enumerate_layouts(family, o);
  for (PlannedLayout& l : layouts) {
    plan_layout(family, o, l);
  }
  std::stable_sort(layouts.begin(), layouts.end(), [](const PlannedLayout& a, const PlannedLayout& b) {
    const auto key = [](const PlannedLayout& l) {
      return std::pair{l.error.empty() ? (l.fits() ? 0 : 1) : 2, l.error.empty() ? l.step : 0.0};
    };
    return key(a) < key(b);
  });
  return layouts;
}

} // namespace dtensor::nn

#pragma once
// Pipeline schedules as value code: the order in which each rank of a pipeline runs the forwards and
// backwards of its micro-batches, and a timeline simulated from those orders (the bubble, and a check that
// no order waits on itself). No communication, no templates.
//
//   p ranks, v chunks (virtual stages) per rank, m micro-batches; chunk c of rank s is the model's stage
//   c * p + s of p * v (Megatron's interleaving: a rank holds stages s, s + p, s + 2p, ...).
//
//   gpipe                    every forward (m), then every backward in reverse; v = 1
//   one_f_one_b              min(p - s - 1, m) warm-up forwards, then one forward and one backward while
//                            forwards remain, then the remaining backwards (Megatron, torch's Schedule1F1B);
//                            v = 1
//   interleaved_one_f_one_b  v chunks per rank (Megatron's interleaved schedule, torch's
//                            ScheduleInterleaved1F1B): the k-th forward of a rank is micro-batch
//                            (k / (p v)) p + k % p of chunk (k / p) % v, its k-th backward the same
//                            micro-batch of chunk v - 1 - (k / p) % v; (p - s - 1) * 2 + (v - 1) * p warm-up
//                            forwards (at most m v), then one forward and one backward, then the remaining
//                            backwards. m must be a multiple of p (the micro-batches run in groups of p).
//
// With forward time f and backward time b on every stage and free transfers, the idle fraction of every
// rank (the bubble) is (p - 1) / (v m + p - 1) for all three when f = b (pipeline_bubble); simulate_pipeline
// computes it from the orders for any f and b.

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/core/error.hpp"

namespace dtensor {

enum class Schedule : std::uint8_t { gpipe, one_f_one_b, interleaved_one_f_one_b };

constexpr const char* schedule_name(Schedule s) noexcept {
  return s == Schedule::gpipe ? "GPipe" : s == Schedule::one_f_one_b ? "1F1B" : "interleaved 1F1B";
}

/// One compute step of a rank: the forward or backward of micro-batch `microbatch` on its chunk `chunk`.
struct PipelineAction {
  enum class Kind : std::uint8_t { forward, backward };
  Kind kind = Kind::forward;
  int microbatch = 0;
  int chunk = 0;

  friend bool operator==(const PipelineAction&, const PipelineAction&) = default;
  /// "F3" or "B0.1" (micro-batch 0 of chunk 1; the chunk is shown when the pipeline has several).
  std::string to_string(bool with_chunk = false) const {
    return (kind == Kind::forward ? "F" : "B") + std::to_string(microbatch) +
           (with_chunk ? "." + std::to_string(chunk) : "");
  }
};

/// The sizes of a pipeline.
struct PipelineShape {
  int stages = 1;       ///< ranks, p
  int microbatches = 1; ///< m
  int chunks = 1;       ///< virtual stages per rank, v (interleaved 1F1B only)
};

namespace detail {

inline void check_pipeline_shape(Schedule schedule, const PipelineShape& s) {
  const std::string what = std::string(schedule_name(schedule)) + " on " + std::to_string(s.stages) +
                           " stages, " + std::to_string(s.chunks) + " chunks per stage, " +
                           std::to_string(s.microbatches) + " micro-batches";
  DTENSOR_CHECK(s.stages >= 1 && s.microbatches >= 1 && s.chunks >= 1,
                "pipeline: " + what + ": every count must be at least 1");
  DTENSOR_CHECK(schedule == Schedule::interleaved_one_f_one_b || s.chunks == 1,
                "pipeline: " + what + ": only interleaved 1F1B runs several chunks per stage");
  DTENSOR_CHECK(schedule != Schedule::interleaved_one_f_one_b || s.microbatches % s.stages == 0,
                "pipeline: " + what +
                    ": interleaved 1F1B runs the micro-batches in groups of the stage count; "
                    "use a multiple of it");
}

} // namespace detail

/// Rank `rank`'s compute steps in order (see the top of this file).
inline std::vector<PipelineAction> pipeline_order(Schedule schedule, const PipelineShape& shape, int rank) {
  detail::check_pipeline_shape(schedule, shape);
  DTENSOR_CHECK(rank >= 0 && rank < shape.stages, "pipeline_order: rank " + std::to_string(rank) + " of " +
                                                      std::to_string(shape.stages) + " stages");
  using K = PipelineAction::Kind;
  const int p = shape.stages;
  const int m = shape.microbatches;
  const int v = shape.chunks;
  std::vector<PipelineAction> order;
  order.reserve(static_cast<std::size_t>(2 * m * v));
  if (schedule == Schedule::gpipe) {
    for (int i = 0; i < m; ++i) {
      order.push_back({K::forward, i, 0});
    }
    for (int i = m - 1; i >= 0; --i) {
      order.push_back({K::backward, i, 0});
    }
    return order;
  }
  const int total = m * v;
  const auto forward_at = [&](int k) {
    return PipelineAction{K::forward, (k / (p * v)) * p + k % p, (k / p) % v};
  };
  const auto backward_at = [&](int k) {
    return PipelineAction{K::backward, (k / (p * v)) * p + k % p, v - 1 - (k / p) % v};
  };
  const int warmup = schedule == Schedule::one_f_one_b ? std::min(p - rank - 1, m)
                                                       : std::min((p - rank - 1) * 2 + (v - 1) * p, total);
  int f = 0;
  int b = 0;
  for (; f < warmup; ++f) {
    order.push_back(forward_at(f));
  }
  while (f < total) {
    order.push_back(forward_at(f++));
    order.push_back(backward_at(b++));
  }
  while (b < total) {
    order.push_back(backward_at(b++));
  }
  return order;
}

/// A timeline of the orders, run with a forward and a backward time per model stage (or one of each for
/// every stage) and free transfers: each step starts when its rank is free and its inputs exist (the previous
/// stage's forward of the micro-batch; the next stage's backward, or on the last stage its own forward).
struct PipelineTimeline {
  double makespan = 0;
  std::vector<double> busy; ///< per rank: time computing
  /// Rank `r`'s idle fraction of the makespan.
  double idle_fraction(int r) const { return makespan > 0 ? 1.0 - busy[std::size_t(r)] / makespan : 0.0; }
};

/// The timeline of `schedule` with the forward and backward time of each model stage (p v of each; model
/// stage c p + s is chunk c of rank s): stages of unequal cost, as a model's first and last stages are
/// (the embedding, the head). Throws Error naming the rank and its waiting step when the orders wait on each
/// other (a schedule that would deadlock).
inline PipelineTimeline simulate_pipeline(Schedule schedule, const PipelineShape& shape,
                                          const std::vector<double>& forward,
                                          const std::vector<double>& backward) {
  detail::check_pipeline_shape(schedule, shape);
  const int p = shape.stages;
  const int m = shape.microbatches;
  const int v = shape.chunks;
  const int g_count = p * v; // model stages
  DTENSOR_CHECK(forward.size() == std::size_t(g_count) && backward.size() == std::size_t(g_count),
                "simulate_pipeline: " + std::to_string(forward.size()) + " forward and " +
                    std::to_string(backward.size()) + " backward times for " + std::to_string(g_count) +
                    " model stages (" + std::to_string(p) + " ranks x " + std::to_string(v) + " chunks)");
  for (int g = 0; g < g_count; ++g) {
    DTENSOR_CHECK(forward[std::size_t(g)] >= 0 && backward[std::size_t(g)] >= 0,
                  "simulate_pipeline: model stage " + std::to_string(g) + "'s forward time " +
                      std::to_string(forward[std::size_t(g)]) + " or backward time " +
                      std::to_string(backward[std::size_t(g)]) + " is negative");
  }
  std::vector<std::vector<PipelineAction>> orders;
  for (int r = 0; r < p; ++r) {
    orders.push_back(pipeline_order(schedule, shape, r));
  }
  // Finish times of (micro-batch, model stage), forward and backward; < 0: not run yet.
  std::vector<double> f_done(static_cast<std::size_t>(m * g_count), -1.0);
  std::vector<double> b_done(static_cast<std::size_t>(m * g_count), -1.0);
  const auto at = [&](int mb, int g) { return static_cast<std::size_t>(mb * g_count + g); };
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<double> free_at(static_cast<std::size_t>(p), 0.0);
  PipelineTimeline t;
  t.busy.assign(static_cast<std::size_t>(p), 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto ri = static_cast<std::size_t>(r);
      while (next[ri] < orders[ri].size()) {
        const PipelineAction& a = orders[ri][next[ri]];
        const int g = a.chunk * p + r;
        double ready = 0;
        if (a.kind == PipelineAction::Kind::forward) {
          ready = g == 0 ? 0.0 : f_done[at(a.microbatch, g - 1)];
        } else {
          ready = g == g_count - 1 ? f_done[at(a.microbatch, g)] : b_done[at(a.microbatch, g + 1)];
        }
        if (ready < 0) {
          break;
        }
        const double cost = (a.kind == PipelineAction::Kind::forward ? forward : backward)[std::size_t(g)];
        const double start = std::max(ready, free_at[ri]);
        free_at[ri] = start + cost;
        t.busy[ri] += cost;
        (a.kind == PipelineAction::Kind::forward ? f_done : b_done)[at(a.microbatch, g)] = start + cost;
        ++next[ri];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r) {
    const auto ri = static_cast<std::size_t>(r);
    DTENSOR_CHECK(next[ri] == orders[ri].size(),
                  "simulate_pipeline: " + std::string(schedule_name(schedule)) + " deadlocks: rank " +
                      std::to_string(r) + " waits at " + orders[ri][next[ri]].to_string(true) +
                      " for an input that no order produces first");
    t.makespan = std::max(t.makespan, free_at[ri]);
  }
  return t;
}

/// The timeline of `schedule` with forward time `forward` and backward time `backward` on every model stage.
inline PipelineTimeline simulate_pipeline(Schedule schedule, const PipelineShape& shape, double forward = 1,
                                          double backward = 1) {
  const std::size_t stages = std::size_t(std::max(shape.stages * shape.chunks, 0));
  return simulate_pipeline(schedule, shape, std::vector<double>(stages, forward),
                           std::vector<double>(stages, backward));
}

/// The layers [first, last) of model stage `stage` when `layers` layers are split over `stages` stages in
/// order: each gets layers / stages, and the first layers % stages one more (5 over 4: 2, 1, 1, 1). Throws
/// when there are fewer layers than stages.
inline std::pair<int, int> pipeline_layers(int layers, int stages, int stage) {
  DTENSOR_CHECK(stages >= 1 && layers >= stages && stage >= 0 && stage < stages,
                "pipeline_layers: " + std::to_string(layers) + " layers over " + std::to_string(stages) +
                    " stages (stage " + std::to_string(stage) + "): every stage needs at least one layer");
  const int base = layers / stages;
  const int extra = layers % stages;
  const int first = stage * base + std::min(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

/// The bubble fraction of GPipe, 1F1B or interleaved 1F1B with p stages, m equal micro-batches and v
/// chunks per stage, forwards as long as backwards: (p - 1) / (v m + p - 1).
constexpr double pipeline_bubble(int stages, int microbatches, int chunks = 1) {
  return double(stages - 1) / double(chunks * microbatches + stages - 1);
}

} // namespace dtensor

#pragma once
// The time a rank's communication takes on a cluster: each op of a CommDebugMode op log
// (comm/comm_debug.hpp) priced by the time model (plan/time_model.hpp) on the group it ran on.
//
//   dtensor::CommDebugMode comm({.log_ops = true, .gpus_per_node = 8});
//   ... one training step, e.g. a dry run as rank r of a large world on the fake backend ...
//   dtensor::CommTime t = dtensor::estimate_comm_time(comm.ops(), dtensor::dgx_h100());
//   t.seconds;  std::puts(t.to_string().c_str());   // per (op, axes): count, bytes, seconds
//
// Each op is priced alone and the times add up: the communication as if nothing overlapped it (what a
// schedule hides behind compute is its own question). Ops: all_reduce, all_gather, reduce_scatter,
// broadcast, reduce and all_to_all by their kind (a redistribution's all_to_all included); point-to-point
// (p2p, permute, send, recv and the pipeline's transfers) as one message of the larger of what the rank
// sends and receives, over NVLink when every rank it exchanges with is on its node, else the network;
// barriers as one launch latency. gather and scatter are priced as the broadcast of the root's blocks (a
// chain moves what the root sends or receives). Ops on one rank cost nothing.
//
// estimate_step_time puts the same ops on the step's timeline, as the schedule issued them:
//
//   const double begin = dtensor::FlopCounter::clock();    // this thread's flop clock
//   ... the step, under CommDebugMode({.log_ops = true}) ...
//   dtensor::StepTime t = dtensor::estimate_step_time(comm.ops(), begin, FlopCounter::clock(), dgx_h100());
//   t.seconds;  t.compute;  t.exposed;              // the step, its compute, the communication it waited on
//
// Compute runs at the cluster's GEMM rate (peak x gemm_efficiency) through the flops the rank counted
// (core/flop_counter.hpp), and an op starts when it is issued, or when the previous op of its group ends
// (a communicator runs its ops in order, as NCCL's stream does; ops of different groups overlap). Compute
// stops where the op's completion is waited for until the op ends: that wait is exposed communication. A
// synchronous op is waited for where it is issued, so all of it is exposed; FSDP's prefetched all_gathers,
// DDP's buckets and the ring's exchanges are waited for after the compute they overlap. Elementwise
// kernels, launch gaps and memory traffic are not in the model (the compute is GEMMs and attention only).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dtensor/comm/comm_debug.hpp"
#include "dtensor/plan/time_model.hpp"

namespace dtensor {

/// What estimate_comm_time found.
struct CommTime {
  struct Row {
    std::int64_t count = 0;
    std::int64_t size = 0; ///< the ops' sizes (CommDebugMode::Op::size), summed
    double seconds = 0;
  };
  double seconds = 0;                                      ///< every op, one after another
  std::map<std::pair<std::string, std::string>, Row> rows; ///< per (op, axes)

  /// One row per (op, axes): count, summed size, seconds; then the total.
  std::string to_string() const {
    char line[160];
    std::snprintf(line, sizeof line, "%-16s %-10s %6s %14s %12s\n", "op", "axes", "count", "size", "ms");
    std::string s = line;
    for (const auto& [key, r] : rows) {
      std::snprintf(line, sizeof line, "%-16s %-10s %6lld %14lld %12.3f\n", key.first.c_str(),
                    key.second.c_str(), static_cast<long long>(r.count), static_cast<long long>(r.size),
                    1e3 * r.seconds);
      s += line;
    }
    std::snprintf(line, sizeof line, "%-16s %-10s %6s %14s %12.3f\n", "total", "", "", "", 1e3 * seconds);
    return s + line;
  }
};

namespace detail {

/// The collective kind an op of the log is priced as; false for a barrier.
inline bool comm_kind_of(std::string_view op, CollectiveKind& kind) {
  static constexpr std::pair<std::string_view, CollectiveKind> named[] = {
      {"all_reduce", CollectiveKind::all_reduce},
      {"all_gather", CollectiveKind::all_gather},
      {"reduce_scatter", CollectiveKind::reduce_scatter},
      {"broadcast", CollectiveKind::broadcast},
      {"reduce", CollectiveKind::reduce},
      {"all_to_all", CollectiveKind::all_to_all},
      {"gather", CollectiveKind::broadcast},
      {"scatter", CollectiveKind::broadcast},
  };
  for (const auto& [name, k] : named) {
    if (op == name) {
      kind = k;
      return true;
    }
  }
  if (op == "barrier" || op == "monitored_barrier") {
    return false;
  }
  kind = CollectiveKind::send_recv; // p2p, permute, send, recv, the pipeline's transfers
  return true;
}

} // namespace detail

/// The seconds of one op of the log on cluster `c` (see the top of this file).
inline double comm_op_seconds(const CommDebugMode::Op& op, const ClusterModel& c) {
  if (op.ranks <= 1) {
    return 0;
  }
  CollectiveKind kind{};
  if (!detail::comm_kind_of(op.op, kind)) {
    return c.base_latency_us * 1e-6;
  }
  GroupSpan span{op.ranks, op.nodes};
  if (kind == CollectiveKind::send_recv) {
    span = GroupSpan{2, op.nodes > 1 ? 2 : 1};
  } else if (span.ranks % span.nodes != 0 || span.ranks / span.nodes > c.gpus_per_node) {
    // Members spread unevenly over their nodes: priced as if spread evenly over as many nodes as the
    // largest share needs (the bandwidth of the slowest tier is what the ring sees either way).
    span.nodes =
        std::min(span.ranks, std::max(span.nodes, (span.ranks + c.gpus_per_node - 1) / c.gpus_per_node));
    while (span.ranks % span.nodes != 0) {
      ++span.nodes;
    }
  }
  return estimate_collective(kind, op.size, span, c).seconds;
}

/// A step on the timeline (estimate_step_time).
struct StepTime {
  struct Row {
    std::int64_t count = 0;
    double seconds = 0; ///< the ops' time
    double exposed = 0; ///< of which compute waited on
  };
  double compute = 0;                                      ///< the step's flops at the GEMM rate
  double comm = 0;                                         ///< every op, one after another
  double exposed = 0;                                      ///< the communication compute waited on
  double seconds = 0;                                      ///< compute + exposed
  std::map<std::pair<std::string, std::string>, Row> rows; ///< per (op, axes)

  /// One row per (op, axes): count, ms, exposed ms; then the step's.
  std::string to_string() const {
    char line[160];
    std::snprintf(line, sizeof line, "%-16s %-10s %6s %12s %12s\n", "op", "axes", "count", "ms",
                  "exposed ms");
    std::string s = line;
    for (const auto& [key, r] : rows) {
      std::snprintf(line, sizeof line, "%-16s %-10s %6lld %12.3f %12.3f\n", key.first.c_str(),
                    key.second.c_str(), static_cast<long long>(r.count), 1e3 * r.seconds, 1e3 * r.exposed);
      s += line;
    }
    std::snprintf(line, sizeof line,
                  "compute %.3f ms, communication %.3f ms of which exposed %.3f ms: step %.3f ms\n",
                  1e3 * compute, 1e3 * comm, 1e3 * exposed, 1e3 * seconds);
    return s + line;
  }
};

/// The step whose ops are `ops` (an op log) and whose compute is this thread's flop clock from
/// `begin_flops` to `end_flops`, on cluster `c` (see the top of this file).
inline StepTime estimate_step_time(std::span<const CommDebugMode::Op> ops, double begin_flops,
                                   double end_flops, const ClusterModel& c) {
  struct Event {
    std::int64_t seq;
    double flops;
    std::size_t op;
    bool wait;
  };
  std::vector<Event> events;
  constexpr std::int64_t never = std::numeric_limits<std::int64_t>::max();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    events.push_back({ops[i].issued_seq, ops[i].issued_flops, i, false});
    const bool waited = ops[i].waited != nullptr && ops[i].waited->seq >= 0;
    events.push_back(
        {waited ? ops[i].waited->seq : never, waited ? ops[i].waited->flops : end_flops, i, true});
  }
  std::stable_sort(events.begin(), events.end(),
                   [](const Event& a, const Event& b) { return a.seq < b.seq; });
  const double rate = c.peak_tflops * 1e12 * c.gemm_efficiency;
  StepTime t;
  std::vector<double> ends(ops.size(), 0);
  std::map<std::string, double> free_at; // per group: when its last op ends
  double now = 0;
  double at = begin_flops;
  const auto advance = [&](double flops) {
    if (flops > at) {
      now += (flops - at) / rate;
      at = flops;
    }
  };
  for (const Event& e : events) {
    advance(e.flops);
    const CommDebugMode::Op& op = ops[e.op];
    StepTime::Row& r = t.rows[{op.op, op.axes}];
    if (!e.wait) {
      const double s = comm_op_seconds(op, c);
      double& free = free_at[op.axes];
      ends[e.op] = std::max(now, free) + s;
      free = ends[e.op];
      ++r.count;
      r.seconds += s;
      t.comm += s;
    } else if (ends[e.op] > now) {
      r.exposed += ends[e.op] - now;
      t.exposed += ends[e.op] - now;
      now = ends[e.op];
    }
  }
  advance(end_flops);
  t.compute = (end_flops - begin_flops) / rate;
  t.seconds = now;
  return t;
}

/// Every op of `ops` priced on `c`, one after another (see the top of this file).
inline CommTime estimate_comm_time(std::span<const CommDebugMode::Op> ops, const ClusterModel& c) {
  CommTime t;
  for (const CommDebugMode::Op& op : ops) {
    const double s = comm_op_seconds(op, c);
    CommTime::Row& r = t.rows[{op.op, op.axes}];
    ++r.count;
    r.size += op.size;
    r.seconds += s;
    t.seconds += s;
  }
  return t;
}

} // namespace dtensor

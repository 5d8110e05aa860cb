#pragma once
// A time model of a cluster of GPUs, for plans and dry runs: how long a collective, a point-to-point
// message or a GEMM takes on a given group, from a few numbers per link tier (intra-node NVLink/NVSwitch,
// inter-node InfiniBand/RoCE) and per GPU.
//
//   ClusterModel c = dgx_h100();              // or parse_cluster_model(text): a small config file
//   CollectiveEstimate e = estimate_collective(CollectiveKind::all_reduce, 256 << 20, GroupSpan{64, 8}, c);
//   e.seconds;  e.algorithm;                  // "ring" or "tree", whichever is faster (as NCCL picks)
//   double t = gemm_seconds(8192, 8192, 8192, c);
//
// The form is NCCL's own tuning model (src/graph/tuning.cc, the Simple protocol): an op costs a launch
// latency, a per-step latency for each step of its algorithm on the tier that step crosses, and its bytes
// over the algorithm's bandwidth.
//   - ring: all_reduce takes 2(n-1) steps, all_gather and reduce_scatter n-1, of which 2(nodes-1) and
//     nodes-1 cross nodes; its bus bandwidth is the slowest tier the ring crosses, and it moves 2(n-1)/n of
//     the buffer (all_reduce) or (n-1)/n (all_gather, reduce_scatter: nccl-tests' bus-bandwidth factors).
//   - tree (all_reduce only): 2((ranks per node - 1) intra steps + log2(nodes) inter steps); half the bus
//     bandwidth (reduce up, broadcast down), derated by NCCL's 0.92.
//   - broadcast and reduce: a pipelined chain, one step's latency; the buffer at the bus bandwidth.
//   - all_to_all: every rank sends (n-1)/n of its buffer at once, the part for other nodes over the
//     network and the rest over NVLink side by side; send_recv: one message on one tier.
// Bytes are nccl-tests' "size": the buffer of all_reduce, broadcast and reduce, the output of all_gather,
// the input of reduce_scatter, what each rank sends in all_to_all, the message of send_recv.
// Every default of the presets says where it comes from; what is an assumption says so (calibrate it with
// nccl-tests and a GEMM benchmark on the machine, then set it in the config file).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace dtensor {

/// One tier of links, as a rank sees it.
struct LinkTier {
  /// Bandwidth one rank sends (and receives) at over this tier, GB/s (10^9 bytes) each way.
  double bandwidth_GBps = 0;
  /// Latency of one step of a ring, and of a tree, over this tier, microseconds.
  double ring_latency_us = 0;
  double tree_latency_us = 0;
};

/// A cluster of identical nodes of `gpus_per_node` GPUs.
struct ClusterModel {
  std::string name;
  int gpus_per_node = 8;
  double gpu_memory_bytes = 0;
  /// Dense peak of the training dtype (bfloat16), TFLOPS, and the fraction of it a large GEMM reaches.
  double peak_tflops = 0;
  /// Dense peak of float GEMMs on the tensor cores (TF32), TFLOPS: a float-compute step's rate.
  double peak_tflops_tf32 = 0;
  double gemm_efficiency = 1;
  /// The fraction of each tier's bandwidth that collectives reach (NCCL's bus bandwidth / link rate).
  double bandwidth_efficiency = 1;
  /// The launch latency of a collective (NCCL's base latency), microseconds.
  double base_latency_us = 0;
  LinkTier nvlink;  // within a node
  LinkTier network; // between nodes
};

/// A DGX H100: 8 H100 SXM5 80 GB, NVLink 4 through NVSwitch, one 400 Gb/s ConnectX-7 per GPU.
inline ClusterModel dgx_h100() {
  ClusterModel c;
  c.name = "dgx_h100";
  c.gpus_per_node = 8;            // NVIDIA DGX H100 user guide: 8 x H100
  c.gpu_memory_bytes = 80e9;      // H100 SXM5 datasheet: 80 GB HBM3
  c.peak_tflops = 989;            // H100 SXM5 datasheet: BF16 1,979 TFLOPS with sparsity, half dense
  c.peak_tflops_tf32 = 494.5;     // H100 SXM5 datasheet: TF32 989 TFLOPS with sparsity, half dense
  c.gemm_efficiency = 0.7;        // assumption: large cuBLAS BF16 GEMMs at about 70 % of dense peak
  c.bandwidth_efficiency = 0.8;   // assumption: nccl-tests bus bandwidth at about 80 % of the link rate
  c.base_latency_us = 8.4;        // NCCL tuning.cc: base latency of ring and tree, Simple protocol
  c.nvlink.bandwidth_GBps = 450;  // H100 SXM5 datasheet: NVLink 900 GB/s, both directions together
  c.nvlink.ring_latency_us = 3.4; // NCCL tuning.cc: NVLink hardware latency, ring, Simple
  c.nvlink.tree_latency_us = 4.0; // NCCL tuning.cc: NVLink hardware latency, tree, Simple
  c.network.bandwidth_GBps = 50;  // DGX H100 user guide: 8 x 400 Gb/s ConnectX-7, one per GPU
  c.network.ring_latency_us = 14; // NCCL tuning.cc: network hardware latency, ring, Simple
  c.network.tree_latency_us = 14; // NCCL tuning.cc: network hardware latency, tree, Simple
  return c;
}

/// A DGX H200: as the DGX H100 with 141 GB per GPU (H200 SXM datasheet: 141 GB HBM3e, the same NVLink
/// 900 GB/s and BF16 peak).
inline ClusterModel dgx_h200() {
  ClusterModel c = dgx_h100();
  c.name = "dgx_h200";
  c.gpu_memory_bytes = 141e9;
  return c;
}

/// A DGX A100 80 GB (the machines of Megatron-LM's and many published runs): 8 A100 SXM4 80 GB, NVLink 3
/// through NVSwitch, one 200 Gb/s HDR InfiniBand adapter per GPU. The efficiencies and latencies are the
/// DGX H100's (the same assumptions; NCCL's tuning.cc uses the same hardware latencies for both).
inline ClusterModel dgx_a100() {
  ClusterModel c = dgx_h100();
  c.name = "dgx_a100";
  c.gpu_memory_bytes = 80e9;     // A100 SXM4 80 GB datasheet: 80 GB HBM2e
  c.peak_tflops = 312;           // A100 datasheet: BF16 tensor core 312 TFLOPS dense (624 with sparsity)
  c.peak_tflops_tf32 = 156;      // A100 datasheet: TF32 tensor core 156 TFLOPS dense (312 with sparsity)
  c.nvlink.bandwidth_GBps = 300; // A100 datasheet: NVLink 600 GB/s, both directions together
  c.network.bandwidth_GBps = 25; // DGX A100 user guide: 8 x 200 Gb/s HDR ConnectX-6 for compute, one per GPU
  return c;
}

/// Where a group's ranks sit: `ranks` over `nodes` nodes, ranks / nodes on each.
struct GroupSpan {
  int ranks = 1;
  int nodes = 1;
};

enum class CollectiveKind {
  all_reduce,
  all_gather,
  reduce_scatter,
  broadcast,
  reduce,
  all_to_all,
  send_recv
};

constexpr const char* to_string(CollectiveKind k) noexcept {
  switch (k) {
  case CollectiveKind::all_reduce:
    return "all_reduce";
  case CollectiveKind::all_gather:
    return "all_gather";
  case CollectiveKind::reduce_scatter:
    return "reduce_scatter";
  case CollectiveKind::broadcast:
    return "broadcast";
  case CollectiveKind::reduce:
    return "reduce";
  case CollectiveKind::all_to_all:
    return "all_to_all";
  case CollectiveKind::send_recv:
    return "send_recv";
  }
  return "?";
}

struct CollectiveEstimate {
  double seconds = 0;
  /// "ring", "tree", "chain" (broadcast, reduce), "direct" (all_to_all, send_recv) or "local" (one rank).
  const char* algorithm = "local";
};

namespace detail {

inline void check_span(CollectiveKind k, GroupSpan g, const ClusterModel& c) {
  const bool ok = g.ranks >= 1 && g.nodes >= 1 && g.nodes <= g.ranks && g.ranks % g.nodes == 0 &&
                  g.ranks / g.nodes <= c.gpus_per_node && (k != CollectiveKind::send_recv || g.ranks == 2);
  if (!ok) {
    throw std::invalid_argument(std::string("estimate_collective(") + to_string(k) + "): a group of " +
                                std::to_string(g.ranks) + " ranks over " + std::to_string(g.nodes) +
                                " nodes does not fit " + c.name + " (" + std::to_string(c.gpus_per_node) +
                                " GPUs a node; the same number of ranks on each node" +
                                (k == CollectiveKind::send_recv ? "; send_recv is between 2 ranks)" : ")"));
  }
}

inline double bytes_seconds(double bytes, double GBps, double efficiency) {
  return bytes / (GBps * 1e9 * efficiency);
}

} // namespace detail

/// How long `kind` of `bytes` (nccl-tests' size, see the top of this file) takes on the group `g` of
/// cluster `c`. Throws std::invalid_argument when the group does not fit the cluster or bytes < 0.
inline CollectiveEstimate estimate_collective(CollectiveKind kind, std::int64_t bytes, GroupSpan g,
                                              const ClusterModel& c) {
  detail::check_span(kind, g, c);
  if (bytes < 0) {
    throw std::invalid_argument(std::string("estimate_collective(") + to_string(kind) +
                                "): " + std::to_string(bytes) + " bytes");
  }
  if (g.ranks == 1) {
    return {0, "local"};
  }
  const double n = g.ranks, nodes = g.nodes, ppn = n / nodes, b = static_cast<double>(bytes);
  const bool across = g.nodes > 1;
  const LinkTier& slow = across ? c.network : c.nvlink;
  const double bus = std::min(c.nvlink.bandwidth_GBps, slow.bandwidth_GBps);
  const double base = c.base_latency_us * 1e-6;
  const double eff = c.bandwidth_efficiency;
  switch (kind) {
  case CollectiveKind::all_reduce:
  case CollectiveKind::all_gather:
  case CollectiveKind::reduce_scatter: {
    const bool ar = kind == CollectiveKind::all_reduce;
    const double steps = (ar ? 2 : 1) * (n - 1), inter = (ar ? 2 : 1) * (nodes - 1);
    const double ring =
        base + ((steps - inter) * c.nvlink.ring_latency_us + inter * c.network.ring_latency_us) * 1e-6 +
        detail::bytes_seconds(b * steps / n, bus, eff);
    if (!ar) {
      return {ring, "ring"};
    }
    const double tree =
        base +
        2 * ((ppn - 1) * c.nvlink.tree_latency_us + std::ceil(std::log2(nodes)) * c.network.tree_latency_us) *
            1e-6 +
        detail::bytes_seconds(b, 0.5 * 0.92 * bus, eff);
    return tree < ring ? CollectiveEstimate{tree, "tree"} : CollectiveEstimate{ring, "ring"};
  }
  case CollectiveKind::broadcast:
  case CollectiveKind::reduce:
    return {base + slow.ring_latency_us * 1e-6 + detail::bytes_seconds(b, bus, eff), "chain"};
  case CollectiveKind::all_to_all: {
    const double off_node = b * (n - ppn) / n, on_node = b * (ppn - 1) / n;
    const double moving =
        std::max(across ? detail::bytes_seconds(off_node, c.network.bandwidth_GBps, eff) : 0.0,
                 detail::bytes_seconds(on_node, c.nvlink.bandwidth_GBps, eff));
    return {base + slow.ring_latency_us * 1e-6 + moving, "direct"};
  }
  case CollectiveKind::send_recv:
    return {base + slow.ring_latency_us * 1e-6 + detail::bytes_seconds(b, slow.bandwidth_GBps, eff),
            "direct"};
  }
  return {};
}

/// Seconds of an m x k by k x n GEMM (2mnk flops) at the cluster's GEMM efficiency.
inline double gemm_seconds(std::int64_t m, std::int64_t n, std::int64_t k, const ClusterModel& c) {
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) /
         (c.peak_tflops * 1e12 * c.gemm_efficiency);
}

/// A ClusterModel from a config file's text: `key = value` lines, `#` comments. `preset = dgx_h100` (or
/// dgx_h200, dgx_a100) starts from a preset, which must come first; the other keys set one field each: name,
/// gpus_per_node, gpu_memory_GB, peak_tflops, peak_tflops_tf32, gemm_efficiency, bandwidth_efficiency,
/// base_latency_us, and nvlink.* / network.* with bandwidth_GBps, ring_latency_us, tree_latency_us. Throws
/// std::invalid_argument naming the line on an unknown key, a bad value or a line that is not `key = value`.
inline ClusterModel parse_cluster_model(std::string_view text) {
  ClusterModel c = dgx_h100();
  int line_no = 0;
  bool any_key = false;
  auto trim = [](std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) {
      s.remove_prefix(1);
    }
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
      s.remove_suffix(1);
    }
    return s;
  };
  while (!text.empty()) {
    const std::size_t nl = std::min(text.find('\n'), text.size());
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(std::min(nl + 1, text.size()));
    ++line_no;
    line = trim(line.substr(0, line.find('#')));
    if (line.empty()) {
      continue;
    }
    const auto fail = [&](const std::string& why) {
      throw std::invalid_argument("cluster model, line " + std::to_string(line_no) + " ('" +
                                  std::string(line) + "'): " + why);
    };
    const std::size_t eq = line.find('=');
    if (eq == std::string_view::npos) {
      fail("expected key = value");
    }
    const std::string key(trim(line.substr(0, eq)));
    const std::string value(trim(line.substr(eq + 1)));
    if (key == "preset") {
      if (any_key) {
        fail("preset must come before the keys it is the base of");
      }
      if (value == "dgx_h100") {
        c = dgx_h100();
      } else if (value == "dgx_h200") {
        c = dgx_h200();
      } else if (value == "dgx_a100") {
        c = dgx_a100();
      } else {
        fail("unknown preset (dgx_h100, dgx_h200, dgx_a100)");
      }
      continue;
    }
    any_key = true;
    if (key == "name") {
      c.name = value;
      continue;
    }
    double v = 0;
    std::size_t used = 0;
    try {
      v = std::stod(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != value.size() || !(v > 0) || !std::isfinite(v)) {
      fail("the value must be a positive number");
    }
    if (key == "gpus_per_node") {
      if (v != std::floor(v) || v > 1 << 20) {
        fail("gpus_per_node must be a whole number");
      }
      c.gpus_per_node = static_cast<int>(v);
    } else if (key == "gpu_memory_GB") {
      c.gpu_memory_bytes = v * 1e9;
    } else if (key == "peak_tflops") {
      c.peak_tflops = v;
    } else if (key == "peak_tflops_tf32") {
      c.peak_tflops_tf32 = v;
    } else if (key == "gemm_efficiency" || key == "bandwidth_efficiency") {
      if (v > 1) {
        fail(key + " is a fraction, at most 1");
      }
      (key == "gemm_efficiency" ? c.gemm_efficiency : c.bandwidth_efficiency) = v;
    } else if (key == "base_latency_us") {
      c.base_latency_us = v;
    } else if (key.starts_with("nvlink.") || key.starts_with("network.")) {
      LinkTier& t = key.starts_with("nvlink.") ? c.nvlink : c.network;
      const std::string field = key.substr(key.find('.') + 1);
      if (field == "bandwidth_GBps") {
        t.bandwidth_GBps = v;
      } else if (field == "ring_latency_us") {
        t.ring_latency_us = v;
      } else if (field == "tree_latency_us") {
        t.tree_latency_us = v;
      } else {
        fail("unknown key");
      }
    } else {
      fail("unknown key");
    }
  }
  return c;
}

} // namespace dtensor

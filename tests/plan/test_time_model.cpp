// The time model (plan/time_model.hpp) against its formulas written out by hand for each algorithm, the
// algorithm choice at the two ends of the size range, the group checks, and the config file's parser. An op
// log (CommDebugMode) priced op by op (plan/comm_time.hpp).

#include <catch2/catch.hpp>

#include <dtensor/plan/comm_time.hpp>
#include <dtensor/plan/time_model.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using namespace dtensor;
using Catch::Matchers::Contains;

namespace {

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

} // namespace

TEST_CASE("time model: one rank is free, whatever the op") {
  const ClusterModel c = dgx_h100();
  for (auto k : {CollectiveKind::all_reduce, CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                 CollectiveKind::broadcast, CollectiveKind::reduce, CollectiveKind::all_to_all}) {
    const CollectiveEstimate e = estimate_collective(k, 1 << 20, {1, 1}, c);
    CHECK(e.seconds == 0);
    CHECK(std::string(e.algorithm) == "local");
  }
}

TEST_CASE("time model: rings and trees within a node as NCCL's model writes them") {
  const ClusterModel c = dgx_h100();
  const double B = 1 << 30, bw = 450e9 * 0.8;
  // all_reduce, 8 ranks: 14 ring steps on NVLink, 2(n-1)/n of the buffer at the bus bandwidth
  const CollectiveEstimate ar = estimate_collective(CollectiveKind::all_reduce, 1 << 30, {8, 1}, c);
  CHECK(std::string(ar.algorithm) == "ring");
  CHECK(ar.seconds == Approx(8.4e-6 + 14 * 3.4e-6 + B * 14 / 8 / bw).epsilon(1e-12));
  // all_gather and reduce_scatter: 7 steps, (n-1)/n of the output / input
  for (auto k : {CollectiveKind::all_gather, CollectiveKind::reduce_scatter}) {
    CHECK(estimate_collective(k, 1 << 30, {8, 1}, c).seconds ==
          Approx(8.4e-6 + 7 * 3.4e-6 + B * 7 / 8 / bw).epsilon(1e-12));
  }
  // broadcast: one step's latency, the whole buffer
  CHECK(estimate_collective(CollectiveKind::broadcast, 1 << 30, {8, 1}, c).seconds ==
        Approx(8.4e-6 + 3.4e-6 + B / bw).epsilon(1e-12));
  // a tiny all_reduce on 8 ranks: the tree's 2 * 7 steps of 4.0 us lose to the ring's 14 of 3.4
  CHECK(std::string(estimate_collective(CollectiveKind::all_reduce, 64, {8, 1}, c).algorithm) == "ring");
}

TEST_CASE("time model: across nodes the tree wins at scale, the ring large all_reduces on few nodes") {
  const ClusterModel c = dgx_h100();
  const GroupSpan g{1024, 128};
  const CollectiveEstimate small = estimate_collective(CollectiveKind::all_reduce, 1024, g, c);
  CHECK(std::string(small.algorithm) == "tree");
  // 2 * (7 NVLink steps + log2(128) network steps)
  CHECK(small.seconds == Approx(8.4e-6 + 2 * (7 * 4.0e-6 + 7 * 14e-6) + 1024 / (0.5 * 0.92 * 50e9 * 0.8)));
  // at 128 nodes the ring's 2046 steps (254 of them between nodes: 9.7 ms) lose even at 1 GiB
  CHECK(std::string(estimate_collective(CollectiveKind::all_reduce, std::int64_t(1) << 30, g, c).algorithm) ==
        "tree");
  // on 2 nodes a large all_reduce rings: 30 steps, 2 between nodes; the network is the bottleneck
  const CollectiveEstimate large =
      estimate_collective(CollectiveKind::all_reduce, std::int64_t(1) << 30, {16, 2}, c);
  CHECK(std::string(large.algorithm) == "ring");
  CHECK(large.seconds ==
        Approx(8.4e-6 + (28 * 3.4e-6 + 2 * 14e-6) + double(1 << 30) * 30 / 16 / (50e9 * 0.8)).epsilon(1e-12));
  // the same group size on one node and across two: crossing costs more
  CHECK(estimate_collective(CollectiveKind::all_gather, 1 << 24, {8, 1}, c).seconds <
        estimate_collective(CollectiveKind::all_gather, 1 << 24, {8, 2}, c).seconds);
}

TEST_CASE("time model: all_to_all moves the off-node part over the network beside the rest over NVLink") {
  const ClusterModel c = dgx_h100();
  const double B = 1 << 28;
  // 16 ranks over 2 nodes: 8/16 of the buffer leaves the node, 7/16 stays on it
  const CollectiveEstimate e = estimate_collective(CollectiveKind::all_to_all, 1 << 28, {16, 2}, c);
  CHECK(std::string(e.algorithm) == "direct");
  CHECK(e.seconds ==
        Approx(8.4e-6 + 14e-6 + std::max(B * 8 / 16 / (50e9 * 0.8), B * 7 / 16 / (450e9 * 0.8))));
  // one node: NVLink only
  CHECK(estimate_collective(CollectiveKind::all_to_all, 1 << 28, {8, 1}, c).seconds ==
        Approx(8.4e-6 + 3.4e-6 + B * 7 / 8 / (450e9 * 0.8)));
}

TEST_CASE("time model: send_recv on each tier, and the time grows with the bytes") {
  const ClusterModel c = dgx_h100();
  CHECK(estimate_collective(CollectiveKind::send_recv, 1 << 20, {2, 1}, c).seconds ==
        Approx(8.4e-6 + 3.4e-6 + double(1 << 20) / (450e9 * 0.8)));
  CHECK(estimate_collective(CollectiveKind::send_recv, 1 << 20, {2, 2}, c).seconds ==
        Approx(8.4e-6 + 14e-6 + double(1 << 20) / (50e9 * 0.8)));
  for (auto k : {CollectiveKind::all_reduce, CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                 CollectiveKind::broadcast, CollectiveKind::all_to_all}) {
    double last = 0;
    for (std::int64_t b = 1; b <= (std::int64_t(1) << 34); b *= 4) {
      const double t = estimate_collective(k, b, {512, 64}, c).seconds;
      CHECK(t >= last);
      last = t;
    }
  }
}

TEST_CASE("time model: groups that do not fit the cluster are errors naming them") {
  const ClusterModel c = dgx_h100();
  CHECK_THAT(error_of([&] {
               estimate_collective(CollectiveKind::all_reduce, 8, {16, 1}, c);
             }),
             Contains("16 ranks over 1 nodes does not fit dgx_h100 (8 GPUs a node"));
  CHECK_THAT(error_of([&] {
               estimate_collective(CollectiveKind::all_gather, 8, {12, 5}, c);
             }),
             Contains("the same number of ranks on each node"));
  CHECK_THAT(error_of([&] {
               estimate_collective(CollectiveKind::send_recv, 8, {3, 1}, c);
             }),
             Contains("send_recv is between 2 ranks"));
  CHECK_THAT(error_of([&] {
               estimate_collective(CollectiveKind::broadcast, -1, {2, 1}, c);
             }),
             Contains("broadcast): -1 bytes"));
  CHECK_THAT(error_of([&] {
               estimate_collective(CollectiveKind::reduce, 8, {0, 1}, c);
             }),
             Contains("a group of 0 ranks"));
}

TEST_CASE("time model: a GEMM's 2mnk flops at the efficiency of the peak") {
  const ClusterModel c = dgx_h200();
  CHECK(gemm_seconds(8192, 4096, 1024, c) == Approx(2.0 * 8192 * 4096 * 1024 / (989e12 * 0.7)));
  CHECK(gemm_seconds(0, 4096, 1024, c) == 0);
  CHECK(c.gpu_memory_bytes == 141e9);
  // A DGX A100: a third of the peak, two thirds of NVLink, half the network of a DGX H100.
  const ClusterModel a = parse_cluster_model("preset = dgx_a100\n");
  CHECK(a.name == "dgx_a100");
  CHECK(gemm_seconds(8192, 4096, 1024, a) == Approx(2.0 * 8192 * 4096 * 1024 / (312e12 * 0.7)));
  CHECK(a.nvlink.bandwidth_GBps == 300);
  CHECK(a.network.bandwidth_GBps == 25);
  CHECK(a.peak_tflops_tf32 == 156);
  CHECK(parse_cluster_model("peak_tflops_tf32 = 400\n").peak_tflops_tf32 == 400);
}

TEST_CASE("time model: the config file: a preset, keys over it, comments, and errors naming the line") {
  const ClusterModel c = parse_cluster_model(R"(# a cluster of H200 nodes on RoCE
preset = dgx_h200
name = my_cluster
network.bandwidth_GBps = 25     # 200 Gb/s NICs
network.ring_latency_us = 20
gemm_efficiency = 0.6

gpus_per_node = 4
)");
  CHECK(c.name == "my_cluster");
  CHECK(c.gpu_memory_bytes == 141e9);
  CHECK(c.network.bandwidth_GBps == 25);
  CHECK(c.network.ring_latency_us == 20);
  CHECK(c.network.tree_latency_us == 14);
  CHECK(c.nvlink.bandwidth_GBps == 450);
  CHECK(c.gemm_efficiency == 0.6);
  CHECK(c.gpus_per_node == 4);
  CHECK(parse_cluster_model("").name == "dgx_h100");

  CHECK_THAT(error_of([] { parse_cluster_model("preset = dgx_h100\n\nnvlink.speed = 3\n"); }),
             Contains("line 3 ('nvlink.speed = 3'): unknown key"));
  CHECK_THAT(error_of([] { parse_cluster_model("peak_tflops = fast"); }),
             Contains("line 1 ('peak_tflops = fast'): the value must be a positive number"));
  CHECK_THAT(error_of([] { parse_cluster_model("peak_tflops = -3"); }), Contains("a positive number"));
  CHECK_THAT(error_of([] { parse_cluster_model("gemm_efficiency = 1.5"); }),
             Contains("a fraction, at most 1"));
  CHECK_THAT(error_of([] { parse_cluster_model("gpus_per_node = 7.5"); }), Contains("a whole number"));
  CHECK_THAT(error_of([] { parse_cluster_model("name = x\npreset = dgx_h100"); }),
             Contains("line 2 ('preset = dgx_h100'): preset must come before"));
  CHECK_THAT(error_of([] { parse_cluster_model("preset = dgx_b200"); }), Contains("unknown preset"));
  CHECK_THAT(error_of([] { parse_cluster_model("just words"); }), Contains("expected key = value"));
}

TEST_CASE("time model: an op log priced op by op on the group each op ran on") {
  const ClusterModel c = dgx_h100();
  auto op = [](const char* name, const char* axes, std::int64_t size, int ranks, int nodes) {
    return CommDebugMode::Op{.op = name, .axes = axes, .size = size, .ranks = ranks, .nodes = nodes};
  };
  const std::vector<CommDebugMode::Op> ops{
      op("all_reduce", "tp", 1 << 20, 8, 1),      op("all_reduce", "tp", 1 << 20, 8, 1),
      op("all_gather", "dp", 64 << 20, 128, 128), op("reduce_scatter", "dp", 64 << 20, 128, 128),
      op("all_to_all", "ep", 8 << 20, 16, 2),     op("irecv", "pp", 4 << 20, 2, 2),
      op("permute", "tp", 1 << 16, 2, 1),         op("barrier", "", 0, 8, 1),
      op("all_reduce", "cp", 1 << 20, 1, 1),      op("gather", "", 1 << 10, 4, 1),
      op("all_reduce", "dp*tp", 1 << 20, 12, 3)};
  const CommTime t = estimate_comm_time(ops, c);
  const double tp = estimate_collective(CollectiveKind::all_reduce, 1 << 20, {8, 1}, c).seconds;
  const double ag = estimate_collective(CollectiveKind::all_gather, 64 << 20, {128, 128}, c).seconds;
  const double rs = estimate_collective(CollectiveKind::reduce_scatter, 64 << 20, {128, 128}, c).seconds;
  const double a2a = estimate_collective(CollectiveKind::all_to_all, 8 << 20, {16, 2}, c).seconds;
  const double p2p_net = estimate_collective(CollectiveKind::send_recv, 4 << 20, {2, 2}, c).seconds;
  const double p2p_nvl = estimate_collective(CollectiveKind::send_recv, 1 << 16, {2, 1}, c).seconds;
  const double gather = estimate_collective(CollectiveKind::broadcast, 1 << 10, {4, 1}, c).seconds;
  // 12 ranks on 3 nodes: 4 a node, as the members sit.
  const double spread = estimate_collective(CollectiveKind::all_reduce, 1 << 20, {12, 3}, c).seconds;
  const double barrier = c.base_latency_us * 1e-6;
  CHECK(t.rows.at({"all_reduce", "tp"}).count == 2);
  CHECK(t.rows.at({"all_reduce", "tp"}).size == 2 << 20);
  CHECK(t.rows.at({"all_reduce", "tp"}).seconds == Approx(2 * tp));
  CHECK(t.rows.at({"all_gather", "dp"}).seconds == Approx(ag));
  CHECK(t.rows.at({"reduce_scatter", "dp"}).seconds == Approx(rs));
  CHECK(t.rows.at({"all_to_all", "ep"}).seconds == Approx(a2a));
  CHECK(t.rows.at({"irecv", "pp"}).seconds == Approx(p2p_net));
  CHECK(t.rows.at({"permute", "tp"}).seconds == Approx(p2p_nvl));
  CHECK(t.rows.at({"barrier", ""}).seconds == Approx(barrier));
  CHECK(t.rows.at({"all_reduce", "cp"}).seconds == 0); // one rank
  CHECK(t.rows.at({"gather", ""}).seconds == Approx(gather));
  CHECK(t.rows.at({"all_reduce", "dp*tp"}).seconds == Approx(spread));
  CHECK(t.seconds == Approx(2 * tp + ag + rs + a2a + p2p_net + p2p_nvl + barrier + gather + spread));
  CHECK(p2p_net > p2p_nvl);
  // Members spread unevenly (6 ranks on 4 nodes, 16 on 1 node of 8): priced on an even spread that fits.
  CHECK(comm_op_seconds(op("all_gather", "x", 1 << 20, 6, 4), c) ==
        Approx(estimate_collective(CollectiveKind::all_gather, 1 << 20, {6, 6}, c).seconds));
  CHECK(comm_op_seconds(op("all_gather", "x", 1 << 20, 16, 1), c) ==
        Approx(estimate_collective(CollectiveKind::all_gather, 1 << 20, {16, 2}, c).seconds));
  CHECK_THAT(t.to_string(), Contains("reduce_scatter") && Contains("total"));
}

TEST_CASE("time model: the step's timeline: synchronous ops exposed, async ones hidden behind the compute "
          "they overlap, one group's ops in order") {
  const ClusterModel c = dgx_h100();
  const double rate = c.peak_tflops * 1e12 * c.gemm_efficiency; // flops a second
  // An op issued at flop clock `at` (event `seq`), waited at `wait_at` (event `wait_seq`; -1: never).
  auto op = [](const char* axes, std::int64_t size, double at, std::int64_t seq, double wait_at,
               std::int64_t wait_seq) {
    CommDebugMode::Op o{.op = "all_gather", .axes = axes, .size = size, .ranks = 8, .nodes = 1};
    o.issued_flops = at;
    o.issued_seq = seq;
    o.waited = std::make_shared<CommDebugMode::Op::Waited>(CommDebugMode::Op::Waited{wait_at, wait_seq});
    return o;
  };
  const double ag = estimate_collective(CollectiveKind::all_gather, 64 << 20, {8, 1}, c).seconds;
  const double long_compute = 10 * ag * rate; // flops that take ten all_gathers
  SECTION("synchronous: waited where issued, all of it exposed") {
    const std::vector<CommDebugMode::Op> ops{op("tp", 64 << 20, 100, 1, 100, 2)};
    const StepTime t = estimate_step_time(ops, 100, 100 + long_compute, c);
    CHECK(t.compute == Approx(10 * ag));
    CHECK(t.comm == Approx(ag));
    CHECK(t.exposed == Approx(ag));
    CHECK(t.seconds == Approx(11 * ag));
    CHECK(t.rows.at({"all_gather", "tp"}).exposed == Approx(ag));
  }
  SECTION("async, waited after compute longer than it: hidden") {
    const std::vector<CommDebugMode::Op> ops{op("dp", 64 << 20, 0, 1, long_compute / 2, 2)};
    const StepTime t = estimate_step_time(ops, 0, long_compute, c);
    CHECK(t.exposed == 0);
    CHECK(t.seconds == Approx(10 * ag));
  }
  SECTION("async, waited after a third of its time: the rest exposed") {
    const std::vector<CommDebugMode::Op> ops{op("dp", 64 << 20, 0, 1, ag * rate / 3, 2)};
    const StepTime t = estimate_step_time(ops, 0, long_compute, c);
    CHECK(t.exposed == Approx(2 * ag / 3));
    CHECK(t.seconds == Approx(10 * ag + 2 * ag / 3));
  }
  SECTION("two ops on one group run one after the other; on two groups side by side") {
    const std::vector<CommDebugMode::Op> same{op("dp", 64 << 20, 0, 1, 0, 3), op("dp", 64 << 20, 0, 2, 0, 4)};
    CHECK(estimate_step_time(same, 0, 0, c).exposed == Approx(2 * ag));
    const std::vector<CommDebugMode::Op> two{op("dp", 64 << 20, 0, 1, 0, 3), op("tp", 64 << 20, 0, 2, 0, 4)};
    CHECK(estimate_step_time(two, 0, 0, c).exposed == Approx(ag));
  }
  SECTION("never waited: it ends with the step") {
    const std::vector<CommDebugMode::Op> ops{op("dp", 64 << 20, long_compute, 1, -1, -1)};
    const StepTime t = estimate_step_time(ops, 0, long_compute, c);
    CHECK(t.exposed == Approx(ag));
    CHECK_THAT(t.to_string(), Contains("exposed") && Contains("all_gather"));
  }
}

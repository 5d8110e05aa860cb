// MoE dispatch + combine at 4 ranks: the exchange an expert-parallel layer makes (per-peer counts by an
// all_to_all_single of integers, the rows by an all_to_all_single with variable splits, and the rows back
// with the splits swapped), timed as our calls, next to torch 1.13 making the same three calls
// (bench/moe/torch_moe.py; bench/moe/moe_vs_torch.sh runs both and joins them); and the whole MoE layer's
// forward (nn::Moe on a one-axis "ep" mesh: routing, the counts' all_gather, the same exchange, SwiGLU
// experts of ffn 8, combine) for scale. Splits: rank i sends
// rows(i, j) = base * (1 + (3 i + 5 j) % 4) rows of `hidden` floats to rank j, the same formula in both.
//
//   dtensor-run --nproc-per-node 4 bench_moe [--smoke] [--out DIR]   # writes DIR/moe_n4.json (rank 0)

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/nn/moe.hpp"

namespace {

using namespace dtensor;
using Clock = std::chrono::steady_clock;

struct Size {
  std::int64_t base, hidden;
  int samples;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// The slowest rank's value.
double slowest(double v, const ProcessGroup& g) {
  Tensor<double, 1> t({1});
  t(0) = v;
  all_reduce(t, ReduceOp::max, g);
  return t(0);
}

} // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  std::string out = "bench/results";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      smoke = true;
    } else if (a == "--out" && i + 1 < argc) {
      out = argv[++i];
    }
  }
  ProcessGroup g = init_process_group();
  const int n = g.size();
  const int r = g.rank();
  std::vector<Size> sizes = {{16, 256, 200}, {128, 1024, 60}, {512, 1024, 20}};
  if (smoke) {
    sizes = {{4, 16, 2}};
  }
  std::string json = "[";
  if (r == 0) {
    std::printf("%-24s %16s %16s\n", "rows/peer x hidden", "exchange us", "MoE forward us");
  }
  for (const Size& s : sizes) {
    std::vector<std::int64_t> send(static_cast<std::size_t>(n));
    std::vector<std::int64_t> recv(static_cast<std::size_t>(n));
    std::int64_t send_rows = 0;
    std::int64_t recv_rows = 0;
    for (int j = 0; j < n; ++j) {
      send[static_cast<std::size_t>(j)] = s.base * (1 + (3 * r + 5 * j) % 4);
      recv[static_cast<std::size_t>(j)] = s.base * (1 + (3 * j + 5 * r) % 4);
      send_rows += send[static_cast<std::size_t>(j)];
      recv_rows += recv[static_cast<std::size_t>(j)];
    }
    Tensor<float, 2> x({send_rows, s.hidden});
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      x.data()[e] = float(e % 7);
    }
    Tensor<float, 2> y({recv_rows, s.hidden});
    Tensor<float, 2> back({send_rows, s.hidden});
    Tensor<std::int64_t, 1> counts({n});
    Tensor<std::int64_t, 1> got({n});
    auto exchange = [&] {
      for (int j = 0; j < n; ++j) {
        counts(j) = send[static_cast<std::size_t>(j)];
      }
      all_to_all_single(got, counts, g);
      all_to_all_single(y, x, recv, send, g);
      all_to_all_single(back, y, send, recv, g);
    };
    exchange();
    for (std::int64_t e = 0; e < x.numel(); ++e) { // the rows came back where they started
      DTENSOR_CHECK(back.data()[e] == x.data()[e], "bench_moe: the exchange did not return the rows");
    }
    std::vector<double> t_ex;
    for (int i = 0; i < s.samples; ++i) {
      const auto t0 = Clock::now();
      exchange();
      t_ex.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    // The layer: 8 experts (2 per rank), top-2, base * n tokens per rank (the batch dim; sequence 1):
    // about as many rows as the exchange above sends (2 assignments per token, half of them local).
    using Mesh = MeshShape<Axis<"ep">>;
    using L = nn::Layout<Mesh, nn::ExpertParallel<"ep">>;
    const auto mesh = init_device_mesh<Mesh>(g, n);
    init::InitKeys keys(1);
    const nn::Moe<float, L> moe(mesh, s.hidden, {.experts = 8, .top_k = 2, .ffn = 8}, keys);
    const std::int64_t rows = s.base * n;
    const auto tokens = nn::act_t<L, float>::from_local(
        mesh, local::randn<float, 3>({rows, 1, s.hidden}, 3, static_cast<std::uint64_t>(r)),
        std::array<std::int64_t, 3>{rows * n, 1, s.hidden});
    (void)moe.forward(tokens);
    std::vector<double> t_moe;
    for (int i = 0; i < std::max(1, s.samples / 4); ++i) {
      const auto t0 = Clock::now();
      (void)moe.forward(tokens);
      t_moe.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    const double ex = slowest(median(t_ex), g);
    const double layer = slowest(median(t_moe), g);
    if (r == 0) {
      const std::string name = std::to_string(s.base) + " x " + std::to_string(s.hidden);
      std::printf("%-24s %16.1f %16.1f\n", name.c_str(), ex, layer);
      json += std::string(json.size() > 1 ? ",\n" : "\n") + "  {\"size\": \"" + name +
              "\", \"exchange_us\": " + std::to_string(ex) +
              ", \"moe_forward_us\": " + std::to_string(layer) + "}";
    }
  }
  if (r == 0 && !out.empty()) {
    std::ofstream(out + "/moe_n" + std::to_string(n) + ".json") << json << "\n]\n";
  }
  return 0;
}

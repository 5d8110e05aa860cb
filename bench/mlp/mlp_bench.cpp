// A tensor-parallel MLP forward on a 1-D mesh (the Megatron pair), timed per iteration with its split into
// local GEMMs, the activation and communication; bench/mlp/torch_mlp.py does the same computation with
// torch.mm and torch.distributed, and bench/mlp/mlp_vs_torch.sh runs both in one command and joins them.
//
//   x [R] (tokens, hidden) x W1 [S(1)] (hidden, ffn)  -> h [S(1)]       matmul, no communication
//   a = act(h)                                         -> a [S(1)]       relu (default), gelu or none
//   a [S(1)] x W2 [S(0)] (ffn, hidden)                 -> y [P(sum)]     matmul, no communication
//   y.redistribute<Replicate>()                        -> y [R]          one all_reduce
//
//   dtensor-run --standalone --nproc-per-node 4 build-bench/bench/bench_mlp [--act relu|gelu|none]
//       [--scale S] [--smoke] [--out DIR] [--sizes TxHxF,...]
//
// Method (the same in torch_mlp.py): every operand is filled from its global index (values -1, 0, 1, so
// with relu or no activation every product and sum is an integer below 2^24 and the result is exact in
// float in any order); each rank builds only its own shards. Per size: `warmup` iterations, then
// `samples` iterations, each timed alone (clock reads between the four steps; a sample is one forward).
// Per rank the median over iterations of the whole forward and of each part (gemm = both matmuls, act,
// comm = the redistribute); a row reports, for each of them, the largest median over ranks (the slowest
// rank), and the min and max over every rank's samples of the whole forward. comm includes the wait for
// the slowest rank to reach the all_reduce.
// Correctness: after timing, rank 0 compares the forward's y with a single-process reference (the full
// x, W1, W2 multiplied by local::matmul, no sharding): exact for relu/none, for gelu within 1e-5 of the
// largest |y|; and every rank writes checksums of y (sum, a weighted sum, sum of |y|) that mlp/join.py
// compares with torch's. A mismatch fails the run (exit 1). Threads: whatever OPENBLAS_NUM_THREADS says
// (mlp_vs_torch.sh sets 1 on both sides); the row records OpenBLAS's thread count. Writes
// DIR/mlp_n<ranks>.json (suite "mlp_tp", no reference; the join adds torch's).

#include "../common/harness.hpp"

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/matmul.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/tensor/dtensor.hpp>

#include <sys/resource.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"tp">>;
using X = DTensor<float, 2, Mesh, Replicate>;
using W1 = DTensor<float, 2, Mesh, Shard<1>>;
using W2 = DTensor<float, 2, Mesh, Shard<0>>;

struct Size {
  std::int64_t tokens, hidden, ffn;
  int samples; ///< iterations timed (before --scale)
  int warmup;
};

enum class Act { none, relu, gelu };

const char* act_name(Act a) {
  return a == Act::relu ? "relu" : a == Act::gelu ? "gelu" : "none";
}

/// The value of element `i` (row-major global index) of operand `seed`: -1, 0 or 1. torch_mlp.py has the
/// same function.
float fill_value(std::int64_t i, std::int64_t seed) {
  return static_cast<float>(((i * 2654435761LL + seed * 97) >> 13) % 3 - 1);
}

/// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of the (.., ld) global operand `seed`.
Tensor<float, 2> fill_block(std::int64_t r0, std::int64_t rows, std::int64_t c0, std::int64_t cols,
                            std::int64_t ld, std::int64_t seed) {
  Tensor<float, 2> t({rows, cols});
  float* p = t.data();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      *p++ = fill_value((r0 + r) * ld + c0 + c, seed);
    }
  }
  return t;
}

/// sum(y), sum(y_i * ((i % 13) - 6)) and sum(|y_i|) in double: exact for integer-valued y of this size;
/// for gelu, mlp/join.py compares the first two within 1e-5 of the third (times 6).
std::array<double, 3> checksums(const Tensor<float, 2>& y) {
  std::array<double, 3> s{};
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    const double v = y.data()[i];
    s[0] += v;
    s[1] += v * static_cast<double>(i % 13 - 6);
    s[2] += std::fabs(v);
  }
  return s;
}

/// A double as JSON with every digit (the harness's json_number keeps 6 for non-integers).
std::string exact_json(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

/// The forward on one process, no sharding: act(x W1) W2.
Tensor<float, 2> reference(const Size& z, Act act) {
  const auto x = fill_block(0, z.tokens, 0, z.hidden, z.hidden, 1);
  const auto w1 = fill_block(0, z.hidden, 0, z.ffn, z.ffn, 2);
  const auto w2 = fill_block(0, z.ffn, 0, z.hidden, z.hidden, 3);
  auto h = local::matmul(x, w1);
  for (std::int64_t i = 0; i < h.numel(); ++i) {
    float& v = h.data()[i];
    if (act == Act::relu) {
      v = v > 0 ? v : 0;
    } else if (act == Act::gelu) {
      v = 0.5f * v * (1.0f + std::erf(v * 0.70710678f));
    }
  }
  return local::matmul(h, w2);
}

/// The largest value over ranks of each entry.
std::vector<double> world_max(const ProcessGroup& g, const std::vector<double>& v) {
  auto t = Tensor<double, 1>({static_cast<std::int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t.data());
  all_reduce(t, ReduceOp::max, g);
  return {t.data(), t.data() + t.numel()};
}

/// This process's counts so far (every thread): minor page faults (first touches of fresh memory, ~1-13
/// us each on this VM), voluntary context switches (blocking waits), involuntary ones (preemptions), and
/// CPU time in us (user + system).
std::array<double, 4> usage() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  const auto us = [](const timeval& t) { return double(t.tv_sec) * 1e6 + double(t.tv_usec); };
  return {double(u.ru_minflt), double(u.ru_nvcsw), double(u.ru_nivcsw), us(u.ru_utime) + us(u.ru_stime)};
}

int blas_threads() {
#ifdef OPENBLAS_VERSION
  return openblas_get_num_threads();
#else
  return -1;
#endif
}

struct Ctx {
  bench::Options opt;
  ProcessGroup world;
  Act act = Act::relu;
  bench::Results results;
  bench::Table table{{"tokens x hidden x ffn", "act", "forward us [min-max]", "gemm us", "act us", "comm us",
                      "GFLOP/s/rank", "faults/iter", "switches/iter vol+invol", "CPU us/iter", "check"}};
  bool failed = false;
};

void run_size(Ctx& c, const DeviceMesh<Mesh>& mesh, const Size& z) {
  const int n = c.world.size();
  const int r = c.world.rank();
  DTENSOR_CHECK(z.ffn % n == 0, "bench_mlp: ffn " + std::to_string(z.ffn) + " is not a multiple of the " +
                                    std::to_string(n) + " ranks");
  const std::int64_t f = z.ffn / n; // this rank's share of ffn
  const X x = X::from_local(mesh, fill_block(0, z.tokens, 0, z.hidden, z.hidden, 1));
  const W1 w1 = W1::from_local(mesh, fill_block(0, z.hidden, r * f, f, z.ffn, 2));    // (hidden, ffn/n)
  const W2 w2 = W2::from_local(mesh, fill_block(r * f, f, 0, z.hidden, z.hidden, 3)); // (ffn/n, hidden)

  std::vector<double> total, gemm, act, comm;
  Tensor<float, 2> last;
  const int samples = bench::scaled(c.opt, z.samples);
  const int warmup = c.opt.smoke ? 0 : z.warmup;
  barrier(c.world);
  std::array<double, 4> use{}; // per timed iteration, once the loop is done
  for (int it = 0; it < warmup + samples; ++it) {
    if (it == warmup) {
      use = usage();
    }
    const auto t0 = bench::Clock::now();
    auto h = matmul(x, w1); //                                           [S(1)] (tokens, ffn/n)
    const auto t1 = bench::Clock::now();
    if (c.act == Act::relu) {
      h = relu(h);
    } else if (c.act == Act::gelu) {
      h = gelu(h);
    }
    const auto t2 = bench::Clock::now();
    auto yp = matmul(h, w2); //                                          [P]    (tokens, hidden)
    const auto t3 = bench::Clock::now();
    auto y = std::move(yp).redistribute<Replicate>(); // all_reduce       [R]    (tokens, hidden)
    const auto t4 = bench::Clock::now();
    if (it >= warmup) {
      using us = std::chrono::duration<double, std::micro>;
      total.push_back(us(t4 - t0).count());
      gemm.push_back(us(t1 - t0).count() + us(t3 - t2).count());
      act.push_back(us(t2 - t1).count());
      comm.push_back(us(t4 - t3).count());
    }
    if (it + 1 == warmup + samples) {
      const auto end = usage();
      for (int k = 0; k < 4; ++k) {
        use[k] = (end[k] - use[k]) / samples;
      }
      last = y.local();
    }
  }
  const bench::Stats st = bench::stats_of(total);
  // Slowest rank's medians; the range over every rank's samples (min as -max of the negated).
  const auto m =
      world_max(c.world, {st.median, bench::stats_of(gemm).median, bench::stats_of(act).median,
                          bench::stats_of(comm).median, -st.min, st.max, use[0], use[1], use[2], use[3]});
  bench::Stats row = st;
  row.median = m[0];
  row.min = -m[4];
  row.max = m[5];

  // Correctness: rank 0 against the single-process reference; every rank's checksums must agree.
  double max_err = 0;
  bool ok = true;
  if (r == 0) {
    const auto ref = reference(z, c.act);
    ok = ref.shape() == last.shape();
    double scale = 0; // gelu: errors are measured against the largest |y| (sums in another order round
    for (std::int64_t i = 0; ok && i < ref.numel(); ++i) { // differently; y has entries near 0)
      scale = std::max(scale, std::fabs(double(ref.data()[i])));
    }
    const double tol = c.act == Act::gelu ? 1e-5 * std::max(1.0, scale) : 0.0;
    for (std::int64_t i = 0; ok && i < ref.numel(); ++i) {
      max_err = std::max(max_err, std::fabs(double(ref.data()[i]) - double(last.data()[i])));
    }
    ok = ok && max_err <= tol;
  }
  const auto [sum, wsum, abs_sum] = checksums(last);
  const auto lo = world_max(c.world, {-sum, -wsum, ok ? 0.0 : 1.0});
  const auto hi = world_max(c.world, {sum, wsum});
  ok = lo[2] == 0 && -lo[0] == hi[0] && -lo[1] == hi[1];
  if (!ok) {
    c.failed = true;
    if (r == 0) {
      std::fprintf(stderr,
                   "bench_mlp: %lldx%lldx%lld %s: the forward differs from the single-process "
                   "reference (rank 0's max |error| %g) or between ranks (checksums)\n",
                   static_cast<long long>(z.tokens), static_cast<long long>(z.hidden),
                   static_cast<long long>(z.ffn), act_name(c.act), max_err);
    }
  }

  const double flops_rank = 4.0 * double(z.tokens) * double(z.hidden) * double(f); // both GEMMs
  const std::string name = std::to_string(z.tokens) + "x" + std::to_string(z.hidden) + "x" +
                           std::to_string(z.ffn) + " " + act_name(c.act);
  bench::Record rec;
  rec.suite = "mlp_tp";
  rec.name = name;
  rec.ranks = n;
  rec.bytes = z.tokens * z.hidden * std::int64_t(sizeof(float)); // the all_reduce
  rec.ours = row;
  rec.add_num("tokens", double(z.tokens))
      .add_num("hidden", double(z.hidden))
      .add_num("ffn", double(z.ffn))
      .add_str("act", act_name(c.act))
      .add_num("gemm_us", m[1])
      .add_num("act_us", m[2])
      .add_num("comm_us", m[3])
      .add_num("gflops_per_rank", flops_rank / (m[1] * 1e3))
      .add_num("page_faults_per_iter", m[6])
      .add_num("voluntary_switches_per_iter", m[7])
      .add_num("involuntary_switches_per_iter", m[8])
      .add_num("cpu_us_per_iter", m[9])
      .add_num("blas_threads", blas_threads())
      .add_str("glibc_tunables", std::getenv("GLIBC_TUNABLES") ? std::getenv("GLIBC_TUNABLES") : "")
      .add("checksum", exact_json(sum))
      .add("checksum_weighted", exact_json(wsum))
      .add("checksum_abs", exact_json(abs_sum))
      .add_str("check",
               ok ? (c.act == Act::gelu ? "reference, 1e-5 of max |y|" : "reference, exact") : "FAILED")
      .add_str("placements", "x[R] w1[S(1)] -> h[S(1)] -> w2[S(0)] -> y[P] -> all_reduce -> y[R]");
  c.table.row({std::to_string(z.tokens) + " x " + std::to_string(z.hidden) + " x " + std::to_string(z.ffn),
               act_name(c.act), bench::range(row), bench::num(m[1]), bench::num(m[2]), bench::num(m[3]),
               bench::fmt("%.1f", flops_rank / (m[1] * 1e3)), bench::fmt("%.0f", m[6]),
               bench::fmt("%.1f+%.1f", m[7], m[8]), bench::num(m[9]), ok ? "ok" : "FAILED"});
  c.results.add(std::move(rec));
}

/// "64x256x1024,8x64x256" -> sizes (samples and warm-up as for the nearest default size).
bool parse_sizes(const std::string& s, std::vector<Size>& out) {
  out.clear();
  std::size_t pos = 0;
  while (pos < s.size()) {
    const std::size_t end = std::min(s.find(',', pos), s.size());
    long long t = 0, h = 0, f = 0;
    if (std::sscanf(s.substr(pos, end - pos).c_str(), "%lldx%lldx%lld", &t, &h, &f) != 3 || t <= 0 ||
        h <= 0 || f <= 0) {
      return false;
    }
    const double work = double(t) * double(h) * double(f);
    const int samples = work <= 1e6 ? 500 : work <= 1e8 ? 200 : work <= 1e9 ? 80 : 30;
    out.push_back({t, h, f, samples, work <= 1e8 ? 20 : work <= 1e9 ? 5 : 3});
    pos = end + 1;
  }
  return !out.empty();
}

int run(Ctx& c) {
  std::vector<Size> sizes = {{8, 64, 256, 500, 20},     // host overhead and latency dominate
                             {64, 256, 1024, 200, 20},  //
                             {128, 512, 2048, 80, 5},   //
                             {256, 1024, 4096, 30, 3}}; // GEMM-bound
  bool act_given = false;
  const auto& a = c.opt.args;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == "--act" && i + 1 < a.size()) {
      act_given = true;
      const std::string v = a[++i];
      if (v != "relu" && v != "gelu" && v != "none") {
        std::fprintf(stderr, "bench_mlp: --act %s: relu, gelu or none\n", v.c_str());
        return 2;
      }
      c.act = v == "relu" ? Act::relu : v == "gelu" ? Act::gelu : Act::none;
    } else if (a[i] == "--sizes" && i + 1 < a.size()) {
      if (!parse_sizes(a[++i], sizes)) {
        std::fprintf(stderr, "bench_mlp: --sizes %s: a list of TOKENSxHIDDENxFFN, e.g. 64x256x1024\n",
                     a[i].c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "bench_mlp: unknown argument '%s' (--scale S, --smoke, --out DIR, --act relu|gelu|none, "
                   "--sizes TxHxF,...)\n",
                   a[i].c_str());
      return 2;
    }
  }
  std::vector<Act> acts{c.act};
  if (c.opt.smoke) { // every activation, unless one is asked for
    sizes = {{8, 64, 256, 1, 0}, {16, 32, 64, 1, 0}};
    if (!act_given) {
      acts = {Act::relu, Act::gelu, Act::none};
    }
  }
  c.world = init_process_group();
  const auto mesh = init_device_mesh<Mesh>(c.world);
  for (const Act act : acts) {
    c.act = act;
    for (const Size& z : sizes) {
      run_size(c, mesh, z);
    }
  }
  if (c.world.rank() == 0) {
    std::printf("TP MLP forward on gloo, %d processes, float32, OpenBLAS threads %d: x[R] W1[S(1)] -> act -> "
                "W2[S(0)] -> all_reduce (medians of the slowest rank, us)\n",
                c.world.size(), blas_threads());
    c.table.print();
    c.results.write(c.opt, "mlp_n" + std::to_string(c.world.size()) + ".json");
  }
  barrier(c.world);
  return c.failed ? 1 : 0;
}

} // namespace

int main(int argc, char** argv) {
  Ctx c;
  c.opt = bench::parse_options(argc, argv);
  try {
    return run(c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mlp: %s\n", e.what());
    return 1;
  }
}

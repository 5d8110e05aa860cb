// The local GEMM (local/gemm.hpp) next to cblas_sgemm called directly on the same contiguous float
// matrices, in the same run, samples interleaved (bench::compare): square 64, 256, 1024, and a linear
// layer, x (4, 1024, 1024) times a shared weight w (1024, 1024) transposed, which matmul folds into the
// one 4096 x 1024 x 1024 GEMM the reference calls. The ratio is matmul's time over the direct call's
// (goal <= 1.05). Threads: OpenBLAS's own default (OPENBLAS_NUM_THREADS sets it) for both sides.
//
//   bench_gemm [--scale S] [--smoke] [--out DIR]     # writes DIR/gemm.json (default bench/results)

#include <cstdint>
#include <cstdio>
#include <string>

#include "dtensor/core/tensor.hpp"
#include "dtensor/local/gemm.hpp"

#include "../common/harness.hpp"

namespace {

using dtensor::Tensor;

struct Case {
  const char* name;
  std::int64_t batch, m, n, k;
  bool trans_b;
  int calls_per_sample; // enough calls that a sample is well above the clock's resolution
};

template <int R>
Tensor<float, R> filled(std::array<std::int64_t, R> shape, float seed) {
  Tensor<float, R> t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = seed * static_cast<float>(i % 7 - 3);
  }
  return t;
}

} // namespace

int main(int argc, char** argv) {
  const bench::Options opt = bench::parse_options(argc, argv);
  const Case cases[] = {{"square 64", 1, 64, 64, 64, false, 200},
                        {"square 256", 1, 256, 256, 256, false, 10},
                        {"square 1024", 1, 1024, 1024, 1024, false, 1},
                        {"linear (4, 1024, 1024) x (1024, 1024)^T", 4, 1024, 1024, 1024, true, 1}};
  bench::Table table{{"case", "m x n x k", "matmul us [min-max]", "cblas_sgemm us", "GFLOP/s", "ratio"}};
  bench::Results results;
  for (const Case& cs : cases) {
    if (opt.smoke && cs.m > 64) {
      continue;
    }
    const std::int64_t rows = cs.batch * cs.m; // the GEMM's m as BLAS sees it
    const Tensor<float, 3> a = filled<3>({cs.batch, cs.m, cs.k}, 0.25f);
    const Tensor<float, 2> b = filled<2>(
        cs.trans_b ? std::array<std::int64_t, 2>{cs.n, cs.k} : std::array<std::int64_t, 2>{cs.k, cs.n}, 0.5f);
    const Tensor<float, 3> c({cs.batch, cs.m, cs.n});
    const Tensor<float, 2> c_ref({rows, cs.n});
    const Tensor<float, 2> a2 = a.view<2>({rows, cs.k});
    const int ldb = static_cast<int>(cs.trans_b ? cs.k : cs.n);
    bench::SamplePlan p;
    p.warmup = opt.smoke ? 0 : 1;
    p.samples = bench::scaled(opt, 11);
    p.batch = opt.smoke ? 1 : cs.calls_per_sample;
    // Rank 2 for one matrix (the shape a sharded 2-D matmul hands down), rank 3 for the linear layer.
    const auto ours = [&] {
      if (cs.batch == 1) {
        dtensor::local::matmul_into(a2, b, c_ref, false, cs.trans_b);
      } else {
        dtensor::local::matmul_into(a, b, c, false, cs.trans_b);
      }
    };
    const auto ref = [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, cs.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(rows),
                  static_cast<int>(cs.n), static_cast<int>(cs.k), 1.0f, a2.data(), static_cast<int>(cs.k),
                  b.data(), ldb, 0.0f, c_ref.data(), static_cast<int>(cs.n));
    };
    const auto [s, r] = bench::compare(p, ours, ref);
    const double flops =
        2.0 * static_cast<double>(rows) * static_cast<double>(cs.n) * static_cast<double>(cs.k);
    bench::Record rec{"gemm",
                      cs.name,
                      "openblas",
                      1,
                      static_cast<std::int64_t>(sizeof(float)) * (rows * cs.k + cs.k * cs.n + rows * cs.n),
                      s,
                      "cblas_sgemm",
                      r,
                      {}};
    rec.add_num("m", static_cast<double>(rows))
        .add_num("n", static_cast<double>(cs.n))
        .add_num("k", static_cast<double>(cs.k))
        .add_num("gflops", flops / (s.median * 1e3));
    table.row({cs.name, std::to_string(rows) + " x " + std::to_string(cs.n) + " x " + std::to_string(cs.k),
               bench::fmt("%.1f [%.1f-%.1f]", s.median, s.min, s.max), bench::fmt("%.1f", r.median),
               bench::fmt("%.1f", flops / (s.median * 1e3)), bench::fmt("%.3f", s.paired_ratio)});
    results.add(std::move(rec));
  }
  std::printf("local GEMM (float32) vs cblas_sgemm on the same matrices, interleaved samples; ratio = median "
              "of paired ratios\n");
  table.print();
  results.write(opt, "gemm.json");
  return 0;
}

// The local attention kernel (local/attention.hpp: blockwise, online softmax) next to the materialised form
// torch 1.13 computes on CPUs, softmax(q k^T * scale) v with the whole (seq x seq) score matrix per head (two
// cblas_sgemm calls per head and a row softmax between them), in the same run, samples interleaved
// (bench::compare): time and peak heap of each (dtensor/testing/heap_counter.hpp), forward only and forward
// + backward, float, batch 1, 8 heads, head_dim 64, seq 512, 2048, 8192, causal and not. The goal
// (issue 27): time <= 1.0x the materialised form's, memory O(seq) where its is O(seq^2). Threads:
// OPENBLAS_NUM_THREADS (scripts/bench.sh runs it with 1). The materialised backward is not timed: its
// forward's score matrix alone is what the memory column is about.
//
//   bench_attention [--scale S] [--smoke] [--out DIR]     # writes DIR/attention.json (default bench/results)

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dtensor/core/tensor.hpp"
#include "dtensor/local/attention.hpp"

#include "../common/harness.hpp"
#include <dtensor/testing/heap_counter.hpp>

namespace {

using dtensor::Tensor;

Tensor<float, 4> filled(std::array<std::int64_t, 4> shape, int seed) {
  Tensor<float, 4> t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = 0.125f * static_cast<float>((i * 7 + seed * 13) % 17 - 8);
  }
  return t;
}

// softmax(q k^T * scale [causal]) v with the whole score matrix of one head at a time (torch 1.13 allocates
// it for every head at once: scores is sized heads x seq x seq here too, as torch's bmm output is).
void materialised(const Tensor<float, 4>& q, const Tensor<float, 4>& k, const Tensor<float, 4>& v,
                  Tensor<float, 4>& o, bool causal) {
  const std::int64_t h = q.shape()[1], s = q.shape()[2], d = q.shape()[3];
  std::vector<float> scores(static_cast<std::size_t>(h * s * s));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int si = static_cast<int>(s), di = static_cast<int>(d);
  for (std::int64_t x = 0; x < h; ++x) {
    float* sc = scores.data() + x * s * s;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, si, si, di, scale, q.data() + x * s * d, di,
                k.data() + x * s * d, di, 0.0f, sc, si);
    for (std::int64_t i = 0; i < s; ++i) {
      float* row = sc + i * s;
      const std::int64_t n = causal ? i + 1 : s;
      float m = row[0];
      for (std::int64_t j = 1; j < n; ++j) {
        m = row[j] > m ? row[j] : m;
      }
      float sum = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        row[j] = std::exp(row[j] - m);
        sum += row[j];
      }
      for (std::int64_t j = 0; j < s; ++j) {
        row[j] = j < n ? row[j] / sum : 0.0f;
      }
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, si, di, si, 1.0f, sc, si, v.data() + x * s * d, di,
                0.0f, o.data() + x * s * d, di);
  }
}

} // namespace

int main(int argc, char** argv) {
  const bench::Options opt = bench::parse_options(argc, argv);
  const std::int64_t heads = 8, d = 64;
  bench::Table table{{"seq", "causal", "ours fwd ms [min-max]", "materialised ms", "ratio", "ours fwd+bwd ms",
                      "ours peak MiB", "materialised peak MiB"}};
  bench::Results results;
  for (const std::int64_t seq : {std::int64_t{512}, std::int64_t{2048}, std::int64_t{8192}}) {
    if (opt.smoke && seq > 512) {
      continue;
    }
    for (const bool causal : {false, true}) {
      const auto q = filled({1, heads, seq, d}, 1);
      const auto k = filled({1, heads, seq, d}, 2);
      const auto v = filled({1, heads, seq, d}, 3);
      Tensor<float, 4> o_ref({1, heads, seq, d});
      dtensor::local::AttentionParams params;
      params.causal = causal;
      // peak heap of one call of each (inputs excluded)
      dtensor::testing::heap::reset_peak();
      std::int64_t before = dtensor::testing::heap::live();
      auto [o, lse] = dtensor::local::attention_forward(q, k, v, params);
      const double ours_peak = static_cast<double>(dtensor::testing::heap::peak() - before) / (1 << 20);
      dtensor::testing::heap::reset_peak();
      before = dtensor::testing::heap::live();
      materialised(q, k, v, o_ref, causal);
      const double ref_peak = static_cast<double>(dtensor::testing::heap::peak() - before) / (1 << 20);
      double max_diff = 0;
      for (std::int64_t i = 0; i < o.numel(); ++i) {
        max_diff = std::max(max_diff, static_cast<double>(std::abs(o.data()[i] - o_ref.data()[i])));
      }
      bench::SamplePlan p;
      p.warmup = opt.smoke ? 0 : 1;
      p.samples = bench::scaled(opt, seq >= 8192 ? 3 : 7);
      p.batch = 1;
      const auto [s, r] = bench::compare(
          p, [&] { (void)dtensor::local::attention_forward(q, k, v, params); },
          [&] { materialised(q, k, v, o_ref, causal); });
      const auto g = filled({1, heads, seq, d}, 4);
      const bench::Stats fb = bench::measure(p, [&] {
        auto [oo, ll] = dtensor::local::attention_forward(q, k, v, params);
        (void)dtensor::local::attention_backward(q, k, v, oo, ll, g, params);
      });
      bench::Record rec{"attention",
                        "seq " + std::to_string(seq) + (causal ? " causal" : ""),
                        "host",
                        1,
                        static_cast<std::int64_t>(sizeof(float)) * 4 * heads * seq * d,
                        s,
                        "materialised softmax(q k^T) v",
                        r,
                        {}};
      rec.add_num("seq", static_cast<double>(seq))
          .add_num("ours_peak_mib", ours_peak)
          .add_num("materialised_peak_mib", ref_peak)
          .add_num("fwd_bwd_us", fb.median)
          .add_num("max_abs_diff", max_diff);
      table.row({std::to_string(seq), causal ? "yes" : "no",
                 bench::fmt("%.1f [%.1f-%.1f]", s.median / 1e3, s.min / 1e3, s.max / 1e3),
                 bench::fmt("%.1f", r.median / 1e3), bench::fmt("%.3f", s.paired_ratio),
                 bench::fmt("%.1f", fb.median / 1e3), bench::fmt("%.2f", ours_peak),
                 bench::fmt("%.1f", ref_peak)});
      results.add(std::move(rec));
    }
  }
  std::printf("local attention (float, batch 1, 8 heads, head_dim 64) vs the materialised softmax(q k^T) v, "
              "interleaved samples; ratio = median of paired ratios; peak = heap beyond the inputs\n");
  table.print();
  results.write(opt, "attention.json");
  return 0;
}

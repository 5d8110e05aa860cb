// loss_parallel next to gather-then-local-loss, in the same run: cross_entropy on logits sharded on the
// vocab ([S(1)], two all_reduces of one value per row, then one of two values) against redistributing the
// logits to [R] (an all_gather of the whole logits) and computing the same loss locally. 4 in-process
// ranks (threads) on gloo, float logits; bytes per rank from CommDebugMode (what each rank receives).
//
//   bench_loss [--scale S] [--smoke] [--out DIR]     # writes DIR/loss_parallel.json (default bench/results)

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

#include "dtensor/comm/comm_debug.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/ops/loss.hpp"
#include "dtensor/testing/run_ranks.hpp"

#include "../common/harness.hpp"

namespace {

using namespace dtensor;
using Mesh = MeshShape<Axis<"tp">>;

struct Case {
  std::int64_t tokens, vocab;
};

template <class DT>
DT block_of(const DeviceMesh<Mesh>& mesh, std::int64_t rows, std::int64_t cols) {
  const Block b = spec_block(Extents{rows, cols}, DT::spec, mesh.sizes(), mesh.coordinate());
  typename DT::local_type t({b.shape[0], b.shape[1]});
  for (std::int64_t i = 0; i < b.shape[0]; ++i) {
    for (std::int64_t j = 0; j < b.shape[1]; ++j) {
      t(i, j) = static_cast<float>(((b.offset[0] + i) * 31 + (b.offset[1] + j) * 7) % 23) * 0.125f;
    }
  }
  return DT(mesh, t, {rows, cols});
}

} // namespace

int main(int argc, char** argv) {
  const bench::Options opt = bench::parse_options(argc, argv);
  const int ranks = 4;
  const Case cases[] = {{64, 1024}, {256, 8192}, {512, 32768}};
  bench::Table table{{"tokens x vocab", "ranks", "loss_parallel us", "gather+local us", "ratio",
                      "loss_parallel B/rank", "gather+local B/rank"}};
  bench::Results results;
  for (const Case& cs : cases) {
    if (opt.smoke && cs.vocab > 1024) {
      continue;
    }
    std::mutex m;
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh>(world);
      using X = DTensor<float, 2, Mesh, Shard<1>>;
      using Target = DTensor<std::int64_t, 1, Mesh, Replicate>;
      const X logits = block_of<X>(mesh, cs.tokens, cs.vocab);
      Tensor<std::int64_t, 1> t({cs.tokens});
      for (std::int64_t i = 0; i < cs.tokens; ++i) {
        t(i) = (i * 131) % cs.vocab;
      }
      const Target target(mesh, t, {cs.tokens});
      float a = 0;
      float b = 0;
      const auto ours = [&] { a = cross_entropy(logits, target).local()(); };
      const auto ref = [&] { b = cross_entropy(logits.redistribute<Replicate>(), target).local()(); };
      CommDebugMode bytes_ours;
      ours();
      const std::int64_t ours_bytes = bytes_ours.total_bytes();
      CommDebugMode bytes_ref;
      ref();
      const std::int64_t ref_bytes = bytes_ref.total_bytes() - ours_bytes;
      DTENSOR_CHECK(std::abs(a - b) <= 1e-5f * std::abs(b),
                    "loss_parallel " + std::to_string(a) + " differs from gather+local " + std::to_string(b));
      bench::SamplePlan p;
      p.warmup = opt.smoke ? 0 : 1;
      p.samples = bench::scaled(opt, 9);
      const auto [s, r] = bench::compare(p, ours, ref);
      if (world.rank() != 0) {
        return;
      }
      std::lock_guard lock(m);
      const std::string name = std::to_string(cs.tokens) + " x " + std::to_string(cs.vocab);
      bench::Record rec{"loss_parallel", name, "gloo", ranks, cs.tokens * cs.vocab * 4, s,
                        "gather+local",  r,    {}};
      rec.add_num("bytes_per_rank", static_cast<double>(ours_bytes))
          .add_num("ref_bytes_per_rank", static_cast<double>(ref_bytes));
      table.row({name, std::to_string(ranks), bench::fmt("%.1f [%.1f-%.1f]", s.median, s.min, s.max),
                 bench::fmt("%.1f", r.median), bench::fmt("%.3f", s.paired_ratio), std::to_string(ours_bytes),
                 std::to_string(ref_bytes)});
      results.add(std::move(rec));
    });
  }
  std::printf(
      "cross_entropy on vocab-sharded float logits [S(1)] vs all_gather to [R] + local loss, 4 in-process "
      "ranks on gloo; ratio = median of paired ratios; bytes: received per rank (CommDebugMode)\n");
  table.print();
  results.write(opt, "loss_parallel.json");
  return 0;
}

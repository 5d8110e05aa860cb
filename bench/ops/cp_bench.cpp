// Context parallelism at n processes: one causal attention step (forward + backward) over mesh axis "cp",
// float, batch 1, 4 heads (MHA), head_dim 32, the sequence sharded over the processes, in four forms:
//   all-gather k/v   redistribute k and v to Replicate (all_gather), local attention, dk/dv Partial ->
//                    Shard (reduce_scatter); keeps the gathered k/v for the backward (memory O(seq))
//   Ulysses          attention<Ulysses<"cp">>: all_to_all to heads and back (4 + 4)
//   ring             attention<Ring<"cp">>: contiguous chunks around the ring
//   ring zigzag      the same on Zigzag<"cp", .> inputs: causal work balanced over the ranks
// Per form: the step time (the slowest rank's median), the bytes each rank receives forward and backward
// (CommDebugMode, the most of any rank) next to the lower bound of the form's family (below), and for the
// ring forms the compute alone (the same kernels on the same shapes and positions, no exchange): exposed
// communication = (step - compute) / step, from the slowest rank's figures, and the causal imbalance =
// the slowest rank's compute / the fastest's.
//
// Lower bounds per rank (float, even shards of m = seq / n rows): a form that brings keys to the queries
// (all-gather, ring) must receive the k and v rows it lacks, (n - 1) m hk (d + dv) 4 bytes forward (the last
// rank's queries see every key), and the dk/dv of its rows from the n - 1 others backward (the same bytes);
// a form that brings the queries to the keys by heads (Ulysses) must receive, for its h / n heads, the
// q, k and v rows of the n - 1 others and send its o rows back: (n - 1) m (h d + 2 hk d + h dv) 4 / n
// forward, the same backward (dO in; dq, dk, dv back).
//
//   dtensor-run --nproc-per-node 4 build-bench/bench/bench_cp [--scale S] [--smoke] [--out DIR]
//   mpirun -np 4 build-bench/bench/bench_cp --backend mpi
// Writes DIR/cp_n<ranks>.json (cp_mpi_n<ranks>.json on MPI). OPENBLAS_NUM_THREADS=1 (scripts/bench.sh).

#include "../common/harness.hpp"

#include <dtensor/backward/redistribute.hpp>
#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/attention.hpp>
#include <dtensor/ops/zigzag.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"cp">>;
using X = DTensor<float, 4, Mesh, Shard<2>>;

struct Ctx {
  bench::Options opt;
  ProcessGroup world;
  std::string backend = "gloo";
  bench::Results results;
  bench::Table table{{"seq", "form", "step ms [min-max]", "fwd B recv", "fwd bound", "bwd B recv",
                      "bwd bound", "compute ms", "exposed", "imbalance"}};
};

// The slowest rank's value (max), or the fastest's (min).
double world_reduce(const Ctx& c, double v, ReduceOp op) {
  auto t = Tensor<double, 1>::full({1}, v);
  all_reduce(t, op, c.world);
  return t(0);
}

X filled(const DeviceMesh<Mesh>& mesh, std::array<std::int64_t, 4> shape, int seed) {
  const Block b = spec_block(detail::to_extents(shape), X::spec, mesh.sizes(), mesh.coordinate());
  Tensor<float, 4> t({b.shape[0], b.shape[1], b.shape[2], b.shape[3]});
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = 0.125f * static_cast<float>((i * 7 + seed * 13 + b.offset[2] * 3) % 17 - 8);
  }
  return X(mesh, t, shape);
}

struct Step {
  bench::Stats time;
  std::int64_t fwd_bytes = 0, bwd_bytes = 0;
};

// Times step(backward_under) (forward + backward; step runs its backward as backward_under(f)), and counts
// one step's bytes, the backward's apart (CommDebugModes nest: the outer one sees both).
template <class F>
Step timed(const Ctx& c, F step) {
  Step s;
  {
    CommDebugMode all;
    std::int64_t bwd = 0;
    step([&](auto&& backward) {
      CommDebugMode b;
      backward();
      bwd = b.total_bytes();
    });
    s.bwd_bytes = bwd;
    s.fwd_bytes = all.total_bytes() - bwd;
  }
  bench::SamplePlan p;
  p.warmup = c.opt.smoke ? 0 : 1;
  p.samples = c.opt.smoke ? 1 : bench::scaled(c.opt, 3);
  s.time = bench::measure(p, [&] { step([](auto&& backward) { backward(); }); });
  return s;
}

// The ring's kernels alone on this rank: the same shapes, positions and merges, k/v of every step from this
// rank's own block (equal shards: the same sizes), forward then backward.
template <bool Zz>
bench::Stats ring_compute(const Ctx& c, const X& q, const X& k, const X& v, const X& g,
                          const AttentionOptions& o) {
  const detail::RingPlan<"cp", X, X, X> p(q, k, v, o, Zz);
  const auto q4 = q.local();
  const auto k4 = k.local();
  const auto v4 = v.local();
  const auto g4 = g.local();
  bench::SamplePlan plan;
  plan.warmup = c.opt.smoke ? 0 : 1;
  plan.samples = c.opt.smoke ? 1 : bench::scaled(c.opt, 3);
  return bench::measure(plan, [&] {
    Tensor<float, 4> out;
    Tensor<float, 3> lse;
    for (int t = 0; t < p.n; ++t) {
      const auto pos = p.positions(p.origin(t));
      auto [o_t, lse_t] = local::attention_forward(q4, k4, v4, p.params, p.coords(pos));
      if (t == 0) {
        out = std::move(o_t);
        lse = std::move(lse_t);
      } else {
        detail::merge_attention(out, lse, o_t, lse_t);
      }
    }
    Tensor<float, 4> dq = Tensor<float, 4>::zeros(q4.shape());
    Tensor<float, 4> dk = Tensor<float, 4>::zeros(k4.shape());
    Tensor<float, 4> dv = Tensor<float, 4>::zeros(v4.shape());
    for (int t = 0; t < p.n; ++t) {
      const auto pos = p.positions(p.origin(t));
      auto [dq_t, dk_t, dv_t] = local::attention_backward(q4, k4, v4, out, lse, g4, p.params, p.coords(pos));
      local::map_into(dq, local::Add{}, dq, dq_t);
      local::map_into(dk, local::Add{}, dk, dk_t);
      local::map_into(dv, local::Add{}, dv, dv_t);
    }
  });
}

void run_seq(Ctx& c, const DeviceMesh<Mesh>& mesh, std::int64_t seq) {
  const int n = c.world.size();
  const std::int64_t h = 4, d = 32;
  const std::array<std::int64_t, 4> shape{1, h, seq, d};
  const X q = filled(mesh, shape, 1);
  const X k = filled(mesh, shape, 2);
  const X v = filled(mesh, shape, 3);
  const X g = filled(mesh, shape, 4);
  const AttentionOptions opts{.causal = true};
  const std::int64_t m = seq / n;
  const std::int64_t kv_bound = (n - 1) * m * h * (d + d) * 4;
  const std::int64_t heads_bound = (n - 1) * m * (h * d + 2 * h * d + h * d) * 4 / n;
  const auto zq = zigzag<"cp", 2>(q);
  const auto zk = zigzag<"cp", 2>(k);
  const auto zv = zigzag<"cp", 2>(v);
  const auto zg = zigzag<"cp", 2>(g);

  const auto row = [&](const std::string& form, const Step& s, std::int64_t bound,
                       const bench::Stats* compute) {
    const double step_ms = world_reduce(c, s.time.median, ReduceOp::max) / 1e3;
    const double min_ms = world_reduce(c, s.time.min, ReduceOp::max) / 1e3;
    const double max_ms = world_reduce(c, s.time.max, ReduceOp::max) / 1e3;
    const auto fwd =
        static_cast<std::int64_t>(world_reduce(c, static_cast<double>(s.fwd_bytes), ReduceOp::max));
    const auto bwd =
        static_cast<std::int64_t>(world_reduce(c, static_cast<double>(s.bwd_bytes), ReduceOp::max));
    double compute_ms = 0, exposed = 0, imbalance = 0;
    if (compute != nullptr) {
      compute_ms = world_reduce(c, compute->median, ReduceOp::max) / 1e3;
      imbalance = compute_ms / (world_reduce(c, compute->median, ReduceOp::min) / 1e3);
      exposed = std::max(0.0, (step_ms - compute_ms) / step_ms);
    }
    if (c.world.rank() != 0) {
      return;
    }
    bench::Record r{"cp", form + " seq " + std::to_string(seq), c.backend, n, seq * h * d * 4, s.time, "", {},
                    {}};
    r.add_num("seq", static_cast<double>(seq))
        .add_num("step_ms", step_ms)
        .add_num("fwd_bytes", static_cast<double>(fwd))
        .add_num("bwd_bytes", static_cast<double>(bwd))
        .add_num("bound_bytes", static_cast<double>(bound));
    if (compute != nullptr) {
      r.add_num("compute_ms", compute_ms).add_num("exposed", exposed).add_num("imbalance", imbalance);
    }
    c.results.add(std::move(r));
    c.table.row({std::to_string(seq), form, bench::fmt("%.1f [%.1f-%.1f]", step_ms, min_ms, max_ms),
                 std::to_string(fwd), std::to_string(bound), std::to_string(bwd), std::to_string(bound),
                 compute != nullptr ? bench::fmt("%.1f", compute_ms) : "",
                 compute != nullptr ? bench::fmt("%.0f %%", 100 * exposed) : "",
                 compute != nullptr ? bench::fmt("%.2f", imbalance) : ""});
  };

  row("all-gather k/v",
      timed(c,
            [&](auto backward_under) {
              auto [kr, k_back] = redistribute_with_backward<Replicate>(k);
              auto [vr, v_back] = redistribute_with_backward<Replicate>(v);
              auto [o, back] = scaled_dot_product_attention(q, kr, vr, opts, with_backward);
              backward_under([&] {
                auto [dq, dk, dv] = back(g);
                (void)k_back(dk);
                (void)v_back(dv);
              });
            }),
      kv_bound, nullptr);
  row("Ulysses",
      timed(c,
            [&](auto backward_under) {
              auto [o, back] = attention<Ulysses<"cp">>(q, k, v, opts, with_backward);
              backward_under([&] { (void)back(g); });
            }),
      heads_bound, nullptr);
  const bench::Stats ring_alone = ring_compute<false>(c, q, k, v, g, opts);
  row("ring",
      timed(c,
            [&](auto backward_under) {
              auto [o, back] = attention<Ring<"cp">>(q, k, v, opts, with_backward);
              backward_under([&] { (void)back(g); });
            }),
      kv_bound, &ring_alone);
  const bench::Stats zigzag_alone = ring_compute<true>(c, zq.tensor, zk.tensor, zv.tensor, zg.tensor, opts);
  row("ring zigzag",
      timed(c,
            [&](auto backward_under) {
              auto [o, back] = attention<Ring<"cp">>(zq, zk, zv, opts, with_backward);
              backward_under([&] { (void)back(zg); });
            }),
      kv_bound, &zigzag_alone);
}

int run(Ctx& c) {
  InitOptions io;
  const auto& a = c.opt.args;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == "--backend" && i + 1 < a.size()) {
      c.backend = a[++i];
    } else {
      std::fprintf(stderr,
                   "bench_cp: unknown argument '%s' (--scale S, --smoke, --out DIR, --backend gloo|mpi)\n",
                   a[i].c_str());
      return 2;
    }
  }
  io.backend = c.backend;
  c.world = init_process_group(io);
  const auto mesh = init_device_mesh<Mesh>(c.world);
  const std::vector<std::int64_t> seqs =
      c.opt.smoke ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{4096, 8192, 16384};
  for (const std::int64_t seq : seqs) {
    run_seq(c, mesh, seq);
  }
  if (c.world.rank() == 0) {
    std::printf(
        "context parallelism on %s, %d processes: causal attention forward + backward, float, batch 1, "
        "4 heads, head_dim 32 (times: the slowest rank; bytes: received per rank, the most of any; "
        "bound: the form family's lower bound, see the top of bench/ops/cp_bench.cpp)\n",
        c.backend.c_str(), c.world.size());
    c.table.print();
    c.results.write(c.opt, std::string(c.backend == "mpi" ? "cp_mpi_n" : "cp_n") +
                               std::to_string(c.world.size()) + ".json");
  }
  barrier(c.world);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  Ctx c;
  c.opt = bench::parse_options(argc, argv);
  try {
    return run(c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cp: %s\n", e.what());
    return 1;
  }
}

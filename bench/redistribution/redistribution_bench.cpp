// Redistribution suite: transitions on 1-, 2- and 3-axis meshes with the plan's steps, bytes per rank from
// the plan, bytes actually moved (CommDebugMode), the analytic lower bound, what PyTorch's greedy planner
// would move (plan/torch_reference.hpp), the measured time, and the peak extra memory; plus the uneven-size
// comparison of variable-size collectives (what the executor does) against padding to equal blocks.
//
//   dtensor-run --standalone --nproc-per-node 4 build-bench/bench/bench_redistribution   # 1-D (4), 2-D (2x2)
//   dtensor-run --standalone --nproc-per-node 8 build-bench/bench/bench_redistribution   # 3-D (2x2x2)
//   dtensor-run --standalone --nproc-per-node 2 build-bench/bench/bench_redistribution   # 1-D (2)
//
// Definitions (BENCHMARKS.md has them in full). All byte counts are per rank, the most any rank receives:
//  - plan bytes: bytes_per_rank of the plan (per step the most any rank receives, summed over steps);
//  - moved bytes: CommDebugMode's total on each rank for one call, the largest over ranks;
//  - lower bound: without Partial sources, the largest over ranks of |target block| - |target block
//    intersected with source block| (what a rank must receive because it does not hold it); with p ranks
//    of Partial axes reduced (p_s of them becoming Shard), R = p_s * |target block| the data a reduction
//    group must produce per rank and the bound is R * (1 + 1/p_s - 2/p): (p-1)/p of R for a reduce_scatter
//    (p_s = p) and 2(p-1)/p of it for an all_reduce (p_s = 1);
//  - torch bytes: torch_greedy_bytes, PyTorch's plan with its padding;
//  - time: each rank's median (min, max) of back-to-back calls, the largest over ranks;
//  - peak extra memory: the most heap bytes live during one redistribute beyond what is live after it
//    (input and output shards), from replaced global operator new/delete; largest over ranks.
// Writes bench/results/redistribution_n<ranks>.json (suites "redistribution" and "uneven").

#include "../common/alloc_counter.hpp"
#include "../common/harness.hpp"

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/plan/torch_reference.hpp>
#include <dtensor/tensor/comm_debug.hpp>
#include <dtensor/tensor/distribute.hpp>

#include <cstdio>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

using Mesh1 = MeshShape<Axis<"x">>;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;
using Mesh3 = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>;
template <class... P>
using L = Placements<P...>;
using R = Replicate;
using P = Partial<>;
template <int D>
using S = Shard<D>;

struct Ctx {
  bench::Options opt;
  ProcessGroup world;
  bench::Results results;
  bench::Table table{{"mesh", "transition", "shape", "plan steps", "plan B", "moved B", "lower bd B",
                      "torch B", "time us [min-max]", "extra mem B", "max(in,out) B"}};
  bench::Table uneven{{"op", "ranks", "shape", "variable us [min-max]", "padded us [min-max]", "var/pad",
                       "var B recv", "pad B recv"}};
};

std::int64_t world_max(const Ctx& c, std::int64_t v) {
  auto t = Tensor<std::int64_t, 1>::full({1}, v);
  all_reduce(t, ReduceOp::max, c.world);
  return t(0);
}

/// Each of median, min and max: the largest over ranks (a rank that sends nothing must not hide the others).
bench::Stats world_max(const Ctx& c, bench::Stats s) {
  auto t = Tensor<double, 1>::from_values({3}, {s.median, s.min, s.max});
  all_reduce(t, ReduceOp::max, c.world);
  s.median = t(0);
  s.min = t(1);
  s.max = t(2);
  return s;
}

/// The analytic lower bound (elements) described at the top of this file.
std::int64_t lower_bound_elems(const PlacementList& src, const PlacementList& dst, const Extents& global,
                               const MeshSizes& sizes) {
  std::int64_t p = 1;
  std::int64_t ps = 1;
  for (int a = 0; a < src.size(); ++a) {
    if (src[a].is_partial() && !dst[a].is_partial()) {
      p *= sizes[a];
      ps *= dst[a].is_shard() ? sizes[a] : 1;
    }
  }
  std::int64_t most = 0;
  for (int r = 0; r < mesh_numel(sizes); ++r) {
    const Block t = local_block(global, dst, sizes, r);
    std::int64_t e = 0;
    if (p > 1) {
      const std::int64_t big = ps * numel(t.shape);
      // R * (1 + 1/ps - 2/p), rounded up
      const std::int64_t num = big * (p * ps + p - 2 * ps);
      const std::int64_t den = p * ps;
      e = (num + den - 1) / den;
    } else {
      const Block s = local_block(global, src, sizes, r);
      e = numel(t.shape) - numel(intersect(t, s).shape);
    }
    most = e > most ? e : most;
  }
  return most;
}

template <class Shape>
std::string mesh_label(const DeviceMesh<Shape>& mesh) {
  std::string s;
  for (int a = 0; a < mesh.sizes().size(); ++a) {
    s += (a ? "x" : "") + std::to_string(mesh.sizes()[a]);
  }
  return s;
}

bench::SamplePlan plan_for(const bench::Options& o, std::int64_t bytes) {
  bench::SamplePlan p;
  p.warmup = o.smoke ? 0 : 1;
  p.samples = bench::scaled(o, 9);
  p.batch = o.smoke ? 1 : (bytes <= (64 << 10) ? 10 : bytes <= (1 << 20) ? 3 : 1);
  return p;
}

/// One redistribution row (or, with Mid, the chain Src -> Mid -> Dst timed as one).
template <class Shape, class Src, class Dst>
struct Runner;

template <class Shape, class... Ps, class... Qs>
struct Runner<Shape, Placements<Ps...>, Placements<Qs...>> {
  static void run(Ctx& c, const DeviceMesh<Shape>& mesh, std::int64_t rows, std::int64_t cols,
                  const char* note = "") {
    Tensor<float, 2> full({rows, cols});
    for (std::int64_t i = 0; i < rows * cols; ++i) {
      full.data()[i] = static_cast<float>(i % 1000);
    }
    auto x = distribute_tensor<Ps...>(mesh, full, replicated_source);
    using X = decltype(x);
    const Extents global{rows, cols};
    const auto plan = X::template plan_to<Qs...>();
    const PlacementList src = placement_list_v<Ps...>;
    const PlacementList dst = placement_list_v<Qs...>;
    const std::int64_t plan_b = plan.bytes_per_rank(global, mesh.sizes(), 4);
    const std::int64_t torch_b = torch_greedy_bytes(src, dst, global, mesh.sizes(), 4);
    const std::int64_t lb = 4 * lower_bound_elems(src, dst, global, mesh.sizes());

    const auto stats = world_max(c, bench::measure(plan_for(c.opt, rows * cols * 4),
                                                   [&] { auto y = x.template redistribute<Qs...>(); }));
    // Bytes moved and memory, one more call each (after the warm-up above: groups exist).
    std::int64_t moved = 0;
    {
      CommDebugMode comm;
      auto y = x.template redistribute<Qs...>();
      moved = comm.total_bytes();
    }
    const std::int64_t in_b = static_cast<std::int64_t>(x.local().nbytes());
    std::int64_t extra = 0;
    std::int64_t out_b = 0;
    std::int64_t allocs = 0;
    {
      bench::alloc::reset_peak();
      const std::int64_t n0 = bench::alloc::count();
      auto y = x.template redistribute<Qs...>();
      allocs = bench::alloc::count() - n0;
      extra = bench::alloc::peak() - bench::alloc::live();
      out_b = static_cast<std::int64_t>(y.local().nbytes());
    }
    moved = world_max(c, moved);
    extra = world_max(c, extra);
    allocs = world_max(c, allocs);
    const std::int64_t bound = world_max(c, std::max(in_b, out_b));

    const std::string name = to_string(src) + "->" + to_string(dst) + note;
    const std::string shape = std::to_string(rows) + "x" + std::to_string(cols);
    const std::string steps = plan.to_string().substr(plan.to_string().find(':') + 2);
    const std::string torch_plan = to_string(torch_greedy_plan(src, dst, 2), Shape::names);
    bench::Record r{"redistribution", name, "gloo", c.world.size(), rows * cols * 4, stats, "", {}, {}};
    r.add_str("mesh", mesh_label(mesh))
        .add_str("shape", shape)
        .add_str("plan", steps)
        .add_num("plan_steps", plan.plan.size())
        .add_num("plan_bytes", double(plan_b))
        .add_num("moved_bytes", double(moved))
        .add_num("lower_bound_bytes", double(lb))
        .add_num("torch_bytes", double(torch_b))
        .add_str("torch_plan", torch_plan)
        .add_num("peak_extra_bytes", double(extra))
        .add_num("max_in_out_bytes", double(bound))
        .add_num("allocations", double(allocs));
    c.table.row({mesh_label(mesh), name, shape, steps, std::to_string(plan_b), std::to_string(moved),
                 std::to_string(lb), std::to_string(torch_b), bench::range(stats), std::to_string(extra),
                 std::to_string(bound)});
    c.results.add(std::move(r));
  }
};

/// R -> P -> R as one row (two redistributes per call).
void run_r_p_r(Ctx& c, const DeviceMesh<Mesh1>& mesh, std::int64_t rows, std::int64_t cols) {
  auto x = distribute_tensor<R>(mesh, Tensor<float, 2>::full({rows, cols}, 1.0f), replicated_source);
  const Extents global{rows, cols};
  const auto p1 = decltype(x)::plan_to<P>();
  const auto p2 = DTensor<float, 2, Mesh1, P>::plan_to<R>();
  const std::int64_t plan_b =
      p1.bytes_per_rank(global, mesh.sizes(), 4) + p2.bytes_per_rank(global, mesh.sizes(), 4);
  const PlacementList lr = placement_list_v<R>;
  const PlacementList lp = placement_list_v<P>;
  const std::int64_t torch_b = torch_greedy_bytes(lr, lp, global, mesh.sizes(), 4) +
                               torch_greedy_bytes(lp, lr, global, mesh.sizes(), 4);
  const std::int64_t lb = 4 * lower_bound_elems(lp, lr, global, mesh.sizes());
  auto chain = [&] { auto z = x.redistribute<P>().redistribute<R>(); };
  const auto stats = world_max(c, bench::measure(plan_for(c.opt, rows * cols * 4), chain));
  std::int64_t moved = 0;
  {
    CommDebugMode comm;
    chain();
    moved = world_max(c, comm.total_bytes());
  }
  bench::alloc::reset_peak();
  std::int64_t extra = 0;
  {
    auto z = x.redistribute<P>().redistribute<R>();
    extra = bench::alloc::peak() - bench::alloc::live();
  }
  extra = world_max(c, extra);
  const std::int64_t bound = static_cast<std::int64_t>(x.local().nbytes());
  const std::string steps = p1.to_string().substr(p1.to_string().find(':') + 2) + "; then " +
                            p2.to_string().substr(p2.to_string().find(':') + 2);
  const std::string shape = std::to_string(rows) + "x" + std::to_string(cols);
  bench::Record r{
      "redistribution", "[R]->[P(sum)]->[R]", "gloo", c.world.size(), rows * cols * 4, stats, "", {}, {}};
  r.add_str("mesh", mesh_label(mesh))
      .add_str("shape", shape)
      .add_str("plan", steps)
      .add_num("plan_steps", p1.plan.size() + p2.plan.size())
      .add_num("plan_bytes", double(plan_b))
      .add_num("moved_bytes", double(moved))
      .add_num("lower_bound_bytes", double(lb))
      .add_num("torch_bytes", double(torch_b))
      .add_str("torch_plan", "local_partial(x); all_reduce(x)")
      .add_num("peak_extra_bytes", double(extra))
      .add_num("max_in_out_bytes", double(bound));
  c.table.row({mesh_label(mesh), "[R]->[P(sum)]->[R]", shape, steps, std::to_string(plan_b),
               std::to_string(moved), std::to_string(lb), std::to_string(torch_b), bench::range(stats),
               std::to_string(extra), std::to_string(bound)});
  c.results.add(std::move(r));
}

// ---- uneven sizes: variable-size collectives (the executor) vs padding to equal blocks
// ----------------------

/// Copies rows [0, n) of `src` (n x cols) into rows [at, at + n) of `dst`.
void copy_rows(const Tensor<float, 2>& dst, std::int64_t at, const Tensor<float, 2>& src, std::int64_t n) {
  if (n > 0) {
    dst.narrow(0, at, n).copy_from(src.narrow(0, 0, n));
  }
}

void run_uneven(Ctx& c, const DeviceMesh<Mesh1>& mesh, std::int64_t rows, std::int64_t cols) {
  const int n = mesh.sizes()[0];
  const int me = mesh.coordinate()[0];
  const std::int64_t cn = (rows + n - 1) / n; // padded chunk rows
  const std::int64_t cm = (cols + n - 1) / n; // padded chunk cols
  const std::int64_t my_rows = chunk_size(rows, n, me);
  const std::int64_t my_cols = chunk_size(cols, n, me);
  const Tensor<float, 2> full = Tensor<float, 2>::full({rows, cols}, 1.0f);
  const std::string shape = std::to_string(rows) + "x" + std::to_string(cols);
  const ProcessGroup& g = c.world;
  const auto plan = plan_for(c.opt, rows * cols * 4);

  auto compare_max = [&](const bench::SamplePlan& p, auto&& a, auto&& b) {
    auto [sa, sb] = bench::compare(p, a, b);
    return std::pair{world_max(c, sa), world_max(c, sb)};
  };
  auto row = [&](const char* op, const bench::Stats& var, const bench::Stats& pad, std::int64_t var_b,
                 std::int64_t pad_b) {
    bench::Record r{"uneven", op, "gloo", n, rows * cols * 4, var, "padded", pad, {}};
    r.add_str("shape", shape)
        .add_str("ours_is", "variable-size collective (executor)")
        .add_num("variable_bytes_received", double(var_b))
        .add_num("padded_bytes_received", double(pad_b));
    c.uneven.row({op, std::to_string(n), shape, bench::range(var), bench::range(pad),
                  bench::fmt("%.3f", r.ratio()), std::to_string(var_b), std::to_string(pad_b)});
    c.results.add(std::move(r));
  };

  { // all_gather: S(0) -> R
    auto x = distribute_tensor<S<0>>(mesh, full, replicated_source);
    auto padded = [&] {
      Tensor<float, 2> in = Tensor<float, 2>::zeros({cn, cols});
      copy_rows(in, 0, x.local(), my_rows);
      Tensor<float, 2> gathered({cn * n, cols});
      all_gather_into_tensor(gathered, in, g);
      Tensor<float, 2> out({rows, cols});
      for (int q = 0; q < n; ++q) {
        copy_rows(out, chunk_offset(rows, n, q), gathered.narrow(0, q * cn, cn), chunk_size(rows, n, q));
      }
    };
    const auto [var, pad] = compare_max(
        plan, [&] { auto y = x.redistribute<R>(); }, padded);
    row("all_gather", var, pad, (rows - chunk_size(rows, n, n - 1)) * cols * 4, (n - 1) * cn * cols * 4);
  }
  { // reduce_scatter: P -> S(0)
    auto x = distribute_tensor<P>(mesh, full, replicated_source);
    auto padded = [&] {
      Tensor<float, 2> in = Tensor<float, 2>::zeros({cn * n, cols});
      copy_rows(in, 0, x.local(), rows);
      Tensor<float, 2> part({cn, cols});
      reduce_scatter_tensor(part, in, ReduceOp::sum, g);
      Tensor<float, 2> out({my_rows, cols});
      copy_rows(out, 0, part, my_rows);
    };
    const auto [var, pad] = compare_max(
        plan, [&] { auto y = x.redistribute<S<0>>(); }, padded);
    row("reduce_scatter", var, pad, (n - 1) * chunk_size(rows, n, 0) * cols * 4, (n - 1) * cn * cols * 4);
  }
  { // all_to_all: S(0) -> S(1)
    auto x = distribute_tensor<S<0>>(mesh, full, replicated_source);
    auto padded = [&] {
      Tensor<float, 2> send = Tensor<float, 2>::zeros({cn * n, cm});
      for (int q = 0; q < n; ++q) {
        const std::int64_t mq = chunk_size(cols, n, q);
        if (my_rows > 0 && mq > 0) {
          send.narrow(0, q * cn, my_rows)
              .narrow(1, 0, mq)
              .copy_from(x.local().narrow(1, chunk_offset(cols, n, q), mq));
        }
      }
      Tensor<float, 2> recv({cn * n, cm});
      all_to_all_single(recv, send, g);
      Tensor<float, 2> out({rows, my_cols});
      for (int q = 0; q < n; ++q) {
        const std::int64_t nq = chunk_size(rows, n, q);
        if (nq > 0 && my_cols > 0) {
          out.narrow(0, chunk_offset(rows, n, q), nq)
              .copy_from(recv.narrow(0, q * cn, nq).narrow(1, 0, my_cols));
        }
      }
    };
    const auto [var, pad] = compare_max(
        plan, [&] { auto y = x.redistribute<S<1>>(); }, padded);
    row("all_to_all", var, pad, (rows - my_rows) * chunk_size(cols, n, 0) * 4, (n - 1) * cn * cm * 4);
  }
}

} // namespace

int main(int argc, char** argv) {
  Ctx c;
  c.opt = bench::parse_options(argc, argv);
  InitOptions io;
  io.backend = "gloo";
  c.world = init_process_group(io);
  const int w = c.world.size();
  const bool smoke = c.opt.smoke;
  // Even shapes are (rows, cols) with rows and cols divisible by 8; uneven ones are not.
  const std::int64_t er = smoke ? 16 : 512, ec = smoke ? 8 : 256;
  const std::int64_t ur = smoke ? 13 : 509, uc = smoke ? 7 : 251;

  auto mesh1 = init_device_mesh<Mesh1>(c.world);
  if (w <= 4) {
    Runner<Mesh1, L<S<0>>, L<R>>::run(c, mesh1, er, ec);
    Runner<Mesh1, L<R>, L<S<0>>>::run(c, mesh1, er, ec);
    Runner<Mesh1, L<S<0>>, L<S<1>>>::run(c, mesh1, er, ec);
    Runner<Mesh1, L<P>, L<R>>::run(c, mesh1, er, ec);
    Runner<Mesh1, L<P>, L<S<0>>>::run(c, mesh1, er, ec);
    Runner<Mesh1, L<R>, L<P>>::run(c, mesh1, er, ec);
    run_r_p_r(c, mesh1, er, ec);
    Runner<Mesh1, L<S<0>>, L<R>>::run(c, mesh1, ur, uc, " uneven");
    Runner<Mesh1, L<S<0>>, L<S<1>>>::run(c, mesh1, ur, uc, " uneven");
    Runner<Mesh1, L<P>, L<S<1>>>::run(c, mesh1, ur, uc, " uneven");
    Runner<Mesh1, L<S<1>>, L<S<0>>>::run(c, mesh1, 3, uc, " rows<ranks");
  }
  if (w == 4) {
    auto mesh2 = init_device_mesh<Mesh2>(c.world, 2);
    Runner<Mesh2, L<S<0>, S<1>>, L<S<1>, S<0>>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<S<0>, S<0>>, L<R, S<1>>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<S<0>, R>, L<R, S<1>>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<S<0>, S<0>>, L<S<1>, S<1>>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<S<0>, S<1>>, L<S<0>, S<0>>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<R, S<1>>, L<S<1>, S<0>>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<S<0>, S<1>>, L<R, R>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<P, P>, L<R, S<1>>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<P, P>, L<S<0>, S<1>>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<P, S<0>>, L<S<0>, R>>::run(c, mesh2, er, ec);
    Runner<Mesh2, L<S<0>, S<1>>, L<S<1>, S<0>>>::run(c, mesh2, ur, uc, " uneven");
    Runner<Mesh2, L<S<0>, S<0>>, L<R, S<1>>>::run(c, mesh2, ur, uc, " uneven");
  }
  if (w == 8) {
    auto mesh3 = init_device_mesh<Mesh3>(c.world, 2, 2);
    Runner<Mesh3, L<S<0>, S<1>, R>, L<S<1>, S<0>, R>>::run(c, mesh3, er, ec);
    Runner<Mesh3, L<S<0>, S<0>, S<0>>, L<S<1>, S<1>, S<1>>>::run(c, mesh3, er, ec);
    Runner<Mesh3, L<S<0>, S<1>, S<0>>, L<R, R, R>>::run(c, mesh3, er, ec);
    Runner<Mesh3, L<P, S<0>, S<1>>, L<S<1>, S<0>, R>>::run(c, mesh3, er, ec);
    Runner<Mesh3, L<S<0>, S<0>, R>, L<R, S<1>, S<1>>>::run(c, mesh3, er, ec);
    Runner<Mesh3, L<S<0>, R, S<1>>, L<S<1>, S<0>, R>>::run(c, mesh3, ur, uc, " uneven");
  }
  if (w <= 4) {
    for (std::int64_t k : smoke ? std::vector<std::int64_t>{1} : std::vector<std::int64_t>{1, 64, 1024}) {
      run_uneven(c, mesh1, w * k + 1, 4 * w + 1);
    }
    if (!smoke) {
      run_uneven(c, mesh1, w * 512 + 1, 255);
    }
  }

  if (c.world.rank() == 0) {
    std::printf("redistribution on gloo, %d processes (float32; bytes per rank; times: the slowest rank's "
                "median, min and max)\n",
                w);
    c.table.print();
    if (w <= 4) {
      std::printf("\nuneven sizes on gloo, %d processes: variable-size collectives (the executor) vs padding "
                  "to equal blocks + unpad copies (interleaved)\n",
                  w);
      c.uneven.print();
    }
    c.results.write(c.opt, "redistribution_n" + std::to_string(w) + ".json");
  }
  barrier(c.world);
  return 0;
}

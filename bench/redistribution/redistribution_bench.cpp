// Redistribution suite: transitions on 1-, 2- and 3-axis meshes with the plan's steps, bytes per rank from
// the plan, bytes actually moved (CommDebugMode), the analytic lower bound, what PyTorch's greedy planner
// would move (plan/torch_reference.hpp), the measured time, and the peak extra memory; plus the uneven-size
// comparison of variable-size collectives (what the executor does) against padding to equal blocks.
//
//   dtensor-run --standalone --nproc-per-node 4 build-bench/bench/bench_redistribution   # 1-D (4), 2-D (2x2)
//   dtensor-run --standalone --nproc-per-node 8 build-bench/bench/bench_redistribution   # 3-D (2x2x2)
//   dtensor-run --standalone --nproc-per-node 2 build-bench/bench/bench_redistribution   # 1-D (2)
//   mpirun -np 4 build-bench/bench/bench_redistribution --backend mpi                     # on MPI
//
// Device mode (--device cuda, which implies --backend nccl; the default of a build without gloo): the same
// cases on CUDA tensors over NCCL, from the binary bench_redistribution_cuda (built when NCCL is found;
// exits 77 without a GPU). With fewer than 4 ranks it also runs the 2-D and 3-D case lists on (1, n) and
// (1, 1, n) meshes, so the planner's multi-axis paths are timed on one GPU. scripts/gpu_check.sh runs it
// as 1 and 2 processes (torch_dtensor_bench.py runs the same cases through torch.distributed.tensor):
//
//   build/bench/bench_redistribution_cuda --device cuda --scale 0.34
//   NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo DTENSOR_TEST_HOSTID_PER_RANK=1
//     dtensor-run --standalone --nproc-per-node 2 build/bench/bench_redistribution_cuda --device cuda
//
// Definitions (BENCHMARKS.md has them in full). All byte counts are per rank, the most any rank receives:
//  - plan bytes: bytes_per_rank of the plan (per step the most any rank receives, summed over steps);
//  - moved bytes: CommDebugMode's total on each rank for one call, the largest over ranks;
//  - lower bound: without Partial sources, the largest over ranks of |target block| - |target block
//    intersected with source block| (what a rank must receive because it does not hold it); with p ranks
//    of Partial axes reduced (p_s of them becoming Shard), R = p_s * |target block| the data a reduction
//    group must produce per rank and the bound is R * (1 + 1/p_s - 2/p): (p-1)/p of R for a reduce_scatter
//    (p_s = p) and 2(p-1)/p of it for an all_reduce (p_s = 1);
//  - best sequence: cheapest_plan's bytes (plan/search.hpp), the least any sequence of the executor's steps
//    moves, found by exhaustive search: the bound for plans of collectives in sequence, which the lower
//    bound above is not for mixed Partial and Shard changes (docs/plan.md, "Partial sources");
//  - torch bytes: torch_greedy_bytes, PyTorch's plan with its padding;
//  - time: each rank's median (min, max) of back-to-back calls, the largest over ranks; on CUDA tensors a
//    batch of back-to-back calls ends with cudaDeviceSynchronize, so the time includes the device work;
//  - host time (CUDA tensors only): the wall time from the call to its return, one call per sample with
//    the device idle before it (cudaDeviceSynchronize outside the timed region), the result destroyed
//    inside it: what the call costs the host (planning, allocation, packing, enqueueing NCCL work, and
//    any wait the call does itself). bench/redistribution/torch_dtensor_bench.py measures
//    torch.distributed.tensor the same way;
//  - peak extra memory: the most bytes live during one redistribute beyond what is live after it (input
//    and output shards), largest over ranks: on the host from replaced global operator new/delete, on a
//    GPU from the device's default memory pool (cudaMemPoolAttrUsedMemHigh; tensors use cudaMallocAsync).
// Writes bench/results/redistribution_n<ranks>.json (suites "redistribution" and "uneven"; on MPI
// redistribution_mpi_n<ranks>.json); device mode: redistribution_cuda_n<ranks>.json with backend "nccl" and
// the host-time fields host_us, host_min_us, host_max_us.

#include "../common/harness.hpp"
#include <dtensor/testing/heap_counter.hpp>

#include <dtensor/backward/duality.hpp>
#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/plan/search.hpp>
#include <dtensor/plan/torch_reference.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/validate_only.hpp>

#if DTENSOR_HAS_NCCL && DTENSOR_HAS_CUDA
#define BENCH_HAS_DEVICE 1
#include <cuda_runtime_api.h>
#include <dtensor/core/cuda_devices.hpp>
#else
#define BENCH_HAS_DEVICE 0
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
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
  std::string backend = "gloo";
  Device dev = Device::cpu(); ///< where the tensors live (--device)
  bench::Results results;
  bench::Table table{{"mesh", "transition", "shape", "plan steps", "plan B", "bwd B", "moved B", "lower bd B",
                      "best seq B", "torch B", "time us [min-max]", "extra mem B", "max(in,out) B"}};
  bench::Table uneven{{"op", "ranks", "shape", "variable us [min-max]", "padded us [min-max]", "var/pad",
                       "var B recv", "pad B recv"}};

  bool cuda() const noexcept { return dev.is_cuda(); }
  std::vector<std::string> errors; ///< cases that threw (the run goes on, then exits 1)
};

/// Runs one case; an exception is reported and recorded, and the suite goes on with the next case.
template <class F>
void guarded(Ctx& c, const std::string& what, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    c.errors.push_back(what + ": " + e.what());
    std::fprintf(stderr, "bench_redistribution: rank %d: %s failed: %s\n", c.world.rank(), what.c_str(),
                 e.what());
  }
}

#if BENCH_HAS_DEVICE
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw Error(std::string("bench_redistribution: ") + what + ": " + cudaGetErrorString(e));
  }
}
#endif

/// Waits for the device (no-op on host tensors).
void device_sync(const Ctx& c) {
#if BENCH_HAS_DEVICE
  if (c.cuda()) {
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
#else
  (void)c;
#endif
}

/// The largest value over ranks of a small host tensor (through the device under NCCL, which takes only
/// device memory).
template <class T>
Tensor<T, 1> world_max_values(const Ctx& c, Tensor<T, 1> host) {
  if (!c.cuda()) {
    all_reduce(host, ReduceOp::max, c.world);
    return host;
  }
  auto d = host.to(c.dev);
  all_reduce(d, ReduceOp::max, c.world);
  return d.to(Device::cpu());
}

std::int64_t world_max(const Ctx& c, std::int64_t v) {
  return world_max_values(c, Tensor<std::int64_t, 1>::full({1}, v))(0);
}

/// Each of median, min and max: the largest over ranks (a rank that sends nothing must not hide the others).
bench::Stats world_max(const Ctx& c, bench::Stats s) {
  auto t = world_max_values(c, Tensor<double, 1>::from_values({3}, {s.median, s.min, s.max}));
  s.median = t(0);
  s.min = t(1);
  s.max = t(2);
  return s;
}

/// `f` as the harness calls it: on CUDA tensors the last call of every batch of `p.batch` calls ends
/// with a device synchronization, so a sample covers the device work of its batch.
template <class F>
auto batch_synced(const Ctx& c, const bench::SamplePlan& p, F& f) {
  return [&c, &p, &f, left = 0]() mutable {
    f();
    if (c.cuda() && ++left == p.batch) {
      left = 0;
      device_sync(c);
    }
  };
}

template <class F>
bench::Stats timed(const Ctx& c, const bench::SamplePlan& p, F&& f) {
  return bench::measure(p, batch_synced(c, p, f));
}

template <class A, class B>
std::pair<bench::Stats, bench::Stats> compared(const Ctx& c, const bench::SamplePlan& p, A&& a, B&& b) {
  return bench::compare(p, batch_synced(c, p, a), batch_synced(c, p, b));
}

/// The host time of one call (CUDA tensors): the device is idle before each sample; the timed region is
/// the call alone (the result destroyed inside it). Samples: --scale x 15.
template <class F>
bench::Stats host_time(const Ctx& c, F&& f) {
  std::vector<double> v;
  const int n = bench::scaled(c.opt, 15);
  for (int i = 0; i < n; ++i) {
    device_sync(c);
    const auto t0 = bench::Clock::now();
    f();
    v.push_back(bench::us_since(t0));
  }
  device_sync(c);
  return bench::stats_of(std::move(v));
}

/// Peak extra memory of one call: reset before it, read with the call's results still alive.
struct MemProbe {
  const Ctx& c;
  explicit MemProbe(const Ctx& ctx) : c(ctx) {
    if (!c.cuda()) {
      dtensor::testing::heap::reset_peak();
      return;
    }
#if BENCH_HAS_DEVICE
    device_sync(c);
    std::uint64_t zero = 0;
    check_cuda(cudaMemPoolSetAttribute(pool(), cudaMemPoolAttrUsedMemHigh, &zero), "cudaMemPoolSetAttribute");
#endif
  }
  /// Bytes live at the peak beyond what is live now.
  std::int64_t extra() const {
    if (!c.cuda()) {
      return dtensor::testing::heap::peak() - dtensor::testing::heap::live();
    }
#if BENCH_HAS_DEVICE
    device_sync(c);
    std::uint64_t high = 0;
    std::uint64_t now = 0;
    check_cuda(cudaMemPoolGetAttribute(pool(), cudaMemPoolAttrUsedMemHigh, &high), "cudaMemPoolGetAttribute");
    check_cuda(cudaMemPoolGetAttribute(pool(), cudaMemPoolAttrUsedMemCurrent, &now),
               "cudaMemPoolGetAttribute");
    return high > now ? static_cast<std::int64_t>(high - now) : 0;
#else
    return 0;
#endif
  }
#if BENCH_HAS_DEVICE
  cudaMemPool_t pool() const {
    cudaMemPool_t p = nullptr;
    check_cuda(cudaDeviceGetDefaultMemPool(&p, c.dev.index), "cudaDeviceGetDefaultMemPool");
    return p;
  }
#endif
};

/// Fields and columns only the device mode has.
void add_host_time(const Ctx& c, bench::Record& r, std::vector<std::string>& cells,
                   const bench::Stats& host) {
  if (!c.cuda()) {
    return;
  }
  r.add_str("device", "cuda")
      .add_num("host_us", host.median)
      .add_num("host_min_us", host.min)
      .add_num("host_max_us", host.max)
      .add_num("host_samples", host.samples)
      .add_str("memory", "device pool (cudaMemPoolAttrUsedMemHigh)");
  cells.push_back(bench::range(host));
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

/// What one redistribution row reports (bytes per rank; the largest over ranks where it varies).
struct RowFigures {
  std::string mesh, name, shape, steps, torch_plan;
  int plan_steps = 0;
  std::int64_t bytes = 0, plan_b = 0, moved = 0, lb = 0, torch_b = 0, extra = 0, bound = 0;
  std::int64_t seq_b = 0;   ///< the cheapest sequence of collectives (plan/search.hpp)
  std::int64_t allocs = -1; ///< heap allocations of one call; < 0: not counted
  std::string bwd_steps;    ///< the backward's plan for the gradient dual(dst) (backward/duality.hpp)
  std::int64_t bwd_b = -1;  ///< its bytes per rank; < 0: no linear backward
  bench::Stats stats, host;
};

/// The backward of src -> dst for the gradient a redundant consumer gives (dual(dst)), on `sizes`.
template <class Names>
void set_backward(RowFigures& f, const PlacementList& src, const PlacementList& dst, const Extents& global,
                  const MeshSizes& sizes, const Names& names) {
  const BackwardPlan b = make_backward_plan(src, dst, dual(dst), 2, sizes);
  if (b.error == BackwardError::none) {
    f.bwd_b = bytes_per_rank(b.plan, global, sizes, 4);
    const std::string text = to_string(b, names);
    f.bwd_steps = text.substr(text.find(':') + 2);
  }
}

/// Adds one row to the table and the JSON results.
void add_row(Ctx& c, const RowFigures& f) {
  bench::Record r{"redistribution", f.name, c.backend, c.world.size(), f.bytes, f.stats, "", {}, {}};
  r.add_str("mesh", f.mesh)
      .add_str("shape", f.shape)
      .add_str("plan", f.steps)
      .add_num("plan_steps", f.plan_steps)
      .add_num("plan_bytes", double(f.plan_b))
      .add_str("backward_plan", f.bwd_steps)
      .add_num("backward_plan_bytes", double(f.bwd_b))
      .add_num("moved_bytes", double(f.moved))
      .add_num("lower_bound_bytes", double(f.lb))
      .add_num("cheapest_sequence_bytes", double(f.seq_b))
      .add_num("torch_bytes", double(f.torch_b))
      .add_str("torch_plan", f.torch_plan)
      .add_num("peak_extra_bytes", double(f.extra))
      .add_num("max_in_out_bytes", double(f.bound));
  if (f.allocs >= 0) {
    r.add_num("allocations", double(f.allocs));
  }
  std::vector<std::string> cells{f.mesh,
                                 f.name,
                                 f.shape,
                                 f.steps,
                                 std::to_string(f.plan_b),
                                 f.bwd_b < 0 ? "-" : std::to_string(f.bwd_b),
                                 std::to_string(f.moved),
                                 std::to_string(f.lb),
                                 std::to_string(f.seq_b),
                                 std::to_string(f.torch_b),
                                 bench::range(f.stats),
                                 std::to_string(f.extra),
                                 std::to_string(f.bound)};
  add_host_time(c, r, cells, f.host);
  c.table.row(std::move(cells));
  c.results.add(std::move(r));
}

/// One redistribution row (or, with Mid, the chain Src -> Mid -> Dst timed as one).
template <class Shape, class Src, class Dst>
struct Runner;

template <class Shape, class... Ps, class... Qs>
struct Runner<Shape, Placements<Ps...>, Placements<Qs...>> {
  static void run(Ctx& c, const DeviceMesh<Shape>& mesh, std::int64_t rows, std::int64_t cols,
                  const char* note = "") {
    guarded(c,
            mesh_label(mesh) + " " + to_string(placement_list_v<Ps...>) + "->" +
                to_string(placement_list_v<Qs...>) + note,
            [&] { run_case(c, mesh, rows, cols, note); });
  }

  static void run_case(Ctx& c, const DeviceMesh<Shape>& mesh, std::int64_t rows, std::int64_t cols,
                       const char* note) {
    Tensor<float, 2> full({rows, cols});
    for (std::int64_t i = 0; i < rows * cols; ++i) {
      full.data()[i] = static_cast<float>(i % 1000);
    }
    auto x = distribute_tensor<Ps...>(mesh, c.cuda() ? full.to(c.dev) : full, replicated_source);
    const Extents global{rows, cols};
    const auto plan = x.template plan_for<Qs...>(); // the plan run on this mesh's sizes
    const PlacementList src = placement_list_v<Ps...>;
    const PlacementList dst = placement_list_v<Qs...>;
    const std::int64_t plan_b = plan.bytes_per_rank(global, mesh.sizes(), 4);
    const std::int64_t torch_b = torch_greedy_bytes(src, dst, global, mesh.sizes(), 4);
    const std::int64_t lb = 4 * lower_bound_elems(src, dst, global, mesh.sizes());

    auto call = [&] { auto y = x.template redistribute<Qs...>(); };
    const auto stats = world_max(c, timed(c, plan_for(c.opt, rows * cols * 4), call));
    const auto host = c.cuda() ? world_max(c, host_time(c, call)) : bench::Stats{};
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
      const MemProbe mem(c);
      const std::int64_t n0 = dtensor::testing::heap::count();
      auto y = x.template redistribute<Qs...>();
      allocs = dtensor::testing::heap::count() - n0;
      extra = mem.extra();
      out_b = static_cast<std::int64_t>(y.local().nbytes());
    }
    moved = world_max(c, moved);
    extra = world_max(c, extra);
    allocs = world_max(c, allocs);
    const std::int64_t bound = world_max(c, std::max(in_b, out_b));

    RowFigures f;
    f.mesh = mesh_label(mesh);
    f.name = to_string(src) + "->" + to_string(dst) + note;
    f.shape = std::to_string(rows) + "x" + std::to_string(cols);
    f.steps = plan.to_string().substr(plan.to_string().find(':') + 2);
    f.torch_plan = to_string(torch_greedy_plan(src, dst, 2), Shape::names);
    f.plan_steps = plan.plan.size();
    f.bytes = rows * cols * 4;
    f.plan_b = plan_b;
    f.moved = moved;
    f.lb = lb;
    f.seq_b = cheapest_plan(src, dst, global, mesh.sizes(), 4).bytes;
    f.torch_b = torch_b;
    f.extra = extra;
    f.bound = bound;
    f.allocs = allocs;
    f.stats = stats;
    f.host = host;
    set_backward(f, src, dst, global, mesh.sizes(), Shape::names);
    add_row(c, f);
  }
};

/// R -> P -> R as one row (two redistributes per call).
void run_r_p_r_case(Ctx& c, const DeviceMesh<Mesh1>& mesh, std::int64_t rows, std::int64_t cols) {
  auto x = distribute_tensor<R>(mesh, Tensor<float, 2>::full({rows, cols}, 1.0f, c.dev), replicated_source);
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
  const auto stats = world_max(c, timed(c, plan_for(c.opt, rows * cols * 4), chain));
  const auto host = c.cuda() ? world_max(c, host_time(c, chain)) : bench::Stats{};
  std::int64_t moved = 0;
  {
    CommDebugMode comm;
    chain();
    moved = world_max(c, comm.total_bytes());
  }
  std::int64_t extra = 0;
  {
    const MemProbe mem(c);
    auto z = x.redistribute<P>().redistribute<R>();
    extra = mem.extra();
  }
  extra = world_max(c, extra);
  RowFigures f;
  f.mesh = mesh_label(mesh);
  f.name = "[R]->[P(sum)]->[R]";
  f.shape = std::to_string(rows) + "x" + std::to_string(cols);
  f.steps = p1.to_string().substr(p1.to_string().find(':') + 2) + "; then " +
            p2.to_string().substr(p2.to_string().find(':') + 2);
  f.torch_plan = "local_partial(x); all_reduce(x)";
  f.plan_steps = p1.plan.size() + p2.plan.size();
  f.bytes = rows * cols * 4;
  f.plan_b = plan_b;
  f.moved = moved;
  f.lb = lb;
  f.seq_b = cheapest_plan(lr, lp, global, mesh.sizes(), 4).bytes +
            cheapest_plan(lp, lr, global, mesh.sizes(), 4).bytes;
  f.torch_b = torch_b;
  f.extra = extra;
  f.bound = static_cast<std::int64_t>(x.local().nbytes());
  f.stats = stats;
  f.host = host;
  add_row(c, f);
}

// ---- uneven sizes: variable-size collectives (the executor) vs padding to equal blocks
// ----------------------

/// Copies rows [0, n) of `src` (n x cols) into rows [at, at + n) of `dst`.
void copy_rows(const Tensor<float, 2>& dst, std::int64_t at, const Tensor<float, 2>& src, std::int64_t n) {
  if (n > 0) {
    dst.narrow(0, at, n).copy_from(src.narrow(0, 0, n));
  }
}

void run_r_p_r(Ctx& c, const DeviceMesh<Mesh1>& mesh, std::int64_t rows, std::int64_t cols) {
  guarded(c, mesh_label(mesh) + " [R]->[P(sum)]->[R]", [&] { run_r_p_r_case(c, mesh, rows, cols); });
}

void run_uneven_case(Ctx& c, const DeviceMesh<Mesh1>& mesh, std::int64_t rows, std::int64_t cols) {
  const int n = mesh.sizes()[0];
  const int me = mesh.coordinate()[0];
  const std::int64_t cn = (rows + n - 1) / n; // padded chunk rows
  const std::int64_t cm = (cols + n - 1) / n; // padded chunk cols
  const std::int64_t my_rows = chunk_size(rows, n, me);
  const std::int64_t my_cols = chunk_size(cols, n, me);
  const Tensor<float, 2> full = Tensor<float, 2>::full({rows, cols}, 1.0f, c.dev);
  const std::string shape = std::to_string(rows) + "x" + std::to_string(cols);
  const ProcessGroup& g = c.world;
  const auto plan = plan_for(c.opt, rows * cols * 4);

  auto compare_max = [&](const bench::SamplePlan& p, auto&& a, auto&& b) {
    auto [sa, sb] = compared(c, p, a, b);
    return std::pair{world_max(c, sa), world_max(c, sb)};
  };
  auto row = [&](const char* op, const bench::Stats& var, const bench::Stats& pad, std::int64_t var_b,
                 std::int64_t pad_b) {
    bench::Record r{"uneven", op, c.backend, n, rows * cols * 4, var, "padded", pad, {}};
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
      Tensor<float, 2> in = Tensor<float, 2>::zeros({cn, cols}, c.dev);
      copy_rows(in, 0, x.local(), my_rows);
      Tensor<float, 2> gathered({cn * n, cols}, c.dev);
      all_gather_into_tensor(gathered, in, g);
      Tensor<float, 2> out({rows, cols}, c.dev);
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
      Tensor<float, 2> in = Tensor<float, 2>::zeros({cn * n, cols}, c.dev);
      copy_rows(in, 0, x.local(), rows);
      Tensor<float, 2> part({cn, cols}, c.dev);
      reduce_scatter_tensor(part, in, ReduceOp::sum, g);
      Tensor<float, 2> out({my_rows, cols}, c.dev);
      copy_rows(out, 0, part, my_rows);
    };
    const auto [var, pad] = compare_max(
        plan, [&] { auto y = x.redistribute<S<0>>(); }, padded);
    row("reduce_scatter", var, pad, (n - 1) * chunk_size(rows, n, 0) * cols * 4, (n - 1) * cn * cols * 4);
  }
  { // all_to_all: S(0) -> S(1)
    auto x = distribute_tensor<S<0>>(mesh, full, replicated_source);
    auto padded = [&] {
      Tensor<float, 2> send = Tensor<float, 2>::zeros({cn * n, cm}, c.dev);
      for (int q = 0; q < n; ++q) {
        const std::int64_t mq = chunk_size(cols, n, q);
        if (my_rows > 0 && mq > 0) {
          send.narrow(0, q * cn, my_rows)
              .narrow(1, 0, mq)
              .copy_from(x.local().narrow(1, chunk_offset(cols, n, q), mq));
        }
      }
      Tensor<float, 2> recv({cn * n, cm}, c.dev);
      all_to_all_single(recv, send, g);
      Tensor<float, 2> out({rows, my_cols}, c.dev);
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

void run_uneven(Ctx& c, const DeviceMesh<Mesh1>& mesh, std::int64_t rows, std::int64_t cols) {
  guarded(c, "uneven " + std::to_string(rows) + "x" + std::to_string(cols),
          [&] { run_uneven_case(c, mesh, rows, cols); });
}

void cases_2d(Ctx& c, const DeviceMesh<Mesh2>& mesh2, std::int64_t er, std::int64_t ec, std::int64_t ur,
              std::int64_t uc) {
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

void cases_3d(Ctx& c, const DeviceMesh<Mesh3>& mesh3, std::int64_t er, std::int64_t ec, std::int64_t ur,
              std::int64_t uc) {
  Runner<Mesh3, L<S<0>, S<1>, R>, L<S<1>, S<0>, R>>::run(c, mesh3, er, ec);
  Runner<Mesh3, L<S<0>, S<0>, S<0>>, L<S<1>, S<1>, S<1>>>::run(c, mesh3, er, ec);
  Runner<Mesh3, L<S<0>, S<1>, S<0>>, L<R, R, R>>::run(c, mesh3, er, ec);
  Runner<Mesh3, L<P, S<0>, S<1>>, L<S<1>, S<0>, R>>::run(c, mesh3, er, ec);
  Runner<Mesh3, L<S<0>, S<0>, R>, L<R, S<1>, S<1>>>::run(c, mesh3, er, ec);
  Runner<Mesh3, L<S<0>, R, S<1>>, L<S<1>, S<0>, R>>::run(c, mesh3, ur, uc, " uneven");
}

/// setup()'s status when the launch check passed (dtensor/testing/validate_only.hpp): main exits 0.
constexpr int kValidated = -1;

/// --backend gloo|mpi|nccl and --device cpu|cuda (cuda implies nccl). Returns 0 to go on, else the exit
/// status (77: skipped, 2: bad arguments; kValidated).
int setup(Ctx& c, InitOptions& io) {
  std::string backend;
#if DTENSOR_HAS_GLOO
  std::string device = "cpu";
#else
  std::string device = "cuda"; // bench_redistribution_cuda: NCCL only
#endif
  const auto& a = c.opt.args;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if ((a[i] == "--backend" || a[i] == "--device") && i + 1 < a.size()) {
      (a[i] == "--backend" ? backend : device) = a[i + 1];
      ++i;
    } else {
      std::fprintf(stderr,
                   "bench_redistribution: unknown argument '%s' (--scale S, --smoke, --out DIR, --backend "
                   "gloo|mpi|nccl, --device cpu|cuda)\n",
                   a[i].c_str());
      return 2;
    }
  }
  if (backend.empty()) {
    backend = device == "cuda" ? "nccl" : "gloo";
  }
  if (!(((backend == "gloo" || backend == "mpi") && device == "cpu") ||
        (backend == "nccl" && device == "cuda"))) {
    std::fprintf(stderr,
                 "bench_redistribution: --backend %s --device %s: gloo and MPI take host tensors, NCCL CUDA "
                 "tensors\n",
                 backend.c_str(), device.c_str());
    return 2;
  }
  c.backend = backend;
  io.backend = backend;
  if (testing::validate_only()) { // gpu_check.sh --dry-run: the flags and the launch, nothing run
    const DistEnv env = read_dist_env();
    testing::validated("bench_redistribution", "--backend " + backend + " --device " + device + ", rank " +
                                                   std::to_string(env.rank) + " of " +
                                                   std::to_string(env.world_size));
    return kValidated;
  }
  if (device == "cpu") {
    return 0;
  }
#if BENCH_HAS_DEVICE
  const CudaDevices visible = probe_cuda_devices();
  if (visible.unusable()) { // a GPU CUDA cannot use (an old driver) is an error, never a skip
    std::fprintf(stderr, "bench_redistribution: CUDA cannot use this machine's GPU: %s\n",
                 visible.reason().c_str());
    return 1;
  }
  if (visible.count == 0) {
    std::printf("bench_redistribution: no CUDA device visible (%s), skipping\n", visible.reason().c_str());
    return 77;
  }
  const int devices = visible.count;
  const DistEnv env = read_dist_env();
  if (const char* h = std::getenv("DTENSOR_TEST_HOSTID_PER_RANK"); h && std::string(h) == "1") {
    // Several ranks on one GPU: NCCL must see them as different hosts (socket transport over loopback).
    ::setenv("NCCL_HOSTID", ("bench-rank-" + std::to_string(env.rank)).c_str(), 1);
  }
  io.device = env.local_rank % devices;
  check_cuda(cudaSetDevice(io.device), "cudaSetDevice");
  c.dev = Device::cuda(io.device);
  c.table = bench::Table{{"mesh", "transition", "shape", "plan steps", "plan B", "bwd B", "moved B",
                          "lower bd B", "best seq B", "torch B", "time us [min-max]", "extra dev B",
                          "max(in,out) B", "host us [min-max]"}};
  return 0;
#else
  std::printf("bench_redistribution: built without NCCL/CUDA (bench_redistribution_cuda has the device "
              "mode), skipping\n");
  return 77;
#endif
}

int run(Ctx& c) {
  InitOptions io;
  if (const int rc = setup(c, io); rc != 0) {
    return rc == kValidated ? 0 : rc;
  }
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
    cases_2d(c, init_device_mesh<Mesh2>(c.world, 2), er, ec, ur, uc);
  }
  if (w == 8) {
    cases_3d(c, init_device_mesh<Mesh3>(c.world, 2, 2), er, ec, ur, uc);
  }
  if (w == 4) {
    // A plan that depends on a dynamic axis size (whether the all_reduce goes before the Shard/Replicate
    // change): the same transition on a mesh whose tp is dynamic (1 here, 2 nominally) and on one where it
    // is static; the rows must show the same plan and bytes.
    using Dyn = MeshShape<Axis<"x", 2>, Axis<"dp", 2>, Axis<"tp">>;
    using Fix = MeshShape<Axis<"x", 2>, Axis<"dp", 2>, Axis<"tp", 1>>;
    Runner<Dyn, L<P, S<0>, R>, L<R, R, S<1>>>::run(c, init_device_mesh<Dyn>(c.world), er, ec, " tp dynamic");
    Runner<Fix, L<P, S<0>, R>, L<R, R, S<1>>>::run(c, init_device_mesh<Fix>(c.world), er, ec, " tp static");
  }
  {
    // The same choice on a simulated (x=2, dp=8, tp=4) mesh (plan bytes only, no communication).
    using Dyn = MeshShape<Axis<"x", 2>, Axis<"dp">, Axis<"tp", 4>>;
    using Fix = MeshShape<Axis<"x", 2>, Axis<"dp", 8>, Axis<"tp", 4>>;
    using Src = L<P, S<0>, R>;
    using Dst = L<R, R, S<1>>;
    const MeshSizes sizes{2, 8, 4};
    const Extents global{er, ec};
    const auto nominal = plan_of<Dyn, 2, Src, Dst>();
    const MeshPlan<Dyn> chosen{detail::select_plan<Dyn, 2, Src, Dst>(sizes)};
    const auto fixed = plan_of<Fix, 2, Src, Dst>();
    if (c.world.rank() == 0) {
      std::printf(
          "dynamic dp on a simulated (x=2, dp=8, tp=4) mesh, [P,S(0),R]->[R,R,S(1)] of %lldx%lld float: "
          "bytes per rank %lld with the plan picked at run time (%s), %lld with dp static, %lld with "
          "the nominal dp=2 plan\n",
          static_cast<long long>(er), static_cast<long long>(ec),
          static_cast<long long>(chosen.bytes_per_rank(global, sizes)), chosen.to_string().c_str(),
          static_cast<long long>(fixed.bytes_per_rank(global, sizes)),
          static_cast<long long>(nominal.bytes_per_rank(global, sizes)));
    }
  }
  if (c.cuda() && w < 4) {
    // One GPU: the multi-axis case lists on (1, n) and (1, 1, n) meshes.
    cases_2d(c, init_device_mesh<Mesh2>(c.world, 1), er, ec, ur, uc);
    cases_3d(c, init_device_mesh<Mesh3>(c.world, 1, 1), er, ec, ur, uc);
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
    std::printf("redistribution on %s, %s tensors, %d processes (float32; bytes per rank; times: the "
                "slowest rank's median, min and max%s)\n",
                c.backend.c_str(), c.cuda() ? "CUDA" : "host", w,
                c.cuda() ? "; time ends each batch with a device sync; host us: the call alone, device idle "
                           "before it"
                         : "");
    c.table.print();
    if (w <= 4) {
      std::printf("\nuneven sizes on %s, %d processes: variable-size collectives (the executor) vs padding "
                  "to equal blocks + unpad copies (interleaved)\n",
                  c.backend.c_str(), w);
      c.uneven.print();
    }
    c.results.write(c.opt, std::string(c.cuda()             ? "redistribution_cuda_n"
                                       : c.backend == "mpi" ? "redistribution_mpi_n"
                                                            : "redistribution_n") +
                               std::to_string(w) + ".json");
  }
  if (!c.errors.empty()) {
    std::fprintf(stderr, "bench_redistribution: rank %d: %zu case(s) failed:\n", c.world.rank(),
                 c.errors.size());
    for (const auto& e : c.errors) {
      std::fprintf(stderr, "  %s\n", e.c_str());
    }
    return 1;
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
    std::fprintf(stderr, "bench_redistribution: %s\n", e.what());
    return 1;
  }
}

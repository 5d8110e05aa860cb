// Host overhead per call: the time spent in dtensor's own code per collective and per redistribute, outside
// the backend's communication.
//
//   build-bench/bench/bench_overhead [--scale S] [--smoke]        # one process, no launcher
//
// Method: a one-rank world (init_process_group without launcher variables: gloo, rank 0 of 1). On a group
// of one, the gloo backend runs no gloo algorithm (all_reduce, broadcast, barrier: nothing; all_gather,
// reduce_scatter, all_to_all: one memmove of the rank's own block), so a call's time is dtensor's code:
// argument checks, BufferRef/counts set-up, the backend adapter (op descriptor, sequence number, executor,
// completion object) and the wait. Tensors are tiny (16 floats) so copies cost a few ns. Each sample times
// 2000 back-to-back calls; the table gives the median ns per call (min-max over samples) and the heap
// allocations per call (replaced operator new). Redistributions run as rank 0 of a fake world of 4
// (backends/fake: every op completes at once, nothing is exchanged) on meshes (4), (2, 2) and (2, 2, 1), with
// the plan fixed at compile time: every step kind runs its geometry, staging and op set-up (on a mesh of one
// rank no step runs: an axis of size 1 costs nothing). The size-1 rows: [S(0),P] -> [S(0),R] on (4, 1), a
// static mesh (no step at compile time) and a dynamic one (the plan for the real sizes, looked up). The second method, ours minus raw
// gloo at 4 B in the collectives sweep (same run, 2 processes), is in BENCHMARKS.md. The exchange
// geometry and the cost model (bytes_per_rank) run on simulated meshes, next to their brute-force oracles.
// Writes bench/results/overhead.json.

#include "../../tests/support/exchange_reference.hpp"
#include "../common/harness.hpp"
#include <dtensor/testing/heap_counter.hpp>

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/ops/reduce.hpp>
#if DTENSOR_HAS_BLAS
#include <dtensor/ops/matmul.hpp>
#endif
#include <dtensor/tensor/distribute.hpp>

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

using namespace dtensor;

namespace {

struct Ctx {
  bench::Options opt;
  bench::Results results;
  bench::Table table{{"call", "ns per call [min-max]", "allocations per call", "lower bound"}};
  int calls = 2000;
  int samples = 15;
  std::string backend = "gloo";
  std::string method =
      "1-rank group/mesh: no gloo algorithm runs; time = dtensor front end + backend adapter";
};

template <class F>
void row(Ctx& c, const std::string& suite_name, const std::string& name, F&& f) {
  bench::SamplePlan p;
  p.warmup = c.opt.smoke ? 0 : 1;
  p.samples = bench::scaled(c.opt, c.samples);
  p.batch = c.opt.smoke ? 1 : c.calls;
  bench::Stats s = bench::measure(p, f);
  const std::int64_t a0 = dtensor::testing::heap::count();
  const int n = c.opt.smoke ? 1 : 100;
  for (int i = 0; i < n; ++i) {
    f();
  }
  const double allocs = double(dtensor::testing::heap::count() - a0) / n;
  bench::Stats ns{s.median * 1e3, s.min * 1e3, s.max * 1e3, s.samples};
  bench::Record r{"overhead", name, c.backend, 1, 64, s, "", {}, {}};
  r.add_str("kind", suite_name)
      .add_num("ns_per_call", ns.median)
      .add_num("ns_min", ns.min)
      .add_num("ns_max", ns.max)
      .add_num("allocations_per_call", allocs)
      .add_str("method", c.method);
  c.table.row({name, bench::num(ns.median) + " [" + bench::num(ns.min) + "-" + bench::num(ns.max) + "]",
               bench::fmt("%.1f", allocs), ""});
  c.results.add(std::move(r));
}

/// The lower bound of an asynchronous op on a host backend: hand a task to a waiting thread and wait
/// for its reply, with the mutex and condition variables the gloo backend's executor uses.
class ThreadHop {
public:
  ThreadHop()
      : worker_([this] {
          std::unique_lock lock(m_);
          for (;;) {
            cv_.wait(lock, [&] { return stop_ || asked_ > answered_; });
            if (stop_) {
              return;
            }
            answered_ = asked_;
            done_.notify_one();
          }
        }) {}
  ~ThreadHop() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_one();
    worker_.join();
  }
  void round_trip() {
    std::unique_lock lock(m_);
    ++asked_;
    cv_.notify_one();
    done_.wait(lock, [&] { return answered_ == asked_; });
  }

private:
  std::mutex m_;
  std::condition_variable cv_, done_;
  std::uint64_t asked_ = 0, answered_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

/// A row with a reference measured in the same run (interleaved samples).
template <class F, class G>
void row_vs(Ctx& c, const std::string& suite_name, const std::string& name, const std::string& ref_name,
            F&& f, G&& g) {
  bench::SamplePlan p;
  p.warmup = c.opt.smoke ? 0 : 1;
  p.samples = bench::scaled(c.opt, c.samples);
  p.batch = c.opt.smoke ? 1 : c.calls;
  const auto [s, ref] = bench::compare(p, f, g);
  bench::Record r{"overhead", name, "gloo", 1, 64, s, ref_name, ref, {}};
  r.add_str("kind", suite_name)
      .add_num("ns_per_call", s.median * 1e3)
      .add_num("ns_min", s.min * 1e3)
      .add_num("ns_max", s.max * 1e3)
      .add_num("ref_ns_per_call", ref.median * 1e3)
      .add_str("method", "1-rank group: no gloo algorithm runs; ref = " + ref_name);
  c.table.row(
      {name,
       bench::num(s.median * 1e3) + " [" + bench::num(s.min * 1e3) + "-" + bench::num(s.max * 1e3) + "]", "-",
       ref_name + ": " + bench::num(ref.median * 1e3) + " ns"});
  c.results.add(std::move(r));
}

template <class... P>
using L = Placements<P...>;

} // namespace

int main(int argc, char** argv) {
  Ctx c;
  c.opt = bench::parse_options(argc, argv);
  InitOptions io;
  io.backend = "gloo";
  ProcessGroup world = init_process_group(io);
  if (world.size() != 1) {
    std::fprintf(stderr, "bench_overhead runs as one process (no launcher)\n");
    return 2;
  }
  auto t = Tensor<float, 1>::full({16}, 1.0f);
  auto t2 = Tensor<float, 1>::full({16}, 1.0f);
  std::vector<Tensor<float, 1>> list{Tensor<float, 1>::full({16}, 1.0f)};

  row(c, "collective", "all_reduce", [&] { all_reduce(t, ReduceOp::sum, world); });
  row(c, "collective", "broadcast", [&] { broadcast(t, 0, world); });
  row(c, "collective", "reduce", [&] { reduce(t, 0, ReduceOp::sum, world); });
  row(c, "collective", "all_gather_into_tensor", [&] { all_gather_into_tensor(t2, t, world); });
  row(c, "collective", "reduce_scatter_tensor", [&] { reduce_scatter_tensor(t2, t, ReduceOp::sum, world); });
  row(c, "collective", "all_to_all_single", [&] { all_to_all_single(t2, t, world); });
  row(c, "collective", "gather (list)", [&] { gather(t, &list, 0, world); });
  row(c, "collective", "barrier", [&] { barrier(world); });
  {
    ThreadHop hop;
    row_vs(
        c, "collective", "all_reduce async + wait", "thread round trip (condvar)",
        [&] { all_reduce(t, ReduceOp::sum, world, async_op).wait(); }, [&] { hop.round_trip(); });
  }

  using M1 = MeshShape<Axis<"x">>;
  using M2 = MeshShape<Axis<"dp">, Axis<"tp">>;
  using M3 = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>;
  auto m1 = init_device_mesh<M1>(world);
  const auto full = Tensor<float, 2>::full({4, 4}, 1.0f);
  {
    // Rank 0 of a fake world of 4: the steps run; the backend completes each op at once.
    const ProcessGroup four = fake_world(0, 4);
    c.backend = "fake";
    c.method = "rank 0 of a fake world of 4: every step's geometry, staging and op set-up run, the backend "
               "completes at once; time = dtensor's code";
    auto f1 = init_device_mesh<M1>(four);
    auto f2 = init_device_mesh<M2>(four, 2);
    auto f3 = init_device_mesh<M3>(four, 2, 2);
    auto s0 = distribute_tensor<Shard<0>>(f1, full, replicated_source);
    auto r1 = distribute_tensor<Replicate>(f1, full, replicated_source);
    auto p1 = distribute_tensor<Partial<>>(f1, full, replicated_source);
    auto s01 = distribute_tensor<Shard<0>, Shard<1>>(f2, full, replicated_source);
    auto s00 = distribute_tensor<Shard<0>, Shard<0>>(f2, full, replicated_source);
    auto s010 = distribute_tensor<Shard<0>, Shard<1>, Replicate>(f3, full, replicated_source);

    row(c, "redistribute", "[S(0)]->[S(0)] (no step)", [&] { auto y = s0.redistribute<Shard<0>>(); });
    row(c, "redistribute", "[S(0)]->[R] all_gather", [&] { auto y = s0.redistribute<Replicate>(); });
    row(c, "redistribute", "[R]->[S(0)] local_chunk", [&] { auto y = r1.redistribute<Shard<0>>(); });
    row(c, "redistribute", "[S(0)]->[S(1)] all_to_all", [&] { auto y = s0.redistribute<Shard<1>>(); });
    row(c, "redistribute", "[P]->[R] all_reduce", [&] { auto y = p1.redistribute<Replicate>(); });
    row(c, "redistribute", "[P]->[S(0)] reduce_scatter", [&] { auto y = p1.redistribute<Shard<0>>(); });
    row(c, "redistribute", "[S(0),S(1)]->[S(1),S(0)] permute",
        [&] { auto y = s01.redistribute<Shard<1>, Shard<0>>(); });
    row(c, "redistribute", "[S(0),S(0)]->[S(1),S(1)] flat all_to_all",
        [&] { auto y = s00.redistribute<Shard<1>, Shard<1>>(); });
    row(c, "redistribute", "[S(0),S(1)]->[R,R] 2x all_gather",
        [&] { auto y = s01.redistribute<Replicate, Replicate>(); });
    row(c, "redistribute", "3-axis [S(0),S(1),R]->[S(1),S(0),R]",
        [&] { auto y = s010.redistribute<Shard<1>, Shard<0>, Replicate>(); });

    // An axis of size 1: [S(0),P] -> [S(0),R] on (4, 1) is no step (torch's test_one_chunk_mesh).
    using Static = MeshShape<Axis<"a", 4>, Axis<"b", 1>>;
    auto st = distribute_tensor<Shard<0>, Partial<>>(init_device_mesh<Static>(four), full, replicated_source);
    auto dy = distribute_tensor<Shard<0>, Partial<>>(init_device_mesh<M2>(four, 4), full, replicated_source);
    row(c, "redistribute", "[S(0),P]->[S(0),R] on (4,1) static (no step)",
        [&] { auto y = st.redistribute<Shard<0>, Replicate>(); });
    row(c, "redistribute", "[S(0),P]->[S(0),R] on (4,1) dynamic (no step)",
        [&] { auto y = dy.redistribute<Shard<0>, Replicate>(); });
    c.backend = "gloo";
    c.method = "1-rank group/mesh: no gloo algorithm runs; time = dtensor front end + backend adapter";
  }

  // Ops on DTensors next to their local kernel on the same local tensors, interleaved: the difference is
  // what the sharded op adds on the host (its placement rule is decided at compile time).
  {
    const auto a = distribute_tensor<Shard<0>>(m1, Tensor<float, 2>::full({64, 64}, 1.5f), replicated_source);
    const auto pa =
        distribute_tensor<Partial<>>(m1, Tensor<float, 2>::full({64, 64}, 1.5f), replicated_source);
    row_vs(
        c, "op", "relu [S(0)] 64x64", "local::map(Relu)", [&] { auto y = relu(a); },
        [&] { auto y = local::map(local::Relu{}, a.local()); });
    row_vs(
        c, "op", "add [P] + [P] 64x64", "local::map(Add)", [&] { auto y = add(pa, pa); },
        [&] { auto y = local::map(local::Add{}, pa.local(), pa.local()); });
    row_vs(
        c, "op", "sum<1> [S(0)] 64x64", "local::reduce(sum)", [&] { auto y = sum<1>(a); },
        [&] { auto y = local::reduce(ReduceOp::sum, a.local(), 1); });
#if DTENSOR_HAS_BLAS
    const auto w = distribute_tensor<Shard<1>>(m1, Tensor<float, 2>::full({64, 64}, 0.5f), replicated_source);
    const auto x =
        distribute_tensor<Replicate>(m1, Tensor<float, 2>::full({64, 64}, 1.0f), replicated_source);
    row_vs(
        c, "op", "matmul [R] x [S(1)] 64x64x64", "local::matmul", [&] { auto y = matmul(x, w); },
        [&] { auto y = local::matmul(x.local(), w.local()); });
#endif
  }

  // Exchange geometry on simulated meshes (no communication): the pieces one rank sends and receives in
  // the permute of [R,S(1),S(2)] -> [S(0),S(2),S(1)], next to the brute force over every group member.
  for (const MeshSizes& sizes : {MeshSizes{4, 4, 4}, MeshSizes{16, 8, 8}, MeshSizes{16, 16, 16}}) {
    const Plan plan =
        make_plan(PlacementList{Placement::replicate(), Placement::shard(1), Placement::shard(2)},
                  PlacementList{Placement::shard(0), Placement::shard(2), Placement::shard(1)}, 3);
    const Step& st = plan.steps[plan.size() - 1];
    const Extents global{4096, 4096, 4096};
    const MeshCoord me = rank_to_coord(mesh_numel(sizes) / 2 + 1, sizes);
    std::vector<Piece> sends, recvs;
    const int saved = c.calls;
    c.calls = c.opt.smoke ? 1 : 50;
    row_vs(
        c, "exchange_geometry",
        "exchange geometry, group of " + std::to_string(group_size(st.axes, sizes)) + " (" +
            std::string(to_string(st.kind)) + ")",
        "brute force over the group", [&] { exchange_pieces(st, global, sizes, me, sends, recvs); },
        [&] { test_support::reference_pieces(st, global, sizes, me, sends, recvs); });
    c.calls = saved;
  }

  // The cost model on a simulated (8, 16, 8) mesh: bytes_per_rank in closed form (the product of each
  // component's axes' sizes at most) next to the oracle that finds every rank's pieces, one call each.
  {
    const MeshSizes sizes{8, 16, 8};
    const Extents global{4096, 4096, 4096};
    const Placement r = Placement::replicate();
    auto s = [](int d) { return Placement::shard(d); };
    const Plan permute = make_plan(PlacementList{r, s(1), s(2)}, PlacementList{s(0), s(2), s(1)}, 3);
    const Plan a2a = make_plan(PlacementList{s(0), s(0), s(0)}, PlacementList{s(1), s(1), s(1)}, 3);
    // Every axis moves to another dim: one component of all three axes (1,024 coordinates).
    const Plan rotate = make_plan(PlacementList{s(0), s(1), s(2)}, PlacementList{s(1), s(2), s(0)}, 3);
    const int saved_calls = c.calls;
    const int saved_samples = c.samples;
    c.calls = 1;
    c.samples = 9;
    for (const Plan* plan : {&permute, &rotate, &a2a}) {
      const Step& st = plan->steps[plan->size() - 1];
      std::int64_t ours = 0;
      std::int64_t ref = 0;
      row_vs(
          c, "cost_model",
          "bytes_per_rank (8,16,8) " + std::string(to_string(st.kind)) + " " + to_string(plan->src) + "->" +
              to_string(plan->dst),
          "oracle: every rank's pieces", [&] { ours = bytes_per_rank(*plan, global, sizes, 4); },
          [&] { ref = test_support::reference_bytes_per_rank(*plan, global, sizes, 4); });
      if (ours != ref) {
        std::fprintf(stderr, "bytes_per_rank: closed form %lld, oracle %lld\n", static_cast<long long>(ours),
                     static_cast<long long>(ref));
        return 1;
      }
    }
    c.calls = saved_calls;
    c.samples = saved_samples;
  }

  std::printf(
      "host overhead per call (collectives: 1-rank gloo group; redistributions: rank 0 of a fake world "
      "of 4; no communication; float32, 16 elements)\n");
  c.table.print();
  c.results.write(c.opt, "overhead.json");
  return 0;
}

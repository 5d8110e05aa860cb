// Collectives sweep on MPI, nccl-tests style: every collective through dtensor's front end on the MPI
// backend (ours) next to the same operation called directly through MPI (raw: the blocking call on a
// communicator of its own), and next to dtensor's gloo backend in the same processes, interleaved sample
// by sample.
//
//   mpirun -np 4 build/bench/bench_collectives_mpi [--scale S] [--smoke] [--passes K] [op ...]
//
// Sizes, bytes, algbw and busbw as bench_collectives (nccl-tests' sizes and bus factors, float32). Times
// are the slowest rank's: each rank's median (and min, max) over its samples, the largest over ranks,
// because a rooted op (broadcast, reduce, gather, scatter) completes at different times on different
// ranks and a blocking call and a non-blocking one wait for different things on the root. `ours/raw` is
// the ratio of those (goal <= 1.05 from 64 KiB); `paired` is the median over ranks of each rank's paired
// ratio. `raw MPI_I*` is MPI's non-blocking call waited for at once (MPI_Iallreduce + MPI_Wait, ...), what
// the backend runs: ours against it is dtensor's own cost, ours against the blocking call also the
// difference between MPI's blocking and non-blocking algorithms (OpenMPI: coll/tuned vs coll/libnbc).
// `gloo/ours` is how many times longer dtensor's gloo backend takes than its MPI backend for the same
// call (both through dtensor's front end, paired the same way).
// Writes bench/results/collectives_mpi_n<ranks>.json.

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/comm/p2p.hpp>

#include <mpi.h>

#include "../common/harness.hpp"
#include "sweep.hpp"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

using bench::sweep::Extent;
using bench::sweep::extent_of;
using bench::sweep::Op;
using bench::sweep::plan_for;
using bench::sweep::selected;

/// The same call on one of dtensor's groups (the MPI one or the gloo one).
std::function<void()> ours_call(const std::string& name, const ProcessGroup& g, Tensor<float, 1>& big,
                                Tensor<float, 1>& big2, Tensor<float, 1>& small,
                                std::vector<Tensor<float, 1>>& list, int rank, int next, int prev) {
  if (name == "all_reduce") {
    return [&] { all_reduce(big, ReduceOp::sum, g); };
  }
  if (name == "reduce") {
    return [&] { reduce(big, 0, ReduceOp::sum, g); };
  }
  if (name == "broadcast") {
    return [&] { broadcast(big, 0, g); };
  }
  if (name == "all_gather") {
    return [&] { all_gather_into_tensor(big, small, g); };
  }
  if (name == "reduce_scatter") {
    return [&] { reduce_scatter_tensor(small, big, ReduceOp::sum, g); };
  }
  if (name == "all_to_all") {
    return [&] { all_to_all_single(big2, big, g); };
  }
  if (name == "gather") {
    return [&, rank] { gather(small, rank == 0 ? &list : nullptr, 0, g); };
  }
  if (name == "scatter") {
    return [&, rank] {
      static const std::vector<Tensor<float, 1>> none;
      scatter(small, rank == 0 ? list : none, 0, g);
    };
  }
  return [&, next, prev] { // sendrecv: a ring, send to rank+1 and receive from rank-1 in one batch
    std::vector<P2POp> p2p{P2POp(P2POp::irecv, big2, prev, g), P2POp(P2POp::isend, big, next, g)};
    for (auto& w : batch_isend_irecv(p2p)) {
      w.wait();
    }
  };
}

/// The slowest rank's view of `s`: the largest median, min and max over ranks, and the median over ranks
/// of the paired ratio (collective over `comm`).
bench::Stats slowest(bench::Stats s, MPI_Comm comm) {
  double mine[3] = {s.median, s.min, s.max};
  double most[3] = {0, 0, 0};
  MPI_Allreduce(mine, most, 3, MPI_DOUBLE, MPI_MAX, comm);
  int n = 1;
  MPI_Comm_size(comm, &n);
  std::vector<double> paired(static_cast<std::size_t>(n));
  MPI_Allgather(&s.paired_ratio, 1, MPI_DOUBLE, paired.data(), 1, MPI_DOUBLE, comm);
  s.median = most[0];
  s.min = most[1];
  s.max = most[2];
  s.paired_ratio = bench::stats_of(std::move(paired)).median;
  return s;
}

} // namespace

int main(int argc, char** argv) {
  bench::Options opt = bench::parse_options(argc, argv);
  const int passes = bench::sweep::take_passes(opt);
  InitOptions io;
  io.backend = "mpi";
  ProcessGroup world = init_process_group(io);
  io.backend = "gloo";
  ProcessGroup gloo = init_process_group(io);
  const int rank = world.rank();
  const int n = world.size();
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);

  const double f1 = n > 1 ? double(n - 1) / n : 0.0;
  const std::vector<Op> ops = {{"all_reduce", 2 * f1}, {"reduce", 1},          {"broadcast", 1},
                               {"all_gather", f1},     {"reduce_scatter", f1}, {"all_to_all", f1},
                               {"gather", f1},         {"scatter", f1},        {"sendrecv", 1}};
  std::vector<std::int64_t> sizes;
  for (std::int64_t b = 4; b <= (opt.smoke ? 1024 : opt.max_bytes); b *= 4) {
    sizes.push_back(b);
  }

  bench::Results results;
  bench::Table table({"op", "bytes", "ours us [min-max]", "raw MPI us [min-max]", "ours/raw", "paired",
                      "raw MPI_I* us", "ours/raw_I*", "paired", "gloo us", "gloo/ours", "busbw GB/s"});
  const int next = (rank + 1) % n;
  const int prev = (rank - 1 + n) % n;
  struct Row {
    std::vector<bench::Stats> ours, raw, ours3, raw_nb, ours2, gloo;
  };
  std::map<std::pair<std::size_t, std::size_t>, Row> measured;
  for (int pass = 0; pass < passes; ++pass) {
    for (std::size_t oi = 0; oi < ops.size(); ++oi) {
      const std::string name = ops[oi].name;
      if ((name == "sendrecv" && n < 2) || !selected(opt, name)) {
        continue;
      }
      for (std::size_t si = 0; si < sizes.size(); ++si) {
        const Extent e = extent_of(name, sizes[si], n);
        const std::int64_t block = e.block;
        const std::int64_t elems = e.elems;
        auto big = Tensor<float, 1>::full({elems}, 1.0f);
        auto big2 = Tensor<float, 1>::full({elems}, 1.0f);
        auto small = Tensor<float, 1>::full({block}, 1.0f);
        std::vector<Tensor<float, 1>> list;
        for (int i = 0; i < n; ++i) {
          list.push_back(Tensor<float, 1>::full({block}, 1.0f));
        }
        float* bp = big.data();
        float* bp2 = big2.data();
        float* sp = small.data();
        const int ne = static_cast<int>(elems);
        const int nb = static_cast<int>(block);
        // The same op as MPI's non-blocking call waited for at once (what the MPI backend runs).
        MPI_Request req = MPI_REQUEST_NULL;
        std::function<void()> raw_nb_call;
        const auto done = [&] { MPI_Wait(&req, MPI_STATUS_IGNORE); };
        if (name == "all_reduce") {
          raw_nb_call = [&] {
            MPI_Iallreduce(MPI_IN_PLACE, bp, ne, MPI_FLOAT, MPI_SUM, raw, &req);
            done();
          };
        } else if (name == "reduce") {
          raw_nb_call = [&] {
            MPI_Ireduce(rank == 0 ? MPI_IN_PLACE : bp, rank == 0 ? bp : nullptr, ne, MPI_FLOAT, MPI_SUM, 0,
                        raw, &req);
            done();
          };
        } else if (name == "broadcast") {
          raw_nb_call = [&] {
            MPI_Ibcast(bp, ne, MPI_FLOAT, 0, raw, &req);
            done();
          };
        } else if (name == "all_gather") {
          raw_nb_call = [&] {
            MPI_Iallgather(sp, nb, MPI_FLOAT, bp, nb, MPI_FLOAT, raw, &req);
            done();
          };
        } else if (name == "reduce_scatter") {
          raw_nb_call = [&] {
            MPI_Ireduce_scatter_block(bp, sp, nb, MPI_FLOAT, MPI_SUM, raw, &req);
            done();
          };
        } else if (name == "all_to_all") {
          raw_nb_call = [&] {
            MPI_Ialltoall(bp, nb, MPI_FLOAT, bp2, nb, MPI_FLOAT, raw, &req);
            done();
          };
        } else if (name == "gather") {
          raw_nb_call = [&] {
            MPI_Igather(sp, nb, MPI_FLOAT, bp, nb, MPI_FLOAT, 0, raw, &req);
            done();
          };
        } else if (name == "scatter") {
          raw_nb_call = [&] {
            MPI_Iscatter(bp, nb, MPI_FLOAT, sp, nb, MPI_FLOAT, 0, raw, &req);
            done();
          };
        } else {
          raw_nb_call = [&] {
            MPI_Request r[2];
            MPI_Irecv(bp2, ne, MPI_FLOAT, prev, 7, raw, &r[0]);
            MPI_Isend(bp, ne, MPI_FLOAT, next, 7, raw, &r[1]);
            MPI_Waitall(2, r, MPI_STATUSES_IGNORE);
          };
        }
        std::function<void()> raw_call;
        if (name == "all_reduce") {
          raw_call = [&] { MPI_Allreduce(MPI_IN_PLACE, bp, ne, MPI_FLOAT, MPI_SUM, raw); };
        } else if (name == "reduce") {
          raw_call = [&] {
            MPI_Reduce(rank == 0 ? MPI_IN_PLACE : bp, rank == 0 ? bp : nullptr, ne, MPI_FLOAT, MPI_SUM, 0,
                       raw);
          };
        } else if (name == "broadcast") {
          raw_call = [&] { MPI_Bcast(bp, ne, MPI_FLOAT, 0, raw); };
        } else if (name == "all_gather") {
          raw_call = [&] { MPI_Allgather(sp, nb, MPI_FLOAT, bp, nb, MPI_FLOAT, raw); };
        } else if (name == "reduce_scatter") {
          raw_call = [&] { MPI_Reduce_scatter_block(bp, sp, nb, MPI_FLOAT, MPI_SUM, raw); };
        } else if (name == "all_to_all") {
          raw_call = [&] { MPI_Alltoall(bp, nb, MPI_FLOAT, bp2, nb, MPI_FLOAT, raw); };
        } else if (name == "gather") {
          raw_call = [&] { MPI_Gather(sp, nb, MPI_FLOAT, bp, nb, MPI_FLOAT, 0, raw); };
        } else if (name == "scatter") {
          raw_call = [&] { MPI_Scatter(bp, nb, MPI_FLOAT, sp, nb, MPI_FLOAT, 0, raw); };
        } else {
          raw_call = [&] {
            MPI_Sendrecv(bp, ne, MPI_FLOAT, next, 7, bp2, ne, MPI_FLOAT, prev, 7, raw, MPI_STATUS_IGNORE);
          };
        }
        const auto ours = ours_call(name, world, big, big2, small, list, rank, next, prev);
        const auto on_gloo = ours_call(name, gloo, big, big2, small, list, rank, next, prev);
        const bench::SamplePlan plan = plan_for(opt, elems * 4);
        const auto [a, b] = bench::compare(plan, ours, raw_call);
        const auto [e3, f3] = bench::compare(plan, ours, raw_nb_call);
        const auto [c, d] = bench::compare(plan, ours, on_gloo);
        Row& row = measured[{oi, si}];
        row.ours.push_back(slowest(a, raw));
        row.raw.push_back(slowest(b, raw));
        row.ours3.push_back(slowest(e3, raw));
        row.raw_nb.push_back(slowest(f3, raw));
        row.ours2.push_back(slowest(c, raw));
        row.gloo.push_back(slowest(d, raw));
      }
    }
  }
  for (const auto& [key, row] : measured) {
    const Op& op = ops[key.first];
    const std::string name = op.name;
    const std::int64_t nominal = sizes[key.second];
    const std::int64_t bytes = extent_of(name, nominal, n).elems * 4;
    const bench::Stats s_ours = bench::combine_passes(row.ours);
    const bench::Stats s_raw = bench::combine_passes(row.raw);
    const bench::Stats s_ours3 = bench::combine_passes(row.ours3);
    const bench::Stats s_raw_nb = bench::combine_passes(row.raw_nb);
    const bench::Stats s_ours2 = bench::combine_passes(row.ours2);
    const bench::Stats s_gloo = bench::combine_passes(row.gloo);
    const double algbw = bytes / (s_ours.median * 1e-6) / 1e9;
    const double busbw = algbw * op.bus_factor;
    // gloo/ours: gloo's time over ours, paired within the second comparison (its paired_ratio is ours/gloo).
    const double gloo_factor = 1.0 / s_ours2.paired_ratio;
    bench::Record r{"collectives", name, "mpi", n, bytes, s_ours, "mpi_raw", s_raw, {}};
    r.add_num("nominal_bytes", double(nominal))
        .add_num("algbw_GBps", algbw)
        .add_num("busbw_GBps", busbw)
        .add_num("ref_busbw_GBps", bytes / (s_raw.median * 1e-6) / 1e9 * op.bus_factor)
        .add_num("bus_factor", op.bus_factor)
        .add_num("raw_nonblocking_us", s_raw_nb.median)
        .add_num("raw_nonblocking_min_us", s_raw_nb.min)
        .add_num("raw_nonblocking_max_us", s_raw_nb.max)
        .add_num("ratio_nonblocking", s_ours3.median / s_raw_nb.median)
        .add_num("paired_ratio_nonblocking", s_ours3.paired_ratio)
        .add_num("gloo_us", s_gloo.median)
        .add_num("gloo_min_us", s_gloo.min)
        .add_num("gloo_max_us", s_gloo.max)
        .add_num("gloo_over_ours", gloo_factor)
        .add_str("dtype", "float32")
        .add_str("time_of", "slowest rank")
        .add_num("passes", double(passes));
    table.row({name, bench::size_string(bytes), bench::range(s_ours), bench::range(s_raw),
               bench::fmt("%.3f", r.ratio()), bench::fmt("%.3f", s_ours.paired_ratio), bench::range(s_raw_nb),
               bench::fmt("%.3f", s_ours3.median / s_raw_nb.median), bench::fmt("%.3f", s_ours3.paired_ratio),
               bench::fmt("%.1f", s_gloo.median), bench::fmt("%.2f", gloo_factor),
               bench::fmt("%.4f", busbw)});
    results.add(std::move(r));
  }
  if (rank == 0) {
    std::printf("collectives on MPI, %d processes (float32; the slowest rank's times; ours = dtensor's MPI "
                "backend, raw = "
                "MPI's blocking call, gloo = dtensor's gloo backend in the same processes, interleaved)\n",
                n);
    table.print();
    results.write(opt, "collectives_mpi_n" + std::to_string(n) + ".json");
  }
  barrier(world);
  MPI_Comm_free(&raw);
  return 0;
}

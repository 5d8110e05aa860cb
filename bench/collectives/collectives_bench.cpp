// Collectives sweep, nccl-tests style: every collective through dtensor's front end (ours) next to the same
// operation called directly through gloo's API (raw) in the same run, interleaved sample by sample.
//
//   dtensor-run --standalone --nproc-per-node 4 build-bench/bench/bench_collectives [--scale S] [--smoke]
//                                                                       [--passes K] [op ...]
//
// Sizes go from 4 B to 16 MiB in x4 steps; `bytes` is nccl-tests' size (all_reduce, reduce, broadcast: the
// buffer; all_gather, gather: the gathered output; reduce_scatter, scatter: the input; all_to_all: one
// rank's send buffer; sendrecv: the message), float32, with at least one element per block (so the
// smallest sizes of the blocked ops are a few bytes larger than the nominal size; `bytes` says how many).
// algbw = bytes / time, busbw = algbw * nccl-tests' factor (all_reduce 2(n-1)/n; all_gather,
// reduce_scatter, all_to_all, gather, scatter (n-1)/n; broadcast, reduce, sendrecv 1). Rank 0's times.
// sendrecv's raw reuses two unbound buffers across calls; sendrecv_fresh is the same ring with raw making
// them per call, as gloo's own collectives and torch's ProcessGroupGloo send/recv do.
// Writes bench/results/collectives_gloo_n<ranks>.json.

#include <dtensor/backends/gloo/rendezvous.hpp>
#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/comm/p2p.hpp>
#include <dtensor/core/timeout.hpp>
#include <dtensor/rendezvous/prefix_store.hpp>
#include <dtensor/rendezvous/tcp_store.hpp>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>

#include "../common/harness.hpp"
#include "sweep.hpp"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

using bench::sweep::Extent;
using bench::sweep::extent_of;
using bench::sweep::Op;
using bench::sweep::plan_for;
using bench::sweep::selected;

/// A raw gloo context over the job's store (its own key prefix), like any gloo user would make one.
std::shared_ptr<::gloo::rendezvous::Context> raw_context(const std::shared_ptr<TcpStore>& store,
                                                         std::shared_ptr<::gloo::transport::Device> dev,
                                                         int rank, int size, const std::string& prefix) {
  GlooStoreAdapter gs(std::make_shared<PrefixStore>(prefix, store));
  auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(kDefaultOpTimeout); // the limit a dtensor group has by default
  ctx->connectFullMesh(gs, dev);
  return ctx;
}

const auto kSum = static_cast<void (*)(void*, const void*, const void*, size_t)>(&::gloo::sum<float>);

} // namespace

int main(int argc, char** argv) {
  bench::Options opt = bench::parse_options(argc, argv);
  const int passes = bench::sweep::take_passes(opt);
  const DistEnv env = read_dist_env();
  auto store = connect_store(env, kDefaultStoreTimeout);
  InitOptions io;
  io.store = store;
  io.backend = "gloo";
  ProcessGroup world = init_process_group(io);
  const int rank = world.rank();
  const int n = world.size();

  ::gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto dev = ::gloo::transport::tcp::CreateDevice(attr);
  auto ctx = raw_context(store, dev, rank, n, "bench/raw");
  // ReduceScatterHalvingDoubling gets a context of its own: it slows a context down for the ops after it
  // (see backends/gloo/backend.hpp), which would bias every later raw row.
  auto ctx_rs = raw_context(store, dev, rank, n, "bench/raw_rs");
  std::uint32_t tag = 1;
  auto next_tag = [&] { return tag = (tag + 1) & 0xFFFFFF; };

  const double f1 = n > 1 ? double(n - 1) / n : 0.0;
  const std::vector<Op> ops = {
      {"all_reduce", 2 * f1}, {"reduce", 1},  {"broadcast", 1}, {"all_gather", f1}, {"reduce_scatter", f1},
      {"all_to_all", f1},     {"gather", f1}, {"scatter", f1},  {"sendrecv", 1},    {"sendrecv_fresh", 1}};
  std::vector<std::int64_t> sizes;
  for (std::int64_t b = 4; b <= (opt.smoke ? 1024 : opt.max_bytes); b *= 4) {
    sizes.push_back(b);
  }

  bench::Results results;
  bench::Table table({"op", "bytes", "ours us [min-max]", "raw gloo us [min-max]", "ours/raw", "paired",
                      "algbw GB/s", "busbw GB/s"});
  const int next = (rank + 1) % n;
  const int prev = (rank - 1 + n) % n;

  // Per row (op, size): the stats of each pass, ours and raw.
  std::map<std::pair<std::size_t, std::size_t>,
           std::pair<std::vector<bench::Stats>, std::vector<bench::Stats>>>
      measured;
  for (int pass = 0; pass < passes; ++pass) {
    for (std::size_t oi = 0; oi < ops.size(); ++oi) {
      const Op& op = ops[oi];
      const std::string name = op.name;
      if ((name.starts_with("sendrecv") && n < 2) || !selected(opt, name)) {
        continue;
      }
      for (std::size_t si = 0; si < sizes.size(); ++si) {
        const Extent e = extent_of(name, sizes[si], n);
        const std::int64_t block = e.block;
        const std::int64_t elems = e.elems;
        const std::int64_t bytes = elems * 4;
        std::function<void()> ours;
        std::function<void()> raw;
        // Buffers (allocated once per size; contents do not matter for timing).
        auto big = Tensor<float, 1>::full({elems}, 1.0f);
        auto big2 = Tensor<float, 1>::full({elems}, 1.0f);
        auto small = Tensor<float, 1>::full({block}, 1.0f);
        std::vector<Tensor<float, 1>> list;
        for (int i = 0; i < n; ++i) {
          list.push_back(Tensor<float, 1>::full({block}, 1.0f));
        }
        std::unique_ptr<::gloo::ReduceScatterHalvingDoubling<float>> rs;
        std::unique_ptr<::gloo::transport::UnboundBuffer> ub_send, ub_recv;
        float* bp = big.data();
        float* bp2 = big2.data();
        float* sp = small.data();

        if (name == "all_reduce") {
          ours = [&] { all_reduce(big, ReduceOp::sum, world); };
          raw = [&] {
            ::gloo::AllreduceOptions o(ctx);
            o.setOutput(bp, static_cast<size_t>(elems));
            o.setAlgorithm(::gloo::AllreduceOptions::Algorithm::RING);
            o.setReduceFunction(kSum);
            o.setTag(next_tag());
            ::gloo::allreduce(o);
          };
        } else if (name == "reduce") {
          ours = [&] { reduce(big, 0, ReduceOp::sum, world); };
          raw = [&] {
            ::gloo::ReduceOptions o(ctx);
            o.setOutput(bp, static_cast<size_t>(elems));
            o.setRoot(0);
            o.setReduceFunction(kSum);
            o.setTag(next_tag());
            ::gloo::reduce(o);
          };
        } else if (name == "broadcast") {
          ours = [&] { broadcast(big, 0, world); };
          raw = [&] {
            ::gloo::BroadcastOptions o(ctx);
            o.setOutput(bp, static_cast<size_t>(elems));
            o.setRoot(0);
            o.setTag(next_tag());
            ::gloo::broadcast(o);
          };
        } else if (name == "all_gather") {
          ours = [&] { all_gather_into_tensor(big, small, world); };
          raw = [&] {
            ::gloo::AllgatherOptions o(ctx);
            o.setInput(sp, static_cast<size_t>(block));
            o.setOutput(bp, static_cast<size_t>(elems));
            o.setTag(next_tag());
            ::gloo::allgather(o);
          };
        } else if (name == "reduce_scatter") {
          ours = [&] { reduce_scatter_tensor(small, big, ReduceOp::sum, world); };
          rs = std::make_unique<::gloo::ReduceScatterHalvingDoubling<float>>(
              ctx_rs, std::vector<float*>{bp2}, static_cast<int>(elems), std::vector<int>(n, int(block)));
          raw = [&] { rs->run(); };
        } else if (name == "all_to_all") {
          ours = [&] { all_to_all_single(big2, big, world); };
          raw = [&] {
            ::gloo::AlltoallOptions o(ctx);
            o.setInput(bp, static_cast<size_t>(elems));
            o.setOutput(bp2, static_cast<size_t>(elems));
            o.setTag(next_tag());
            ::gloo::alltoall(o);
          };
        } else if (name == "gather") {
          ours = [&] { gather(small, rank == 0 ? &list : nullptr, 0, world); };
          raw = [&] {
            ::gloo::GatherOptions o(ctx);
            o.setInput(sp, static_cast<size_t>(block));
            if (rank == 0) {
              o.setOutput(bp, static_cast<size_t>(elems));
            }
            o.setRoot(0);
            o.setTag(next_tag());
            ::gloo::gather(o);
          };
        } else if (name == "scatter") {
          const std::vector<Tensor<float, 1>> none;
          ours = [&, none] { scatter(small, rank == 0 ? list : none, 0, world); };
          raw = [&] {
            ::gloo::ScatterOptions o(ctx);
            if (rank == 0) {
              std::vector<float*> ptrs;
              for (int i = 0; i < n; ++i) {
                ptrs.push_back(bp + i * block);
              }
              o.setInputs(ptrs, static_cast<size_t>(block));
            }
            o.setOutput(sp, static_cast<size_t>(block));
            o.setRoot(0);
            o.setTag(next_tag());
            ::gloo::scatter(o);
          };
        } else if (name.starts_with("sendrecv")) { // ring: send to rank+1, receive from rank-1
          ours = [&] {
            std::vector<P2POp> p2p{P2POp(P2POp::irecv, big2, prev, world),
                                   P2POp(P2POp::isend, big, next, world)};
            for (auto& w : batch_isend_irecv(p2p)) {
              w.wait();
            }
          };
          if (name == "sendrecv") { // raw: two unbound buffers made once and reused by every call
            ub_send = ctx->createUnboundBuffer(bp, static_cast<size_t>(bytes));
            ub_recv = ctx->createUnboundBuffer(bp2, static_cast<size_t>(bytes));
          }
          raw = [&, fresh = name == "sendrecv_fresh"] {
            // sendrecv_fresh: raw makes its buffers per call, as gloo's own collectives (and torch's
            // ProcessGroupGloo send/recv) do.
            if (fresh) {
              ub_send = ctx->createUnboundBuffer(bp, static_cast<size_t>(bytes));
              ub_recv = ctx->createUnboundBuffer(bp2, static_cast<size_t>(bytes));
            }
            const std::uint64_t slot = next_tag();
            ub_recv->recv(prev, slot);
            ub_send->send(next, slot);
            ub_recv->waitRecv();
            ub_send->waitSend();
          };
        }

        const auto [pass_ours, pass_raw] = bench::compare(plan_for(opt, bytes), ours, raw);
        measured[{oi, si}].first.push_back(pass_ours);
        measured[{oi, si}].second.push_back(pass_raw);
      }
    }
  }
  for (const auto& [key, row] : measured) {
    const Op& op = ops[key.first];
    const std::string name = op.name;
    const std::int64_t nominal = sizes[key.second];
    const std::int64_t bytes = extent_of(name, nominal, n).elems * 4;
    const bench::Stats s_ours = bench::combine_passes(row.first);
    const bench::Stats s_raw = bench::combine_passes(row.second);
    const double algbw = bytes / (s_ours.median * 1e-6) / 1e9;
    const double busbw = algbw * op.bus_factor;
    bench::Record r{"collectives", name, "gloo", n, bytes, s_ours, "gloo_raw", s_raw, {}};
    r.add_num("nominal_bytes", double(nominal))
        .add_num("algbw_GBps", algbw)
        .add_num("busbw_GBps", busbw)
        .add_num("ref_busbw_GBps", bytes / (s_raw.median * 1e-6) / 1e9 * op.bus_factor)
        .add_num("bus_factor", op.bus_factor)
        .add_str("dtype", "float32")
        .add_str("time_of", "rank 0");
    table.row({name, bench::size_string(bytes), bench::range(s_ours), bench::range(s_raw),
               bench::fmt("%.3f", r.ratio()), bench::fmt("%.3f", s_ours.paired_ratio),
               bench::fmt("%.4f", algbw), bench::fmt("%.4f", busbw)});
    r.add_num("passes", double(passes));
    results.add(std::move(r));
  }

  // barrier: no payload.
  if (selected(opt, "barrier")) {
    bench::SamplePlan p = plan_for(opt, 0);
    std::vector<bench::Stats> po, pr;
    for (int pass = 0; pass < passes; ++pass) {
      const auto [a, b] = bench::compare(
          p, [&] { barrier(world); },
          [&] {
            ::gloo::BarrierOptions o(ctx);
            o.setTag(next_tag());
            ::gloo::barrier(o);
          });
      po.push_back(a);
      pr.push_back(b);
    }
    const bench::Stats s_ours = bench::combine_passes(po);
    const bench::Stats s_raw = bench::combine_passes(pr);
    bench::Record r{"collectives", "barrier", "gloo", n, 0, s_ours, "gloo_raw", s_raw, {}};
    table.row({"barrier", "0 B", bench::range(s_ours), bench::range(s_raw), bench::fmt("%.3f", r.ratio()),
               bench::fmt("%.3f", s_ours.paired_ratio), "-", "-"});
    results.add(std::move(r));
  }

  if (rank == 0) {
    std::printf(
        "collectives on gloo, %d processes (float32; times of rank 0; ours = dtensor front end, raw = "
        "gloo's API called directly, interleaved)\n",
        n);
    table.print();
    results.write(opt, "collectives_gloo_n" + std::to_string(n) + ".json");
  }
  barrier(world);
  return 0;
}

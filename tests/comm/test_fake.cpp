// The fake backend (backends/fake/backend.hpp): one process plays one rank of a group of any size.
//
// The reference is a real group (in-process gloo ranks) whose members hold what the fake's premise says
// they hold: the same data on every member (all_reduce ... gather), symmetric traffic (all_to_all), a
// shift of equal blocks (send / recv). Every rank of the real group must end with exactly what
// fake_world(rank, n) gives that rank, at 1 to 4 ranks; outputs are poisoned first. What a rank of a real
// mesh communicates in a redistribution (CommDebugMode's table: ops, axes, bytes) must equal what the
// same rank of a fake world records, over every source and target placement, with uneven and empty
// shards. Then the scale the fake exists for: a mesh of 16,384 ranks built in one process.

#include "common.hpp"
#include "dtensor/backends/fake/backend.hpp"
#include "dtensor/comm/comm_debug.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/core/flop_counter.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/tensor/dtensor.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using namespace comm_test;
using Catch::Matchers::Contains;

namespace {

/// One rank's outputs of the op sequence below, in order, as doubles.
using Outputs = std::vector<std::vector<double>>;

template <class T, int Rank>
std::vector<double> values_of(const Tensor<T, Rank>& t) {
  std::vector<double> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    v.push_back(as_double(t.data()[i]));
  }
  return v;
}

template <class T>
Tensor<T, 1> poisoned(std::int64_t n) {
  return Tensor<T, 1>::full({n}, poison<T>());
}

/// Every op on `group`, with data that satisfies the fake's premise; returns this rank's outputs.
template <class T>
Outputs run_ops(const ProcessGroup& group) {
  const int n = group.size(), r = group.rank();
  Outputs out;
  // The same data on every member: 1 2 3 4 5 (small enough for a product over 4 ranks).
  auto same = [] {
    Tensor<T, 1> t({5});
    for (int i = 0; i < 5; ++i) {
      t(i) = from_int<T>(i + 1);
    }
    return t;
  };
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::product}) {
    auto t = same();
    all_reduce(t, op, group);
    out.push_back(values_of(t));
  }
  for (int root : {0, n - 1}) {
    auto t = same();
    reduce(t, root, ReduceOp::sum, group);
    out.push_back(values_of(t));
    auto b = same();
    broadcast(b, root, group);
    out.push_back(values_of(b));
  }
  {
    auto g = poisoned<T>(5 * n);
    all_gather_into_tensor(g, same(), group);
    out.push_back(values_of(g));
  }
  {
    // reduce_scatter of [n*2]: every member's input is 1..2n.
    Tensor<T, 1> in({2 * n});
    for (int i = 0; i < 2 * n; ++i) {
      in(i) = from_int<T>(i + 1);
    }
    auto o = poisoned<T>(2);
    reduce_scatter_tensor(o, in, ReduceOp::sum, group);
    out.push_back(values_of(o));
  }
  {
    // all_to_all with splits: member r sends member j (r + j) % 3 rows (none for some pairs) of values
    // 10 * (r + j) + min(r, j) + k, symmetric in (r, j): what j sends r is what r sends j.
    std::vector<std::int64_t> send(n), recv(n);
    std::int64_t total = 0;
    for (int j = 0; j < n; ++j) {
      send[j] = recv[j] = (r + j) % 3;
      total += send[j];
    }
    Tensor<T, 1> in({total});
    std::int64_t at = 0;
    for (int j = 0; j < n; ++j) {
      for (std::int64_t k = 0; k < send[j]; ++k) {
        in(at++) = from_int<T>(10 * (r + j) + std::min(r, j) + k);
      }
    }
    auto o = poisoned<T>(total);
    all_to_all_single(o, in, recv, send, group);
    out.push_back(values_of(o));
  }
  for (int root : {0, n - 1}) {
    std::vector<Tensor<T, 1>> blocks;
    for (int i = 0; i < n && r == root; ++i) {
      blocks.push_back(poisoned<T>(5));
    }
    gather(same(), r == root ? &blocks : nullptr, root, group);
    for (const auto& b : blocks) {
      out.push_back(values_of(b));
    }
  }
  {
    // scatter: the root's own block is compared; the other members' blocks are the root's, not here.
    std::vector<Tensor<T, 1>> list;
    for (int i = 0; i < n && r == 0; ++i) {
      list.push_back(Tensor<T, 1>::full({3}, from_int<T>(i + 7)));
    }
    auto o = poisoned<T>(3);
    scatter(o, list, 0, group);
    if (r == 0) {
      out.push_back(values_of(o));
    }
  }
  if (n > 1) {
    // A shift: every member sends its next the same block and receives its previous one's.
    auto o = poisoned<T>(4);
    const auto mine = same().narrow(0, 1, 4).contiguous();
    const std::vector<P2POp> ops{{P2POp::isend, mine, (r + 1) % n, group},
                                 {P2POp::irecv, o, (r + n - 1) % n, group}};
    for (auto& w : batch_isend_irecv(ops)) {
      w.wait();
    }
    out.push_back(values_of(o));
  }
  barrier(group);
  monitored_barrier(group);
  return out;
}

/// Every placement pair on a (dp, tp) mesh, as one rank's CommDebugMode table per pair.
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;

template <class... Ts>
struct List {};
template <class... Ts, class F>
void for_each_type(List<Ts...>, F&& f) {
  (f.template operator()<Ts>(), ...);
}

/// Per redistribution: its plan, what it communicates (CommDebugMode's table) and the peak of the tensors
/// it holds (MemoryTracker), of local tensors on `device`.
std::vector<std::string> redistribution_tables(const ProcessGroup& world, int dp, int tp,
                                               Device device = Device::cpu()) {
  auto mesh = init_device_mesh<Mesh2>(world, dp, tp);
  using Sources = List<Replicate, Shard<0>, Shard<1>, Partial<>>;
  using Targets = List<Replicate, Shard<0>, Shard<1>>;
  std::vector<std::string> tables;
  // (7, 5): uneven shards; (2, 3) on 3 or 4 ranks of an axis: empty ones.
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{7, 5}, {2, 3}}) {
    for_each_type(Sources{}, [&]<class A0>() {
      for_each_type(Sources{}, [&]<class A1>() {
        for_each_type(Targets{}, [&]<class B0>() {
          for_each_type(Targets{}, [&]<class B1>() {
            using DT = DTensor<float, 2, Mesh2, A0, A1>;
            const Block b = spec_block(Extents{rows, cols}, DT::spec, mesh.sizes(), mesh.coordinate());
            auto x = DT::from_local(mesh, Tensor<float, 2>::full({b.shape[0], b.shape[1]}, 1.0f, device),
                                    std::array<std::int64_t, 2>{rows, cols});
            CommDebugMode comm;
            MemoryTracker memory;
            auto y = x.template redistribute<B0, B1>();
            (void)y.full_tensor();
            tables.push_back(x.template plan_for<B0, B1>().to_string() + "\n" + comm.to_string() + "\npeak " +
                             std::to_string(memory.stats().peak_total));
          });
        });
      });
    });
  }
  return tables;
}

} // namespace

TEMPLATE_TEST_CASE("fake: every op leaves what a real group gives when the members hold alike",
                   "[comm][fake]", float, std::int32_t, bfloat16) {
  for (int n = 1; n <= 4; ++n) {
    std::vector<Outputs> real(static_cast<std::size_t>(n));
    std::mutex m;
    testing::run_ranks(n, [&](ProcessGroup& world) {
      Outputs o = run_ops<TestType>(world);
      std::lock_guard lock(m);
      real[static_cast<std::size_t>(world.rank())] = std::move(o);
    });
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r << " of " << n);
      const Outputs fake = run_ops<TestType>(fake_world(r, n));
      REQUIRE(fake.size() == real[static_cast<std::size_t>(r)].size());
      for (std::size_t i = 0; i < fake.size(); ++i) {
        INFO("output " << i);
        CHECK(fake[i] == real[static_cast<std::size_t>(r)][i]);
      }
    }
  }
}

TEST_CASE("fake: blocks of other sizes repeat or cut this member's, and off-root outputs stay",
          "[comm][fake]") {
  const ProcessGroup g = fake_world(1, 4);
  // all_gather with blocks of other sizes than this member's 2: x repeated or cut.
  {
    std::vector<Tensor<int, 1>> outs{poisoned<int>(3), poisoned<int>(2), poisoned<int>(5), poisoned<int>(1)};
    Tensor<int, 1> in({2});
    in(0) = 4;
    in(1) = 9;
    all_gather(outs, in, g);
    CHECK(values_of(outs[0]) == std::vector<double>{4, 9, 4});
    CHECK(values_of(outs[1]) == std::vector<double>{4, 9});
    CHECK(values_of(outs[2]) == std::vector<double>{4, 9, 4, 9, 4});
    CHECK(values_of(outs[3]) == std::vector<double>{4});
  }
  {
    // An empty block of this member: the others' blocks are zeros, not left poisoned.
    std::vector<Tensor<int, 1>> outs{poisoned<int>(2), poisoned<int>(0), poisoned<int>(1), poisoned<int>(0)};
    all_gather(outs, poisoned<int>(0), g);
    CHECK(values_of(outs[0]) == std::vector<double>{0, 0});
    CHECK(values_of(outs[2]) == std::vector<double>{0});
  }
  {
    // Off the root, reduce, gather and scatter leave this member's buffers as they were.
    auto t = Tensor<int, 1>::full({3}, 5);
    reduce(t, 0, ReduceOp::sum, g);
    CHECK(values_of(t) == std::vector<double>{5, 5, 5});
    auto o = poisoned<int>(2);
    scatter(o, {}, 0, g);
    CHECK(values_of(o) == std::vector<double>{-77, -77});
  }
  {
    // A recv with no send of its size in the batch is left as it was.
    auto o = poisoned<int>(3);
    recv(o, 0, g);
    CHECK(values_of(o) == std::vector<double>{-77, -77, -77});
  }
}

TEST_CASE("fake: a rank of 16,384 reduces by doubling and builds its mesh alone", "[comm][fake]") {
  const int n = 16384;
  for (int rank : {0, 5, 9000, n - 1}) {
    INFO("rank " << rank);
    const ProcessGroup world = fake_world(rank, n);
    CHECK(world.size() == n);
    CHECK(world.rank() == rank);
    CHECK(world.backend_name() == "fake");
    auto t = Tensor<std::int64_t, 1>::full({3}, 3);
    all_reduce(t, ReduceOp::sum, world);
    CHECK(values_of(t) == std::vector<double>{3.0 * n, 3.0 * n, 3.0 * n});
    auto f = Tensor<float, 1>::full({2}, 0.5f);
    all_reduce(f, ReduceOp::avg, world);
    CHECK(values_of(f) == std::vector<double>{0.5, 0.5});
    auto p = Tensor<std::int32_t, 1>::full({1}, -1);
    all_reduce(p, ReduceOp::product, world); // (-1)^16384
    CHECK(values_of(p) == std::vector<double>{1});

    // (pp 16, dp 128, tp 8): the axis groups are what the coordinates say; nothing was exchanged.
    using Mesh3 = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>;
    CommDebugMode comm;
    auto mesh = init_device_mesh<Mesh3>(world, 16, 128, 8);
    const int pp = rank / 1024, dp = rank / 8 % 128, tp = rank % 8;
    CHECK(mesh.local_rank<"pp">() == pp);
    CHECK(mesh.local_rank<"dp">() == dp);
    CHECK(mesh.local_rank<"tp">() == tp);
    const auto tp_ranks = mesh.group<"tp">().ranks();
    REQUIRE(tp_ranks.size() == 8);
    for (int i = 0; i < 8; ++i) {
      CHECK(tp_ranks[i] == rank - tp + i);
    }
    const auto dp_ranks = mesh.group<"dp">().ranks();
    REQUIRE(dp_ranks.size() == 128);
    CHECK(dp_ranks[127] == pp * 1024 + 127 * 8 + tp);
    const auto pp_ranks = mesh.group<"pp">().ranks();
    REQUIRE(pp_ranks.size() == 16);
    CHECK(pp_ranks[15] == 15 * 1024 + dp * 8 + tp);
    const ProcessGroup& dp_tp = mesh.group_over(axis_bit(1) | axis_bit(2));
    CHECK(dp_tp.size() == 1024);
    CHECK(dp_tp.rank() == dp * 8 + tp);
    CHECK(comm.total_count() == 0);

    // CommDebugMode sees the fake's ops with their axis and bytes, as it sees a real group's.
    auto x = Tensor<float, 1>::full({1024}, 1.0f);
    all_reduce(x, ReduceOp::sum, mesh.group<"tp">());
    CHECK(comm.count("all_reduce", "tp") == 1);
    CHECK(comm.bytes("all_reduce", "tp") == 2 * 7 * 1024 * 4 / 8);

    // The op log: each op's size and where its group sits, 8 ranks a node: tp within one node, dp over
    // 128 nodes (stride 8), pp over 16, dp x tp over the 128 nodes of this pp stage.
    CommDebugMode log({.log_ops = true, .gpus_per_node = 8});
    all_reduce(x, ReduceOp::sum, mesh.group<"tp">());
    all_reduce(x, ReduceOp::max, mesh.group<"dp">());
    auto gathered = Tensor<float, 1>({16 * 1024});
    all_gather_into_tensor(gathered, x, mesh.group<"pp">());
    auto shard = Tensor<float, 1>({1});
    reduce_scatter_tensor(shard, x, ReduceOp::sum, dp_tp);
    send(x, (mesh.local_rank<"pp">() + 1) % 16, mesh.group<"pp">());
    barrier(mesh.group<"tp">());
    const auto& ops = log.ops();
    REQUIRE(ops.size() == 6);
    CHECK(log.count("all_reduce") == 2);
    struct Want {
      const char* op;
      std::int64_t size;
      int ranks, nodes;
    };
    const Want want[] = {{"all_reduce", 4096, 8, 1},
                         {"all_reduce", 4096, 128, 128},
                         {"all_gather", 16 * 4096, 16, 16},
                         {"reduce_scatter", 4096, 1024, 128},
                         {"send", 4096, 2, 2},
                         {"barrier", 0, 8, 1}};
    for (std::size_t i = 0; i < ops.size(); ++i) {
      INFO("op " << i << ": " << ops[i].op << " over " << ops[i].axes);
      CHECK(ops[i].op == want[i].op);
      CHECK(ops[i].size == want[i].size);
      CHECK(ops[i].ranks == want[i].ranks);
      CHECK(ops[i].nodes == want[i].nodes);
    }
    CHECK(ops[1].reduce == ReduceOp::max);
    CHECK(ops[1].axes == "dp");
    CHECK(ops[3].bytes == 1023 * 4);
    CHECK(comm.ops().empty()); // a mode without the log keeps counts only
  }
}

TEST_CASE("fake: the op log of a real group gives every op's size and group at 1-4 ranks, uneven blocks",
          "[comm][fake]") {
  for (int n = 1; n <= 4; ++n) {
    INFO(n << " ranks");
    std::vector<std::vector<CommDebugMode::Op>> logs(static_cast<std::size_t>(n));
    std::vector<std::int64_t> sent(static_cast<std::size_t>(n)), received(static_cast<std::size_t>(n));
    std::mutex m;
    testing::run_ranks(n, [&](ProcessGroup& world) {
      CommDebugMode log({.log_ops = true, .gpus_per_node = 2});
      const int me = world.rank();
      auto x = Tensor<float, 1>::full({5}, 1.0f);
      all_reduce(x, ReduceOp::sum, world);
      broadcast(x, 0, world);
      // Uneven all_to_all: rank r sends r + i elements to rank i.
      std::vector<std::int64_t> send_counts(static_cast<std::size_t>(n)),
          recv_counts(static_cast<std::size_t>(n));
      std::int64_t s = 0, r = 0;
      for (int i = 0; i < n; ++i) {
        send_counts[std::size_t(i)] = me + i;
        recv_counts[std::size_t(i)] = i + me;
        s += me + i;
        r += i + me;
      }
      auto in = Tensor<float, 1>::full({s}, 1.0f);
      auto out = Tensor<float, 1>::full({r}, -1.0f);
      all_to_all_single(out, in, recv_counts, send_counts, world);
      auto gathered = Tensor<float, 1>({5 * n});
      all_gather_into_tensor(gathered, x, world);
      std::lock_guard lock(m);
      logs[std::size_t(me)] = log.ops();
      sent[std::size_t(me)] = s;
      received[std::size_t(me)] = r;
    });
    for (int me = 0; me < n; ++me) {
      INFO("rank " << me);
      const auto& ops = logs[std::size_t(me)];
      REQUIRE(ops.size() == 4);
      CHECK(ops[0].op == "all_reduce");
      CHECK(ops[0].size == 20);
      CHECK(ops[1].op == "broadcast");
      CHECK(ops[1].size == 20);
      CHECK(ops[2].op == "all_to_all");
      CHECK(ops[2].size == 4 * sent[std::size_t(me)]);
      CHECK(ops[2].bytes == 4 * (received[std::size_t(me)] - 2 * me));
      CHECK(ops[3].op == "all_gather");
      CHECK(ops[3].size == 20 * n);
      for (const auto& op : ops) {
        CHECK(op.ranks == n);
        CHECK(op.nodes == (n + 1) / 2);
      }
    }
  }
}

TEST_CASE("fake: a rank's redistributions, of host or meta tensors, communicate and hold what the same rank "
          "of a real mesh does",
          "[comm][fake]") {
  for (auto [dp, tp] : {std::pair{1, 1}, {2, 1}, {1, 3}, {2, 2}}) { // 1 to 4 ranks
    const int n = dp * tp;
    std::vector<std::vector<std::string>> real(static_cast<std::size_t>(n));
    std::mutex m;
    testing::run_ranks(n, [&](ProcessGroup& world) {
      auto t = redistribution_tables(world, dp, tp);
      std::lock_guard lock(m);
      real[static_cast<std::size_t>(world.rank())] = std::move(t);
    });
    for (int r = 0; r < n; ++r) {
      for (const Device device : {Device::cpu(), Device::meta()}) { // meta: shapes only, the same tables
        const auto fake = redistribution_tables(fake_world(r, n), dp, tp, device);
        REQUIRE(fake.size() == real[static_cast<std::size_t>(r)].size());
        for (std::size_t i = 0; i < fake.size(); ++i) {
          INFO("rank " << r << " of (dp " << dp << ", tp " << tp << "), " << device.to_string());
          CHECK(fake[i] == real[static_cast<std::size_t>(r)][i]);
        }
      }
    }
  }
}

TEST_CASE("the op log puts each op on the flop clock: a synchronous op waited where it was issued, an async "
          "one where its completion was waited for",
          "[comm][fake]") {
  const ProcessGroup g = fake_world(1, 8);
  auto x = Tensor<float, 1>({1024}, Device::meta());
  CommDebugMode comm({.log_ops = true});
  count_flops(100);
  all_reduce(x, ReduceOp::sum, g);
  Work w = all_reduce(x, ReduceOp::sum, g, async_op);
  Work never = all_gather_into_tensor(Tensor<float, 1>({8192}, Device::meta()), x, g, async_op);
  count_flops(50); // the compute the async all_reduce overlaps
  w.wait();
  w.wait(); // the first wait counts
  const auto& ops = comm.ops();
  REQUIRE(ops.size() == 3);
  CHECK(ops[0].waited->flops == ops[0].issued_flops);
  CHECK(ops[0].waited->seq == ops[0].issued_seq + 1);
  CHECK(ops[1].issued_flops == ops[0].issued_flops);
  CHECK(ops[1].waited->flops == ops[1].issued_flops + 50);
  CHECK(ops[1].waited->seq > ops[2].issued_seq);
  CHECK(ops[2].waited->seq < 0); // never waited
  (void)never;
}

TEST_CASE("fake: what it cannot do is an error naming the rank, group and op", "[comm][fake]") {
  const ProcessGroup g = fake_world(2, 3);
  // The exchanging split: the other members are not here to say their colours.
  CHECK_THROWS_WITH(g.split(0, 2),
                    Contains("rank 2 (global 2) of fake group [0,1,2]: split(color 0, key 2)") &&
                        Contains("call split(color, key, every)"));
  const std::vector<SplitEntry> every{{0, 0}, {1, 1}, {0, 2}};
  const ProcessGroup even = g.split(0, 2, every);
  CHECK(even.size() == 2);
  CHECK(even.rank() == 1);
  CHECK(std::vector<int>(even.ranks().begin(), even.ranks().end()) == std::vector<int>{0, 2});
  CHECK_THROWS_WITH(g.split(0, 2, std::vector<SplitEntry>{{0, 0}}),
                    Contains("split: 1 colours and keys given for a group of 3"));
  CHECK_THROWS_WITH(g.split(1, 2, every),
                    Contains("the list gives this member colour 0 and key 2, but it passes "
                             "colour 1 and key 2"));
  // Device memory: the fake copies on the host.
  int dummy[2] = {};
  CHECK_THROWS_WITH(g.backend().all_reduce({dummy, 2, DType::int32, Device::cuda(0)}, ReduceOp::sum, {}),
                    Contains("fake group [0,1,2]: all_reduce: the tensor is on cuda:0") &&
                        Contains("pass host memory"));
  CHECK_THROWS_WITH(fake_world(3, 3), Contains("fake backend: rank 3 of a world of 3"));
  // Meta tensors: a real group has no data to move for them; the fake moves none and records the op.
  testing::run_ranks(2, [](ProcessGroup& world) {
    auto m = Tensor<float, 1>({6}, Device::meta());
    try {
      all_reduce(m, ReduceOp::sum, world);
      throw std::runtime_error("no error");
    } catch (const Error& e) {
      if (std::string(e.what()).find("all_reduce: the tensor (6 elements) is a meta tensor") ==
              std::string::npos ||
          std::string(e.what()).find("DTENSOR_BACKEND=fake") == std::string::npos) {
        throw;
      }
    }
  });
  CommDebugMode comm;
  auto m = Tensor<float, 1>({6}, Device::meta());
  auto out = Tensor<float, 1>({18}, Device::meta());
  all_reduce(m, ReduceOp::sum, g);
  all_gather_into_tensor(out, m, g);
  all_to_all_single(out, out.narrow(0, 0, 18).clone(), g);
  CHECK(comm.count("all_reduce") == 1);
  CHECK(comm.count("all_gather") == 1);
  CHECK(comm.count("all_to_all") == 1);
  // Large groups are named by their ends.
  CHECK_THAT(fake_world(7, 100).to_string(),
             Contains("rank 7 (global 7) of fake group [0,...,99] (100 ranks)"));
}

TEST_CASE("fake: DTENSOR_BACKEND=fake makes init_process_group play one rank alone", "[comm][fake]") {
  InitOptions o;
  o.backend = "fake";
  DistEnv env;
  env.rank = 5;
  env.world_size = 8;
  env.source = "torchrun";
  o.env = env;
  const ProcessGroup world = init_process_group(o);
  CHECK(world.rank() == 5);
  CHECK(world.size() == 8);
  CHECK(world.backend_name() == "fake");
  CHECK(world.dry_run());
  CHECK_FALSE(backend_traits("fake").meets_peers);
  CHECK(backend_traits("gloo").meets_peers);
  auto t = Tensor<int, 1>::full({2}, 2);
  all_reduce(t, ReduceOp::sum, world);
  CHECK(values_of(t) == std::vector<double>{16, 16});
  // "auto" never picks it.
  CHECK(resolve_backend_name("auto") != "fake");

  // From the environment alone, as a program is dry-run: no MASTER_ADDR, no store, no launcher.
  ::setenv("DTENSOR_BACKEND", "fake", 1);
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  const ProcessGroup from_env = init_process_group();
  ::unsetenv("DTENSOR_BACKEND");
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  CHECK(from_env.rank() == 3);
  CHECK(from_env.size() == 4);
  CHECK(from_env.backend_name() == "fake");
}

// Members that disagree with each other (issue 18, defects 1 and 6): collectives and point-to-point with
// different element counts, dtypes, roots or reduce ops on different ranks, and groups created in
// different orders, must give every member a dtensor::Error within about the timeout whose message names
// the op and what each member passed -- never an abort of the process (gloo's EnforceNotMet), never stale
// or mixed data.

#include "common.hpp"

#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/tensor/dtensor.hpp>

#include <catch2/catch.hpp>

#include <mutex>
#include <string>
#include <vector>

using namespace comm_test;
using namespace std::chrono_literals;

namespace {

/// Runs `fn` on 2 ranks with a short timeout; each rank must throw a dtensor::Error whose message holds
/// every one of `parts`. Returns after checking the time it took.
void expect_every_rank_fails(const std::function<void(ProcessGroup&)>& fn,
                             const std::vector<std::string>& parts, int world = 2) {
  testing::RunRanksOptions opts;
  opts.timeout = 500ms;
  std::mutex m;
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  std::vector<int> failed(static_cast<std::size_t>(world), 0);
  const auto t0 = std::chrono::steady_clock::now();
  testing::run_ranks(
      world,
      [&](ProcessGroup& g) {
        try {
          fn(g);
        } catch (const Error& e) {
          std::lock_guard lock(m);
          messages[static_cast<std::size_t>(g.rank())] = e.what();
          failed[static_cast<std::size_t>(g.rank())] = 1;
        }
      },
      opts);
  const double took = seconds_since(t0);
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << messages[static_cast<std::size_t>(r)]);
    REQUIRE(failed[static_cast<std::size_t>(r)] == 1);
    for (const auto& p : parts) {
      CHECK_THAT(messages[static_cast<std::size_t>(r)], Catch::Matchers::Contains(p));
    }
  }
  REQUIRE(took < 4.0);
}

template <class T>
Tensor<T, 1> filled(std::int64_t n, int rank) {
  return Tensor<T, 1>::full({n}, static_cast<T>(rank + 1));
}

} // namespace

TEST_CASE("collectives whose members disagree on the element count fail on every rank", "[comm][mismatch]") {
  const std::string op = GENERATE(std::string("all_reduce"), std::string("reduce"), std::string("broadcast"),
                                  std::string("all_gather_into_tensor"));
  const bool small_first = GENERATE(true, false); // rank 0 has the smaller count, or rank 1
  INFO(op << (small_first ? ", rank 0 smaller" : ", rank 1 smaller"));
  expect_every_rank_fails(
      [&](ProcessGroup& g) {
        const bool small = (g.rank() == 0) == small_first;
        if (op == "all_gather_into_tensor") {
          auto in = filled<float>(small ? 4 : 8, g.rank());
          auto out = Tensor<float, 1>::full({2 * in.numel()}, -1.0f);
          all_gather_into_tensor(out, in, g);
          return;
        }
        auto t = filled<float>(small ? 16 : 32, g.rank());
        if (op == "all_reduce") {
          all_reduce(t, ReduceOp::sum, g);
        } else if (op == "reduce") {
          reduce(t, 0, ReduceOp::sum, g);
        } else {
          broadcast(t, 0, g);
        }
      },
      {op == "all_gather_into_tensor" ? "all_gather" : op, "disagree",
       op == "all_gather_into_tensor" ? "4 x float32" : "16 x float32",
       op == "all_gather_into_tensor" ? "8 x float32" : "32 x float32", "rank 0: ", "rank 1: "});
}

TEST_CASE("collectives whose members disagree on the dtype fail on every rank", "[comm][mismatch]") {
  const std::string other = GENERATE(std::string("float64"), std::string("int32"));
  const std::string op = GENERATE(std::string("all_reduce"), std::string("broadcast"));
  INFO(op << " float32 vs " << other);
  expect_every_rank_fails(
      [&](ProcessGroup& g) {
        auto run = [&](auto t) {
          if (op == "all_reduce") {
            all_reduce(t, ReduceOp::sum, g);
          } else {
            broadcast(t, 0, g);
          }
        };
        if (g.rank() == 0) {
          run(filled<float>(16, 0));
        } else if (other == "float64") {
          run(filled<double>(16, 1));
        } else {
          run(filled<std::int32_t>(16, 1));
        }
      },
      {op, "disagree", "16 x float32", "16 x " + other});
}

TEST_CASE("collectives whose members disagree on the root or the reduce op fail on every rank",
          "[comm][mismatch]") {
  const std::string what = GENERATE(std::string("root"), std::string("reduce op"));
  INFO(what);
  expect_every_rank_fails(
      [&](ProcessGroup& g) {
        auto t = filled<float>(8, g.rank());
        if (what == "root") {
          broadcast(t, g.rank(), g);
        } else {
          all_reduce(t, g.rank() == 0 ? ReduceOp::sum : ReduceOp::max, g);
        }
      },
      {what == "root" ? "broadcast" : "all_reduce", "disagree", what == "root" ? "root 0" : "op sum",
       what == "root" ? "root 1" : "op max"});
}

TEST_CASE("send and recv whose sizes or dtypes disagree fail on both ranks", "[comm][mismatch]") {
  const std::string kind = GENERATE(std::string("send 16 / recv 32"), std::string("send 32 / recv 16"),
                                    std::string("float32 / int32"));
  INFO(kind);
  expect_every_rank_fails(
      [&](ProcessGroup& g) {
        if (kind == "float32 / int32") {
          if (g.rank() == 0) {
            send(filled<float>(16, 0), 1, g);
          } else {
            auto t = filled<std::int32_t>(16, 1);
            recv(t, 0, g);
          }
          return;
        }
        const bool sender_small = kind == "send 16 / recv 32";
        if (g.rank() == 0) {
          send(filled<float>(sender_small ? 16 : 32, 0), 1, g);
        } else {
          auto t = filled<float>(sender_small ? 32 : 16, 1);
          recv(t, 0, g);
        }
      },
      {"disagree", kind == "float32 / int32" ? "16 x int32" : "16 x float32",
       kind == "float32 / int32" ? "16 x float32" : "32 x float32", "rank 0: send", "rank 1: recv"});
}

TEST_CASE("from_local of uneven shards without the global shape fails cleanly at the first collective",
          "[comm][mismatch]") {
  // Rank 0 holds 3 rows, rank 1 holds 2: each infers an even global shape of its own (6 and 4 rows).
  using Mesh = MeshShape<Axis<"dp">>;
  expect_every_rank_fails(
      [](ProcessGroup& g) {
        auto mesh = init_device_mesh<Mesh>(g);
        auto local = Tensor<float, 2>::full({g.rank() == 0 ? 3 : 2, 4}, 1.0f);
        auto x = DTensor<float, 2, Mesh, Shard<0>>::from_local(mesh, local);
        (void)x.full_tensor();
      },
      {"redistribute [S(0)] -> [R]", "all_gather", "disagree", "rank 0: all_gather #0 (12 x float32)",
       "rank 1: all_gather #0 (8 x float32)"});
}

TEST_CASE("groups created in different orders fail on every member with what each member was making",
          "[comm][mismatch][groups]") {
  // Rank 0 makes [0,1] then [0,1,2]; ranks 1 and 2 make [0,1,2] first (rank 1 then [0,1]); or a split of
  // the world against a new_group; or splits of two groups in different orders.
  const int order = GENERATE(0, 1, 2);
  INFO("order " << order);
  std::vector<std::string> parts{"different orders"};
  if (order == 0) {
    parts.push_back("is at: creating new_group([0,1");
  } else {
    parts.push_back("is at: creating ");
  }
  expect_every_rank_fails(
      [&](ProcessGroup& g) {
        const int r = g.rank();
        if (order == 0) {
          if (r == 0) {
            auto a = g.new_group({0, 1});
            auto b = g.new_group({0, 1, 2});
          } else if (r == 1) {
            auto b = g.new_group({0, 1, 2});
            auto a = g.new_group({0, 1});
          } else {
            auto b = g.new_group({0, 1, 2});
          }
        } else if (order == 1) {
          if (r == 1) {
            auto b = g.new_group({0, 1});
            auto a = g.split(0, r);
          } else {
            auto a = g.split(0, r);
            auto b = r == 0 ? g.new_group({0, 1}) : ProcessGroup();
          }
        } else {
          auto sub = g.new_group({0, 1});
          if (r == 1) {
            auto b = sub.split(0, r);
            auto a = g.split(0, r);
          } else {
            auto a = g.split(0, r);
            auto b = r == 0 ? sub.split(0, r) : ProcessGroup();
          }
        }
      },
      parts, 3);
}

TEST_CASE("DTENSOR_DEBUG=detail: a desync is reported at once on every rank with each member's fields, and "
          "nothing is sent",
          "[comm][mismatch][desync]") {
  struct Level { // restores the level for the other cases of this process
    Level() { set_debug_level(DebugLevel::detail); }
    ~Level() { set_debug_level(DebugLevel::off); }
  } level;
  const std::string kind = GENERATE(std::string("count"), std::string("op"), std::string("dtype"),
                                    std::string("all_to_all splits"), std::string("gather blocks"));
  INFO(kind);
  testing::RunRanksOptions opts;
  opts.timeout = 10s; // the check must not wait for it
  std::mutex m;
  std::vector<std::string> messages(3);
  const auto t0 = std::chrono::steady_clock::now();
  testing::run_ranks(
      3,
      [&](ProcessGroup& g) {
        const int r = g.rank();
        auto t = filled<float>(r == 1 && kind == "count" ? 32 : 16, r);
        try {
          if (kind == "count") {
            all_reduce(t, ReduceOp::sum, g);
          } else if (kind == "op") {
            if (r == 2) {
              broadcast(t, 0, g);
            } else {
              all_reduce(t, ReduceOp::sum, g);
            }
          } else if (kind == "dtype") {
            if (r == 2) {
              all_reduce(filled<std::int32_t>(16, r), ReduceOp::sum, g);
            } else {
              all_reduce(t, ReduceOp::sum, g);
            }
          } else if (kind == "all_to_all splits") {
            // Rank 0 sends rank 1 two rows; rank 1 expects one.
            std::vector<std::int64_t> in_splits{1, 1, 1}, out_splits{1, 1, 1};
            if (r == 0) {
              in_splits = {1, 2, 1};
            }
            auto in = Tensor<float, 1>::full({in_splits[0] + in_splits[1] + in_splits[2]}, 1.0f);
            auto out = Tensor<float, 1>::full({3}, 0.0f);
            all_to_all_single(out, in, out_splits, in_splits, g);
          } else {
            // The root expects 16 from everyone; rank 2 sends 8.
            std::vector<Tensor<float, 1>> list{filled<float>(16, 0), filled<float>(16, 0),
                                               filled<float>(16, 0)};
            gather(r == 2 ? filled<float>(8, r) : t, r == 0 ? &list : nullptr, 0, g);
          }
        } catch (const Error& e) {
          std::lock_guard lock(m);
          messages[static_cast<std::size_t>(r)] = e.what();
        }
        // Nothing was sent: the group is still in step.
        auto one = Tensor<float, 1>::full({4}, 1.0f);
        all_reduce(one, ReduceOp::sum, g);
        expect_values<float>(
            one, [](auto) { return 3.0f; }, "all_reduce after the desync error");
      },
      opts);
  REQUIRE(seconds_since(t0) < 3.0);
  const std::string field = kind == "count"               ? "disagree on the count"
                            : kind == "op"                ? "disagree on the op"
                            : kind == "dtype"             ? "disagree on the dtype"
                            : kind == "all_to_all splits" ? "rank 0 sends 2 to rank 1, which expects 1"
                                                          : "rank 2 sends 8 to rank 0, which expects 16";
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r << ": " << messages[static_cast<std::size_t>(r)]);
    CHECK_THAT(messages[static_cast<std::size_t>(r)],
               Catch::Matchers::Contains("desync check of collective #0"));
    CHECK_THAT(messages[static_cast<std::size_t>(r)], Catch::Matchers::Contains(field));
    CHECK_THAT(messages[static_cast<std::size_t>(r)], Catch::Matchers::Contains("nothing was sent"));
    CHECK_THAT(messages[static_cast<std::size_t>(r)], Catch::Matchers::Contains("rank 2: "));
  }
  if (kind == "count") {
    CHECK_THAT(messages[0], Catch::Matchers::Contains("rank 0: all_reduce (16 x float32, op sum); rank 1: "
                                                      "all_reduce (32 x float32, op sum)"));
  }
}

TEST_CASE("DTENSOR_DEBUG=detail: a member that never comes is named with its last collective",
          "[comm][mismatch][desync]") {
  struct Level {
    Level() { set_debug_level(DebugLevel::detail); }
    ~Level() { set_debug_level(DebugLevel::off); }
  } level;
  testing::RunRanksOptions opts;
  opts.timeout = 500ms;
  testing::run_ranks(
      3,
      [&](ProcessGroup& g) {
        auto t = filled<float>(4, g.rank());
        all_reduce(t, ReduceOp::sum, g);
        if (g.rank() == 1) {
          return;
        }
        expect_throws<TimeoutError>([&] { broadcast(t, 0, g); },
                                    {"desync check of collective #1",
                                     "missing: rank 1 (its last checked "
                                     "collective: #0 all_reduce (4 x float32, op sum))"},
                                    "a member that never comes");
      },
      opts);
}

TEST_CASE("a timeout says what this rank did last on the group (flight recorder)", "[comm][flight]") {
  testing::RunRanksOptions opts;
  opts.timeout = 500ms;
  testing::run_ranks(
      2,
      [&](ProcessGroup& g) {
        auto t = filled<float>(4, g.rank());
        all_reduce(t, ReduceOp::sum, g);
        broadcast(t, 1, g);
        auto w = all_reduce(filled<double>(3, 0), ReduceOp::max, g, async_op);
        w.wait();
        const std::string record = g.flight_record();
        DTENSOR_CHECK(
            record.find("#0 all_reduce (4 x float32, op sum) completed in ") == 0 &&
                record.find("; #1 broadcast (4 x float32, root 1) completed in ") != std::string::npos &&
                record.find("; #2 all_reduce (3 x float64, op max) completed in ") != std::string::npos,
            "flight record: " + record);
        if (g.rank() == 1) {
          return; // never comes to the next one
        }
        expect_throws<TimeoutError>([&] { reduce(t, 0, ReduceOp::sum, g); },
                                    {"flight recorder, this rank's last ops on the group: #0 all_reduce (4 x "
                                     "float32, op sum) completed in ",
                                     "#2 all_reduce (3 x float64, op max) completed in ",
                                     "#3 reduce (4 x float32, op sum, root 0) running for "},
                                    "a timeout after three ops");
      },
      opts);
}

TEST_CASE("monitored_barrier passes when every member comes and names the ones that do not",
          "[comm][monitored_barrier]") {
  testing::RunRanksOptions opts;
  opts.timeout = 5s;
  const auto t0 = std::chrono::steady_clock::now();
  testing::run_ranks(
      4,
      [&](ProcessGroup& g) {
        for (int i = 0; i < 5; ++i) { // keys of earlier barriers are reused safely
          monitored_barrier(g);
        }
        // A sub-group over global ranks {1, 2, 3}: its rank 1 (global 2) and rank 2 (global 3) stay away.
        auto sub = g.new_group({1, 2, 3});
        if (g.rank() == 1) {
          expect_throws<TimeoutError>(
              [&] { monitored_barrier(sub, 300ms); },
              {"monitored_barrier #0", "ranks 1, 2 (global 2, 3) did not arrive within 300 ms"},
              "members that stay away");
        }
        monitored_barrier(g); // the world is still in step
      },
      opts);
  REQUIRE(seconds_since(t0) < 4.0);
}

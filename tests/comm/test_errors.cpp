// Error paths: argument errors one rank can see are thrown before any communication (the group stays
// usable), a rank that never arrives gives the others a TimeoutError within the configured time, a rank that
// throws or aborts makes the others fail within seconds, and messages name rank, group, op and sizes.

#include "common.hpp"

#include <catch2/catch.hpp>

#include <mutex>
#include <thread>

using namespace comm_test;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

TEST_CASE("argument errors are thrown before any communication", "[comm][errors]") {
  const int world = GENERATE(1, 3);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    const std::string me = "rank " + std::to_string(r);
    auto ok = Tensor<float, 2>::full({2, 2}, 1.0f);
    expect_throws(
        [&] {
          all_gather_into_tensor(Tensor<float, 2>({5, 2}), ok, g);
        },
        {me, "gloo group", "all_gather_into_tensor", "[5, 2]", "[2, 2]", "group of " + std::to_string(n)},
        "all_gather_into_tensor with a wrong output size");
    expect_throws(
        [&] {
          reduce_scatter_tensor(Tensor<float, 2>({3, 2}), ok, ReduceOp::sum, g);
        },
        {me, "reduce_scatter_tensor", "[3, 2]", "[2, 2]"}, "reduce_scatter_tensor with a wrong output size");
    auto wide = Tensor<float, 2>::full({4, 4}, 0.0f);
    expect_throws([&] { all_reduce(wide.narrow(1, 0, 2), ReduceOp::sum, g); },
                  {me, "all_reduce", "not contiguous", "[4, 2]"}, "non-contiguous tensor");
    float host[4] = {};
    auto on_gpu = Tensor<float, 1>::from_blob(host, {4}, Device::cuda(0));
    expect_throws([&] { all_reduce(on_gpu, ReduceOp::sum, g); }, {me, "all_reduce", "cuda:0", "host"},
                  "device tensor on gloo");
    expect_throws([&] { broadcast(on_gpu, 0, g, async_op); }, {"broadcast", "cuda:0"},
                  "async device tensor on gloo");
    auto t = Tensor<float, 1>::full({4}, 1.0f);
    expect_throws([&] { reduce(t, n, ReduceOp::sum, g); },
                  {me, "reduce", "dst " + std::to_string(n), "out of range"}, "dst out of range");
    expect_throws([&] { broadcast(t, -1, g); }, {me, "broadcast", "src -1", "out of range"},
                  "src out of range");
    std::vector<std::int64_t> neg(n, 0), fine(n, 0);
    neg[0] = -1;
    auto rows = Tensor<float, 2>({0, 2});
    expect_throws([&] { all_to_all_single(rows, rows, fine, neg, g); },
                  {me, "all_to_all_single", "negative", "-1"}, "negative split size");
    std::vector<std::int64_t> too_many(n, 1);
    expect_throws([&] { all_to_all_single(rows, rows, fine, too_many, g); },
                  {me, "all_to_all_single", "sum to " + std::to_string(n), "0 rows"},
                  "split sizes that do not add up");
    std::vector<std::int64_t> short_splits(n + 1, 0);
    expect_throws([&] { all_to_all_single(rows, rows, fine, short_splits, g); }, {"entries for a group of"},
                  "wrong number of split sizes");
    std::vector<Tensor<float, 1>> few(n + 1, t);
    expect_throws([&] { all_gather(few, t, g); },
                  {me, "all_gather", std::to_string(n + 1) + " output tensors"}, "list of the wrong length");
    expect_throws([&] { send(t, n, g); }, {me, "send", "peer " + std::to_string(n)}, "peer out of range");
    expect_throws([&] { isend(t, r, g); }, {me, "send", "itself"}, "send to itself");
    expect_throws([&] { irecv(t, (r + 1) % n, g, -3); }, {"tag -3"}, "negative tag", n > 1);
    expect_throws([&] { gather(t, nullptr, 0, g); }, {"gather"}, "gather without a list on dst", r == 0);
    std::vector<Tensor<float, 1>> blocks(n, t);
    blocks[0] = Tensor<float, 1>({5});
    expect_throws([&] { scatter(t, blocks, 0, g); },
                  {me, "scatter", "own block has 5 elements", "output has " + std::to_string(t.numel())},
                  "scatter whose own block does not match the output", r == 0);
    expect_throws([&] { gather(t, &blocks, 0, g); }, {me, "gather", "own block has 5 elements"},
                  "gather whose own block does not match the input", r == 0);
    expect_throws([&] { scatter(t, few, 0, g); }, {me, "scatter", "got " + std::to_string(n + 1)},
                  "scatter list of the wrong length", r == 0);
    // Nothing was sent: the group still works, in step on every rank.
    all_reduce(t, ReduceOp::sum, g);
    expect_values<float>(
        t, [&](auto) { return static_cast<float>(n); }, "all_reduce after argument errors");
  });
}

TEST_CASE("a rank that throws fails the test with its message and releases the others quickly",
          "[comm][errors]") {
  const int world = GENERATE(2, 3, 4);
  const bool already_inside = GENERATE(false, true); // others already blocked in the collective, or not yet
  testing::RunRanksOptions opts;
  opts.timeout = 20s; // far longer than the test may take
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(testing::run_ranks(
                          world,
                          [&](ProcessGroup& g) {
                            if (g.rank() == 1) {
                              if (already_inside) {
                                std::this_thread::sleep_for(200ms);
                              }
                              throw Error("boom on rank 1");
                            }
                            auto t = Tensor<float, 1>::full({16}, 1.0f);
                            all_reduce(t, ReduceOp::sum, g);
                            all_reduce(t, ReduceOp::sum, g);
                          },
                          opts),
                      Contains("rank 1 failed: boom on rank 1"));
  REQUIRE(seconds_since(t0) < 5.0);
}

TEST_CASE("the other ranks' errors name the failing rank", "[comm][errors]") {
  std::string message;
  try {
    testing::run_ranks(3, [](ProcessGroup& g) {
      if (g.rank() == 2) {
        throw Error("rank two gives up");
      }
      auto t = Tensor<std::int32_t, 1>::full({7}, 1);
      all_reduce(t, ReduceOp::sum, g);
    });
  } catch (const Error& e) {
    message = e.what();
  }
  INFO(message);
  REQUIRE_THAT(message, Contains("run_ranks(3): rank 2 failed: rank two gives up"));
  REQUIRE_THAT(message, Contains("then rank"));
  REQUIRE_THAT(message, Contains("all_reduce #0 (7 x int32, op sum)"));
  REQUIRE_THAT(message, Contains("gloo group [0,1,2]"));
}

TEST_CASE("a rank that skips a collective gives the others a TimeoutError within the timeout",
          "[comm][errors]") {
  const int world = GENERATE(2, 4);
  const bool async = GENERATE(false, true);
  testing::RunRanksOptions opts;
  opts.timeout = 500ms;
  std::atomic<int> timeouts{0};
  std::atomic<double> slowest{0};
  const auto t0 = std::chrono::steady_clock::now();
  testing::run_ranks(
      world,
      [&](ProcessGroup& g) {
        if (g.rank() == g.size() - 1) {
          return; // never arrives
        }
        auto t = Tensor<float, 1>::full({5}, 1.0f);
        const auto start = std::chrono::steady_clock::now();
        expect_throws<TimeoutError>(
            [&] {
              if (async) {
                auto w = all_reduce(t, ReduceOp::sum, g, async_op);
                w.wait();
              } else {
                all_reduce(t, ReduceOp::sum, g);
              }
            },
            {"rank " + std::to_string(g.rank()), "all_reduce", "5 x float32", "timed out"},
            "skipped collective");
        const double s = seconds_since(start);
        double cur = slowest.load();
        while (s > cur && !slowest.compare_exchange_weak(cur, s)) {
        }
        ++timeouts;
      },
      opts);
  REQUIRE(timeouts == world - 1);
  INFO("slowest rank saw its TimeoutError after " << slowest.load() << " s");
  REQUIRE(slowest.load() >= 0.45);
  REQUIRE(slowest.load() < 2.5);
  REQUIRE(seconds_since(t0) < 5.0);
}

TEST_CASE("a receive without a sender times out, abort() releases a blocked peer", "[comm][errors]") {
  testing::RunRanksOptions opts;
  opts.timeout = 400ms;
  testing::run_ranks(
      2,
      [](ProcessGroup& g) {
        if (g.rank() == 0) {
          auto t = Tensor<double, 1>::full({3}, 0.0);
          expect_throws<TimeoutError>([&] { recv(t, 1, g); }, {"rank 0", "recv", "3 x float64", "timed out"},
                                      "recv without a sender");
        }
      },
      opts);

  opts.timeout = 20s;
  const auto t0 = std::chrono::steady_clock::now();
  testing::run_ranks(
      2,
      [](ProcessGroup& g) {
        auto t = Tensor<int, 1>::full({3}, 0);
        if (g.rank() == 0) {
          std::this_thread::sleep_for(200ms);
          g.abort("operator said stop");
          expect_throws([&] { all_reduce(t, ReduceOp::sum, g); }, {"aborted", "operator said stop"},
                        "op after abort");
        } else {
          expect_throws([&] { recv(t, 0, g); }, {"rank 1", "recv", "operator said stop"},
                        "peer of an aborted rank");
        }
      },
      opts);
  REQUIRE(seconds_since(t0) < 5.0);
}

TEST_CASE("members that disagree on block sizes get an error naming the op, never a short read",
          "[comm][errors]") {
  const std::string op =
      GENERATE(std::string("gather"), std::string("scatter"), std::string("all_to_all_single"));
  const bool longer =
      GENERATE(false, true); // the root's / sender's idea of rank 1's block is larger or smaller
  testing::RunRanksOptions opts;
  opts.timeout = 500ms;
  std::atomic<int> errors{0};
  std::atomic<int> explained{0};
  std::mutex m;
  std::string unexpected;
  const auto t0 = std::chrono::steady_clock::now();
  testing::run_ranks(
      2,
      [&](ProcessGroup& g) {
        const std::int64_t theirs = longer ? 4 : 2;   // what rank 0 uses for rank 1's block
        auto own = Tensor<float, 1>::full({3}, 1.0f); // every member's own block: 3 elements
        std::vector<Tensor<float, 1>> list{Tensor<float, 1>::full({3}, 2.0f),
                                           Tensor<float, 1>::full({theirs}, 2.0f)};
        try {
          if (op == "gather") {
            gather(own, &list, 0, g);
          } else if (op == "scatter") {
            scatter(own, list, 0, g);
          } else {
            // Rank 0 sends `theirs` rows to rank 1, which expects 3.
            std::vector<std::int64_t> in_splits{1, theirs};
            std::vector<std::int64_t> out_splits{1, 1};
            if (g.rank() == 1) {
              in_splits = {1, 1};
              out_splits = {3, 1};
            }
            auto in = Tensor<float, 1>::full({in_splits[0] + in_splits[1]}, 1.0f);
            auto out = Tensor<float, 1>::full({out_splits[0] + out_splits[1]}, -1.0f);
            all_to_all_single(out, in, out_splits, in_splits, g);
          }
        } catch (const Error& e) {
          // Each member fails with the op's name; at least one says why (the other may see its peer's
          // failure first).
          const std::string msg = e.what();
          const std::string backend_op = op == "all_to_all_single" ? "all_to_all" : op;
          if (msg.find(backend_op) == std::string::npos) {
            std::lock_guard lock(m);
            unexpected = msg;
          }
          explained += msg.find("disagree on the sizes") != std::string::npos ? 1 : 0;
          ++errors;
        }
      },
      opts);
  INFO(unexpected);
  CHECK(unexpected.empty());
  REQUIRE(errors == 2);
  REQUIRE(explained >= 1);
  REQUIRE(seconds_since(t0) < 5.0);
}

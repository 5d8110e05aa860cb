// Point-to-point: send/recv/isend/irecv, in-order matching per (peer, tag), batch_isend_irecv ring
// exchanges in both directions (pipeline 1F1B) at 2-4 ranks, and P2P interleaved with collectives.

#include "common.hpp"

#include <catch2/catch.hpp>

using namespace comm_test;

TEMPLATE_TEST_CASE("send/recv and isend/irecv deliver in order per tag", "[comm][p2p]", float,
                   dtensor::bfloat16, std::int64_t, std::uint8_t) {
  using T = TestType;
  const int world = GENERATE(2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    // Ring: blocking send to the right on even ranks first, receive first on odd ranks (no deadlock).
    const int right = (r + 1) % n, left = (r + n - 1) % n;
    auto out = Tensor<T, 1>::full({5}, from_int<T>(r + 1));
    auto in = Tensor<T, 1>::full({5}, poison<T>());
    if (r % 2 == 0) {
      send(out, right, g);
      recv(in, left, g);
    } else {
      recv(in, left, g);
      send(out, right, g);
    }
    expect_values<T>(
        in, [&](auto) { return from_int<T>(left + 1); }, "send/recv ring");

    // Three successive messages with tag 0 and one with tag 7, received in a different tag order.
    if (r == 0) {
      std::vector<Work> ws;
      for (int j = 0; j < 3; ++j) {
        ws.push_back(isend(Tensor<T, 1>::full({3 + j}, from_int<T>(10 + j)), 1, g));
      }
      ws.push_back(isend(Tensor<T, 1>::full({2}, from_int<T>(99)), 1, g, 7));
      for (auto& w : ws) {
        w.wait();
      }
    } else if (r == 1) {
      auto tagged = Tensor<T, 1>::full({2}, poison<T>());
      auto wt = irecv(tagged, 0, g, 7);
      std::vector<Tensor<T, 1>> got;
      std::vector<Work> ws;
      for (int j = 0; j < 3; ++j) {
        got.push_back(Tensor<T, 1>::full({3 + j}, poison<T>()));
        ws.push_back(irecv(got.back(), 0, g));
      }
      for (int j = 2; j >= 0; --j) {
        ws[j].wait();
        expect_values<T>(
            got[j], [&](auto) { return from_int<T>(10 + j); }, "message " + std::to_string(j));
      }
      wt.wait();
      expect_values<T>(
          tagged, [&](auto) { return from_int<T>(99); }, "tag 7");
    }
    // Empty messages are legal.
    if (r == 0) {
      send(Tensor<T, 1>({0}), n - 1, g);
    } else if (r == n - 1) {
      recv(Tensor<T, 1>({0}), 0, g);
    }
  });
}

TEST_CASE("batch_isend_irecv ring exchange in both directions never deadlocks (1F1B)", "[comm][p2p]") {
  const int world = GENERATE(2, 3, 4);
  const std::int64_t numel = GENERATE(1, 1 << 18); // 4 B and 1 MiB of floats
  testing::run_ranks(world, [numel](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    for (int step = 0; step < 4; ++step) {
      auto act = Tensor<float, 1>::full({numel}, static_cast<float>(100 * step + r));   // forward to next
      auto grad = Tensor<float, 1>::full({numel}, static_cast<float>(-100 * step - r)); // backward to prev
      auto act_in = Tensor<float, 1>::full({numel}, -777.0f);
      auto grad_in = Tensor<float, 1>::full({numel}, -777.0f);
      // Every rank sends before it receives, in both directions at once.
      std::vector<P2POp> ops{{P2POp::isend, act, next, g, 1},
                             {P2POp::isend, grad, prev, g, 2},
                             {P2POp::irecv, act_in, prev, g, 1},
                             {P2POp::irecv, grad_in, next, g, 2}};
      auto works = batch_isend_irecv(ops);
      DTENSOR_CHECK(works.size() == ops.size(), "one Work per op");
      for (auto& w : works) {
        w.wait();
      }
      expect_values<float>(
          act_in, [&](auto) { return static_cast<float>(100 * step + prev); }, "activation");
      expect_values<float>(
          grad_in, [&](auto) { return static_cast<float>(-100 * step - next); }, "gradient");
    }
  });
}

TEST_CASE("point-to-point interleaves with collectives on the same group", "[comm][p2p]") {
  const int world = GENERATE(2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    // Rank 0 posts a receive, then joins an all_reduce; rank n-1 sends only after the all_reduce.
    auto box = Tensor<int, 1>::full({3}, -777);
    Work pending;
    if (r == 0) {
      pending = irecv(box, n - 1, g, 5);
    }
    auto t = Tensor<int, 1>::full({4}, r);
    all_reduce(t, ReduceOp::sum, g);
    expect_values<int>(
        t, [&](auto) { return n * (n - 1) / 2; }, "all_reduce");
    if (r == n - 1) {
      send(Tensor<int, 1>::full({3}, 1234), 0, g, 5);
    }
    auto w = all_reduce(t, ReduceOp::max, g, async_op);
    pending.wait();
    w.wait();
    if (r == 0) {
      expect_values<int>(
          box, [](auto) { return 1234; }, "irecv across collectives");
    }
    expect_values<int>(
        t, [&](auto) { return n * (n - 1) / 2; }, "async all_reduce");
  });
}

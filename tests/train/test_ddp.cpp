// DDP (train/ddp.hpp): bucket assignment as plain values; a 2-layer MLP (matmul, bias, gelu, matmul,
// bias; tensor parallel over tp) trained with SGD on a batch sharded over dp equals the same training on one
// rank (double, 1e-12) on (dp, tp) = (1..4, 1) and (2, 2), with uneven batch shards; CommDebugMode pins one
// all_reduce over dp per bucket per step and the bucket boundaries as configured; a bucket's all_reduce is
// issued before later gradients are computed (overlap), and buckets are issued in order.
#include <catch2/catch.hpp>

#include <dtensor/backward/redistribute.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/local/copy.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/init.hpp>
#include <dtensor/ops/matmul.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/ddp.hpp>
#include <dtensor/train/optim.hpp>

#include "../support/ops_tensors.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"tp">>;
using Buckets = std::vector<std::vector<int>>;

constexpr std::int64_t kIn = 5, kHidden = 6, kOut = 3;

struct Trained {
  std::vector<double> losses;
  Tensor<double, 2> w1, w2;
  Tensor<double, 1> b1, b2;
  Buckets buckets;
  std::vector<std::int64_t> all_reduces; ///< dp all_reduces in each step's backward
  std::vector<std::int64_t> before_w2;   ///< dp all_reduces issued when dw2 is computed
  std::vector<std::int64_t> before_w1;   ///< ... when dw1 is computed
  std::vector<std::int64_t> other_comm;  ///< other communication in the backward
};

// How each rank normalizes its loss.
enum class Loss {
  global_mean, // 0.5 / B |y - t|^2 over the whole batch: gradients Partial<sum> over dp, summed
  local_mean,  // torch DDP's: each rank's 0.5 / B_rank |y_rank - t_rank|^2, gradients averaged over dp
};

// The MLP's parameters W1 [R,S(1)], b1 [R,S(0)], W2 [R,S(0)], b2 [R,R], as torch's Linear initialises them.
auto init_params(const DeviceMesh<Mesh>& mesh) {
  auto w1 = zeros<double, R, S<1>>(mesh, {kIn, kHidden});
  auto b1 = zeros<double, R, S<0>>(mesh, {kHidden});
  auto w2 = zeros<double, R, S<0>>(mesh, {kHidden, kOut});
  auto b2 = zeros<double, R, R>(mesh, {kOut});
  init::InitKeys keys(5);
  // matmul weights are (in, out): their fan_in is torch's fan_out.
  init::kaiming_uniform_(w1, keys.next(), std::sqrt(5.0), init::FanMode::fan_out);
  init::linear_bias_(b1, kIn, keys.next());
  init::kaiming_uniform_(w2, keys.next(), std::sqrt(5.0), init::FanMode::fan_out);
  init::linear_bias_(b2, kHidden, keys.next());
  return std::tuple{w1, b1, w2, b2};
}

// The MLP y = gelu(x W1 + b1) W2 + b2, W1 column parallel [R,S(1)], W2 row parallel [R,S(0)], trained for
// `steps` steps of SGD with momentum on the loss 0.5 / B * |y - t|^2 with a batch of `batch` rows sharded
// over dp.
Trained train(const DeviceMesh<Mesh>& mesh, DDPOptions options, int steps, std::int64_t batch, Loss kind) {
  auto [w1, b1, w2, b2] = init_params(mesh);

  auto reducer = ddp_reducer<"dp">(options, w1, b1, w2, b2);
  optim::SGD opt({.lr = 0.2, .momentum = 0.9, .weight_decay = 0.01});
  Trained out;
  out.buckets = reducer.buckets();
  using X = DTensor<double, 2, Mesh, S<0>, R>;
  for (int step = 0; step < steps; ++step) {
    X x = make<X>(mesh, {batch, kIn}, 100 + step);
    local::scale(x.local(), 0.25);
    X t = make<X>(mesh, {batch, kOut}, 200 + step);
    local::scale(t.local(), 0.25);
    // Forward.
    auto [h0, mm1_back] = matmul(x, w1, with_backward);           // [S(0),S(1)]
    auto [h, add1_back] = add(h0, b1, with_backward);             // [S(0),S(1)]
    auto [a, gelu_back] = gelu(h, with_backward);                 // [S(0),S(1)]
    auto [y0, mm2_back] = matmul(a, w2, with_backward);           // [S(0),P]
    auto [y1, ar_back] = redistribute_with_backward<S<0>, R>(y0); // all_reduce(tp)
    auto [y, add2_back] = add(y1, b2, with_backward);             // [S(0),R]
    const auto diff = sub(y, t);
    const auto full = diff.full_tensor();
    double loss = 0;
    for (std::int64_t e = 0; e < full.numel(); ++e) {
      loss += full.data()[e] * full.data()[e];
    }
    out.losses.push_back(0.5 / static_cast<double>(batch) * loss);
    const auto rows = static_cast<double>(kind == Loss::local_mean ? diff.local().shape()[0] : batch);
    const auto dy = scale(diff, 1.0 / rows);
    auto hand_over = [&](int i, auto g) {
      if (kind == Loss::local_mean) {
        return reducer.ready(i, as_partial_avg<"dp">(g)); // [P(avg)] -> [R]: the mean
      }
      return reducer.ready(i, g); // [P(sum)] -> [R]: the sum
    };

    // Backward, handing each gradient to the reducer as soon as it exists.
    CommDebugMode comm;
    auto [dy1, db2] = add2_back(dy);
    static_assert(std::is_same_v<decltype(db2), DTensor<double, 1, Mesh, P, R>>);
    auto g_b2 = hand_over(3, db2); // [P,R] -> [R,R]
    static_assert(std::is_same_v<decltype(g_b2), decltype(b2)>);
    const auto dy0 = ar_back(dy1);
    out.before_w2.push_back(comm.count("all_reduce", "dp"));
    auto [da, dw2] = mm2_back(dy0);
    static_assert(std::is_same_v<decltype(dw2), DTensor<double, 2, Mesh, P, S<0>>>);
    auto g_w2 = hand_over(2, dw2);
    auto [dh0, db1] = add1_back(gelu_back(da));
    auto g_b1 = hand_over(1, db1);
    out.before_w1.push_back(comm.count("all_reduce", "dp"));
    auto [dx, dw1] = mm1_back(dh0);
    (void)dx;
    auto g_w1 = hand_over(0, dw1);
    static_assert(std::is_same_v<decltype(g_w1), decltype(w1)>);
    reducer.finish();
    out.all_reduces.push_back(comm.count("all_reduce", "dp"));
    out.other_comm.push_back(comm.total_count() - comm.count("all_reduce", "dp"));

    opt.step(std::tie(w1, b1, w2, b2), std::tie(g_w1, g_b1, g_w2, g_b2));
  }
  out.w1 = w1.full_tensor();
  out.b1 = b1.full_tensor();
  out.w2 = w2.full_tensor();
  out.b2 = b2.full_tensor();
  return out;
}

// The same MLP and loss (global mean) trained by plain SGD with gradient accumulation: each step's batch
// of `micro` x `batch` rows in `micro` micro-batches, the first micro - 1 handed to accumulate() (no
// communication), the last to ready(); with `whole`, the same rows as one batch (the reference). Returns
// the losses, the parameters, and the dp all_reduces of each step.
Trained train_accumulated(const DeviceMesh<Mesh>& mesh, int steps, std::int64_t batch, int micro,
                          bool whole) {
  auto [w1, b1, w2, b2] = init_params(mesh);
  auto reducer = ddp_reducer<"dp">({.bucket_cap_bytes = 150, .first_bucket_cap_bytes = 1}, w1, b1, w2, b2);
  optim::SGD opt({.lr = 0.2});
  Trained out;
  using X = DTensor<double, 2, Mesh, S<0>, R>;
  const std::int64_t total = micro * batch;
  for (int step = 0; step < steps; ++step) {
    const auto x_all = make<X>(mesh, {total, kIn}, 100 + step).full_tensor();
    const auto t_all = make<X>(mesh, {total, kOut}, 200 + step).full_tensor();
    CommDebugMode comm;
    double loss = 0;
    const int parts = whole ? 1 : micro;
    const std::int64_t rows = whole ? total : batch;
    for (int k = 0; k < parts; ++k) {
      const X x = scale(
          distribute_tensor<S<0>, R>(mesh, x_all.narrow(0, k * rows, rows).contiguous(), replicated_source),
          0.25);
      const X t = scale(
          distribute_tensor<S<0>, R>(mesh, t_all.narrow(0, k * rows, rows).contiguous(), replicated_source),
          0.25);
      auto [h0, mm1_back] = matmul(x, w1, with_backward);
      auto [h, add1_back] = add(h0, b1, with_backward);
      auto [a, gelu_back] = gelu(h, with_backward);
      auto [y0, mm2_back] = matmul(a, w2, with_backward);
      auto [y1, ar_back] = redistribute_with_backward<S<0>, R>(y0);
      auto [y, add2_back] = add(y1, b2, with_backward);
      const auto diff = sub(y, t);
      const auto full = diff.full_tensor();
      for (std::int64_t e = 0; e < full.numel(); ++e) {
        loss += 0.5 / static_cast<double>(total) * full.data()[e] * full.data()[e];
      }
      auto [dy1, db2] = add2_back(scale(diff, 1.0 / static_cast<double>(total)));
      auto [da, dw2] = mm2_back(ar_back(dy1));
      auto [dh0, db1] = add1_back(gelu_back(da));
      auto [dx, dw1] = mm1_back(dh0);
      (void)dx;
      if (k + 1 < parts) {
        reducer.accumulate(3, db2);
        reducer.accumulate(2, dw2);
        reducer.accumulate(1, db1);
        reducer.accumulate(0, dw1);
        continue;
      }
      auto g_b2 = reducer.ready(3, db2);
      auto g_w2 = reducer.ready(2, dw2);
      auto g_b1 = reducer.ready(1, db1);
      auto g_w1 = reducer.ready(0, dw1);
      reducer.finish();
      opt.step(std::tie(w1, b1, w2, b2), std::tie(g_w1, g_b1, g_w2, g_b2));
    }
    out.losses.push_back(loss);
    out.all_reduces.push_back(comm.count("all_reduce", "dp"));
  }
  out.buckets = reducer.buckets();
  out.w1 = w1.full_tensor();
  out.b1 = b1.full_tensor();
  out.w2 = w2.full_tensor();
  out.b2 = b2.full_tensor();
  return out;
}

template <class T, int N>
double max_difference(const Tensor<T, N>& a, const Tensor<T, N>& b) {
  double d = 0;
  for (std::int64_t e = 0; e < a.numel(); ++e) {
    d = std::max(d, std::abs(double(a.data()[e]) - double(b.data()[e])));
  }
  return d;
}

} // namespace

TEST_CASE("DDP buckets: walked from the last parameter, closed at the caps (the first bucket's own)",
          "[parallel]") {
  // Bytes of parameters 0..3: 240, 48, 144, 24.
  const std::vector<std::int64_t> bytes = {240, 48, 144, 24};
  CHECK(assign_buckets(bytes, 1, 150) == Buckets{{3}, {2, 1}, {0}});
  CHECK(assign_buckets(bytes, 1 << 20, 25 << 20) == Buckets{{3, 2, 1, 0}}); // torch's defaults: one bucket
  CHECK(assign_buckets(bytes, 24, 24) == Buckets{{3}, {2}, {1}, {0}});
  CHECK(assign_buckets(bytes, 200, 100) == Buckets{{3, 2, 1}, {0}}); // 216 >= 200 closes the first
  CHECK(assign_buckets({}, 1, 1).empty());
  const DDPOptions defaults;
  CHECK(defaults.bucket_cap_bytes == 25 * 1024 * 1024);
  CHECK(defaults.first_bucket_cap_bytes == 1024 * 1024);
}

TEST_CASE("DDP: a 2-layer MLP trained on a dp-sharded batch equals the one-rank training (1e-12), one "
          "all_reduce per bucket per step, issued while the backward runs, on (1..4, 1) and (2, 2)",
          "[parallel]") {
  const int steps = 3;
  const DDPOptions small{.bucket_cap_bytes = 150, .first_bucket_cap_bytes = 1};
  // A loss over the global batch of 7 rows (uneven shards; gradients summed), and torch's per-rank mean
  // over 12 rows (even shards; gradients averaged).
  for (auto [batch, kind] :
       {std::pair{std::int64_t{7}, Loss::global_mean}, std::pair{std::int64_t{12}, Loss::local_mean}}) {
    INFO((kind == Loss::global_mean ? "global-batch loss, " : "per-rank mean loss, ") << batch << " rows");
    Trained want;
    testing::run_ranks(1, [&, batch = batch, kind = kind](ProcessGroup& world) {
      want = train(init_device_mesh<Mesh>(world, 1, 1), small, steps, batch, kind);
    });
    CHECK(want.buckets == Buckets{{3}, {2, 1}, {0}});
    for (auto [dp, tp, options] :
         {std::tuple{1, 1, small}, std::tuple{2, 1, small}, std::tuple{3, 1, small}, std::tuple{4, 1, small},
          std::tuple{2, 2, small}, std::tuple{2, 2, DDPOptions{}}, std::tuple{3, 1, DDPOptions{}}}) {
      INFO("mesh (" << dp << ", " << tp << "), bucket caps " << options.first_bucket_cap_bytes << " / "
                    << options.bucket_cap_bytes);
      testing::run_ranks(
          dp * tp, [&, dp = dp, tp = tp, options = options, batch = batch, kind = kind](ProcessGroup& world) {
            const Trained got = train(init_device_mesh<Mesh>(world, dp, tp), options, steps, batch, kind);
            for (int s = 0; s < steps; ++s) {
              expect(std::abs(got.losses[s] - want.losses[s]) <= 1e-12 * std::abs(want.losses[s]),
                     "loss at step " + std::to_string(s) + ": " + std::to_string(got.losses[s]) + " vs " +
                         std::to_string(want.losses[s]));
            }
            expect(want.losses[steps - 1] < want.losses[0], "the loss decreases");
            expect(max_difference(got.w1, want.w1) <= 1e-12 && max_difference(got.b1, want.b1) <= 1e-12 &&
                       max_difference(got.w2, want.w2) <= 1e-12 && max_difference(got.b2, want.b2) <= 1e-12,
                   "final parameters differ from the one-rank training");
            // Local sizes (doubles): W1 5 x 6/tp, b1 6/tp, W2 6/tp x 3, b2 3.
            const Buckets expected = options.bucket_cap_bytes == 150
                                         ? (tp == 1 ? Buckets{{3}, {2, 1}, {0}} : Buckets{{3}, {2, 1, 0}})
                                         : Buckets{{3, 2, 1, 0}};
            expect(got.buckets == expected, "bucket boundaries");
            // One all_reduce per bucket; none over a dp of one rank (a size-1 axis costs nothing).
            const std::int64_t k = dp > 1 ? 1 : 0;
            const auto n = static_cast<std::int64_t>(expected.size());
            for (int s = 0; s < steps; ++s) {
              expect(got.all_reduces[s] == n * k,
                     "step " + std::to_string(s) + ": " + std::to_string(got.all_reduces[s]) +
                         " all_reduces over dp, want one per bucket: " + std::to_string(n));
              expect(got.other_comm[s] == 0, "the backward communicates only DDP's all_reduces");
              if (n > 1) {
                // The bucket of b2 was in flight while dW2 was computed, and every bucket but W1's while dW1
                // was.
                expect(got.before_w2[s] == k, "b2's bucket issued before dW2 is computed");
                expect(got.before_w1[s] == (n - 1) * k, "all buckets but W1's issued before dW1 is computed");
              } else {
                expect(got.before_w1[s] == 0, "one bucket: issued with the last gradient");
              }
            }
          });
    }
  }
}

TEST_CASE(
    "DDP gradient accumulation: 3 micro-batches, one all_reduce per bucket, equal to one rank's 3x batch",
    "[parallel]") {
  const int steps = 3;
  Trained want;
  testing::run_ranks(1, [&](ProcessGroup& world) {
    want = train_accumulated(init_device_mesh<Mesh>(world, 1, 1), steps, 5, 3, true);
  });
  for (auto [dp, tp] :
       {std::pair{1, 1}, std::pair{2, 1}, std::pair{3, 1}, std::pair{4, 1}, std::pair{2, 2}}) {
    INFO("mesh (" << dp << ", " << tp << ")");
    testing::run_ranks(dp * tp, [&, dp = dp, tp = tp](ProcessGroup& world) {
      const Trained got = train_accumulated(init_device_mesh<Mesh>(world, dp, tp), steps, 5, 3, false);
      for (int s = 0; s < steps; ++s) {
        expect(std::abs(got.losses[s] - want.losses[s]) <= 1e-12 * std::abs(want.losses[s]),
               "loss at step " + std::to_string(s) + ": " + std::to_string(got.losses[s]) + " vs " +
                   std::to_string(want.losses[s]));
        expect(got.all_reduces[s] == (dp > 1 ? static_cast<std::int64_t>(got.buckets.size()) : 0),
               "step " + std::to_string(s) + ": " + std::to_string(got.all_reduces[s]) +
                   " all_reduces over dp, want one per bucket for the three micro-batches");
      }
      expect(max_difference(got.w1, want.w1) <= 1e-12 && max_difference(got.b1, want.b1) <= 1e-12 &&
                 max_difference(got.w2, want.w2) <= 1e-12 && max_difference(got.b2, want.b2) <= 1e-12,
             "final parameters differ from the one-rank training on the whole batch");
    });
  }
}

TEST_CASE("DDPReducer: buckets issued in order as they complete, the sum or mean over dp, errors",
          "[parallel]") {
  testing::run_ranks(3, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, 3, 1);
    using G = DTensor<double, 1, Mesh, P, R>;
    // Four parameters of 2 doubles (16 bytes): buckets [3], [2, 1], [0] with caps 16 / 32.
    DDPReducer<"dp", double, Mesh> reducer(mesh, {2, 2, 2, 2},
                                           {.bucket_cap_bytes = 32, .first_bucket_cap_bytes = 16});
    REQUIRE(reducer.buckets() == Buckets{{3}, {2, 1}, {0}});
    const int me = mesh.local_rank<"dp">();
    auto grad = [&](int i) { // rank r holds (r + 1) * (i + 1) at both elements
      return G(mesh, Tensor<double, 1>::full({2}, double((me + 1) * (i + 1))), {2});
    };
    CommDebugMode comm;
    std::vector<int> issued;
    auto g0 = reducer.ready(0, grad(0)); // bucket 2 complete, bucket 0 not: nothing issued
    issued.push_back(reducer.buckets_issued());
    auto g2 = reducer.ready(2, grad(2));
    issued.push_back(reducer.buckets_issued());
    auto g3 = reducer.ready(3, grad(3)); // bucket 0 complete: issued; bucket 1 not
    issued.push_back(reducer.buckets_issued());
    auto g1 = reducer.ready(1, grad(1)); // bucket 1 complete, then bucket 2 (ready since the first call)
    issued.push_back(reducer.buckets_issued());
    expect(issued == std::vector<int>{0, 0, 1, 3}, "buckets issued in order");
    expect(comm.count("all_reduce", "dp") == 3, "one all_reduce per bucket");
    reducer.finish();
    // Partial<sum>: the sum over dp of (r + 1) * (i + 1), (1 + 2 + 3) (i + 1) = 6 (i + 1).
    int i = 0;
    for (const auto& g : {g0.local(), g1.local(), g2.local(), g3.local()}) {
      expect(g(0) == 6.0 * (i + 1) && g(1) == 6.0 * (i + 1), "sum of parameter " + std::to_string(i));
      ++i;
    }
    // The next step reuses the reducer; a missing gradient and a second hand-over are errors.
    (void)reducer.ready(1, grad(1));
    bool threw = false;
    try {
      (void)reducer.ready(1, grad(1));
    } catch (const Error& e) {
      threw = std::string(e.what()).find("already handed over") != std::string::npos;
    }
    expect(threw, "ready() twice in a step");
    threw = false;
    try {
      reducer.finish();
    } catch (const Error& e) {
      threw = std::string(e.what()).find("parameter(s) 0, 2, 3") != std::string::npos;
    }
    expect(threw, "finish() with gradients missing");
    // Complete the step, with Partial<avg> gradients: the mean over dp, 2 (i + 1) (up to the rounding of the
    // 1 / 3 each gradient is multiplied by).
    const auto h0 = reducer.ready(0, as_partial_avg<"dp">(grad(0)));
    static_assert(std::is_same_v<decltype(h0), const DTensor<double, 1, Mesh, R, R>>);
    const auto h2 = reducer.ready(2, as_partial_avg<"dp">(grad(2)));
    const auto h3 = reducer.ready(3, as_partial_avg<"dp">(grad(3)));
    reducer.finish();
    i = 0;
    for (const auto& g : {h0.local(), h2.local(), h3.local()}) {
      const double want = 2.0 * (i == 0 ? 1 : i + 2);
      expect(std::abs(g(0) - want) < 1e-15 * want && std::abs(g(1) - want) < 1e-15 * want,
             "mean of a Partial<avg> gradient");
      ++i;
    }
  });
}

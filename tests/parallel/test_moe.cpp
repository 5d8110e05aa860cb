// The mixture-of-experts layer (parallel/moe.hpp): on expert-parallel groups of 1, 2 and 4 ranks each rank's
// outputs, its input gradient, the router's gradient summed over the ranks and every expert's weight
// gradients equal the same mixture run on one rank over each rank's tokens (capacity is per rank's batch),
// top-1 and top-2, with and without a capacity factor (dropped counts equal), few tokens and many experts (so
// experts get no tokens and ranks send nothing to some peers), a rank with no tokens at all. The one-rank
// mixture itself is checked by central finite differences. CommDebugMode: two all_to_all_single forward
// (counts, rows) plus the combine, two backward.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/parallel/moe.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

Tensor<double, 2> tokens_of(int rank, std::int64_t t, std::int64_t hidden) {
  return local::randn<double, 2>({t, hidden}, 100, static_cast<std::uint64_t>(rank));
}
Tensor<double, 2> grad_of(int rank, std::int64_t t, std::int64_t hidden) {
  return local::randn<double, 2>({t, hidden}, 200, static_cast<std::uint64_t>(rank));
}

void close(const Tensor<double, 2>& got, const Tensor<double, 2>& want, const std::string& what) {
  expect(got.shape() == want.shape(), what + ": shape");
  for (std::int64_t e = 0; e < want.numel(); ++e) {
    expect(std::abs(got.data()[e] - want.data()[e]) <= 1e-12 * (1 + std::abs(want.data()[e])),
           what + ": element " + std::to_string(e) + " is " + std::to_string(got.data()[e]) + ", want " +
               std::to_string(want.data()[e]));
  }
}

Tensor<double, 2> plus(const Tensor<double, 2>& a, const Tensor<double, 2>& b) {
  return local::map(local::Add{}, a, b);
}

struct Reference {
  std::vector<Tensor<double, 2>> y, dx;  // per rank
  Tensor<double, 2> router;              // summed over ranks
  std::vector<Tensor<double, 2>> w1, w2; // per global expert, summed over ranks
  std::vector<std::int64_t> dropped;     // per rank
};

// The mixture on one rank, each of `ranks` ranks' tokens in turn.
Reference reference(const MoEConfig& c, int ranks, const std::vector<std::int64_t>& t) {
  Reference ref;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    MoE<double> moe(one, c, 7);
    for (int r = 0; r < ranks; ++r) {
      auto [y, back] = moe.forward(tokens_of(r, t[r], c.hidden), with_backward);
      MoEGrads<double> g = back(grad_of(r, t[r], c.hidden));
      ref.y.push_back(y);
      ref.dx.push_back(g.dx);
      ref.dropped.push_back(back.dropped());
      ref.router = r == 0 ? g.router : plus(ref.router, g.router);
      for (int e = 0; e < c.experts; ++e) {
        if (r == 0) {
          ref.w1.push_back(g.w1[e]);
          ref.w2.push_back(g.w2[e]);
        } else {
          ref.w1[e] = plus(ref.w1[e], g.w1[e]);
          ref.w2[e] = plus(ref.w2[e], g.w2[e]);
        }
      }
    }
  });
  return ref;
}

void moe_case(const MoEConfig& c, int ranks, const std::vector<std::int64_t>& t, const std::string& name) {
  const Reference ref = reference(c, ranks, t);
  testing::run_ranks(ranks, [&](ProcessGroup& ep) {
    const int r = ep.rank();
    MoE<double> moe(ep, c, 7);
    CommDebugMode comm;
    auto [y, back] = moe.forward(tokens_of(r, t[r], c.hidden), with_backward);
    const std::int64_t forward_collectives = comm.total_count();
    MoEGrads<double> g = back(grad_of(r, t[r], c.hidden));
    close(y, ref.y[r], name + ": y");
    close(g.dx, ref.dx[r], name + ": dx");
    expect(back.dropped() == ref.dropped[r],
           name + ": dropped " + std::to_string(back.dropped()) + ", want " + std::to_string(ref.dropped[r]));
    if (ranks > 1) {
      expect(forward_collectives == 3, name + ": forward collectives\n" + comm.to_string());
      expect(comm.total_count() == 5, name + ": forward + backward collectives\n" + comm.to_string());
    }
    // The router's gradient: this rank's part; the sum over ranks is the reference.
    Tensor<double, 2> router = g.router.clone();
    all_reduce(router, ReduceOp::sum, ep);
    close(router, ref.router, name + ": router gradient");
    for (int j = 0; j < moe.local_experts(); ++j) {
      const int e = r * moe.local_experts() + j;
      close(g.w1[j], ref.w1[e], name + ": W1 gradient of expert " + std::to_string(e));
      close(g.w2[j], ref.w2[e], name + ": W2 gradient of expert " + std::to_string(e));
    }
  });
}

} // namespace

TEST_CASE("MoE on 1, 2 and 4 ranks equals one rank: top-1 and top-2, capacity, empty experts and ranks",
          "[parallel]") {
  for (int k : {1, 2}) {
    for (double cf : {0.0, 1.0}) {
      const MoEConfig c{6, 5, 8, k, cf};
      const std::string name = "top-" + std::to_string(k) + " cf " + std::to_string(cf);
      moe_case(c, 1, {9}, name + " 1 rank");
      moe_case(c, 2, {9, 4}, name + " 2 ranks");
      moe_case(c, 4, {5, 3, 0, 7}, name + " 4 ranks (one without tokens)");
      moe_case(c, 4, {1, 1, 1, 1}, name + " 4 ranks, one token each");
    }
  }
}

TEST_CASE("MoE capacity: assignments over an expert's capacity are dropped in token order and counted",
          "[parallel]") {
  testing::run_ranks(1, [&](ProcessGroup& one) {
    // 2 experts, 10 tokens, top-1, capacity factor 0.5: ceil(0.5 * 10 / 2) = 3 per expert.
    MoE<double> moe(one, {4, 3, 2, 1, 0.5}, 3);
    auto [y, back] = moe.forward(tokens_of(0, 10, 4), with_backward);
    expect(back.dropped() >= 4, "at most 6 of 10 fit: dropped " + std::to_string(back.dropped()));
    // A dropped token's output is zero.
    std::int64_t zero_rows = 0;
    for (std::int64_t i = 0; i < 10; ++i) {
      bool zero = true;
      for (std::int64_t h = 0; h < 4; ++h) {
        zero = zero && y(i, h) == 0.0;
      }
      zero_rows += zero ? 1 : 0;
    }
    expect(zero_rows == back.dropped(),
           "rows of zeros " + std::to_string(zero_rows) + ", dropped " + std::to_string(back.dropped()));
  });
}

TEST_CASE("MoE on one rank: gradients by central finite differences (top-2, no capacity)", "[parallel]") {
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const MoEConfig c{4, 3, 4, 2, 0.0};
    MoE<double> moe(one, c, 5);
    const Tensor<double, 2> x = tokens_of(0, 5, 4);
    const Tensor<double, 2> dy = grad_of(0, 5, 4);
    auto loss = [&] {
      const auto y = moe.forward(x);
      double s = 0;
      for (std::int64_t e = 0; e < y.numel(); ++e) {
        s += y.data()[e] * dy.data()[e];
      }
      return s;
    };
    auto [y, back] = moe.forward(x, with_backward);
    const MoEGrads<double> g = back(dy);
    auto check = [&](Tensor<double, 2> param, const Tensor<double, 2>& grad, const std::string& what) {
      for (std::int64_t e = 0; e < param.numel(); e += 3) {
        const double keep = param.data()[e];
        const double h = 1e-6;
        param.data()[e] = keep + h;
        const double up = loss();
        param.data()[e] = keep - h;
        const double down = loss();
        param.data()[e] = keep;
        const double fd = (up - down) / (2 * h);
        expect(std::abs(fd - grad.data()[e]) <= 1e-6 * (1 + std::abs(fd)),
               what + ": element " + std::to_string(e) + " is " + std::to_string(grad.data()[e]) +
                   ", finite differences " + std::to_string(fd));
      }
    };
    check(moe.router, g.router, "router");
    check(moe.w1[1], g.w1[1], "W1 of expert 1");
    check(moe.w2[2], g.w2[2], "W2 of expert 2");
    check(x, g.dx, "dx");
  });
}

TEST_CASE(
    "MoE on a (dp, ep) = (2, 2) mesh: experts over ep, replicas over dp, gradients reduced over dp equal "
    "one rank",
    "[parallel]") {
  using Mesh = MeshShape<Axis<"dp">, Axis<"ep">>;
  const MoEConfig c{6, 5, 4, 2, 1.0};
  const std::vector<std::int64_t> t{5, 3, 6, 4};
  const Reference ref = reference(c, 4, t);
  testing::run_ranks(4, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, 2, 2);
    const ProcessGroup& dp = mesh.group(0);
    const ProcessGroup& ep = mesh.group(1);
    const int w = world.rank();
    MoE<double> moe(ep, c, 7);
    auto [y, back] = moe.forward(tokens_of(w, t[w], c.hidden), with_backward);
    MoEGrads<double> g = back(grad_of(w, t[w], c.hidden));
    close(y, ref.y[w], "(dp, ep): y");
    close(g.dx, ref.dx[w], "(dp, ep): dx");
    Tensor<double, 2> router = g.router.clone();
    all_reduce(router, ReduceOp::sum, world);
    close(router, ref.router, "(dp, ep): router gradient");
    for (int j = 0; j < moe.local_experts(); ++j) {
      const int e = ep.rank() * moe.local_experts() + j;
      Tensor<double, 2> w1 = g.w1[j].clone();
      all_reduce(w1, ReduceOp::sum, dp);
      close(w1, ref.w1[e], "(dp, ep): W1 gradient of expert " + std::to_string(e));
    }
  });
}

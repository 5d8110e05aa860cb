// nn::Moe (nn/moe.hpp): the mixture-of-experts layer on DTensors. The one-rank layer against a
// plain loop reference (routing, capacity in token order, SwiGLU experts, combine, the load-balancing
// loss) and its gradients against central finite differences of L = <y, g> + coeff * aux; then every layout
// against the one-rank layer: the output, the input's and every parameter's full gradient, the stats —
// expert parallel alone on 1-4 ranks, EP x DP (2 x 2), EP x TP with and without sequence parallelism
// (2 x 2), DP x TP without ep (every expert on every rank); top-1 and top-2, dropless and with a capacity
// that drops, 12 experts over few tokens (experts and ranks that get nothing), batch 3 (a rank with no
// tokens at 4 ranks). The collectives are pinned per layout; bad configurations name their sizes. Last, the
// MoE GPT (nn::LanguageModel of nn::MoeBlock: GQA attention + the mixture) trained by nn::DdpTrainer for
// three AdamW steps on EP x DP (2 x 2), EP alone (1 x 4) and EP x TP + SP (2 x 2), and by nn::FsdpTrainer
// on EP x FSDP (2 x 2: the experts sharded over ep, every shard over dp): the losses, the gradient
// norms, the stats and the final parameters equal one rank's within 1e-10, the exchanges per step pinned.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/block.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/nn/moe.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"ep">, Axis<"tp">>;
using Ep = nn::Layout<Mesh, nn::ExpertParallel<"ep">>;
using EpTp = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::ExpertParallel<"ep">>;
using EpTpSp = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::ExpertParallel<"ep">>;
using DpTp = nn::Layout<Mesh, nn::TensorParallel<"tp">>;
using Vec = std::vector<double>;

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

struct Case {
  std::int64_t batch = 3, seq = 5, hidden = 8;
  nn::MoeConfig c{
      .experts = 12, .top_k = 2, .ffn = 6, .capacity_factor = 0, .aux_loss_coeff = 0.01, .init_std = 0.5};
};

/// Inputs and the output's gradient: a fixed pattern (batch, seq, hidden).
Tensor<double, 3> pattern(const Case& k, int salt) {
  Tensor<double, 3> t({k.batch, k.seq, k.hidden});
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = std::sin(0.7 * double(i) + salt) * (1 + 0.1 * double((i * 7 + salt) % 5));
  }
  return t;
}

template <class L>
nn::act_t<L, double> act(const DeviceMesh<Mesh>& mesh, const Tensor<double, 3>& full) {
  return [&]<class... Q>(DTensor<double, 3, Mesh, Q...>*) {
    return distribute_tensor<Q...>(mesh, full);
  }(static_cast<nn::act_t<L, double>*>(nullptr));
}

Vec flat(const auto& t) {
  return Vec(t.data(), t.data() + t.numel());
}

struct Result {
  Vec y, dx;
  std::vector<Vec> params, grads; ///< router, W1, W3, W2: full
  nn::MoeStats stats;
  std::int64_t fwd_a2a = 0, fwd_gather = 0, bwd_a2a = 0, fwd_total = 0, bwd_total = 0;
};

template <class L>
Result run_layer(const DeviceMesh<Mesh>& mesh, const Case& k) {
  init::InitKeys keys(11);
  nn::Moe<double, L> moe(mesh, k.hidden, k.c, keys);
  const auto x = act<L>(mesh, pattern(k, 1));
  const auto g = act<L>(mesh, pattern(k, 2));
  Result r;
  CommDebugMode comm;
  auto [y, back] = moe.forward(x, with_backward);
  r.fwd_a2a = comm.count("all_to_all", "ep");
  // The counts' all_gather runs over the token axes (every axis but tp) of more than one rank.
  std::string token_axes;
  for (int a = 0; a < mesh.num_axes(); ++a) {
    if (a != L::tp && mesh.size(a) > 1) {
      token_axes += (token_axes.empty() ? "" : "*") + std::string(mesh.names()[a]);
    }
  }
  r.fwd_gather = token_axes.empty() ? 0 : comm.count("all_gather", token_axes);
  r.fwd_total = comm.total_count();
  r.stats = moe.stats();
  comm.reset();
  auto [dx, grads] = back(g);
  r.bwd_a2a = comm.count("all_to_all", "ep");
  r.bwd_total = comm.total_count();
  r.y = flat(y.full_tensor());
  r.dx = flat(dx.full_tensor());
  std::apply([&](const auto&... w) { (r.grads.push_back(flat(w.full_tensor())), ...); }, grads);
  std::apply([&](const auto&... w) { (r.params.push_back(flat(w.full_tensor())), ...); }, moe.parameters());
  return r;
}

void close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  expect(got.size() == want.size(),
         what + ": " + std::to_string(got.size()) + " elements, want " + std::to_string(want.size()));
  for (std::size_t i = 0; i < want.size(); ++i) {
    expect(std::abs(got[i] - want[i]) <= tol * (1 + std::abs(want[i])),
           what + ": element " + std::to_string(i) + " is " + std::to_string(got[i]) + ", want " +
               std::to_string(want[i]));
  }
}

// ---- the plain reference: the layer's forward in loops ---------------------------------------------------

struct Plain {
  Vec y;
  double aux = 0;
  std::int64_t dropped = 0;
  std::vector<std::int64_t> per_expert;
};

double silu(double v) {
  return v / (1 + std::exp(-v));
}

/// router (E, H), w1/w3 (E, F, H), w2 (E, H, F); x (T, H).
Plain plain_forward(const Vec& x, const std::vector<Vec>& p, std::int64_t t, std::int64_t h,
                    const nn::MoeConfig& c) {
  const std::int64_t e_count = c.experts, f = c.ffn;
  const int k = c.top_k;
  Plain out;
  out.y.assign(static_cast<std::size_t>(t * h), 0.0);
  out.per_expert.assign(static_cast<std::size_t>(e_count), 0);
  Vec probs(static_cast<std::size_t>(t * e_count));
  std::vector<std::vector<std::pair<std::int64_t, double>>> picks(static_cast<std::size_t>(t));
  for (std::int64_t i = 0; i < t; ++i) {
    Vec l(static_cast<std::size_t>(e_count));
    for (std::int64_t e = 0; e < e_count; ++e) {
      for (std::int64_t j = 0; j < h; ++j) {
        l[e] += x[i * h + j] * p[0][e * h + j];
      }
    }
    const double m = *std::max_element(l.begin(), l.end());
    double s = 0;
    for (double& v : l) {
      v = std::exp(v - m);
      s += v;
    }
    for (std::int64_t e = 0; e < e_count; ++e) {
      probs[i * e_count + e] = l[e] / s;
    }
    std::vector<std::int64_t> order(static_cast<std::size_t>(e_count));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return probs[i * e_count + a] > probs[i * e_count + b];
    });
    double sum = 0;
    for (int j = 0; j < k; ++j) {
      sum += probs[i * e_count + order[j]];
    }
    for (int j = 0; j < k; ++j) {
      const double pr = probs[i * e_count + order[j]];
      picks[i].push_back({order[j], k == 1 ? pr : pr / sum});
      ++out.per_expert[order[j]];
    }
  }
  const std::int64_t cap =
      c.capacity_factor > 0
          ? static_cast<std::int64_t>(std::ceil(c.capacity_factor * double(t * k) / e_count))
          : -1;
  std::vector<std::int64_t> taken(static_cast<std::size_t>(e_count), 0);
  for (std::int64_t i = 0; i < t; ++i) {
    for (const auto& [e, gate] : picks[i]) {
      if (cap >= 0 && taken[e]++ >= cap) {
        ++out.dropped;
        continue;
      }
      Vec a(static_cast<std::size_t>(f));
      for (std::int64_t u = 0; u < f; ++u) {
        double g1 = 0, g3 = 0;
        for (std::int64_t j = 0; j < h; ++j) {
          g1 += x[i * h + j] * p[1][(e * f + u) * h + j];
          g3 += x[i * h + j] * p[2][(e * f + u) * h + j];
        }
        a[u] = silu(g1) * g3;
      }
      for (std::int64_t j = 0; j < h; ++j) {
        double v = 0;
        for (std::int64_t u = 0; u < f; ++u) {
          v += a[u] * p[3][(e * h + j) * f + u];
        }
        out.y[i * h + j] += gate * v;
      }
    }
  }
  for (std::int64_t e = 0; e < e_count; ++e) {
    double ps = 0;
    for (std::int64_t i = 0; i < t; ++i) {
      ps += probs[i * e_count + e];
    }
    out.aux += double(e_count) * (double(out.per_expert[e]) / double(t * k)) * (ps / double(t));
  }
  return out;
}

template <class L>
Result one_rank(const Case& k) {
  Result want;
  testing::run_ranks(
      1, [&](ProcessGroup& one) { want = run_layer<L>(init_device_mesh<Mesh>(one, 1, 1, 1), k); });
  return want;
}

template <class L>
void check_layout(const Case& k, int dp, int ep, int tp, const Result& want, const std::string& name) {
  testing::run_ranks(dp * ep * tp, [&](ProcessGroup& world) {
    const Result got = run_layer<L>(init_device_mesh<Mesh>(world, dp, ep, tp), k);
    const std::string at = name + " (" + std::to_string(dp) + "," + std::to_string(ep) + "," +
                           std::to_string(tp) + ") rank " + std::to_string(world.rank());
    close(got.y, want.y, 1e-12, at + ": y");
    close(got.dx, want.dx, 1e-12, at + ": dx");
    const char* names[] = {"router", "W1", "W3", "W2"};
    for (std::size_t i = 0; i < 4; ++i) {
      close(got.grads[i], want.grads[i], 1e-12, at + ": d" + names[i]);
    }
    close({got.stats.aux_loss}, {want.stats.aux_loss}, 1e-13, at + ": aux loss");
    expect(got.stats.dropped == want.stats.dropped && got.stats.per_expert == want.stats.per_expert &&
               got.stats.tokens == want.stats.tokens && got.stats.capacity == want.stats.capacity,
           at + ": stats differ (dropped " + std::to_string(got.stats.dropped) + ", want " +
               std::to_string(want.stats.dropped) + ")");
    // Pinned: the counts over the batch axes (one all_gather, none without batch axes to gather over),
    // counts + rows + rows back over ep forward, rows + rows back over ep backward.
    const bool has_ep = L::ep >= 0 && ep > 1;
    expect(got.fwd_a2a == (has_ep ? 3 : 0) && got.bwd_a2a == (has_ep ? 2 : 0),
           at + ": " + std::to_string(got.fwd_a2a) + " forward and " + std::to_string(got.bwd_a2a) +
               " backward all_to_alls over ep");
    expect(got.fwd_gather == (dp * ep > 1 ? 1 : 0),
           at + ": " + std::to_string(got.fwd_gather) + " all_gathers of the counts");
  });
}

} // namespace

TEST_CASE("nn::Moe on one rank equals the plain loops, its gradients the finite differences", "[moe]") {
  for (const auto& [top_k, cf] : {std::pair{1, 0.0}, std::pair{2, 0.0}, std::pair{2, 1.0}}) {
    Case k;
    k.c.top_k = top_k;
    k.c.capacity_factor = cf;
    const Result want = one_rank<Ep>(k);
    const std::int64_t t = k.batch * k.seq;
    const Plain plain = plain_forward(flat(pattern(k, 1)), want.params, t, k.hidden, k.c);
    const std::string at = "top-" + std::to_string(top_k) + " cf " + std::to_string(cf);
    close(want.y, plain.y, 1e-12, at + ": y");
    close({want.stats.aux_loss}, {plain.aux}, 1e-13, at + ": aux loss");
    CHECK(want.stats.dropped == plain.dropped);
    CHECK(want.stats.per_expert == plain.per_expert);
    if (cf > 0) {
      CHECK(plain.dropped > 0); // the case drops something
    }
    // L = <y, g> + coeff * aux by central differences, at a few entries of every parameter and of x.
    const Vec g = flat(pattern(k, 2));
    const auto loss = [&](const Vec& x, const std::vector<Vec>& p) {
      const Plain r = plain_forward(x, p, t, k.hidden, k.c);
      return std::inner_product(r.y.begin(), r.y.end(), g.begin(), 0.0) + k.c.aux_loss_coeff * r.aux;
    };
    const double eps = 1e-6;
    const Vec x = flat(pattern(k, 1));
    for (std::size_t i = 0; i < 4; ++i) {
      for (std::size_t at_e = 0; at_e < want.params[i].size(); at_e += 37) {
        auto plus = want.params, minus = want.params;
        plus[i][at_e] += eps;
        minus[i][at_e] -= eps;
        const double fd = (loss(x, plus) - loss(x, minus)) / (2 * eps);
        INFO(at << " parameter " << i << " element " << at_e);
        CHECK(want.grads[i][at_e] == Approx(fd).margin(1e-7).epsilon(1e-6));
      }
    }
    for (std::size_t at_e = 0; at_e < x.size(); at_e += 13) {
      Vec plus = x, minus = x;
      plus[at_e] += eps;
      minus[at_e] -= eps;
      const double fd = (loss(plus, want.params) - loss(minus, want.params)) / (2 * eps);
      INFO(at << " x element " << at_e);
      CHECK(want.dx[at_e] == Approx(fd).margin(1e-7).epsilon(1e-6));
    }
  }
}

TEST_CASE("nn::Moe: expert parallel on 1-4 ranks, EP x DP, EP x TP (+SP), DP x TP equal one rank", "[moe]") {
  for (const auto& [top_k, cf] : {std::pair{1, 1.0}, std::pair{2, 0.0}, std::pair{2, 1.0}}) {
    Case k;
    k.c.top_k = top_k;
    k.c.capacity_factor = cf;
    const std::string at = "top-" + std::to_string(top_k) + " cf " + std::to_string(cf);
    const Result want = one_rank<Ep>(k);
    for (int n = 1; n <= 4; ++n) {
      check_layout<Ep>(k, 1, n, 1, want, at + " ep");
    }
    check_layout<Ep>(k, 2, 2, 1, want, at + " ep x dp");
    check_layout<EpTp>(k, 1, 2, 2, want, at + " ep x tp");
    check_layout<EpTpSp>(k, 1, 2, 2, want, at + " ep x tp + sp");
    check_layout<DpTp>(k, 2, 1, 2, want, at + " dp x tp, no ep");
  }
}

TEST_CASE("nn::Moe of meta tensors on a fake rank routes evenly: each expert its share of the batch",
          "[moe][meta]") {
  // 4 x 6 tokens over ep 4: 6 a rank; top-2 of 12 experts: 4 assignments an expert, 3 local experts a rank,
  // so every rank sends 3 rows to each rank and receives 3 from each (9 from the others).
  Case k;
  k.batch = 4;
  k.seq = 6;
  for (int r = 0; r < 4; ++r) {
    const auto mesh = init_device_mesh<Mesh>(fake_world(r, 4), 1, 4, 1);
    init::InitKeys keys(11);
    nn::Moe<double, Ep> moe(mesh, k.hidden, k.c, keys, Device::meta());
    const auto x = [&]<class... Q>(DTensor<double, 3, Mesh, Q...>*) {
      return zeros<double, Q...>(mesh, {k.batch, k.seq, k.hidden}, Device::meta());
    }(static_cast<nn::act_t<Ep, double>*>(nullptr));
    CommDebugMode comm({.log_ops = true});
    auto [y, back] = moe.forward(x, with_backward);
    auto [dx, grads] = back(y);
    INFO("rank " << r);
    CHECK(y.local().device().is_meta());
    CHECK(dx.local().shape() == x.local().shape());
    CHECK(moe.stats().per_expert == std::vector<std::int64_t>(12, 4));
    CHECK(moe.stats().dropped == 0);
    std::vector<std::int64_t> rows; // the row exchanges' bytes received: forward out and back, backward
    for (const auto& op : comm.ops()) {
      if (op.op == "all_to_all" && op.bytes > 9 * 8) { // not the counts' (9 int64 from the others)
        rows.push_back(op.bytes);
      }
    }
    CHECK(rows == std::vector<std::int64_t>(4, 9 * k.hidden * 8));
  }
}

TEST_CASE("nn::Moe: bad configurations name their sizes", "[moe]") {
  testing::run_ranks(2, [](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world, 1, 2, 1);
    init::InitKeys keys(1);
    nn::MoeConfig c{.experts = 3, .top_k = 1, .ffn = 4};
    CHECK_THROWS_WITH((nn::Moe<double, Ep>(mesh, 8, c, keys)),
                      Catch::Contains("3 experts do not divide over the expert-parallel axis of size 2"));
    c.experts = 4;
    c.top_k = 5;
    CHECK_THROWS_WITH((nn::Moe<double, Ep>(mesh, 8, c, keys)), Catch::Contains("top_k 5 out of [1, 4]"));
  });
}

namespace {

using MoeGpt = nn::LanguageModel<double, Ep, nn::MoeBlock>;
using MoeGptTp = nn::LanguageModel<double, EpTpSp, nn::MoeBlock>;
constexpr int kLayers = 2, kSteps = 3;
constexpr std::int64_t kBatch = 4, kSeq = 6;
const nn::TransformerConfig gpt_config{.vocab = 29,
                                       .hidden = 16,
                                       .heads = 4,
                                       .kv_heads = 2,
                                       .ffn = 24,
                                       .norm_eps = 1e-6,
                                       .init_std = 0.3,
                                       .moe = {.experts = 4,
                                               .top_k = 2,
                                               .ffn = 12,
                                               .capacity_factor = 1.25,
                                               .aux_loss_coeff = 0.01,
                                               .init_std = 0.3}};

struct TrainRun {
  std::vector<double> losses, norms, aux;
  std::vector<std::int64_t> dropped;
  std::vector<Vec> params;
  std::int64_t a2a_per_step = -1, gathers_per_step = -1;
};

template <class Model, bool Fsdp = false>
TrainRun train_gpt(const DeviceMesh<Mesh>& mesh) {
  using L = typename Model::layout_type;
  init::InitKeys keys(5);
  Model model(mesh, gpt_config, kLayers, keys);
  const nn::MoeStats* first_block = &model.blocks[0].mlp.stats(); // shared with the trainer's copy
  using Trainer =
      std::conditional_t<Fsdp, nn::FsdpTrainer<Model, dtensor::Fsdp<"dp">>, nn::DdpTrainer<Model, "dp">>;
  Trainer trainer(mesh, std::move(model), {.max_norm = 0.5});
  optim::AdamW opt({.lr = 2e-2, .weight_decay = 0.01});
  TrainRun run;
  for (int s = 0; s < kSteps; ++s) {
    const auto ids = [&](std::int64_t shift) {
      return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
        return from_global_index<std::int64_t, Q...>(mesh, {kBatch, kSeq}, [&](const auto& i) {
          return (i[0] * 11 + i[1] * 5 + s * 3 + shift + i[1] * i[1]) % gpt_config.vocab;
        });
      }(static_cast<nn::ids_t<L>*>(nullptr));
    };
    CommDebugMode comm;
    const nn::StepResult r = trainer.step(ids(0), ids(1), opt);
    run.losses.push_back(r.loss);
    run.norms.push_back(r.grad_norm);
    const nn::MoeStats st = *first_block;
    run.aux.push_back(st.aux_loss);
    run.dropped.push_back(st.dropped);
    run.a2a_per_step = comm.count("all_to_all", "ep");
    run.gathers_per_step =
        comm.count("all_gather") - comm.count("all_gather", "tp") - comm.count("all_gather", "dp");
  }
  trainer.with_gathered([&](auto& m) {
    nn::for_each_tensor(m.parameters(), [&](const auto& w) { run.params.push_back(flat(w.full_tensor())); });
  });
  return run;
}

void compare_runs(const TrainRun& got, const TrainRun& want, const std::string& at) {
  close(got.losses, want.losses, 1e-10, at + ": losses");
  close(got.norms, want.norms, 1e-10, at + ": gradient norms");
  close(got.aux, want.aux, 1e-10, at + ": aux losses");
  expect(got.dropped == want.dropped, at + ": dropped assignments differ");
  expect(got.params.size() == want.params.size(), at + ": parameter count");
  for (std::size_t i = 0; i < want.params.size(); ++i) {
    close(got.params[i], want.params[i], 1e-10, at + ": parameter " + std::to_string(i));
  }
}

} // namespace

TEST_CASE("The MoE GPT trained by DdpTrainer on EP x DP, EP, EP x TP equals one rank", "[moe][trainer]") {
  TrainRun want;
  testing::run_ranks(
      1, [&](ProcessGroup& one) { want = train_gpt<MoeGpt>(init_device_mesh<Mesh>(one, 1, 1, 1)); });
  std::int64_t dropped = 0;
  for (std::int64_t d : want.dropped) {
    dropped += d;
  }
  CHECK(dropped > 0); // the capacity binds
  const auto run = [&](auto tag, int dp, int ep, int tp, const std::string& name, auto fsdp) {
    using Model = typename decltype(tag)::type;
    testing::run_ranks(dp * ep * tp, [&](ProcessGroup& world) {
      const TrainRun got = train_gpt<Model, decltype(fsdp)::value>(init_device_mesh<Mesh>(world, dp, ep, tp));
      const std::string at = name + " rank " + std::to_string(world.rank());
      compare_runs(got, want, at);
      // Per MoE block: counts, rows, rows back forward; rows, rows back backward; the counts gathered once
      // over the batch axes. FsdpTrainer runs each block's forward again in its backward.
      const int forwards = decltype(fsdp)::value ? 2 : 1;
      expect(got.a2a_per_step == (ep > 1 ? (3 * forwards + 2) * kLayers : 0),
             at + ": " + std::to_string(got.a2a_per_step) + " all_to_alls over ep per step");
      expect(got.gathers_per_step == (dp * ep > 1 ? forwards * kLayers : 0),
             at + ": " + std::to_string(got.gathers_per_step) + " all_gathers of the counts per step");
    });
  };
  run(std::type_identity<MoeGpt>{}, 2, 2, 1, "ep x dp", std::false_type{});
  run(std::type_identity<MoeGpt>{}, 1, 4, 1, "ep", std::false_type{});
  run(std::type_identity<MoeGptTp>{}, 1, 2, 2, "ep x tp + sp", std::false_type{});
  run(std::type_identity<MoeGpt>{}, 2, 2, 1, "ep x fsdp", std::true_type{});
}

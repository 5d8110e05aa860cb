// The transformer layers of dtensor::nn (nn/): a small model (embedding, two blocks with
// GQA + RoPE attention and a SwiGLU MLP, a final RMSNorm, the vocab-parallel head and its loss) in every
// layout nn::Layout names, forward and backward, against the same model on one rank (a (1,1,1) mesh of a
// one-rank in-process world: the weights come from the sharding-invariant RNG, so they are the same
// numbers): the loss and every parameter's gradient. Meshes of 1-4 ranks over (dp, cp, tp): data parallel
// alone, tensor parallel with and without sequence parallelism, ring and Ulysses context parallelism and
// their compositions; uneven shards (batch 3, sequence 5 or 7). The collectives of a block are pinned for
// tensor (+ sequence) parallelism. Also: a GELU + LayerNorm block, activation checkpointing (bit for bit),
// a block under FsdpSchedule with its FlatParamGroup built from nn::params_of, and the errors of a head split
// that cannot be. Where dtensor::checkpoint is linked, the full training state (train/train_state.hpp) of
// a smaller model, saved and resumed on the same and on other layouts (at the end of this file).
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train.hpp>
#include <dtensor/train/fsdp_schedule.hpp>
#if DTENSOR_HAS_CHECKPOINT
#include <dtensor/train/optim.hpp>
#include <dtensor/train/train_state.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../support/block_memory.hpp"

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"cp">, Axis<"tp">>;
using Dp = nn::Layout<Mesh>;
using Tp = nn::Layout<Mesh, nn::TensorParallel<"tp">>;
using TpSp = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using TpSpCm = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::CollectiveMatmul>;
using RingSp =
    nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::ContextParallel<Ring<"cp">>>;
using Ulysses2 = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::ContextParallel<Ulysses<"cp">>>;

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

/// A model's loss and every parameter's full gradient, flattened, in parameter order.
struct Result {
  double loss = 0;
  std::vector<std::vector<double>> grads;
  std::vector<std::vector<double>> params; ///< the parameters' full tensors (for the plain reference)
  std::string comm; ///< the first block's collectives, forward then backward (the pinned layouts)

  template <class... G>
  void add(const std::tuple<G...>& gs) {
    std::apply([&](const auto&... g) { (add_one(g), ...); }, gs);
  }
  template <class G>
  void add_one(const G& g) {
    const auto full = g.full_tensor();
    grads.emplace_back(full.data(), full.data() + full.numel());
  }
};

/// Token ids (batch, seq) of the layout: a fixed pattern of [0, vocab).
template <class L>
nn::ids_t<L> tokens(const DeviceMesh<Mesh>& mesh, std::int64_t batch, std::int64_t seq, std::int64_t vocab,
                    int shift) {
  Tensor<std::int64_t, 2> full({batch, seq});
  for (std::int64_t i = 0; i < batch * seq; ++i) {
    full.data()[i] = (i * 5 + shift + i * i) % vocab;
  }
  return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
    return distribute_tensor<Q...>(mesh, full);
  }(static_cast<nn::ids_t<L>*>(nullptr));
}

/// The model's forward and backward on `mesh` in layout L.
template <class L, class Activation = nn::SwiGlu, template <class, class> class Norm = nn::RmsNorm,
          bool Checkpoint = false, bool Split = false>
Result run_model(const DeviceMesh<Mesh>& mesh, const nn::TransformerConfig& c, std::int64_t batch,
                 std::int64_t seq, nn::Recompute recompute = nn::Recompute::selective) {
  init::InitKeys keys(7);
  nn::Embedding<double, L> emb(mesh, c.vocab, c.hidden, keys.next(), 1.0);
  nn::TransformerBlock<double, L, Activation, Norm> b0(mesh, c, keys), b1(mesh, c, keys);
  b0.recompute = recompute;
  b1.recompute = recompute;
  Norm<double, L> norm(mesh, c.hidden, c.norm_eps);
  nn::LmHead<double, L> head(mesh, c.vocab, c.hidden, keys.next(), 0.5);
  const auto ids = tokens<L>(mesh, batch, seq, c.vocab, 1);
  const auto targets = tokens<L>(mesh, batch, seq, c.vocab, 2);

  Result r;
  auto block_forward = [&](const auto& block, const auto& x) {
    if constexpr (Checkpoint) {
      return nn::checkpointed(block).forward(x, with_backward);
    } else if constexpr (Split) {
      return nn::forward_split(block, x); // B now, W (the weights' gradients) when asked, as a pipeline runs
    } else {
      return block.forward(x, with_backward);
    }
  };
  auto [h0, emb_back] = emb.forward(ids, with_backward);
  CommDebugMode block_comm;
  auto [h1, b0_back] = block_forward(b0, h0);
  const std::string forward_comm = block_comm.to_string();
  auto [h2, b1_back] = block_forward(b1, h1);
  auto [n, norm_back] = norm.forward(h2, with_backward);
  auto [loss, head_back] = head.forward(n, targets, with_backward);
  r.loss = loss.full_tensor().data()[0];

  auto [dn, head_grads] = head_back(1.0);
  auto [dh2, norm_grads] = norm_back(dn);
  auto [dh1, b1_grads] = b1_back(dh2);
  block_comm.reset();
  auto [dh0, b0_grads] = b0_back(dh1);
  r.comm = forward_comm + "backward:\n" + block_comm.to_string();
  auto [none, emb_grads] = emb_back(dh0);
  r.add(emb_grads);
  if constexpr (Split) { // the W's after every B, the earlier block's first
    r.add(b0_grads());
    r.add(b1_grads());
  } else {
    r.add(b0_grads);
    r.add(b1_grads);
  }
  r.add(norm_grads);
  r.add(head_grads);
  auto keep = [&](const auto& w) {
    const auto full = w.full_tensor();
    r.params.emplace_back(full.data(), full.data() + full.numel());
  };
  std::apply([&](const auto&... w) { (keep(w), ...); },
             std::tuple_cat(emb.parameters(), b0.parameters(), b1.parameters(), norm.parameters(),
                            head.parameters()));
  return r;
}

// ---- the plain reference: the same model written out in loops over std::vector<double>
// ---------------------

using Vec = std::vector<double>;

/// y (rows, out) = x (rows, in) W^T, W (out, in).
Vec linear_ref(const Vec& x, const Vec& w, std::int64_t rows, std::int64_t in, std::int64_t out) {
  Vec y(static_cast<std::size_t>(rows * out), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (std::int64_t i = 0; i < in; ++i) {
        s += x[static_cast<std::size_t>(r * in + i)] * w[static_cast<std::size_t>(o * in + i)];
      }
      y[static_cast<std::size_t>(r * out + o)] = s;
    }
  }
  return y;
}

Vec rms_ref(const Vec& x, const Vec& g, std::int64_t rows, std::int64_t h, double eps) {
  Vec y(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (std::int64_t i = 0; i < h; ++i) {
      ms += x[static_cast<std::size_t>(r * h + i)] * x[static_cast<std::size_t>(r * h + i)];
    }
    const double rs = 1.0 / std::sqrt(ms / double(h) + eps);
    for (std::int64_t i = 0; i < h; ++i) {
      y[static_cast<std::size_t>(r * h + i)] =
          x[static_cast<std::size_t>(r * h + i)] * rs * g[static_cast<std::size_t>(i)];
    }
  }
  return y;
}

/// RoPE (rotate half) on rows (batch, seq) of `heads` heads of hd, in place.
void rope_ref(Vec& x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t hd,
              double base) {
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t p = 0; p < seq; ++p) {
      for (std::int64_t n = 0; n < heads; ++n) {
        double* v = x.data() + ((b * seq + p) * heads + n) * hd;
        for (std::int64_t i = 0; i < hd / 2; ++i) {
          const double a = double(p) * std::pow(base, -2.0 * double(i) / double(hd));
          const double x0 = v[i], x1 = v[i + hd / 2];
          v[i] = x0 * std::cos(a) - x1 * std::sin(a);
          v[i + hd / 2] = x1 * std::cos(a) + x0 * std::sin(a);
        }
      }
    }
  }
}

/// The model's mean loss, its parameters in the layers' order (SwiGLU blocks, RMSNorm).
double loss_ref(const std::vector<Vec>& w, const nn::TransformerConfig& c, const Tensor<std::int64_t, 2>& ids,
                const Tensor<std::int64_t, 2>& targets) {
  const std::int64_t batch = ids.shape()[0], seq = ids.shape()[1], rows = batch * seq, h = c.hidden;
  const std::int64_t hd = c.head_dim(), nq = c.heads, nkv = c.kv_head_count(), f = c.ffn;
  Vec x(static_cast<std::size_t>(rows * h));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < h; ++i) {
      x[static_cast<std::size_t>(r * h + i)] = w[0][static_cast<std::size_t>(ids.data()[r] * h + i)];
    }
  }
  for (int blk = 0; blk < 2; ++blk) {
    const std::size_t o = 1 + 9 * static_cast<std::size_t>(blk);
    const Vec n = rms_ref(x, w[o], rows, h, c.norm_eps);
    Vec q = linear_ref(n, w[o + 1], rows, h, nq * hd);
    Vec k = linear_ref(n, w[o + 2], rows, h, nkv * hd);
    const Vec v = linear_ref(n, w[o + 3], rows, h, nkv * hd);
    rope_ref(q, batch, seq, nq, hd, c.rope_base);
    rope_ref(k, batch, seq, nkv, hd, c.rope_base);
    Vec att(static_cast<std::size_t>(rows * nq * hd), 0.0);
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t head = 0; head < nq; ++head) {
        const std::int64_t kv = head / (nq / nkv);
        for (std::int64_t s = 0; s < seq; ++s) {
          std::vector<double> p(static_cast<std::size_t>(s + 1));
          double m = -1e300, z = 0;
          for (std::int64_t t = 0; t <= s; ++t) {
            double d = 0;
            for (std::int64_t i = 0; i < hd; ++i) {
              d += q[static_cast<std::size_t>(((b * seq + s) * nq + head) * hd + i)] *
                   k[static_cast<std::size_t>(((b * seq + t) * nkv + kv) * hd + i)];
            }
            p[static_cast<std::size_t>(t)] = d / std::sqrt(double(hd));
            m = std::max(m, p[static_cast<std::size_t>(t)]);
          }
          for (double& e : p) {
            e = std::exp(e - m);
            z += e;
          }
          for (std::int64_t t = 0; t <= s; ++t) {
            for (std::int64_t i = 0; i < hd; ++i) {
              att[static_cast<std::size_t>(((b * seq + s) * nq + head) * hd + i)] +=
                  p[static_cast<std::size_t>(t)] / z *
                  v[static_cast<std::size_t>(((b * seq + t) * nkv + kv) * hd + i)];
            }
          }
        }
      }
    }
    const Vec a = linear_ref(att, w[o + 4], rows, nq * hd, h);
    for (std::size_t e = 0; e < x.size(); ++e) {
      x[e] += a[e];
    }
    const Vec n2 = rms_ref(x, w[o + 5], rows, h, c.norm_eps);
    const Vec g = linear_ref(n2, w[o + 6], rows, h, f);
    const Vec u = linear_ref(n2, w[o + 7], rows, h, f);
    Vec m(g.size());
    for (std::size_t e = 0; e < g.size(); ++e) {
      m[e] = g[e] / (1 + std::exp(-g[e])) * u[e];
    }
    const Vec y = linear_ref(m, w[o + 8], rows, f, h);
    for (std::size_t e = 0; e < x.size(); ++e) {
      x[e] += y[e];
    }
  }
  const Vec n = rms_ref(x, w[19], rows, h, c.norm_eps);
  const Vec logits = linear_ref(n, w[20], rows, h, c.vocab);
  double total = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* z = logits.data() + r * c.vocab;
    const double m = *std::max_element(z, z + c.vocab);
    double s = 0;
    for (std::int64_t i = 0; i < c.vocab; ++i) {
      s += std::exp(z[i] - m);
    }
    total += std::log(s) + m - z[targets.data()[r]];
  }
  return total / double(rows);
}

/// The same model on a (1,1,1) mesh of one rank.
template <class L, class Activation = nn::SwiGlu, template <class, class> class Norm = nn::RmsNorm>
Result reference(const nn::TransformerConfig& c, std::int64_t batch, std::int64_t seq) {
  Result want;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    want = run_model<L, Activation, Norm>(init_device_mesh<Mesh>(one, 1, 1, 1), c, batch, seq);
  });
  return want;
}

void compare(const Result& got, const Result& want, double tol, const std::string& name) {
  expect(std::abs(got.loss - want.loss) <= tol * std::abs(want.loss),
         name + ": loss " + std::to_string(got.loss) + ", one rank " + std::to_string(want.loss));
  expect(got.grads.size() == want.grads.size(), name + ": the number of gradients");
  for (std::size_t i = 0; i < want.grads.size(); ++i) {
    expect(got.grads[i].size() == want.grads[i].size(), name + ": the size of gradient " + std::to_string(i));
    double d = 0, scale = 0;
    for (std::size_t e = 0; e < want.grads[i].size(); ++e) {
      d = std::max(d, std::abs(got.grads[i][e] - want.grads[i][e]));
      scale = std::max(scale, std::abs(want.grads[i][e]));
    }
    expect(d <= tol * std::max(scale, 1e-3), name + ": parameter " + std::to_string(i) +
                                                 "'s gradient differs by " + std::to_string(d) +
                                                 " (largest " + std::to_string(scale) + ")");
  }
}

nn::TransformerConfig small(std::int64_t heads, std::int64_t kv_heads) {
  return {.vocab = 11,
          .hidden = 2 * heads,
          .heads = heads,
          .kv_heads = kv_heads,
          .ffn = 10,
          .rope_base = 100,
          .init_std = 0.5};
}

/// The layout L on (dp, cp, tp) against one rank.
template <class L, class Activation = nn::SwiGlu, template <class, class> class Norm = nn::RmsNorm>
void check_layout(int dp, int cp, int tp, const nn::TransformerConfig& c, std::int64_t batch,
                  std::int64_t seq, const std::string& name) {
  INFO(name << " on (dp=" << dp << ", cp=" << cp << ", tp=" << tp << ")");
  const Result want = reference<L, Activation, Norm>(c, batch, seq);
  testing::run_ranks(dp * cp * tp, [&](ProcessGroup& world) {
    const Result got =
        run_model<L, Activation, Norm>(init_device_mesh<Mesh>(world, dp, cp, tp), c, batch, seq);
    compare(got, want, 1e-11,
            name + " on (" + std::to_string(dp) + ", " + std::to_string(cp) + ", " + std::to_string(tp) +
                ")");
  });
}

} // namespace

TEST_CASE("nn layers on one rank against the model written out in loops: the loss, and every parameter's "
          "gradient against central differences of it",
          "[parallel][layers]") {
  const auto c = small(4, 2);
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const auto mesh = init_device_mesh<Mesh>(one, 1, 1, 1);
    const Result got = run_model<Dp>(mesh, c, 2, 5);
    const auto ids = tokens<Dp>(mesh, 2, 5, c.vocab, 1).full_tensor();
    const auto targets = tokens<Dp>(mesh, 2, 5, c.vocab, 2).full_tensor();
    const double want = loss_ref(got.params, c, ids, targets);
    expect(std::abs(got.loss - want) <= 1e-12 * std::abs(want),
           "loss " + std::to_string(got.loss) + ", written out " + std::to_string(want));
    expect(got.params.size() == 21 && got.grads.size() == 21, "21 parameters");
    for (std::size_t i = 0; i < got.params.size(); ++i) {
      const std::size_t n = got.params[i].size();
      for (std::size_t e : {std::size_t(0), n / 3, n - 1}) { // three elements of every parameter
        std::vector<Vec> w = got.params;
        const double step = 1e-5;
        w[i][e] += step;
        const double up = loss_ref(w, c, ids, targets);
        w[i][e] -= 2 * step;
        const double fd = (up - loss_ref(w, c, ids, targets)) / (2 * step);
        expect(std::abs(got.grads[i][e] - fd) <= 1e-7 * std::max(1.0, std::abs(fd)),
               "parameter " + std::to_string(i) + " element " + std::to_string(e) + ": gradient " +
                   std::to_string(got.grads[i][e]) + ", central difference " + std::to_string(fd));
      }
    }
  });
}

TEST_CASE("nn layers: data and tensor parallel, with and without sequence parallelism, as one rank",
          "[parallel][layers]") {
  const auto gqa = small(4, 2); // 4 query heads share 2 kv heads
  for (int n = 1; n <= 4; ++n) {
    check_layout<Dp>(n, 1, 1, gqa, 3, 5, "data parallel");
  }
  for (int tp : {1, 2}) {
    check_layout<Tp>(1, 1, tp, gqa, 3, 5, "tensor parallel");
    check_layout<TpSp>(1, 1, tp, gqa, 3, 5, "tensor + sequence parallel");
  }
  check_layout<TpSp>(2, 1, 2, gqa, 3, 5, "tensor + sequence parallel, batch over dp");
  check_layout<TpSp>(1, 1, 4, small(4, 4), 3, 5, "tensor + sequence parallel, 4 heads over 4");
  check_layout<TpSp>(1, 1, 3, small(6, 3), 2, 7, "tensor + sequence parallel, 6 heads over 3");
  check_layout<Tp, nn::Gelu, nn::LayerNorm>(2, 1, 2, gqa, 3, 5, "GELU + LayerNorm blocks, tensor parallel");
}

// (the GELU MLP's collective matmul: examples/06_train/tp_cm, whose blocks are GELU MlpBlocks, against one
// rank)
TEST_CASE("nn layers: collective matmul (nn::CollectiveMatmul) = sequence parallel within GEMM rounding, "
          "and no all_gather or reduce_scatter left in a block",
          "[parallel][layers]") {
  const auto gqa = small(4, 2);
  check_layout<TpSpCm>(1, 1, 3, small(6, 3), 2, 7, "collective matmul, 6 heads over 3, uneven sequence");
  for (const auto& [dp, tp, seq] : {std::tuple{1, 2, 5}, std::tuple{2, 2, 5}, std::tuple{1, 4, 3}}) {
    testing::run_ranks(dp * tp, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, dp, 1, tp);
      const auto c = tp == 4 ? small(4, 4) : gqa;
      const std::string where =
          "(" + std::to_string(dp) + ", 1, " + std::to_string(tp) + ") seq " + std::to_string(seq);
      const Result fused = run_model<TpSpCm>(mesh, c, 2, seq);
      compare(fused, run_model<TpSp>(mesh, c, 2, seq), 1e-13, "collective matmul on " + where);
      if (tp > 1) {
        expect(fused.comm.find("all_gather") == std::string::npos &&
                   fused.comm.find("reduce_scatter") == std::string::npos &&
                   fused.comm.find("batch_isend_irecv") != std::string::npos,
               "a collective-matmul block exchanges blocks point to point only:\n" + fused.comm);
      }
    });
  }
}

TEST_CASE("nn layers: context parallel (ring and Ulysses) and composed with tensor parallelism, as one rank",
          "[parallel][layers]") {
  const auto gqa = small(4, 2);
  for (int cp = 2; cp <= 4; ++cp) {
    check_layout<RingSp>(1, cp, 1, gqa, 2, 7, "ring context parallel");
  }
  check_layout<RingSp>(1, 2, 2, gqa, 2, 7, "ring context parallel x tensor + sequence parallel");
  check_layout<RingSp>(2, 2, 1, gqa, 3, 5, "ring context parallel x data parallel");
  check_layout<Ulysses2>(1, 2, 1, gqa, 2, 7, "Ulysses context parallel");
  check_layout<Ulysses2>(2, 2, 1, gqa, 3, 5, "Ulysses context parallel x data parallel");
}

namespace {

/// The bytes a TransformerBlock<double, L>'s forward allocates and its backward keeps, on rank 0 of (dp,
/// cp, tp): MemoryTracker's count after the forward, less its output.
template <class L>
std::int64_t block_kept(const nn::TransformerConfig& c, std::int64_t batch, std::int64_t seq, int dp, int cp,
                        int tp, nn::Recompute mode = nn::Recompute::selective) {
  std::int64_t kept = 0;
  testing::run_ranks(dp * cp * tp, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world, dp, cp, tp);
    init::InitKeys keys(3);
    nn::TransformerBlock<double, L> block(mesh, c, keys);
    block.recompute = mode;
    const auto x = [&]<class... Q>(DTensor<double, 3, Mesh, Q...>*) {
      return from_global_index<double, Q...>(
          mesh, {batch, seq, c.hidden}, [](const auto& i) { return double((i[0] + 3 * i[1] + i[2]) % 7); });
    }(static_cast<nn::act_t<L, double>*>(nullptr));
    MemoryTracker memory;
    auto [y, back] = block.forward(x, with_backward);
    if (world.rank() == 0) {
      kept = memory.stats().live_total - y.local().nbytes();
    }
  });
  return kept;
}

} // namespace

TEST_CASE("nn layers: the activations a block keeps for its backward, term by term, in every layout and "
          "under each nn::Recompute",
          "[parallel][layers][memory]") {
  const nn::TransformerConfig c{.vocab = 11, .hidden = 64, .heads = 8, .kv_heads = 4, .ffn = 160};
  const std::int64_t batch = 2, seq = 32, tokens = batch * seq;
  CHECK(block_kept<TpSp>(c, batch, seq, 1, 1, 2) == testing::expected_block_kept<double>(c, tokens, 2, true));
  CHECK(block_kept<TpSp>(c, batch, seq, 1, 1, 4) == testing::expected_block_kept<double>(c, tokens, 4, true));
  CHECK(block_kept<Tp>(c, batch, seq, 1, 1, 2) == testing::expected_block_kept<double>(c, tokens, 2, false));
  CHECK(block_kept<Dp>(c, batch, seq, 2, 1, 1) ==
        testing::expected_block_kept<double>(c, tokens / 2, 1, false));
  CHECK(block_kept<RingSp>(c, batch, seq, 1, 2, 2) ==
        testing::expected_block_kept<double>(c, tokens / 2, 2, true));
  CHECK(block_kept<Ulysses2>(c, batch, seq, 1, 2, 2) ==
        testing::expected_block_kept<double>(c, tokens / 2, 2, false, 2));
  CHECK(block_kept<TpSpCm>(c, batch, seq, 1, 1, 2) ==
        testing::expected_block_kept<double>(c, tokens, 2, true));
  CHECK(block_kept<TpSpCm>(c, batch, seq, 1, 1, 4) ==
        testing::expected_block_kept<double>(c, tokens, 4, true));
  for (const auto mode : {nn::Recompute::none, nn::Recompute::full}) {
    CHECK(block_kept<TpSp>(c, batch, seq, 1, 1, 2, mode) ==
          testing::expected_block_kept<double>(c, tokens, 2, true, 1, mode));
    CHECK(block_kept<TpSpCm>(c, batch, seq, 1, 1, 2, mode) ==
          testing::expected_block_kept<double>(c, tokens, 2, true, 1, mode));
    CHECK(block_kept<Dp>(c, batch, seq, 2, 1, 1, mode) ==
          testing::expected_block_kept<double>(c, tokens / 2, 1, false, 1, mode));
  }
  // Under sequence parallelism the bytes kept per token do not grow with t (they grew by the gathered
  // copies before: 2 (t - 1) of the residual stream's size for each of the two column-parallel regions).
  CHECK(2 * block_kept<TpSp>(c, batch, seq, 1, 1, 4) == block_kept<TpSp>(c, batch, seq, 1, 1, 2));
}

TEST_CASE("nn layers: a block's collectives, activation checkpointing and nn::Recompute bit for bit, bad "
          "head splits",
          "[parallel][layers]") {
  const auto gqa = small(4, 2);
  SECTION(
      "tensor + sequence parallel: an all_gather in and a reduce_scatter out of each region, duals back") {
    testing::run_ranks(2, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 1, 1, 2);
      const Result sp = run_model<TpSp>(mesh, gqa, 2, 5);
      const Result tp = run_model<Tp>(mesh, gqa, 2, 5);
      auto count = [](const std::string& table, const std::string& line) {
        std::int64_t n = 0;
        for (std::size_t at = table.find(line); at != std::string::npos; at = table.find(line, at + 1)) {
          ++n;
        }
        return n;
      };
      const std::string fwd_sp = sp.comm.substr(0, sp.comm.find("backward:"));
      const std::string bwd_sp = sp.comm.substr(sp.comm.find("backward:"));
      expect(count(fwd_sp, "all_gather") == 1 && count(fwd_sp, "reduce_scatter") == 1 &&
                 count(bwd_sp, "all_gather") == 1 && count(bwd_sp, "reduce_scatter") == 1 &&
                 count(sp.comm, "all_reduce") == 0,
             "sequence parallel block:\n" + sp.comm);
      const std::string fwd_tp = tp.comm.substr(0, tp.comm.find("backward:"));
      const std::string bwd_tp = tp.comm.substr(tp.comm.find("backward:"));
      expect(count(fwd_tp, "all_reduce") == 1 && count(bwd_tp, "all_reduce") == 1 &&
                 count(tp.comm, "all_gather") == 0 && count(tp.comm, "reduce_scatter") == 0,
             "tensor parallel block:\n" + tp.comm);
    });
  }
  SECTION("checkpointed blocks give the same loss and gradients bit for bit") {
    testing::run_ranks(4, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 1, 2, 2);
      const Result plain = run_model<RingSp>(mesh, gqa, 2, 7);
      const Result again = run_model<RingSp, nn::SwiGlu, nn::RmsNorm, true>(mesh, gqa, 2, 7);
      compare(again, plain, 0, "checkpointed");
    });
  }
  SECTION("the backward split into B and W (zero-bubble pipelines) gives the same gradients bit for bit") {
    testing::run_ranks(2, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 1, 1, 2);
      compare(run_model<TpSp, nn::SwiGlu, nn::RmsNorm, false, true>(mesh, gqa, 2, 5),
              run_model<TpSp>(mesh, gqa, 2, 5), 0, "tp + sp, split");
      compare(run_model<TpSpCm, nn::SwiGlu, nn::RmsNorm, false, true>(mesh, gqa, 2, 5),
              run_model<TpSpCm>(mesh, gqa, 2, 5), 0, "collective matmul, split");
      compare(run_model<Tp, nn::Gelu, nn::LayerNorm, false, true>(mesh, gqa, 2, 5),
              run_model<Tp, nn::Gelu, nn::LayerNorm>(mesh, gqa, 2, 5), 0, "tp, GELU, LayerNorm, split");
      for (const auto mode : {nn::Recompute::none, nn::Recompute::full}) {
        compare(run_model<TpSp, nn::SwiGlu, nn::RmsNorm, false, true>(mesh, gqa, 2, 5, mode),
                run_model<TpSp>(mesh, gqa, 2, 5), 0,
                "tp + sp, split, Recompute " + std::to_string(int(mode)));
      }
    });
  }
  SECTION("each nn::Recompute gives the same loss and gradients bit for bit") {
    testing::run_ranks(2, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 1, 1, 2);
      const Result sp = run_model<TpSp>(mesh, gqa, 2, 5);
      const Result cm = run_model<TpSpCm>(mesh, gqa, 2, 5);
      for (const auto mode : {nn::Recompute::none, nn::Recompute::full}) {
        compare(run_model<TpSp>(mesh, gqa, 2, 5, mode), sp, 0,
                "tp + sp, Recompute " + std::to_string(int(mode)));
        compare(run_model<TpSpCm>(mesh, gqa, 2, 5, mode), cm, 0,
                "collective matmul, Recompute " + std::to_string(int(mode)));
      }
    });
    testing::run_ranks(4, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 1, 2, 2);
      compare(run_model<RingSp>(mesh, gqa, 2, 7, nn::Recompute::none), run_model<RingSp>(mesh, gqa, 2, 7), 0,
              "ring, Recompute none");
    });
  }
  SECTION("heads that do not split over tp: an error on every rank naming the sizes") {
    testing::run_ranks(4, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 1, 1, 4);
      try {
        run_model<TpSp>(mesh, gqa, 2, 5);
        expect(false, "no error for 2 kv heads over tp 4");
      } catch (const Error& e) {
        expect(std::string(e.what()).find(
                   "4 heads and 2 kv heads over the tensor-parallel axis \"tp\" of size 4") !=
                   std::string::npos,
               std::string("the message: ") + e.what());
      }
    });
  }
}

TEST_CASE("nn layers under FsdpSchedule: a block's FlatParamGroup from nn::params_of, as one rank",
          "[parallel][layers][fsdp]") {
  using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
  using Block = nn::TransformerBlock<double, L>;
  using Group = FlatParamGroup<double, Mesh, Fsdp<"dp">, nn::params_of<Block>>;
  const auto c = small(4, 2);
  // The gradients of one block, input (3, 5, hidden) of value(.), loss sum(y * dy): plain, then FSDP.
  auto run = [&](const DeviceMesh<Mesh>& mesh, bool fsdp) {
    init::InitKeys keys(3);
    Block block(mesh, c, keys);
    auto act = [&](std::uint64_t offset) {
      auto t = detail::factory_of<nn::act_t<L, double>>::zeros(mesh, {3, 5, c.hidden});
      init::normal_(t, 0.0, 1.0, {11, offset});
      return t;
    };
    const auto x = act(0), dy = act(1);
    Result r;
    if (!fsdp) {
      auto [y, back] = block.forward(x, with_backward);
      auto [dx, grads] = back(dy);
      r.add_one(y);
      r.add_one(dx);
      r.add(grads);
      return r;
    }
    Group group = std::apply([](const auto&... p) { return Group(p...); }, block.parameters());
    FsdpSchedule sched;
    sched.add(group);
    std::optional<typename Block::input_type> dx;
    sched.backward(group, [&](const auto&... p) {
      auto [y, back] = block.with_parameters(p...).forward(x, with_backward);
      r.add_one(y);
      auto [d, grads] = back(dy);
      dx.emplace(d);
      return grads;
    });
    sched.finish();
    r.add_one(*dx);
    // The reduced gradient shards, gathered and cut into the parameters' full tensors: compare the flat
    // gradient against the plain run's (packed in the same order by the same group type).
    const auto flat = group.grad().full_tensor();
    r.grads.emplace_back(flat.data(), flat.data() + flat.numel());
    return r;
  };
  Result want;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const auto mesh = init_device_mesh<Mesh>(one, 1, 1, 1);
    want = run(mesh, false);
    // The plain gradients packed as the one-rank group packs them (its flat buffer is the whole group).
    Result packed = run(mesh, true);
    std::vector<double> flat;
    for (std::size_t i = 2; i < want.grads.size(); ++i) {
      flat.insert(flat.end(), want.grads[i].begin(), want.grads[i].end());
    }
    want.grads.resize(2);
    want.grads.push_back(flat);
    compare(packed, want, 1e-12, "FSDP on one rank");
  });
  for (int dp = 2; dp <= 4; ++dp) {
    testing::run_ranks(dp, [&](ProcessGroup& world) {
      const Result got = run(init_device_mesh<Mesh>(world, dp, 1, 1), true);
      compare(got, want, 1e-11, "FSDP over dp=" + std::to_string(dp));
    });
  }
}

#if DTENSOR_HAS_CHECKPOINT

// ---- The full training state in a sharded checkpoint (train/train_state.hpp): a small GPT of nn layers
// (nn::LanguageModel: embedding, one block with GQA attention and a SwiGLU MLP, a final norm, the head)
// trained by nn::DdpTrainer or nn::FsdpTrainer with AdamW in double, saved after 2 steps and resumed for 2
// more:
//  - on the same layout (replicated parameters on 2 ranks; FSDP groups on 2 ranks): the losses and the final
//    parameters equal those of the uninterrupted run bit for bit;
//  - onto other layouts and rank counts (saved under FSDP x TP on (dp=2, tp=2), resumed replicated under TP
//    on 2 ranks and on one rank; saved replicated under TP, resumed under FSDP on 3 ranks): equal to the
//    uninterrupted one-rank run within 1e-10;
//  - the progress (step, data position, random stream) comes back as saved; a model of other shapes is an
//    error naming the parameter.

namespace {
namespace state {

const nn::TransformerConfig config{
    .vocab = 13, .hidden = 8, .heads = 4, .kv_heads = 2, .ffn = 10, .rope_base = 100, .init_std = 0.5};

/// The model in layout L (double): embedding, one block, final norm, head.
template <class L>
using Model = nn::LanguageModel<double, L, nn::TransformerBlock>;

/// Step `step`'s ids and targets (batch 3, seq 5): a pattern of the step.
template <class L>
std::pair<nn::ids_t<L>, nn::ids_t<L>> batch(const DeviceMesh<Mesh>& mesh, std::int64_t step) {
  auto make = [&](std::int64_t shift) {
    return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
      return from_global_index<std::int64_t, Q...>(mesh, {3, 5}, [&](const auto& i) {
        return (i[0] * 7 + i[1] * 3 + step * 5 + shift + i[1] * i[1]) % config.vocab;
      });
    }(static_cast<nn::ids_t<L>*>(nullptr));
  };
  return {make(0), make(1)};
}

/// What a run gives: the losses of its steps and the final parameters (full).
struct Run {
  std::vector<double> losses;
  std::vector<std::vector<double>> params;
  TrainingProgress progress;
};

const optim::AdamWOptions adamw{.lr = 1e-2, .weight_decay = 0.01};

/// Steps [first, last) in layout L with nn::FsdpTrainer over dp (Sharded) or nn::DdpTrainer: loads `from`
/// first (unless empty), saves into `to` at the end (unless empty).
template <class L, bool Sharded>
Run train(const DeviceMesh<Mesh>& mesh, int first, int last, const std::string& from, const std::string& to) {
  init::InitKeys keys(5);
  using Trainer =
      std::conditional_t<Sharded, nn::FsdpTrainer<Model<L>, Fsdp<"dp">>, nn::DdpTrainer<Model<L>>>;
  Trainer trainer(mesh, Model<L>(mesh, config, 1, keys));
  optim::AdamW opt(adamw);
  Run run;
  if (!from.empty()) {
    run.progress = load_training_state(trainer, from, opt);
    expect(run.progress.step == first, "the resumed step " + std::to_string(run.progress.step));
  }
  for (int s = first; s < last; ++s) {
    const auto [ids, targets] = batch<L>(mesh, s);
    run.losses.push_back(trainer.step(ids, targets, opt).loss);
  }
  if (!to.empty()) {
    save_training_state(trainer, to, opt,
                        {.step = last, .data_position = 3 * last, .rng_seed = 17, .rng_offset = 4});
  }
  trainer.with_gathered([&](auto& m) {
    nn::for_each_tensor(m.parameters(), [&](const auto& w) {
      const auto full = w.full_tensor();
      run.params.emplace_back(full.data(), full.data() + full.numel());
    });
  });
  return run;
}
/// `tail` equals the last steps of `whole`, within `tol` (0: bit for bit).
void compare(const Run& tail, const Run& whole, double tol, const std::string& name) {
  const std::size_t skip = whole.losses.size() - tail.losses.size();
  for (std::size_t s = 0; s < tail.losses.size(); ++s) {
    const double d = std::abs(tail.losses[s] - whole.losses[skip + s]);
    expect(d <= tol * std::abs(whole.losses[skip + s]),
           name + ": step " + std::to_string(skip + s + 1) + "'s loss " + std::to_string(tail.losses[s]) +
               ", uninterrupted " + std::to_string(whole.losses[skip + s]));
  }
  expect(tail.params.size() == whole.params.size(), name + ": the number of parameters");
  for (std::size_t i = 0; i < whole.params.size(); ++i) {
    for (std::size_t e = 0; e < whole.params[i].size(); ++e) {
      const double d = std::abs(tail.params[i][e] - whole.params[i][e]);
      expect(d <= tol * std::max(1.0, std::abs(whole.params[i][e])),
             name + ": parameter " + std::to_string(i) + " element " + std::to_string(e) + " differs by " +
                 std::to_string(d));
    }
  }
}

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("dtensor_train_state_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

} // namespace state
} // namespace

TEST_CASE("nn layers, training state: resumed on the same layout, the run goes on bit for bit",
          "[parallel][checkpoint]") {
  SECTION("replicated parameters, tensor + sequence parallel on 2 ranks") {
    const std::string dir = state::scratch("tp");
    testing::run_ranks(2, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 1, 1, 2);
      const state::Run whole = state::train<TpSp, false>(mesh, 0, 4, "", "");
      state::train<TpSp, false>(mesh, 0, 2, "", dir);
      const state::Run tail = state::train<TpSp, false>(mesh, 2, 4, dir, "");
      state::compare(tail, whole, 0, "tp resumed on tp");
      expect(tail.progress.data_position == 6 && tail.progress.rng_seed == 17 &&
                 tail.progress.rng_offset == 4,
             "the progress comes back as saved");
    });
  }
  SECTION("FSDP groups on 2 ranks") {
    const std::string dir = state::scratch("fsdp");
    testing::run_ranks(2, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<Mesh>(world, 2, 1, 1);
      const state::Run whole = state::train<Dp, true>(mesh, 0, 4, "", "");
      state::train<Dp, true>(mesh, 0, 2, "", dir);
      const state::Run tail = state::train<Dp, true>(mesh, 2, 4, dir, "");
      state::compare(tail, whole, 0, "fsdp resumed on fsdp");
    });
  }
}

TEST_CASE("nn layers, training state: saved on one layout, resumed on another and on other rank counts, as "
          "one rank",
          "[parallel][checkpoint]") {
  state::Run whole;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    whole = state::train<Dp, false>(init_device_mesh<Mesh>(one, 1, 1, 1), 0, 4, "", "");
  });
  const std::string from_fsdp_tp = state::scratch("fsdp_tp");
  testing::run_ranks(4, [&](ProcessGroup& world) {
    state::train<TpSp, true>(init_device_mesh<Mesh>(world, 2, 1, 2), 0, 2, "", from_fsdp_tp);
  });
  testing::run_ranks(2, [&](ProcessGroup& world) {
    const state::Run tail =
        state::train<TpSp, false>(init_device_mesh<Mesh>(world, 1, 1, 2), 2, 4, from_fsdp_tp, "");
    state::compare(tail, whole, 1e-10, "saved under fsdp x tp on 4, resumed under tp on 2");
  });
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const state::Run tail =
        state::train<Dp, false>(init_device_mesh<Mesh>(one, 1, 1, 1), 2, 4, from_fsdp_tp, "");
    state::compare(tail, whole, 1e-10, "saved under fsdp x tp on 4, resumed on one rank");
  });
  const std::string from_tp = state::scratch("tp_to_fsdp");
  testing::run_ranks(2, [&](ProcessGroup& world) {
    state::train<TpSp, false>(init_device_mesh<Mesh>(world, 1, 1, 2), 0, 2, "", from_tp);
  });
  testing::run_ranks(3, [&](ProcessGroup& world) {
    const state::Run tail = state::train<Dp, true>(init_device_mesh<Mesh>(world, 3, 1, 1), 2, 4, from_tp, "");
    state::compare(tail, whole, 1e-10, "saved under tp on 2, resumed under fsdp on 3");
  });
  SECTION("a model of other shapes: an error naming the parameter") {
    testing::run_ranks(1, [&](ProcessGroup& one) {
      const auto mesh = init_device_mesh<Mesh>(one, 1, 1, 1);
      init::InitKeys keys(1);
      nn::Embedding<double, Dp> emb(mesh, state::config.vocab + 1, state::config.hidden, keys.next());
      optim::AdamW opt(state::adamw);
      try {
        load_training_state(from_tp, opt, emb.parameters());
        expect(false, "no error for a vocabulary of another size");
      } catch (const Error& e) {
        expect(std::string(e.what()).find("parameter 0 has global shape (14, 8), the checkpoint's (13, 8)") !=
                   std::string::npos,
               std::string("the message: ") + e.what());
      }
    });
  }
}

#endif // DTENSOR_HAS_CHECKPOINT

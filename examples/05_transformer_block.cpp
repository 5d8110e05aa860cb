// 05: one transformer block, tensor + sequence parallel on a (dp=2, tp=2) mesh, forward and backward,
// every gradient checked against the same model on one rank.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_05_transformer_block
//
//   ids [S(0),R] --embedding (vocab parallel: W_emb [R,S(0)])--> [S(0),P] --reduce_scatter(tp)--> h
//   [S(0),S(0)]
//   attention (head-parallel TP + SP):
//     h --rms_norm--> --all_gather(tp)--> x [S(0),R] --x Wq, Wk, Wv [R,S(1)]--> [S(0),S(1)] (10 x heads*hd)
//     --unflatten, transpose--> (batch, heads, seq, hd) [S(0),S(1)]: sequences over dp, heads over tp
//     --rotary_embedding (q, k)--> --causal scaled_dot_product_attention (local: no communication)-->
//     --transpose, flatten--> [S(0),S(1)] --x Wo [S(0),R]--> [S(0),P] --reduce_scatter(tp)--> + h = h1
//   MLP: h1 --rms_norm--> --all_gather(tp)--> x W1 [R,S(1)] --> gelu --x W2 [R,S(0)]--> [S(0),P]
//     --reduce_scatter(tp)--> + h1 = h2 [S(0),S(0)]
//   h2 --rms_norm--> --all_gather(tp)--> x W_out [R,S(1)] --> logits [S(0),S(1)] (tokens over dp, vocab
//     over tp) --cross_entropy (loss_parallel: no gather of the logits)--> loss
//
// 10 tokens are 2 sequences of 5 (batch over dp); between the tensor-parallel regions they are sharded over
// tp too (sequence parallel); each placement is a type, so a wrong wiring does not compile. The backward
// runs each op's context in reverse: every redistribute's backward is its dual collective
// (redistribute_with_backward). The weights come from randn (the same on any mesh and placements), so the
// one-rank model starts from the same numbers; its loss and the full gradients of all the weights must
// agree to 1e-12 (double precision; the orders of summation differ). The 5 tokens of a sequence over 2 tp
// ranks give uneven shards (3, 2).
//
// The forward and backward run under a CommDebugMode, and what it records must be exactly what the
// structure above implies (expected_comm): per op, mesh axis and reduce op, the count and the bytes this
// rank received; on the (1, 1) mesh of the reference nothing at all (an axis of size 1 costs nothing).

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"dp">, Axis<"tp">>;
using R = Replicate;
using P = Partial<>;
template <int D>
using S = Shard<D>;

constexpr std::int64_t kVocab = 11, kHidden = 8, kFfn = 12, kBatch = 2, kSeq = 5, kTokens = kBatch * kSeq;
constexpr std::int64_t kHeads = 2, kHeadDim = kHidden / kHeads;

/// The weights' gradients, as full tensors (for comparing with the one-rank model).
struct Result {
  double loss = 0;
  Tensor<double, 2> emb, wq, wk, wv, wo, w1, w2, out;
  Tensor<double, 1> norm0, norm1, norm2;
  std::string comm;      ///< the communication of the forward and backward
  std::string comm_diff; ///< how it differs from expected_comm (empty: not at all)
};

/// One line of a rank's expected communication: `count` ops `op` over mesh axis `axes` (reducing by
/// `reduce`, for those that reduce) in which this rank received `bytes`.
struct CommPin {
  std::string op, axes;
  std::optional<ReduceOp> reduce;
  std::int64_t count = 0, bytes = 0;
};

/// torch.chunk's share of rank r when n items are split k ways.
std::int64_t chunk(std::int64_t n, std::int64_t k, std::int64_t r) {
  const std::int64_t c = (n + k - 1) / k;
  return std::max<std::int64_t>(0, std::min(n, (r + 1) * c) - r * c);
}
/// What an all_reduce of `count` doubles over n ranks is counted as receiving: a ring's 2(n - 1)/n.
std::int64_t ring_bytes(std::int64_t n, std::int64_t count) {
  return n > 1 ? (2 * (n - 1) * count + n - 1) / n * 8 : 0;
}

/// The forward and backward communication of rank (d, t) on a (dp, tp) mesh, from the block's structure:
/// three tensor-parallel regions (attention, the MLP and the head), each entered by an all_gather over tp of
/// the sequence-parallel activations (backward: reduce_scatter) and three left by a reduce_scatter over tp
/// (the embedding's, the attention's and the MLP's Partial outputs; backward: all_gather); attention itself
/// moves nothing (heads over tp, sequences over dp); the loss on logits [S(0),S(1)]: an all_reduce(max) and
/// an all_reduce(sum) of two values per row over tp (the vocab), one of two values over dp (the rows).
/// Nothing else: no gather of the logits, no gradient reduction (the gains' gradients stay Partial here).
std::vector<CommPin> expected_comm(std::int64_t dp, std::int64_t tp, std::int64_t d, std::int64_t t) {
  const std::int64_t rows = chunk(kTokens, dp, d); // tokens of this dp coordinate: the logits' rows
  const std::int64_t own = chunk(rows, tp, t);     // of those, this rank's between the TP regions
  const std::int64_t act = kHidden * 8;            // bytes of one token's activation
  const std::int64_t on_tp = tp > 1 ? 1 : 0, on_dp = dp > 1 ? 1 : 0; // none over an axis of size 1
  return {{"all_gather", "tp", std::nullopt, 6 * on_tp, 6 * (rows - own) * act},
          {"reduce_scatter", "tp", ReduceOp::sum, 6 * on_tp, 6 * (tp - 1) * own * act},
          {"all_reduce", "tp", ReduceOp::max, on_tp, ring_bytes(tp, rows)},
          {"all_reduce", "tp", ReduceOp::sum, on_tp, ring_bytes(tp, 2 * rows)},
          {"all_reduce", "dp", ReduceOp::sum, on_dp, ring_bytes(dp, 2)}};
}

/// Empty when `comm` recorded exactly `want` and nothing else; otherwise the differences.
std::string compare_comm(const CommDebugMode& comm, const std::vector<CommPin>& want) {
  std::string diff;
  std::int64_t total = 0;
  for (const CommPin& w : want) {
    const std::int64_t count = w.reduce ? comm.count(w.op, w.axes, *w.reduce) : comm.count(w.op, w.axes);
    const std::int64_t bytes = w.reduce ? comm.bytes(w.op, w.axes, *w.reduce) : comm.bytes(w.op, w.axes);
    const std::string name =
        w.op + (w.reduce ? "(" + std::string(to_string(*w.reduce)) + ")" : "") + " over " + w.axes;
    if (count != w.count || bytes != w.bytes) {
      diff += " " + name + ": " + std::to_string(count) + " ops, " + std::to_string(bytes) + " bytes where " +
              std::to_string(w.count) + " ops, " + std::to_string(w.bytes) + " bytes expected;";
    }
    total += w.count;
  }
  if (comm.total_count() != total) {
    diff += " " + std::to_string(comm.total_count()) + " ops in all where " + std::to_string(total) +
            " expected;";
  }
  return diff;
}

/// ids and targets: small integers, the same on every rank (each rank keeps its block).
template <class DT>
DT tokens(const DeviceMesh<Mesh>& mesh, int seed) {
  Tensor<std::int64_t, 1> full({kTokens});
  for (std::int64_t i = 0; i < kTokens; ++i) {
    full(i) = (i * 7 + seed * 3 + i * i) % kVocab;
  }
  return distribute_tensor<S<0>, R>(mesh, full);
}

/// The block on `mesh` (any sizes: (2, 2) for the parallel run, (1, 1) for the reference).
Result run_block(const DeviceMesh<Mesh>& mesh) {
  // Parameters: randn, scaled; their values do not depend on the placements.
  auto w_emb = scale(randn<double, R, S<0>>(mesh, {kVocab, kHidden}, 1, 0), 0.5);
  auto g0 = randn<double, R, R>(mesh, {kHidden}, 1, 6);
  auto wq = scale(randn<double, R, S<1>>(mesh, {kHidden, kHidden}, 1, 7), 0.3);
  auto wk = scale(randn<double, R, S<1>>(mesh, {kHidden, kHidden}, 1, 8), 0.3);
  auto wv = scale(randn<double, R, S<1>>(mesh, {kHidden, kHidden}, 1, 9), 0.3);
  auto wo = scale(randn<double, R, S<0>>(mesh, {kHidden, kHidden}, 1, 10), 0.3);
  auto g1 = randn<double, R, R>(mesh, {kHidden}, 1, 1);
  auto w1 = scale(randn<double, R, S<1>>(mesh, {kHidden, kFfn}, 1, 2), 0.3);
  auto w2 = scale(randn<double, R, S<0>>(mesh, {kFfn, kHidden}, 1, 3), 0.3);
  auto g2 = randn<double, R, R>(mesh, {kHidden}, 1, 4);
  auto w_out = scale(randn<double, R, S<1>>(mesh, {kHidden, kVocab}, 1, 5), 0.3);
  const auto ids = tokens<DTensor<std::int64_t, 1, Mesh, S<0>, R>>(mesh, 1);
  const auto targets = tokens<DTensor<std::int64_t, 1, Mesh, S<0>, R>>(mesh, 2);

  CommDebugMode comm;
  // Forward.
  auto [e, emb_back] = embedding(ids, w_emb, with_backward);      // [S(0),P]
  auto [h, rs0_back] = redistribute_with_backward<S<0>, S<0>>(e); // reduce_scatter
  // attention: heads over tp, sequences over dp
  auto [n0, norm0_back] = rms_norm<1>(h, g0, 1e-6, with_backward); // [S(0),S(0)]
  auto [x0, ag0_back] = redistribute_with_backward<S<0>, R>(n0);   // all_gather
  // (tokens, heads * hd) [S(0),S(1)] -> (batch, heads, seq, hd) [S(0),S(1)], and back
  const auto to_heads = [](const auto& t) {
    auto [a4, split_back] = unflatten<1>(t, std::array<std::int64_t, 2>{kHeads, kHeadDim}, with_backward);
    auto [b4, batch_back] = unflatten<0>(a4, std::array<std::int64_t, 2>{kBatch, kSeq}, with_backward);
    auto [bhsd, t_back] = transpose<1, 2>(b4, with_backward);
    return std::tuple{bhsd, [=](const auto& g) { return split_back(batch_back(t_back(g))); }};
  };
  auto [qf, wq_back] = matmul(x0, wq, with_backward); // column-parallel: [S(0),S(1)]
  auto [kf, wk_back] = matmul(x0, wk, with_backward);
  auto [vf, wv_back] = matmul(x0, wv, with_backward);
  auto [q, q_back] = to_heads(qf);
  auto [k, k_back] = to_heads(kf);
  auto [v, v_back] = to_heads(vf);
  auto [qr, qr_back] = rotary_embedding<2>(q, {}, with_backward);
  auto [kr, kr_back] = rotary_embedding<2>(k, {}, with_backward);
  auto [att, att_back] = scaled_dot_product_attention(qr, kr, v, {.causal = true}, with_backward);
  auto [att_t, att_t_back] = transpose<1, 2>(att, with_backward);
  auto [att_f, att_f_back] = flatten<2, 3>(att_t, with_backward);
  auto [att_2d, att_2d_back] = flatten<0, 1>(att_f, with_backward); // (tokens, heads * hd) [S(0),S(1)]
  auto [y, wo_back] = matmul(att_2d, wo, with_backward);            // [S(0),P]
  auto [y_sp, rs_att_back] = redistribute_with_backward<S<0>, S<0>>(y);
  auto [h1, add0_back] = add(h, y_sp, with_backward); // residual
  // MLP
  auto [n1, norm1_back] = rms_norm<1>(h1, g1, 1e-6, with_backward); // [S(0),S(0)]
  auto [x1, ag1_back] = redistribute_with_backward<S<0>, R>(n1);    // all_gather
  auto [u, mm1_back] = matmul(x1, w1, with_backward);               // [S(0),S(1)]
  auto [a, gelu_back] = gelu(u, with_backward);
  auto [m, mm2_back] = matmul(a, w2, with_backward);                 // [S(0),P]
  auto [v_sp, rs1_back] = redistribute_with_backward<S<0>, S<0>>(m); // reduce_scatter
  auto [h2, add_back] = add(h1, v_sp, with_backward);                // residual
  auto [n2, norm2_back] = rms_norm<1>(h2, g2, 1e-6, with_backward);
  auto [x2, ag2_back] = redistribute_with_backward<S<0>, R>(n2);
  auto [logits, head_back] = matmul(x2, w_out, with_backward); // [S(0),S(1)]
  auto [loss, loss_back] = cross_entropy(logits, targets, with_backward);

  // Backward, in reverse.
  const auto dlogits = loss_back(1.0);
  auto [dx2, dw_out] = head_back(dlogits);
  auto [dh2, dg2] = norm2_back(ag2_back(dx2));
  auto [dh_res, dv_sp] = add_back(dh2);
  auto [da, dw2] = mm2_back(rs1_back(dv_sp));
  auto [dx1, dw1] = mm1_back(gelu_back(da));
  auto [dh1_norm, dg1] = norm1_back(ag1_back(dx1));
  const auto dh1 = add(dh_res, dh1_norm);
  auto [dh_res0, dy_sp] = add0_back(dh1);
  auto [datt_2d, dwo] = wo_back(rs_att_back(dy_sp));
  const auto datt = att_t_back(att_f_back(att_2d_back(datt_2d)));
  auto [dqr, dkr, dv] = att_back(datt);
  auto [dx_q, dwq] = wq_back(q_back(qr_back(dqr))); // x0 feeds q, k and v: dx0 sums the three
  auto [dx_k, dwk] = wk_back(k_back(kr_back(dkr)));
  auto [dx_v, dwv] = wv_back(v_back(dv));
  auto [dh0_norm, dg0] = norm0_back(ag0_back(add(add(dx_q, dx_k), dx_v)));
  const auto dh = add(dh_res0, dh0_norm);
  const auto dw_emb = emb_back(rs0_back(dh));
  const std::string traffic = comm.to_string();
  const std::string diff =
      compare_comm(comm, expected_comm(mesh.size<"dp">(), mesh.size<"tp">(), mesh.local_rank<"dp">(),
                                       mesh.local_rank<"tp">()));

  return {loss.full_tensor()(),
          dw_emb.full_tensor(),
          dwq.full_tensor(),
          dwk.full_tensor(),
          dwv.full_tensor(),
          dwo.full_tensor(),
          dw1.full_tensor(),
          dw2.full_tensor(),
          dw_out.full_tensor(),
          dg0.full_tensor(),
          dg1.full_tensor(),
          dg2.full_tensor(),
          traffic,
          diff};
}

template <class T, int R>
double max_difference(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  double d = 0;
  for (std::int64_t e = 0; e < a.numel(); ++e) {
    d = std::max(d, std::abs(double(a.data()[e]) - double(b.data()[e])));
  }
  return d;
}

} // namespace

int main() {
  ProcessGroup world = init_process_group();
  auto mesh = init_device_mesh<Mesh>(world, 2, 2);
  const Result got = run_block(mesh);
  // The same model on one rank: an in-process world of 1, a (1, 1) mesh.
  Result want;
  testing::run_ranks(1, [&](ProcessGroup& one) { want = run_block(init_device_mesh<Mesh>(one, 1, 1)); });
  const double tol = 1e-12;
  bool ok = std::abs(got.loss - want.loss) <= tol * std::abs(want.loss);
  const double diffs[] = {max_difference(got.emb, want.emb),     max_difference(got.wq, want.wq),
                          max_difference(got.wk, want.wk),       max_difference(got.wv, want.wv),
                          max_difference(got.wo, want.wo),       max_difference(got.w1, want.w1),
                          max_difference(got.w2, want.w2),       max_difference(got.out, want.out),
                          max_difference(got.norm0, want.norm0), max_difference(got.norm1, want.norm1),
                          max_difference(got.norm2, want.norm2)};
  for (double d : diffs) {
    ok = ok && d <= tol;
  }
  // Every rank's communication as the structure implies, and the reference's (nothing moved).
  const bool comm_ok = got.comm_diff.empty() && want.comm_diff.empty();
  if (!got.comm_diff.empty()) {
    std::printf("rank %d: collectives differ from the block's structure:%s\n%s", world.rank(),
                got.comm_diff.c_str(), got.comm.c_str());
  }
  if (!want.comm_diff.empty()) {
    std::printf("rank %d: the one-rank reference's collectives differ:%s\n%s", world.rank(),
                want.comm_diff.c_str(), want.comm.c_str());
  }
  if (world.rank() == 0) {
    std::printf("one transformer block on (dp=2, tp=2): loss %.12f (one rank: %.12f)\n", got.loss, want.loss);
    std::printf(
        "max |gradient - one rank's|: W_emb %.1e, Wq %.1e, Wk %.1e, Wv %.1e, Wo %.1e, W1 %.1e, W2 %.1e, "
        "W_out %.1e, norm0 %.1e, norm1 %.1e, norm2 %.1e\n",
        diffs[0], diffs[1], diffs[2], diffs[3], diffs[4], diffs[5], diffs[6], diffs[7], diffs[8], diffs[9],
        diffs[10]);
    std::printf("communication of rank 0's forward and backward (no gather of the logits):\n%s",
                got.comm.c_str());
    std::printf("%s\n", ok ? "OK: the loss and every gradient equal the one-rank model's"
                           : "MISMATCH with the one-rank model");
    std::printf("%s\n", comm_ok ? "OK: every rank's collectives (op, axis, reduce op, count, bytes) are the "
                                  "block's"
                                : "MISMATCH in the collectives");
  }
  return ok && comm_ok ? 0 : 1;
}

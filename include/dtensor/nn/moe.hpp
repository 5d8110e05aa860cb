#pragma once
// nn::Moe: a mixture-of-experts feed-forward layer on DTensors, in the layout L. Its experts are SwiGLU MLPs
// (Mixtral's), sharded over the layout's expert-parallel axis (nn::ExpertParallel<"ep">) and, inside each
// expert, over the tensor-parallel axis as nn::Mlp is; the tokens come and go as nn::act_t.
//
//   using L = nn::Layout<MeshShape<Axis<"dp">, Axis<"ep">>, nn::ExpertParallel<"ep">>;
//   nn::Moe<float, L> moe(mesh, hidden, {.experts = 8, .top_k = 2, .ffn = 256, .aux_loss_coeff = 0.01},
//                         keys);
//   auto [y, back] = moe.forward(x, with_backward);
//   auto [dx, grads] = back(dy);   // grads: router, W1, W3, W2
//   moe.stats().aux_loss;          // the load-balancing loss of that forward
//
// Parameters, and what each axis does to them (batch: every axis but tp; ep is one of them):
//
//   tensor                        batch (not ep)   ep       tp
//   router (experts, hidden)      R                R        R
//   W1, W3 (experts, ffn, hidden) R                S(0)     S(1)
//   W2 (experts, hidden, ffn)     R                S(0)     S(2)
//
// Forward: the tokens are gathered over tp on entry (sequence parallelism; every tp rank then routes the
// same tokens), the router's logits x Wr^T give each token its top-k experts and gates
// (nn/moe_routing.hpp); the per-expert counts and the probabilities' sums are all_gathered over the
// batch axes (one small collective), which gives the capacity in the batch's token order and the
// load-balancing loss over the whole batch, so any layout computes what one rank computes. The kept rows,
// sorted by expert, go to the experts' ranks by all_to_all_single over ep (the counts first, then the
// rows with variable splits); each rank runs its local experts as grouped GEMMs (one call per weight for all
// its local experts: local/grouped_gemm.hpp) and the rows return by the reverse all_to_all_single. Each
// token's output is the gate-weighted sum of its experts' rows: Partial over tp (each tp rank holds a slice
// of every expert's ffn), completed on exit as nn::Mlp's is.
//
// Meta tensors (a dry run) have no logits to route by: each token takes k experts in turn
// (detail::uniform_logits), so every expert gets its even share of the batch, and the gates' gradients are 0.
//
// Backward: the duals in reverse (all_to_all with its splits swapped, the experts' GEMMs, the gates',
// the router's), plus the load-balancing loss's gradient times aux_loss_coeff (added once: on tp coordinate
// 0 of the Partial). Gradients: the router's Partial<sum> over the batch axes and tp, the experts'
// Partial<sum> over the batch axes but ep (S(0) there) — what DDP and FSDP reduce, as for every layer.
// Routing runs on the host (t x experts values per rank); rows move by local/rows.hpp's kernels, GEMMs by the
// BLAS or cuBLAS. Context parallelism is not supported yet (the capacity order would need the sequence's).

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/local/gemm.hpp"
#include "dtensor/local/grouped_gemm.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/local/rows.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/moe_routing.hpp"
#include "dtensor/nn/unit.hpp"

namespace dtensor {

namespace nn {
namespace detail {

/// The placement code of MoePlaced: d >= 0 Shard<d>, -1 Replicate, -2 Partial<sum>.
inline constexpr int moe_partial = -2;

constexpr Placement moe_placement(int d) noexcept {
  return d >= 0 ? Placement::shard(d) : d == moe_partial ? Placement::partial() : Placement::replicate();
}

template <class L, int Batch, int Ep, int Tp>
struct MoePlaced {
  static constexpr PlacementList list() {
    PlacementList l;
    for (int a = 0; a < L::mesh_shape::rank; ++a) {
      l.push_back(moe_placement(a == L::tp ? Tp : a == L::ep ? Ep : Batch));
    }
    return l;
  }
};

} // namespace detail

/// A DTensor on L's mesh placed by axis role (see detail::moe_placement's code): on the batch axes but ep,
/// on ep, on tp.
template <class L, class T, int Rank, int Batch, int Ep, int Tp>
using moe_placed_t =
    dtensor_from_t<T, Rank, typename L::mesh_shape, &detail::MoePlaced<L, Batch, Ep, Tp>::list>;

namespace detail {

/// Each local expert's rows of `t` (`rows[j]` rows for expert j, in order): views.
template <class T>
std::vector<Tensor<T, 2>> row_blocks(const Tensor<T, 2>& t, const std::vector<std::int64_t>& rows) {
  std::vector<Tensor<T, 2>> blocks;
  std::int64_t lo = 0;
  for (std::int64_t n : rows) {
    blocks.push_back(t.narrow(0, lo, n));
    lo += n;
  }
  return blocks;
}

/// Each local expert's matrix of an (el, a, b) weight: (a, b) views.
template <class T>
std::vector<Tensor<T, 2>> expert_matrices(const Tensor<T, 3>& w) {
  std::vector<Tensor<T, 2>> m;
  for (std::int64_t j = 0; j < w.shape()[0]; ++j) {
    m.push_back(w.narrow(0, j, 1).template view<2>({w.shape()[1], w.shape()[2]}));
  }
  return m;
}

/// c's row block j = a's row block j op(W_j) (+ beta c) for every local expert j: one grouped GEMM.
template <class T>
void expert_gemm(const Tensor<T, 2>& a, const Tensor<T, 3>& w, const Tensor<T, 2>& c,
                 const std::vector<std::int64_t>& rows, bool trans_w, double beta = 0) {
  local::grouped_matmul_into<T>(row_blocks(a, rows), expert_matrices(w), row_blocks(c, rows), false, trans_w,
                                1.0, beta);
}

/// dW_j = (a's row block j)^T (b's row block j) for every local expert j, into (el, ., .): one grouped GEMM.
template <class T>
void expert_weight_grad(const Tensor<T, 2>& a, const Tensor<T, 2>& b, const Tensor<T, 3>& dw,
                        const std::vector<std::int64_t>& rows) {
  local::grouped_matmul_into<T>(row_blocks(a, rows), row_blocks(b, rows), expert_matrices(dw), true, false,
                                1.0, 0.0);
}

/// What nn::Moe's backward keeps from its forward.
template <class T>
struct MoeSaved {
  MoeRouting routing;
  MoeExchange exchange;
  Tensor<T, 2> x;                ///< this rank's tokens (t, hidden), gathered over tp
  Tensor<T, 2> router;           ///< (experts, hidden)
  Tensor<T, 3> w1, w3, w2;       ///< the local experts'
  Tensor<T, 2> xin;              ///< the received rows grouped by local expert (received, hidden)
  Tensor<T, 2> pre1, pre3;       ///< xin W1^T, xin W3^T (received, ffn)
  Tensor<T, 2> silu, act;        ///< silu(pre1), silu(pre1) * pre3: what nn::Mlp's op contexts keep too
  Tensor<T, 2> expert_out;       ///< the rows returned to this rank, in send order (sent, hidden)
  std::vector<double> aux_dprob; ///< the load-balancing term's d/dp per expert, weighted; empty: none here
};

} // namespace detail

template <class T, class L>
class Moe : public Layer<Moe<T, L>> {
  static_assert(L::cp < 0, "nn::Moe: context parallelism is not supported yet (the capacity's token order "
                           "would follow the sequence's shards); use a layout without nn::ContextParallel");

public:
  using router_type = replicated_t<L, T, 2>;         // (experts, hidden)
  using up_type = moe_placed_t<L, T, 3, -1, 0, 1>;   // (experts, ffn, hidden)
  using down_type = moe_placed_t<L, T, 3, -1, 0, 2>; // (experts, hidden, ffn)
  using input_type = act_t<L, T>;

  /// The router, W1, W3 and W2 normal(0, config.init_std) from the next four keys.
  Moe(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t hidden, const MoeConfig& c,
      init::InitKeys& keys, Device device = Device::cpu())
      : router(
            detail::normal_weight<router_type>(mesh, {c.experts, hidden}, c.init_std, keys.next(), device)),
        w1(detail::normal_weight<up_type>(mesh, {c.experts, c.ffn, hidden}, c.init_std, keys.next(), device)),
        w3(detail::normal_weight<up_type>(mesh, {c.experts, c.ffn, hidden}, c.init_std, keys.next(), device)),
        w2(detail::normal_weight<down_type>(mesh, {c.experts, hidden, c.ffn}, c.init_std, keys.next(),
                                            device)),
        config(c), stats_(std::make_shared<MoeStats>()) {
    check(mesh);
  }
  Moe(router_type r, up_type w1, up_type w3, down_type w2, const MoeConfig& c,
      std::shared_ptr<MoeStats> stats = std::make_shared<MoeStats>())
      : router(std::move(r)), w1(std::move(w1)), w3(std::move(w3)), w2(std::move(w2)), config(c),
        stats_(std::move(stats)) {}

  router_type router;
  up_type w1; ///< gate
  up_type w3; ///< up
  down_type w2;
  MoeConfig config;

  static constexpr auto parameter_members() { return std::tuple{&Moe::router, &Moe::w1, &Moe::w3, &Moe::w2}; }
  /// A layer made by with_parameters shares this layer's stats.
  static constexpr auto state_members() { return std::tuple{&Moe::config, &Moe::stats_}; }

  /// What the last forward of this layer (or of one made from it by with_parameters) routed.
  const MoeStats& stats() const noexcept { return *stats_; }

  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    static_assert(std::is_same_v<X, input_type>,
                  "nn::Moe: the input must be nn::act_t<L, T> of the layer's layout and element type");
    check(x.mesh());
    using y_type = moe_placed_t<L, T, 3, 0, 0, detail::moe_partial>; // the gathered tokens, Partial on tp
    auto [xg, entry_back] = dtensor::nn::detail::to_placements<gathered_t<L, T>>::run(x);
    const Tensor<T, 3> xl = xg.local().contiguous();
    const auto shape = xl.shape();
    auto saved = std::make_shared<detail::MoeSaved<T>>();
    Tensor<T, 2> y = run_forward(*saved, xl.template view<2>({shape[0] * shape[1], shape[2]}),
                                 xg.local_offset()[0], x.mesh());
    auto [out, exit_back] = detail::to_placements<input_type>::run(
        y_type(xg.mesh(), y.template view<3>(shape), xg.global_shape()));
    auto back = [saved, mesh = x.mesh(), global = xg.global_shape(), shapes = global_shapes(),
                 entry_back = std::move(entry_back), exit_back = std::move(exit_back)](const auto& dout) {
      using dx_type = moe_placed_t<L, T, 3, 0, 0, detail::moe_partial>;
      using router_grad_type =
          moe_placed_t<L, T, 2, detail::moe_partial, detail::moe_partial, detail::moe_partial>;
      using up_grad_type = moe_placed_t<L, T, 3, detail::moe_partial, 0, 1>;
      using down_grad_type = moe_placed_t<L, T, 3, detail::moe_partial, 0, 2>;
      const Tensor<T, 3> dy = exit_back(dout).local().contiguous();
      const auto s = dy.shape();
      auto g = run_backward(*saved, dy.template view<2>({s[0] * s[1], s[2]}), mesh);
      auto dx = detail::gradient_as<input_type>(
          entry_back(dx_type(mesh, std::get<0>(g).template view<3>(s), global)));
      return Gradients{std::move(dx),
                       std::tuple{router_grad_type(mesh, std::move(std::get<1>(g)), std::get<0>(shapes)),
                                  up_grad_type(mesh, std::move(std::get<2>(g)), std::get<1>(shapes)),
                                  up_grad_type(mesh, std::move(std::get<3>(g)), std::get<1>(shapes)),
                                  down_grad_type(mesh, std::move(std::get<4>(g)), std::get<2>(shapes))}};
    };
    return WithBackward<input_type, decltype(back)>{std::move(out), std::move(back)};
  }
  template <class X>
  input_type forward(const X& x) const {
    return forward(x, with_backward).output;
  }

private:
  using Mesh = DeviceMesh<typename L::mesh_shape>;

  std::shared_ptr<MoeStats> stats_;

  auto global_shapes() const {
    return std::tuple{router.global_shape(), w1.global_shape(), w2.global_shape()};
  }

  static int ep_size(const Mesh& mesh) {
    if constexpr (L::ep >= 0) {
      return mesh.size(L::ep);
    } else {
      return 1;
    }
  }

  void check(const Mesh& mesh) const {
    const int n = ep_size(mesh);
    DTENSOR_CHECK(config.experts > 0 && config.experts % n == 0,
                  "nn::Moe: " + std::to_string(config.experts) +
                      " experts do not divide over the expert-parallel axis of size " + std::to_string(n) +
                      ": choose an expert count that is a multiple of it");
    DTENSOR_CHECK(config.top_k >= 1 && config.top_k <= config.experts,
                  "nn::Moe: top_k " + std::to_string(config.top_k) + " out of [1, " +
                      std::to_string(config.experts) + "]");
    DTENSOR_CHECK(config.ffn > 0, "nn::Moe: ffn (each expert's hidden units) must be positive");
  }

  /// The batch axes (every axis but tp): the tokens' group for the counts.
  static constexpr AxisMask token_axes() {
    AxisMask m = 0;
    for (int a = 0; a < L::mesh_shape::rank; ++a) {
      m = a == L::tp ? m : static_cast<AxisMask>(m | axis_bit(a));
    }
    return m;
  }

  static int token_group_size(const Mesh& mesh) {
    int n = 1;
    for (int a = 0; a < L::mesh_shape::rank; ++a) {
      n *= a == L::tp ? 1 : mesh.size(a);
    }
    return n;
  }

  /// Counts and probability sums over the batch: `before` (assignments per expert of the tokens before
  /// this rank's), and the stats of the whole batch.
  void batch_counts(const detail::MoeRouting& r, std::int64_t batch_offset, const Mesh& mesh,
                    const Tensor<T, 2>& like, std::vector<std::int64_t>& before, MoeStats& st) const {
    const auto e_count = static_cast<std::size_t>(config.experts);
    const std::size_t width = 2 + 2 * e_count;
    std::vector<double> mine(width);
    mine[0] = double(batch_offset);
    mine[1] = double(r.tokens);
    for (std::size_t e = 0; e < e_count; ++e) {
      mine[2 + e] = double(r.counts[e]);
      mine[2 + e_count + e] = r.prob_sums[e];
    }
    std::vector<double> all = mine;
    if (const int members = token_group_size(mesh); members > 1) {
      const ProcessGroup& g = mesh.group_over(token_axes());
      const auto in = dtensor::detail::host_values(mine, like);
      Tensor<double, 1> out = dtensor::detail::empty_like(
          std::array<std::int64_t, 1>{static_cast<std::int64_t>(width) * members}, in);
      all_gather_into_tensor(out, in, g);
      const auto host = out.to(Device::cpu());
      all.assign(host.data(), host.data() + host.numel());
    }
    before.assign(e_count, 0);
    st.tokens = 0;
    st.per_expert.assign(e_count, 0);
    std::vector<double> prob_sums(e_count, 0.0);
    for (std::size_t at = 0; at < all.size(); at += width) {
      const bool earlier = all[at] < mine[0];
      st.tokens += static_cast<std::int64_t>(all[at + 1]);
      for (std::size_t e = 0; e < e_count; ++e) {
        const auto c = static_cast<std::int64_t>(all[at + 2 + e]);
        st.per_expert[e] += c;
        before[e] += earlier ? c : 0;
        prob_sums[e] += all[at + 2 + e_count + e];
      }
    }
    const double tk = double(st.tokens) * config.top_k;
    st.capacity = config.capacity_factor > 0
                      ? static_cast<std::int64_t>(std::ceil(config.capacity_factor * tk / double(e_count)))
                      : -1;
    st.aux_loss = 0;
    st.dropped = 0;
    for (std::size_t e = 0; e < e_count; ++e) {
      if (st.tokens > 0) {
        st.aux_loss += double(e_count) * (double(st.per_expert[e]) / tk) * (prob_sums[e] / double(st.tokens));
      }
      st.dropped += st.capacity < 0 ? 0 : std::max<std::int64_t>(0, st.per_expert[e] - st.capacity);
    }
  }

  /// out[...] = in[...] over ep with the given splits (no ep axis, or one rank on it: out is in).
  static Tensor<T, 2> exchange(const Tensor<T, 2>& in, const std::vector<std::int64_t>& out_splits,
                               const std::vector<std::int64_t>& in_splits, std::int64_t out_rows,
                               const Mesh& mesh) {
    if (ep_size(mesh) > 1) {
      Tensor<T, 2> out =
          dtensor::detail::empty_like(std::array<std::int64_t, 2>{out_rows, in.shape()[1]}, in);
      all_to_all_single(out, in, out_splits, in_splits, mesh.group(L::ep));
      return out;
    }
    return in;
  }

  Tensor<T, 2> run_forward(detail::MoeSaved<T>& s, const Tensor<T, 2>& x, std::int64_t batch_offset,
                           const Mesh& mesh) const {
    const std::int64_t t = x.shape()[0];
    const int n = ep_size(mesh);
    const int el = static_cast<int>(config.experts) / n;
    DTENSOR_CHECK(x.shape()[1] == router.global_shape()[1],
                  "nn::Moe: tokens of " + std::to_string(x.shape()[1]) +
                      " features, the layer's hidden size is " + std::to_string(router.global_shape()[1]));
    s.x = x;
    s.router = router.local();
    s.w1 = w1.local();
    s.w3 = w3.local();
    s.w2 = w2.local();
    const bool meta = x.device().is_meta(); // no values: even routing (detail::uniform_logits)
    const auto logits =
        local::matmul(s.x, s.router, false, true).to(meta ? Device::meta() : Device::cpu()); // (t, experts)
    const std::vector<double> l =
        meta ? detail::uniform_logits(t, static_cast<int>(config.experts), config.top_k, batch_offset)
             : std::vector<double>(logits.data(), logits.data() + logits.numel());
    s.routing = detail::route(l, t, static_cast<int>(config.experts), config.top_k);
    std::vector<std::int64_t> before;
    MoeStats& st = *stats_;
    batch_counts(s.routing, batch_offset, mesh, x, before, st);
    detail::apply_capacity(s.routing, before, st.capacity);
    if (config.aux_loss_coeff != 0 && st.tokens > 0 && (L::tp < 0 || mesh.coordinate()[L::tp] == 0)) {
      s.aux_dprob.resize(static_cast<std::size_t>(config.experts));
      const double tk = double(st.tokens) * config.top_k;
      for (std::size_t e = 0; e < s.aux_dprob.size(); ++e) {
        s.aux_dprob[e] = config.aux_loss_coeff * double(config.experts) * (double(st.per_expert[e]) / tk) /
                         double(st.tokens);
      }
    }
    // The counts per expert to the experts' ranks: recv_counts[src * el + j], for local expert j.
    std::vector<std::int64_t> recv_counts = s.routing.kept;
    if (n > 1) {
      const auto counts = dtensor::detail::host_values(s.routing.kept, x);
      Tensor<std::int64_t, 1> recv =
          dtensor::detail::empty_like(std::array<std::int64_t, 1>{config.experts}, counts);
      all_to_all_single(recv, counts, mesh.group(L::ep));
      const auto host = recv.to(Device::cpu());
      recv_counts.assign(host.data(), host.data() + host.numel());
    }
    s.exchange = detail::plan_exchange(s.routing.kept, recv_counts, n, el);
    const detail::MoeExchange& ex = s.exchange;
    const Tensor<T, 2> send = local::gather_rows(x, s.routing.send_rows);
    const Tensor<T, 2> recv = exchange(send, ex.recv_splits, ex.send_splits, ex.received, mesh);
    s.xin = local::gather_rows(recv, ex.group_index);
    const std::int64_t ffn = s.w1.shape()[1];
    s.pre1 = dtensor::detail::empty_like(std::array<std::int64_t, 2>{ex.received, ffn}, x);
    s.pre3 = dtensor::detail::empty_like(std::array<std::int64_t, 2>{ex.received, ffn}, x);
    detail::expert_gemm(s.xin, s.w1, s.pre1, ex.expert_rows, true);
    detail::expert_gemm(s.xin, s.w3, s.pre3, ex.expert_rows, true);
    s.silu = local::map(local::Silu{}, s.pre1);
    s.act = local::map(local::Mul{}, s.silu, s.pre3);
    Tensor<T, 2> grouped_out =
        dtensor::detail::empty_like(std::array<std::int64_t, 2>{ex.received, x.shape()[1]}, x);
    detail::expert_gemm(s.act, s.w2, grouped_out, ex.expert_rows, true);
    const std::int64_t sent = static_cast<std::int64_t>(s.routing.send_rows.size());
    s.expert_out =
        exchange(local::gather_rows(grouped_out, ex.ungroup), ex.send_splits, ex.recv_splits, sent, mesh);
    return local::combine_rows(s.expert_out, s.routing.slot, s.routing.gates, t, config.top_k);
  }

  /// dx (Partial on tp), and the local gradients of the router, W1, W3, W2.
  static auto run_backward(const detail::MoeSaved<T>& s, const Tensor<T, 2>& dy_in, const Mesh& mesh) {
    const detail::MoeRouting& r = s.routing;
    const detail::MoeExchange& ex = s.exchange;
    const std::int64_t t = r.tokens;
    const std::int64_t hidden = s.x.shape()[1];
    const int k = r.k;
    DTENSOR_CHECK(dy_in.shape()[0] == t && dy_in.shape()[1] == hidden,
                  "nn::Moe backward: dy's local shape " + dtensor::detail::shape_to_string(dy_in.shape()) +
                      " is not the input's " + dtensor::detail::shape_to_string(s.x.shape()));
    const Tensor<T, 2> dy = dy_in.contiguous();
    // The gates' gradients: dgate[a] = <dy[token], row[slot]>, on the host (t x k); 0 for meta tensors.
    const bool meta = dy.device().is_meta();
    const auto dy_host = dy.to(meta ? Device::meta() : Device::cpu());
    const auto out_host = s.expert_out.to(meta ? Device::meta() : Device::cpu());
    std::vector<double> dgate(static_cast<std::size_t>(t * k), 0.0);
    std::vector<double> send_gate(r.send_rows.size(), 0.0);
    for (std::int64_t a = 0; a < t * k; ++a) {
      const std::int64_t slot = r.slot[static_cast<std::size_t>(a)];
      if (slot < 0) {
        continue;
      }
      send_gate[static_cast<std::size_t>(slot)] = r.gates[static_cast<std::size_t>(a)];
      double d = 0;
      for (std::int64_t h = 0; h < hidden && !meta; ++h) {
        d += double(dy_host.data()[(a / k) * hidden + h]) * double(out_host.data()[slot * hidden + h]);
      }
      dgate[static_cast<std::size_t>(a)] = d;
    }
    // The rows' gradients (gate * dy of their token), to the experts like the rows.
    const Tensor<T, 2> d_send = local::gather_rows(dy, r.send_rows, send_gate);
    const Tensor<T, 2> d_recv = exchange(d_send, ex.recv_splits, ex.send_splits, ex.received, mesh);
    const Tensor<T, 2> dout = local::gather_rows(d_recv, ex.group_index);
    const std::int64_t ffn = s.w1.shape()[1];
    Tensor<T, 2> dact = dtensor::detail::empty_like(std::array<std::int64_t, 2>{ex.received, ffn}, dy);
    detail::expert_gemm(dout, s.w2, dact, ex.expert_rows, false); // dout W2
    const Tensor<T, 2> dpre3 = local::map(local::Mul{}, s.silu, dact);
    const Tensor<T, 2> dpre1 =
        local::map(local::BackwardOf<local::Silu>{}, s.pre1, local::map(local::Mul{}, s.pre3, dact));
    Tensor<T, 3> dw1 = dtensor::detail::empty_like(s.w1.shape(), s.w1);
    Tensor<T, 3> dw3 = dtensor::detail::empty_like(s.w3.shape(), s.w3);
    Tensor<T, 3> dw2 = dtensor::detail::empty_like(s.w2.shape(), s.w2);
    detail::expert_weight_grad(dpre1, s.xin, dw1, ex.expert_rows); // dpre1^T xin
    detail::expert_weight_grad(dpre3, s.xin, dw3, ex.expert_rows);
    detail::expert_weight_grad(dout, s.act, dw2, ex.expert_rows); // dout^T act
    Tensor<T, 2> dxin = dtensor::detail::empty_like(std::array<std::int64_t, 2>{ex.received, hidden}, dy);
    detail::expert_gemm(dpre1, s.w1, dxin, ex.expert_rows, false);
    detail::expert_gemm(dpre3, s.w3, dxin, ex.expert_rows, false, 1.0);
    const std::int64_t sent = static_cast<std::int64_t>(r.send_rows.size());
    const Tensor<T, 2> dx_send =
        exchange(local::gather_rows(dxin, ex.ungroup), ex.send_splits, ex.recv_splits, sent, mesh);
    Tensor<T, 2> dx = local::combine_rows(dx_send, r.slot, {}, t, k);
    // The router: the gates' and the load-balancing loss's gradients through the softmax.
    const std::vector<double> dlogits = detail::router_grad(r, dgate, s.aux_dprob);
    const Tensor<T, 2> dl =
        meta ? Tensor<T, 2>({t, r.experts}, dy.device())
             : dtensor::detail::host_weights<T>(dlogits, dy).template view<2>({t, r.experts});
    local::matmul_into(dl, s.router, dx, false, false, 1.0, 1.0); // dx += dlogits Wr
    Tensor<T, 2> drouter = local::matmul(dl, s.x, true, false);   // dlogits^T x
    return std::tuple{std::move(dx), std::move(drouter), std::move(dw1), std::move(dw3), std::move(dw2)};
  }
};

} // namespace nn
} // namespace dtensor

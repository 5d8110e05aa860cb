#pragma once
// nn::Attention: causal self-attention (or, config.causal false, an encoder's: every position sees every
// other) with grouped-query attention and RoPE, tensor parallel on the
// layout's tp axis (Megatron: q, k, v column parallel, so the heads are over tp and attention itself is
// local; the output projection row parallel), sequence parallel as the layout says, and context parallel
// in the layout's form (Ring<"cp"> or Ulysses<"cp">, ops/attention.hpp) when it names one.
//
//   x (batch, seq, hidden) act_t --gather on tp (sp)--> x W_q^T, x W_k^T, x W_v^T   (batch, seq, heads * hd)
//     --unflatten, transpose--> (batch, heads, seq, hd): batch over the data axes, heads over tp, seq over cp
//     --rotary (q, k: positions are the global sequence indices, so every shard turns as one rank would)
//     --attention (local, or the layout's context-parallel form)
//     --transpose, flatten--> (batch, seq, heads * hd) --x W_o^T--> Partial over tp --reduce_scatter (sp) or
//     all_reduce--> act_t
//
// Parameters, in order: W_q (heads * hd, hidden), W_k and W_v (kv_heads * hd, hidden), W_o (hidden, heads *
// hd); no biases. The heads are split over tp as Megatron splits them: heads and kv_heads must both be
// divisible by the tp size (an error names the sizes otherwise), so each rank's query heads find their
// key/value heads on the same rank.

#include <array>
#include <concepts>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/core/error.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/attention.hpp"
#include "dtensor/ops/collective_matmul.hpp"
#include "dtensor/ops/matmul.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/rotary.hpp"
#include "dtensor/ops/shape.hpp"

namespace dtensor::nn {

template <class T, class L>
class Attention : public Layer<Attention<T, L>> {
public:
  using q_type = column_weight_t<L, T>; // (heads * hd, hidden)
  using o_type = row_weight_t<L, T>;    // (hidden, heads * hd)
  using input_type = act_t<L, T>;

  /// The projections normal(0, std) from the next four keys.
  Attention(const DeviceMesh<typename L::mesh_shape>& mesh, const TransformerConfig& c, init::InitKeys& keys,
            Device device = Device::cpu())
      : wq(detail::normal_weight<q_type>(mesh, {c.heads * c.head_dim(), c.hidden}, c.init_std, keys.next(),
                                         device)),
        wk(detail::normal_weight<q_type>(mesh, {c.kv_head_count() * c.head_dim(), c.hidden}, c.init_std,
                                         keys.next(), device)),
        wv(detail::normal_weight<q_type>(mesh, {c.kv_head_count() * c.head_dim(), c.hidden}, c.init_std,
                                         keys.next(), device)),
        wo(detail::normal_weight<o_type>(mesh, {c.hidden, c.heads * c.head_dim()}, c.init_std, keys.next(),
                                         device)),
        config(c) {
    check_config();
  }
  Attention(q_type wq, q_type wk, q_type wv, o_type wo, const TransformerConfig& c)
      : wq(std::move(wq)), wk(std::move(wk)), wv(std::move(wv)), wo(std::move(wo)), config(c) {}

  q_type wq, wk, wv;
  o_type wo;
  TransformerConfig config;

  static constexpr auto parameter_members() {
    return std::tuple{&Attention::wq, &Attention::wk, &Attention::wv, &Attention::wo};
  }
  static constexpr auto state_members() { return std::tuple{&Attention::config}; }

  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    return forward(x, with_backward, Kept<X>{x});
  }
  /// With `again`, a function giving x again in the backward (x computed again from what an earlier layer
  /// keeps: nn::TransformerBlock passes its norm's output, nn::NormOutput), which the backward keeps
  /// instead of x.
  template <class X, std::invocable Again>
  auto forward(const X& x, WithBackwardTag, Again again) const {
    return forward_impl<false>(x, std::move(again));
  }
  /// The backward split for zero-bubble pipelines (nn::SplitGradients): B computes dx, W the projections'
  /// gradients from the output gradients B kept (under nn::CollectiveMatmul both in B).
  template <class X>
  auto forward(const X& x, WithSplitBackwardTag) const {
    return forward_impl<true>(x, Kept<X>{x});
  }
  template <class X, std::invocable Again>
  auto forward(const X& x, WithSplitBackwardTag, Again again) const {
    return forward_impl<true>(x, std::move(again));
  }
  template <class X>
  input_type forward(const X& x) const {
    return forward(x, with_backward).output;
  }

private:
  template <bool Split, class X, class Again>
  auto forward_impl(const X& x, Again again) const {
    static_assert(std::is_same_v<X, input_type>,
                  "nn::Attention: the input must be nn::act_t<L, T> of the layer's layout and element type");
    check_split(x.mesh());
    const std::int64_t hd = config.head_dim();
    const RotaryOptions rope{.base = config.rope_base};
    auto [qkv, in_back] = project_in<Split>(x, std::move(again)); // (b, s, heads * hd) each
    auto [q, qh_back] = to_heads(std::get<0>(qkv), config.heads, hd);
    auto [k, kh_back] = to_heads(std::get<1>(qkv), config.kv_head_count(), hd);
    auto [v, vh_back] = to_heads(std::get<2>(qkv), config.kv_head_count(), hd);
    auto [qr, qr_back] = rotary_embedding<2>(q, rope, with_backward);
    auto [kr, kr_back] = rotary_embedding<2>(k, rope, with_backward);
    auto [o, attn_back] = attend(qr, kr, v);
    auto [ot, ot_back] = transpose<1, 2>(o, with_backward); // (b, s, heads, hd)
    auto [of, of_back] = flatten<2, 3>(ot, with_backward);  // (b, s, heads * hd)
    auto [out, out_back] = project_out<Split>(of, o);
    auto back = [=](const auto& dout) {
      auto [dof, dwo] = out_back(dout);
      auto [dq, dk, dv] = attn_back(ot_back(of_back(dof)));
      auto [dx, dw] = in_back(qh_back(qr_back(dq)), kh_back(kr_back(dk)), vh_back(dv));
      auto params = [](auto in, auto o) {
        return std::tuple{std::get<0>(std::move(in)), std::get<1>(std::move(in)), std::get<2>(std::move(in)),
                          std::move(o)};
      };
      if constexpr (Split) {
        return SplitGradients{detail::gradient_as<input_type>(dx),
                              [dw, dwo, params] { return params(dw(), dwo()); }};
      } else {
        return Gradients{detail::gradient_as<input_type>(dx), params(std::move(dw), std::move(dwo))};
      }
    };
    return WithBackward<input_type, decltype(back)>{std::move(out), std::move(back)};
  }

  void check_config() const {
    DTENSOR_CHECK(config.heads > 0 && config.hidden % config.heads == 0 &&
                      config.heads % config.kv_head_count() == 0,
                  "nn::Attention: hidden " + std::to_string(config.hidden) + ", heads " +
                      std::to_string(config.heads) + ", kv_heads " + std::to_string(config.kv_head_count()) +
                      ": the heads must divide hidden and the kv heads the heads");
  }
  template <class Mesh>
  void check_split(const Mesh& mesh) const {
    if constexpr (L::tp >= 0) {
      const int n = mesh.size(L::tp);
      DTENSOR_CHECK(
          config.heads % n == 0 && config.kv_head_count() % n == 0,
          "nn::Attention: " + std::to_string(config.heads) + " heads and " +
              std::to_string(config.kv_head_count()) + " kv heads over the tensor-parallel axis \"" +
              std::string(mesh.names()[L::tp]) + "\" of size " + std::to_string(n) +
              ": both counts must be divisible by it (Megatron's head split); choose a tp size that "
              "divides both");
    }
  }

  /// {x W_q^T, x W_k^T, x W_v^T} after the entry all_gather on tp (sp), as a collective matmul with
  /// nn::CollectiveMatmul; the backward maps (dq, dk, dv) to {dx (Partial on tp, or reduce_scattered
  /// there with sp), {dW_q, dW_k, dW_v}}. It keeps `again` (x, or a function computing it again), not the
  /// gathered copy: under sequence parallelism the sequence shard, gathered again in the backward (1/t of
  /// the copy: docs/parallel.md, activation memory).
  template <bool Split, class X, class Again>
  auto project_in(const X& x, Again again) const {
    if constexpr (L::collective_matmul) {
      auto [y, back] = all_gather_linear(x, std::tie(wq, wk, wv), with_backward, std::move(again));
      return WithBackward<decltype(y), decltype(later<Split>(std::move(back)))>{
          std::move(y), later<Split>(std::move(back))};
    } else {
      using XG = gathered_t<L, T>;
      auto [xg, entry_back] = detail::to_placements<XG>::run(x);
      auto qf = linear(xg, wq);
      auto kf = linear(xg, wk);
      auto vf = linear(xg, wv);
      auto back = [again = std::move(again), wq = wq, wk = wk, wv = wv,
                   entry_back = std::move(entry_back)](const auto& dq, const auto& dk, const auto& dv) {
        const XG g = detail::to_placements<XG>::run(again()).output; // the entry all_gather again (sp)
        const ProductBackward<true, XG, q_type> pq(g, wq), pk(g, wk), pv(g, wv);
        if constexpr (Split) { // W gathers x again rather than holding the gathered copy since B
          auto [dxq, dwq] = pq.split_taking_a(dq);
          auto [dxk, dwk] = pk.split_taking_a(dk);
          auto [dxv, dwv] = pv.split_taking_a(dv);
          return std::pair{entry_back(add(add(dxq, dxk), dxv)), [dwq, dwk, dwv, again] {
                             const XG g = detail::to_placements<XG>::run(again()).output;
                             return std::tuple{dwq(g), dwk(g), dwv(g)};
                           }};
        } else {
          auto [dxq, dwq] = pq(dq);
          auto [dxk, dwk] = pk(dk);
          auto [dxv, dwv] = pv(dv);
          return std::pair{entry_back(add(add(dxq, dxk), dxv)),
                           std::tuple{std::move(dwq), std::move(dwk), std::move(dwv)}};
        }
      };
      return WithBackward<std::tuple<decltype(qf), decltype(kf), decltype(vf)>, decltype(back)>{
          {std::move(qf), std::move(kf), std::move(vf)}, std::move(back)};
    }
  }

  /// of W_o^T (Partial on tp) brought to the activations' placements (reduce_scatter with sp, all_reduce
  /// without), the first as a collective matmul with nn::CollectiveMatmul; the backward maps dout to
  /// {dof, dW_o}.
  template <bool Split, class F, class O>
  auto project_out(const F& of, const O& o) const {
    // W_o's gradient needs `of`: rebuilt from the attention's output o (b, heads, s, hd), which the
    // attention keeps for its own backward, rather than kept a second time, transposed.
    auto of_again = [o] { return F(flatten<2, 3>(transpose<1, 2>(o))); };
    if constexpr (L::collective_matmul) {
      auto [y, back] = linear_reduce_scatter<input_type>(of, wo, with_backward, std::move(of_again));
      return WithBackward<input_type, decltype(later<Split>(std::move(back)))>{std::move(y),
                                                                               later<Split>(std::move(back))};
    } else {
      auto [out, exit_back] = detail::to_placements<input_type>::run(linear(of, wo));
      auto back = [of_again = std::move(of_again), wo = wo,
                   exit_back = std::move(exit_back)](const auto& dout) {
        const ProductBackward<true, F, o_type> p(of_again(), wo);
        if constexpr (Split) {
          return p.split(exit_back(dout));
        } else {
          return p(exit_back(dout));
        }
      };
      return WithBackward<input_type, decltype(back)>{std::move(out), std::move(back)};
    }
  }

  /// A fused backward `back` (giving {dx, gradients}) as a split one ({dx, a function giving the gradients}),
  /// with Split; as it is otherwise.
  template <bool Split, class B>
  static auto later(B back) {
    if constexpr (Split) {
      return [back = std::move(back)](const auto&... d) {
        auto [dx, dw] = back(d...);
        return std::pair{std::move(dx), [dw = std::move(dw)] { return dw; }};
      };
    } else {
      return back;
    }
  }

  /// (b, s, n * hd) -> (b, n, s, hd), with the backward.
  template <class F>
  static auto to_heads(const F& f, std::int64_t n, std::int64_t hd) {
    auto [u, u_back] = unflatten<2>(f, std::array<std::int64_t, 2>{n, hd}, with_backward);
    auto [t, t_back] = transpose<1, 2>(u, with_backward);
    auto back = [u_back = std::move(u_back), t_back = std::move(t_back)](const auto& g) {
      return u_back(t_back(g));
    };
    return WithBackward<decltype(t), decltype(back)>{std::move(t), std::move(back)};
  }

  template <class Q, class K, class V>
  auto attend(const Q& q, const K& k, const V& v) const {
    const AttentionOptions o{.causal = config.causal};
    if constexpr (std::is_void_v<typename L::cp_form>) {
      return scaled_dot_product_attention(q, k, v, o, with_backward);
    } else {
      return attention<typename L::cp_form>(q, k, v, o, with_backward);
    }
  }
};

} // namespace dtensor::nn

#pragma once
// nn::TransformerBlock: a pre-norm decoder block, h + attention(norm(h)), then + mlp(norm(.)), in the
// layout L (nn::Layout: tp, sp, cp, ep axes). Its parameters are its layers', in order: the attention
// norm's weight, W_q, W_k, W_v, W_o, the MLP norm's weight, the MLP's weights (W1, W3, W2 for SwiGLU). Input
// and output are nn::act_t; the backward returns the input's gradient and the parameters' in that order.
// With Ffn = nn::Experts the feed-forward is a mixture of experts, nn::Moe (config.moe; its parameters the
// router's and the experts' W1, W3, W2): nn::MoeBlock<T, L>.
//
//   nn::TransformerBlock<float, L> block(mesh, config, keys);
//   auto [y, back] = block.forward(h, with_backward);
//   auto [dh, grads] = back(dy);                      // grads: std::tuple of 9 gradients
//   block.recompute = nn::Recompute::full;            // keep only h; the forward again in the backward
//   using Group = FlatParamGroup<float, Mesh, Fsdp<"dp">, nn::params_of<decltype(block)>>;   // under FSDP
//   Group group = std::apply([](const auto&... p) { return Group(p...); }, block.parameters());

#include <cstdint>
#include <tuple>
#include <utility>

#include "dtensor/nn/attention.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/mlp.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/moe.hpp"
#include "dtensor/nn/norm.hpp"
#include "dtensor/ops/pointwise.hpp"

namespace dtensor::nn {

/// The feed-forward of nn::TransformerBlock that is a mixture of experts (nn::Moe, config.moe).
struct Experts {};

namespace detail {
template <class T, class L, class Ffn>
struct feed_forward {
  using type = Mlp<T, L, Ffn>;
  static type make(const DeviceMesh<typename L::mesh_shape>& mesh, const TransformerConfig& c,
                   init::InitKeys& keys, Device device) {
    return type(mesh, c.hidden, c.ffn, keys, c.init_std, device);
  }
};
template <class T, class L>
struct feed_forward<T, L, Experts> {
  using type = Moe<T, L>;
  static type make(const DeviceMesh<typename L::mesh_shape>& mesh, const TransformerConfig& c,
                   init::InitKeys& keys, Device device) {
    return type(mesh, c.hidden, c.moe, keys, device);
  }
};
} // namespace detail

template <class T, class L, class Activation = SwiGlu, template <class, class> class Norm = RmsNorm>
class TransformerBlock {
public:
  using norm_type = Norm<T, L>;
  using attention_type = Attention<T, L>;
  using mlp_type = typename detail::feed_forward<T, L, Activation>::type;
  using parameter_types = decltype(std::tuple_cat(
      std::declval<parameter_types_t<norm_type>>(), std::declval<parameter_types_t<attention_type>>(),
      std::declval<parameter_types_t<norm_type>>(), std::declval<parameter_types_t<mlp_type>>()));
  using input_type = act_t<L, T>;

  TransformerBlock(const DeviceMesh<typename L::mesh_shape>& mesh, const TransformerConfig& c,
                   init::InitKeys& keys, Device device = Device::cpu())
      : attention_norm(mesh, c.hidden, c.norm_eps, device), attention(mesh, c, keys, device),
        mlp_norm(mesh, c.hidden, c.norm_eps, device),
        mlp(detail::feed_forward<T, L, Activation>::make(mesh, c, keys, device)) {}
  TransformerBlock(norm_type n1, attention_type a, norm_type n2, mlp_type m)
      : attention_norm(std::move(n1)), attention(std::move(a)), mlp_norm(std::move(n2)), mlp(std::move(m)) {}

  norm_type attention_norm;
  attention_type attention;
  norm_type mlp_norm;
  mlp_type mlp;
  Recompute recompute = Recompute::selective; ///< what the backward keeps (nn::Recompute)

  auto parameters() {
    return std::tuple_cat(attention_norm.parameters(), attention.parameters(), mlp_norm.parameters(),
                          mlp.parameters());
  }
  template <class... W>
  auto with_parameters(const W&... w) const {
    static_assert(sizeof...(W) == std::tuple_size_v<parameter_types>,
                  "nn::TransformerBlock::with_parameters: every parameter of the block, in order");
    const auto t = std::tie(w...);
    constexpr std::size_t a = std::tuple_size_v<parameter_types_t<norm_type>>;
    constexpr std::size_t m = a + std::tuple_size_v<parameter_types_t<attention_type>>;
    using U = typename std::tuple_element_t<0, std::tuple<W...>>::value_type;
    TransformerBlock<U, L, Activation, Norm> b(
        detail::with_parameters_at<0>(attention_norm, t), detail::with_parameters_at<a>(attention, t),
        detail::with_parameters_at<m>(mlp_norm, t), detail::with_parameters_at<m + a>(mlp, t));
    b.recompute = recompute;
    return b;
  }

  template <class X>
  auto forward(const X& h, WithBackwardTag) const {
    static_assert(
        std::is_same_v<X, input_type>,
        "nn::TransformerBlock: the input must be nn::act_t<L, T> of the block's layout and element type");
    return detail::block_forward<false>(*this, h);
  }
  /// The backward split for zero-bubble pipelines (nn::SplitGradients): B runs the input's gradient through
  /// the block (the norms' weight gradients with it: reductions, no GEMM), W the projections' and the MLP's
  /// weight gradients.
  template <class X>
  auto forward(const X& h, WithSplitBackwardTag) const {
    static_assert(
        std::is_same_v<X, input_type>,
        "nn::TransformerBlock: the input must be nn::act_t<L, T> of the block's layout and element type");
    return detail::block_forward<true>(*this, h);
  }
  /// The forward with its backward keeping the bound (keep_all false: the norms' outputs and the MLP's
  /// activation computed again in the backward) or every op's inputs (true); what forward runs under
  /// `recompute`. With Split the backward gives nn::SplitGradients.
  template <bool Split = false>
  auto forward_keeping(const input_type& h, bool keep_all) const {
    constexpr auto tag = [] {
      if constexpr (Split) {
        return with_split_backward;
      } else {
        return with_backward;
      }
    }();
    auto [n1, n1_back] = attention_norm.forward(h, with_backward);
    auto [a, a_back] = attention.forward(n1, tag, norm_output(attention_norm, h, n1, !keep_all));
    auto [h1, r1_back] = add(h, a, with_backward);
    auto [n2, n2_back] = mlp_norm.forward(h1, with_backward);
    auto [f, f_back] = [&] {
      if constexpr (std::is_same_v<Activation, Experts>) {
        if constexpr (Split) {
          return forward_split(mlp, n2);
        } else {
          return mlp.forward(n2, with_backward);
        }
      } else {
        return mlp.forward(n2, tag, norm_output(mlp_norm, h1, n2, !keep_all), keep_all);
      }
    }();
    auto [out, r2_back] = add(h1, f, with_backward);
    auto back = [n1_back = std::move(n1_back), a_back = std::move(a_back), r1_back = std::move(r1_back),
                 n2_back = std::move(n2_back), f_back = std::move(f_back),
                 r2_back = std::move(r2_back)](const auto& dout) {
      auto [dh1_res, df] = r2_back(dout);
      auto [dn2, mlp_grads] = f_back(df);
      auto [dh1_norm, n2_grads] = n2_back(dn2);
      auto [dh_res, da] = r1_back(add(dh1_res, dh1_norm));
      auto [dn1, attention_grads] = a_back(da);
      auto [dh_norm, n1_grads] = n1_back(dn1);
      if constexpr (Split) {
        return SplitGradients{add(dh_res, dh_norm), [n1_grads, attention_grads, n2_grads, mlp_grads] {
                                return std::tuple_cat(n1_grads, attention_grads(), n2_grads, mlp_grads());
                              }};
      } else {
        return Gradients{add(dh_res, dh_norm), std::tuple_cat(std::move(n1_grads), std::move(attention_grads),
                                                              std::move(n2_grads), std::move(mlp_grads))};
      }
    };
    return WithBackward<input_type, decltype(back)>{std::move(out), std::move(back)};
  }
  template <class X>
  input_type forward(const X& h) const {
    return forward(h, with_backward).output;
  }
};

/// A transformer block whose feed-forward is a mixture of experts (config.moe), for nn::LanguageModel.
template <class T, class L>
using MoeBlock = TransformerBlock<T, L, Experts>;

} // namespace dtensor::nn

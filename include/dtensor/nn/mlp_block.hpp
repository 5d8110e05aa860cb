#pragma once
// nn::MlpBlock: a pre-norm residual feed-forward block, h + mlp(norm(h)), in the layout L: a transformer
// block without its attention (the block of examples/06_train.cpp, and of MLP-mixer-like stacks). Its
// parameters are the norm's weight and the MLP's (W1, W2 for GELU; W1, W3, W2 for SwiGLU). Input and
// output are nn::act_t; the backward returns the input's gradient and the parameters' in that order. It
// takes the constructor arguments of nn::TransformerBlock (the config's hidden, ffn, norm_eps, init_std), so
// nn::LanguageModel builds either.
//
//   nn::MlpBlock<float, L> block(mesh, config, keys);
//   auto [y, back] = block.forward(h, with_backward);
//   auto [dh, grads] = back(dy);                      // grads: std::tuple{dnorm, dW1, dW2}
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/mlp.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/norm.hpp"
#include "dtensor/ops/pointwise.hpp"

namespace dtensor::nn {

template <class T, class L, class Activation = Gelu, template <class, class> class Norm = RmsNorm>
class MlpBlock {
public:
  using norm_type = Norm<T, L>;
  using mlp_type = Mlp<T, L, Activation>;
  using parameter_types = decltype(std::tuple_cat(std::declval<parameter_types_t<norm_type>>(),
                                                  std::declval<parameter_types_t<mlp_type>>()));
  using input_type = act_t<L, T>;

  MlpBlock(const DeviceMesh<typename L::mesh_shape>& mesh, const TransformerConfig& c, init::InitKeys& keys,
           Device device = Device::cpu())
      : norm(mesh, c.hidden, c.norm_eps, device), mlp(mesh, c.hidden, c.ffn, keys, c.init_std, device) {}
  MlpBlock(norm_type n, mlp_type m) : norm(std::move(n)), mlp(std::move(m)) {}

  norm_type norm;
  mlp_type mlp;
  Recompute recompute = Recompute::selective; ///< what the backward keeps (nn::Recompute)

  auto parameters() { return std::tuple_cat(norm.parameters(), mlp.parameters()); }
  template <class... W>
  auto with_parameters(const W&... w) const {
    static_assert(sizeof...(W) == std::tuple_size_v<parameter_types>,
                  "nn::MlpBlock::with_parameters: every parameter of the block, in order");
    const auto t = std::tie(w...);
    constexpr std::size_t n = std::tuple_size_v<parameter_types_t<norm_type>>;
    using U = typename std::tuple_element_t<0, std::tuple<W...>>::value_type;
    MlpBlock<U, L, Activation, Norm> b(detail::with_parameters_at<0>(norm, t),
                                       detail::with_parameters_at<n>(mlp, t));
    b.recompute = recompute;
    return b;
  }

  template <class X>
  auto forward(const X& h, WithBackwardTag) const {
    static_assert(std::is_same_v<X, input_type>,
                  "nn::MlpBlock: the input must be nn::act_t<L, T> of the block's layout and element type");
    return detail::block_forward<false>(*this, h);
  }
  /// The backward split for zero-bubble pipelines (nn::SplitGradients): the MLP's weight gradients in W.
  template <class X>
  auto forward(const X& h, WithSplitBackwardTag) const {
    static_assert(std::is_same_v<X, input_type>,
                  "nn::MlpBlock: the input must be nn::act_t<L, T> of the block's layout and element type");
    return detail::block_forward<true>(*this, h);
  }
  /// The forward with its backward keeping the bound (keep_all false) or every op's inputs (true); with
  /// Split the backward gives nn::SplitGradients.
  template <bool Split = false>
  auto forward_keeping(const input_type& h, bool keep_all) const {
    auto [n, n_back] = norm.forward(h, with_backward);
    auto [f, f_back] = [&] {
      if constexpr (Split) {
        return mlp.forward(n, with_split_backward, norm_output(norm, h, n, !keep_all), keep_all);
      } else {
        return mlp.forward(n, with_backward, norm_output(norm, h, n, !keep_all), keep_all);
      }
    }();
    auto [out, r_back] = add(h, f, with_backward);
    auto back = [n_back = std::move(n_back), f_back = std::move(f_back),
                 r_back = std::move(r_back)](const auto& dout) {
      auto [dh_res, df] = r_back(dout);
      auto [dn, mlp_grads] = f_back(df);
      auto [dh_norm, norm_grads] = n_back(dn);
      if constexpr (Split) {
        return SplitGradients{add(dh_res, dh_norm),
                              [norm_grads, mlp_grads] { return std::tuple_cat(norm_grads, mlp_grads()); }};
      } else {
        return Gradients{add(dh_res, dh_norm), std::tuple_cat(std::move(norm_grads), std::move(mlp_grads))};
      }
    };
    return WithBackward<input_type, decltype(back)>{std::move(out), std::move(back)};
  }
  template <class X>
  input_type forward(const X& h) const {
    return forward(h, with_backward).output;
  }
};

} // namespace dtensor::nn

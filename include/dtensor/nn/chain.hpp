#pragma once
// nn::Chain: layers run one after the other as one layer (torch's nn.Sequential as one unit): its
// parameters are the layers' in order, its forward feeds each layer's output to the next, its backward runs
// theirs in reverse. A model makes a chain one unit of the contract (nn/contract.hpp) when the layers
// should be one FSDP group and one pipeline piece: a final norm and the head, a pooling and a classifier.
//
//   nn::Chain<nn::RmsNorm<float, L>, nn::LmHead<float, L>> output(norm, head);
//   auto [logits, back] = output.forward(h, with_backward);
//   auto [dh, grads] = back(dlogits);                 // grads: std::tuple{dnorm, dW}
//   auto& head = output.get<1>();
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/unit.hpp"

namespace dtensor::nn {

template <class... Layers>
class Chain {
  static_assert(sizeof...(Layers) >= 1, "nn::Chain: at least one layer");
  static constexpr std::size_t N = sizeof...(Layers);

public:
  using parameter_types = decltype(std::tuple_cat(std::declval<parameter_types_t<Layers>>()...));

  explicit Chain(Layers... l) : layers(std::move(l)...) {}

  std::tuple<Layers...> layers;

  template <std::size_t I>
  auto& get() noexcept {
    return std::get<I>(layers);
  }
  template <std::size_t I>
  const auto& get() const noexcept {
    return std::get<I>(layers);
  }

  auto parameters() {
    return std::apply([](auto&... l) { return std::tuple_cat(l.parameters()...); }, layers);
  }
  /// The same layers on other handles of their parameters (every parameter of the chain, in order).
  template <class... W>
  auto with_parameters(const W&... w) const {
    static_assert(sizeof...(W) == std::tuple_size_v<parameter_types>,
                  "nn::Chain::with_parameters: every parameter of the chain's layers, in order");
    const auto all = std::tie(w...);
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return Chain<decltype(detail::with_parameters_at<offset<I>()>(std::get<I>(layers), all))...>(
          detail::with_parameters_at<offset<I>()>(std::get<I>(layers), all)...);
    }
    (std::make_index_sequence<N>{});
  }

  template <class X>
  auto forward(const X& x) const {
    return forward_from<0>(x);
  }
  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    return forward_from<0>(x, with_backward);
  }

private:
  /// The index of layer I's first parameter in the chain's.
  template <std::size_t I>
  static constexpr std::size_t offset() {
    return [&]<std::size_t... K>(std::index_sequence<K...>) {
      return (std::size_t(0) + ... +
              std::tuple_size_v<parameter_types_t<std::tuple_element_t<K, std::tuple<Layers...>>>>);
    }
    (std::make_index_sequence<I>{});
  }

  template <std::size_t I, class X>
  auto forward_from(const X& x) const {
    if constexpr (I == N) {
      return x;
    } else {
      return forward_from<I + 1>(std::get<I>(layers).forward(x));
    }
  }
  /// Layers I.. with their backward: back(dy) runs them in reverse and concatenates their gradients.
  template <std::size_t I, class X>
  auto forward_from(const X& x, WithBackwardTag) const {
    auto [y, first] = std::get<I>(layers).forward(x, with_backward);
    if constexpr (I + 1 == N) {
      return WithBackward<decltype(y), decltype(first)>{std::move(y), std::move(first)};
    } else {
      auto [z, rest] = forward_from<I + 1>(y, with_backward);
      auto back = [first = std::move(first), rest = std::move(rest)](const auto& dz) {
        auto [dy, rest_grads] = rest(dz);
        auto [dx, grads] = first(dy);
        return Gradients{std::move(dx), std::tuple_cat(std::move(grads), std::move(rest_grads))};
      };
      return WithBackward<decltype(z), decltype(back)>{std::move(z), std::move(back)};
    }
  }
};

} // namespace dtensor::nn

#pragma once
// nn::LmHead: the language-model head and its loss, vocab parallel on the layout's tp axis: the input
// (nn::act_t, after the final norm) is gathered on entry (sequence parallelism: an all_gather over tp),
// multiplied by W (vocab, hidden), Shard<0> on tp, to logits (batch, seq, vocab) whose vocabulary stays
// over tp (nn::logits_t), and cross_entropy runs on them as torch's loss_parallel does: no gather of the
// logits, two all_reduces of one and two values per row over tp, one of two values over the axes that
// shard the rows. The loss is the mean over every (not ignored) target of the global batch.
//
//   nn::LmHead<float, L> head(mesh, vocab, hidden, keys.next());
//   auto [loss, back] = head.forward(h, targets, with_backward);   // loss: a rank-0 DTensor, Replicate
//   auto [dh, grads] = back(1.0);                                   // grads: std::tuple{dW}
//   auto [z, zback] = head.forward(h, with_backward);              // the logits (a unit of a model)
//   auto logits = head.logits(h);                                   // for sampling: logits.full_tensor()

#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/collective_matmul.hpp"
#include "dtensor/ops/loss.hpp"
#include "dtensor/ops/matmul.hpp"

namespace dtensor::nn {

template <class T, class L>
class LmHead : public Layer<LmHead<T, L>> {
public:
  using weight_type = column_weight_t<L, T>; // (vocab, hidden): the vocab over tp
  using input_type = act_t<L, T>;

  LmHead(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t vocab, std::int64_t hidden,
         init::InitKey key, double std = 0.02, Device device = Device::cpu())
      : weight(detail::normal_weight<weight_type>(mesh, {vocab, hidden}, std, key, device)) {}
  explicit LmHead(weight_type w) : weight(std::move(w)) {}

  weight_type weight;

  static constexpr auto parameter_members() { return std::tuple{&LmHead::weight}; }
  static constexpr auto state_members() { return std::tuple{}; }

  /// The logits (batch, seq, vocab), the vocabulary over tp.
  template <class X>
  logits_t<L, T> logits(const X& x) const {
    static_assert(std::is_same_v<X, input_type>, "nn::LmHead: the input must be nn::act_t<L, T>");
    return linear(detail::to_placements<gathered_t<L, T>>::run(x).output, weight);
  }

  /// The logits with their backward (the head as a unit of a model, nn::CrossEntropyLoss after it): back(dz)
  /// gives the input's gradient and W's for the logits' gradient dz.
  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    static_assert(std::is_same_v<X, input_type>, "nn::LmHead: the input must be nn::act_t<L, T>");
    if constexpr (L::collective_matmul) { // the all_gather on tp overlapped with the vocab GEMM
      auto [z, z_back] = all_gather_linear(x, std::tie(weight), with_backward);
      auto back = [z_back = std::move(z_back)](const auto& dz) {
        auto [dx, dw] = z_back(dz);
        return Gradients{detail::gradient_as<input_type>(dx), std::tuple{std::get<0>(std::move(dw))}};
      };
      return WithBackward<logits_t<L, T>, decltype(back)>{std::get<0>(std::move(z)), std::move(back)};
    } else {
      auto [xg, entry_back] = detail::to_placements<gathered_t<L, T>>::run(x); // all_gather on tp (sp)
      auto [z, w_back] = linear(xg, weight, with_backward);                    // logits: the vocab over tp
      auto back = [entry_back = std::move(entry_back), w_back = std::move(w_back)](const auto& dz) {
        auto [dxg, dw] = w_back(dz);
        return Gradients{detail::gradient_as<input_type>(entry_back(dxg)), std::tuple{std::move(dw)}};
      };
      return WithBackward<logits_t<L, T>, decltype(back)>{std::move(z), std::move(back)};
    }
  }
  template <class X>
  logits_t<L, T> forward(const X& x) const {
    return logits(x);
  }

  /// The mean cross-entropy against `targets` (nn::ids_t<L>; ignore_index rows do not count), with its
  /// backward: back(g) gives the input's gradient and W's for a loss gradient g (1.0: the loss itself).
  template <class X, class Targets>
  auto forward(const X& x, const Targets& targets, WithBackwardTag) const {
    static_assert(std::is_same_v<Targets, ids_t<L, typename Targets::value_type>>,
                  "nn::LmHead: the targets must be nn::ids_t<L>, placed like the ids");
    auto [z, z_back] = forward(x, with_backward);
    auto [loss, loss_back] = cross_entropy(z, targets, with_backward);
    auto back = [z_back = std::move(z_back), loss_back = std::move(loss_back)](double g = 1.0) {
      return z_back(loss_back(g));
    };
    return WithBackward<decltype(loss), decltype(back)>{std::move(loss), std::move(back)};
  }
  template <class X, class Targets>
  auto forward(const X& x, const Targets& targets) const {
    return cross_entropy(logits(x), targets);
  }
};

} // namespace dtensor::nn

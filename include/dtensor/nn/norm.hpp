#pragma once
// nn::RmsNorm and nn::LayerNorm over the hidden dim of activations of any placements that leave it whole
// (the layers' act_t: batch and sequence sharded, hidden whole): no communication. The weight (and bias)
// are Replicate; their gradients sum over the rows, Partial<sum> over the axes that shard the rows (the
// batch axes, and with sequence or context parallelism the tp and cp axes: a data-parallel reduction or an
// all_reduce completes them).
//
//   nn::RmsNorm<float, L> norm(mesh, hidden);      // weight ones
//   auto [y, back] = norm.forward(h, with_backward);
//   auto [dh, grads] = back(dy);                    // grads: std::tuple{dw}

#include <cstdint>
#include <tuple>
#include <utility>

#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/norm.hpp"

namespace dtensor::nn {

/// A norm's output as the layer after it has it again in its backward (docs/parallel.md, activation memory):
/// kept, or (rebuild) computed again from the norm's input, which the norm's backward keeps anyway, and the
/// norm's parameters: no bytes kept, one pointwise pass in the backward, the same values bit for bit.
template <class Norm, class X>
struct NormOutput {
  Norm norm;
  X kept; ///< the output, or with `rebuild` the norm's input
  bool rebuild = true;

  X operator()() const { return rebuild ? norm.forward(kept) : kept; }
};

/// norm's output y = norm.forward(x) as NormOutput: rebuilt from x, or y kept.
template <class Norm, class X>
NormOutput<Norm, X> norm_output(const Norm& norm, const X& x, const X& y, bool rebuild) {
  return {norm, rebuild ? x : y, rebuild};
}

template <class T, class L>
class RmsNorm : public Layer<RmsNorm<T, L>> {
public:
  using weight_type = replicated_t<L, T>;

  RmsNorm(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t hidden, double eps = 1e-5,
          Device device = Device::cpu())
      : weight(detail::ones_weight<weight_type>(mesh, hidden, device)), eps(eps) {}
  RmsNorm(weight_type w, double eps) : weight(std::move(w)), eps(eps) {}

  weight_type weight;
  double eps;

  static constexpr auto parameter_members() { return std::tuple{&RmsNorm::weight}; }
  static constexpr auto state_members() { return std::tuple{&RmsNorm::eps}; }

  template <AnyDTensor X>
  auto forward(const X& x, WithBackwardTag) const {
    auto [y, norm_back] = rms_norm<1>(x, weight, eps, with_backward);
    auto back = [norm_back = std::move(norm_back)](const auto& dy) {
      auto [dx, dw] = norm_back(dy);
      return Gradients{std::move(dx), std::tuple{std::move(dw)}};
    };
    return WithBackward<X, decltype(back)>{std::move(y), std::move(back)};
  }
  template <AnyDTensor X>
  X forward(const X& x) const {
    return rms_norm<1>(x, weight, eps);
  }
};

template <class T, class L>
class LayerNorm : public Layer<LayerNorm<T, L>> {
public:
  using weight_type = replicated_t<L, T>;

  LayerNorm(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t hidden, double eps = 1e-5,
            Device device = Device::cpu())
      : weight(detail::ones_weight<weight_type>(mesh, hidden, device)),
        bias(dtensor::detail::factory_of<weight_type>::zeros(mesh, {hidden}, device)), eps(eps) {}
  LayerNorm(weight_type w, weight_type b, double eps) : weight(std::move(w)), bias(std::move(b)), eps(eps) {}

  weight_type weight;
  weight_type bias;
  double eps;

  static constexpr auto parameter_members() { return std::tuple{&LayerNorm::weight, &LayerNorm::bias}; }
  static constexpr auto state_members() { return std::tuple{&LayerNorm::eps}; }

  template <AnyDTensor X>
  auto forward(const X& x, WithBackwardTag) const {
    auto [y, norm_back] = layer_norm<1>(x, weight, bias, eps, with_backward);
    auto back = [norm_back = std::move(norm_back)](const auto& dy) {
      auto [dx, dw, db] = norm_back(dy);
      return Gradients{std::move(dx), std::tuple{std::move(dw), std::move(db)}};
    };
    return WithBackward<X, decltype(back)>{std::move(y), std::move(back)};
  }
  template <AnyDTensor X>
  X forward(const X& x) const {
    return layer_norm<1>(x, weight, bias, eps);
  }
};

} // namespace dtensor::nn

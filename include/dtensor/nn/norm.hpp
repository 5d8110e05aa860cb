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
#include "dtensor/ops/norm.hpp"

namespace dtensor::nn {

template <class T, class L>
class RmsNorm {
public:
  using weight_type = replicated_t<L, T>;
  using parameter_types = std::tuple<weight_type>;

  RmsNorm(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t hidden, double eps = 1e-5,
          Device device = Device::cpu())
      : weight(detail::ones_weight<weight_type>(mesh, hidden, device)), eps(eps) {}
  RmsNorm(weight_type w, double eps) : weight(std::move(w)), eps(eps) {}

  weight_type weight;
  double eps;

  auto parameters() { return std::tie(weight); }
  template <class W>
  auto with_parameters(const W& w) const {
    return RmsNorm<typename W::value_type, L>(w, eps);
  }

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
class LayerNorm {
public:
  using weight_type = replicated_t<L, T>;
  using parameter_types = std::tuple<weight_type, weight_type>;

  LayerNorm(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t hidden, double eps = 1e-5,
            Device device = Device::cpu())
      : weight(detail::ones_weight<weight_type>(mesh, hidden, device)),
        bias(dtensor::detail::factory_of<weight_type>::zeros(mesh, {hidden}, device)), eps(eps) {}
  LayerNorm(weight_type w, weight_type b, double eps) : weight(std::move(w)), bias(std::move(b)), eps(eps) {}

  weight_type weight;
  weight_type bias;
  double eps;

  auto parameters() { return std::tie(weight, bias); }
  template <class W>
  auto with_parameters(const W& w, const W& b) const {
    return LayerNorm<typename W::value_type, L>(w, b, eps);
  }

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

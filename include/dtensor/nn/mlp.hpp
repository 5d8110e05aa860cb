#pragma once
// nn::Mlp: the feed-forward block, tensor parallel on the layout's tp axis (Megatron): the input is
// gathered on entry (sequence parallelism: an all_gather of the sequence over tp; without it nothing),
// the up projections are column parallel (their hidden units over tp), the activation is local, the down
// projection is row parallel (a Partial over tp), completed on exit (a reduce_scatter to the sequence
// shards with sequence parallelism, an all_reduce without). Two activations:
//
//   nn::SwiGlu: W2 (silu(W1 x) * (W3 x))      parameters W1, W3 (ffn, hidden), W2 (hidden, ffn)  (Llama)
//   nn::Gelu:   W2 gelu(W1 x)                 parameters W1 (ffn, hidden), W2 (hidden, ffn)
//
// No biases (Llama's and most recent models' choice; ColumnParallelLinear / RowParallelLinear in
// nn/linear.hpp have them). Input and output are nn::act_t. The backward runs the duals in reverse: the
// input's gradient leaves the region Partial over tp and is reduce_scattered (sequence parallel) or
// all_reduced there, as Megatron's f and g.

#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/ops/collective_matmul.hpp"
#include "dtensor/ops/matmul.hpp"
#include "dtensor/ops/pointwise.hpp"

namespace dtensor::nn {

/// The MLP's activations (see Mlp).
struct SwiGlu {};
struct Gelu {};

template <class T, class L, class Activation = SwiGlu>
class Mlp {
  static constexpr bool swiglu = std::is_same_v<Activation, SwiGlu>;
  static_assert(swiglu || std::is_same_v<Activation, Gelu>,
                "nn::Mlp: the activation is nn::SwiGlu or nn::Gelu");

public:
  using up_type = column_weight_t<L, T>; // (ffn, hidden)
  using down_type = row_weight_t<L, T>;  // (hidden, ffn)
  using parameter_types =
      std::conditional_t<swiglu, std::tuple<up_type, up_type, down_type>, std::tuple<up_type, down_type>>;
  using input_type = act_t<L, T>;

  /// W1 (and W3), W2 normal(0, std) from the next keys.
  Mlp(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t hidden, std::int64_t ffn,
      init::InitKeys& keys, double std = 0.02, Device device = Device::cpu())
      : w1(detail::normal_weight<up_type>(mesh, {ffn, hidden}, std, keys.next(), device)),
        w3(swiglu ? detail::normal_weight<up_type>(mesh, {ffn, hidden}, std, keys.next(), device)
                  : up_type(mesh, {}, {ffn, hidden})),
        w2(detail::normal_weight<down_type>(mesh, {hidden, ffn}, std, keys.next(), device)) {}
  Mlp(up_type w1, up_type w3, down_type w2) : w1(std::move(w1)), w3(std::move(w3)), w2(std::move(w2)) {}

  up_type w1; ///< gate (SwiGlu) or up (Gelu)
  up_type w3; ///< up (SwiGlu); unused and empty with Gelu
  down_type w2;

  auto parameters() {
    if constexpr (swiglu) {
      return std::tie(w1, w3, w2);
    } else {
      return std::tie(w1, w2);
    }
  }
  template <class... W>
  auto with_parameters(const W&... w) const {
    static_assert(sizeof...(W) == std::tuple_size_v<parameter_types>,
                  "nn::Mlp::with_parameters: the parameters in "
                  "order: W1, W3, W2 (SwiGlu) or W1, W2 (Gelu)");
    const auto t = std::tie(w...);
    using U = typename std::tuple_element_t<0, std::tuple<W...>>::value_type;
    if constexpr (swiglu) {
      return Mlp<U, L, Activation>(std::get<0>(t), std::get<1>(t), std::get<2>(t));
    } else {
      const auto& w1 = std::get<0>(t);
      return Mlp<U, L, Activation>(w1, std::remove_cvref_t<decltype(w1)>(w1.mesh(), {}, w1.global_shape()),
                                   std::get<1>(t));
    }
  }

  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    static_assert(std::is_same_v<X, input_type>,
                  "nn::Mlp: the input must be nn::act_t<L, T> of the layer's layout and element type");
    if constexpr (L::collective_matmul) {
      return forward_overlapped(x);
    } else {
      return forward_unfused(x);
    }
  }
  template <class X>
  input_type forward(const X& x) const {
    return forward(x, with_backward).output;
  }

private:
  /// The entry all_gather and the exit reduce_scatter as collective matmuls (nn::CollectiveMatmul).
  template <class X>
  auto forward_overlapped(const X& x) const {
    if constexpr (swiglu) {
      auto [up, up_back] = all_gather_linear(x, std::tie(w1, w3), with_backward);
      auto [s, silu_back] = silu(std::get<0>(up), with_backward);
      auto [m, mul_back] = mul(s, std::get<1>(up), with_backward);
      auto [out, down_back] = linear_reduce_scatter<input_type>(m, w2, with_backward);
      auto back = [up_back = std::move(up_back), silu_back = std::move(silu_back),
                   mul_back = std::move(mul_back), down_back = std::move(down_back)](const auto& dout) {
        auto [dm, dw2] = down_back(dout);
        auto [ds, du] = mul_back(dm);
        auto [dx, dw] = up_back(silu_back(ds), du);
        return Gradients{detail::gradient_as<input_type>(dx),
                         std::tuple{std::get<0>(std::move(dw)), std::get<1>(std::move(dw)), std::move(dw2)}};
      };
      return WithBackward<input_type, decltype(back)>{std::move(out), std::move(back)};
    } else {
      auto [up, up_back] = all_gather_linear(x, std::tie(w1), with_backward);
      auto [m, act_back] = gelu(std::get<0>(up), with_backward);
      auto [out, down_back] = linear_reduce_scatter<input_type>(m, w2, with_backward);
      auto back = [up_back = std::move(up_back), act_back = std::move(act_back),
                   down_back = std::move(down_back)](const auto& dout) {
        auto [dm, dw2] = down_back(dout);
        auto [dx, dw] = up_back(act_back(dm));
        return Gradients{detail::gradient_as<input_type>(dx),
                         std::tuple{std::get<0>(std::move(dw)), std::move(dw2)}};
      };
      return WithBackward<input_type, decltype(back)>{std::move(out), std::move(back)};
    }
  }

  /// The MLP keeping what its backward cannot rebuild cheaply (docs/parallel.md, activation memory): x
  /// (under sequence parallelism the sequence shard, gathered again in the backward) and W1's (and W3's)
  /// outputs; the activation and W2's input are computed again from them in the backward.
  template <class X>
  auto forward_unfused(const X& x) const {
    using XG = gathered_t<L, T>;
    auto [xg, entry_back] = detail::to_placements<XG>::run(x); // all_gather on tp (sp)
    auto a = linear(xg, w1);                                   // hidden units over tp
    auto u = [&] {
      if constexpr (swiglu) {
        return linear(xg, w3);
      } else {
        return a; // unused
      }
    }();
    auto [y, exit_back] = detail::to_placements<input_type>::run(linear(activation(a, u).output, w2));
    auto back = [x, a, u, w1 = w1, w3 = w3, w2 = w2, entry_back = std::move(entry_back),
                 exit_back = std::move(exit_back)](const auto& dout) {
      auto [m, act_back] = activation(a, u);
      auto [dm, dw2] = ProductBackward<true, decltype(m), down_type>(m, w2)(exit_back(dout));
      const XG g = detail::to_placements<XG>::run(x).output; // the entry all_gather again (sp)
      if constexpr (swiglu) {
        auto [da, du] = act_back(dm);
        auto [dxg_gate, dw1] = ProductBackward<true, XG, up_type>(g, w1)(da);
        auto [dxg_up, dw3] = ProductBackward<true, XG, up_type>(g, w3)(du);
        auto dx = detail::gradient_as<input_type>(entry_back(add(dxg_gate, dxg_up)));
        return Gradients{std::move(dx), std::tuple{std::move(dw1), std::move(dw3), std::move(dw2)}};
      } else {
        auto [dxg, dw1] = ProductBackward<true, XG, up_type>(g, w1)(act_back(dm));
        auto dx = detail::gradient_as<input_type>(entry_back(dxg));
        return Gradients{std::move(dx), std::tuple{std::move(dw1), std::move(dw2)}};
      }
    };
    return WithBackward<input_type, decltype(back)>{std::move(y), std::move(back)};
  }

  /// W2's input from a = W1 x (and u = W3 x): silu(a) * u, or gelu(a); its backward gives (da, du), or da.
  template <class A>
  static auto activation(const A& a, const A& u) {
    if constexpr (swiglu) {
      auto [s, silu_back] = silu(a, with_backward);
      auto [m, mul_back] = mul(s, u, with_backward);
      auto back = [silu_back = std::move(silu_back), mul_back = std::move(mul_back)](const auto& dm) {
        auto [ds, du] = mul_back(dm);
        return std::pair{silu_back(ds), std::move(du)};
      };
      return WithBackward<decltype(m), decltype(back)>{std::move(m), std::move(back)};
    } else {
      (void)u;
      return gelu(a, with_backward);
    }
  }
};

} // namespace dtensor::nn

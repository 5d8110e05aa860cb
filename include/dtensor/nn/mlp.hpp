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

#include <concepts>
#include <cstdint>
#include <optional>
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
    return forward(x, with_backward, Kept<X>{x});
  }
  /// With `again`, a function giving x again in the backward (computed again from what an earlier layer
  /// keeps: nn::TransformerBlock passes its norm's output, nn::NormOutput), kept instead of x; with
  /// keep_hidden the activation's output (W2's input) and its inputs are kept rather than computed again
  /// (Recompute::none).
  ///
  /// What the backward keeps (docs/parallel.md, activation memory): `again`, not the gathered input (under
  /// sequence parallelism it gathers the sequence shard again), and W1's (and W3's) outputs; W2's input and
  /// the activation's derivative are computed again from them. With nn::CollectiveMatmul the entry gather
  /// and the exit reduce_scatter are collective matmuls, in the backward as well.
  template <class X, std::invocable Again>
  auto forward(const X& x, WithBackwardTag, Again again, bool keep_hidden = false) const {
    return forward_impl<false>(x, std::move(again), keep_hidden);
  }
  /// The backward split for zero-bubble pipelines (nn::SplitGradients): B computes dx, W the weights'
  /// gradients from the output gradients B kept (under nn::CollectiveMatmul both in B).
  template <class X>
  auto forward(const X& x, WithSplitBackwardTag) const {
    return forward_impl<true>(x, Kept<X>{x}, false);
  }
  template <class X, std::invocable Again>
  auto forward(const X& x, WithSplitBackwardTag, Again again, bool keep_hidden = false) const {
    return forward_impl<true>(x, std::move(again), keep_hidden);
  }
  template <class X>
  input_type forward(const X& x) const {
    return forward(x, with_backward).output;
  }

private:
  using gathered_type = gathered_t<L, T>;

  template <bool Split, class X, class Again>
  auto forward_impl(const X& x, Again again, bool keep_hidden) const {
    static_assert(std::is_same_v<X, input_type>,
                  "nn::Mlp: the input must be nn::act_t<L, T> of the layer's layout and element type");
    auto [a, u] = up(x);
    auto act = activation(a, u);
    auto [y, exit_back] = down(act.output);
    std::optional<decltype(act)> kept;
    if (keep_hidden) {
      kept.emplace(std::move(act));
    }
    auto back = [again = std::move(again), a, u, kept = std::move(kept), w1 = w1, w3 = w3, w2 = w2,
                 exit_back = std::move(exit_back)](const auto& dout) {
      const auto [m, act_back] = kept ? *kept : activation(a, u);
      auto [dm, dw2] = down_backward<Split>(m, w2, exit_back, dout);
      auto [dx, dw] = [&] {
        if constexpr (swiglu) {
          auto [da, du] = act_back(dm);
          return up_backward<Split>(again, w1, w3, da, du);
        } else {
          return up_backward<Split>(again, w1, w3, act_back(dm));
        }
      }();
      auto params = [](auto up, auto down) {
        if constexpr (swiglu) {
          return std::tuple{std::get<0>(std::move(up)), std::get<1>(std::move(up)), std::move(down)};
        } else {
          return std::tuple{std::get<0>(std::move(up)), std::move(down)};
        }
      };
      if constexpr (Split) {
        return SplitGradients{detail::gradient_as<input_type>(dx),
                              [dw, dw2, params] { return params(dw(), dw2()); }};
      } else {
        return Gradients{detail::gradient_as<input_type>(dx), params(std::move(dw), std::move(dw2))};
      }
    };
    return WithBackward<input_type, decltype(back)>{std::move(y), std::move(back)};
  }

  /// {W1 x, W3 x} (hidden units over tp) after the entry all_gather on tp (sp); with Gelu {W1 x, W1 x}.
  /// The gathered x is not kept.
  template <class X>
  auto up(const X& x) const {
    if constexpr (L::collective_matmul && swiglu) {
      auto [xg, a, u] = all_gather_linear(x, std::tie(w1, w3));
      return std::pair{std::move(a), std::move(u)};
    } else if constexpr (L::collective_matmul) {
      auto [xg, a] = all_gather_linear(x, std::tie(w1));
      return std::pair{a, a};
    } else {
      const gathered_type xg = detail::to_placements<gathered_type>::run(x).output;
      auto a = linear(xg, w1);
      return std::pair{a, swiglu ? linear(xg, w3) : a};
    }
  }

  /// {dx, {dW1, dW3}} (or {dx, {dW1}}) from W1's and W3's output gradients, x from again(): gathered
  /// again (sp) as the forward did. With Split the second is a function giving that tuple later.
  template <bool Split, class Again, class... D>
  static auto up_backward(const Again& again, const up_type& w1, const up_type& w3, const D&... d) {
    using X = input_type;
    if constexpr (L::collective_matmul) {
      auto [dx, dw] = [&] {
        if constexpr (swiglu) {
          return GatherLinearBackward<X, Again, up_type, up_type>(again, std::tuple{w1, w3})(d...);
        } else {
          return GatherLinearBackward<X, Again, up_type>(again, std::tuple{w1})(d...);
        }
      }();
      if constexpr (Split) {
        return std::pair{std::move(dx), [dw = std::move(dw)] { return dw; }};
      } else {
        return std::pair{std::move(dx), std::move(dw)};
      }
    } else {
      auto [g, entry_back] = detail::to_placements<gathered_type>::run(again());
      const auto& da = std::get<0>(std::tie(d...));
      const ProductBackward<true, gathered_type, up_type> p1(g, w1);
      if constexpr (swiglu) {
        const auto& du = std::get<1>(std::tie(d...));
        const ProductBackward<true, gathered_type, up_type> p3(g, w3);
        if constexpr (Split) { // W gathers x again rather than holding the gathered copy since B
          auto [dg, dw1] = p1.split_taking_a(da);
          auto [dg3, dw3] = p3.split_taking_a(du);
          return std::pair{entry_back(add(dg, dg3)), [dw1, dw3, again] {
                             const gathered_type g =
                                 detail::to_placements<gathered_type>::run(again()).output;
                             return std::tuple{dw1(g), dw3(g)};
                           }};
        } else {
          auto [dg, dw1] = p1(da);
          auto [dg3, dw3] = p3(du);
          return std::pair{entry_back(add(dg, dg3)), std::tuple{std::move(dw1), std::move(dw3)}};
        }
      } else if constexpr (Split) {
        auto [dg, dw1] = p1.split_taking_a(da);
        return std::pair{entry_back(dg), [dw1, again] {
                           return std::tuple{dw1(detail::to_placements<gathered_type>::run(again()).output)};
                         }};
      } else {
        auto [dg, dw1] = p1(da);
        return std::pair{entry_back(dg), std::tuple{std::move(dw1)}};
      }
    }
  }

  /// {W2 m brought to the activations' placements (reduce_scatter with sp, all_reduce without), the
  /// exit's backward (unused with nn::CollectiveMatmul)}.
  template <class M>
  auto down(const M& m) const {
    if constexpr (L::collective_matmul) {
      return std::pair{linear_reduce_scatter<input_type>(m, w2), 0};
    } else {
      auto [y, exit_back] = detail::to_placements<input_type>::run(linear(m, w2));
      return std::pair{std::move(y), std::move(exit_back)};
    }
  }

  /// {dm, dW2} from the output's gradient, m W2's input; with Split dW2 as a function giving it later.
  template <bool Split, class M, class E, class G>
  static auto down_backward(const M& m, const down_type& w2, const E& exit_back, const G& dout) {
    if constexpr (L::collective_matmul) {
      (void)exit_back;
      auto [dm, dw2] = LinearScatterBackward<input_type, M, down_type>(Kept<M>{m}, w2)(dout);
      if constexpr (Split) {
        return std::pair{std::move(dm), [dw2 = std::move(dw2)] { return dw2; }};
      } else {
        return std::pair{std::move(dm), std::move(dw2)};
      }
    } else if constexpr (Split) {
      return ProductBackward<true, M, down_type>(m, w2).split(exit_back(dout));
    } else {
      return ProductBackward<true, M, down_type>(m, w2)(exit_back(dout));
    }
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

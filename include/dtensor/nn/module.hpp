#pragma once
// What every layer of dtensor::nn shares: the form of its backward's result, its configuration, and the
// helpers that make and rebuild its parameters.
//
// A layer is a small value: its configuration and its parameters as DTensor handles (copies share the
// storage, as Tensor does), public and in a fixed order: a unit of a model (nn/contract.hpp; nn::Layer in
// nn/unit.hpp writes the first two below from a list of the parameter members). Each layer here gives
//
//   using parameter_types = std::tuple<W...>;       // the parameters' DTensor types, in order
//   auto parameters();                              // std::tuple<W&...>
//   auto with_parameters(const P&... p) const;      // the same layer on other handles of its parameters,
//                                                   // e.g. the views an FSDP group's params() gives; the
//                                                   // element type follows P (mixed precision)
//   auto forward(x, with_backward) const;           // WithBackward{y, back}: auto [dx, grads] = back(dy)
//   auto forward(x) const;                          // y alone
//
// The backward returns nn::Gradients{input, params}: the input's gradient in the input's placements and a
// tuple of the parameters' gradients in parameter order, as the ops give them (Partial<sum> over the axes
// that shard the batch: what DDP and FSDP reduce; FsdpSchedule::backward takes the tuple as it is).

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/backward/activation_checkpoint.hpp"
#include "dtensor/backward/redistribute.hpp"
#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/nn/init.hpp"
#include "dtensor/nn/moe_routing.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/distribute.hpp"

namespace dtensor::nn {

/// The value of the rank-0 DTensor `d` (a loss) on the host, after what full_tensor() communicates; NaN
/// for a meta one (core/device.hpp: a dry run has shapes, no values).
template <class D>
double scalar_value(const D& d) {
  const auto full = d.full_tensor();
  const ::dtensor::detail::HostSyncScope read("the loss's value");
  return full.device().is_meta() ? std::nan("") : double(full.item());
}

/// The result of a layer's backward: the input's gradient and the parameters' (a tuple, in order).
template <class Input, class Params>
struct Gradients {
  Input input;
  Params params;
};
template <class Input, class Params>
Gradients(Input, Params) -> Gradients<Input, Params>;

/// A backward split in two (zero-bubble pipelines, Qi et al.): B, the input's gradient, now; W, `weight()`,
/// the parameters' gradients (the Gradients::params tuple) later. The same values as the fused backward's.
template <class Input, class Weight>
struct SplitGradients {
  Input input;
  Weight weight;
};
template <class Input, class Weight>
SplitGradients(Input, Weight) -> SplitGradients<Input, Weight>;

/// A layer's forward with its backward split (SplitGradients): layer.forward(x, with_split_backward) where
/// the layer has that form (the blocks: their GEMMs' weight gradients wait for W), otherwise its fused
/// backward run in B, W handing over what it computed (any unit of any model).
template <class Layer, class X>
auto forward_split(const Layer& layer, const X& x) {
  if constexpr (requires { layer.forward(x, with_split_backward); }) {
    return layer.forward(x, with_split_backward);
  } else {
    auto [y, back] = layer.forward(x, with_backward);
    auto split = [back = std::move(back)](const auto& dy) {
      auto [dx, g] = back(dy);
      return SplitGradients{std::move(dx), [g = std::move(g)] { return g; }};
    };
    return WithBackward<decltype(y), decltype(split)>{std::move(y), std::move(split)};
  }
}

/// The input gradient of a layer whose input is not differentiable (token ids).
struct NoGradient {};

/// What a block (nn::TransformerBlock, nn::MlpBlock) keeps of its forward for its backward, per block
/// (docs/parallel.md, activation memory):
///   selective  the bound: what the backward cannot rebuild cheaply. The norms' outputs and the MLP's
///              activation are computed again in the backward from what it keeps (the default;
///              Korthikanti et al.'s selective recomputation: recompute the cheap parts, keep the GEMMs')
///   none       every op keeps its inputs: the norms' outputs and the activation's too (more memory, no
///              pointwise pass again)
///   full       only the block's input: the block's forward runs again in its backward (activation
///              checkpointing, nn::activation_checkpoint for one block)
enum class Recompute { selective, none, full };

/// The sizes of a GPT-style decoder (Llama's shape: RMSNorm, RoPE, GQA, SwiGLU, no biases).
struct TransformerConfig {
  std::int64_t vocab = 0;
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0; ///< 0: heads (multi-head attention); fewer: grouped-query attention
  std::int64_t ffn = 0;      ///< the MLP's hidden units
  double norm_eps = 1e-5;
  double rope_base = 10000;
  double init_std = 0.02; ///< weights normal(0, init_std); norm weights ones
  bool causal = true;     ///< false: each position attends to every other (an encoder: nn::VisionEncoder)
  MoeConfig moe{};        ///< the experts of a block whose feed-forward is nn::Experts (nn::MoeBlock)

  std::int64_t head_dim() const noexcept { return heads > 0 ? hidden / heads : 0; }
  std::int64_t kv_head_count() const noexcept { return kv_heads > 0 ? kv_heads : heads; }
};

namespace detail {

/// A block's forward with its backward under b.recompute: b.forward_keeping<Split>(h, keep_all) runs it
/// keeping the bound (false) or every op's inputs (true), its backward split (nn::SplitGradients) with Split;
/// under Recompute::full its context is dropped at once and the backward runs forward_keeping again from h
/// (the block is copied into the backward: its parameters are handles).
template <bool Split, class Block, class X>
auto block_forward(const Block& b, const X& h) {
  auto [out, inner] = b.template forward_keeping<Split>(h, b.recompute == Recompute::none);
  std::optional<decltype(inner)> kept;
  if (b.recompute != Recompute::full) {
    kept.emplace(std::move(inner));
  }
  auto back = [b, h, kept = std::move(kept)](const auto& dout) {
    return kept ? (*kept)(dout) : b.template forward_keeping<Split>(h, false).backward(dout);
  };
  return WithBackward<decltype(out), decltype(back)>{std::move(out), std::move(back)};
}

/// x brought to the placements of the DTensor type D, with the backward of that redistribution.
template <class D>
using to_placements = dtensor::detail::with_backward_to<D>;

/// A gradient brought to the placements of the DTensor type D (the primal's).
template <class D, class G>
D gradient_as(const G& g) {
  return dtensor::detail::redistribute_as<D, G>::run(g);
}

/// A weight of type D, normal(0, std) from the sharding-invariant RNG (the same numbers on any mesh).
template <class D, class Shape>
D normal_weight(const DeviceMesh<Shape>& mesh, const std::int64_t (&shape)[D::rank], double std,
                init::InitKey key, Device device) {
  D w = dtensor::detail::factory_of<D>::zeros(mesh, shape, device);
  init::normal_(w, 0.0, std, key);
  return w;
}
/// A norm weight of type D: ones.
template <class D, class Shape>
D ones_weight(const DeviceMesh<Shape>& mesh, std::int64_t n, Device device) {
  D w = dtensor::detail::factory_of<D>::zeros(mesh, {n}, device);
  init::ones_(w);
  return w;
}

/// layer.with_parameters(std::get<Offset + I>(t)...) for the layer's parameter count.
template <std::size_t Offset, class Layer, class Tuple>
auto with_parameters_at(const Layer& layer, const Tuple& t) {
  constexpr std::size_t n = std::tuple_size_v<parameter_types_t<Layer>>;
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return layer.with_parameters(std::get<Offset + I>(t)...);
  }
  (std::make_index_sequence<n>{});
}

} // namespace detail

namespace detail {

/// `layers` blocks of type Block, each made from (mesh, config, keys, device): the weights drawn from `keys`
/// block after block.
template <class Block, class Mesh>
std::vector<Block> make_blocks(const DeviceMesh<Mesh>& mesh, const TransformerConfig& c, std::int64_t layers,
                               init::InitKeys& keys, Device device) {
  std::vector<Block> b;
  b.reserve(std::size_t(layers));
  for (std::int64_t i = 0; i < layers; ++i) {
    b.emplace_back(mesh, c, keys, device);
  }
  return b;
}

} // namespace detail

/// Drops the layer's hold on its parameters' storage: each becomes a handle with no local data (the same
/// mesh and global shape), so the layer is kept as configuration only, for with_parameters. For a model
/// whose FSDP groups now own the parameters (they copied them into their flat shards): the full tensors are
/// freed once no other handle holds them.
template <class Layer>
void release_parameters(Layer& layer) {
  std::apply(
      [](auto&... w) { ((w = std::remove_cvref_t<decltype(w)>(w.mesh(), {}, w.global_shape())), ...); },
      layer.parameters());
}

/// Activation checkpointing of a layer (torch.utils.checkpoint): `nn::checkpointed(block).forward(x,
/// with_backward)` keeps x and the parameters' handles only and runs the layer's forward again in its
/// backward (backward/activation_checkpoint.hpp); the results equal the plain forward's bit for bit. It is
/// a layer itself (the wrapped layer's constructor, parameters and with_parameters), so a model can hold
/// checkpointed blocks: `template <class T, class L> using Ckpt = nn::Checkpointed<nn::MlpBlock<T, L>>;`
/// then `nn::LanguageModel<T, L, Ckpt>`.
template <class Layer>
struct Checkpointed {
  using parameter_types = parameter_types_t<Layer>;

  Layer layer;

  Checkpointed(Layer l) : layer(std::move(l)) {}
  template <class... A>
  requires std::is_constructible_v<Layer, A&&...>
  explicit Checkpointed(A&&... args) : layer(std::forward<A>(args)...) {}

  auto parameters() { return layer.parameters(); }
  template <class... W>
  auto with_parameters(const W&... w) const {
    using Inner = decltype(layer.with_parameters(w...));
    return Checkpointed<Inner>(layer.with_parameters(w...));
  }
  template <class X>
  auto forward(const X& x) const {
    return layer.forward(x);
  }
  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    auto f = [l = layer](const X& in, WithBackwardTag) { return l.forward(in, with_backward); };
    return activation_checkpoint(std::move(f), x);
  }
};
template <class Layer>
Checkpointed<Layer> checkpointed(const Layer& layer) {
  return Checkpointed<Layer>(layer);
}

} // namespace dtensor::nn

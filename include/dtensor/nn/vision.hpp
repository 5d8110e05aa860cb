#pragma once
// A vision transformer encoder (ViT) as layers of dtensor::nn in the layout L: images cut into patches come
// in as a sequence (batch, patches, patch values), placed as activations (nn::images_t = nn::act_t: the batch
// over the data axes, the patches over cp, and over tp under sequence parallelism);
//
//   nn::PatchEmbedding<T, L>    a linear map of each patch to the hidden size (W (hidden, patch values),
//                               replicated; no communication)
//   nn::TransformerBlock<T, L>  with config.causal = false: every patch attends to every other (RoPE on the
//                               patch index gives the positions)
//   nn::ClassifierHead<T, L>    the mean over the patches (an all_reduce over the axes that shard them), a
//                               linear map to the classes: logits (batch, classes), nn::class_logits_t
//
// and nn::VisionEncoder, the model of the contract (nn/contract.hpp) made of them: the patch embedding,
// the blocks, a final RMSNorm and the classifier (one unit), trained on class labels (nn::labels_t: the
// batch over the data axes) with nn::CrossEntropyLoss by any trainer.
//
//   nn::TransformerConfig c{.hidden = 32, .heads = 4, .ffn = 64, .causal = false};
//   nn::VisionEncoder<float, L> vit(mesh, c, {.patch_values = 4, .classes = 10}, /*layers=*/2, keys);
//   nn::FsdpTrainer<decltype(vit), Fsdp<"dp">> trainer(mesh, std::move(vit));
//   trainer.step(images, labels, opt);
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/backward/redistribute.hpp"
#include "dtensor/nn/block.hpp"
#include "dtensor/nn/chain.hpp"
#include "dtensor/nn/contract.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/losses.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/norm.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/matmul.hpp"
#include "dtensor/ops/reduce.hpp"

namespace dtensor::nn {

/// Images as sequences of patches (batch, patches, patch values), placed as activations.
template <class L, class T>
using images_t = act_t<L, T>;
/// Pooled features (batch, hidden): the batch over the data axes, replicated elsewhere.
template <class L, class T>
using pooled_t = placed_t<L, T, 2, 0, -1, -1>;
/// Class logits (batch, classes).
template <class L, class T>
using class_logits_t = placed_t<L, T, 2, 0, -1, -1>;
/// Class labels (batch), integer class indices.
template <class L, class I = std::int64_t>
using labels_t = placed_t<L, I, 1, 0, -1, -1>;

/// The shape of the images and the classes of nn::VisionEncoder.
struct VisionConfig {
  std::int64_t patch_values = 0; ///< the values of one patch (pixels times channels)
  std::int64_t classes = 0;
};

/// Each patch mapped to the hidden size by one replicated weight (hidden, patch values).
template <class T, class L>
class PatchEmbedding : public Layer<PatchEmbedding<T, L>> {
public:
  using weight_type = replicated_t<L, T, 2>;

  PatchEmbedding(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t patch_values,
                 std::int64_t hidden, init::InitKey key, double std = 0.02, Device device = Device::cpu())
      : weight(detail::normal_weight<weight_type>(mesh, {hidden, patch_values}, std, key, device)) {}
  explicit PatchEmbedding(weight_type w) : weight(std::move(w)) {}

  weight_type weight;

  static constexpr auto parameter_members() { return std::tuple{&PatchEmbedding::weight}; }
  static constexpr auto state_members() { return std::tuple{}; }

  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    static_assert(std::is_same_v<X, images_t<L, T>>,
                  "nn::PatchEmbedding: the input must be nn::images_t<L, T> (batch, patches, patch values)");
    auto [y, back] = linear(x, weight, with_backward);
    auto grads = [back = std::move(back)](const auto& dy) {
      auto [dx, dw] = back(dy);
      return Gradients{std::move(dx), std::tuple{std::move(dw)}};
    };
    return WithBackward<act_t<L, T>, decltype(grads)>{std::move(y), std::move(grads)};
  }
  template <class X>
  act_t<L, T> forward(const X& x) const {
    return linear(x, weight);
  }
};

/// The mean over the patches, then a replicated linear map (classes, hidden) to the class logits.
template <class T, class L>
class ClassifierHead : public Layer<ClassifierHead<T, L>> {
public:
  using weight_type = replicated_t<L, T, 2>;
  using input_type = act_t<L, T>;

  ClassifierHead(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t hidden, std::int64_t classes,
                 init::InitKey key, double std = 0.02, Device device = Device::cpu())
      : weight(detail::normal_weight<weight_type>(mesh, {classes, hidden}, std, key, device)) {}
  explicit ClassifierHead(weight_type w) : weight(std::move(w)) {}

  weight_type weight;

  static constexpr auto parameter_members() { return std::tuple{&ClassifierHead::weight}; }
  static constexpr auto state_members() { return std::tuple{}; }

  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    static_assert(std::is_same_v<X, input_type>, "nn::ClassifierHead: the input must be nn::act_t<L, T>");
    auto [m, mean_back] = mean<1>(x, with_backward); // Partial over the axes that shard the patches
    auto [p, pool_back] = dtensor::detail::with_backward_to<pooled_t<L, T>>::run(m);
    auto [z, w_back] = linear(p, weight, with_backward);
    auto back = [mean_back = std::move(mean_back), pool_back = std::move(pool_back),
                 w_back = std::move(w_back)](const auto& dz) {
      auto [dp, dw] = w_back(dz);
      return Gradients{detail::gradient_as<input_type>(mean_back(pool_back(dp))), std::tuple{std::move(dw)}};
    };
    return WithBackward<class_logits_t<L, T>, decltype(back)>{std::move(z), std::move(back)};
  }
  template <class X>
  class_logits_t<L, T> forward(const X& x) const {
    return forward(x, with_backward).output;
  }
};

/// A vision transformer encoder and classifier (see the top of the file).
template <class T, class L, template <class, class> class Block = TransformerBlock>
class VisionEncoder {
public:
  using value_type = T;
  using layout_type = L;
  using block_type = Block<T, L>;
  using output_type = Chain<RmsNorm<T, L>, ClassifierHead<T, L>>;
  template <class U>
  using rebind = VisionEncoder<U, L, Block>;

  /// The weights drawn from `keys` in the order patch embedding, blocks, classifier (the same on any mesh).
  VisionEncoder(const DeviceMesh<typename L::mesh_shape>& mesh, const TransformerConfig& c,
                const VisionConfig& v, std::int64_t layers, init::InitKeys& keys,
                Device device = Device::cpu())
      : patches(mesh, v.patch_values, c.hidden, keys.next(), c.init_std, device),
        blocks(detail::make_blocks<block_type>(mesh, c, layers, keys, device)),
        output(RmsNorm<T, L>(mesh, c.hidden, c.norm_eps, device),
               ClassifierHead<T, L>(mesh, c.hidden, v.classes, keys.next(), c.init_std, device)) {
    DTENSOR_CHECK(!c.causal, "nn::VisionEncoder: an encoder attends both ways: set TransformerConfig::causal "
                             "to false");
  }
  VisionEncoder(PatchEmbedding<T, L> p, std::vector<block_type> b, output_type o)
      : patches(std::move(p)), blocks(std::move(b)), output(std::move(o)) {}

  PatchEmbedding<T, L> patches;
  std::vector<block_type> blocks;
  output_type output; ///< the final norm and the classifier

  auto units() { return std::tie(patches, blocks, output); }
  auto loss_function() const { return CrossEntropyLoss{}; }

  /// The class logits of `images`.
  class_logits_t<L, T> logits(const images_t<L, T>& images) const {
    act_t<L, T> h = patches.forward(images);
    for (const auto& b : blocks) {
      h = b.forward(h);
    }
    return output.forward(h);
  }
  /// What crosses a pipeline stage boundary for `images` (nn::PipelineTrainer's dry run).
  std::vector<std::int64_t> boundary_shape(const images_t<L, T>& images) const {
    return {images.global_shape()[0], images.global_shape()[1], patches.weight.global_shape()[0]};
  }
};

} // namespace dtensor::nn

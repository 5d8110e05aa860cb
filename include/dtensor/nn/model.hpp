#pragma once
// nn::LanguageModel: a decoder-only language model as layers of dtensor::nn in the layout L: the
// vocab-parallel embedding, `layers` blocks (nn::TransformerBlock for a GPT, nn::MlpBlock for a stack without
// attention, or any block template taking <T, L> with their constructor), and the output (a final RMSNorm
// and the vocab-parallel head: nn::Chain, one unit) giving the logits, trained with nn::CrossEntropyLoss. It
// is a value: the layers' configuration and their parameters' handles, and a model of the contract
// (nn/contract.hpp): nn::DdpTrainer, nn::FsdpTrainer and nn::PipelineTrainer train it as any other.
//
//   init::InitKeys keys(2024);
//   nn::LanguageModel<float, L, nn::TransformerBlock> gpt(mesh, config, /*layers=*/4, keys);
//   double loss = gpt.loss(ids, targets);                          // forward only
//   auto logits = gpt.logits(ids);                                 // the vocabulary over tp
//
// The weights are drawn from `keys` in the order embedding, blocks, head: the sharding-invariant RNG gives
// the same numbers on every mesh.
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "dtensor/nn/chain.hpp"
#include "dtensor/nn/contract.hpp"
#include "dtensor/nn/embedding.hpp"
#include "dtensor/nn/head.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/losses.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/norm.hpp"

namespace dtensor::nn {

template <class T, class L, template <class, class> class Block>
class LanguageModel {
public:
  using value_type = T;
  using layout_type = L;
  using block_type = Block<T, L>;
  using output_type = Chain<RmsNorm<T, L>, LmHead<T, L>>;
  using ids_type = ids_t<L>;
  using act_type = act_t<L, T>;
  template <class U>
  using rebind = LanguageModel<U, L, Block>;

  LanguageModel(const DeviceMesh<typename L::mesh_shape>& mesh, const TransformerConfig& c,
                std::int64_t layers, init::InitKeys& keys, Device device = Device::cpu())
      : embedding(mesh, c.vocab, c.hidden, keys.next(), c.init_std, device),
        blocks(detail::make_blocks<block_type>(mesh, c, layers, keys, device)),
        output(RmsNorm<T, L>(mesh, c.hidden, c.norm_eps, device),
               LmHead<T, L>(mesh, c.vocab, c.hidden, keys.next(), c.init_std, device)) {}
  LanguageModel(Embedding<T, L> e, std::vector<block_type> b, output_type o)
      : embedding(std::move(e)), blocks(std::move(b)), output(std::move(o)) {}
  LanguageModel(Embedding<T, L> e, std::vector<block_type> b, RmsNorm<T, L> n, LmHead<T, L> h)
      : embedding(std::move(e)), blocks(std::move(b)), output(std::move(n), std::move(h)) {}

  Embedding<T, L> embedding;
  std::vector<block_type> blocks;
  output_type output; ///< the final norm (output.get<0>()) and the head (output.get<1>())

  /// The units, in the order of the forward: the embedding, the blocks, the output.
  auto units() { return std::tie(embedding, blocks, output); }
  auto loss_function() const { return CrossEntropyLoss{}; }

  /// Every parameter: std::tuple{embedding's, a vector of each block's, the final norm's and the head's}.
  auto parameters() { return model_parameters(*this); }

  /// The mean loss of one batch, no backward.
  double loss(const ids_type& ids, const ids_type& targets) const {
    return scalar_value(loss_function()(logits(ids), targets));
  }

  /// The logits of every position (sharded on the vocabulary as the head leaves them).
  auto logits(const ids_type& ids) const {
    act_type h = embedding.forward(ids);
    for (const auto& blk : blocks) {
      h = blk.forward(h);
    }
    return output.forward(h);
  }

  /// What crosses a pipeline stage boundary for `ids` (nn::PipelineTrainer's dry run): (batch, sequence,
  /// hidden).
  std::vector<std::int64_t> boundary_shape(const ids_type& ids) const {
    return {ids.global_shape()[0], ids.global_shape()[1], embedding.weight.global_shape()[1]};
  }
};

} // namespace dtensor::nn

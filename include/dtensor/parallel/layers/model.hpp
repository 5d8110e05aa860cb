#pragma once
// nn::LanguageModel: a decoder-only language model as layers of dtensor::nn in the layout L: the
// vocab-parallel embedding, `layers` blocks (nn::TransformerBlock for a GPT, nn::MlpBlock for a stack without
// attention, or any block template taking <T, L> with their constructor), a final RMSNorm and the
// vocab-parallel head with its loss. It is a value: the layers' configuration and their parameters'
// handles. nn::DdpTrainer and nn::FsdpTrainer (layers/trainer.hpp) train it.
//
//   init::InitKeys keys(2024);
//   nn::LanguageModel<float, L, nn::TransformerBlock> gpt(mesh, config, /*layers=*/4, keys);
//   double loss = gpt.loss(ids, targets);                          // forward only
//   double l = gpt.step(ids, targets, [&](auto part, auto&& grads) { ... });   // forward + backward
//
// step() hands each layer's gradients (a tuple, in the layer's parameter order) to `grads(part, tuple)` as
// the backward produces them: nn::HeadPart{} first (the final norm's weight, then the head's), then
// nn::BlockPart{b} from the last block to the first, then nn::EmbeddingPart{}; `part`'s type says which,
// so a generic lambda routes each tuple type at compile time. The weights are drawn
// from `keys` in the order embedding, blocks, head: the sharding-invariant RNG gives the same numbers on
// every mesh.
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "dtensor/parallel/layers/embedding.hpp"
#include "dtensor/parallel/layers/head.hpp"
#include "dtensor/parallel/layers/layout.hpp"
#include "dtensor/parallel/layers/module.hpp"
#include "dtensor/parallel/layers/norm.hpp"

namespace dtensor::nn {

/// Which layer a tuple of gradients of LanguageModel::step belongs to.
struct EmbeddingPart {};
struct BlockPart {
  int index;
};
struct HeadPart {};

template <class T, class L, template <class, class> class Block>
class LanguageModel {
public:
  using value_type = T;
  using layout_type = L;
  using block_type = Block<T, L>;
  using ids_type = ids_t<L>;
  using act_type = act_t<L, T>;
  template <class U>
  using rebind = LanguageModel<U, L, Block>;

  LanguageModel(const DeviceMesh<typename L::mesh_shape>& mesh, const TransformerConfig& c,
                std::int64_t layers, init::InitKeys& keys, Device device = Device::cpu())
      : embedding(mesh, c.vocab, c.hidden, keys.next(), c.init_std, device),
        blocks(make_blocks(mesh, c, layers, keys, device)), norm(mesh, c.hidden, c.norm_eps, device),
        head(mesh, c.vocab, c.hidden, keys.next(), c.init_std, device) {}
  LanguageModel(Embedding<T, L> e, std::vector<block_type> b, RmsNorm<T, L> n, LmHead<T, L> h)
      : embedding(std::move(e)), blocks(std::move(b)), norm(std::move(n)), head(std::move(h)) {}

  Embedding<T, L> embedding;
  std::vector<block_type> blocks;
  RmsNorm<T, L> norm;
  LmHead<T, L> head;

  /// Every parameter: std::tuple{embedding's, a vector of each block's, the final norm's and the head's}.
  auto parameters() {
    std::vector<decltype(std::declval<block_type&>().parameters())> b;
    b.reserve(blocks.size());
    for (auto& blk : blocks) {
      b.push_back(blk.parameters());
    }
    return std::tuple{embedding.parameters(), std::move(b),
                      std::tuple_cat(norm.parameters(), head.parameters())};
  }

  /// The mean loss of one batch, no backward.
  double loss(const ids_type& ids, const ids_type& targets) const {
    return scalar_value(head.forward(norm.forward(hidden(ids)), targets));
  }

  /// The logits of every position (sharded on the vocabulary as the head leaves them).
  auto logits(const ids_type& ids) const { return head.logits(norm.forward(hidden(ids))); }

  /// Forward and backward of one batch: the loss; each layer's gradients handed to `grads(part, tuple)`
  /// as soon as the backward has them (see the top of the file), of the loss times `loss_scale` (1 / K for
  /// one of K micro-batches).
  template <class F>
  double step(const ids_type& ids, const ids_type& targets, F&& grads, double loss_scale = 1.0) const {
    auto [h0, emb_back] = embedding.forward(ids, with_backward);
    using Back = decltype(std::declval<const block_type&>().forward(h0, with_backward).backward);
    std::vector<Back> backs;
    backs.reserve(blocks.size());
    act_type h = h0;
    for (const auto& blk : blocks) {
      auto [y, back] = blk.forward(h, with_backward);
      backs.push_back(std::move(back));
      h = std::move(y);
    }
    auto [n, norm_back] = norm.forward(h, with_backward);
    auto [loss, head_back] = head.forward(n, targets, with_backward);
    auto [dn, head_grads] = head_back(loss_scale);
    auto [dh, norm_grads] = norm_back(dn);
    grads(HeadPart{}, std::tuple_cat(std::move(norm_grads), std::move(head_grads)));
    for (int b = int(blocks.size()) - 1; b >= 0; --b) {
      auto [dx, g] = backs[std::size_t(b)](dh);
      grads(BlockPart{b}, std::move(g));
      dh = std::move(dx);
    }
    grads(EmbeddingPart{}, emb_back(dh).params);
    return scalar_value(loss);
  }

private:
  act_type hidden(const ids_type& ids) const {
    act_type h = embedding.forward(ids);
    for (const auto& blk : blocks) {
      h = blk.forward(h);
    }
    return h;
  }

  static std::vector<block_type> make_blocks(const DeviceMesh<typename L::mesh_shape>& mesh,
                                             const TransformerConfig& c, std::int64_t layers,
                                             init::InitKeys& keys, Device device) {
    std::vector<block_type> b;
    b.reserve(std::size_t(layers));
    for (std::int64_t i = 0; i < layers; ++i) {
      b.emplace_back(mesh, c, keys, device);
    }
    return b;
  }
};

} // namespace dtensor::nn

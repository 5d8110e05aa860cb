#pragma once
// nn::Embedding: the token embedding, vocab parallel (Megatron's VocabParallelEmbedding) on the layout's tp
// axis: W (vocab, hidden) is Shard<0> there, each rank looks its ids up in its own rows (zeros for the
// others), and the Partial sum is completed on exit: a reduce_scatter to the sequence shards with sequence
// parallelism, an all_reduce without. The ids are nn::ids_t (batch over the data axes, the sequence over
// cp); the output is nn::act_t. The backward gives W's gradient: its rows on tp, Partial<sum> over the
// axes that shard the tokens.
//
//   nn::Embedding<float, L> emb(mesh, vocab, hidden, keys.next());
//   auto [h, back] = emb.forward(ids, with_backward);
//   auto [none, grads] = back(dh);        // grads: std::tuple{dW}

#include <cstdint>
#include <tuple>
#include <utility>

#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/embedding.hpp"

namespace dtensor::nn {

template <class T, class L>
class Embedding : public Layer<Embedding<T, L>> {
public:
  using weight_type = column_weight_t<L, T>; // (vocab, hidden): the vocab over tp
  using output_type = act_t<L, T>;

  /// W normal(0, std) from `key` (the same numbers on any mesh).
  Embedding(const DeviceMesh<typename L::mesh_shape>& mesh, std::int64_t vocab, std::int64_t hidden,
            init::InitKey key, double std = 0.02, Device device = Device::cpu())
      : weight(detail::normal_weight<weight_type>(mesh, {vocab, hidden}, std, key, device)) {}
  explicit Embedding(weight_type w) : weight(std::move(w)) {}

  weight_type weight;

  static constexpr auto parameter_members() { return std::tuple{&Embedding::weight}; }
  static constexpr auto state_members() { return std::tuple{}; }

  template <class Ids>
  auto forward(const Ids& ids, WithBackwardTag) const {
    static_assert(std::is_same_v<Ids, ids_t<L, typename Ids::value_type>>,
                  "nn::Embedding: the ids must be nn::ids_t<L> (batch over the data axes, the sequence over "
                  "the context-parallel axis, Replicate on tp): redistribute them first");
    auto [e, lookup_back] = embedding(ids, weight, with_backward); // Partial on tp
    auto [h, exit_back] = detail::to_placements<output_type>::run(e);
    auto back = [lookup_back = std::move(lookup_back), exit_back = std::move(exit_back)](const auto& dh) {
      return Gradients{NoGradient{}, std::tuple{lookup_back(exit_back(dh))}};
    };
    return WithBackward<output_type, decltype(back)>{std::move(h), std::move(back)};
  }
  template <class Ids>
  output_type forward(const Ids& ids) const {
    return forward(ids, with_backward).output;
  }
};

} // namespace dtensor::nn

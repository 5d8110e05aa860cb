#pragma once
// Embedding lookup on DTensors, forward and backward, the output placements from the rule engine:
//
//   auto h = embedding(ids, w);        // ids [S(0)] (batch, seq), w [R] (vocab, hidden) -> h [S(0)]
//   auto v = embedding(ids, wv);       // ids [R], wv [S(0)]: vocab parallel (Megatron's
//                                      // VocabParallelEmbedding): each rank looks up the ids in its vocab
//                                      // rows, zeros elsewhere -> v [P]; one all_reduce (or
//                                      // reduce_scatter to Shard<seq>) later completes it
//   auto c = embedding(ids, wh);       // ids [R], wh [S(1)] -> c [S(2)]: hidden sharded
//   auto [y, back] = embedding(ids, w, with_backward);  DW dw = back(dy);
//
// As an einsum, out[..., h] = sum_v onehot(ids)[..., v] w[v, h]: the vocab is contracted (a sharded vocab
// gives Partial<sum>), the hidden dim and the ids' dims are kept. The ids are integers (int32 or int64),
// never Partial; the weight is not Partial. The backward scatters the gradient's rows into the weight's
// own block only: Partial<sum> on the mesh axes where the ids are sharded (each rank added its own
// positions), the weight's Shard where it is sharded. Ids outside [0, vocab) on host tensors throw, naming
// the id and its position.

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace local {

/// Element i of the (positions, width) output: row ids[p] - begin of w (width columns, contiguous), or
/// zero where that row is not in [0, rows).
template <class T, class I>
struct EmbeddingGather {
  struct {
    std::int64_t count;
  } layout;
  T* out;
  const I* ids;
  const T* w;
  std::int64_t width;
  std::int64_t begin;
  std::int64_t rows;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t p = i / width;
    const std::int64_t h = i % width;
    const std::int64_t r = static_cast<std::int64_t>(ids[p]) - begin;
    out[i] = r >= 0 && r < rows ? w[r * width + h] : T(0);
  }
};

/// Column h of dw (rows x width, contiguous): the sum of g's column h over the positions whose id falls
/// in [begin, begin + rows); one index per column, so no two indices write one element and the order of
/// the sum is fixed.
template <class T, class I>
struct EmbeddingScatter {
  struct {
    std::int64_t count;
  } layout;
  T* dw;
  const I* ids;
  const T* g;
  std::int64_t positions;
  std::int64_t width;
  std::int64_t begin;
  std::int64_t rows;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t h) const {
    for (std::int64_t p = 0; p < positions; ++p) {
      const std::int64_t r = static_cast<std::int64_t>(ids[p]) - begin;
      if (r >= 0 && r < rows) {
        dw[r * width + h] =
            T(static_cast<compute_t<T>>(dw[r * width + h]) + static_cast<compute_t<T>>(g[p * width + h]));
      }
    }
  }
};

} // namespace local

namespace detail {

constexpr bool any_partial(const PlacementList& l) {
  for (Placement p : l) {
    if (p.is_partial()) {
      return true;
    }
  }
  return false;
}

/// ids labelled 'a'.., the weight "yz" (vocab, hidden), the output the ids' labels and 'z'.
template <int Rk>
constexpr OpSpec embedding_spec() {
  OpSpec s;
  s.in.push_back(trailing_labels(Rk, Rk));
  s.in.push_back(labels("yz"));
  Labels out = trailing_labels(Rk, Rk);
  out.push_back('z');
  s.out = out;
  s.linearity = Linearity::multiplicative;
  return s;
}

template <class Ids, class W>
struct EmbeddingOut {
  static constexpr RuleResult rule() {
    return apply_rule(embedding_spec<Ids::rank>(), {Ids::placements, W::placements});
  }
};

/// Whether ids and weight are embedding's operands; where not, a static_assert here says why (the one
/// error). The rule's checks are the output type's (embedding_result_t).
template <class Ids, class W>
consteval bool embedding_operands() {
  constexpr bool ids = std::is_same_v<typename Ids::value_type, std::int32_t> ||
                       std::is_same_v<typename Ids::value_type, std::int64_t>;
  static_assert(ids, "embedding: the ids are a DTensor of int32 or int64");
  static_assert(W::rank == 2, "embedding: the weight is (vocab, hidden)");
  static_assert(!any_partial(Ids::placements),
                "embedding: the ids cannot be Partial: redistribute<Replicate> them");
  static_assert(!any_partial(W::placements),
                "embedding: the weight cannot be Partial: redistribute<Replicate> it");
  return ids && W::rank == 2 && !any_partial(Ids::placements) && !any_partial(W::placements);
}

/// The weight gradient's placements: the weight's Shard where it is sharded; Partial<sum> where the ids
/// are sharded (each rank added its positions) or the output's gradient is Partial; else Replicate.
template <class Ids, class W, class G>
struct EmbeddingGradOut {
  static constexpr PlacementList list() {
    PlacementList l;
    for (int a = 0; a < W::placements.size(); ++a) {
      const Placement w = normalize(W::placements[a], 2);
      if (w.is_shard()) {
        l.push_back(w);
      } else if (Ids::placements[a].is_shard() || G::placements[a].is_partial()) {
        l.push_back(Placement::partial(ReduceOp::sum));
      } else {
        l.push_back(Placement::replicate());
      }
    }
    return l;
  }
};

/// What the forward and backward share: the output block, the ids cut to it, the weight's rows held.
template <class Ids, class W, class Y>
struct EmbeddingGeometry {
  Block out;
  Tensor<typename Ids::value_type, Ids::rank> ids; ///< this rank's positions, contiguous
  std::int64_t begin = 0;                          ///< the weight block's first vocab row
  std::int64_t rows = 0;                           ///< its number of vocab rows

  EmbeddingGeometry(const Ids& ids_in, const W& w) {
    constexpr OpSpec s = embedding_spec<Ids::rank>();
    std::array<std::int64_t, Ids::rank + 1> global{};
    for (int d = 0; d < Ids::rank; ++d) {
      global[d] = ids_in.global_shape()[d];
    }
    global[Ids::rank] = w.global_shape()[1];
    const auto& mesh = ids_in.mesh();
    out = spec_block(to_extents(global), Y::spec, mesh.sizes(), mesh.coordinate());
    ids = operand_view(ids_in, s.in[0], s.out, out).contiguous();
    const Block held = spec_block(to_extents(w.global_shape()), W::spec, mesh.sizes(), mesh.coordinate());
    begin = held.offset[0];
    rows = held.shape[0];
  }
};

template <class Ids, class W>
using embedding_result_t = rule_result_t<typename W::value_type, Ids::rank + 1,
                                         typename dtensor_traits<W>::shape_type, &EmbeddingOut<Ids, W>::rule>;

template <class Ids, class W>
auto embedding_local(const Ids& ids, const W& w) {
  using T = typename W::value_type;
  using Y = embedding_result_t<Ids, W>;
  const std::int64_t vocab = w.global_shape()[0];
  EmbeddingGeometry<Ids, W, Y> geo(ids, w);
  if (geo.ids.device().is_cpu()) {
    for (std::int64_t p = 0; p < geo.ids.numel(); ++p) {
      const auto id = static_cast<std::int64_t>(geo.ids.data()[p]);
      DTENSOR_CHECK(id >= 0 && id < vocab, "embedding: id " + std::to_string(id) + " at local position " +
                                               std::to_string(p) + " is outside the vocabulary [0, " +
                                               std::to_string(vocab) + ")");
    }
  }
  constexpr OpSpec s = embedding_spec<Ids::rank>();
  const auto wl = operand_view(w, s.in[1], s.out, geo.out).contiguous();
  std::array<std::int64_t, Ids::rank + 1> shape{};
  for (int d = 0; d <= Ids::rank; ++d) {
    shape[d] = geo.out.shape[d];
  }
  Tensor<T, Ids::rank + 1> out = empty_like(shape, wl);
  const std::int64_t width = shape[Ids::rank];
  local::EmbeddingGather<T, typename Ids::value_type> run{
      {geo.ids.numel() * width}, out.data(), geo.ids.data(), wl.data(), width, geo.begin, geo.rows};
  local::launch(run, wl.device(), wl.stream_handle(), "embedding");
  std::array<std::int64_t, Ids::rank + 1> global{};
  for (int d = 0; d < Ids::rank; ++d) {
    global[d] = ids.global_shape()[d];
  }
  global[Ids::rank] = w.global_shape()[1];
  return Y(w.mesh(), std::move(out), global);
}

template <class Ids, class W>
auto embedding_forward(const Ids& ids, const W& w) {
  if constexpr (!embedding_operands<Ids, W>()) {
    return w; // after embedding_operands' error, w stands in for the result: no second error
  } else {
    return embedding_local(ids, w);
  }
}

} // namespace detail

/// The backward of embedding: the weight's gradient (the ids have none).
template <class Ids, class W>
class EmbeddingBackward {
public:
  EmbeddingBackward(Ids ids, W w) : ids_(std::move(ids)), w_(std::move(w)) {}

  template <AnyDTensor G>
  auto operator()(const G& g) const {
    if constexpr (!detail::embedding_operands<Ids, W>()) {
      return w_; // the forward's error; no second one here
    } else {
      return backward(g);
    }
  }

private:
  template <class G>
  auto backward(const G& g) const {
    using namespace detail;
    using T = typename W::value_type;
    using Shape = typename dtensor_traits<W>::shape_type;
    using Y = embedding_result_t<Ids, W>;
    static_assert(std::is_same_v<typename G::value_type, T> && G::rank == Ids::rank + 1,
                  "backward: the gradient must have the forward output's element type and rank");
    using Target = dtensor_from_t<T, G::rank, Shape, &GradTarget<Y, G>::list>;
    using DW = dtensor_from_t<T, 2, Shape, &EmbeddingGradOut<Ids, W, Target>::list>;
    const Target gt = redistribute_as<Target, G>::run(g);
    EmbeddingGeometry<Ids, W, Y> geo(ids_, w_);
    const auto gl = gt.local().contiguous();
    const auto& wl = w_.local();
    Tensor<T, 2> dw = empty_like(wl.shape(), wl);
    local::fill(dw, T(0));
    const std::int64_t width = wl.shape()[1];
    local::EmbeddingScatter<T, typename Ids::value_type> run{
        {width}, dw.data(), geo.ids.data(), gl.data(), geo.ids.numel(), width, geo.begin, geo.rows};
    local::launch(run, wl.device(), wl.stream_handle(), "embedding backward");
    return DW(w_.mesh(), std::move(dw), w_.global_shape());
  }

  Ids ids_;
  W w_;
};

/// Rows `ids` of `w` (vocab, hidden): the output has the ids' dims and hidden (see the top of this file).
template <AnyDTensor Ids, AnyDTensor W>
auto embedding(const Ids& ids, const W& w) {
  return detail::embedding_forward(ids, w);
}
template <AnyDTensor Ids, AnyDTensor W>
auto embedding(const Ids& ids, const W& w, WithBackwardTag) {
  auto y = detail::embedding_forward(ids, w);
  return WithBackward<decltype(y), EmbeddingBackward<Ids, W>>{std::move(y),
                                                              EmbeddingBackward<Ids, W>(ids, w)};
}

} // namespace dtensor

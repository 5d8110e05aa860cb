#pragma once
// Rotary position embeddings (RoPE) of a DTensor, with positions from each shard's global indices:
//
//   auto qr = rotary_embedding<2>(q);                        // q (batch, heads, seq, head_dim), any sharding
//   auto [kr, back] = rotary_embedding<2>(k, {.base = 500000}, with_backward);   // dk = back(dkr)
//
// Pair i of head_dim (x_a, x_b) at sequence position p is rotated by the angle p * base^(-2i / head_dim):
// (x_a cos - x_b sin, x_b cos + x_a sin). Pairs are (i, i + head_dim / 2) ("rotate half", as GPT-NeoX and
// Hugging Face's Llama), or (2i, 2i + 1) with `interleaved` (the original RoFormer / Meta Llama layout).
// The position of a row is its global index along dim SeqDim plus `offset`: a rank holding rows 8..11 of a
// sequence-sharded tensor rotates them by positions 8..11, so sequence parallelism and context parallelism
// get the angles one rank would (the silent bug of adding sharding by hand: every shard starting at 0). A
// sequence in the zigzag layout of load-balanced ring attention (Zigzag<"cp", X>, ops/zigzag.hpp) turns
// each row by its natural position, which the layout gives.
//
// Placements pass through: the rotation is linear, so Partial stays Partial; the sequence may be sharded;
// head_dim may not (a pair would straddle ranks; a compile error says so). The backward rotates the
// gradient by the opposite angles. Host tensors; the angles are computed in double per position, then
// applied in the compute type (float for bfloat16 and half).

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/ops/zigzag.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

/// RoPE's parameters.
struct RotaryOptions {
  double base = 10000;      ///< theta: pair i turns base^(-2i / head_dim) radians per position
  bool interleaved = false; ///< pairs (2i, 2i + 1) instead of (i, i + head_dim / 2)
  std::int64_t offset = 0;  ///< added to every position (e.g. the tokens already in a KV cache)
};

namespace detail {

template <int SeqDim, class X>
consteval bool rotary_ok() {
  static_assert(X::rank >= 2 && SeqDim >= 0 && SeqDim < X::rank - 1,
                "rotary_embedding<SeqDim>: x is (..., seq, ..., head_dim), SeqDim before the last dim");
  constexpr bool head_dim_whole = [] {
    for (Placement p : X::placements) {
      if (normalize(p, X::rank) == Placement::shard(X::rank - 1)) {
        return false;
      }
    }
    return true;
  }();
  static_assert(head_dim_whole,
                "dtensor rotary_embedding: head_dim (the last dim) is sharded, and its pairs "
                "would straddle ranks: redistribute it to Replicate (shard heads or seq instead)");
  return X::rank >= 2 && SeqDim >= 0 && SeqDim < X::rank - 1 && head_dim_whole;
}

/// x's local tensor rotated by the angles of its rows' global positions (`sign` -1: the opposite angles);
/// `pos`: each local row's position along SeqDim (empty: the rows' global indices).
template <int SeqDim, class X>
typename X::local_type rotate(const X& x, const RotaryOptions& o, double sign,
                              const std::vector<std::int64_t>& pos = {}) {
  using T = typename X::value_type;
  using C = local::compute_t<T>;
  const auto& t = x.local();
  DTENSOR_CHECK(!t.device().is_cuda(), "rotary_embedding: host (or meta) tensors");
  const std::int64_t d = x.global_shape()[X::rank - 1];
  DTENSOR_CHECK(d % 2 == 0,
                "rotary_embedding: head_dim " + std::to_string(d) + " is odd; RoPE rotates pairs");
  const Block b = spec_block(to_extents(x.global_shape()), X::spec, x.mesh().sizes(), x.mesh().coordinate());
  const std::int64_t half = d / 2;
  const std::int64_t seq = t.shape()[SeqDim];
  const bool meta = t.device().is_meta(); // no values: no angles either
  std::vector<C> cs(static_cast<std::size_t>(meta ? 0 : seq * half)), sn(cs.size());
  for (std::int64_t s = 0; s < seq && !meta; ++s) {
    const std::int64_t at = pos.empty() ? b.offset[SeqDim] + s : pos[static_cast<std::size_t>(s)];
    const double p = static_cast<double>(at + o.offset);
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = p * std::pow(o.base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
      cs[static_cast<std::size_t>(s * half + i)] = static_cast<C>(std::cos(angle));
      sn[static_cast<std::size_t>(s * half + i)] = static_cast<C>(sign * std::sin(angle));
    }
  }
  std::int64_t inner = 1; // rows between consecutive positions
  for (int k = SeqDim + 1; k < X::rank - 1; ++k) {
    inner *= t.shape()[k];
  }
  const auto in = t.contiguous();
  typename X::local_type out(t.shape(), t.device());
  const std::int64_t rows = d == 0 || meta ? 0 : in.numel() / d;
  const std::int64_t step_a = o.interleaved ? 2 : 1;
  const std::int64_t gap = o.interleaved ? 1 : half;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t s = (r / inner) % seq;
    const T* xr = in.data() + r * d;
    T* yr = out.data() + r * d;
    const C* c = cs.data() + s * half;
    const C* si = sn.data() + s * half;
    for (std::int64_t i = 0; i < half; ++i) {
      const std::int64_t a = i * step_a;
      const C xa = static_cast<C>(xr[a]);
      const C xb = static_cast<C>(xr[a + gap]);
      yr[a] = T(xa * c[i] - xb * si[i]);
      yr[a + gap] = T(xb * c[i] + xa * si[i]);
    }
  }
  return out;
}

} // namespace detail

/// The backward of rotary_embedding: the gradient rotated back (any placements of x's; head_dim whole).
template <int SeqDim, class X>
class RotaryBackward {
public:
  RotaryBackward(RotaryOptions o, typename X::shape_type global) : o_(o), global_(global) {}

  template <AnyDTensor G>
  G operator()(const G& g) const {
    static_assert(std::is_same_v<typename G::value_type, typename X::value_type> && G::rank == X::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    static_assert(detail::rotary_ok<SeqDim, G>());
    DTENSOR_CHECK(g.global_shape() == global_,
                  "backward of rotary_embedding: the gradient's global shape " +
                      detail::shape_string(detail::to_extents(g.global_shape())) + " is not the output's");
    return G(g.mesh(), detail::rotate<SeqDim>(g, o_, -1), g.global_shape());
  }

  /// The gradient of a zigzag-laid-out x (rotary_embedding of a Zigzag).
  template <fixed_string Axis, class G>
  Zigzag<Axis, G> operator()(const Zigzag<Axis, G>& g) const {
    static_assert(std::is_same_v<typename G::value_type, typename X::value_type> && G::rank == X::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    DTENSOR_CHECK(g.tensor.global_shape() == global_,
                  "backward of rotary_embedding: the gradient's global shape " +
                      detail::shape_string(detail::to_extents(g.tensor.global_shape())) +
                      " is not the output's");
    return {G(g.tensor.mesh(), detail::rotate<SeqDim>(g.tensor, o_, -1, g.positions()), global_)};
  }

private:
  RotaryOptions o_;
  typename X::shape_type global_;
};

/// x with RoPE applied along head_dim at the global positions of dim SeqDim (see the top of the file).
template <int SeqDim, AnyDTensor X>
X rotary_embedding(const X& x, const RotaryOptions& o = {}) {
  if constexpr (!detail::rotary_ok<SeqDim, X>()) {
    return x;
  } else {
    return X(x.mesh(), detail::rotate<SeqDim>(x, o, 1), x.global_shape());
  }
}
template <int SeqDim, AnyDTensor X>
auto rotary_embedding(const X& x, const RotaryOptions& o, WithBackwardTag) {
  return WithBackward<X, RotaryBackward<SeqDim, X>>{rotary_embedding<SeqDim>(x, o),
                                                    RotaryBackward<SeqDim, X>(o, x.global_shape())};
}

/// RoPE of a sequence in the zigzag layout (ops/zigzag.hpp): each row turns by its natural position.
template <int SeqDim, fixed_string Axis, class X>
Zigzag<Axis, X> rotary_embedding(const Zigzag<Axis, X>& z, const RotaryOptions& o = {}) {
  static_assert((SeqDim < 0 ? SeqDim + X::rank : SeqDim) == Zigzag<Axis, X>::seq_dim,
                "dtensor rotary_embedding: SeqDim must be the dim the Zigzag layout orders");
  if constexpr (!detail::rotary_ok<SeqDim, X>()) {
    return z;
  } else {
    return {
        X(z.tensor.mesh(), detail::rotate<SeqDim>(z.tensor, o, 1, z.positions()), z.tensor.global_shape())};
  }
}
template <int SeqDim, fixed_string Axis, class X>
auto rotary_embedding(const Zigzag<Axis, X>& z, const RotaryOptions& o, WithBackwardTag) {
  return WithBackward<Zigzag<Axis, X>, RotaryBackward<SeqDim, X>>{
      rotary_embedding<SeqDim>(z, o), RotaryBackward<SeqDim, X>(o, z.tensor.global_shape())};
}

} // namespace dtensor

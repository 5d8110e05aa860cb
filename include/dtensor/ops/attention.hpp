#pragma once
// Scaled dot-product attention of DTensors, forward and backward; the local kernel is local/attention.hpp
// (blockwise, online softmax, no seq x seq matrix).
//
//   // q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq_k, .): kv_heads divides heads (GQA)
//   auto o = scaled_dot_product_attention(q, k, v, {.causal = true});
//   auto [o2, back] = scaled_dot_product_attention(q, k, v, {.causal = true}, with_backward);
//   auto [dq, dk, dv] = back(d_o);
//
// The batch-less form takes (heads, seq, head_dim). The output has q's placements. On each mesh axis:
//
//   q, k, v Shard<batch> or Shard<heads>       -> local attention, no communication (Megatron's
//     (k/v may instead be Replicate: each rank     head-parallel attention: qkv column-parallel, heads over
//     reads the k/v heads its q heads need)        tp, the output projection row-parallel -> Partial)
//   q Shard<seq>, k and v Replicate            -> local: each rank's queries see every key, masked by
//                                                 their global positions
//   all Replicate                              -> local
//   k or v Shard<seq>                          -> does not compile: a query needs every key; name a
//                                                 context-parallel form, Ulysses<"axis"> or Ring<"axis">
//   Shard<head_dim>, a Partial, or q Replicate where k/v are sharded -> does not compile, saying what to
//                                                 redistribute
//
// Heads shard as any dim does (torch's chunking: uneven counts leave the last ranks fewer, or none).
// With GQA each rank's q heads must find their k/v heads on the same rank: with k/v sharded too, both
// counts divisible by the axis size does it; otherwise keep k/v Replicate on that axis (an error names the
// heads and groups when they do not fit). The causal mask and dropout use global positions and indices
// (local/attention.hpp), so every sharding computes the same attention as one rank.
//
// Backward: dO is brought to the output's placements, the local backward recomputes the probabilities from
// the saved log-sum-exp, dq has q's placements; dk and dv have k's and v's, except on axes where k/v are
// Replicate but q is sharded: there each rank holds the part of the gradient its queries give, so they are
// Partial<sum> (a valid gradient of a Replicate primal; reduce it where the parameter gradient is due).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/backward/redistribute.hpp"
#include "dtensor/backward/with_backward.hpp"
#include "dtensor/comm/p2p.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/core/thread_scope.hpp"
#include "dtensor/local/attention.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/check_memo.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/ops/zigzag.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

/// What an attention call computes (torch.nn.functional.scaled_dot_product_attention's arguments).
struct AttentionOptions {
  bool causal = false;
  double scale = 0;         ///< 0: 1 / sqrt(head_dim)
  double dropout = 0;       ///< dropout on the attention weights (training; needs dtensor::random)
  std::uint64_t seed = 0;   ///< dropout's generator: the same on every rank
  std::uint64_t offset = 0; ///< its stream: a new one for each call
};

namespace detail {

/// Why attention cannot run on its inputs' placements.
enum class AttentionError : std::uint8_t {
  none,
  kv_seq,         ///< k or v sharded on the sequence
  head_dim,       ///< a head_dim sharded
  partial,        ///< a Partial input
  kv_not_like_q,  ///< k/v sharded where q is not sharded the same way
  q_seq_kv_shard, ///< q sharded on the sequence while k/v are sharded on batch or heads
  rank,           ///< not rank 3 or 4
};

/// The error of one mesh axis (placements normalised to `rank`).
constexpr AttentionError attention_axis_error(Placement q, Placement k, Placement v, int rank) {
  const int seq = rank - 2;
  const int head_dim = rank - 1;
  if (q.is_partial() || k.is_partial() || v.is_partial()) {
    return AttentionError::partial;
  }
  if (k == Placement::shard(seq) || v == Placement::shard(seq)) {
    return AttentionError::kv_seq;
  }
  if (q == Placement::shard(head_dim) || k == Placement::shard(head_dim) || v == Placement::shard(head_dim)) {
    return AttentionError::head_dim;
  }
  for (Placement kv : {k, v}) {
    if (kv.is_shard() && q == Placement::shard(seq)) {
      return AttentionError::q_seq_kv_shard;
    }
    if (kv.is_shard() && kv != q) {
      return AttentionError::kv_not_like_q;
    }
  }
  return AttentionError::none;
}

template <class Q, class K, class V>
struct AttentionRule {
  static constexpr AttentionError error = [] {
    if (Q::rank != 3 && Q::rank != 4) {
      return AttentionError::rank;
    }
    for (int a = 0; a < Q::placements.size(); ++a) {
      const AttentionError e =
          attention_axis_error(normalize(Q::placements[a], Q::rank), normalize(K::placements[a], Q::rank),
                               normalize(V::placements[a], Q::rank), Q::rank);
      if (e != AttentionError::none) {
        return e;
      }
    }
    return AttentionError::none;
  }();
  /// dk's (dv's) placements: k's, with Partial<sum> where k is Replicate and q is sharded.
  template <class KV>
  static constexpr PlacementList grad() {
    PlacementList l;
    for (int a = 0; a < KV::placements.size(); ++a) {
      const Placement p = normalize(KV::placements[a], KV::rank);
      l.push_back(p.is_replicate() && normalize(Q::placements[a], Q::rank).is_shard()
                      ? Placement::partial(ReduceOp::sum)
                      : p);
    }
    return l;
  }
  static constexpr PlacementList dk() { return grad<K>(); }
  static constexpr PlacementList dv() { return grad<V>(); }
};

/// The static_asserts of an attention rule error (the only error; see ops/typed_rules.hpp).
template <AttentionError E>
consteval bool check_attention() {
  static_assert(E != AttentionError::rank,
                "dtensor attention: q, k and v are (batch, heads, seq, head_dim) or (heads, seq, head_dim)");
  static_assert(
      E != AttentionError::kv_seq,
      "dtensor attention: k or v is sharded on the sequence dim, but each query needs every key. Use "
      "context parallelism over that mesh axis: attention<Ulysses<\"axis\">>(q, k, v) (all_to_all "
      "to heads and back) or attention<Ring<\"axis\">>(q, k, v) (k/v blocks passed around the ring); "
      "or redistribute k and v to Replicate on it");
  static_assert(E != AttentionError::head_dim,
                "dtensor attention: head_dim is sharded: the scores would be partial sums under a softmax; "
                "redistribute to Replicate on that axis (or shard heads instead)");
  static_assert(E != AttentionError::partial,
                "dtensor attention: a Partial input to attention (softmax is not linear): "
                "redistribute<Replicate> it first");
  static_assert(E != AttentionError::kv_not_like_q,
                "dtensor attention: k or v is sharded on a mesh axis where q is not sharded the same way: "
                "shard q on the same dim (batch or heads), or make k and v Replicate there");
  static_assert(E != AttentionError::q_seq_kv_shard,
                "dtensor attention: q is sharded on the sequence while k or v is sharded on batch or heads "
                "along the same mesh axis: redistribute k and v to Replicate on it");
  return true;
}

/// A local tensor of rank 3 or 4 as rank 4 (the batch-less form gets batch 1).
template <class T, int R>
Tensor<T, 4> as_rank4(const Tensor<T, R>& t) {
  if constexpr (R == 4) {
    return t;
  } else {
    return t.contiguous().template view<4>({1, t.shape()[0], t.shape()[1], t.shape()[2]});
  }
}
template <int R, class T>
Tensor<T, R> from_rank4(const Tensor<T, 4>& t) {
  if constexpr (R == 4) {
    return t;
  } else {
    return t.template view<3>({t.shape()[1], t.shape()[2], t.shape()[3]});
  }
}

/// Throws, on every rank alike, when some rank's q heads (placed by Q) would not find the k/v heads of their
/// groups among its own (placed by K): GQA with heads sharded unevenly against the groups.
template <class Q, class K>
void check_head_groups(const std::string& shapes, const MeshSizes& sizes, const Extents& gq,
                       const Extents& gk) {
  constexpr int h = Q::rank - 3;
  const std::int64_t group = gk[h] > 0 ? gq[h] / gk[h] : 1;
  if (group == 1) {
    return; // one k/v head per q head: the rule placed k/v heads as q's or whole, so each rank has its own
  }
  thread_local CheckMemo memo; // ops/check_memo.hpp: every rank walked once per sizes
  const std::string key = check_key(gq, gk, sizes);
  if (memo.passed(key)) {
    return;
  }
  for (int r = 0; r < mesh_numel(sizes); ++r) {
    const MeshCoord c = rank_to_coord(r, sizes);
    const Block qb = spec_block(gq, Q::spec, sizes, c);
    const Block kb = spec_block(gk, K::spec, sizes, c);
    const std::int64_t nh = qb.shape[h];
    if (nh == 0 || (Q::rank == 4 && qb.shape[0] == 0)) {
      continue;
    }
    const std::int64_t lo = qb.offset[h] / group;
    const std::int64_t hi = (qb.offset[h] + nh - 1) / group + 1;
    DTENSOR_CHECK(lo >= kb.offset[h] && hi <= kb.offset[h] + kb.shape[h],
                  shapes + ": rank " + std::to_string(r) + "'s q heads [" + std::to_string(qb.offset[h]) +
                      ", " + std::to_string(qb.offset[h] + nh) + ") (groups of " + std::to_string(group) +
                      " per k/v head) need k/v heads [" + std::to_string(lo) + ", " + std::to_string(hi) +
                      "), but it holds k/v heads [" + std::to_string(kb.offset[h]) + ", " +
                      std::to_string(kb.offset[h] + kb.shape[h]) +
                      "): shard heads so that each rank's q heads are whole groups (q and k/v head counts "
                      "divisible by the axis size), or keep k/v Replicate on that axis");
  }
  memo.pass(key);
}

/// Each rank's attention problem: its q block, the k/v heads (and batch) that block needs, and where they
/// sit in the global problem.
template <class Q, class K, class V>
struct AttentionLocal {
  static constexpr int R = Q::rank;
  static constexpr int b_dim = R == 4 ? 0 : -1;
  static constexpr int h_dim = R - 3;
  static constexpr int s_dim = R - 2;
  using T = typename Q::value_type;

  Block k_held, k_need, v_held, v_need;
  Tensor<T, 4> q, k, v;
  std::vector<std::int64_t> q_pos;
  local::AttentionCoords coords;
  local::AttentionParams params;

  AttentionLocal(const Q& qx, const K& kx, const V& vx, const AttentionOptions& o) {
    const auto& gq = qx.global_shape();
    const auto& gk = kx.global_shape();
    const auto& gv = vx.global_shape();
    const std::string shapes = "attention: q " + shape_string(to_extents(gq)) + ", k " +
                               shape_string(to_extents(gk)) + ", v " + shape_string(to_extents(gv));
    const auto same_mesh = [&](const auto& m) {
      return m.sizes() == qx.mesh().sizes() && m.coordinate() == qx.mesh().coordinate();
    };
    DTENSOR_CHECK(same_mesh(kx.mesh()) && same_mesh(vx.mesh()), shapes + ": q, k and v must be on one mesh");
    DTENSOR_CHECK(
        gk ==
            [&] {
              auto s = gv;
              s[R - 1] = gk[R - 1];
              return s;
            }(),
        shapes + ": k and v differ in more than the last dim");
    DTENSOR_CHECK((R == 3 || gk[0] == gq[0]) && gk[R - 1] == gq[R - 1],
                  shapes + ": k must have q's batch and head_dim");
    const std::int64_t heads = gq[h_dim];
    const std::int64_t kv_heads = gk[h_dim];
    DTENSOR_CHECK((heads == 0 && kv_heads == 0) || (kv_heads > 0 && heads % kv_heads == 0),
                  shapes + ": k/v's heads (" + std::to_string(kv_heads) + ") must divide q's heads (" +
                      std::to_string(heads) + ")");
    const std::int64_t group = kv_heads > 0 ? heads / kv_heads : 1;
    const auto& mesh = qx.mesh();
    check_head_groups<Q, K>(shapes, mesh.sizes(), to_extents(gq), to_extents(gk));
    const Block qb = spec_block(to_extents(gq), Q::spec, mesh.sizes(), mesh.coordinate());
    k_held = spec_block(to_extents(gk), K::spec, mesh.sizes(), mesh.coordinate());
    v_held = spec_block(to_extents(gv), V::spec, mesh.sizes(), mesh.coordinate());
    const std::int64_t b0 = R == 4 ? qb.offset[0] : 0;
    const std::int64_t h0 = qb.offset[h_dim];
    const std::int64_t nh = qb.shape[h_dim];
    const auto need = [&](const Block& held, const auto& global) {
      Block n{to_extents(global), Extents(R, 0)};
      if constexpr (R == 4) {
        n.offset[0] = b0;
        n.shape[0] = qb.shape[0];
      }
      n.offset[h_dim] = nh == 0 ? 0 : h0 / group;
      n.shape[h_dim] = nh == 0 ? 0 : (h0 + nh - 1) / group - h0 / group + 1;
      for (int d = 0; d < R; ++d) {
        const bool inside =
            n.offset[d] >= held.offset[d] && n.offset[d] + n.shape[d] <= held.offset[d] + held.shape[d];
        DTENSOR_CHECK(n.shape[d] == 0 || inside, shapes + ": rank " + std::to_string(mesh.rank()) +
                                                     " lacks the k/v block its q block needs (dim " +
                                                     std::to_string(d) + ")"); // check_head_groups passed
        if (n.shape[d] == 0) {
          n.offset[d] = held.offset[d];
        }
      }
      return n;
    };
    k_need = need(k_held, gk);
    v_need = need(v_held, gv);
    q = as_rank4(qx.local());
    k = as_rank4(cut<T, R>(kx.local(), k_held, k_need));
    v = as_rank4(cut<T, R>(vx.local(), v_held, v_need));
    q_pos.resize(static_cast<std::size_t>(qb.shape[s_dim]));
    for (std::size_t i = 0; i < q_pos.size(); ++i) {
      q_pos[i] = qb.offset[s_dim] + static_cast<std::int64_t>(i);
    }
    coords.batch0 = b0;
    coords.head0 = h0;
    coords.heads = heads;
    coords.kv_heads = kv_heads;
    coords.seq_q = gq[s_dim];
    coords.seq_k = gk[s_dim];
    coords.q_pos = q_pos.data();
    params = {o.causal, o.scale, o.dropout, o.seed, o.offset};
  }
  // coords points into q_pos: not copyable as is
  AttentionLocal(const AttentionLocal&) = delete;
  AttentionLocal& operator=(const AttentionLocal&) = delete;

  /// A gradient for the k (or v) block `held` from the one computed on `need` (zero elsewhere).
  template <int RK>
  static Tensor<T, RK> place(const Tensor<T, 4>& g, const Block& held, const Block& need) {
    const Tensor<T, RK> gr = from_rank4<RK>(g);
    if (held == need) {
      return gr;
    }
    Tensor<T, RK> out = Tensor<T, RK>::zeros(to_array<RK>(held.shape), g.device());
    local::copy(cut<T, RK>(out, held, need), gr);
    return out;
  }
};

template <class Q, class K, class V>
constexpr bool attention_ok() {
  constexpr bool same =
      std::is_same_v<typename Q::value_type, typename K::value_type> &&
      std::is_same_v<typename Q::value_type, typename V::value_type> &&
      std::is_same_v<typename dtensor_traits<Q>::shape_type, typename dtensor_traits<K>::shape_type> &&
      std::is_same_v<typename dtensor_traits<Q>::shape_type, typename dtensor_traits<V>::shape_type>;
  static_assert(same, "dtensor attention: q, k and v must have one element type and one mesh");
  static_assert(Q::rank == K::rank && Q::rank == V::rank, "dtensor attention: q, k and v must have one rank");
  return same && Q::rank == K::rank && Q::rank == V::rank &&
         check_attention<AttentionRule<Q, K, V>::error>() &&
         AttentionRule<Q, K, V>::error == AttentionError::none;
}

/// What an attention backward keeps (q, k, v, the output and the log-sum-exp of each query row), and dO
/// brought to the output's placements.
template <class Q, class K, class V>
class SavedAttention {
protected:
  using T = typename Q::value_type;

  SavedAttention(Q q, K k, V v, Q o, Tensor<local::compute_t<T>, 3> lse, AttentionOptions opt)
      : q_(std::move(q)), k_(std::move(k)), v_(std::move(v)), o_(std::move(o)), lse_(std::move(lse)),
        opt_(opt) {}

  template <class G>
  Q output_gradient(const G& g, const char* op) const {
    static_assert(std::is_same_v<typename G::value_type, T> && G::rank == Q::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    DTENSOR_CHECK(g.global_shape() == o_.global_shape(),
                  std::string("backward of ") + op + ": the gradient's global shape " +
                      shape_string(to_extents(g.global_shape())) + " is not the output's " +
                      shape_string(to_extents(o_.global_shape())));
    return redistribute_as<Q, G>::run(g);
  }

  Q q_;
  K k_;
  V v_;
  Q o_;
  Tensor<local::compute_t<T>, 3> lse_;
  AttentionOptions opt_;
};

} // namespace detail

/// The backward context of attention: keeps q, k, v, the output and the log-sum-exp of each query row.
template <class Q, class K, class V>
class AttentionBackward : detail::SavedAttention<Q, K, V> {
  using Base = detail::SavedAttention<Q, K, V>;
  using T = typename Q::value_type;
  using Rule = detail::AttentionRule<Q, K, V>;
  using Shape = typename detail::dtensor_traits<Q>::shape_type;
  using Base::k_, Base::lse_, Base::o_, Base::opt_, Base::q_, Base::v_;

public:
  using DK = dtensor_from_t<T, Q::rank, Shape, &Rule::dk>;
  using DV = dtensor_from_t<T, Q::rank, Shape, &Rule::dv>;

  AttentionBackward(Q q, K k, V v, Q o, Tensor<local::compute_t<T>, 3> lse, AttentionOptions opt)
      : Base(std::move(q), std::move(k), std::move(v), std::move(o), std::move(lse), opt) {}

  /// {dq, dk, dv} from dO (any placements).
  template <AnyDTensor G>
  std::tuple<Q, DK, DV> operator()(const G& g) const {
    const Q go = this->output_gradient(g, "attention");
    const detail::AttentionLocal<Q, K, V> l(q_, k_, v_, opt_);
    auto [dq, dk, dv] = local::attention_backward(l.q, l.k, l.v, detail::as_rank4(o_.local()), lse_,
                                                  detail::as_rank4(go.local()), l.params, l.coords);
    using L = detail::AttentionLocal<Q, K, V>;
    return {Q(q_.mesh(), detail::from_rank4<Q::rank>(dq), q_.global_shape()),
            DK(q_.mesh(), L::template place<Q::rank>(dk, l.k_held, l.k_need), k_.global_shape()),
            DV(q_.mesh(), L::template place<Q::rank>(dv, l.v_held, l.v_need), v_.global_shape())};
  }
};

namespace detail {

template <class Q, class K, class V>
std::pair<Q, Tensor<local::compute_t<typename Q::value_type>, 3>>
attention_forward(const Q& q, const K& k, const V& v, const AttentionOptions& o) {
  const AttentionLocal<Q, K, V> l(q, k, v, o);
  auto [out, lse] = local::attention_forward(l.q, l.k, l.v, l.params, l.coords);
  auto go = q.global_shape();
  go[Q::rank - 1] = v.global_shape()[Q::rank - 1];
  return {Q(q.mesh(), from_rank4<Q::rank>(out), go), std::move(lse)};
}

} // namespace detail

/// softmax(q k^T * scale [+ causal mask]) v with optional dropout (see the top of the file); the output has
/// q's placements and type.
template <AnyDTensor Q, AnyDTensor K, AnyDTensor V>
Q scaled_dot_product_attention(const Q& q, const K& k, const V& v, const AttentionOptions& o = {}) {
  if constexpr (!detail::attention_ok<Q, K, V>()) {
    return q; // after the error above, q stands in for the result: no second error
  } else {
    return detail::attention_forward(q, k, v, o).first;
  }
}
/// With the backward: `auto [o, back] = ...(q, k, v, opts, with_backward); auto [dq, dk, dv] = back(d_o);`.
template <AnyDTensor Q, AnyDTensor K, AnyDTensor V>
auto scaled_dot_product_attention(const Q& q, const K& k, const V& v, const AttentionOptions& o,
                                  WithBackwardTag) {
  if constexpr (!detail::attention_ok<Q, K, V>()) {
    return q;
  } else {
    auto [out, lse] = detail::attention_forward(q, k, v, o);
    AttentionBackward<Q, K, V> back(q, k, v, out, std::move(lse), o);
    return WithBackward<Q, AttentionBackward<Q, K, V>>{std::move(out), std::move(back)};
  }
}

/// Ulysses context parallelism over mesh axis `Axis` (DeepSpeed-Ulysses): q, k and v sharded on the
/// sequence there go to heads sharded (one all_to_all each), attention runs over the whole sequence on
/// each rank's heads, and the output comes back to the sequence (one all_to_all). The backward is the
/// duals: one all_to_all for dO, one for each of dq, dk, dv (4 forward, 4 backward; q, k and v are sent
/// separately, not packed, so GQA's smaller k/v move only their own bytes). Heads split as any dim does:
/// uneven head counts leave some ranks fewer (the all_to_all's splits differ); with GQA each rank's q
/// heads must be whole groups of its k/v heads (an error names them otherwise: then use Ring).
template <fixed_string Axis>
struct Ulysses {
  static constexpr auto context_parallel_axis = Axis;
};

namespace detail {

template <class X, int Axis>
struct WithAxisReplicate {
  static constexpr PlacementList list() {
    PlacementList l = X::placements;
    l[Axis] = Placement::replicate();
    return l;
  }
};

template <class X, int Axis>
using with_axis_replicate_t =
    dtensor_from_t<typename X::value_type, X::rank, typename dtensor_traits<X>::shape_type,
                   &WithAxisReplicate<X, Axis>::list>;

template <class D, class X>
struct redistribute_with_backward_as;
template <class T, int R, class Shape, class... P, class X>
struct redistribute_with_backward_as<DTensor<T, R, Shape, P...>, X> {
  static auto run(const X& x) { return redistribute_with_backward<P...>(x); }
};

template <fixed_string Axis, class Q, class K, class V>
constexpr int ulysses_axis() {
  using Shape = typename dtensor_traits<Q>::shape_type;
  constexpr int a = Shape::template index_of<Axis>();
  constexpr Placement seq = Placement::shard(Q::rank - 2);
  static_assert(normalize(Q::placements[a], Q::rank) == seq && normalize(K::placements[a], K::rank) == seq &&
                    normalize(V::placements[a], V::rank) == seq,
                "dtensor attention<Ulysses<axis>>: q, k and v must be Shard<seq> (dim rank - 2) on that mesh "
                "axis: context parallelism takes sequence-sharded activations");
  return a;
}

} // namespace detail

template <class Form, AnyDTensor Q, AnyDTensor K, AnyDTensor V>
auto attention(const Q& q, const K& k, const V& v, const AttentionOptions& o, WithBackwardTag);

/// Attention in a context-parallel form (Ulysses<"cp">): see Ulysses.
template <class Form, AnyDTensor Q, AnyDTensor K, AnyDTensor V>
Q attention(const Q& q, const K& k, const V& v, const AttentionOptions& o = {}) {
  return attention<Form>(q, k, v, o, with_backward).output;
}

namespace detail {
template <class Form>
struct attention_form;
template <fixed_string Axis>
struct attention_form<Ulysses<Axis>> {
  template <class Q, class K, class V>
  static auto run(const Q& q, const K& k, const V& v, const AttentionOptions& o) {
    constexpr int a = ulysses_axis<Axis, Q, K, V>();
    constexpr int heads = Q::rank - 3;
    using QH = with_axis_shard_t<Q, a, heads>;
    using KH = with_axis_shard_t<K, a, heads>;
    using VH = with_axis_shard_t<V, a, heads>;
    // before any communication, so that every rank throws or none does
    const std::string shapes = "attention<Ulysses<" + std::string(Axis.view()) + ">>: q " +
                               shape_string(to_extents(q.global_shape())) + ", k " +
                               shape_string(to_extents(k.global_shape()));
    check_head_groups<QH, KH>(shapes, q.mesh().sizes(), to_extents(q.global_shape()),
                              to_extents(k.global_shape()));
    auto [qh, q_back] = redistribute_with_backward_as<QH, Q>::run(q);
    auto [kh, k_back] = redistribute_with_backward_as<KH, K>::run(k);
    auto [vh, v_back] = redistribute_with_backward_as<VH, V>::run(v);
    auto [oh, a_back] = scaled_dot_product_attention(qh, kh, vh, o, with_backward);
    auto [out, o_back] = redistribute_with_backward_as<Q, QH>::run(oh);
    auto back = [q_back = std::move(q_back), k_back = std::move(k_back), v_back = std::move(v_back),
                 a_back = std::move(a_back), o_back = std::move(o_back)](const auto& d_o) {
      auto [dq, dk, dv] = a_back(o_back(d_o));
      return std::tuple{q_back(dq), k_back(dk), v_back(dv)};
    };
    return WithBackward<Q, decltype(back)>{std::move(out), std::move(back)};
  }
};
} // namespace detail

/// Ring attention over mesh axis `Axis` (context parallelism for long sequences): q, k and v sharded on the
/// sequence there, each rank keeps its queries and the k/v chunks go around the axis's ring, one
/// batch_isend_irecv round per step posted before the step's local attention runs (so the next chunk moves
/// while this one computes): n - 1 rounds forward, each step's (o, lse) merged by their log-sum-exps. The
/// backward sends k/v around again (n - 1 rounds) and the dk/dv accumulators after them (n rounds: each
/// returns to its chunk's owner; each round moves while the next step's kernel runs). The causal mask
/// compares global positions, so any chunking masks as one rank would; chunks wholly after a rank's queries
/// are skipped by the kernel. Contiguous chunks leave the last ranks most of the causal work: pass q, k and
/// v as Zigzag<Axis, .> (zigzag<Axis, seq>(x), ops/zigzag.hpp) and each rank holds a piece from the front and
/// one from the back of the sequence, the same work on every rank. Uneven sequence lengths work (chunks of
/// different sizes). q, k and v must have the same placements on every axis (e.g. batch over dp, heads over
/// tp beside it).
template <fixed_string Axis>
struct Ring {
  static constexpr auto context_parallel_axis = Axis;
};

/// What ring attention did, in order, on this thread while one is alive (like CommDebugMode): "post t" when
/// step t's exchange is posted, "compute t" when its kernel starts, "wait t" when it waits for the exchange
/// (backward steps read "backward post t" and so on). For tests and debugging of the overlap.
class RingTrace : public detail::ThreadScope<RingTrace> {
public:
  RingTrace() = default;

  const std::vector<std::string>& events() const noexcept { return events_; }

  /// Adds `what t` to the innermost live trace of this thread, if any.
  static void note(const char* what, int step) {
    if (RingTrace* t = innermost()) {
      t->events_.push_back(std::string(what) + " " + std::to_string(step));
    }
  }

private:
  std::vector<std::string> events_;
};

namespace detail {

/// (o, lse) += the attention over other keys (o2, lse2): weights exp(lse - max), renormalised.
template <class T, class C>
void merge_attention(Tensor<T, 4>& o, Tensor<C, 3>& lse, const Tensor<T, 4>& o2, const Tensor<C, 3>& lse2) {
  DTENSOR_CHECK(!o.device().is_cuda(),
                "ring attention merges its steps' outputs on host tensors; on CUDA tensors "
                "use head-parallel attention or Ulysses (both run the CUDA kernel)");
  const std::int64_t rows = o.device().is_meta() ? 0 : lse.numel(); // meta: nothing to merge
  const std::int64_t dv = rows == 0 ? 0 : o.numel() / rows;
  const auto oc = o2.contiguous();
  const auto lc = lse2.contiguous();
  for (std::int64_t r = 0; r < rows; ++r) {
    const C l1 = lse.data()[r];
    const C l2 = lc.data()[r];
    const C m = std::max(l1, l2);
    if (m == -std::numeric_limits<C>::infinity()) {
      continue; // no key seen yet by either
    }
    const C w1 = std::exp(l1 - m);
    const C w2 = std::exp(l2 - m);
    const C s = w1 + w2;
    T* a = o.data() + r * dv;
    const T* b = oc.data() + r * dv;
    for (std::int64_t c = 0; c < dv; ++c) {
      a[c] = T((w1 * static_cast<C>(a[c]) + w2 * static_cast<C>(b[c])) / s);
    }
    lse.data()[r] = m + std::log(s);
  }
}

template <fixed_string Axis, class Q, class K, class V>
struct RingPlan {
  using T = typename Q::value_type;
  using C = local::compute_t<T>;
  using Shape = typename dtensor_traits<Q>::shape_type;
  static constexpr int a = Shape::template index_of<Axis>();
  static constexpr int R = Q::rank;
  static constexpr int s_dim = R - 2;
  static constexpr bool ok = [] {
    constexpr Placement seq = Placement::shard(R - 2);
    static_assert(
        normalize(Q::placements[a], R) == seq,
        "dtensor attention<Ring<axis>>: q, k and v must be Shard<seq> (dim rank - 2) on that mesh axis");
    static_assert(Q::placements == K::placements && Q::placements == V::placements,
                  "dtensor attention<Ring<axis>>: q, k and v must have the same placements");
    return normalize(Q::placements[a], R) == seq && Q::placements == K::placements &&
           Q::placements == V::placements;
  }();
  /// q's placements with the ring's axis Replicate: what the local attention of one chunk sees.
  using QR = with_axis_replicate_t<Q, a>;
  static constexpr bool rule_ok = ok && check_attention<AttentionRule<QR, QR, QR>::error>() &&
                                  AttentionRule<QR, QR, QR>::error == AttentionError::none;

  const Q& q;
  int n, me;
  ProcessGroup group;
  MeshCoord coord;
  Extents gq, gk, gv;
  Block qb;
  bool zigzag; ///< the sequence in the zigzag layout (Zigzag<Axis, Q>), not in torch.chunk's blocks
  std::vector<std::int64_t> q_pos;
  local::AttentionParams params;

  RingPlan(const Q& q_, const K& k, const V& v, const AttentionOptions& o, bool zz)
      : q(q_), n(q_.mesh().size(a)), me(q_.mesh().coordinate()[a]), group(q_.mesh().group(a)),
        coord(q_.mesh().coordinate()), gq(to_extents(q_.global_shape())), gk(to_extents(k.global_shape())),
        gv(to_extents(v.global_shape())), qb(spec_block(gq, Q::spec, q_.mesh().sizes(), coord)),
        zigzag(zz), params{o.causal, o.scale, o.dropout, o.seed, o.offset} {
    const std::string shapes = "attention<Ring<" + std::string(Axis.view()) + ">>: q " + shape_string(gq) +
                               ", k " + shape_string(gk) + ", v " + shape_string(gv);
    const std::int64_t h = gq[R - 3];
    const std::int64_t hk = gk[R - 3];
    DTENSOR_CHECK(
        (R == 3 || (gk[0] == gq[0] && gv[0] == gq[0])) && gk[R - 1] == gq[R - 1] && gv[R - 3] == hk &&
            gv[s_dim] == gk[s_dim] && ((h == 0 && hk == 0) || (hk > 0 && h % hk == 0)),
        shapes + ": q (batch, heads, seq, d), k (batch, kv_heads, seq_k, d) and v (batch, kv_heads, "
                 "seq_k, dv), kv_heads dividing heads");
    check_head_groups<Q, K>(shapes, q_.mesh().sizes(), gq, gk);
    q_pos = zigzag ? zigzag_positions(gq[s_dim], n, me) : block_positions(qb);
  }

  int origin(int step) const { return ((me - step) % n + n) % n; }
  /// The block of k (v: global `g`, spec S) that the rank at position `j` of the ring holds.
  template <class X>
  Block block_of(const Extents& g, int j) const {
    MeshCoord c = coord;
    c[a] = j;
    return spec_block(g, X::spec, q.mesh().sizes(), c);
  }
  static std::vector<std::int64_t> block_positions(const Block& b) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(b.shape[s_dim]));
    for (std::size_t i = 0; i < p.size(); ++i) {
      p[i] = b.offset[s_dim] + static_cast<std::int64_t>(i);
    }
    return p;
  }
  /// The global positions of the keys the rank at ring position j holds.
  std::vector<std::int64_t> positions(int j) const {
    return zigzag ? zigzag_positions(gk[s_dim], n, j) : block_positions(block_of<K>(gk, j));
  }
  local::AttentionCoords coords(const std::vector<std::int64_t>& k_pos) const {
    local::AttentionCoords c;
    c.batch0 = R == 4 ? qb.offset[0] : 0;
    c.head0 = qb.offset[R - 3];
    c.heads = gq[R - 3];
    c.kv_heads = gk[R - 3];
    c.seq_q = gq[s_dim];
    c.seq_k = gk[s_dim];
    c.q_pos = q_pos.data();
    c.k_pos = k_pos.data();
    return c;
  }
  /// An empty local tensor for the chunk of ring position j of a tensor placed as X with global `g`.
  template <class X>
  Tensor<T, 4> buffer(const Extents& g, int j) const {
    return as_rank4(Tensor<T, R>(to_array<R>(block_of<X>(g, j).shape), q.local().device()));
  }
  /// Posts the exchange of one step: `send` to the next rank, `recv` (fresh buffers) from the previous one.
  std::vector<Work> rotate(const std::vector<Tensor<T, 4>>& send,
                           const std::vector<Tensor<T, 4>>& recv) const {
    std::vector<P2POp> ops;
    for (const auto& t : send) {
      ops.emplace_back(P2POp::isend, t, (me + 1) % n, group);
    }
    for (const auto& t : recv) {
      ops.emplace_back(P2POp::irecv, t, (me + n - 1) % n, group);
    }
    return batch_isend_irecv(ops);
  }
};

} // namespace detail

/// The backward context of ring attention: keeps q, k, v, the output and its log-sum-exp. Zigzag: the
/// sequence in the zigzag layout (the gradients take and give Zigzag<Axis, .>).
template <fixed_string Axis, class Q, class K, class V, bool Zz = false>
class RingAttentionBackward : detail::SavedAttention<Q, K, V> {
  using Base = detail::SavedAttention<Q, K, V>;
  using Plan = detail::RingPlan<Axis, Q, K, V>;
  using T = typename Q::value_type;
  using Base::k_, Base::lse_, Base::o_, Base::opt_, Base::q_, Base::v_;

public:
  RingAttentionBackward(Q q, K k, V v, Q o, Tensor<local::compute_t<T>, 3> lse, AttentionOptions opt)
      : Base(std::move(q), std::move(k), std::move(v), std::move(o), std::move(lse), opt) {}

  /// {dq, dk, dv} from dO (any placements; with Zz, Zigzag<Axis, .> in and out).
  template <class G>
  auto operator()(const G& g) const {
    if constexpr (Zz) {
      auto [dq, dk, dv] = run(g.tensor);
      return std::tuple<Zigzag<Axis, Q>, Zigzag<Axis, K>, Zigzag<Axis, V>>{
          {std::move(dq)}, {std::move(dk)}, {std::move(dv)}};
    } else {
      return run(g);
    }
  }

private:
  template <class G>
  std::tuple<Q, K, V> run(const G& g) const {
    const Q go = this->output_gradient(g, "ring attention");
    const Plan p(q_, k_, v_, opt_, Zz);
    const auto q4 = detail::as_rank4(q_.local());
    const auto o4 = detail::as_rank4(o_.local());
    const auto g4 = detail::as_rank4(go.local());
    Tensor<T, 4> k_cur = detail::as_rank4(k_.local()).contiguous();
    Tensor<T, 4> v_cur = detail::as_rank4(v_.local()).contiguous();
    Tensor<T, 4> dq = Tensor<T, 4>::zeros(q4.shape(), q4.device());
    // The dk/dv accumulator of chunk origin(t) arrives from the previous rank during step t (posted at the
    // end of step t - 1, so it moves while step t's kernel runs), takes this rank's part, and goes on; after
    // n passes each is home.
    Tensor<T, 4> dk_acc;
    Tensor<T, 4> dv_acc;
    std::vector<Work> grads_moving;
    std::vector<Tensor<T, 4>> grads_sent; // alive until their sends complete
    for (int t = 0; t < p.n; ++t) {
      const int j = p.origin(t);
      std::vector<Work> moving;
      Tensor<T, 4> k_next;
      Tensor<T, 4> v_next;
      if (t + 1 < p.n) { // the next chunk moves while this one computes
        k_next = p.template buffer<K>(p.gk, p.origin(t + 1));
        v_next = p.template buffer<V>(p.gv, p.origin(t + 1));
        moving = p.rotate({k_cur, v_cur}, {k_next, v_next});
        RingTrace::note("backward post", t);
      }
      const auto k_pos = p.positions(j);
      RingTrace::note("backward compute", t);
      auto [dq_t, dk_t, dv_t] =
          local::attention_backward(q4, k_cur, v_cur, o4, lse_, g4, p.params, p.coords(k_pos));
      local::map_into(dq, local::Add{}, dq, dq_t);
      RingTrace::note("backward wait", t);
      for (auto& w : grads_moving) {
        w.wait();
      }
      for (auto& w : moving) {
        w.wait();
      }
      if (t == 0) {
        dk_acc = dk_t;
        dv_acc = dv_t;
      } else {
        local::map_into(dk_t, local::Add{}, dk_t, dk_acc);
        local::map_into(dv_t, local::Add{}, dv_t, dv_acc);
        dk_acc = dk_t;
        dv_acc = dv_t;
      }
      if (p.n > 1) { // on to the next rank; received into fresh buffers (the sent ones stay untouched)
        Tensor<T, 4> dk_in = p.template buffer<K>(p.gk, p.origin(t + 1));
        Tensor<T, 4> dv_in = p.template buffer<V>(p.gv, p.origin(t + 1));
        grads_sent = {dk_acc, dv_acc};
        grads_moving = p.rotate(grads_sent, {dk_in, dv_in});
        RingTrace::note("backward post grads", t);
        dk_acc = dk_in;
        dv_acc = dv_in;
      }
      k_cur = k_next;
      v_cur = v_next;
    }
    RingTrace::note("backward wait grads", p.n - 1);
    for (auto& w : grads_moving) {
      w.wait();
    }
    return {Q(q_.mesh(), detail::from_rank4<Q::rank>(dq), q_.global_shape()),
            K(q_.mesh(), detail::from_rank4<Q::rank>(dk_acc), k_.global_shape()),
            V(q_.mesh(), detail::from_rank4<Q::rank>(dv_acc), v_.global_shape())};
  }
};

namespace detail {
template <fixed_string Axis>
struct attention_form<Ring<Axis>> {
  template <class Q, class K, class V, bool Zz = false>
  static auto run(const Q& q, const K& k, const V& v, const AttentionOptions& opt,
                  std::bool_constant<Zz> = {}) {
    using Plan = RingPlan<Axis, Q, K, V>;
    using T = typename Q::value_type;
    using Back = RingAttentionBackward<Axis, Q, K, V, Zz>;
    using Out = std::conditional_t<Zz, Zigzag<Axis, Q>, Q>;
    if constexpr (!Plan::rule_ok) {
      return WithBackward<Out, Back>{Out{q}, Back(q, k, v, q, {}, opt)}; // after the error: no second one
    } else {
      const Plan p(q, k, v, opt, Zz);
      const auto q4 = as_rank4(q.local());
      Tensor<T, 4> k_cur = as_rank4(k.local()).contiguous();
      Tensor<T, 4> v_cur = as_rank4(v.local()).contiguous();
      Tensor<T, 4> o;
      Tensor<local::compute_t<T>, 3> lse;
      for (int t = 0; t < p.n; ++t) {
        std::vector<Work> moving;
        Tensor<T, 4> k_next;
        Tensor<T, 4> v_next;
        if (t + 1 < p.n) { // posted before this step's kernel: the next chunk moves while this one computes
          k_next = p.template buffer<K>(p.gk, p.origin(t + 1));
          v_next = p.template buffer<V>(p.gv, p.origin(t + 1));
          moving = p.rotate({k_cur, v_cur}, {k_next, v_next});
          RingTrace::note("post", t);
        }
        const auto k_pos = p.positions(p.origin(t));
        RingTrace::note("compute", t);
        auto [o_t, lse_t] = local::attention_forward(q4, k_cur, v_cur, p.params, p.coords(k_pos));
        if (t == 0) {
          o = std::move(o_t);
          lse = std::move(lse_t);
        } else {
          merge_attention(o, lse, o_t, lse_t);
        }
        RingTrace::note("wait", t);
        for (auto& w : moving) {
          w.wait();
        }
        k_cur = k_next;
        v_cur = v_next;
      }
      auto go = q.global_shape();
      go[Q::rank - 1] = v.global_shape()[Q::rank - 1];
      Q out(q.mesh(), from_rank4<Q::rank>(o), go);
      Back back(q, k, v, out, std::move(lse), opt);
      return WithBackward<Out, Back>{Out{std::move(out)}, std::move(back)};
    }
  }
};

template <class Form, fixed_string Axis>
constexpr bool zigzag_form_ok() {
  static_assert(std::is_same_v<Form, Ring<Axis>>,
                "dtensor attention: q, k and v in the Zigzag layout over a mesh axis run as attention<Ring<"
                "that axis>> (the layout balances ring attention's causal work); for another form, "
                "unzigzag them first");
  return std::is_same_v<Form, Ring<Axis>>;
}

} // namespace detail

/// With the backward: `auto [o, back] = attention<Ulysses<"cp">>(q, k, v, opts, with_backward);
/// auto [dq, dk, dv] = back(d_o);` (dq, dk, dv in q's, k's and v's placements).
template <class Form, AnyDTensor Q, AnyDTensor K, AnyDTensor V>
auto attention(const Q& q, const K& k, const V& v, const AttentionOptions& o, WithBackwardTag) {
  return detail::attention_form<Form>::run(q, k, v, o);
}

/// Ring attention with load-balanced causal work: q, k and v in the zigzag layout over the ring's axis
/// (ops/zigzag.hpp); the output and, with the backward, dO and dq/dk/dv are Zigzag too.
template <class Form, fixed_string Axis, class Q, class K, class V>
auto attention(const Zigzag<Axis, Q>& q, const Zigzag<Axis, K>& k, const Zigzag<Axis, V>& v,
               const AttentionOptions& o, WithBackwardTag) {
  if constexpr (!detail::zigzag_form_ok<Form, Axis>()) {
    return q;
  } else {
    return detail::attention_form<Form>::run(q.tensor, k.tensor, v.tensor, o, std::true_type{});
  }
}
template <class Form, fixed_string Axis, class Q, class K, class V>
Zigzag<Axis, Q> attention(const Zigzag<Axis, Q>& q, const Zigzag<Axis, K>& k, const Zigzag<Axis, V>& v,
                          const AttentionOptions& o = {}) {
  if constexpr (!detail::zigzag_form_ok<Form, Axis>()) {
    return q;
  } else {
    return attention<Form>(q, k, v, o, with_backward).output;
  }
}

} // namespace dtensor

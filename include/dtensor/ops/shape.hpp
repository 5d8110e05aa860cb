#pragma once
// Dim shuffles and reshapes of DTensors: a Shard moves with its dim, and nothing communicates.
//
//   auto t = transpose<0, 1>(x);       // x [S(0), R] (m, n) -> t [S(1), R] (n, m)
//   auto p = permute<2, 0, 1>(x3);     // x3 [S(2)] (a, b, c) -> p [S(0)] (c, a, b)
//   auto f = flatten<0, 1>(x3);        // x3 [S(0)] (a, b, c) -> f [S(0)] (a*b, c)
//   auto u = unflatten<0>(f, std::array<std::int64_t, 2>{a, b});   // back to [S(0)] (a, b, c)
//   auto r = reshape<1>(y, {n});       // y without Shard: any shape of the same size
//   auto [t2, back] = transpose<0, 1>(x, with_backward);           // dx = back(dt), and so for each op
//
// flatten and unflatten keep a Shard where it survives: on the first dim of a merged group, or on the dim
// that is split (it becomes the first of the new dims). A Shard on another dim of a merged group does not
// compile (redistribute it to the group's first dim or to Replicate). Whether the blocks survive depends
// on the sizes (torch.chunk of the merged dim must cut where the rows' chunks do: the number of shards
// divides the sharded dim, or its chunks end where the merged dim's do): checked on every coordinate before
// anything changes, with an error that says which rank and sizes. permute copies the shard into contiguous
// memory; flatten, unflatten and reshape are views of it.

#include <array>
#include <cstdint>
#include <string>
#include <utility>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/checked_int.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/ops/check_memo.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {

template <std::size_t R>
constexpr bool is_permutation(const std::array<int, R>& p) {
  for (std::size_t i = 0; i < R; ++i) {
    if (p[i] < 0 || p[i] >= static_cast<int>(R)) {
      return false;
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (p[j] == p[i]) {
        return false;
      }
    }
  }
  return true;
}

template <std::size_t R>
constexpr std::array<int, R> inverse(const std::array<int, R>& p) {
  std::array<int, R> q{};
  for (std::size_t i = 0; i < R; ++i) {
    q[static_cast<std::size_t>(p[i])] = static_cast<int>(i);
  }
  return q;
}

/// Output dim i is input dim Perm[i]: the labels move with their dims.
template <auto Perm, class X>
struct PermuteOut {
  static constexpr RuleResult rule() {
    OpSpec s;
    s.in.push_back(trailing_labels(X::rank, X::rank));
    Labels out;
    for (int p : Perm) {
      out.push_back(static_cast<char>('a' + p));
    }
    s.out = out;
    s.linearity = Linearity::linear;
    return apply_rule(s, {X::placements});
  }
};
/// The output type of permute_dims<Perm> on X (naming it reports inputs the rule rejects).
template <auto Perm, class X>
using permute_result_t = rule_result_t<typename X::value_type, X::rank,
                                       typename dtensor_traits<X>::shape_type, &PermuteOut<Perm, X>::rule>;

template <auto Perm, class X>
auto permute_dims(const X& x) {
  static_assert(Perm.size() == static_cast<std::size_t>(X::rank) && is_permutation(Perm),
                "permute: the dims must be a permutation of 0 .. rank-1");
  using T = typename X::value_type;
  using Y = permute_result_t<Perm, X>;
  auto move = [](const auto& a) {
    auto b = a;
    for (int i = 0; i < X::rank; ++i) {
      b[i] = a[Perm[i]];
    }
    return b;
  };
  const auto& local = x.local();
  // A view of the shard with its dims permuted, copied into contiguous memory of its shape.
  const auto view =
      Tensor<T, X::rank>::from_blob(const_cast<T*>(local.data()), move(local.shape()), move(local.strides()),
                                    local.device(), local.stream_handle());
  auto out = empty_like(view.shape(), local);
  local::copy(out, view);
  return Y(x.mesh(), std::move(out), move(x.global_shape()));
}

template <int R, class... I>
constexpr std::array<int, R> dims_of(I... i) {
  std::array<int, R> p{static_cast<int>(i < 0 ? i + R : i)...};
  return p;
}

template <int R>
constexpr std::array<int, R> swapped(int d0, int d1) {
  std::array<int, R> p{};
  for (int i = 0; i < R; ++i) {
    p[i] = i == d0 ? d1 : i == d1 ? d0 : i;
  }
  return p;
}

/// Why a merge or split of dims cannot keep the placements.
enum class ReshapeError : std::uint8_t { none, merged_shard, shard_of_unsharded };

struct ReshapeRule {
  PlacementList out;
  ReshapeError error = ReshapeError::none;
};

/// The placements after merging dims [start, start + count) of a rank-`rank` tensor into one (merge) or
/// splitting dim `start` into `count` dims (split): a Shard of the group's first dim stays there, later
/// dims shift; a Shard of another merged dim has nowhere to go.
constexpr ReshapeRule regroup_rule(PlacementList in, int rank, int start, int count, bool merge) {
  ReshapeRule r;
  for (Placement p : in) {
    p = normalize(p, rank);
    if (p.is_shard()) {
      const int d = p.dim;
      if (merge && d > start && d < start + count) {
        r.error = ReshapeError::merged_shard;
        return r;
      }
      const int shift = merge ? -(count - 1) : count - 1;
      p = Placement::shard(d <= start ? d : d + shift);
    }
    r.out.push_back(p);
  }
  return r;
}

/// @post true: a failed check is its own static_assert (as check_rule).
template <ReshapeError E>
consteval bool check_reshape() {
  static_assert(E != ReshapeError::merged_shard,
                "flatten: a Shard on a merged dim other than the first cannot survive the merge (its chunks "
                "are not contiguous in the merged dim): redistribute it to Shard the group's first dim, or "
                "to Replicate, first");
  return true;
}

/// The placements after the regroup; where regroup_rule fails, after check_reshape reported why, Replicate
/// on every axis (a stand-in, as RuleOut's).
template <int Start, int Count, bool Merge, class X>
struct RegroupOut {
  static constexpr ReshapeRule rule() { return regroup_rule(X::placements, X::rank, Start, Count, Merge); }
  static constexpr bool checked = check_reshape<rule().error>();
  static constexpr PlacementList list() {
    return checked && rule().error == ReshapeError::none
               ? rule().out
               : PlacementList(X::placements.size(), Placement::replicate());
  }
};

/// Throws unless, on every coordinate, the block of the split layout (dims [start, start + count) of
/// `split_global` under `split`) is the block of the merged layout (`merged`) with those dims merged: then
/// every local shard is both, and the reshape is a view. `what` names the op for the message.
inline void check_regroup(const Extents& split_global, const ShardSpec& split, const ShardSpec& merged,
                          int start, int count, const MeshSizes& sizes, const std::string& what) {
  Extents merged_global;
  std::int64_t inner = 1;
  for (int d = 0; d < split_global.size(); ++d) {
    if (d > start && d < start + count) {
      inner *= split_global[d];
      merged_global[merged_global.size() - 1] *= split_global[d];
    } else {
      merged_global.push_back(split_global[d]);
    }
  }
  for (int r = 0; r < mesh_numel(sizes); ++r) {
    const MeshCoord c = rank_to_coord(r, sizes);
    const Block s = spec_block(split_global, split, sizes, c);
    const Block m = spec_block(merged_global, merged, sizes, c);
    const std::int64_t length = s.shape[start] * inner;
    const bool empty = length == 0 && m.shape[start] == 0;
    if (!empty && (m.shape[start] != length || m.offset[start] != s.offset[start] * inner)) {
      throw Error(
          what + ": the Shard of dim " + std::to_string(start) + " (size " +
          std::to_string(split_global[start]) + ") does not survive merging it with the " +
          std::to_string(count - 1) + " dims after it (" + std::to_string(inner) +
          " elements per row): rank " + std::to_string(r) + " of the mesh holds rows [" +
          std::to_string(s.offset[start]) + ", " + std::to_string(s.offset[start] + s.shape[start]) +
          ") = [" + std::to_string(s.offset[start] * inner) + ", " +
          std::to_string(s.offset[start] * inner + length) + ") of the merged dim of " +
          std::to_string(merged_global[start]) + ", whose chunk there is [" +
          std::to_string(m.offset[start]) + ", " + std::to_string(m.offset[start] + m.shape[start]) +
          "); make the sharded dim divisible by its number of shards, or redistribute<Replicate> first");
    }
  }
}

template <int Start, int End, class X>
auto flatten_dims(const X& x) {
  static_assert(Start >= 0 && Start <= End && End < X::rank, "flatten: need 0 <= Start <= End < rank");
  constexpr int count = End - Start + 1;
  constexpr int rank = X::rank - count + 1;
  using T = typename X::value_type;
  using Y = dtensor_from_t<T, rank, typename dtensor_traits<X>::shape_type,
                           &RegroupOut<Start, count, true, X>::list>;
  thread_local CheckMemo memo; // ops/check_memo.hpp: every rank walked once per sizes
  if (const std::string key = check_key(x.global_shape(), x.mesh().sizes()); !memo.passed(key)) {
    check_regroup(to_extents(x.global_shape()), X::spec, Y::spec, Start, count, x.mesh().sizes(),
                  "flatten<" + std::to_string(Start) + ", " + std::to_string(End) + ">");
    memo.pass(key);
  }
  auto merge = [](const auto& a) {
    std::array<std::int64_t, rank> b{};
    for (int d = 0; d < X::rank; ++d) {
      const int o = d <= Start ? d : d > End ? d - count + 1 : Start;
      b[o] = d > Start && d <= End ? b[o] * a[d] : a[d];
    }
    return b;
  };
  return Y(x.mesh(), x.local().template view<rank>(merge(x.local().shape())), merge(x.global_shape()));
}

template <int Dim, std::size_t K, class X>
auto unflatten_dim(const X& x, std::array<std::int64_t, K> sizes) {
  static_assert(K >= 1, "unflatten: give at least one size");
  static_assert(Dim >= 0 && Dim < X::rank, "unflatten: dim out of range");
  constexpr int count = static_cast<int>(K);
  constexpr int rank = X::rank + count - 1;
  using T = typename X::value_type;
  using Y = dtensor_from_t<T, rank, typename dtensor_traits<X>::shape_type,
                           &RegroupOut<Dim, count, false, X>::list>;
  const std::int64_t length = x.global_shape()[Dim];
  std::int64_t known = 1; // the product of the given non-zero sizes, then of all given sizes
  bool has_zero = false;
  bool fits = true;
  int infer = -1;
  for (int i = 0; i < count; ++i) {
    DTENSOR_CHECK(sizes[i] >= 0 || (sizes[i] == -1 && infer < 0),
                  "unflatten<" + std::to_string(Dim) + ">: sizes must be >= 0, with at most one -1");
    if (sizes[i] == -1) {
      infer = i;
    } else {
      has_zero = has_zero || sizes[i] == 0;
      fits = fits && (sizes[i] == 0 || ::dtensor::detail::checked_mul(known, sizes[i], known));
    }
  }
  DTENSOR_CHECK(fits, "unflatten<" + std::to_string(Dim) + ">: the sizes " +
                          ::dtensor::detail::format_list(sizes, ", ") + " multiply to more than int64 holds");
  known = has_zero ? 0 : known;
  if (infer >= 0) {
    DTENSOR_CHECK(known > 0 && length % known == 0, "unflatten<" + std::to_string(Dim) + ">: dim of size " +
                                                        std::to_string(length) + " does not split by " +
                                                        std::to_string(known));
    sizes[infer] = length / known;
    known = length;
  }
  DTENSOR_CHECK(known == length, "unflatten<" + std::to_string(Dim) + ">: the sizes multiply to " +
                                     std::to_string(known) + ", not the dim's " + std::to_string(length));
  std::array<std::int64_t, rank> global{};
  for (int d = 0, o = 0; d < X::rank; ++d) {
    if (d == Dim) {
      for (int i = 0; i < count; ++i) {
        global[o++] = sizes[i];
      }
    } else {
      global[o++] = x.global_shape()[d];
    }
  }
  thread_local CheckMemo memo; // ops/check_memo.hpp: every rank walked once per sizes
  if (const std::string key = check_key(global, x.mesh().sizes()); !memo.passed(key)) {
    check_regroup(to_extents(global), Y::spec, X::spec, Dim, count, x.mesh().sizes(),
                  "unflatten<" + std::to_string(Dim) + ">");
    memo.pass(key);
  }
  const Block mine = spec_block(to_extents(global), Y::spec, x.mesh().sizes(), x.mesh().coordinate());
  std::array<std::int64_t, rank> local{};
  for (int d = 0; d < rank; ++d) {
    local[d] = mine.shape[d];
  }
  return Y(x.mesh(), x.local().template view<rank>(local), global);
}

} // namespace detail

/// The backward of a permute: the inverse permute of the gradient (after bringing it to the output's
/// layout).
template <auto Perm, class X>
class PermuteBackward {
public:
  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using T = typename X::value_type;
    using Shape = typename dtensor_traits<X>::shape_type;
    using Y = permute_result_t<Perm, X>;
    using Target = dtensor_from_t<T, X::rank, Shape, &GradTarget<Y, G>::list>;
    return as_gradient_of<X>(permute_dims<inverse(Perm)>(redistribute_as<Target, G>::run(g)));
  }
};

/// x with its dims reordered: output dim i is x's dim Dims[i] (negative dims count from the end).
template <int... Dims, AnyDTensor X>
auto permute(const X& x) {
  return detail::permute_dims<detail::dims_of<X::rank>(Dims...)>(x);
}
template <int... Dims, AnyDTensor X>
auto permute(const X& x, WithBackwardTag) {
  constexpr auto perm = detail::dims_of<X::rank>(Dims...);
  auto y = detail::permute_dims<perm>(x);
  return WithBackward<decltype(y), PermuteBackward<perm, X>>{std::move(y), {}};
}

/// x with dims D0 and D1 swapped (negative dims count from the end).
template <int D0, int D1, AnyDTensor X>
auto transpose(const X& x) {
  return detail::permute_dims<detail::swapped<X::rank>(D0 < 0 ? D0 + X::rank : D0,
                                                       D1 < 0 ? D1 + X::rank : D1)>(x);
}
template <int D0, int D1, AnyDTensor X>
auto transpose(const X& x, WithBackwardTag) {
  constexpr auto perm = detail::swapped<X::rank>(D0 < 0 ? D0 + X::rank : D0, D1 < 0 ? D1 + X::rank : D1);
  auto y = detail::permute_dims<perm>(x);
  return WithBackward<decltype(y), PermuteBackward<perm, X>>{std::move(y), {}};
}

/// The backward of flatten<Start, End>: the gradient split back to x's sizes.
template <int Start, int End, class X>
class FlattenBackward {
public:
  explicit FlattenBackward(typename X::shape_type global) : global_(global) {}

  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using T = typename X::value_type;
    using Shape = typename dtensor_traits<X>::shape_type;
    using Y = dtensor_from_t<T, G::rank, Shape, &RegroupOut<Start, End - Start + 1, true, X>::list>;
    using Target = dtensor_from_t<T, G::rank, Shape, &GradTarget<Y, G>::list>;
    std::array<std::int64_t, End - Start + 1> sizes{};
    for (int d = Start; d <= End; ++d) {
      sizes[d - Start] = global_[d];
    }
    return as_gradient_of<X>(unflatten_dim<Start>(redistribute_as<Target, G>::run(g), sizes));
  }

private:
  typename X::shape_type global_;
};

/// The backward of unflatten<Dim> into K dims: the gradient merged back.
template <int Dim, int K, class X>
class UnflattenBackward {
public:
  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using T = typename X::value_type;
    using Shape = typename dtensor_traits<X>::shape_type;
    using Y = dtensor_from_t<T, G::rank, Shape, &RegroupOut<Dim, K, false, X>::list>;
    using Target = dtensor_from_t<T, G::rank, Shape, &GradTarget<Y, G>::list>;
    return as_gradient_of<X>(flatten_dims<Dim, Dim + K - 1>(redistribute_as<Target, G>::run(g)));
  }
};

/// Dims Start..End of x merged into one (torch.flatten(x, Start, End)); a view of the shard.
template <int Start, int End, AnyDTensor X>
auto flatten(const X& x) {
  return detail::flatten_dims < Start < 0 ? Start + X::rank : Start, End < 0 ? End + X::rank : End > (x);
}
template <int Start, int End, AnyDTensor X>
auto flatten(const X& x, WithBackwardTag) {
  constexpr int s = Start < 0 ? Start + X::rank : Start;
  constexpr int e = End < 0 ? End + X::rank : End;
  auto y = detail::flatten_dims<s, e>(x);
  return WithBackward<decltype(y), FlattenBackward<s, e, X>>{std::move(y),
                                                             FlattenBackward<s, e, X>(x.global_shape())};
}

/// Dim Dim of x split into `sizes` (one may be -1: inferred), torch.unflatten; a view of the shard.
template <int Dim, AnyDTensor X, std::size_t K>
auto unflatten(const X& x, const std::array<std::int64_t, K>& sizes) {
  return detail::unflatten_dim < Dim < 0 ? Dim + X::rank : Dim > (x, sizes);
}
template <int Dim, AnyDTensor X, std::size_t K>
auto unflatten(const X& x, const std::array<std::int64_t, K>& sizes, WithBackwardTag) {
  constexpr int d = Dim < 0 ? Dim + X::rank : Dim;
  auto y = detail::unflatten_dim<d>(x, sizes);
  return WithBackward<decltype(y), UnflattenBackward<d, static_cast<int>(K), X>>{std::move(y), {}};
}

namespace detail {

constexpr bool any_shard(const PlacementList& l) {
  for (Placement p : l) {
    if (p.is_shard()) {
      return true;
    }
  }
  return false;
}

template <class X>
struct SamePlacements {
  static constexpr PlacementList list() { return X::placements; }
};

template <int NewRank, class X>
auto reshape_unsharded(const X& x, const std::array<std::int64_t, NewRank>& shape) {
  static_assert(
      !any_shard(X::placements),
      "reshape: the DTensor shards a dim; use flatten / unflatten (a Shard survives on the first dim "
      "of a merged group or on a split dim), or redistribute<Replicate> first");
  using Y = dtensor_from_t<typename X::value_type, NewRank, typename dtensor_traits<X>::shape_type,
                           &SamePlacements<X>::list>;
  return Y(x.mesh(), x.local().template reshape<NewRank>(shape), shape);
}

} // namespace detail

/// The backward of reshape: the gradient in x's shape.
template <class X>
class ReshapeBackward {
public:
  explicit ReshapeBackward(typename X::shape_type global) : global_(global) {}

  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using T = typename X::value_type;
    using Shape = typename dtensor_traits<X>::shape_type;
    using Y = dtensor_from_t<T, G::rank, Shape, &SamePlacements<X>::list>;
    using Target = dtensor_from_t<T, G::rank, Shape, &GradTarget<Y, G>::list>;
    return as_gradient_of<X>(reshape_unsharded<X::rank>(redistribute_as<Target, G>::run(g), global_));
  }

private:
  typename X::shape_type global_;
};

/// x in a new shape of the same size (torch.reshape), for a DTensor that shards no dim (Replicate or
/// Partial on every axis: its local tensor is the whole shape). A sharded one: flatten / unflatten keep
/// the Shard.
template <int NewRank, AnyDTensor X>
auto reshape(const X& x, const std::array<std::int64_t, NewRank>& shape) {
  return detail::reshape_unsharded<NewRank>(x, shape);
}
template <int NewRank, AnyDTensor X>
auto reshape(const X& x, const std::array<std::int64_t, NewRank>& shape, WithBackwardTag) {
  auto y = detail::reshape_unsharded<NewRank>(x, shape);
  return WithBackward<decltype(y), ReshapeBackward<X>>{std::move(y), ReshapeBackward<X>(x.global_shape())};
}

} // namespace dtensor

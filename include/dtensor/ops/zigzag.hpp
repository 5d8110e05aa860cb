#pragma once
// The zigzag (head-tail) sequence layout of causal context parallelism, as a type.
//
// With the causal mask, the queries at the end of a sequence see every key and those at its start see
// few, so ring attention over contiguous sequence chunks leaves the last rank of the axis most of the work.
// In the zigzag layout the rank at position i of n on the axis holds two pieces of the sequence: one from
// the front (piece i) and one from the back (piece 2n - 1 - i), so every rank gets the same causal work.
//
//   Zigzag<"cp", X> z = zigzag<"cp", 1>(x);  // x (batch, seq, hidden) Shard<1> or Replicate on "cp"
//   auto q = Zigzag<"cp", Q>{...};            // what a layer computes per token keeps the layout
//   auto o = attention<Ring<"cp">>(q, k, v, {.causal = true});  // Zigzag in, Zigzag out: balanced
//   X back = unzigzag(z);                      // natural order again (one all_to_all_single)
//
// `Zigzag<Axis, X>` holds a DTensor X sharded on the sequence dim over mesh axis Axis whose rows are in
// zigzag order: X's local block is the rank's torch.chunk share of the sequence (m rows), and those rows are
// the natural positions zigzag_positions(seq, n, i) gives: ceil(m / 2) from the front (ranks in order)
// then floor(m / 2) from the back (ranks in reverse order). When 2n divides the sequence these are exactly
// chunks i and 2n - 1 - i of 2n; uneven lengths keep torch.chunk's shard sizes, so X is an ordinary DTensor
// of its type. The layout is in the type, not a convention: what depends on positions (ring attention's
// causal mask, rotary_embedding) takes a Zigzag and reads the positions from it; per-token operations
// work on `.tensor` and wrap their result again (`Zigzag<"cp", Y>{y}`), which is the user saying "same
// rows".

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/comm/collectives.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

/// The two runs of natural positions the rank at position `i` of `n` holds in the zigzag layout of a
/// sequence of `len`: [front, front + front_len) then [back, back + back_len).
struct ZigzagRuns {
  std::int64_t front, front_len, back, back_len;
};

/// See the top of the file. @pre len >= 0, 0 <= i < n.
constexpr ZigzagRuns zigzag_runs(std::int64_t len, int n, int i) noexcept {
  std::int64_t front = 0;
  std::int64_t back = len;
  for (int r = 0;; ++r) {
    const std::int64_t m = chunk_size(len, n, r);
    back -= m / 2;
    if (r == i) {
      return {front, m - m / 2, back, m / 2};
    }
    front += m - m / 2;
  }
}

/// The natural positions of the rank at `i` of `n`, in the order it holds them (ascending).
inline std::vector<std::int64_t> zigzag_positions(std::int64_t len, int n, int i) {
  const ZigzagRuns z = zigzag_runs(len, n, i);
  std::vector<std::int64_t> p;
  p.reserve(static_cast<std::size_t>(z.front_len + z.back_len));
  for (std::int64_t k = 0; k < z.front_len; ++k) {
    p.push_back(z.front + k);
  }
  for (std::int64_t k = 0; k < z.back_len; ++k) {
    p.push_back(z.back + k);
  }
  return p;
}

namespace detail {

/// The mesh axis named Axis in X's mesh and the tensor dim X shards over it (the sequence dim).
template <fixed_string Axis, class X>
struct ZigzagAxis {
  using Shape = typename dtensor_traits<X>::shape_type;
  static constexpr int axis = Shape::template index_of<Axis>();
  static constexpr Placement p = normalize(X::placements[axis], X::rank);
  static constexpr int seq_dim = p.is_shard() ? p.dim : 0;
  static constexpr bool alone = [] {
    for (int a = 0; a < X::placements.size(); ++a) {
      if (a != axis && normalize(X::placements[a], X::rank) == p) {
        return false;
      }
    }
    return true;
  }();
  static constexpr bool ok = [] {
    static_assert(p.is_shard(),
                  "dtensor Zigzag<axis, X>: X must be sharded on the sequence dim over that mesh axis");
    static_assert(alone,
                  "dtensor Zigzag<axis, X>: the sequence dim must be sharded over that mesh axis only");
    return p.is_shard() && alone;
  }();
};

} // namespace detail

/// A DTensor whose sequence dim, sharded over mesh axis Axis, is in zigzag order (see the top of the file).
template <fixed_string Axis, AnyDTensor X>
requires(detail::ZigzagAxis<Axis, X>::ok) struct Zigzag {
  using tensor_type = X;
  static constexpr int axis = detail::ZigzagAxis<Axis, X>::axis;
  static constexpr int seq_dim = detail::ZigzagAxis<Axis, X>::seq_dim;

  X tensor;

  /// The natural positions of this rank's rows along the sequence dim, in local order.
  std::vector<std::int64_t> positions() const {
    return zigzag_positions(tensor.global_shape()[seq_dim], tensor.mesh().size(axis),
                            tensor.mesh().coordinate()[axis]);
  }
};

namespace detail {

/// The natural positions each rank of an axis of n holds: torch.chunk's blocks, or the zigzag layout.
inline std::vector<std::int64_t> sequence_positions(bool zigzag, std::int64_t len, int n, int i) {
  if (zigzag) {
    return zigzag_positions(len, n, i);
  }
  std::vector<std::int64_t> p(static_cast<std::size_t>(chunk_size(len, n, i)));
  for (std::size_t k = 0; k < p.size(); ++k) {
    p[k] = chunk_offset(len, n, i) + static_cast<std::int64_t>(k);
  }
  return p;
}

/// A shape as (the product of the dims before `dim`, dim `dim`, the product of those after it).
template <class Shape>
std::array<std::int64_t, 3> around_dim(const Shape& shape, int dim) {
  std::array<std::int64_t, 3> r{1, shape[static_cast<std::size_t>(dim)], 1};
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    r[d < dim ? 0 : 2] *= d == dim ? 1 : shape[static_cast<std::size_t>(d)];
  }
  return r;
}

/// The rows of `t` (dim `dim`) at local indices `rows`, as a (rows, outer, inner) tensor: row-major pieces
/// of the dims before and after `dim`.
template <class T, int R>
Tensor<T, 3> pack_rows(const Tensor<T, R>& t, int dim, const std::vector<std::int64_t>& rows) {
  const auto c = t.contiguous();
  const auto [outer, len, inner] = around_dim(c.shape(), dim);
  Tensor<T, 3> out({static_cast<std::int64_t>(rows.size()), outer, inner}, c.device());
  for (std::size_t j = 0; j < rows.size() && !c.device().is_meta(); ++j) {
    for (std::int64_t o = 0; o < outer; ++o) {
      const T* src = c.data() + (o * len + rows[j]) * inner;
      std::copy(src, src + inner, out.data() + (static_cast<std::int64_t>(j) * outer + o) * inner);
    }
  }
  return out;
}

/// The rows of `t` at local indices `rows` along `dim`, in that order, as a tensor of t's rank (one copy).
template <class T, int R>
Tensor<T, R> take_rows(const Tensor<T, R>& t, int dim, const std::vector<std::int64_t>& rows) {
  const auto c = t.contiguous();
  const auto [outer, len, inner] = around_dim(c.shape(), dim);
  const auto m = static_cast<std::int64_t>(rows.size());
  auto shape = c.shape();
  shape[dim] = m;
  Tensor<T, R> out(shape, c.device());
  for (std::int64_t o = 0; o < outer && !c.device().is_meta(); ++o) {
    for (std::int64_t j = 0; j < m; ++j) {
      const T* src = c.data() + (o * len + rows[static_cast<std::size_t>(j)]) * inner;
      std::copy(src, src + inner, out.data() + (o * m + j) * inner);
    }
  }
  return out;
}

/// The inverse of pack_rows: row j of `packed` to local index rows[j] of `out` (contiguous) along `dim`.
template <class T, int R>
void unpack_rows(const Tensor<T, R>& out, int dim, const Tensor<T, 3>& packed,
                 const std::vector<std::int64_t>& rows) {
  const std::int64_t outer = packed.shape()[1];
  const std::int64_t inner = packed.shape()[2];
  const std::int64_t len = out.shape()[dim];
  for (std::size_t j = 0; j < rows.size() && !out.device().is_meta(); ++j) {
    for (std::int64_t o = 0; o < outer; ++o) {
      const T* src = packed.data() + (static_cast<std::int64_t>(j) * outer + o) * inner;
      std::copy(src, src + inner, out.data() + (o * len + rows[j]) * inner);
    }
  }
}

/// The local indices in `have` (ascending positions) of the positions both `have` and `want` hold.
inline std::vector<std::int64_t> common_rows(const std::vector<std::int64_t>& have,
                                             const std::vector<std::int64_t>& want) {
  std::vector<std::int64_t> rows;
  std::size_t i = 0;
  std::size_t j = 0;
  while (i < have.size() && j < want.size()) {
    if (have[i] < want[j]) {
      ++i;
    } else if (want[j] < have[i]) {
      ++j;
    } else {
      rows.push_back(static_cast<std::int64_t>(i++));
      ++j;
    }
  }
  return rows;
}

/// The local tensor of a rank holding the sequence positions `layout(me)` (dim `dim`, sharded over the
/// axis of `group`), rearranged to hold `target(me)`: one all_to_all_single with split sizes, each row sent
/// once (the bytes a rank sends are the rows it holds that another rank wants: the lower bound).
template <class T, int R, class Layout, class Target>
Tensor<T, R> resequence(const Tensor<T, R>& t, int dim, const ProcessGroup& group, int me, int n,
                        Layout layout, Target target) {
  const std::vector<std::int64_t> have = layout(me);
  const std::vector<std::int64_t> want = target(me);
  DTENSOR_CHECK(static_cast<std::int64_t>(have.size()) == t.shape()[dim],
                "zigzag: rank " + std::to_string(me) + " holds " + std::to_string(t.shape()[dim]) +
                    " rows of the sequence where its layout places " + std::to_string(have.size()));
  auto shape = t.shape();
  shape[dim] = static_cast<std::int64_t>(want.size());
  Tensor<T, R> out(shape, t.device());
  std::vector<std::int64_t> send_rows;
  std::vector<std::int64_t> send_split(static_cast<std::size_t>(n));
  std::vector<std::int64_t> recv_split(static_cast<std::size_t>(n));
  std::vector<std::int64_t> recv_at; // where each received row goes, in the order they arrive
  for (int r = 0; r < n; ++r) {
    const std::vector<std::int64_t> to_r = common_rows(have, target(r));
    send_split[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(to_r.size());
    send_rows.insert(send_rows.end(), to_r.begin(), to_r.end());
    const std::vector<std::int64_t> from_r = common_rows(want, layout(r));
    recv_split[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(from_r.size());
    recv_at.insert(recv_at.end(), from_r.begin(), from_r.end());
  }
  const Tensor<T, 3> sent = pack_rows(t, dim, send_rows);
  if (n == 1) {
    unpack_rows(out, dim, sent, recv_at);
    return out;
  }
  Tensor<T, 3> received({static_cast<std::int64_t>(recv_at.size()), sent.shape()[1], sent.shape()[2]},
                        sent.device());
  all_to_all_single(received, sent, recv_split, send_split, group);
  unpack_rows(out, dim, received, recv_at);
  return out;
}

template <fixed_string Axis, class X>
X resequence_as(const X& x, bool from_zigzag, bool to_zigzag) {
  using A = ZigzagAxis<Axis, X>;
  const std::int64_t len = x.global_shape()[A::seq_dim];
  const int n = x.mesh().size(A::axis);
  const auto layout = [&](int r) { return sequence_positions(from_zigzag, len, n, r); };
  const auto target = [&](int r) { return sequence_positions(to_zigzag, len, n, r); };
  return X(x.mesh(),
           resequence(x.local(), A::seq_dim, x.mesh().group(A::axis), x.mesh().coordinate()[A::axis], n,
                      layout, target),
           x.global_shape());
}

} // namespace detail

/// x in the zigzag layout over mesh axis Axis, its sequence dim SeqDim: from Shard<SeqDim> on Axis (natural
/// order: one all_to_all_single moving the rows each rank gives up) or from Replicate on Axis (each rank
/// keeps its rows: no communication).
template <fixed_string Axis, int SeqDim, AnyDTensor X>
auto zigzag(const X& x) {
  using Shape = typename detail::dtensor_traits<X>::shape_type;
  constexpr int a = Shape::template index_of<Axis>();
  constexpr int seq = SeqDim < 0 ? SeqDim + X::rank : SeqDim;
  constexpr Placement p = normalize(X::placements[a], X::rank);
  static_assert(p.is_replicate() || p == Placement::shard(seq),
                "dtensor zigzag<axis, seq_dim>(x): x must be Shard<seq_dim> (natural order) or Replicate on "
                "that mesh axis");
  using Y = detail::with_axis_shard_t<X, a, seq>;
  if constexpr (p.is_replicate()) {
    const auto& t = x.local();
    DTENSOR_CHECK(t.shape()[seq] == x.global_shape()[seq],
                  "zigzag: the sequence dim of x is sharded over another mesh axis");
    const std::vector<std::int64_t> rows =
        zigzag_positions(x.global_shape()[seq], x.mesh().size(a), x.mesh().coordinate()[a]);
    return Zigzag<Axis, Y>{Y(x.mesh(), detail::take_rows(t, seq, rows), x.global_shape())};
  } else {
    return Zigzag<Axis, Y>{detail::resequence_as<Axis>(x, false, true)};
  }
}

/// z's tensor in natural order (one all_to_all_single over the axis).
template <fixed_string Axis, class X>
X unzigzag(const Zigzag<Axis, X>& z) {
  return detail::resequence_as<Axis>(z.tensor, true, false);
}

} // namespace dtensor

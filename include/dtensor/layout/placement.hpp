#pragma once
// Placements: how a tensor dimension relates to one mesh axis.
//
//   Shard<D>        the tensor is split along dim D over the axis (torch.chunk sizes); Shard<-1> = last dim
//   Replicate       every coordinate of the axis holds the same data
//   Partial<Op>     every coordinate holds a partial value; the global value is their reduction by Op
//
// The types are thin names for `Placement` values; all logic (validation, layout, planning) works on the
// values so that one constexpr implementation serves compile time and run time.

#include <cstdint>
#include <string>

#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/static_vector.hpp"

namespace dtensor {

/// A placement as a value: what `Shard<D>`, `Replicate` and `Partial<Op>` stand for.
struct Placement {
  enum class Kind : std::uint8_t { replicate, shard, partial };

  Kind kind = Kind::replicate;
  int dim = 0;                 ///< shard: the tensor dim as written (may be negative: counts from the end)
  ReduceOp op = ReduceOp::sum; ///< partial: the pending reduction

  static constexpr Placement replicate() noexcept { return {}; }
  static constexpr Placement shard(int d) noexcept { return {Kind::shard, d, ReduceOp::sum}; }
  static constexpr Placement partial(ReduceOp o = ReduceOp::sum) noexcept { return {Kind::partial, 0, o}; }

  constexpr bool is_replicate() const noexcept { return kind == Kind::replicate; }
  constexpr bool is_shard() const noexcept { return kind == Kind::shard; }
  constexpr bool is_shard(int d) const noexcept { return kind == Kind::shard && dim == d; }
  constexpr bool is_partial() const noexcept { return kind == Kind::partial; }

  friend constexpr bool operator==(const Placement& a, const Placement& b) noexcept {
    if (a.kind != b.kind) {
      return false;
    }
    return a.kind == Kind::replicate || (a.kind == Kind::shard ? a.dim == b.dim : a.op == b.op);
  }
};

/// Whether the rank at coordinate `coord` along an axis with placement `p` holds the value itself: a
/// Partial<sum> / Partial<product> / Partial<bxor> value made from a replicated one lives on coordinate 0
/// and the others hold the op's identity (0 / 1 / 0), which keeps it exact; every other placement holds it
/// everywhere (Partial<avg/max/min/band/bor> hold the value on every coordinate: reducing v with itself
/// gives v).
constexpr bool holds_value(Placement p, int coord) noexcept {
  return !(p.is_partial() && (p.op == ReduceOp::sum || p.op == ReduceOp::product || p.op == ReduceOp::bxor) &&
           coord != 0);
}

/// The placement list of a DTensor: one Placement per mesh axis, in mesh-axis order.
using PlacementList = StaticVector<Placement, max_mesh_rank>;

/// Shard<D>: split tensor dim D over the mesh axis. Negative D counts from the end (Shard<-1> = last).
template <int D>
struct Shard {
  static constexpr int dim = D;
  static constexpr Placement value = Placement::shard(D);
};

/// Replicate: every coordinate along the mesh axis holds the whole (sub)tensor.
struct Replicate {
  static constexpr Placement value = Placement::replicate();
};

/// Partial<Op>: every coordinate holds a partial value; the global tensor is their reduction by Op.
template <ReduceOp Op = ReduceOp::sum>
struct Partial {
  static constexpr ReduceOp op = Op;
  static constexpr Placement value = Placement::partial(Op);
};

namespace detail {
template <class P>
inline constexpr bool is_placement_type = false;
template <int D>
inline constexpr bool is_placement_type<Shard<D>> = true;
template <>
inline constexpr bool is_placement_type<Replicate> = true;
template <ReduceOp Op>
inline constexpr bool is_placement_type<Partial<Op>> = true;
} // namespace detail

/// Shard<D>, Replicate or Partial<Op>.
template <class P>
concept PlacementType = detail::is_placement_type<P>;

/// The placement values of a typed placement list.
template <PlacementType... P>
inline constexpr PlacementList placement_list_v = PlacementList{P::value...};

/// Shard dims made non-negative for a tensor of `tensor_rank` dims (out-of-range dims are kept as is;
/// `check_placements` reports them).
constexpr Placement normalize(Placement p, int tensor_rank) noexcept {
  if (p.is_shard() && p.dim < 0) {
    p.dim += tensor_rank;
  }
  return p;
}

constexpr PlacementList normalize(PlacementList list, int tensor_rank) noexcept {
  for (Placement& p : list) {
    p = normalize(p, tensor_rank);
  }
  return list;
}

/// What is wrong with a placement list, if anything (see check_placements).
enum class PlacementError : std::uint8_t {
  none,
  count_mismatch,         ///< not exactly one placement per mesh axis
  shard_dim_out_of_range, ///< a Shard dim outside [-tensor_rank, tensor_rank)
  mixed_partial_ops,      ///< Partial ops other than {sum, avg} mixed across axes
};

/// Validates `list` for a mesh of `mesh_rank` axes and a tensor of `tensor_rank` dims.
constexpr PlacementError check_placements(const PlacementList& list, int mesh_rank,
                                          int tensor_rank) noexcept {
  if (list.size() != mesh_rank) {
    return PlacementError::count_mismatch;
  }
  bool has_partial = false;
  ReduceOp first_op = ReduceOp::sum;
  for (const Placement& p : list) {
    if (p.is_shard() && (p.dim < -tensor_rank || p.dim >= tensor_rank)) {
      return PlacementError::shard_dim_out_of_range;
    }
    if (p.is_partial()) {
      if (!has_partial) {
        has_partial = true;
        first_op = p.op;
      } else if (p.op != first_op) {
        const bool sum_avg = (p.op == ReduceOp::sum || p.op == ReduceOp::avg) &&
                             (first_op == ReduceOp::sum || first_op == ReduceOp::avg);
        if (!sum_avg) {
          return PlacementError::mixed_partial_ops;
        }
      }
    }
  }
  return PlacementError::none;
}

/// "S(0)", "R", "P(sum)".
inline std::string to_string(const Placement& p) {
  switch (p.kind) {
  case Placement::Kind::replicate:
    return "R";
  case Placement::Kind::shard:
    return "S(" + std::to_string(p.dim) + ")";
  case Placement::Kind::partial:
    return "P(" + std::string(to_string(p.op)) + ")";
  }
  return "?";
}

/// "[S(0),R]".
inline std::string to_string(const PlacementList& list) {
  std::string s = "[";
  for (int i = 0; i < list.size(); ++i) {
    if (i > 0) {
      s += ',';
    }
    s += to_string(list[i]);
  }
  return s + "]";
}

} // namespace dtensor

#pragma once
// Sharding rules: the output placements of an op, decided at compile time from its inputs' placements.
//
// One engine, written once, as constexpr code over values. An op is described like an einsum: a label per
// dim of each operand and of the output (matmul: "mk", "kn" -> "mn"; a reduction over dim 1 of a 3-D
// tensor: "abc" -> "ac"), and how it treats a Partial operand (its Linearity). Every mesh axis is decided
// on its own:
//
//   all operands Replicate                               -> Replicate
//   Shard on a kept label (in the output), the others     -> Shard<that label's output dim>
//     Shard on the same label or Replicate                  (a Replicate operand that has the label uses
//                                                           its local chunk: no communication)
//   Shard on a contracted label (not in the output) in    -> Partial<sum> (a matmul's k) or Partial<op>
//     every operand that has it                            (a reduction by op over a sharded dim)
//   Partial<sum/avg> where the op is linear in it:
//     linear (scale, transpose, sum, mean)                -> the same Partial
//     additive (add, sub): every operand Partial, one op  -> that Partial
//     multiplicative (mul, matmul): one Partial, the     -> that Partial
//     others Replicate
//     quotient (div): a Partial numerator, Replicate     -> that Partial
//     divisor
//   anything else                                         -> an error naming what to redistribute
//
// so P + P -> P, P * R -> P, but P + R, P * P, relu(P), x + scalar with x Partial do not compile: each would
// silently count a term n times or mix the partial values nonlinearly (pytorch#163193). The output DTensor
// type of every op in ops/ comes from apply_rule; tests/ops/test_rules.cpp pins the tables.

#include <cstdint>
#include <string_view>

#include "dtensor/core/static_vector.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"

namespace dtensor {

/// How an op treats a Partial operand (see the top of this file).
enum class Linearity : std::uint8_t {
  nonlinear,      ///< relu, gelu, silu, exp, x + scalar, max/min reductions: no Partial input
  linear,         ///< scale, neg, transpose, view, sum, mean: Partial in, the same Partial out
  additive,       ///< add, sub: every operand Partial with one op, or none
  multiplicative, ///< mul, matmul: at most one Partial operand, the others Replicate
  quotient,       ///< div: the numerator (operand 0) may be Partial over a Replicate divisor
};

/// Why an op cannot run on its inputs' placements.
enum class RuleError : std::uint8_t {
  none,
  different_dims,      ///< two operands Shard different dims along one mesh axis
  contracted_mismatch, ///< a contracted dim is Shard in one operand and not in another
  partial_nonlinear,   ///< a Partial input to an op that is not linear in it
  partial_plus_other,  ///< Partial + Replicate (or Shard): the other term would count n times
  partial_product,     ///< Partial * Partial
  partial_and_shard,   ///< a Partial operand where another is Shard on the same axis
  partial_op,          ///< a Partial<max/min/product> input to anything but nonlinear-free identity ops
  partial_ops_differ,  ///< Partial<sum> + Partial<avg>
  partial_divisor,     ///< dividing by a Partial
  shard_axes,          ///< one dim sharded over mesh axes that are not a leading part of the output's
  shape,               ///< the labels do not describe the operands (an internal error of the op)
};

/// The sentence for an error (the ops' static_asserts say the same, with the op's name).
constexpr std::string_view to_string(RuleError e) noexcept {
  switch (e) {
  case RuleError::none:
    return "";
  case RuleError::different_dims:
    return "the operands are sharded on different dims along one mesh axis: redistribute one so both shard "
           "the same dim, or to Replicate";
  case RuleError::contracted_mismatch:
    return "a contracted dim is sharded in one operand but not in the other: redistribute the other to "
           "Shard that dim too, or this one to Replicate";
  case RuleError::partial_nonlinear:
    return "a Partial input to a nonlinear op: redistribute<Replicate> it first";
  case RuleError::partial_plus_other:
    return "Partial + a non-Partial term would add that term once per rank: redistribute<Replicate> the "
           "Partial operand first";
  case RuleError::partial_product:
    return "Partial * Partial is not Partial: redistribute<Replicate> one factor first";
  case RuleError::partial_and_shard:
    return "one operand is Partial and another Shard along the same mesh axis: redistribute<Replicate> the "
           "Partial one first";
  case RuleError::partial_op:
    return "a Partial<max/min/product> input: only Partial<sum/avg> pass through ops; "
           "redistribute<Replicate> "
           "it first";
  case RuleError::partial_ops_differ:
    return "Partial operands with different ops (sum and avg): redistribute one first";
  case RuleError::partial_divisor:
    return "dividing by a Partial: redistribute<Replicate> the divisor first";
  case RuleError::shard_axes:
    return "an operand shards a dim over mesh axes that are not the first of the axes the other operands "
           "shard it over: redistribute it to match them, or to Replicate";
  case RuleError::shape:
    return "the op's dim labels do not match its operands";
  }
  return "?";
}

inline constexpr int max_operands = 3;

/// Dim labels of one operand or of the output: one char per dim, outermost first ("bmk").
using Labels = StaticVector<char, max_tensor_rank>;

/// An op as its rule sees it.
struct OpSpec {
  StaticVector<Labels, max_operands> in;
  Labels out;
  Linearity linearity = Linearity::nonlinear;
  /// The Partial a Shard on a contracted label becomes (sum for a matmul; the op of a reduction).
  ReduceOp contract = ReduceOp::sum;
};

/// The output placements, or why there are none (`error`, on mesh axis `axis`).
struct RuleResult {
  PlacementList out;
  RuleError error = RuleError::none;
  int axis = -1;

  constexpr bool ok() const noexcept { return error == RuleError::none; }
};

/// Labels from a string literal: labels("mk").
constexpr Labels labels(std::string_view s) noexcept {
  Labels l;
  for (char c : s) {
    l.push_back(c);
  }
  return l;
}

/// "abcdefgh" cut to `rank` labels, the last `rank` of a tensor of `of` dims (for rank broadcasting).
constexpr Labels trailing_labels(int rank, int of) {
  Labels l;
  for (int d = of - rank; d < of; ++d) {
    l.push_back(static_cast<char>('a' + d));
  }
  return l;
}

/// "abc.." for `rank` dims without the label of `dim`: a reduction's output, a reduced gradient's dims.
constexpr Labels labels_without(int rank, int dim) {
  Labels l;
  for (int d = 0; d < rank; ++d) {
    if (d != dim) {
      l.push_back(static_cast<char>('a' + d));
    }
  }
  return l;
}

/// Position of `c` in `l`, or -1.
constexpr int find_label(const Labels& l, char c) noexcept {
  for (int i = 0; i < l.size(); ++i) {
    if (l[i] == c) {
      return i;
    }
  }
  return -1;
}

/// The rule of `spec` for operands with placements `in` (one list per operand, one placement per mesh axis).
constexpr RuleResult apply_rule(const OpSpec& spec, const StaticVector<PlacementList, max_operands>& in) {
  RuleResult r;
  if (in.size() != spec.in.size() || in.empty()) {
    r.error = RuleError::shape;
    return r;
  }
  const int axes = in[0].size();
  for (int a = 0; a < axes; ++a) {
    // What this axis does: the label it shards (or 0), how many operands are Partial and with which op.
    char kept = 0;
    char contracted = 0;
    int partials = 0;
    int shards = 0;
    ReduceOp pop = ReduceOp::sum;
    auto fail = [&](RuleError e) {
      r.error = e;
      r.axis = a;
      return r;
    };
    for (int k = 0; k < in.size(); ++k) {
      if (in[k].size() != axes) {
        return fail(RuleError::shape);
      }
      const Placement p = normalize(in[k][a], spec.in[k].size());
      if (p.is_shard()) {
        if (p.dim < 0 || p.dim >= spec.in[k].size()) {
          return fail(RuleError::shape);
        }
        const char c = spec.in[k][p.dim];
        const bool is_kept = find_label(spec.out, c) >= 0;
        char& slot = is_kept ? kept : contracted;
        if ((slot != 0 && slot != c) || (is_kept ? contracted : kept) != 0) {
          return fail(RuleError::different_dims);
        }
        slot = c;
        ++shards;
      } else if (p.is_partial()) {
        if (p.op != ReduceOp::sum && p.op != ReduceOp::avg) {
          return fail(RuleError::partial_op);
        }
        if (partials > 0 && p.op != pop) {
          return fail(RuleError::partial_ops_differ);
        }
        pop = p.op;
        ++partials;
      }
    }
    if (partials > 0 && shards > 0) {
      return fail(RuleError::partial_and_shard);
    }
    if (contracted != 0) { // every operand with the label shards it here
      for (int k = 0; k < in.size(); ++k) {
        const int d = find_label(spec.in[k], contracted);
        if (d >= 0 && !(normalize(in[k][a], spec.in[k].size()) == Placement::shard(d))) {
          return fail(RuleError::contracted_mismatch);
        }
      }
      r.out.push_back(Placement::partial(spec.contract));
      continue;
    }
    if (kept != 0) {
      r.out.push_back(Placement::shard(find_label(spec.out, kept)));
      continue;
    }
    if (partials == 0) {
      r.out.push_back(Placement::replicate());
      continue;
    }
    switch (spec.linearity) {
    case Linearity::nonlinear:
      return fail(RuleError::partial_nonlinear);
    case Linearity::linear:
      break;
    case Linearity::additive:
      if (partials != in.size()) {
        return fail(RuleError::partial_plus_other);
      }
      break;
    case Linearity::multiplicative:
      if (partials > 1) {
        return fail(RuleError::partial_product);
      }
      break;
    case Linearity::quotient:
      for (int k = 1; k < in.size(); ++k) {
        if (in[k][a].is_partial()) {
          return fail(RuleError::partial_divisor);
        }
      }
      break;
    }
    r.out.push_back(Placement::partial(pop));
  }
  // An operand's block of a kept dim must contain the output's: the axes sharding that dim in the operand
  // (left to right, as its placement list orders them) must be the first of those in the output.
  for (int k = 0; k < in.size(); ++k) {
    for (int d = 0; d < spec.in[k].size(); ++d) {
      const int o = find_label(spec.out, spec.in[k][d]);
      if (o < 0) {
        continue;
      }
      bool gap = false; // an output splitter of the dim this operand does not shard
      for (int a = 0; a < axes; ++a) {
        const bool mine = normalize(in[k][a], spec.in[k].size()) == Placement::shard(d);
        const bool theirs = r.out[a] == Placement::shard(o);
        if (mine && gap) {
          r.error = RuleError::shard_axes;
          r.axis = a;
          return r;
        }
        gap = gap || (theirs && !mine);
      }
    }
  }
  return r;
}

/// The local block an operand needs for the output block `out_block`: its kept dims cut to the output's,
/// its other dims whole (a contracted Shard dim is the operand's own block, which apply_rule made the same
/// in every operand). `held` is the operand's own block; the result is within it.
constexpr Block operand_block(const Labels& operand, const Labels& out, const Block& held,
                              const Block& out_block) {
  Block b = held;
  for (int d = 0; d < operand.size(); ++d) {
    const int o = find_label(out, operand[d]);
    if (o >= 0) {
      b.offset[d] = out_block.offset[o];
      b.shape[d] = out_block.shape[o];
    }
  }
  return b;
}

} // namespace dtensor

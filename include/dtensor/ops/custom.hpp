#pragma once
// Your own op with a sharding rule that the engine applies as it does its own (ops/rules.hpp):
//
//   struct SwiGlu {                          // silu(gate) * up, elementwise over (tokens, features)
//     static constexpr OpSpec sharding{{labels("tf"), labels("tf")}, labels("tf"), Linearity::nonlinear};
//     template <class T>
//     Tensor<T, 2> operator()(const Tensor<T, 2>& gate, const Tensor<T, 2>& up) const;  // on the shards
//   };
//   auto y = apply_op(SwiGlu{}, gate, up);   // [S(0)] with [S(0)] -> [S(0)]; [P] -> does not compile
//
// The rule is an einsum-like OpSpec (dim labels per operand and output, how a Partial passes): the output
// placements are apply_rule's, a Replicate operand that has a sharded output label is cut to the output's
// block (no communication), and the output's global shape comes from the labels. Or it is any constexpr
// function of the input placement lists:
//
//   struct Mine {
//     static constexpr RuleResult rule(const StaticVector<PlacementList, max_operands>& in);
//     Tensor<float, 1> operator()(const Tensor<float, 2>& x) const;   // or a LocalResult (uneven shards)
//   };
//
// whose operands get their whole local tensors and whose output shape follows from_local (as local_map).
// For a type you cannot change, specialize op_sharding<Op> with a `sharding` or a `rule` member instead.

#include <array>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/ops/local_map.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

/// Where the engine finds an op's sharding: by default the op's own `sharding` (an OpSpec) or `rule` (a
/// constexpr function of the inputs' placement lists); specialize it for a type you cannot change.
template <class Op>
struct op_sharding {};
template <class Op>
requires requires {
  Op::sharding;
}
struct op_sharding<Op> {
  static constexpr OpSpec sharding = Op::sharding;
};
template <class Op>
requires(
    !requires { Op::sharding; } && requires { &Op::rule; }) struct op_sharding<Op> {
  static constexpr RuleResult rule(const StaticVector<PlacementList, max_operands>& in) {
    return Op::rule(in);
  }
};

namespace detail {

template <class Op>
concept LabelledOp = requires {
  op_sharding<Op>::sharding;
};
template <class Op>
concept RuledOp = requires {
  &op_sharding<Op>::rule;
};

template <class Op, class... X>
constexpr RuleResult custom_rule() {
  if constexpr (LabelledOp<Op>) {
    return apply_rule(op_sharding<Op>::sharding, {X::placements...});
  } else {
    return op_sharding<Op>::rule({X::placements...});
  }
}

/// Whether the labels describe the operands (one label per dim) and every output label is an input's.
template <class... X>
constexpr bool labels_fit(const OpSpec& s) {
  constexpr std::array<int, sizeof...(X)> ranks{X::rank...};
  if (s.in.size() != static_cast<int>(sizeof...(X))) {
    return false;
  }
  for (int k = 0; k < s.in.size(); ++k) {
    if (s.in[k].size() != ranks[static_cast<std::size_t>(k)]) {
      return false;
    }
  }
  for (char c : s.out) {
    bool found = false;
    for (const Labels& l : s.in) {
      found = found || find_label(l, c) >= 0;
    }
    if (!found) {
      return false;
    }
  }
  return true;
}

template <class Op, class... X, std::size_t... K>
auto apply_labelled(const Op& op, std::index_sequence<K...>, const X&... xs) {
  constexpr OpSpec s = op_sharding<Op>::sharding;
  static_assert(labels_fit<X...>(s),
                "apply_op: the op's OpSpec does not fit its operands: one label per dim of "
                "each operand, and every output label must be some input's (an op that "
                "creates dims needs a `rule` instead)");
  using First = std::tuple_element_t<0, std::tuple<X...>>;
  constexpr int rank = s.out.size();
  const auto& mesh = std::get<0>(std::tie(xs...)).mesh();
  // The output's global shape from the labels; a label's length must agree between the operands.
  std::array<std::int64_t, rank> global{};
  std::array<bool, rank> seen{};
  auto take = [&](const auto& x, const Labels& l) {
    for (int d = 0; d < l.size(); ++d) {
      const int o = find_label(s.out, l[d]);
      const std::int64_t n = x.global_shape()[d];
      if (o < 0) {
        continue;
      }
      DTENSOR_CHECK(!seen[o] || global[o] == n, "apply_op: dim label '" + std::string(1, l[d]) +
                                                    "' has length " + std::to_string(global[o]) +
                                                    " in one operand and " + std::to_string(n) +
                                                    " in another");
      global[o] = n;
      seen[o] = true;
    }
  };
  (take(xs, s.in[K]), ...);
  using Result = std::invoke_result_t<const Op&, const typename X::local_type&...>;
  using Y = rule_result_t<typename Result::value_type, rank, typename dtensor_traits<First>::shape_type,
                          &custom_rule<Op, X...>>;
  static_assert(Result::rank == rank,
                "apply_op: the local function must return a tensor of the output labels' rank");
  const Block out = spec_block(to_extents(global), Y::spec, mesh.sizes(), mesh.coordinate());
  Result local = op(operand_view(xs, s.in[K], s.out, out)...);
  std::array<std::int64_t, rank> want{};
  for (int d = 0; d < rank; ++d) {
    want[d] = out.shape[d];
  }
  DTENSOR_CHECK(local.shape() == want, "apply_op: the local function returned shape " +
                                           dtensor::detail::shape_to_string(local.shape()) +
                                           " where this rank's output block is " +
                                           dtensor::detail::shape_to_string(want));
  return Y(mesh, std::move(local), global);
}

} // namespace detail

/// `op` on the shards of `xs`, the output placements from op's sharding rule at compile time (see the top of
/// this file). Never communicates: inputs the rule does not accept do not compile.
template <class Op, AnyDTensor... X>
auto apply_op(const Op& op, const X&... xs) {
  static_assert(sizeof...(X) >= 1 && sizeof...(X) <= max_operands, "apply_op: 1 to 3 operands");
  static_assert(detail::LabelledOp<Op> || detail::RuledOp<Op>,
                "apply_op: the op has no sharding rule: give it a `static constexpr OpSpec sharding` or a "
                "`static constexpr RuleResult rule(const StaticVector<PlacementList, max_operands>&)`, or "
                "specialize dtensor::op_sharding<Op>");
  if constexpr (detail::LabelledOp<Op>) {
    return detail::apply_labelled(op, std::index_sequence_for<X...>{}, xs...);
  } else if constexpr (detail::RuledOp<Op>) {
    using First = std::tuple_element_t<0, std::tuple<X...>>;
    using Result = std::invoke_result_t<const Op&, const typename X::local_type&...>;
    using Local = typename detail::local_result_traits<Result>::tensor;
    using Y =
        rule_result_t<typename Local::value_type, Local::rank,
                      typename detail::dtensor_traits<First>::shape_type, &detail::custom_rule<Op, X...>>;
    const auto& mesh = std::get<0>(std::tie(xs...)).mesh();
    Result r = op(xs.local()...);
    if constexpr (std::is_same_v<Result, Local>) {
      return Y::from_local(mesh, std::move(r));
    } else {
      return Y::from_local(mesh, std::move(r.local), r.global);
    }
  } else { // no rule (the static_assert above): the first operand stands in, adding no error of its own
    return std::get<0>(std::tie(xs...));
  }
}

} // namespace dtensor

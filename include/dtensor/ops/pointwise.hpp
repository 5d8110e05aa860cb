#pragma once
// Pointwise ops on DTensors, their output placements fixed at compile time by ops/rules.hpp:
//
//   auto h = relu(x);                          // x [S(0),R] -> h [S(0),R]; relu(Partial) does not compile
//   auto [h2, back] = gelu(x, with_backward);  // and the context of its backward: dx = back(dh)
//   auto z = add(p, q);                        // [P] + [P] -> [P];  [P] + [R] does not compile
//   auto w = mul(p, r);                        // [P] * [R] -> [P]
//   auto b = add(y, bias);                     // bias of lower rank: broadcast over y's leading dims
//
// A Replicate operand meeting a Shard one uses its local chunk (no communication). Each op is a local
// kernel (local/pointwise.hpp) on the operands' blocks of the output's block; no communication,
// no dispatch at run time. The backward of a unary op takes the output's gradient with any placements:
// where they do not line up with the input's blocks (a Partial gradient of a Shard input) it is
// redistributed first, which the returned gradient's type shows.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/fewest_bytes.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace op_spec {

/// A pointwise op's OpSpec for operands of these ranks: each labelled with the trailing dims of the
/// highest rank (a lower-rank operand broadcasts over the leading dims).
constexpr OpSpec pointwise(Linearity linearity, std::initializer_list<int> ranks) {
  int rank = 0;
  for (int r : ranks) {
    rank = rank > r ? rank : r;
  }
  OpSpec s;
  for (int r : ranks) {
    s.in.push_back(trailing_labels(r, rank));
  }
  s.out = trailing_labels(rank, rank);
  s.linearity = linearity;
  return s;
}

} // namespace op_spec

namespace detail {

/// The OpSpec of a pointwise op over operands X... (the first of the highest rank).
template <Linearity L, class... X>
struct PointwiseSpec {
  static constexpr OpSpec spec() { return op_spec::pointwise(L, {X::rank...}); }
};

/// The rule of a pointwise op over operands X....
template <Linearity L, class... X>
constexpr RuleResult pointwise_rule() {
  return apply_rule(PointwiseSpec<L, X...>::spec(), {X::placements...});
}

/// The output type of a pointwise op over X... with A's element type and rank (naming it reports inputs the
/// rule rejects).
template <class A, Linearity L, class... X>
using pointwise_result_t = rule_result_t<typename A::value_type, A::rank,
                                         typename dtensor_traits<A>::shape_type, &pointwise_rule<L, X...>>;

/// f over the operands' blocks of the output block: the output DTensor (of type Y).
template <class Y, class F, class A, class... B>
Y run_pointwise(F f, const A& a, const B&... b) {
  const Extents global = to_extents(a.global_shape());
  const Block out = spec_block(global, Y::spec, a.mesh().sizes(), a.mesh().coordinate());
  const Labels lo = trailing_labels(A::rank, A::rank);
  auto local = local::map(f, operand_view(a, lo, lo, out),
                          operand_view(b, trailing_labels(B::rank, A::rank), lo, out)...);
  return Y(a.mesh(), std::move(local), a.global_shape());
}

} // namespace detail

/// The backward context of a unary op F on X: keeps the input.
template <class F, Linearity L, class X>
class UnaryBackward {
public:
  UnaryBackward(F f, X x) : f_(f), x_(std::move(x)) {}

  /// The input's gradient from the output's gradient `g` (any placements of the same tensor type).
  template <class G>
  requires AnyDTensor<G>
  auto operator()(const G& g) const {
    using T = typename X::value_type;
    using Shape = typename detail::dtensor_traits<X>::shape_type;
    using Target = dtensor_from_t<T, X::rank, Shape, &detail::GradTarget<X, G>::list>;
    static_assert(std::is_same_v<typename G::value_type, T> && G::rank == X::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    DTENSOR_CHECK(g.global_shape() == x_.global_shape(),
                  "backward of a pointwise op: the gradient's global shape differs from the output's");
    const Target gt = detail::redistribute_as<Target, G>::run(g);
    using Result = detail::pointwise_result_t<X, Linearity::multiplicative, X, Target>;
    return detail::run_pointwise<Result>(local::BackwardOf<F>{f_}, x_, gt);
  }

private:
  F f_;
  X x_;
};

namespace detail {

template <Linearity L, class F, class X>
auto unary(F f, const X& x) {
  return run_pointwise<pointwise_result_t<X, L, X>>(f, x);
}

template <Linearity L, class F, class X>
auto unary(F f, const X& x, WithBackwardTag) {
  auto y = unary<L>(f, x);
  return WithBackward<decltype(y), UnaryBackward<F, L, X>>{std::move(y), UnaryBackward<F, L, X>(f, x)};
}

template <Linearity L, class F, class A, class B>
auto binary(F f, const A& a, const B& b) {
  constexpr bool same =
      std::is_same_v<typename A::value_type, typename B::value_type> &&
      std::is_same_v<typename dtensor_traits<A>::shape_type, typename dtensor_traits<B>::shape_type>;
  static_assert(A::rank >= B::rank, "dtensor op: the second operand is broadcast over the first's leading "
                                    "dims, so its rank must not be higher: swap them (or transpose the op)");
  static_assert(same, "dtensor op: both operands must have one element type and one mesh");
  if constexpr (A::rank < B::rank || !same) {
    return a; // after the error above, a stands in for the result: no second error
  } else {
    using Y = pointwise_result_t<A, L, A, B>;
    for (int d = 0; d < B::rank; ++d) {
      DTENSOR_CHECK(b.global_shape()[d] == a.global_shape()[A::rank - B::rank + d],
                    "dtensor op: global shapes " + shape_string(to_extents(a.global_shape())) + " and " +
                        shape_string(to_extents(b.global_shape())) +
                        " do not broadcast (trailing dims must match)");
    }
    return run_pointwise<Y>(f, a, b);
  }
}

/// f over operands whose rule (linearity L) holds, as the rule's DTensor.
template <Linearity L, class F, class A, class... B>
auto apply_pointwise(F f, const A& a, const B&... b) {
  return run_pointwise<pointwise_result_t<A, L, A, B...>>(f, a, b...);
}

/// The rule of summing x (labels "abc..") over its leading dims down to rank Rb.
template <int Rb, class X>
struct SumLeading {
  static constexpr RuleResult rule() {
    OpSpec s;
    s.in.push_back(trailing_labels(X::rank, X::rank));
    s.out = trailing_labels(Rb, X::rank);
    s.linearity = Linearity::linear;
    return apply_rule(s, {X::placements});
  }
};

/// x summed over its leading dims down to rank Rb (the gradient of an operand broadcast over them): a
/// sharded leading dim gives Partial<sum>.
template <int Rb, class X>
auto sum_leading(const X& x) {
  if constexpr (Rb == X::rank) {
    return x;
  } else {
    using Y = rule_result_t<typename X::value_type, Rb, typename dtensor_traits<X>::shape_type,
                            &SumLeading<Rb, X>::rule>;
    typename Y::shape_type global{};
    for (int d = 0; d < Rb; ++d) {
      global[d] = x.global_shape()[X::rank - Rb + d];
    }
    return Y(x.mesh(), local::sum_to_rank<Rb>(x.local()), global);
  }
}

enum class BinaryKind : std::uint8_t { add, sub, mul, div };

} // namespace detail

/// The backward context of a binary op y = a (op) b (b broadcast over a's leading dims): keeps a and b for
/// mul and div, only a's global shape for add and sub (their gradients do not depend on the operands: a
/// residual connection's backward holds no activation).
template <detail::BinaryKind K, Linearity L, class A, class B>
class BinaryBackward {
  static constexpr bool keeps_operands = K == detail::BinaryKind::mul || K == detail::BinaryKind::div;

public:
  BinaryBackward(A a, B b) : shape_(a.global_shape()) {
    if constexpr (keeps_operands) {
      a_.emplace(std::move(a));
      b_.emplace(std::move(b));
    }
  }

  /// {da, db} from y's gradient (any placements); each in placements of its primal's gradient.
  template <AnyDTensor G>
  auto operator()(const G& g) const {
    using namespace detail;
    using Y = pointwise_result_t<A, L, A, B>;
    using T = typename A::value_type;
    static_assert(std::is_same_v<typename G::value_type, T> && G::rank == A::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    DTENSOR_CHECK(g.global_shape() == shape_,
                  "backward of a pointwise op: the gradient's global shape differs from the output's");
    using Target =
        dtensor_from_t<T, A::rank, typename dtensor_traits<A>::shape_type, &GradTarget<Y, G>::list>;
    const Target gt = redistribute_as<Target, G>::run(g);
    if constexpr (K == BinaryKind::add) {
      return std::pair{as_gradient_of<A>(gt), as_gradient_of<B>(sum_leading<B::rank>(gt))};
    } else if constexpr (K == BinaryKind::sub) {
      return std::pair{as_gradient_of<A>(gt), as_gradient_of<B>(sum_leading<B::rank>(
                                                  unary<Linearity::linear>(local::Scale{-1.0}, gt)))};
    } else if constexpr (K == BinaryKind::mul) {
      return std::pair{as_gradient_of<A>(apply_pointwise<Linearity::multiplicative>(local::Mul{}, gt, *b_)),
                       as_gradient_of<B>(sum_leading<B::rank>(
                           apply_pointwise<Linearity::multiplicative>(local::Mul{}, gt, *a_)))};
    } else {
      return std::pair{as_gradient_of<A>(apply_pointwise<Linearity::quotient>(local::Div{}, gt, *b_)),
                       as_gradient_of<B>(sum_leading<B::rank>(
                           apply_pointwise<Linearity::multiplicative>(local::DivisorGrad{}, gt, *a_, *b_)))};
    }
  }

private:
  typename A::shape_type shape_;
  std::optional<A> a_;
  std::optional<B> b_;
};

/// max(x, 0). Not for Partial inputs.
template <AnyDTensor X>
auto relu(const X& x) {
  return detail::unary<Linearity::nonlinear>(local::Relu{}, x);
}
template <AnyDTensor X>
auto relu(const X& x, WithBackwardTag) {
  return detail::unary<Linearity::nonlinear>(local::Relu{}, x, with_backward);
}
/// x * Phi(x) (the erf form). Not for Partial inputs.
template <AnyDTensor X>
auto gelu(const X& x) {
  return detail::unary<Linearity::nonlinear>(local::Gelu{}, x);
}
template <AnyDTensor X>
auto gelu(const X& x, WithBackwardTag) {
  return detail::unary<Linearity::nonlinear>(local::Gelu{}, x, with_backward);
}
/// x * sigmoid(x). Not for Partial inputs.
template <AnyDTensor X>
auto silu(const X& x) {
  return detail::unary<Linearity::nonlinear>(local::Silu{}, x);
}
template <AnyDTensor X>
auto silu(const X& x, WithBackwardTag) {
  return detail::unary<Linearity::nonlinear>(local::Silu{}, x, with_backward);
}
/// e^x. Not for Partial inputs.
template <AnyDTensor X>
auto exp(const X& x) {
  return detail::unary<Linearity::nonlinear>(local::Exp{}, x);
}
template <AnyDTensor X>
auto exp(const X& x, WithBackwardTag) {
  return detail::unary<Linearity::nonlinear>(local::Exp{}, x, with_backward);
}
/// x * factor: linear, so a Partial stays Partial.
template <AnyDTensor X>
auto scale(const X& x, double factor) {
  return detail::unary<Linearity::linear>(local::Scale{factor}, x);
}
template <AnyDTensor X>
auto scale(const X& x, double factor, WithBackwardTag) {
  return detail::unary<Linearity::linear>(local::Scale{factor}, x, with_backward);
}
/// x + value: not for Partial inputs (each rank would add the value).
template <AnyDTensor X>
auto add(const X& x, double value) {
  return detail::unary<Linearity::nonlinear>(local::AddScalar{value}, x);
}

/// a + b (b broadcast over a's leading dims): Partial + Partial is Partial.
template <AnyDTensor A, AnyDTensor B>
auto add(const A& a, const B& b) {
  return detail::binary<Linearity::additive>(local::Add{}, a, b);
}
/// add after bringing a and b to the placements of a rule with the fewest bytes (ops/fewest_bytes.hpp).
template <AnyDTensor A, AnyDTensor B>
auto add(const A& a, const B& b, FewestBytesTag) {
  auto [fa, fb] = detail::fit_inputs<detail::PointwiseSpec<Linearity::additive, A, B>>(a, b);
  return add(fa, fb);
}
template <AnyDTensor A, AnyDTensor B>
auto add(const A& a, const B& b, WithBackwardTag) {
  using Back = BinaryBackward<detail::BinaryKind::add, Linearity::additive, A, B>;
  auto y = add(a, b);
  return WithBackward<decltype(y), Back>{std::move(y), Back(a, b)};
}
/// a - b.
template <AnyDTensor A, AnyDTensor B>
auto sub(const A& a, const B& b) {
  return detail::binary<Linearity::additive>(local::Sub{}, a, b);
}
/// sub after bringing a and b to the placements of a rule with the fewest bytes (ops/fewest_bytes.hpp).
template <AnyDTensor A, AnyDTensor B>
auto sub(const A& a, const B& b, FewestBytesTag) {
  auto [fa, fb] = detail::fit_inputs<detail::PointwiseSpec<Linearity::additive, A, B>>(a, b);
  return sub(fa, fb);
}
template <AnyDTensor A, AnyDTensor B>
auto sub(const A& a, const B& b, WithBackwardTag) {
  using Back = BinaryBackward<detail::BinaryKind::sub, Linearity::additive, A, B>;
  auto y = sub(a, b);
  return WithBackward<decltype(y), Back>{std::move(y), Back(a, b)};
}
/// a * b elementwise: at most one Partial factor, the other Replicate.
template <AnyDTensor A, AnyDTensor B>
auto mul(const A& a, const B& b) {
  return detail::binary<Linearity::multiplicative>(local::Mul{}, a, b);
}
/// mul after bringing a and b to the placements of a rule with the fewest bytes (ops/fewest_bytes.hpp).
template <AnyDTensor A, AnyDTensor B>
auto mul(const A& a, const B& b, FewestBytesTag) {
  auto [fa, fb] = detail::fit_inputs<detail::PointwiseSpec<Linearity::multiplicative, A, B>>(a, b);
  return mul(fa, fb);
}
template <AnyDTensor A, AnyDTensor B>
auto mul(const A& a, const B& b, WithBackwardTag) {
  using Back = BinaryBackward<detail::BinaryKind::mul, Linearity::multiplicative, A, B>;
  auto y = mul(a, b);
  return WithBackward<decltype(y), Back>{std::move(y), Back(a, b)};
}
/// a / b elementwise: a Partial numerator over a Replicate divisor stays Partial.
template <AnyDTensor A, AnyDTensor B>
auto div(const A& a, const B& b) {
  return detail::binary<Linearity::quotient>(local::Div{}, a, b);
}
/// div after bringing a and b to the placements of a rule with the fewest bytes (ops/fewest_bytes.hpp).
template <AnyDTensor A, AnyDTensor B>
auto div(const A& a, const B& b, FewestBytesTag) {
  auto [fa, fb] = detail::fit_inputs<detail::PointwiseSpec<Linearity::quotient, A, B>>(a, b);
  return div(fa, fb);
}
template <AnyDTensor A, AnyDTensor B>
auto div(const A& a, const B& b, WithBackwardTag) {
  using Back = BinaryBackward<detail::BinaryKind::div, Linearity::quotient, A, B>;
  auto y = div(a, b);
  return WithBackward<decltype(y), Back>{std::move(y), Back(a, b)};
}

} // namespace dtensor

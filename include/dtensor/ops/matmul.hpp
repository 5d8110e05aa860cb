#pragma once
// Matrix products of DTensors, output placements fixed at compile time by ops/rules.hpp's einsum rule,
// the local product a GEMM (local/gemm.hpp: OpenBLAS on the host, cuBLAS on CUDA tensors):
//
//   auto y = matmul(x, w);            // x [R] (m, k), w [S(1)] (k, n) -> y [S(1)]: column parallel
//   auto z = matmul(y, w2);           // y [S(1)] (m, n), w2 [S(0)] (n, p) -> z [P]: row parallel
//   auto [h, back] = linear(x, w, with_backward);   // x W^T with W (out, in), as torch.nn.functional.linear
//   auto [dx, dw] = back(dh);
//
// On each mesh axis: A S(m) with B R -> S(m); A R with B S(n) -> S(n); A S(k) with B S(k) -> Partial<sum>;
// R with R -> R; Partial with R -> Partial; anything else does not compile and says what to redistribute.
// A is (m, k) or batched (b, m, k); B is (k, n), shared by every batch, or (b, k, n). No communication: a
// Partial result stays pending until the caller redistributes it (the row-parallel all_reduce).
//
// The backward is the same rule twice, dA = dC B^T and dB = A^T dC (summed over the batch for a shared B),
// after bringing dC to C's layout (a Partial gradient of a Shard output is reduce-scattered first); each
// gradient comes out in a placement that describes the gradient of its primal (Replicate or Partial<sum>
// for a Replicate primal: a column-parallel input's gradient stays Partial, the Megatron f backward,
// until the caller reduces it).

#include <array>
#include <cstdint>
#include <tuple>
#include <utility>

#include "dtensor/backward/duality.hpp"
#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/local/gemm.hpp"
#include "dtensor/ops/fewest_bytes.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {

/// Labels of a product's operands: 'b' batch, 'm' rows, 'k' contracted, 'n' columns.
constexpr Labels mm_labels(int rank, char first, char second) {
  Labels l;
  if (rank == 3) {
    l.push_back('b');
  }
  l.push_back(first);
  l.push_back(second);
  return l;
}

/// A product x y -> out with these labels and transposes, as its rule and local GEMM see it.
struct Product {
  Labels x, y, out;
  bool trans_x = false;
  bool trans_y = false;
};

template <class X, class Y>
constexpr RuleResult product_rule(const Product& p) {
  OpSpec s;
  s.in.push_back(p.x);
  s.in.push_back(p.y);
  s.out = p.out;
  s.linearity = Linearity::multiplicative;
  return apply_rule(s, {X::placements, Y::placements});
}

/// The products of C = A op(B) (op: transposed for linear, whose weight is (n, k)) and of its backward.
template <int RA, int RB, bool Linear>
struct Products {
  static constexpr bool valid = (RA == 2 && RB == 2) || (RA == 3 && (RB == 2 || RB == 3));
  static_assert(valid, "matmul / linear: A is (m, k) or (b, m, k); B is rank 2 or, with a batched A, rank 3");
  static constexpr Labels a = mm_labels(RA, 'm', 'k');
  static constexpr Labels b = Linear ? mm_labels(RB, 'n', 'k') : mm_labels(RB, 'k', 'n');
  static constexpr Labels c = mm_labels(RA, 'm', 'n');
  /// C = A op(B)
  static constexpr Product forward{a, b, c, false, Linear};
  /// dA = dC op(B)^T
  static constexpr Product grad_a{c, b, a, false, !Linear};
  /// dB = A^T dC (matmul), dC^T A (linear); summed over the batch when B is shared
  static constexpr Product grad_b = Linear ? Product{c, a, b, true, false} : Product{a, c, b, true, false};
};

/// The rule of product P (a pointer to a Products member) on operands X, Y.
template <const Product* P, class X, class Y>
struct ProductOut {
  static constexpr RuleResult rule() { return product_rule<X, Y>(*P); }
};

/// The output type of product P on X, Y (naming it reports inputs the rule rejects).
template <const Product* P, class X, class Y, int Rank>
using product_result_t = rule_result_t<typename X::value_type, Rank, typename dtensor_traits<X>::shape_type,
                                       &ProductOut<P, X, Y>::rule>;

/// Product P of x and y on their blocks of the output's block, as the DTensor Out of global shape `global`.
template <class Out, const Product* P, class X, class Y>
Out run_product(const X& x, const Y& y, const typename Out::shape_type& global) {
  const Block out = spec_block(to_extents(global), Out::spec, x.mesh().sizes(), x.mesh().coordinate());
  const auto vx = operand_view(x, P->x, P->out, out);
  const auto vy = operand_view(y, P->y, P->out, out);
  if constexpr (Out::rank == 2 && X::rank == 3) { // the batch is summed away: one GEMM over (b m) rows
    const auto fx = vx.contiguous();
    const auto fy = vy.contiguous();
    const auto mx = fx.template view<2>({fx.shape()[0] * fx.shape()[1], fx.shape()[2]});
    const auto my = fy.template view<2>({fy.shape()[0] * fy.shape()[1], fy.shape()[2]});
    return Out(x.mesh(), local::matmul(mx, my, P->trans_x, P->trans_y), global);
  } else {
    return Out(x.mesh(), local::matmul(vx, vy, P->trans_x, P->trans_y), global);
  }
}

/// The global shape of C = A op(B).
template <bool Linear, class A, class B>
typename A::shape_type product_shape(const A& a, const B& b) {
  const auto& sa = a.global_shape();
  const auto& sb = b.global_shape();
  const std::int64_t k = Linear ? sb[B::rank - 1] : sb[B::rank - 2];
  const std::int64_t n = Linear ? sb[B::rank - 2] : sb[B::rank - 1];
  DTENSOR_CHECK(sa[A::rank - 1] == k && (B::rank == 2 || sa[0] == sb[0]),
                std::string(Linear ? "linear" : "matmul") + ": global shapes " +
                    shape_string(to_extents(sa)) + " and " + shape_string(to_extents(sb)) +
                    " do not multiply" + (Linear ? " (the weight is (out, in))" : ""));
  typename A::shape_type c = sa;
  c[A::rank - 1] = n;
  return c;
}

/// C = A op(B): the operands' checks, then the rule's output type (see matmul and linear).
template <bool Linear, class A, class B>
auto product(const A& a, const B& b) {
  using Ps = Products<A::rank, B::rank, Linear>;
  constexpr bool same =
      std::is_same_v<typename A::value_type, typename B::value_type> &&
      std::is_same_v<typename dtensor_traits<A>::shape_type, typename dtensor_traits<B>::shape_type>;
  static_assert(same, "matmul / linear: both operands must have one element type and one mesh");
  if constexpr (!same || !Ps::valid) {
    return a; // after the error above (or Products'), a stands in for the result: no second error
  } else {
    using C = product_result_t<&Ps::forward, A, B, A::rank>;
    return run_product<C, &Ps::forward>(a, b, product_shape<Linear>(a, b));
  }
}

} // namespace detail

/// The backward context of C = A op(B): keeps A and B.
template <bool Linear, class A, class B>
class ProductBackward {
  using Ps = detail::Products<A::rank, B::rank, Linear>;

public:
  ProductBackward(A a, B b) : a_(std::move(a)), b_(std::move(b)) {}

  /// {dA, dB} from dC (any placements); each in placements that describe its primal's gradient.
  template <AnyDTensor G>
  auto operator()(const G& g) const {
    if constexpr (!detail::ProductOut<&Ps::forward, A, B>::rule().ok()) {
      return std::pair{a_, b_}; // the forward's rule rejected A, B (that is the error): no second one here
    } else {
      return backward(g);
    }
  }

  /// The backward split for zero-bubble pipelines: {dA, w} now, w() gives dB later (the same values as
  /// operator()'s; w holds dC and A until then).
  template <AnyDTensor G>
  auto split(const G& g) const {
    static_assert(detail::ProductOut<&Ps::forward, A, B>::rule().ok(),
                  "ProductBackward::split: the forward's placements are rejected");
    auto [da, db] = backward<true>(g);
    return std::pair{std::move(da), [db = std::move(db), a = a_] { return db(a); }};
  }
  /// split whose w takes A (w(a) gives dB): for a caller that keeps A more cheaply until then (a sequence
  /// shard it gathers again) rather than holding it whole between B and W.
  template <AnyDTensor G>
  auto split_taking_a(const G& g) const {
    static_assert(detail::ProductOut<&Ps::forward, A, B>::rule().ok(),
                  "ProductBackward::split_taking_a: the forward's placements are rejected");
    return backward<true>(g);
  }

private:
  template <bool Split = false, class G>
  auto backward(const G& g) const {
    using C = detail::product_result_t<&Ps::forward, A, B, A::rank>;
    static_assert(std::is_same_v<typename G::value_type, typename A::value_type> && G::rank == A::rank,
                  "backward: the gradient must have the forward output's element type and rank");
    const auto c_shape = detail::product_shape<Linear>(a_, b_);
    DTENSOR_CHECK(g.global_shape() == c_shape,
                  "backward of matmul: the gradient's global shape " +
                      detail::shape_string(detail::to_extents(g.global_shape())) + " is not the output's " +
                      detail::shape_string(detail::to_extents(c_shape)));
    using Target =
        dtensor_from_t<typename A::value_type, A::rank, typename detail::dtensor_traits<A>::shape_type,
                       &detail::GradTarget<C, G>::list>;
    const Target dc = detail::redistribute_as<Target, G>::run(g);
    using DA = detail::product_result_t<&Ps::grad_a, Target, B, A::rank>;
    using DB = detail::product_result_t<&Ps::grad_b, std::conditional_t<Linear, Target, A>,
                                        std::conditional_t<Linear, A, Target>, B::rank>;
    DA da = detail::run_product<DA, &Ps::grad_a>(dc, b_, a_.global_shape());
    auto db = [dc, shape = b_.global_shape()](const A& a) {
      if constexpr (Linear) {
        return detail::as_gradient_of<B>(detail::run_product<DB, &Ps::grad_b>(dc, a, shape));
      } else {
        return detail::as_gradient_of<B>(detail::run_product<DB, &Ps::grad_b>(a, dc, shape));
      }
    };
    if constexpr (Split) {
      return std::pair{detail::as_gradient_of<A>(std::move(da)), std::move(db)};
    } else {
      return std::pair{detail::as_gradient_of<A>(std::move(da)), db(a_)};
    }
  }

  A a_;
  B b_;
};

namespace op_spec {

/// matmul's OpSpec for A of rank `ra` ((m, k) or (b, m, k)) and B of rank `rb`.
constexpr OpSpec matmul(int ra, int rb) {
  OpSpec s;
  s.in.push_back(detail::mm_labels(ra, 'm', 'k'));
  s.in.push_back(detail::mm_labels(rb, 'k', 'n'));
  s.out = detail::mm_labels(ra, 'm', 'n');
  s.linearity = Linearity::multiplicative;
  return s;
}
/// linear's OpSpec for x of rank `rx` and the weight (out, in).
constexpr OpSpec linear(int rx) {
  OpSpec s = matmul(rx, 2);
  s.in[1] = detail::mm_labels(2, 'n', 'k');
  return s;
}

} // namespace op_spec

namespace detail {

template <bool Linear, class A, class B>
struct ProductSpec {
  static constexpr OpSpec spec() {
    return Linear ? op_spec::linear(A::rank) : op_spec::matmul(A::rank, B::rank);
  }
};

} // namespace detail

/// A B: A (m, k) or (b, m, k), B (k, n) or (b, k, n).
template <AnyDTensor A, AnyDTensor B>
auto matmul(const A& a, const B& b) {
  return detail::product<false>(a, b);
}
/// matmul after bringing a and b to the placements of a rule with the fewest bytes (ops/fewest_bytes.hpp).
template <AnyDTensor A, AnyDTensor B>
auto matmul(const A& a, const B& b, FewestBytesTag) {
  auto [fa, fb] = detail::fit_inputs<detail::ProductSpec<false, A, B>>(a, b);
  return matmul(fa, fb);
}
template <AnyDTensor A, AnyDTensor B>
auto matmul(const A& a, const B& b, WithBackwardTag) {
  auto c = matmul(a, b);
  return WithBackward<decltype(c), ProductBackward<false, A, B>>{std::move(c),
                                                                 ProductBackward<false, A, B>(a, b)};
}

/// x W^T with W (out, in), as torch.nn.functional.linear without a bias (linear(x, w, b) below has one).
template <AnyDTensor X, AnyDTensor W>
auto linear(const X& x, const W& w) {
  static_assert(W::rank == 2, "linear: the weight is (out, in)");
  if constexpr (W::rank != 2) {
    return x; // after the error above, x stands in for the result: no second error
  } else {
    return detail::product<true>(x, w);
  }
}
/// linear after bringing x and w to the placements of a rule with the fewest bytes (ops/fewest_bytes.hpp).
template <AnyDTensor X, AnyDTensor W>
auto linear(const X& x, const W& w, FewestBytesTag) {
  static_assert(W::rank == 2, "linear: the weight is (out, in)");
  auto [fx, fw] = detail::fit_inputs<detail::ProductSpec<true, X, W>>(x, w);
  return linear(fx, fw);
}
template <AnyDTensor X, AnyDTensor W>
auto linear(const X& x, const W& w, WithBackwardTag) {
  auto y = linear(x, w);
  return WithBackward<decltype(y), ProductBackward<true, X, W>>{std::move(y),
                                                                ProductBackward<true, X, W>(x, w)};
}

/// x W^T + b (torch.nn.functional.linear with a bias): the bias (out) is added over x's leading dims.
template <AnyDTensor X, AnyDTensor W, AnyDTensor B>
auto linear(const X& x, const W& w, const B& b) {
  static_assert(B::rank == 1, "linear: the bias is (out)");
  return add(linear(x, w), b);
}
/// With the backward: `auto [y, back] = linear(x, w, b, with_backward); auto [dx, dw, db] = back(dy);`.
template <AnyDTensor X, AnyDTensor W, AnyDTensor B>
auto linear(const X& x, const W& w, const B& b, WithBackwardTag) {
  static_assert(B::rank == 1, "linear: the bias is (out)");
  auto [y, linear_back] = linear(x, w, with_backward);
  auto [out, bias_back] = add(y, b, with_backward);
  auto back = [linear_back = std::move(linear_back), bias_back = std::move(bias_back)](const auto& dy) {
    auto [dyy, db] = bias_back(dy);
    auto [dx, dw] = linear_back(dyy);
    return std::tuple{std::move(dx), std::move(dw), std::move(db)};
  };
  return WithBackward<decltype(out), decltype(back)>{std::move(out), std::move(back)};
}

} // namespace dtensor

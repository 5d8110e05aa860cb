// The sharding rules' tables (ops/rules.hpp), pinned: the einsum rule of a matmul on each axis, the
// Partial linearity rules of the pointwise ops, and the DTensor types the ops return.
#include <catch2/catch.hpp>

#include <dtensor/ops/pointwise.hpp>
#include <dtensor/ops/rules.hpp>

#include <type_traits>

using namespace dtensor;

namespace {

constexpr Placement R = Placement::replicate();
constexpr Placement P = Placement::partial(ReduceOp::sum);
constexpr Placement Pavg = Placement::partial(ReduceOp::avg);
constexpr Placement S(int d) {
  return Placement::shard(d);
}

constexpr OpSpec matmul_spec() {
  OpSpec s;
  s.in.push_back(labels("mk"));
  s.in.push_back(labels("kn"));
  s.out = labels("mn");
  s.linearity = Linearity::multiplicative;
  return s;
}

constexpr RuleResult mm(Placement a, Placement b) {
  return apply_rule(matmul_spec(), {PlacementList{a}, PlacementList{b}});
}

constexpr bool gives(const RuleResult& r, Placement out) {
  return r.ok() && r.out.size() == 1 && r.out[0] == out;
}

// C[m,n] = A[m,k] B[k,n], on one axis.
static_assert(gives(mm(S(0), R), S(0)), "A S(m) with B R -> C S(m)");
static_assert(gives(mm(R, S(1)), S(1)), "A R with B S(n) -> C S(n)");
static_assert(gives(mm(S(1), S(0)), P), "A S(k) with B S(k) -> C Partial<sum>");
static_assert(gives(mm(R, R), R), "R with R -> R");
static_assert(gives(mm(P, R), P) && gives(mm(R, P), P), "Partial<sum> with R -> Partial<sum>");
static_assert(gives(mm(Pavg, R), Pavg), "Partial<avg> with R -> Partial<avg>");
static_assert(mm(S(1), R).error == RuleError::contracted_mismatch, "A S(k) with B R: redistribute B");
static_assert(mm(R, S(0)).error == RuleError::contracted_mismatch, "A R with B S(k): redistribute A");
static_assert(mm(S(0), S(1)).error == RuleError::different_dims, "A S(m) with B S(n) on one axis");
static_assert(mm(S(1), S(1)).error == RuleError::different_dims, "A S(k) with B S(n) on one axis");
static_assert(mm(P, P).error == RuleError::partial_product, "P * P");
static_assert(mm(P, S(1)).error == RuleError::partial_and_shard, "P with S on one axis");
static_assert(mm(Placement::partial(ReduceOp::max), R).error == RuleError::partial_op, "P(max) input");

// Two axes: each decided on its own. [S(m), R] x [R, S(n)] -> [S(m), S(n)]; the contraction over a 2-D
// mesh: [S(k), S(k)] x [S(k), S(k)] -> [P, P].
static_assert(apply_rule(matmul_spec(), {PlacementList{S(0), R}, PlacementList{R, S(1)}}).out ==
              PlacementList{S(0), S(1)});
static_assert(apply_rule(matmul_spec(), {PlacementList{S(1), S(1)}, PlacementList{S(0), S(0)}}).out ==
              PlacementList{P, P});
static_assert(apply_rule(matmul_spec(), {PlacementList{S(1), S(0)}, PlacementList{S(0), R}}).out ==
              PlacementList{P, S(0)});

constexpr RuleResult pointwise(Linearity l, PlacementList a, PlacementList b) {
  OpSpec s;
  s.in.push_back(labels("ab"));
  s.in.push_back(labels("ab"));
  s.out = labels("ab");
  s.linearity = l;
  return apply_rule(s, {a, b});
}
constexpr RuleResult unary(Linearity l, PlacementList a) {
  OpSpec s;
  s.in.push_back(labels("ab"));
  s.out = labels("ab");
  s.linearity = l;
  return apply_rule(s, {a});
}

// The Partial rules of the pointwise ops.
static_assert(pointwise(Linearity::additive, {P}, {P}).out == PlacementList{P}, "P + P -> P");
static_assert(pointwise(Linearity::additive, {P}, {R}).error == RuleError::partial_plus_other, "P + R");
static_assert(pointwise(Linearity::additive, {P}, {Pavg}).error == RuleError::partial_ops_differ);
static_assert(pointwise(Linearity::multiplicative, {P}, {R}).out == PlacementList{P}, "P * R -> P");
static_assert(pointwise(Linearity::multiplicative, {P}, {P}).error == RuleError::partial_product, "P * P");
static_assert(pointwise(Linearity::quotient, {P}, {R}).out == PlacementList{P}, "P / R -> P");
static_assert(pointwise(Linearity::quotient, {R}, {P}).error == RuleError::partial_divisor, "R / P");
static_assert(unary(Linearity::nonlinear, {P}).error == RuleError::partial_nonlinear, "relu(P)");
static_assert(unary(Linearity::linear, {P}).out == PlacementList{P}, "scale(P) -> P");
static_assert(pointwise(Linearity::additive, {S(0)}, {R}).out == PlacementList{S(0)},
              "S + R -> S (R uses its local chunk)");
static_assert(pointwise(Linearity::additive, {S(0)}, {S(1)}).error == RuleError::different_dims);
// A dim sharded over axes (0, 1) in one operand and over axis 1 only in the other: the second holds
// blocks that do not contain the output's.
static_assert(pointwise(Linearity::additive, {S(0), S(0)}, {R, S(0)}).error == RuleError::shard_axes);
static_assert(pointwise(Linearity::additive, {S(0), S(0)}, {S(0), R}).out == PlacementList{S(0), S(0)});

// The types the ops return.
using M2 = MeshShape<Axis<"dp">, Axis<"tp">>;
template <class... Ps>
using X = DTensor<float, 2, M2, Ps...>;
using Bias = DTensor<float, 1, M2, Replicate, Shard<0>>;
static_assert(std::is_same_v<decltype(relu(std::declval<X<Shard<0>, Replicate>>())), X<Shard<0>, Replicate>>);
static_assert(
    std::is_same_v<decltype(scale(std::declval<X<Partial<>, Shard<1>>>(), 2.0)), X<Partial<>, Shard<1>>>);
static_assert(std::is_same_v<decltype(add(std::declval<X<Partial<>, Replicate>>(),
                                          std::declval<X<Partial<>, Shard<-1>>>())),
                             X<Partial<>, Shard<1>>>);
static_assert(std::is_same_v<decltype(mul(std::declval<X<Partial<>, Shard<1>>>(), std::declval<Bias>())),
                             X<Partial<>, Shard<1>>>,
              "a bias of lower rank sharded on its dim 0 shards the output's dim 1");
static_assert(std::is_same_v<decltype(div(std::declval<X<Partial<ReduceOp::avg>, Replicate>>(),
                                          std::declval<X<Replicate, Replicate>>())),
                             X<Partial<ReduceOp::avg>, Replicate>>);

} // namespace

TEST_CASE("the rule tables compile (static_asserts above)", "[ops]") {
  SUCCEED();
}

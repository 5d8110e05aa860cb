// Compile-fail cases for the sharding rules of ops/ (format: see vocabulary.cpp): each names the
// redistribute to write.
#include <dtensor/ops/norm.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/ops/reduce.hpp>
#include <dtensor/ops/shape.hpp>
#include <dtensor/ops/softmax.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp">>;
template <class... Ps>
using X = DTensor<float, 2, Mesh, Ps...>;
using P = Partial<>;
using R = Replicate;

// The control: what the rules accept compiles.
void control(const X<P, R>& p, const X<R, R>& r, const X<Shard<0>, R>& s,
             const DTensor<float, 1, Mesh, R, R>& w) {
  (void)add(p, p);
  (void)mul(p, r);
  (void)div(p, r);
  (void)scale(p, 2.0);
  (void)relu(s);
  (void)sum<0>(p);
  (void)max<1>(s, with_backward);
  (void)flatten<0, 1>(s);
  (void)permute<1, 0>(s);
  (void)reshape<1>(r, {4});
  (void)softmax<1>(s);
  (void)layer_norm<1>(s, w, w);
}

//! CASE relu_partial dtensor op: a Partial input to a nonlinear op .relu, gelu, silu, exp, max, x . scalar
#ifdef CASE_relu_partial
void f(const X<P, R>& p) {
  (void)relu(p);
}
#endif

//! CASE partial_plus_replicate dtensor op: Partial . a non-Partial operand would add that operand once per
#ifdef CASE_partial_plus_replicate
void f(const X<P, R>& p, const X<R, R>& r) {
  (void)add(p, r);
}
#endif

//! CASE partial_plus_scalar dtensor op: a Partial input to a nonlinear op
#ifdef CASE_partial_plus_scalar
void f(const X<P, R>& p) {
  (void)add(p, 1.0);
}
#endif

//! CASE partial_times_partial dtensor op: Partial . Partial is not Partial: redistribute<Replicate> one
#ifdef CASE_partial_times_partial
void f(const X<P, R>& p) {
  (void)mul(p, p);
}
#endif

//! CASE divide_by_partial dtensor op: dividing by a Partial: redistribute<Replicate> the divisor first
#ifdef CASE_divide_by_partial
void f(const X<R, R>& r, const X<P, R>& p) {
  (void)div(r, p);
}
#endif

//! CASE different_dims dtensor op: the operands are sharded on different dims along one mesh axis
#ifdef CASE_different_dims
void f(const X<Shard<0>, R>& a, const X<Shard<1>, R>& b) {
  (void)add(a, b);
}
#endif

//! CASE partial_and_shard dtensor op: one operand is Partial and another Shard along the same mesh axis
#ifdef CASE_partial_and_shard
void f(const X<P, R>& p, const X<Shard<0>, R>& s) {
  (void)mul(p, s);
}
#endif

//! CASE max_partial dtensor op: a Partial input to a nonlinear op
#ifdef CASE_max_partial
void f(const X<P, R>& p) {
  (void)max<0>(p);
}
#endif

//! CASE shard_axes dtensor op: an operand shards a dim over mesh axes that are not the first of those the
#ifdef CASE_shard_axes
void f(const X<Shard<0>, Shard<0>>& a, const X<R, Shard<0>>& b) {
  (void)add(a, b);
}
#endif

//! CASE local_map_placements local_map: an input.s placements are not the declared ones
#ifdef CASE_local_map_placements
#include <dtensor/ops/local_map.hpp>
void f(const X<R, R>& x) {
  auto g = local_map<In<Placements<Shard<0>, R>>, Out<Placements<Shard<0>, R>>>(
      [](const Tensor<float, 2>& t) { return t; });
  (void)g(x);
}
#endif

//! CASE flatten_inner_shard flatten: a Shard on a merged dim other than the first cannot survive the merge
#ifdef CASE_flatten_inner_shard
void f(const X<R, Shard<1>>& x) {
  (void)flatten<0, 1>(x);
}
#endif

//! CASE reshape_sharded reshape: the DTensor shards a dim; use flatten / unflatten
#ifdef CASE_reshape_sharded
void f(const X<Shard<0>, R>& x) {
  (void)reshape<1>(x, {4});
}
#endif

//! CASE permute_not_permutation permute: the dims must be a permutation of 0 .. rank-1
#ifdef CASE_permute_not_permutation
void f(const X<Shard<0>, R>& x) {
  (void)permute<0, 0>(x);
}
#endif

//! CASE custom_op_partial dtensor op: a Partial input to a nonlinear op
#ifdef CASE_custom_op_partial
#include <dtensor/ops/custom.hpp>
struct Gate {
  static constexpr OpSpec sharding{{labels("ab"), labels("ab")}, labels("ab"), Linearity::nonlinear};
  Tensor<float, 2> operator()(const Tensor<float, 2>& a, const Tensor<float, 2>&) const { return a; }
};
void f(const X<P, R>& p, const X<R, R>& r) {
  (void)apply_op(Gate{}, p, r);
}
#endif

//! CASE custom_op_no_rule apply_op: the op has no sharding rule
#ifdef CASE_custom_op_no_rule
#include <dtensor/ops/custom.hpp>
struct NoRule {
  Tensor<float, 2> operator()(const Tensor<float, 2>& a) const { return a; }
};
void f(const X<R, R>& r) {
  (void)apply_op(NoRule{}, r);
}
#endif

//! CASE softmax_partial dtensor op: a Partial input to a nonlinear op
#ifdef CASE_softmax_partial
#include <dtensor/ops/softmax.hpp>
void f(const X<P, R>& p) {
  (void)softmax<1>(p);
}
#endif

//! CASE norm_sharded_dim layer_norm / rms_norm: a normalized .trailing. dim is sharded: redistribute it to
#ifdef CASE_norm_sharded_dim
#include <dtensor/ops/norm.hpp>
void f(const X<R, Shard<1>>& x, const DTensor<float, 1, Mesh, R, R>& w) {
  (void)rms_norm<1>(x, w);
}
#endif

//! CASE norm_weight_sharded layer_norm / rms_norm: the weight and bias must be Replicate on every mesh axis
#ifdef CASE_norm_weight_sharded
#include <dtensor/ops/norm.hpp>
void f(const X<Shard<0>, R>& x, const DTensor<float, 1, Mesh, R, Shard<0>>& w) {
  (void)rms_norm<1>(x, w);
}
#endif

//! CASE embedding_ids_and_vocab_sharded dtensor op: the operands are sharded on different dims along one
#ifdef CASE_embedding_ids_and_vocab_sharded
#include <dtensor/ops/embedding.hpp>
void f(const DTensor<std::int64_t, 1, Mesh, Shard<0>, R>& ids, const X<Shard<0>, R>& w) {
  (void)embedding(ids, w);
}
#endif

//! CASE loss_partial_logits cross_entropy: Partial logits
#ifdef CASE_loss_partial_logits
#include <dtensor/ops/loss.hpp>
void f(const X<R, P>& logits, const DTensor<std::int64_t, 1, Mesh, R, R>& t) {
  (void)cross_entropy(logits, t);
}
#endif

//! CASE loss_target_placement cross_entropy: the target must be placed like the logits. rows
#ifdef CASE_loss_target_placement
#include <dtensor/ops/loss.hpp>
void f(const X<Shard<0>, Shard<1>>& logits, const DTensor<std::int64_t, 1, Mesh, R, R>& t) {
  (void)cross_entropy(logits, t);
}
#endif

//! CASE transpose_partial_max dtensor op: a Partial<max/min/product> input
#ifdef CASE_transpose_partial_max
void f(const X<Partial<ReduceOp::max>, R>& x) {
  (void)transpose<0, 1>(x);
}
#endif

//! CASE custom_rule_function dtensor op: a Partial input to a nonlinear op
#ifdef CASE_custom_rule_function
#include <dtensor/ops/custom.hpp>
struct Mine { // a rule as a function of the inputs' placements: Partial rejected, the rest passes
  static constexpr RuleResult rule(const StaticVector<PlacementList, max_operands>& in) {
    RuleResult r;
    for (Placement p : in[0]) {
      r.error = p.is_partial() ? RuleError::partial_nonlinear : r.error;
    }
    r.out = in[0];
    return r;
  }
  Tensor<float, 2> operator()(const Tensor<float, 2>& a) const { return a; }
};
void f(const X<P, R>& p) {
  auto y = apply_op(Mine{}, p);
  (void)relu(y);
}
#endif

//! CASE embedding_partial_ids embedding: the ids cannot be Partial
#ifdef CASE_embedding_partial_ids
#include <dtensor/ops/embedding.hpp>
void f(const DTensor<std::int64_t, 1, Mesh, P, R>& ids, const X<Shard<0>, R>& w) {
  (void)embedding(ids, w);
}
#endif

//! CASE local_map_input_count local_map: In<...> declares a different number of inputs
#ifdef CASE_local_map_input_count
#include <dtensor/ops/local_map.hpp>
void f(const X<R, R>& x) {
  auto g = local_map<In<Placements<R, R>, Placements<R, R>>, Out<Placements<R, R>>>(
      [](const Tensor<float, 2>& t) { return t; });
  (void)g(x);
}
#endif

// Compile-fail cases for attention's sharding rule (ops/attention.hpp; format: see vocabulary.cpp): each
// names what to write instead.
// Syntax only, never linked: the local kernel's blocks use the BLAS (<cblas.h> is on the default path).
#define DTENSOR_HAS_BLAS 1
#include <dtensor/ops/attention.hpp>
#include <dtensor/ops/rotary.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"cp">>;
template <class... Ps>
using X = DTensor<float, 4, Mesh, Ps...>;
using R = Replicate;

// The control: what the rule accepts compiles (batch over dp, heads or the queries' sequence over cp).
void control(const X<Shard<0>, Shard<1>>& heads, const X<Shard<0>, R>& kv, const X<R, Shard<2>>& q_seq,
             const X<R, R>& r) {
  (void)scaled_dot_product_attention(heads, heads, heads);
  (void)scaled_dot_product_attention(heads, kv, kv, {.causal = true});
  (void)scaled_dot_product_attention(q_seq, r, r, {.causal = true}, with_backward);
  (void)attention<Ulysses<"cp">>(q_seq, q_seq, q_seq);
  (void)attention<Ring<"cp">>(q_seq, q_seq, q_seq, {.causal = true}, with_backward);
  (void)rotary_embedding<2>(q_seq, {}, with_backward);
  const auto z = zigzag<"cp", 2>(q_seq);
  (void)attention<Ring<"cp">>(z, z, z, {.causal = true}, with_backward);
  (void)rotary_embedding<2>(zigzag<"cp", 2>(r), {}, with_backward);
  (void)unzigzag(z);
}

//! CASE kv_sharded_on_seq dtensor attention: k or v is sharded on the sequence dim.*Ulysses.*Ring
#ifdef CASE_kv_sharded_on_seq
void f(const X<R, Shard<2>>& x) {
  (void)scaled_dot_product_attention(x, x, x);
}
#endif

//! CASE different_meshes dtensor attention: q, k and v must have one element type and one mesh
#ifdef CASE_different_meshes
void f(const X<R, R>& q, const DTensor<float, 4, MeshShape<Axis<"tp">>, Replicate>& k) {
  (void)scaled_dot_product_attention(q, k, k);
}
#endif

//! CASE head_dim_sharded dtensor attention: head_dim is sharded
#ifdef CASE_head_dim_sharded
void f(const X<R, Shard<3>>& x) {
  (void)scaled_dot_product_attention(x, x, x);
}
#endif

//! CASE partial_input dtensor attention: a Partial input to attention
#ifdef CASE_partial_input
void f(const X<R, Partial<>>& q, const X<R, R>& r) {
  (void)scaled_dot_product_attention(q, r, r);
}
#endif

//! CASE kv_sharded_q_replicate dtensor attention: k or v is sharded on a mesh axis where q is not sharded
#ifdef CASE_kv_sharded_q_replicate
void f(const X<R, R>& q, const X<R, Shard<1>>& kv) {
  (void)scaled_dot_product_attention(q, kv, kv);
}
#endif

//! CASE rope_head_dim_sharded dtensor rotary_embedding: head_dim .the last dim. is sharded
#ifdef CASE_rope_head_dim_sharded
void f(const X<R, Shard<3>>& x) {
  (void)rotary_embedding<2>(x);
}
#endif

//! CASE ring_placements_differ dtensor attention<Ring<axis>>: q, k and v must have the same placements
#ifdef CASE_ring_placements_differ
void f(const X<R, Shard<2>>& q, const X<Shard<0>, Shard<2>>& kv) {
  (void)attention<Ring<"cp">>(q, kv, kv);
}
#endif

//! CASE zigzag_not_ring dtensor attention: q, k and v in the Zigzag layout over a mesh axis run as attention<
#ifdef CASE_zigzag_not_ring
void f(const X<R, Shard<2>>& q) {
  const auto z = zigzag<"cp", 2>(q);
  (void)attention<Ulysses<"cp">>(z, z, z);
}
#endif

//! CASE zigzag_from_other_dim dtensor zigzag<axis, seq_dim>.x.: x must be Shard<seq_dim> .natural order.
#ifdef CASE_zigzag_from_other_dim
void f(const X<R, Shard<1>>& x) {
  (void)zigzag<"cp", 2>(x);
}
#endif

//! CASE zigzag_not_sharded dtensor Zigzag<axis, X>: X must be sharded on the sequence dim over that mesh axis
#ifdef CASE_zigzag_not_sharded
Zigzag<"cp", X<R, R>> z;
#endif

// Compile-fail cases for matmul and linear (ops/matmul.hpp; format: see vocabulary.cpp): the rule's message
// is the first error, before anything about the output type.
// Syntax only, never linked: the products may use the BLAS (<cblas.h> is on the default path).
#define DTENSOR_HAS_BLAS 1
#include <dtensor/ops/matmul.hpp>

using namespace dtensor;
using Mesh1 = MeshShape<Axis<"tp">>;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp">>;
template <class... Ps>
using X1 = DTensor<float, 2, Mesh1, Ps...>;
template <class... Ps>
using X = DTensor<float, 2, Mesh, Ps...>;
using P = Partial<>;
using R = Replicate;

// The control: column- and row-parallel products, with and without the backward, and a fitted product.
void control(const X<Shard<0>, R>& x, const X<R, Shard<0>>& w1, const X<R, Shard<1>>& w2,
             const DTensor<float, 1, Mesh, R, Shard<0>>& b1, const X1<Shard<1>>& a, const X1<Shard<1>>& b) {
  auto h = linear(x, w1, b1);                    // [S(0),S(1)]
  (void)linear(h, w2);                           // [S(0),P]
  auto [y, back] = matmul(x, w2, with_backward); // [S(0),S(1)]
  (void)back(y);
  (void)matmul(a, b, fewest_bytes); // b -> [S(0)]: [P]
}

//! CASE different_dims_one_axis dtensor op: the operands are sharded on different dims along one mesh axis
#ifdef CASE_different_dims_one_axis
void f(const X1<Shard<0>>& a, const X1<Shard<1>>& b) {
  (void)matmul(a, b);
}
#endif

//! CASE contracted_mismatch dtensor op: a contracted dim is sharded in one operand but not in the other
#ifdef CASE_contracted_mismatch
void f(const X<R, Shard<1>>& a, const X<R, R>& b) {
  (void)matmul(a, b);
}
#endif

//! CASE partial_product dtensor op: Partial . Partial is not Partial
#ifdef CASE_partial_product
void f(const X<P, R>& a, const X<P, R>& b) {
  (void)linear(a, b);
}
#endif

//! CASE with_backward dtensor op: the operands are sharded on different dims along one mesh axis
#ifdef CASE_with_backward
void f(const X1<Shard<0>>& a, const X1<Shard<1>>& b) {
  auto [c, back] = matmul(a, b, with_backward);
  (void)back(c);
}
#endif

//! CASE linear_bias_partial dtensor op: one operand is Partial and another Shard along the same mesh axis
#ifdef CASE_linear_bias_partial
void f(const X<R, R>& x, const X<R, Shard<0>>& w, const DTensor<float, 1, Mesh, R, P>& b) {
  (void)linear(x, w, b);
}
#endif

//! CASE partial_max_operand dtensor op: a Partial<max/min/product> input
#ifdef CASE_partial_max_operand
void f(const X<Partial<ReduceOp::max>, R>& a, const X<R, R>& b) {
  (void)matmul(a, b);
}
#endif

//! CASE mesh_mismatch matmul / linear: both operands must have one element type and one mesh
#ifdef CASE_mesh_mismatch
void f(const X<R, R>& a, const X1<R>& b) {
  (void)matmul(a, b);
}
#endif

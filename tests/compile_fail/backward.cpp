// Compile-fail cases for the backward of redistribute (backward/redistribute.hpp; format: see
// vocabulary.cpp).
#include <dtensor/backward/redistribute.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;
using X = DTensor<float, 2, Mesh, Shard<0>, Replicate>;
using PMax = DTensor<float, 2, Mesh, Partial<ReduceOp::max>, Replicate>;
using Back =
    RedistributeBackward<float, 2, Mesh, Placements<Shard<0>, Replicate>, Placements<Replicate, Replicate>>;

// The control: a linear backward with any linear gradient placements compiles.
void control(const X& x, const DTensor<float, 2, Mesh, Partial<>, Replicate>& dy) {
  auto [y, back] = redistribute_with_backward<Replicate, Replicate>(x);
  (void)y;
  (void)back(dy);
  (void)back.to<Shard<0>, Partial<>>(dy);
}

//! CASE partial_max backward: Partial<max/min/product> has no linear backward
#ifdef CASE_partial_max
void f(const PMax& p) {
  (void)redistribute_with_backward<Replicate, Replicate>(p);
}
#endif

//! CASE gradient_max backward: a gradient cannot be Partial<max/min/product>: gradients add up
#ifdef CASE_gradient_max
void f(const Back& back, const PMax& dy) {
  (void)back(dy);
}
#endif

//! CASE gradient_rank backward: the gradient must have the forward.s element type, rank and mesh shape
#ifdef CASE_gradient_rank
void f(const Back& back, const DTensor<float, 3, Mesh, Replicate, Replicate>& dy) {
  (void)back(dy);
}
#endif

//! CASE gradient_dtype backward: the gradient must have the forward.s element type, rank and mesh shape
#ifdef CASE_gradient_dtype
void f(const Back& back, const DTensor<double, 2, Mesh, Replicate, Replicate>& dy) {
  (void)back(dy);
}
#endif

//! CASE gradient_out backward_plan_of: Out must be the gradient placements of Src
#ifdef CASE_gradient_out
void f(const Back& back, const DTensor<float, 2, Mesh, Replicate, Replicate>& dy) {
  (void)back.to<Replicate, Replicate>(dy);
}
#endif

//! CASE shard_gradient_to_partial backward_plan_of: a Shard gradient cannot become Partial<sum>
#ifdef CASE_shard_gradient_to_partial
void f(const Back& back, const DTensor<float, 2, Mesh, Replicate, Shard<1>>& dy) {
  (void)back.to<Shard<0>, Partial<>>(dy);
}
#endif

//! CASE forward_shard_to_partial redistribute: Shard -> Partial is not a transition
#ifdef CASE_forward_shard_to_partial
void f(const X& x) {
  auto [y, back] = redistribute_with_backward<Partial<>, Replicate>(x);
  (void)back(y);
}
#endif

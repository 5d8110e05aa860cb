// Compile-fail cases for FSDP (train/fsdp.hpp; format: see vocabulary.cpp).
#include <dtensor/train/fsdp.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;
using Group = FlatParamGroup<float, Mesh, Fsdp<"dp">, Params<Param<2, Replicate, Shard<0>>, Param<1>>>;

// The control: a group on (dp, tp) with Partial<sum> or Replicate gradients over dp compiles.
void control(Group& g, const DTensor<float, 2, Mesh, Partial<>, Shard<0>>& dw,
             const DTensor<float, 1, Mesh, Replicate, Partial<>>& db) {
  g.reduce_gradients(dw, db);
}

//! CASE sharded_param FlatParamGroup: a parameter.s placements describe it unsharded, so they must be
#ifdef CASE_sharded_param
FlatParamGroup<float, Mesh, Fsdp<"dp">, Params<Param<2, Shard<0>, Replicate>>>* g;
void f() {
  (void)sizeof(*g);
}
#endif

//! CASE partial_param FlatParamGroup: a parameter cannot be Partial
#ifdef CASE_partial_param
FlatParamGroup<float, Mesh, Fsdp<"dp">, Params<Param<2, Replicate, Partial<>>>>* g;
void f() {
  (void)sizeof(*g);
}
#endif

//! CASE sharded_gradient FlatParamGroup::reduce_gradients: a gradient must be Partial<sum>
#ifdef CASE_sharded_gradient
void f(Group& g, const DTensor<float, 2, Mesh, Shard<0>, Shard<0>>& dw,
       const DTensor<float, 1, Mesh, Replicate, Replicate>& db) {
  g.reduce_gradients(dw, db);
}
#endif

//! CASE gradient_count FlatParamGroup::reduce_gradients: pass one gradient per parameter
#ifdef CASE_gradient_count
void f(Group& g, const DTensor<float, 2, Mesh, Partial<>, Shard<0>>& dw) {
  g.reduce_gradients(dw);
}
#endif

//! CASE same_axes Hsdp<replicate, shard>: the two axes must differ
#ifdef CASE_same_axes
FlatParamGroup<float, Mesh, Hsdp<"dp", "dp">, Params<Param<2>>>* g;
void f() {
  (void)sizeof(*g);
}
#endif

// Compile-fail cases for the layers of parallel/ (format: see vocabulary.cpp): the wiring of tensor-parallel
// layers is checked by the types.
// Syntax only, never linked: the layers' products may use the BLAS (<cblas.h> is on the default path).
#define DTENSOR_HAS_BLAS 1
#include <dtensor/nn/linear.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp">>;
template <class... Ps>
using X = DTensor<float, 2, Mesh, Ps...>;
using R = Replicate;

// The control: a column layer's output feeds a row layer.
void control(const nn::ColumnParallelLinear<float, Mesh>& up, const nn::RowParallelLinear<float, Mesh>& down,
             const X<Shard<0>, R>& x) {
  (void)down.forward(gelu(up.forward(x)));
}

//! CASE row_after_replicate RowParallelLinear: the input must be Shard<last> on the tp axis
#ifdef CASE_row_after_replicate
void f(const nn::RowParallelLinear<float, Mesh>& down, const X<Shard<0>, R>& x) {
  (void)down.forward(x);
}
#endif

//! CASE column_sharded_input ColumnParallelLinear: the input must be Replicate on the tp axis
#ifdef CASE_column_sharded_input
void f(const nn::ColumnParallelLinear<float, Mesh>& up, const X<R, Shard<1>>& x) {
  (void)up.forward(x);
}
#endif

//! CASE column_sp_wants_sequence ColumnParallelLinear: the input must be Replicate on the tp axis
#ifdef CASE_column_sp_wants_sequence
void f(const nn::ColumnParallelLinear<float, Mesh, "tp", true>& up, const X<Shard<0>, R>& x) {
  (void)up.forward(x);
}
#endif

//! CASE two_columns ColumnParallelLinear: the input must be Replicate on the tp axis
#ifdef CASE_two_columns
void f(const nn::ColumnParallelLinear<float, Mesh>& a, const nn::ColumnParallelLinear<float, Mesh>& b,
       const X<Shard<0>, R>& x) {
  (void)b.forward(a.forward(x));
}
#endif

// Compile-fail cases for DTensor::redistribute and typed plans (see vocabulary.cpp for the format).
#include <dtensor/tensor/dtensor.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;
using X = DTensor<float, 2, Mesh, Shard<0>, Replicate>;
using P = DTensor<float, 2, Mesh, Partial<ReduceOp::max>, Replicate>;

// The control: valid transitions compile.
void control(const X& x, const P& p) {
  (void)x.redistribute<Replicate, Shard<1>>();
  (void)p.redistribute<Replicate, Partial<ReduceOp::max>>();
}

//! CASE shard_to_partial redistribute: Shard -> Partial is not a transition: a shard is a piece of the tensor
#ifdef CASE_shard_to_partial
void f(const X& x) {
  (void)x.redistribute<Partial<>, Replicate>();
}
#endif

//! CASE partial_op_change redistribute: Partial<a> -> Partial<b> with a different op is not a transition
#ifdef CASE_partial_op_change
void f(const P& p) {
  (void)p.redistribute<Partial<ReduceOp::sum>, Replicate>();
}
#endif

//! CASE target_not_a_placement placements must be Shard<D>, Replicate or Partial<ReduceOp>
#ifdef CASE_target_not_a_placement
void f(const X& x) {
  (void)x.redistribute<int, Replicate>();
}
#endif

//! CASE target_wrong_count wrong number of placements: give exactly one placement per mesh axis
#ifdef CASE_target_wrong_count
void f(const X& x) {
  (void)x.redistribute<Replicate>();
}
#endif

//! CASE target_shard_dim Shard<D>: D must be in .-rank, rank. of the tensor
#ifdef CASE_target_shard_dim
void f(const X& x) {
  (void)x.redistribute<Shard<2>, Replicate>();
}
#endif

//! CASE target_mixed_partial Partial placements with different ops on different mesh axes: only Partial<sum>
#ifdef CASE_target_mixed_partial
void f(const X& x) {
  (void)x.redistribute<Partial<ReduceOp::max>, Partial<ReduceOp::min>>();
}
#endif

//! CASE dtensor_bad_placements wrong number of placements: give exactly one placement per mesh axis
#ifdef CASE_dtensor_bad_placements
DTensor<float, 2, Mesh, Shard<0>>* bad = nullptr;
void f() {
  (void)sizeof(*bad);
}
#endif

//! CASE plan_of_shard_to_partial redistribute: Shard -> Partial is not a transition
#ifdef CASE_plan_of_shard_to_partial
constexpr auto plan = plan_of<Mesh, 2, Placements<Shard<0>, Replicate>, Placements<Partial<>, Replicate>>();
#endif

//! CASE unsupported_element_type dtensor::Tensor<T, Rank>: T must be float, double, dtensor::bfloat16
#ifdef CASE_unsupported_element_type
Tensor<char, 1> t;
#endif

int main() {}

//! CASE bitwise_partial_of_float DTensor: Partial<band>, Partial<bor> and Partial<bxor> are bitwise
#ifdef CASE_bitwise_partial_of_float
void f(const DTensor<float, 2, Mesh, Partial<ReduceOp::bxor>, Replicate>& p) {
  (void)p.local();
}
#endif

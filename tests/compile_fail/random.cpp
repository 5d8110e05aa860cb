// Compile-fail cases for random numbers (local/random.hpp, ops/random.hpp). The file compiles as a
// program that includes the headers and may or may not have Random123 (case no_random123 hides it).
#include <cstdint>

#ifdef CASE_no_random123
#define DTENSOR_HAS_RANDOM123 0
#endif

#include <dtensor/ops/random.hpp>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;

//! CASE no_random123 dtensor random numbers .rand, randn, dropout. need Random123.s headers: install
#ifdef CASE_no_random123
void f(const Tensor<float, 2>& t) {
  local::rand_into(t, 1, 0, GlobalBlock<2>{{0, 0}, t.shape()});
}
#endif

//! CASE integer_type dtensor random numbers: the element type must be float, double, bfloat16 or half
#ifdef CASE_integer_type
void f(const Tensor<std::int32_t, 2>& t) {
  local::randn_into(t, 1, 0, GlobalBlock<2>{{0, 0}, t.shape()});
}
#endif

//! CASE dropout_partial_max dtensor op: a Partial<max/min/product> input: only Partial<sum/avg> pass through
#ifdef CASE_dropout_partial_max
void f(const DTensor<float, 2, Mesh, Partial<ReduceOp::max>, Replicate>& x) {
  (void)dropout(x, 0.1, 1);
}
#endif

//! CASE wrong_placement_count wrong number of placements
#ifdef CASE_wrong_placement_count
void f(const DeviceMesh<Mesh>& mesh) {
  (void)rand<Shard<0>>(mesh, {4, 4}, 1);
}
#endif

// Compile-fail cases for the local GEMM (local/gemm.hpp). These compile without dtensor::blas, as a
// program that did not link it: the header itself compiles, a host GEMM does not.
#include <cstdint>

#include <dtensor/local/gemm.hpp>

using namespace dtensor;

//! CASE no_blas dtensor ops need a BLAS: link the dtensor::blas target .Debian: libopenblas-dev.
#ifdef CASE_no_blas
void f(const Tensor<float, 2>& a, const Tensor<float, 2>& b, const Tensor<float, 2>& c) {
  local::matmul_into(a, b, c);
}
#endif

//! CASE integer_type dtensor::local::matmul: T must be float, double, dtensor::bfloat16 or dtensor::half
#ifdef CASE_integer_type
void f(const Tensor<std::int32_t, 2>& a, const Tensor<std::int32_t, 2>& b) {
  local::matmul(a, b);
}
#endif

//! CASE rank_mismatch dtensor::local::matmul: a .m, k. x b .k, n., or a batched a .batch, m, k. x b .batch
#ifdef CASE_rank_mismatch
void f(const Tensor<float, 2>& a, const Tensor<float, 3>& b) {
  local::matmul(a, b);
}
#endif

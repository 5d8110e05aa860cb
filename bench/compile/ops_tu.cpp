// Compile-cost probe (bench/compile/compile_time.sh): <dtensor/ops.hpp> (the umbrella plus ops/) and 20
// different ops on DTensors (pointwise, reductions, transpose, matmul/linear where a BLAS is found), several
// with their backward; each op's output placements are decided at compile time.
#include <dtensor/ops.hpp>

using namespace dtensor;
using M1 = MeshShape<Axis<"x">>;
using M2 = MeshShape<Axis<"dp">, Axis<"tp">>;
template <class M, class... Ps>
using X = DTensor<float, 2, M, Ps...>;
using R = Replicate;
using P = Partial<>;

auto o01(const X<M1, Shard<0>>& x) {
  return relu(x);
}
auto o02(const X<M2, Shard<0>, R>& x) {
  return gelu(x);
}
auto o03(const X<M2, R, Shard<1>>& x) {
  return silu(x, with_backward);
}
auto o04(const X<M1, R>& x) {
  return exp(x);
}
auto o05(const X<M2, P, Shard<1>>& x) {
  return scale(x, 0.5);
}
auto o06(const X<M1, P>& a, const X<M1, P>& b) {
  return add(a, b, with_backward);
}
auto o07(const X<M2, Shard<0>, R>& a, const X<M2, R, R>& b) {
  return sub(a, b);
}
auto o08(const X<M1, P>& a, const X<M1, R>& b) {
  return mul(a, b, with_backward);
}
auto o09(const X<M2, Shard<0>, Shard<1>>& a, const DTensor<float, 1, M2, R, Shard<0>>& b) {
  return add(a, b);
}
auto o10(const X<M1, R>& a, const X<M1, R>& b) {
  return div(a, b);
}
auto o11(const X<M1, Shard<1>>& x) {
  return sum<1>(x, with_backward);
}
auto o12(const X<M2, Shard<0>, P>& x) {
  return mean<0>(x);
}
auto o13(const X<M2, Shard<1>, R>& x) {
  return max<1>(x);
}
auto o14(const X<M1, Shard<0>>& x) {
  return min<0>(x);
}
auto o15(const X<M2, Shard<0>, R>& x) {
  return transpose<0, 1>(x, with_backward);
}
auto o16(const X<M1, R>& x) {
  return add(x, 1.0);
}
#if DTENSOR_HAS_BLAS
auto o17(const X<M1, R>& x, const X<M1, Shard<1>>& w) {
  return matmul(x, w, with_backward);
}
auto o18(const X<M1, Shard<1>>& h, const X<M1, Shard<0>>& w) {
  return matmul(h, w);
}
auto o19(const DTensor<float, 3, M2, Shard<0>, R>& x, const X<M2, R, Shard<0>>& w) {
  return linear(x, w, with_backward);
}
auto o20(const X<M2, R, Shard<1>>& a, const X<M2, R, Shard<0>>& b) {
  return matmul(a, b);
}
#else
auto o17(const X<M1, Shard<0>>& x) {
  return relu(x, with_backward);
}
auto o18(const X<M1, Shard<0>>& x) {
  return exp(x, with_backward);
}
auto o19(const X<M2, R, P>& x) {
  return sum<1>(x);
}
auto o20(const X<M2, R, R>& a, const X<M2, R, R>& b) {
  return mul(a, b);
}
#endif

// Compile-cost probe (bench/compile/compile_time.sh): the umbrella header plus DTensor, and 20 different
// redistributions instantiated (each plan is computed at compile time and the executor instantiated).
#include <dtensor/dtensor.hpp>
#include <dtensor/tensor/distribute.hpp>

using namespace dtensor;
using M1 = MeshShape<Axis<"x">>;
using M2 = MeshShape<Axis<"dp">, Axis<"tp">>;
using M3 = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp", 2>>;
using R = Replicate;
using P = Partial<>;
template <int D>
using S = Shard<D>;
template <class M, class... Ps>
using X = DTensor<float, 2, M, Ps...>;

auto r01(const X<M1, S<0>>& x) {
  return x.redistribute<R>();
}
auto r02(const X<M1, R>& x) {
  return x.redistribute<S<1>>();
}
auto r03(const X<M1, S<0>>& x) {
  return x.redistribute<S<1>>();
}
auto r04(const X<M1, P>& x) {
  return x.redistribute<R>();
}
auto r05(const X<M1, P>& x) {
  return x.redistribute<S<0>>();
}
auto r06(const X<M1, R>& x) {
  return x.redistribute<P>();
}
auto r07(const X<M2, S<0>, S<1>>& x) {
  return x.redistribute<S<1>, S<0>>();
}
auto r08(const X<M2, S<0>, S<0>>& x) {
  return x.redistribute<R, S<1>>();
}
auto r09(const X<M2, S<0>, R>& x) {
  return x.redistribute<R, S<1>>();
}
auto r10(const X<M2, S<0>, S<0>>& x) {
  return x.redistribute<S<1>, S<1>>();
}
auto r11(const X<M2, S<0>, S<1>>& x) {
  return x.redistribute<S<0>, S<0>>();
}
auto r12(const X<M2, R, S<1>>& x) {
  return x.redistribute<S<1>, S<0>>();
}
auto r13(const X<M2, S<0>, S<1>>& x) {
  return x.redistribute<R, R>();
}
auto r14(const X<M2, P, P>& x) {
  return x.redistribute<R, S<1>>();
}
auto r15(const X<M2, P, P>& x) {
  return x.redistribute<S<0>, S<1>>();
}
auto r16(const X<M2, P, S<0>>& x) {
  return x.redistribute<S<0>, R>();
}
auto r17(const X<M3, S<0>, S<1>, R>& x) {
  return x.redistribute<S<1>, S<0>, R>();
}
auto r18(const X<M3, S<0>, S<0>, S<0>>& x) {
  return x.redistribute<S<1>, S<1>, S<1>>();
}
auto r19(const X<M3, S<0>, S<1>, S<0>>& x) {
  return x.redistribute<R, R, R>();
}
auto r20(const X<M3, P, S<0>, S<1>>& x) {
  return x.redistribute<S<1>, S<0>, R>();
}

int main() {
  return 0;
}

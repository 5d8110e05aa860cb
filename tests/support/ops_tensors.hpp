#pragma once
// Helpers shared by the tests of ops/: placement lists as type lists, and DTensors filled with a known
// integer-valued global tensor whose Partial axes hold cancelling noise. Inside a rank (a thread of
// run_ranks) throw dtensor::Error (expect) rather than using Catch2's macros.

#include <dtensor/core/error.hpp>
#include <dtensor/core/extents.hpp>
#include <dtensor/layout/shard_spec.hpp>
#include <dtensor/tensor/dtensor.hpp>

#include <cmath>
#include <cstdint>
#include <string>

namespace dtensor::test_support {

// The placements and meshes the ops tests use.
using R = Replicate;
using P = Partial<>;
using Pavg = Partial<ReduceOp::avg>;
template <int D>
using S = Shard<D>;
using Mesh1 = MeshShape<Axis<"x">>;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;

inline void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

template <class... T>
struct TypeList {};

template <class F, class... T>
void for_each(TypeList<T...>, F f) {
  (f.template operator()<T>(), ...);
}

template <class Mesh, int Rank, class PL>
struct dt;
template <class Mesh, int Rank, class... Ps>
struct dt<Mesh, Rank, Placements<Ps...>> {
  using type = DTensor<double, Rank, Mesh, Ps...>;
};

// The global value at a flat index, an integer in [-3, 3] (a seed selects the tensor).
inline double value(int seed, std::int64_t flat) {
  return double((flat * 7 + seed * 13 + (flat * flat) % 5) % 7 - 3);
}

// This rank's local tensor of a DTensor of type DT holding value(seed, .): the first coordinate of the
// Partial axes holds the value (times the Partial<avg> axes' sizes, which the avg divides away), every
// coordinate noise that cancels, as any partial values may.
template <class DT, class Mesh>
DT make(const Mesh& mesh, const typename DT::shape_type& shape, int seed) {
  const Extents global = detail::to_extents(shape);
  const Block b = spec_block(global, DT::spec, mesh.sizes(), mesh.coordinate());
  int index = 0;
  int count = 1;
  double avg = 1; // product of the Partial<avg> axes' sizes
  for (int a = 0; a < DT::placements.size(); ++a) {
    if (DT::placements[a].is_partial()) {
      index = index * mesh.size(a) + mesh.coordinate()[a];
      count *= mesh.size(a);
      avg *= DT::placements[a].op == ReduceOp::avg ? mesh.size(a) : 1;
    }
  }
  typename DT::shape_type local_shape{};
  for (int d = 0; d < DT::rank; ++d) {
    local_shape[d] = b.shape[d];
  }
  typename DT::local_type t(local_shape);
  const std::int64_t n = t.numel();
  for (std::int64_t e = 0; e < n; ++e) {
    std::int64_t rest = e;
    std::int64_t flat = 0;
    std::int64_t stride = 1;
    for (int d = DT::rank - 1; d >= 0; --d) {
      const std::int64_t i = rest % b.shape[d];
      rest /= b.shape[d];
      flat += (b.offset[d] + i) * stride;
      stride *= global[d];
    }
    const double v = value(seed, flat);
    const double k = double(flat % 3 + 1);
    const double noise = count == 1 ? 0 : (index == 0 ? -(count - 1) * k : k);
    t.data()[e] = (index == 0 ? v * avg : 0) + noise;
  }
  return DT(mesh, t, shape);
}

// Every element of full(y) equals want(flat index), within tol relative.
template <class Y, class F>
void check_full(const Y& y, F want, double tol, const std::string& what) {
  const auto full = y.full_tensor();
  for (std::int64_t e = 0; e < full.numel(); ++e) {
    const double got = full.data()[e];
    const double w = want(e);
    expect(std::abs(got - w) <= tol * (1 + std::abs(w)), what + ": element " + std::to_string(e) + " is " +
                                                             std::to_string(got) + ", want " +
                                                             std::to_string(w));
  }
}

} // namespace dtensor::test_support

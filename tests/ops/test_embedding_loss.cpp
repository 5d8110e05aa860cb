// embedding (ops/embedding.hpp) and cross_entropy on vocab-sharded logits (ops/loss.hpp) against a
// single-process computation, forward and backward (the loss's gradient also by central finite
// differences), on 1-D meshes of 1-4 ranks and on (2,2): ids and weights replicated, sharded on the
// positions, vocab parallel (uneven and empty vocab shards: 7 rows over 4 ranks), hidden sharded; logits
// sharded on the vocab and on the rows, a row with ignore_index. loss_parallel never gathers the logits.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/embedding.hpp>
#include <dtensor/ops/loss.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

constexpr std::int64_t vocab = 7;

// DT with int64 elements.
template <class DT>
struct ids_of;
template <class T, int Rank, class Shape, class... Ps>
struct ids_of<DTensor<T, Rank, Shape, Ps...>> {
  using type = DTensor<std::int64_t, Rank, Shape, Ps...>;
};

// The id at a flat position: every id of [0, vocab) appears, some several times.
std::int64_t id_at(std::int64_t flat) {
  return (flat * 5 + 3) % vocab;
}

// A DTensor of ids of type DT: this rank's block of f(flat index).
template <class DT, class Mesh, class F>
DT make_ids(const Mesh& mesh, const typename DT::shape_type& shape, F f) {
  const Extents global = detail::to_extents(shape);
  const Block b = spec_block(global, DT::spec, mesh.sizes(), mesh.coordinate());
  typename DT::shape_type local_shape{};
  for (int d = 0; d < DT::rank; ++d) {
    local_shape[d] = b.shape[d];
  }
  typename DT::local_type t(local_shape);
  for (std::int64_t e = 0; e < t.numel(); ++e) {
    std::int64_t rest = e;
    std::int64_t flat = 0;
    std::int64_t stride = 1;
    for (int d = DT::rank - 1; d >= 0; --d) {
      const std::int64_t i = rest % b.shape[d];
      rest /= b.shape[d];
      flat += (b.offset[d] + i) * stride;
      stride *= global[d];
    }
    t.data()[e] = f(flat);
  }
  return DT(mesh, t, shape);
}

template <class Mesh, class IdsPL, class WPL, class... Sizes>
void embedding_case(int ranks, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    using Ids = typename ids_of<typename dt<Mesh, 2, IdsPL>::type>::type;
    using W = typename dt<Mesh, 2, WPL>::type;
    const std::int64_t hidden = 5;
    const Ids ids = make_ids<Ids>(mesh, {4, 3}, id_at);
    const W w = make<W>(mesh, {vocab, hidden}, 2);
    const std::string name = "ids " + to_string(Ids::placements) + ", weight " + to_string(W::placements);
    auto [y, back] = embedding(ids, w, with_backward);
    using Y = std::remove_cvref_t<decltype(y)>;
    static_assert(Y::rank == 3);
    check_full(
        y, [&](std::int64_t e) { return value(2, id_at(e / hidden) * hidden + e % hidden); }, 0,
        "embedding " + name);
    const Y g = make<Y>(mesh, y.global_shape(), 7);
    check_full(
        back(g),
        [&](std::int64_t e) {
          const std::int64_t v = e / hidden;
          const std::int64_t h = e % hidden;
          double s = 0;
          for (std::int64_t p = 0; p < 12; ++p) {
            s += id_at(p) == v ? value(7, p * hidden + h) : 0.0;
          }
          return s;
        },
        0, "embedding backward " + name);
  });
}

// Mean cross-entropy of logits x (rows, vocab) against targets t (ignore_index rows skipped).
double loss_ref(const std::vector<double>& x, const std::vector<std::int64_t>& t) {
  const std::int64_t rows = static_cast<std::int64_t>(t.size());
  double total = 0;
  double count = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (t[static_cast<std::size_t>(r)] == ignore_index) {
      continue;
    }
    double m = -1e300;
    for (std::int64_t k = 0; k < vocab; ++k) {
      m = std::max(m, x[static_cast<std::size_t>(r * vocab + k)]);
    }
    double s = 0;
    for (std::int64_t k = 0; k < vocab; ++k) {
      s += std::exp(x[static_cast<std::size_t>(r * vocab + k)] - m);
    }
    total += std::log(s) + m - x[static_cast<std::size_t>(r * vocab + t[static_cast<std::size_t>(r)])];
    count += 1;
  }
  return total / count;
}

std::int64_t target_at(std::int64_t r) {
  return r == 2 ? ignore_index : (r * 3 + 1) % vocab;
}

template <class Mesh, class XPL, class TPL, class... Sizes>
void loss_case(int ranks, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    using X = typename dt<Mesh, 2, XPL>::type;
    using Target = typename ids_of<typename dt<Mesh, 1, TPL>::type>::type;
    const std::int64_t rows = 6;
    const X x = make<X>(mesh, {rows, vocab}, 1);
    const Target t = make_ids<Target>(mesh, {rows}, target_at);
    std::vector<double> xv(static_cast<std::size_t>(rows * vocab));
    for (std::size_t e = 0; e < xv.size(); ++e) {
      xv[e] = value(1, static_cast<std::int64_t>(e));
    }
    std::vector<std::int64_t> tv(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) {
      tv[static_cast<std::size_t>(r)] = target_at(r);
    }
    const std::string name = "logits " + to_string(X::placements);
    CommDebugMode debug;
    auto [loss, back] = cross_entropy(x, t, with_backward);
    expect(debug.count("all_gather") == 0, name + ": loss_parallel gathered:\n" + debug.to_string());
    const double got = loss.full_tensor().data()[0];
    const double want = loss_ref(xv, tv);
    expect(std::abs(got - want) <= 1e-13 * std::abs(want),
           name + ": loss " + std::to_string(got) + ", want " + std::to_string(want));
    // The gradient of 0.5 * loss, against central differences of the reference.
    const X dx = back(0.5);
    check_full(
        dx,
        [&](std::int64_t e) {
          std::vector<double> v = xv;
          const double h = 1e-5;
          v[static_cast<std::size_t>(e)] += h;
          const double up = loss_ref(v, tv);
          v[static_cast<std::size_t>(e)] -= 2 * h;
          return 0.5 * (up - loss_ref(v, tv)) / (2 * h);
        },
        1e-8, name + ": dlogits");
  });
}

} // namespace

TEST_CASE("embedding: replicated, position-sharded, vocab-parallel and hidden-sharded weights, forward and "
          "backward, on 1-4 ranks and (2,2)",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    embedding_case<Mesh1, Placements<R>, Placements<R>>(n);
    embedding_case<Mesh1, Placements<S<0>>, Placements<R>>(n);
    embedding_case<Mesh1, Placements<S<1>>, Placements<R>>(n);
    embedding_case<Mesh1, Placements<R>, Placements<S<0>>>(n);
    embedding_case<Mesh1, Placements<R>, Placements<S<1>>>(n);
  }
  embedding_case<Mesh2, Placements<S<0>, R>, Placements<R, S<0>>>(4, 2, 2);
  embedding_case<Mesh2, Placements<S<0>, R>, Placements<R, S<1>>>(4, 2, 2);
  embedding_case<Mesh2, Placements<R, R>, Placements<S<0>, S<0>>>(4, 2, 2);
  embedding_case<Mesh2, Placements<R, S<1>>, Placements<S<0>, R>>(4, 2, 2);
}

TEST_CASE("cross_entropy on logits sharded on the vocab and the rows: loss and gradient, no gather, on 1-4 "
          "ranks and (2,2)",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    loss_case<Mesh1, Placements<S<1>>, Placements<R>>(n);
    loss_case<Mesh1, Placements<S<0>>, Placements<S<0>>>(n);
    loss_case<Mesh1, Placements<R>, Placements<R>>(n);
  }
  loss_case<Mesh2, Placements<S<0>, S<1>>, Placements<S<0>, R>>(4, 2, 2);
  loss_case<Mesh2, Placements<R, S<1>>, Placements<R, R>>(4, 2, 2);
  loss_case<Mesh2, Placements<S<1>, S<1>>, Placements<R, R>>(4, 2, 2);
}

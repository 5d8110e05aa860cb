// embedding (ops/embedding.hpp) and cross_entropy on vocab-sharded logits (ops/loss.hpp) against a
// single-process computation, forward and backward (the loss's gradient also by central finite
// differences), on 1-D meshes of 1-4 ranks and on (2,2): ids and weights replicated, sharded on the
// positions, vocab parallel (uneven and empty vocab shards: 7 rows over 4 ranks), hidden sharded; logits
// sharded on the vocab and on the rows, a row with ignore_index. loss_parallel never gathers the logits:
// its collectives are pinned exactly (CommDebugMode: op, axis, reduce op, count and bytes), and logits
// near +-700 in double with an empty vocab shard (vocab 5 over 4 ranks) and rows of 67-268 columns per
// shard (the host row kernels' lane and block paths and their tails) are checked against the formula.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/core/extents.hpp>
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
double loss_ref(const std::vector<double>& x, const std::vector<std::int64_t>& t,
                std::int64_t vocab = ::vocab) {
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

// The bytes CommDebugMode counts for an all_reduce of `count` elements of `size` bytes over n ranks: a
// ring's 2(n-1)/n of the buffer, rounded up (comm/comm_debug.hpp).
std::int64_t ring_bytes(int n, std::int64_t count, std::int64_t size) {
  return n > 1 ? (2 * (n - 1) * count + n - 1) / n * size : 0;
}

// cross_entropy's collectives on logits of type X, from its contract (ops/loss.hpp): over the mesh axes
// that shard the vocab (one group, flattened where there are several: the planner reduces Partial axes of
// one op together), one all_reduce(max) of one value per local row and one all_reduce(sum) of two; over
// the axes that shard the rows, one all_reduce(sum) of two doubles (the loss's sum and count); nothing
// else, and nothing in the backward. `rows` is this rank's row count.
template <class X, class Mesh>
void expect_loss_comm(const CommDebugMode& debug, const Mesh& mesh, std::int64_t rows,
                      const std::string& name) {
  using T = typename X::value_type;
  AxisMask vocab = 0;
  AxisMask row = 0;
  int n_vocab = 1;
  int n_row = 1;
  for (int a = 0; a < X::placements.size(); ++a) {
    const Placement q = normalize(X::placements[a], X::rank);
    if (q == Placement::shard(X::rank - 1)) {
      vocab |= axis_bit(a);
      n_vocab *= mesh.size(a);
    } else if (q.is_shard()) {
      row |= axis_bit(a);
      n_row *= mesh.size(a);
    }
  }
  // Axes of size 1 take no part (over them only: no collective).
  vocab &= ~mesh.unit_axes();
  row &= ~mesh.unit_axes();
  std::int64_t ops = 0;
  for (const AxisMask group : {vocab, row}) {
    if (group == 0) {
      continue;
    }
    const bool on_vocab = group == vocab;
    const std::string axes = axes_to_string(group, mesh.names(), X::placements.size());
    const std::int64_t max_count = debug.count("all_reduce", axes, ReduceOp::max);
    const std::int64_t max_bytes = debug.bytes("all_reduce", axes, ReduceOp::max);
    const std::int64_t sum_count = debug.count("all_reduce", axes, ReduceOp::sum);
    const std::int64_t sum_bytes = debug.bytes("all_reduce", axes, ReduceOp::sum);
    const std::int64_t want_max = on_vocab ? 1 : 0;
    const std::int64_t want_max_bytes = on_vocab ? ring_bytes(n_vocab, rows, sizeof(T)) : 0;
    const std::int64_t want_sum_bytes =
        on_vocab ? ring_bytes(n_vocab, 2 * rows, sizeof(T)) : ring_bytes(n_row, 2, sizeof(double));
    expect(max_count == want_max && max_bytes == want_max_bytes && sum_count == 1 &&
               sum_bytes == want_sum_bytes,
           name + ": over " + axes + " want " + std::to_string(want_max) + " all_reduce(max) of " +
               std::to_string(want_max_bytes) + " bytes and 1 all_reduce(sum) of " +
               std::to_string(want_sum_bytes) + " bytes, got\n" + debug.to_string());
    ops += want_max + 1;
  }
  expect(debug.total_count() == ops && debug.count("all_reduce") == ops,
         name + ": want " + std::to_string(ops) + " collectives, all of them all_reduces, got\n" +
             debug.to_string());
}

// cross_entropy on logits (rows..., vocab) of value(1, .) against target_at: rank 2 (6 rows) or rank 3 (batch
// 3, seq 5: the batch or the sequence sharded like the rows of data and context parallelism). The loss and
// gradient equal those of the same rows flattened to (rows, vocab); the collectives are pinned.
template <class Mesh, int Rank, class XPL, class TPL, class... Sizes>
void loss_case(int ranks, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    using X = typename dt<Mesh, Rank, XPL>::type;
    using Target = typename ids_of<typename dt<Mesh, Rank - 1, TPL>::type>::type;
    typename X::shape_type shape{};
    typename Target::shape_type lead{};
    if constexpr (Rank == 2) {
      shape = {6, vocab};
      lead = {6};
    } else {
      shape = {3, 5, vocab};
      lead = {3, 5};
    }
    const X x = make<X>(mesh, shape, 1);
    const Target t = make_ids<Target>(mesh, lead, target_at);
    const std::int64_t rows = Rank == 2 ? 6 : 15;
    std::vector<double> xv(static_cast<std::size_t>(rows * vocab));
    for (std::size_t e = 0; e < xv.size(); ++e) {
      xv[e] = value(1, static_cast<std::int64_t>(e));
    }
    std::vector<std::int64_t> tv(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) {
      tv[static_cast<std::size_t>(r)] = target_at(r);
    }
    const std::string name = "logits " + to_string(X::placements) + " of rank " + std::to_string(Rank) +
                             " on " + std::to_string(ranks);
    CommDebugMode debug;
    auto [loss, back] = cross_entropy(x, t, with_backward);
    expect(debug.count("all_gather") == 0, name + ": loss_parallel gathered:\n" + debug.to_string());
    std::int64_t local_rows = 1; // the rows this rank holds: its block's leading dims
    for (int d = 0; d + 1 < Rank; ++d) {
      local_rows *= x.local().shape()[d];
    }
    expect_loss_comm<X>(debug, mesh, local_rows, name);
    const double got = loss.full_tensor().data()[0];
    const double want = loss_ref(xv, tv);
    expect(std::abs(got - want) <= 1e-13 * std::abs(want),
           name + ": loss " + std::to_string(got) + ", want " + std::to_string(want));
    // The gradient of 0.5 * loss, against central differences of the reference; the backward does not
    // communicate.
    debug.reset();
    const X dx = back(0.5);
    expect(debug.total_count() == 0, name + ": the backward communicated\n" + debug.to_string());
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

// Logits near +-700 (even rows about +700, odd rows about -700, integer offsets in [-3, 3]): exp of them
// overflows or underflows double unless shifted by the true row max; a row max completed by anything but
// a max (a sum of the shards' maxima, or -inf from an empty shard) gives inf or NaN here.
double far_logit(std::int64_t flat, std::int64_t vocab) {
  return (flat / vocab % 2 == 0 ? 700.0 : -700.0) + value(4, flat);
}
std::int64_t far_target(std::int64_t r, std::int64_t vocab) {
  return r == 3 ? ignore_index : (r * 5 + 2) % vocab;
}

// cross_entropy on logits (rows, vocab) of far_logit against the formula: the loss, the gradient
// (softmax(x) - onehot(target)) g / count written out in double, and the collectives.
template <class Mesh, class XPL, class TPL, class... Sizes>
void far_loss_case(int ranks, std::int64_t rows, std::int64_t vocab, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    using X = typename dt<Mesh, 2, XPL>::type;
    using Target = typename ids_of<typename dt<Mesh, 1, TPL>::type>::type;
    const X x = make_ids<X>(mesh, {rows, vocab}, [&](std::int64_t e) { return far_logit(e, vocab); });
    const Target t = make_ids<Target>(mesh, {rows}, [&](std::int64_t r) { return far_target(r, vocab); });
    std::vector<double> xv(static_cast<std::size_t>(rows * vocab));
    for (std::size_t e = 0; e < xv.size(); ++e) {
      xv[e] = far_logit(static_cast<std::int64_t>(e), vocab);
    }
    std::vector<std::int64_t> tv(static_cast<std::size_t>(rows));
    double count = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      tv[static_cast<std::size_t>(r)] = far_target(r, vocab);
      count += tv[static_cast<std::size_t>(r)] == ignore_index ? 0 : 1;
    }
    const std::string name = "logits near +-700 " + to_string(X::placements) + " (" + std::to_string(rows) +
                             ", " + std::to_string(vocab) + ") on " + std::to_string(ranks) + " ranks";
    CommDebugMode debug;
    auto [loss, back] = cross_entropy(x, t, with_backward);
    expect_loss_comm<X>(debug, mesh, x.local().shape()[0], name);
    const double got = loss.full_tensor().data()[0];
    const double want = loss_ref(xv, tv, vocab);
    expect(std::isfinite(want) && std::abs(got - want) <= 1e-12 * std::abs(want),
           name + ": loss " + std::to_string(got) + ", want " + std::to_string(want));
    const double g = 0.5;
    check_full(
        back(g),
        [&](std::int64_t e) {
          const std::int64_t r = e / vocab;
          const std::int64_t target = tv[static_cast<std::size_t>(r)];
          if (target == ignore_index) {
            return 0.0;
          }
          const double* row = xv.data() + r * vocab;
          double m = row[0];
          for (std::int64_t k = 1; k < vocab; ++k) {
            m = std::max(m, row[k]);
          }
          double s = 0;
          for (std::int64_t k = 0; k < vocab; ++k) {
            s += std::exp(row[k] - m);
          }
          const double p = std::exp(row[e % vocab] - m) / s;
          return (p - (e % vocab == target ? 1.0 : 0.0)) * g / count;
        },
        1e-12, name + ": dlogits");
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
    loss_case<Mesh1, 2, Placements<S<1>>, Placements<R>>(n);
    loss_case<Mesh1, 2, Placements<S<0>>, Placements<S<0>>>(n);
    loss_case<Mesh1, 2, Placements<R>, Placements<R>>(n);
  }
  loss_case<Mesh2, 2, Placements<S<0>, S<1>>, Placements<S<0>, R>>(4, 2, 2);
  loss_case<Mesh2, 2, Placements<R, S<1>>, Placements<R, R>>(4, 2, 2);
  loss_case<Mesh2, 2, Placements<S<1>, S<1>>, Placements<R, R>>(4, 2, 2);
}

TEST_CASE("cross_entropy on logits (batch, seq, vocab): rows sharded on the batch, the sequence or both, the "
          "vocab beside them, on 1-4 ranks and (2,2)",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    loss_case<Mesh1, 3, Placements<S<1>>, Placements<S<1>>>(n);
    loss_case<Mesh1, 3, Placements<S<2>>, Placements<R>>(n);
  }
  loss_case<Mesh2, 3, Placements<S<0>, S<2>>, Placements<S<0>, R>>(4, 2, 2);
  loss_case<Mesh2, 3, Placements<S<1>, S<2>>, Placements<S<1>, R>>(4, 2, 2);
  loss_case<Mesh2, 3, Placements<S<0>, S<1>>, Placements<S<0>, S<1>>>(4, 2, 2);
  loss_case<Mesh2, 3, Placements<S<1>, S<1>>, Placements<S<1>, S<1>>>(4, 2, 2);
}

TEST_CASE(
    "cross_entropy on logits near +-700 in double: an empty vocab shard (vocab 5 over 4 ranks), rows of "
    "67-268 columns per shard, one all_reduce(max) over the vocab axis, on 1-4 ranks and (2,2)",
    "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    for (std::int64_t v : {std::int64_t(5), std::int64_t(268)}) { // 268: 67 columns a shard at 4 ranks
      far_loss_case<Mesh1, Placements<S<1>>, Placements<R>>(n, 6, v);
      far_loss_case<Mesh1, Placements<S<0>>, Placements<S<0>>>(n, 6, v);
    }
    far_loss_case<Mesh1, Placements<R>, Placements<R>>(n, 6, 67);
  }
  far_loss_case<Mesh2, Placements<S<0>, S<1>>, Placements<S<0>, R>>(4, 6, 5, 2, 2);
  far_loss_case<Mesh2, Placements<S<1>, S<1>>, Placements<R, R>>(4, 6, 5, 2, 2);
  far_loss_case<Mesh2, Placements<S<0>, S<1>>, Placements<S<0>, R>>(4, 6, 134, 2, 2);
  far_loss_case<Mesh2, Placements<S<1>, S<1>>, Placements<R, R>>(4, 3, 268, 2, 2);
}

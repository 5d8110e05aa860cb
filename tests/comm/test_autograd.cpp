// dtensor::autograd: every forward/backward pair at 1-4 ranks, along every dim of a rank-3 tensor, with
// even, uneven and empty blocks: the forward and the backward against a single-process reference, the
// adjoint identity <A x, gy> == <x, back(gy)> (global inner products; integer-valued data keeps them
// exact), the async forms against the synchronous ones, the collectives CommDebugMode sees, and errors.
// Every member can rebuild every member's data (value() of seed, member, index), which is how the
// references are computed.

#include "common.hpp"

#include "dtensor/backward/collectives.hpp"
#include "dtensor/comm/comm_debug.hpp"
#include "dtensor/layout/algebra.hpp"

#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <vector>

using namespace comm_test;
namespace ag = dtensor::autograd;

namespace {

using T3 = Tensor<float, 3>;
using Shape = T3::Shape;

/// Member `who`'s value at flat index i of tensor `seed`: an integer in [-3, 3]. Replicated tensors use
/// who = -1, the same on every member.
float value(int seed, int who, std::int64_t i) {
  const std::int64_t h = (seed * 131 + (who + 1) * 31 + i * 17 + i / 3) % 7;
  return static_cast<float>(h - 3);
}

T3 filled(const Shape& s, int seed, int who) {
  T3 t(s);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = value(seed, who, i);
  }
  return t;
}

std::string tag(const ProcessGroup& g, const std::string& what) {
  return "rank " + std::to_string(g.rank()) + "/" + std::to_string(g.size()) + " " + what;
}

std::string shape_str(const Shape& s) {
  return dtensor::detail::shape_to_string(s);
}

/// Block i of n (torch.chunk) of `full` along `dim`.
T3 block_of(const T3& full, int dim, int n, int i) {
  const auto len = full.shape(dim);
  return full.narrow(dim, chunk_offset(len, n, i), chunk_size(len, n, i)).clone();
}

Shape block_shape(Shape s, int dim, int n, int i) {
  s[dim] = chunk_size(s[dim], n, i);
  return s;
}

T3 concat(const std::vector<T3>& parts, int dim) {
  Shape s = parts.at(0).shape();
  s[dim] = 0;
  for (const auto& p : parts) {
    s[dim] += p.shape(dim);
  }
  T3 out(s);
  std::int64_t at = 0;
  for (const auto& p : parts) {
    out.narrow(dim, at, p.shape(dim)).copy_from(p);
    at += p.shape(dim);
  }
  return out;
}

T3 sum_of(int n, const std::function<T3(int)>& member) {
  T3 acc = member(0).clone();
  for (int m = 1; m < n; ++m) {
    const T3 t = member(m);
    for (std::int64_t i = 0; i < acc.numel(); ++i) {
      acc.data()[i] += t.data()[i];
    }
  }
  return acc;
}

void expect_same(const T3& got, const T3& want, const std::string& what) {
  if (got.shape() != want.shape()) {
    throw Error(what + ": shape " + shape_str(got.shape()) + ", expected " + shape_str(want.shape()));
  }
  const T3 g = got.contiguous(), w = want.contiguous();
  expect_values<float>(
      g, [&](std::int64_t i) { return w.data()[i]; }, what);
}

double dot(const T3& a, const T3& b) {
  const T3 x = a.contiguous(), y = b.contiguous();
  double s = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    s += static_cast<double>(x.data()[i]) * y.data()[i];
  }
  return s;
}

/// Which side of a pair is the same on every member (counted once in the global inner product).
enum class Side { per_member, replicated };

/// <A x, gy> == <x, back(gy)>, exactly (integer-valued data). Communicates (outside any CommDebugMode).
void expect_adjoint(const ProcessGroup& g, const T3& x, const T3& gx, Side xs, const T3& y, const T3& gy,
                    Side ys, const std::string& what) {
  auto sums = Tensor<double, 1>::zeros({2});
  const bool first = g.rank() == 0;
  sums(0) = ys == Side::per_member || first ? dot(y, gy) : 0.0;
  sums(1) = xs == Side::per_member || first ? dot(x, gx) : 0.0;
  all_reduce(sums, ReduceOp::sum, g);
  if (sums(0) != sums(1)) {
    throw Error(what + ": adjoint identity fails: <A x, gy> = " + std::to_string(sums(0)) +
                " but <x, back(gy)> = " + std::to_string(sums(1)));
  }
}

/// CommDebugMode saw exactly these ops (name -> count) and nothing else.
void expect_comm(const CommDebugMode& mode, const std::map<std::string, int>& expected,
                 const std::string& what) {
  std::int64_t total = 0;
  for (const auto& [op, count] : expected) {
    if (mode.count(op) != count) {
      throw Error(what + ": " + std::to_string(mode.count(op)) + " " + op + ", expected " +
                  std::to_string(count) + "\n" + mode.to_string());
    }
    total += count;
  }
  if (mode.total_count() != total) {
    throw Error(what + ": unexpected communication\n" + mode.to_string());
  }
}

/// A global shape and the dim the blocks split.
struct Geometry {
  Shape full;
  int dim;
  std::string str() const { return shape_str(full) + " dim " + std::to_string(dim); }
};

/// Every dim of two base shapes (one whose leading dims are 1, so blocks along dims 1 and 2 are
/// contiguous), each with 0, 1, 5 and 2n entries along the split dim: empty, uneven and even blocks.
std::vector<Geometry> geometries(int n) {
  std::vector<Geometry> out;
  for (Shape base : {Shape{2, 3, 2}, Shape{1, 1, 3}}) {
    for (int dim = 0; dim < 3; ++dim) {
      for (std::int64_t len : {std::int64_t{0}, std::int64_t{1}, std::int64_t{5}, std::int64_t{2} * n}) {
        Shape s = base;
        s[dim] = len;
        out.push_back({s, dim});
      }
    }
  }
  return out;
}

} // namespace

TEST_CASE("autograd::all_reduce: sum forward, identity backward", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (const auto& geo : geometries(n)) {
      const std::string what = tag(g, "all_reduce " + geo.str());
      const T3 x = filled(geo.full, 1, r);
      const T3 gy = filled(geo.full, 2, -1);
      CommDebugMode fwd;
      auto [y, back] = ag::all_reduce(x, g);
      expect_comm(fwd, {{"all_reduce", 1}}, what + " forward");
      CommDebugMode bwd;
      const T3 gx = back(gy);
      expect_comm(bwd, {}, what + " backward");
      expect_same(y, sum_of(n, [&](int m) { return filled(geo.full, 1, m); }), what + " forward");
      expect_same(gx, gy, what + " backward");
      expect_same(ag::all_reduce(x, g, async_op).output.wait(), y, what + " async forward");
      expect_same(back(gy, async_op).wait(), gx, what + " async backward");
      expect_adjoint(g, x, gx, Side::per_member, y, gy, Side::replicated, what);
    }
  });
}

TEST_CASE("autograd::copy: identity forward, all_reduce backward", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (const auto& geo : geometries(n)) {
      const std::string what = tag(g, "copy " + geo.str());
      const T3 x = filled(geo.full, 1, -1);
      const T3 gy = filled(geo.full, 2, r);
      CommDebugMode fwd;
      auto [y, back] = ag::copy(x, g);
      expect_comm(fwd, {}, what + " forward");
      CommDebugMode bwd;
      const T3 gx = back(gy);
      expect_comm(bwd, {{"all_reduce", 1}}, what + " backward");
      expect_same(y, x, what + " forward");
      expect_same(gx, sum_of(n, [&](int m) { return filled(geo.full, 2, m); }), what + " backward");
      expect_same(gy, filled(geo.full, 2, r), what + " backward leaves the gradient untouched");
      expect_same(back(gy, async_op).wait(), gx, what + " async backward");
      expect_adjoint(g, x, gx, Side::replicated, y, gy, Side::per_member, what);
    }
  });
}

TEST_CASE("autograd::all_gather: all_gather forward, reduce_scatter backward", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (const auto& geo : geometries(n)) {
      const std::string what = tag(g, "all_gather " + geo.str());
      const int d = geo.dim;
      const std::int64_t len = geo.full[d];
      // member m's block of its own full-shape tensor: the reference is the concatenation of those
      auto x_of = [&](int m) { return block_of(filled(geo.full, 1, m), d, n, m); };
      const T3 x = x_of(r);
      const T3 gy = filled(geo.full, 2, r);
      std::vector<T3> xs;
      for (int m = 0; m < n; ++m) {
        xs.push_back(x_of(m));
      }
      const T3 want_y = concat(xs, d);
      const T3 want_gx = block_of(sum_of(n, [&](int m) { return filled(geo.full, 2, m); }), d, n, r);

      CommDebugMode fwd;
      auto [y, back] = ag::all_gather(x, d, len, g);
      expect_comm(fwd, {{"all_gather", 1}}, what + " forward");
      CommDebugMode bwd;
      const T3 gx = back(gy);
      expect_comm(bwd, {{"reduce_scatter", 1}}, what + " backward");
      expect_same(y, want_y, what + " forward");
      expect_same(gx, want_gx, what + " backward");
      expect_adjoint(g, x, gx, Side::per_member, y, gy, Side::per_member, what);

      expect_same(ag::all_gather(x, d, len, g, async_op).output.wait(), y, what + " async forward");
      expect_same(back(gy, async_op).wait(), gx, what + " async backward");
      expect_same(ag::all_gather(x, d - 3, len, g).output, y, what + " negative dim");

      // without the global size: the shapes are exchanged first (one more all_gather)
      CommDebugMode exchange;
      auto [y2, back2] = ag::all_gather(x, d, g);
      expect_comm(exchange, {{"all_gather", 2}}, what + " forward without the global size");
      expect_same(y2, y, what + " forward without the global size");
      expect_same(back2(gy), gx, what + " backward without the global size");

      // the block movers write every element of their (poisoned) outputs
      auto out = T3::full(want_y.shape(), -77.0f);
      ag::detail::gather_blocks(out, x, back.blocks, g, false);
      expect_same(out, want_y, what + " gather_blocks into a poisoned output");
      auto part = T3::full(want_gx.shape(), -77.0f);
      ag::detail::reduce_scatter_blocks(part, gy, back.blocks, g, false);
      expect_same(part, want_gx, what + " reduce_scatter_blocks into a poisoned output");
    }
  });
}

TEST_CASE("autograd::all_gather without a global size keeps any block sizes", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    auto rows = [](int m) { return std::int64_t{(2 * m + 1) % 3}; }; // 1, 0, 2, 1: not torch.chunk's
    for (int d = 0; d < 3; ++d) {
      const std::string what = tag(g, "all_gather of sizes (2m+1)%3 along dim " + std::to_string(d));
      auto shape_of = [&](int m) {
        Shape s{2, 3, 2};
        s[d] = rows(m);
        return s;
      };
      std::vector<T3> xs;
      for (int m = 0; m < n; ++m) {
        xs.push_back(filled(shape_of(m), 1, m));
      }
      const T3 want_y = concat(xs, d);
      const T3 gy = filled(want_y.shape(), 2, r);
      std::vector<T3> gys;
      for (int m = 0; m < n; ++m) {
        gys.push_back(filled(want_y.shape(), 2, m));
      }
      const T3 gsum = sum_of(n, [&](int m) { return gys[m]; });
      std::int64_t at = 0;
      for (int m = 0; m < r; ++m) {
        at += rows(m);
      }
      const T3 want_gx = gsum.narrow(d, at, rows(r)).clone();

      CommDebugMode fwd;
      auto [y, back] = ag::all_gather(xs[r], d, g);
      expect_comm(fwd, {{"all_gather", 2}}, what + " forward");
      CommDebugMode bwd;
      const T3 gx = back(gy);
      expect_comm(bwd, {{"reduce_scatter", 1}}, what + " backward");
      expect_same(y, want_y, what + " forward");
      expect_same(gx, want_gx, what + " backward");
      expect_adjoint(g, xs[r], gx, Side::per_member, y, gy, Side::per_member, what);
    }
  });
}

TEST_CASE("autograd::reduce_scatter: reduce_scatter forward, all_gather backward", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (const auto& geo : geometries(n)) {
      const std::string what = tag(g, "reduce_scatter " + geo.str());
      const int d = geo.dim;
      const T3 x = filled(geo.full, 1, r);
      auto gy_of = [&](int m) { return filled(block_shape(geo.full, d, n, m), 2, m); };
      const T3 gy = gy_of(r);
      const T3 want_y = block_of(sum_of(n, [&](int m) { return filled(geo.full, 1, m); }), d, n, r);
      std::vector<T3> gys;
      for (int m = 0; m < n; ++m) {
        gys.push_back(gy_of(m));
      }
      const T3 want_gx = concat(gys, d);

      CommDebugMode fwd;
      auto [y, back] = ag::reduce_scatter(x, d, g);
      expect_comm(fwd, {{"reduce_scatter", 1}}, what + " forward");
      CommDebugMode bwd;
      const T3 gx = back(gy);
      expect_comm(bwd, {{"all_gather", 1}}, what + " backward");
      expect_same(y, want_y, what + " forward");
      expect_same(gx, want_gx, what + " backward");
      expect_same(ag::reduce_scatter(x, d, g, async_op).output.wait(), y, what + " async forward");
      expect_same(back(gy, async_op).wait(), gx, what + " async backward");
      expect_adjoint(g, x, gx, Side::per_member, y, gy, Side::per_member, what);
    }
  });
}

TEST_CASE("autograd::all_to_all_single: splits swapped in the backward", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    // member p sends (2p + q) % 3 rows to member q (some 0); empty lists: 2 rows to every member
    for (bool equal : {false, true}) {
      auto sends = [&](int p, int q) { return equal ? std::int64_t{2} : std::int64_t{(2 * p + q) % 3}; };
      std::vector<std::int64_t> in_splits, out_splits;
      if (!equal) {
        for (int q = 0; q < n; ++q) {
          in_splits.push_back(sends(r, q));
          out_splits.push_back(sends(q, r));
        }
      }
      auto rows_in = [&](int p) {
        std::int64_t s = 0;
        for (int q = 0; q < n; ++q) {
          s += sends(p, q);
        }
        return s;
      };
      auto rows_out = [&](int q) {
        std::int64_t s = 0;
        for (int p = 0; p < n; ++p) {
          s += sends(p, q);
        }
        return s;
      };
      auto x_of = [&](int p) { return filled({rows_in(p), 3, 2}, 1, p); };
      auto gy_of = [&](int q) { return filled({rows_out(q), 3, 2}, 2, q); };
      // rows of member p's tensor that go to / come from member q, in the order of q
      auto piece = [&](const T3& t, int q, const std::function<std::int64_t(int)>& size) {
        std::int64_t at = 0;
        for (int j = 0; j < q; ++j) {
          at += size(j);
        }
        return t.narrow(0, at, size(q)).clone();
      };
      std::vector<T3> want_y_parts, want_gx_parts;
      for (int p = 0; p < n; ++p) {
        want_y_parts.push_back(piece(x_of(p), r, [&](int q) { return sends(p, q); }));
        want_gx_parts.push_back(piece(gy_of(p), r, [&](int q) { return sends(q, p); }));
      }
      const std::string what = tag(g, std::string("all_to_all_single ") + (equal ? "equal" : "uneven"));
      const T3 x = x_of(r), gy = gy_of(r);

      CommDebugMode fwd;
      auto [y, back] = ag::all_to_all_single(x, out_splits, in_splits, g);
      expect_comm(fwd, {{"all_to_all", 1}}, what + " forward");
      CommDebugMode bwd;
      const T3 gx = back(gy);
      expect_comm(bwd, {{"all_to_all", 1}}, what + " backward");
      expect_same(y, concat(want_y_parts, 0), what + " forward");
      expect_same(gx, concat(want_gx_parts, 0), what + " backward");
      expect_same(ag::all_to_all_single(x, out_splits, in_splits, g, async_op).output.wait(), y,
                  what + " async forward");
      expect_same(back(gy, async_op).wait(), gx, what + " async backward");
      expect_adjoint(g, x, gx, Side::per_member, y, gy, Side::per_member, what);
    }
  });
}

TEST_CASE("autograd::broadcast: reduce to src in the backward, zeros elsewhere", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (const Shape& s : {Shape{2, 3, 2}, Shape{0, 3, 1}}) {
      for (int src = 0; src < n; ++src) {
        const std::string what = tag(g, "broadcast from " + std::to_string(src) + " of " + shape_str(s));
        const T3 x = filled(s, 1, r), gy = filled(s, 2, r);
        CommDebugMode fwd;
        auto [y, back] = ag::broadcast(x, src, g);
        expect_comm(fwd, {{"broadcast", 1}}, what + " forward");
        CommDebugMode bwd;
        const T3 gx = back(gy);
        expect_comm(bwd, {{"reduce", 1}}, what + " backward");
        expect_same(y, filled(s, 1, src), what + " forward");
        expect_same(gx, r == src ? sum_of(n, [&](int m) { return filled(s, 2, m); }) : T3::zeros(s),
                    what + " backward");
        expect_same(gy, filled(s, 2, r), what + " backward leaves the gradient untouched");
        expect_same(ag::broadcast(x, src, g, async_op).output.wait(), y, what + " async forward");
        expect_same(back(gy, async_op).wait(), gx, what + " async backward");
        expect_adjoint(g, x, gx, Side::per_member, y, gy, Side::per_member, what);
      }
    }
  });
}

TEST_CASE("autograd::chunk and all_gather_replicated: each other's backward", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (const auto& geo : geometries(n)) {
      const int d = geo.dim;
      const std::int64_t len = geo.full[d];
      auto blocks_of = [&](int seed) {
        std::vector<T3> parts;
        for (int m = 0; m < n; ++m) {
          parts.push_back(filled(block_shape(geo.full, d, n, m), seed, m));
        }
        return parts;
      };
      {
        const std::string what = tag(g, "chunk " + geo.str());
        const T3 x = filled(geo.full, 1, -1);
        const auto gys = blocks_of(2);
        CommDebugMode fwd;
        auto [y, back] = ag::chunk(x, d, g);
        expect_comm(fwd, {}, what + " forward");
        CommDebugMode bwd;
        const T3 gx = back(gys[r]);
        expect_comm(bwd, {{"all_gather", 1}}, what + " backward");
        expect_same(y, block_of(x, d, n, r), what + " forward");
        expect_same(gx, concat(gys, d), what + " backward");
        expect_same(back(gys[r], async_op).wait(), gx, what + " async backward");
        expect_adjoint(g, x, gx, Side::replicated, y, gys[r], Side::per_member, what);
      }
      {
        const std::string what = tag(g, "all_gather_replicated " + geo.str());
        const auto xs = blocks_of(1);
        const T3 gy = filled(geo.full, 2, -1);
        CommDebugMode fwd;
        auto [y, back] = ag::all_gather_replicated(xs[r], d, len, g);
        expect_comm(fwd, {{"all_gather", 1}}, what + " forward");
        CommDebugMode bwd;
        const T3 gx = back(gy);
        expect_comm(bwd, {}, what + " backward");
        expect_same(y, concat(xs, d), what + " forward");
        expect_same(gx, block_of(gy, d, n, r), what + " backward");
        expect_same(ag::all_gather_replicated(xs[r], d, len, g, async_op).output.wait(), y,
                    what + " async forward");
        expect_same(back(gy, async_op).wait(), gx, what + " async backward");
        expect_adjoint(g, xs[r], gx, Side::per_member, y, gy, Side::replicated, what);
      }
    }
  });
}

TEST_CASE("Megatron regions run the pairs they name", "[comm][autograd]") {
  const int world = GENERATE(1, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    const Shape full{5, 2, 3};
    const T3 rep = filled(full, 1, -1), mine = filled(full, 2, r);
    auto count = [](const std::function<void()>& fn, const std::map<std::string, int>& expected,
                    const std::string& what) {
      CommDebugMode mode;
      fn();
      expect_comm(mode, expected, what);
    };
    {
      const std::string what = tag(g, "copy_to");
      auto [y, back] = ag::copy_to(rep, g);
      expect_same(y, rep, what);
      count([&] { back(mine); }, {{"all_reduce", 1}}, what + " backward");
    }
    {
      const std::string what = tag(g, "reduce_from");
      count([&] { ag::reduce_from(mine, g); }, {{"all_reduce", 1}}, what);
      auto [y, back] = ag::reduce_from(mine, g);
      count([&] { back(rep); }, {}, what + " backward");
    }
    {
      const std::string what = tag(g, "scatter_to (last dim)");
      auto [y, back] = ag::scatter_to(rep, g);
      expect_same(y, block_of(rep, 2, n, r), what);
      count([&] { expect_same(back(y), back(y, async_op).wait(), what); }, {{"all_gather", 2}},
            what + " backward");
    }
    {
      const std::string what = tag(g, "gather_from (last dim)");
      const T3 x = block_of(rep, 2, n, r);
      count([&] { ag::gather_from(x, 3, g); }, {{"all_gather", 1}}, what);
      auto [y, back] = ag::gather_from(x, 3, g);
      expect_same(y, rep, what);
      count([&] { expect_same(back(mine), block_of(mine, 2, n, r), what + " backward"); }, {},
            what + " backward");
    }
    {
      const std::string what = tag(g, "scatter_to_sequence");
      auto [y, back] = ag::scatter_to_sequence(rep, g);
      expect_same(y, block_of(rep, 0, n, r), what);
      count([&] { back(y); }, {{"all_gather", 1}}, what + " backward");
    }
    {
      const std::string what = tag(g, "gather_from_sequence");
      const T3 x = block_of(mine, 1, n, r);
      count([&] { ag::gather_from_sequence(x, 2, g, 1); }, {{"all_gather", 1}}, what);
      auto [y, back] = ag::gather_from_sequence(x, 2, g, 1);
      count([&] { back(mine); }, {{"reduce_scatter", 1}}, what + " backward");
    }
    {
      const std::string what = tag(g, "reduce_scatter_to_sequence");
      count([&] { ag::reduce_scatter_to_sequence(mine, g); }, {{"reduce_scatter", 1}}, what);
      auto [y, back] = ag::reduce_scatter_to_sequence(mine, g);
      expect_same(y, block_of(sum_of(n, [&](int m) { return filled(full, 2, m); }), 0, n, r), what);
      count([&] { back(y); }, {{"all_gather", 1}}, what + " backward");
    }
  });
}

TEST_CASE("autograd: wrong dims, blocks and gradients throw before communicating", "[comm][autograd]") {
  const int world = GENERATE(1, 2, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    const std::string me = "rank " + std::to_string(r);
    const T3 x = filled({2, 3, 2}, 1, r);
    CommDebugMode mode;
    expect_throws([&] { ag::all_gather(x, 3, 2 * n, g); }, {"autograd::all_gather", me, "dim 3", "[2, 3, 2]"},
                  tag(g, "all_gather dim 3"));
    expect_throws([&] { ag::reduce_scatter(x, -4, g); }, {"autograd::reduce_scatter", me, "dim -4"},
                  tag(g, "reduce_scatter dim -4"));
    expect_throws([&] { ag::chunk(x, 5, g); }, {"autograd::chunk", me, "dim 5"}, tag(g, "chunk dim 5"));
    expect_throws([&] { ag::all_gather_replicated(x, 7, 2, g); },
                  {"autograd::all_gather_replicated", "dim 7"}, tag(g, "all_gather_replicated dim 7"));
    // 2 rows per member do not make torch.chunk blocks of 2n + 1 rows: member r's block has
    // chunk_size(2n+1, n, r) rows
    const auto want = chunk_size(2 * n + 1, n, r);
    expect_throws([&] { ag::all_gather(x, 0, 2 * n + 1, g); },
                  {"autograd::all_gather", me, "has 2 entries along dim 0",
                   "global size " + std::to_string(2 * n + 1),
                   "gives member " + std::to_string(r) + " " + std::to_string(want)},
                  tag(g, "all_gather block of the wrong size"), want != 2);
    expect_throws([&] { ag::all_gather(x, 0, -1, g); }, {"autograd::all_gather", "-1"},
                  tag(g, "all_gather negative global size"));
    expect_comm(mode, {}, tag(g, "no communication before the errors"));

    const T3 wrong = filled({2, 3, 3}, 2, r);
    const std::vector<std::string> grad_words{"backward", "gradient has shape [2, 3, 3]", me};
    auto with = [&](std::vector<std::string> words, const std::string& op) {
      words.push_back("autograd::" + op);
      return words;
    };
    auto [y1, b1] = ag::all_reduce(x, g);
    expect_throws([&] { b1(wrong); }, with(grad_words, "all_reduce"), tag(g, "all_reduce backward"));
    auto [y2, b2] = ag::copy(x, g);
    expect_throws([&] { b2(wrong, async_op); }, with(grad_words, "copy"), tag(g, "copy backward"));
    auto [y3, b3] = ag::all_gather(x, 1, 3 * n, g);
    expect_throws([&] { b3(wrong); }, with(grad_words, "all_gather"), tag(g, "all_gather backward"));
    auto [y4, b4] = ag::reduce_scatter(x, 0, g);
    expect_throws([&] { b4(wrong); }, with(grad_words, "reduce_scatter"), tag(g, "reduce_scatter backward"));
    auto [y5, b5] = ag::all_to_all_single(filled({n, 3, 3}, 1, r), {}, {}, g);
    expect_throws(
        [&] {
          b5(filled({n, 3, 2}, 2, r));
        },
        {"backward", "gradient has shape [" + std::to_string(n) + ", 3, 2]", me,
         "autograd::all_to_all_single"},
        tag(g, "all_to_all backward"));
    auto [y6, b6] = ag::broadcast(x, 0, g);
    expect_throws([&] { b6(wrong); }, with(grad_words, "broadcast"), tag(g, "broadcast backward"));
    auto [y7, b7] = ag::chunk(x, 2, g);
    expect_throws([&] { b7(wrong); }, with(grad_words, "chunk"), tag(g, "chunk backward"));
    auto [y8, b8] = ag::all_gather_replicated(x, 2, 2 * n, g);
    expect_throws([&] { b8(wrong); }, with(grad_words, "all_gather_replicated"),
                  tag(g, "all_gather_replicated backward"));

    if (n > 1) { // member 0's block differs outside the gathered dim: every member names the mismatch
      const T3 odd = filled(r == 0 ? Shape{2, 4, 2} : Shape{2, 3, 2}, 1, r);
      expect_throws([&] { ag::all_gather(odd, 0, g); },
                    {"autograd::all_gather", me, "member", "differ outside dim 0"},
                    tag(g, "exchanged shapes differ"));
    }
  });
}

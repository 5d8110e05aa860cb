// Every collective x element type x reduce op x 1..4 ranks x even, uneven and empty sizes, against a
// single-process reference, with outputs poisoned beforehand. Integer-valued data keeps every reduction
// exact in any order.

#include "common.hpp"

#include "dtensor/comm/comm_debug.hpp"
#include "dtensor/comm/wait_timer.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <iterator>
#include <limits>
#include <string>
#include <thread>
#include <vector>

using namespace comm_test;

namespace {

constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::product};

/// The ops every collective that reduces is checked with on T: kOps, and the bitwise ones on integers.
template <class T>
std::vector<ReduceOp> ops_for() {
  std::vector<ReduceOp> ops(std::begin(kOps), std::end(kOps));
  if constexpr (std::is_integral_v<T>) {
    ops.insert(ops.end(), {ReduceOp::band, ReduceOp::bor, ReduceOp::bxor});
  }
  return ops;
}

/// Rank r's value at flat index i: small integers in {1, 2, 3}.
long val(int r, std::int64_t i) {
  return (r * 7 + i * 3 + i / 5) % 3 + 1;
}

/// The reference reduction over ranks 0..n-1 of f(m).
template <class T>
T reference(ReduceOp op, int n, const std::function<long(int)>& f) {
  long acc = f(0);
  for (int m = 1; m < n; ++m) {
    const long v = f(m);
    switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      acc += v;
      break;
    case ReduceOp::product:
      acc *= v;
      break;
    case ReduceOp::max:
      acc = std::max(acc, v);
      break;
    case ReduceOp::min:
      acc = std::min(acc, v);
      break;
    case ReduceOp::band:
      acc &= v;
      break;
    case ReduceOp::bor:
      acc |= v;
      break;
    case ReduceOp::bxor:
      acc ^= v;
      break;
    }
  }
  if (op != ReduceOp::avg) {
    return from_int<T>(acc);
  }
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(acc / n); // truncation toward zero
  } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return static_cast<T>(static_cast<T>(acc) / static_cast<T>(n));
  } else {
    return T(static_cast<float>(acc) / static_cast<float>(n));
  }
}

template <class T, int Rank>
void fill_with(const Tensor<T, Rank>& t, const std::function<long(std::int64_t)>& f) {
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = from_int<T>(f(i));
  }
}

std::string tag(const ProcessGroup& g, const std::string& what) {
  return "rank " + std::to_string(g.rank()) + "/" + std::to_string(g.size()) + " " + what;
}

} // namespace

TEMPLATE_TEST_CASE("all_reduce, reduce and broadcast match a single-process reference", "[comm][collectives]",
                   DTENSOR_ALL_ELEMENT_TYPES) {
  using T = TestType;
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (std::int64_t numel : {0, 1, 7, 33}) {
      for (ReduceOp op : ops_for<T>()) {
        const std::string what = std::string(to_string(op)) + " of " + std::to_string(numel);
        auto t = Tensor<T, 2>({numel, 1});
        fill_with(t, [&](auto i) { return val(r, i); });
        all_reduce(t, op, g);
        expect_values<T>(
            t, [&](auto i) { return reference<T>(op, n, [&](int m) { return val(m, i); }); },
            tag(g, "all_reduce " + what));
        for (int dst = 0; dst < n; ++dst) {
          auto u = Tensor<T, 1>({numel});
          fill_with(u, [&](auto i) { return val(r, i); });
          reduce(u, dst, op, g);
          if (r == dst) {
            expect_values<T>(
                u, [&](auto i) { return reference<T>(op, n, [&](int m) { return val(m, i); }); },
                tag(g, "reduce to " + std::to_string(dst) + " " + what));
          } else {
            expect_values<T>(
                u, [&](auto i) { return from_int<T>(val(r, i)); }, tag(g, "reduce non-dst " + what));
          }
        }
      }
      for (int src = 0; src < n; ++src) {
        auto t = Tensor<T, 1>::full({numel}, poison<T>());
        if (r == src) {
          fill_with(t, [&](auto i) { return val(src, i) + 3; });
        }
        broadcast(t, src, g);
        expect_values<T>(
            t, [&](auto i) { return from_int<T>(val(src, i) + 3); },
            tag(g, "broadcast from " + std::to_string(src)));
      }
    }
  });
}

TEMPLATE_TEST_CASE("all_gather_into_tensor, reduce_scatter_tensor and their list forms",
                   "[comm][collectives]", DTENSOR_ALL_ELEMENT_TYPES) {
  using T = TestType;
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (std::int64_t k : {0, 1, 3}) {
      const std::int64_t block = k * 2;
      auto in = Tensor<T, 2>({k, 2});
      fill_with(in, [&](auto i) { return val(r, i); });
      auto expect_gathered = [&](auto j) { return from_int<T>(val(static_cast<int>(j / block), j % block)); };
      auto cat = Tensor<T, 2>::full({n * k, 2}, poison<T>());
      all_gather_into_tensor(cat, in, g);
      expect_values<T>(cat, expect_gathered, tag(g, "all_gather_into_tensor k=" + std::to_string(k)));
      auto stacked = Tensor<T, 3>::full({n, k, 2}, poison<T>());
      all_gather_into_tensor(stacked, in, g);
      expect_values<T>(stacked, expect_gathered,
                       tag(g, "all_gather_into_tensor stacked k=" + std::to_string(k)));
      auto untouched = functional::all_gather_into_tensor(in, g);
      expect_values<T>(
          in, [&](auto i) { return from_int<T>(val(r, i)); }, tag(g, "functional input untouched"));
      expect_values<T>(untouched, expect_gathered, tag(g, "functional::all_gather_into_tensor"));

      for (ReduceOp op : ops_for<T>()) {
        const std::string what = std::string(to_string(op)) + " k=" + std::to_string(k);
        auto big = Tensor<T, 2>({n * k, 2});
        fill_with(big, [&](auto j) { return val(r, j); });
        auto out = Tensor<T, 2>::full({k, 2}, poison<T>());
        reduce_scatter_tensor(out, big, op, g);
        auto expected = [&](auto i) {
          return reference<T>(op, n, [&](int m) { return val(m, r * block + i); });
        };
        expect_values<T>(out, expected, tag(g, "reduce_scatter_tensor " + what));
        auto fout = functional::reduce_scatter_tensor(big, op, g);
        expect_values<T>(fout, expected, tag(g, "functional::reduce_scatter_tensor " + what));
      }
    }
    // Uneven list forms: member m contributes rows(m) rows (0, 1, 2, 0, ...).
    auto rows = [](int m) { return static_cast<std::int64_t>(m % 3); };
    auto in = Tensor<T, 2>({rows(r), 2});
    fill_with(in, [&](auto i) { return val(r, i); });
    std::vector<Tensor<T, 2>> outs;
    for (int m = 0; m < n; ++m) {
      outs.push_back(Tensor<T, 2>::full({rows(m), 2}, poison<T>()));
    }
    all_gather(outs, in, g);
    for (int m = 0; m < n; ++m) {
      expect_values<T>(
          outs[m], [&](auto i) { return from_int<T>(val(m, i)); },
          tag(g, "all_gather (uneven) block " + std::to_string(m)));
    }
    for (ReduceOp op : ops_for<T>()) {
      std::vector<Tensor<T, 2>> ins;
      for (int j = 0; j < n; ++j) {
        ins.push_back(Tensor<T, 2>({rows(j), 2}));
        fill_with(ins.back(), [&](auto i) { return val(r, 100 * j + i); });
      }
      auto out = Tensor<T, 2>::full({rows(r), 2}, poison<T>());
      reduce_scatter(out, ins, op, g);
      expect_values<T>(
          out, [&](auto i) { return reference<T>(op, n, [&](int m) { return val(m, 100 * r + i); }); },
          tag(g, "reduce_scatter (uneven list) " + std::string(to_string(op))));
    }
  });
}

TEMPLATE_TEST_CASE("all_to_all_single (equal and split sizes) and all_to_all lists", "[comm][collectives]",
                   DTENSOR_ALL_ELEMENT_TYPES) {
  using T = TestType;
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    // code(src, dst, e) <= 127: exact in every element type.
    auto code = [](int src, int dst, std::int64_t e) {
      return static_cast<long>((src * 4 + dst) * 8 + e % 8);
    };
    for (std::int64_t k : {0, 1, 3}) {
      const std::int64_t block = k * 2;
      auto in = Tensor<T, 2>({n * k, 2});
      fill_with(in, [&](auto j) { return code(r, static_cast<int>(j / block), j % block); });
      auto out = Tensor<T, 2>::full({n * k, 2}, poison<T>());
      all_to_all_single(out, in, g);
      expect_values<T>(
          out, [&](auto j) { return from_int<T>(code(static_cast<int>(j / block), r, j % block)); },
          tag(g, "all_to_all_single k=" + std::to_string(k)));
      auto fout = functional::all_to_all_single(in, g);
      expect_values<T>(
          fout, [&](auto j) { return from_int<T>(code(static_cast<int>(j / block), r, j % block)); },
          tag(g, "functional::all_to_all_single k=" + std::to_string(k)));
    }
    // Split sizes: s(src, dst) rows of 2 go from src to dst (some empty).
    auto s = [](int src, int dst) { return static_cast<std::int64_t>((src + 2 * dst) % 3); };
    std::vector<std::int64_t> in_splits(n), out_splits(n);
    std::int64_t in_rows = 0, out_rows = 0;
    for (int j = 0; j < n; ++j) {
      in_splits[j] = s(r, j);
      out_splits[j] = s(j, r);
      in_rows += in_splits[j];
      out_rows += out_splits[j];
    }
    auto in = Tensor<T, 2>({in_rows, 2});
    {
      std::int64_t at = 0;
      for (int dst = 0; dst < n; ++dst) {
        for (std::int64_t e = 0; e < in_splits[dst] * 2; ++e) {
          in.data()[at++] = from_int<T>(code(r, dst, e));
        }
      }
    }
    auto out = Tensor<T, 2>::full({out_rows, 2}, poison<T>());
    all_to_all_single(out, in, out_splits, in_splits, g);
    std::vector<T> expected;
    for (int src = 0; src < n; ++src) {
      for (std::int64_t e = 0; e < out_splits[src] * 2; ++e) {
        expected.push_back(from_int<T>(code(src, r, e)));
      }
    }
    expect_values<T>(
        out, [&](auto j) { return expected[j]; }, tag(g, "all_to_all_single with splits"));
    auto fout = functional::all_to_all_single(in, out_splits, in_splits, g);
    expect_values<T>(
        fout, [&](auto j) { return expected[j]; }, tag(g, "functional::all_to_all_single with splits"));

    // Lists of different lengths: sz(src, dst) elements from src to dst.
    auto sz = [](int src, int dst) { return static_cast<std::int64_t>((src * 2 + dst) % 4); };
    std::vector<Tensor<T, 1>> ins, outs;
    for (int j = 0; j < n; ++j) {
      ins.push_back(Tensor<T, 1>({sz(r, j)}));
      fill_with(ins.back(), [&](auto e) { return code(r, j, e); });
      outs.push_back(Tensor<T, 1>::full({sz(j, r)}, poison<T>()));
    }
    all_to_all(outs, ins, g);
    for (int src = 0; src < n; ++src) {
      expect_values<T>(
          outs[src], [&](auto e) { return from_int<T>(code(src, r, e)); },
          tag(g, "all_to_all list from " + std::to_string(src)));
    }
  });
}

TEMPLATE_TEST_CASE("gather, scatter and barrier", "[comm][collectives]", DTENSOR_ALL_ELEMENT_TYPES) {
  using T = TestType;
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    for (std::int64_t k : {0, 2}) {
      for (int root = 0; root < n; ++root) {
        auto in = Tensor<T, 2>({k, 2});
        fill_with(in, [&](auto i) { return val(r, i) + r; });
        std::vector<Tensor<T, 2>> list;
        if (r == root) {
          for (int m = 0; m < n; ++m) {
            list.push_back(Tensor<T, 2>::full({k, 2}, poison<T>()));
          }
        }
        gather(in, r == root ? &list : nullptr, root, g);
        for (int m = 0; m < static_cast<int>(list.size()); ++m) {
          expect_values<T>(
              list[m], [&](auto i) { return from_int<T>(val(m, i) + m); },
              tag(g, "gather to " + std::to_string(root) + " block " + std::to_string(m)));
        }
        std::vector<Tensor<T, 2>> parts;
        if (r == root) {
          for (int m = 0; m < n; ++m) {
            parts.push_back(Tensor<T, 2>({k, 2}));
            fill_with(parts.back(), [&](auto i) { return val(m, i) + 2 * m; });
          }
        }
        auto out = Tensor<T, 2>::full({k, 2}, poison<T>());
        scatter(out, parts, root, g);
        expect_values<T>(
            out, [&](auto i) { return from_int<T>(val(r, i) + 2 * r); },
            tag(g, "scatter from " + std::to_string(root)));
      }
    }
    barrier(g);
    barrier(g, async_op).wait();
  });
}

TEST_CASE("async collectives overlap compute, stay ordered, and complete at wait()", "[comm][async]") {
  const int world = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    std::vector<Tensor<float, 1>> ts;
    std::vector<Work> works;
    for (int j = 0; j < 8; ++j) {
      ts.push_back(Tensor<float, 1>::full({1000 + j}, static_cast<float>(r + j)));
      works.push_back(all_reduce(ts.back(), ReduceOp::sum, g, async_op));
    }
    auto big_in = Tensor<std::int64_t, 1>::full({6}, r);
    auto gathered = Tensor<std::int64_t, 1>::full({6 * n}, -777);
    works.push_back(all_gather_into_tensor(gathered, big_in, g, async_op));
    auto rs_in = Tensor<std::int64_t, 1>::full({3 * n}, r + 1);
    auto rs_out = Tensor<std::int64_t, 1>::full({3}, -777);
    works.push_back(reduce_scatter_tensor(rs_out, rs_in, ReduceOp::sum, g, async_op));
    // A synchronous op queued behind the async ones runs after them.
    auto b = Tensor<float, 1>::full({4}, r == 0 ? 42.0f : -777.0f);
    broadcast(b, 0, g);
    double acc = 0; // compute while (some of) the ops are in flight
    for (int i = 0; i < 200000; ++i) {
      acc += i * 1e-9;
    }
    DTENSOR_CHECK(acc > 0, "compute");
    for (auto it = works.rbegin(); it != works.rend(); ++it) {
      it->wait();
      DTENSOR_CHECK(it->is_completed(), "is_completed() after wait()");
    }
    const float base = static_cast<float>(n * (n - 1) / 2);
    for (int j = 0; j < 8; ++j) {
      expect_values<float>(
          ts[j], [&](auto) { return base + static_cast<float>(n * j); },
          "async all_reduce " + std::to_string(j));
    }
    expect_values<std::int64_t>(
        gathered, [&](auto i) { return i / 6; }, "async all_gather_into_tensor");
    expect_values<std::int64_t>(
        rs_out, [&](auto) { return n * (n + 1) / 2; }, "async reduce_scatter_tensor");
    expect_values<float>(
        b, [&](auto) { return 42.0f; }, "sync broadcast after async ops");
    // functional forms leave their inputs untouched.
    auto x = Tensor<float, 1>::full({5}, static_cast<float>(r));
    auto y = functional::all_reduce(x, ReduceOp::max, g);
    expect_values<float>(
        x, [&](auto) { return static_cast<float>(r); }, "functional::all_reduce input");
    expect_values<float>(
        y, [&](auto) { return static_cast<float>(n - 1); }, "functional::all_reduce output");
    auto z = functional::broadcast(x, n - 1, g);
    expect_values<float>(
        z, [&](auto) { return static_cast<float>(n - 1); }, "functional::broadcast");
    std::vector<Tensor<float, 1>::Shape> shapes;
    for (int m = 0; m < n; ++m) {
      shapes.push_back({m});
    }
    auto parts = functional::all_gather(Tensor<float, 1>::full({r}, static_cast<float>(r)),
                                        std::span<const Tensor<float, 1>::Shape>(shapes), g);
    for (int m = 0; m < n; ++m) {
      expect_values<float>(
          parts[m], [&](auto) { return static_cast<float>(m); }, "functional::all_gather");
    }
  });
}

TEST_CASE("max and min propagate NaN whichever rank holds it (all_reduce, reduce_scatter)",
          "[comm][collectives]") {
  const int world = GENERATE(2, 3, 4);
  for (int holder = 0; holder < world; ++holder) {
    testing::run_ranks(world, [&](ProcessGroup& g) {
      const int n = g.size();
      const int r = g.rank();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      // Element 0 is NaN on `holder` only; element 1 is an ordinary value everywhere.
      for (ReduceOp op : {ReduceOp::max, ReduceOp::min}) {
        auto t = Tensor<float, 1>::full({2}, static_cast<float>(r));
        t(0) = r == holder ? nan : static_cast<float>(r);
        all_reduce(t, op, g);
        DTENSOR_CHECK(std::isnan(t(0)), "all_reduce " + std::string(to_string(op)) + ": NaN on rank " +
                                            std::to_string(holder) + " lost on rank " + std::to_string(r));
        DTENSOR_CHECK(t(1) == (op == ReduceOp::max ? float(n - 1) : 0.0f),
                      "all_reduce: the ordinary element");
        auto in = Tensor<float, 1>::full({n}, static_cast<float>(r));
        if (r == holder) {
          in(0) = nan;
        }
        auto out = Tensor<float, 1>::full({1}, -777.0f);
        reduce_scatter_tensor(out, in, op, g);
        DTENSOR_CHECK(r == 0 ? std::isnan(out(0)) : !std::isnan(out(0)),
                      "reduce_scatter " + std::string(to_string(op)) + ": NaN of rank " +
                          std::to_string(holder) + " in block 0 only, on rank " + std::to_string(r));
      }
    });
  }
}

TEST_CASE("reduce_scatter adds the blocks in rank order bitwise on floats that round differently otherwise",
          "[comm][collectives]") {
  // Rank r contributes v[(r + s) % 4] to every element: the sum in rank order ((v0 + v1) + v2) + v3 rounds
  // differently from other orders, e.g. for s = 0 ((1 + 0) + 1) + 2^24 = 2^24 + 2 exactly, but in reverse
  // ((2^24 + 1) + 0) + 1 = 2^24 (each + 1 rounds to even). The header promises the rank-order result.
  auto check = []<class T>(T big) {
    const T v[4] = {T(1), T(0), T(1), big};
    auto fold = [&](int s, bool reverse) {
      T acc = v[((reverse ? 3 : 0) + s) % 4];
      for (int i = 1; i < 4; ++i) {
        acc = acc + v[((reverse ? 3 - i : i) + s) % 4];
      }
      return acc;
    };
    REQUIRE(fold(0, false) == big + T(2)); // the test can fail: rank order differs from reverse order
    REQUIRE(fold(0, true) == big);
    testing::run_ranks(4, [&](ProcessGroup& g) {
      const int r = g.rank();
      for (int s = 0; s < 4; ++s) {
        const T mine = v[(r + s) % 4];
        const T want = fold(s, false);
        auto what = [&](const std::string& form) {
          return tag(g, form + " (shift " + std::to_string(s) + ", " + std::string(dtype_name(dtype_v<T>)) +
                            ")");
        };
        // Uneven blocks are not possible through the typed API; 3 elements per block, 12 in all.
        auto in = Tensor<T, 1>::full({12}, mine);
        auto out = Tensor<T, 1>::full({3}, poison<T>());
        reduce_scatter_tensor(out, in, ReduceOp::sum, g);
        expect_values<T, 1>(
            out, [&](std::int64_t) { return want; }, what("reduce_scatter_tensor"));
        std::vector<Tensor<T, 1>> blocks;
        for (int m = 0; m < 4; ++m) {
          blocks.push_back(Tensor<T, 1>::full({2}, mine));
        }
        auto out2 = Tensor<T, 1>::full({2}, poison<T>());
        reduce_scatter(out2, blocks, ReduceOp::sum, g);
        expect_values<T, 1>(
            out2, [&](std::int64_t) { return want; }, what("reduce_scatter (list)"));
        // In place: the output is this rank's block of the input.
        auto whole = Tensor<T, 1>::full({8}, mine);
        auto own = whole.narrow(0, 2 * r, 2);
        reduce_scatter_tensor(own, whole, ReduceOp::sum, g, async_op).wait();
        expect_values<T, 1>(
            own, [&](std::int64_t) { return want; }, what("in-place async reduce_scatter_tensor"));
      }
    });
  };
  check(float(1 << 24));
  check(double(std::int64_t{1} << 53));
}

TEST_CASE("CommDebugMode counts every plain collective and point-to-point op with its bytes",
          "[comm][debug]") {
  // Each family once, synchronous, async and functional, at 3 ranks (a non-power of two); bytes are what
  // this rank receives (comm_debug.hpp), 4 per float.
  testing::run_ranks(3, [](ProcessGroup& g) {
    const int n = g.size();
    const int r = g.rank();
    CommDebugMode comm;
    auto expect = [&](const char* op, std::int64_t count, std::int64_t bytes) {
      DTENSOR_CHECK(comm.count(op) == count && comm.bytes(op) == bytes,
                    tag(g, std::string(op) + ": CommDebugMode counted " + std::to_string(comm.count(op)) +
                               " ops and " + std::to_string(comm.bytes(op)) + " bytes, expected " +
                               std::to_string(count) + " and " + std::to_string(bytes) + "\n" +
                               comm.to_string()));
    };
    auto six = Tensor<float, 1>::full({6}, 1.0f);
    all_reduce(six, ReduceOp::sum, g);
    all_reduce(six, ReduceOp::max, g, async_op).wait();
    (void)functional::all_reduce(six, ReduceOp::sum, g);
    expect("all_reduce", 3, 3 * 4 * ((2 * (n - 1) * 6 + n - 1) / n));
    // The reduce op of each: count(op, axes, ReduceOp) and bytes(...) select by it.
    auto expect_reduce = [&](const char* op, ReduceOp reduce, std::int64_t count, std::int64_t bytes) {
      DTENSOR_CHECK(comm.count(op, {}, reduce) == count && comm.bytes(op, {}, reduce) == bytes,
                    tag(g, std::string(op) + "(" + std::string(to_string(reduce)) +
                               "): CommDebugMode counted " + std::to_string(comm.count(op, {}, reduce)) +
                               " ops and " + std::to_string(comm.bytes(op, {}, reduce)) +
                               " bytes, expected " + std::to_string(count) + " and " + std::to_string(bytes) +
                               "\n" + comm.to_string()));
    };
    expect_reduce("all_reduce", ReduceOp::sum, 2, 2 * 4 * ((2 * (n - 1) * 6 + n - 1) / n));
    expect_reduce("all_reduce", ReduceOp::max, 1, 4 * ((2 * (n - 1) * 6 + n - 1) / n));
    expect_reduce("all_reduce", ReduceOp::min, 0, 0);
    reduce(six, 1, ReduceOp::min, g);
    expect("reduce", 1, r == 1 ? 4 * (n - 1) * 6 : 0);
    expect_reduce("reduce", ReduceOp::min, 1, r == 1 ? 4 * (n - 1) * 6 : 0);
    expect_reduce("reduce", ReduceOp::sum, 0, 0);
    broadcast(six, 2, g);
    (void)functional::broadcast(six, 2, g);
    expect("broadcast", 2, r == 2 ? 0 : 2 * 4 * 6);
    auto three = Tensor<float, 1>::full({3}, 1.0f);
    auto whole = Tensor<float, 1>::zeros({3 * n});
    all_gather_into_tensor(whole, three, g);
    std::vector<Tensor<float, 1>> parts;
    for (int m = 0; m < n; ++m) {
      parts.push_back(Tensor<float, 1>::zeros({3}));
    }
    all_gather(parts, three, g);
    (void)functional::all_gather_into_tensor(three, g);
    expect("all_gather", 3, 3 * 4 * (n - 1) * 3);
    reduce_scatter_tensor(three, whole, ReduceOp::sum, g);
    reduce_scatter(three, parts, ReduceOp::product, g, async_op).wait();
    (void)functional::reduce_scatter_tensor(whole, ReduceOp::avg, g);
    expect("reduce_scatter", 3, 3 * 4 * (n - 1) * 3);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::product, ReduceOp::avg}) {
      expect_reduce("reduce_scatter", op, 1, 4 * (n - 1) * 3);
    }
    expect_reduce("all_gather", ReduceOp::sum, 0, 0); // ops that do not reduce record no reduce op
    all_to_all_single(whole, Tensor<float, 1>::full({3 * n}, 2.0f), g);
    std::vector<Tensor<float, 1>> outs, ins;
    for (int m = 0; m < n; ++m) {
      outs.push_back(Tensor<float, 1>::zeros({2}));
      ins.push_back(Tensor<float, 1>::full({2}, 1.0f));
    }
    all_to_all(outs, ins, g);
    expect("all_to_all", 2, 4 * (n - 1) * 3 + 4 * (n - 1) * 2);
    gather(three, r == 0 ? &parts : nullptr, 0, g);
    expect("gather", 1, r == 0 ? 4 * (n - 1) * 3 : 0);
    scatter(three, r == 0 ? parts : std::vector<Tensor<float, 1>>{}, 0, g);
    expect("scatter", 1, r == 0 ? 0 : 4 * 3);
    barrier(g);
    expect("barrier", 1, 0);
    monitored_barrier(g);
    expect("monitored_barrier", 1, 0);
    // Point to point: a ring, rank r sends to r + 1 and receives from r - 1.
    const int next = (r + 1) % n;
    const int prev = (r + n - 1) % n;
    if (r % 2 == 0) {
      send(three, next, g);
      recv(three, prev, g);
    } else {
      recv(three, prev, g);
      send(three, next, g);
    }
    expect("send", 1, 0);
    expect("recv", 1, 4 * 3);
    Work a = isend(three, next, g);
    Work b = irecv(six.narrow(0, 0, 3), prev, g);
    a.wait();
    b.wait();
    expect("isend", 1, 0);
    expect("irecv", 1, 4 * 3);
    const std::vector<P2POp> ops{P2POp(P2POp::isend, six, next, g),
                                 P2POp(P2POp::irecv, six.clone(), prev, g)};
    auto works = batch_isend_irecv(ops);
    for (Work& w : works) {
      w.wait();
    }
    expect("batch_isend_irecv", 1, 4 * 6);
    DTENSOR_CHECK(comm.total_count() == 3 + 1 + 2 + 3 + 3 + 2 + 1 + 1 + 1 + 1 + 2 + 2 + 1,
                  tag(g, "total count " + std::to_string(comm.total_count()) + "\n" + comm.to_string()));
    // The table lists each reducing op's reduce ops.
    const std::string table = comm.to_string();
    DTENSOR_CHECK(table.find("sum 2, max 1") != std::string::npos &&
                      table.find("sum 1, avg 1, product 1") != std::string::npos,
                  tag(g, "the table's reduce column:\n" + table));
  });
}

TEST_CASE("CommWaitTimer counts the time blocked in communication, not the compute beside it",
          "[comm][debug]") {
  // The last rank joins each op 0.4 s late. A synchronous op blocks the others until it arrives; an async op
  // posted at once and waited for after 0.8 s of (slept) compute has completed by then, so waiting costs
  // nothing. Bounds are a quarter of a second from either side of what is timed.
  using std::chrono::milliseconds;
  const int world = GENERATE(1, 2, 4);
  testing::run_ranks(world, [](ProcessGroup& g) {
    const int n = g.size(), r = g.rank();
    const bool late = r == n - 1 && n > 1;
    auto t = Tensor<float, 1>::full({16}, 1.0f);
    barrier(g);
    CommWaitTimer outer;
    double sync_s = 0;
    {
      CommWaitTimer timer;
      if (late) {
        std::this_thread::sleep_for(milliseconds(400));
      }
      all_reduce(t, ReduceOp::sum, g);
      sync_s = timer.seconds();
      // Per op: all of it is the all_reduce's; the table names it.
      DTENSOR_CHECK(timer.seconds("all_reduce") == sync_s && timer.seconds("broadcast") == 0 &&
                        timer.seconds("all_reduce", "tp") == 0 && timer.entries().size() == 1 &&
                        timer.to_string().find("all_reduce") != std::string::npos,
                    tag(g, "the timer by op:\n" + timer.to_string()));
      DTENSOR_CHECK(late || n == 1 || sync_s > 0.3,
                    tag(g, "a synchronous all_reduce waited 0.4 s for the last rank, timed " +
                               std::to_string(sync_s) + " s"));
    }
    CommWaitTimer timer;
    if (late) {
      std::this_thread::sleep_for(milliseconds(400));
    }
    Work w = all_reduce(t, ReduceOp::sum, g, async_op);
    std::this_thread::sleep_for(milliseconds(800)); // compute beside the op: not communication
    w.wait();
    DTENSOR_CHECK(timer.seconds() < 0.25, tag(g, "an async all_reduce done before its wait timed " +
                                                     std::to_string(timer.seconds()) + " s"));
    DTENSOR_CHECK(std::abs(outer.seconds() - (sync_s + timer.seconds())) < 1e-9, // nested: both count
                  tag(g, "the outer timer has " + std::to_string(outer.seconds()) + " s, the inner ones " +
                             std::to_string(sync_s) + " and " + std::to_string(timer.seconds())));
    expect_values<float>(
        t, [&](auto) { return static_cast<float>(n * n); }, "the timed all_reduces");
    timer.reset();
    DTENSOR_CHECK(timer.seconds() == 0, tag(g, "reset"));
  });
}

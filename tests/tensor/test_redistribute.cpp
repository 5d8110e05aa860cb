// DTensor redistribution over in-process gloo ranks, against a single-process reference.
//
// The global tensor is g(i, j) = 100 i + j (integer-valued floats, exact in any reduction order). A
// Partial<sum> source holds g on the first coordinate of its Partial axes plus a zero-sum noise spread
// over all of them, so the reduction really has to happen. Every buffer the executor allocates is
// poisoned first. After each redistribution every rank's shard is compared with the reference block and
// the gathered full tensor with the reference.

#include <catch2/catch.hpp>

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/p2p.hpp>
#include <dtensor/core/extents.hpp>
#include <dtensor/core/tensor_io.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/plan/torch_reference.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/tensor/dtensor.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <variant>

using namespace dtensor;

namespace {

template <class... Ts>
struct List {};

template <class... Ts, class F>
void for_each_type(List<Ts...>, F&& f) {
  (f.template operator()<Ts>(), ...);
}

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

struct Poison {
  Poison() { exec::poison_buffers() = true; }
  ~Poison() { exec::poison_buffers() = false; }
};

double reference(std::int64_t i, std::int64_t j) {
  return 100.0 * i + j;
}

// This rank's shard of the reference under the DTensor type DT, with Partial<sum> axes holding the
// value plus zero-sum noise.
template <class DT, class Mesh>
DT make_source(const Mesh& mesh, std::int64_t rows, std::int64_t cols) {
  using T = typename DT::value_type;
  const typename DT::shape_type global{rows, cols};
  const Block b = spec_block(Extents{rows, cols}, DT::spec, mesh.sizes(), mesh.coordinate());
  int combos = 1;
  int linear = 0;
  for (int a = 0; a < DT::placements.size(); ++a) {
    if (DT::placements[a].is_partial()) {
      combos *= mesh.size(a);
      linear = linear * mesh.size(a) + mesh.coordinate()[a];
    }
  }
  Tensor<T, 2> local({b.shape[0], b.shape[1]});
  for (std::int64_t i = 0; i < b.shape[0]; ++i) {
    for (std::int64_t j = 0; j < b.shape[1]; ++j) {
      const std::int64_t gi = b.offset[0] + i;
      const double noise = (gi % 7 + 1) * (linear == 0 ? -(combos - 1) : 1);
      local(i, j) = static_cast<T>((linear == 0 ? reference(gi, b.offset[1] + j) : 0.0) + noise);
    }
  }
  return DT::from_local(mesh, local, global);
}

// Checks that x (no Partial axis) holds exactly the reference: its shard and its full tensor.
template <class DT>
void check_matches_reference(const DT& x, const std::string& what) {
  const auto& local = x.local();
  const auto off = x.local_offset();
  const Block b =
      spec_block(detail::to_extents(x.global_shape()), DT::spec, x.mesh().sizes(), x.mesh().coordinate());
  expect(detail::to_extents(local.shape()) == b.shape,
         what + ": local shape " + detail::shape_string(detail::to_extents(local.shape())) +
             " != " + detail::shape_string(b.shape));
  for (std::int64_t i = 0; i < local.shape()[0]; ++i) {
    for (std::int64_t j = 0; j < local.shape()[1]; ++j) {
      const double want = reference(off[0] + i, off[1] + j);
      expect(static_cast<double>(local(i, j)) == want,
             what + ": rank " + std::to_string(x.mesh().rank()) + " local (" + std::to_string(i) + ", " +
                 std::to_string(j) + ") = " + std::to_string(static_cast<double>(local(i, j))) +
                 ", expected " + std::to_string(want));
    }
  }
  const auto full = x.full_tensor();
  for (std::int64_t i = 0; i < x.global_shape()[0]; ++i) {
    for (std::int64_t j = 0; j < x.global_shape()[1]; ++j) {
      expect(static_cast<double>(full(i, j)) == reference(i, j),
             what + ": full_tensor(" + std::to_string(i) + ", " + std::to_string(j) + ") wrong on rank " +
                 std::to_string(x.mesh().rank()));
    }
  }
}

using Mesh1 = MeshShape<Axis<"x">>;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;
using Mesh3 = MeshShape<Axis<"pp", 2>, Axis<"dp", 2>, Axis<"tp", 2>>;

template <class Src, class Dst>
struct Pair {};

} // namespace

TEST_CASE("1-D meshes: every single-axis transition with the expected collective", "[dtensor]") {
  Poison poison;
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    testing::run_ranks(n, [n](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      // Sharded dims divisible by n, uneven, and smaller than the mesh (empty shards).
      const std::int64_t sizes[][2] = {{2 * n, 3 * n}, {2 * n + 1, n + 2}, {n - 1, n > 1 ? n - 1 : 0}};
      for (const auto& s : sizes) {
        using Sources = List<Replicate, Shard<0>, Shard<1>, Partial<>>;
        using Targets = List<Replicate, Shard<0>, Shard<1>>;
        for_each_type(Sources{}, [&]<class A>() {
          for_each_type(Targets{}, [&]<class B>() {
            auto x = make_source<DTensor<float, 2, Mesh1, A>>(mesh, s[0], s[1]);
            CommDebugMode comm;
            auto y = x.template redistribute<B>();
            const std::string what = "[" + to_string(A::value) + "] -> [" + to_string(B::value) + "] of (" +
                                     std::to_string(s[0]) + ", " + std::to_string(s[1]) + ") on " +
                                     std::to_string(n) + " ranks";
            const Placement a = A::value;
            const Placement b = B::value;
            std::string op;
            if (a.is_shard() && b.is_replicate()) {
              op = "all_gather";
            } else if (a.is_partial() && b.is_replicate()) {
              op = "all_reduce";
            } else if (a.is_partial() && b.is_shard()) {
              op = "reduce_scatter";
            } else if (a.is_shard() && b.is_shard() && a.dim != b.dim) {
              op = "all_to_all";
            }
            if (n == 1) {
              op.clear(); // an axis of size 1: no communication (the block stays as it is)
            }
            expect(comm.total_count() == (op.empty() ? 0 : 1),
                   what + ": " + std::to_string(comm.total_count()) + " collectives\n" + comm.to_string());
            expect(op.empty() || comm.count(op, "x") == 1,
                   what + ": expected one " + op + "\n" + comm.to_string());
            check_matches_reference(y, what);
          });
        });
        // R -> P -> R returns the value; P -> P is free.
        auto r = make_source<DTensor<float, 2, Mesh1, Replicate>>(mesh, s[0], s[1]);
        CommDebugMode comm;
        auto p = r.redistribute<Partial<>>();
        auto pp = p.redistribute<Partial<>>();
        expect(comm.total_count() == 0, "R -> P and P -> P communicate nothing");
        check_matches_reference(pp.redistribute<Replicate>(), "R -> P -> R");
        expect(comm.count("all_reduce") == (n > 1 ? 1 : 0), "P -> R is one all_reduce (none on one rank)");
      }
    });
  }
}

namespace {

void exhaustive_2d(int dp, int tp) {
  Poison poison;
  testing::run_ranks(dp * tp, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, dp, tp);
    using Sources = List<Replicate, Shard<0>, Shard<1>, Partial<>>;
    using Targets = List<Replicate, Shard<0>, Shard<1>>;
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{7, 5}, {8, 6}}) {
      for_each_type(Sources{}, [&]<class A0>() {
        for_each_type(Sources{}, [&]<class A1>() {
          for_each_type(Targets{}, [&]<class B0>() {
            for_each_type(Targets{}, [&]<class B1>() {
              auto x = make_source<DTensor<float, 2, Mesh2, A0, A1>>(mesh, rows, cols);
              CommDebugMode comm;
              auto y = x.template redistribute<B0, B1>();
              const auto plan = x.template plan_for<B0, B1>(); // the plan for this mesh's sizes
              const std::string what =
                  plan.to_string() + " of (" + std::to_string(rows) + ", " + std::to_string(cols) + ")";
              const std::int64_t counted = comm.total_count();
              const std::int64_t counted_bytes = comm.total_bytes();
              const std::string table = comm.to_string();
              check_matches_reference(y, what);
              // CommDebugMode saw every step, with the bytes the plan's geometry says this rank receives;
              // the most any rank received is the plan's bytes_per_rank (one step) or at most it.
              const Extents global{rows, cols};
              std::int64_t expected = 0;
              for (const Step& st : plan.plan.steps) {
                expected += step_elements_received(st, global, mesh.sizes(), mesh.coordinate()) * 4;
              }
              expect(counted == plan.plan.num_collectives() && counted_bytes == expected,
                     what + ": CommDebugMode counted " + std::to_string(counted) + " ops, " +
                         std::to_string(counted_bytes) + " bytes; the plan says " +
                         std::to_string(plan.plan.num_collectives()) + ", " + std::to_string(expected) +
                         "\n" + table);
              auto most = Tensor<std::int64_t, 1>::full({1}, counted_bytes);
              all_reduce(most, ReduceOp::max, world);
              const std::int64_t bound = plan.bytes_per_rank(global, mesh.sizes());
              expect(plan.plan.num_collectives() > 1 ? most(0) <= bound : most(0) == bound,
                     what + ": the most any rank received is " + std::to_string(most(0)) +
                         " bytes, bytes_per_rank says " + std::to_string(bound));
            });
          });
        });
      });
    }
  });
}

} // namespace

TEST_CASE("an rvalue DTensor is reduced in place, an lvalue is left as it was", "[dtensor]") {
  Poison poison;
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    testing::run_ranks(n, [n](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      using PT = DTensor<float, 2, Mesh1, Partial<>>;
      // The lvalue keeps its partial values; the result is a new buffer.
      auto p = make_source<PT>(mesh, 2 * n + 1, 3);
      const auto before = p.local().clone();
      auto r = p.redistribute<Replicate>();
      check_matches_reference(r, "P -> R of an lvalue");
      // (On one rank nothing is reduced: the result is the block itself, as an R -> R is.)
      expect((r.local().data() != p.local().data()) == (n > 1), "an lvalue's P -> R writes a new buffer");
      for (std::int64_t i = 0; i < before.shape()[0]; ++i) {
        for (std::int64_t j = 0; j < before.shape()[1]; ++j) {
          expect(p.local()(i, j) == before(i, j), "an lvalue's P -> R leaves the input alone");
        }
      }
      // An rvalue whose memory nothing else holds is reduced in place.
      auto q = make_source<PT>(mesh, 2 * n + 1, 3);
      const float* memory = q.local().data();
      auto s = std::move(q).redistribute<Replicate>();
      check_matches_reference(s, "P -> R of an rvalue");
      expect(s.local().data() == memory, "an rvalue's P -> R reuses its memory");
      // Shared memory is never overwritten, rvalue or not: a copy still holds the partial values.
      auto u = make_source<PT>(mesh, 2 * n + 1, 3);
      const auto held = u.local();
      const auto kept = held.clone();
      auto v = std::move(u).redistribute<Replicate>();
      check_matches_reference(v, "P -> R of an rvalue whose memory is shared");
      expect((v.local().data() != held.data()) == (n > 1), "shared memory: P -> R writes a new buffer");
      for (std::int64_t i = 0; i < kept.shape()[0]; ++i) {
        for (std::int64_t j = 0; j < kept.shape()[1]; ++j) {
          expect(held(i, j) == kept(i, j), "memory another tensor holds is not reduced in place");
        }
      }
      // The chain R -> P -> R through a temporary: the all_reduce runs on the temporary.
      auto x = DTensor<float, 2, Mesh1, Replicate>::from_local(mesh, r.local().clone(), r.global_shape());
      check_matches_reference(x.redistribute<Partial<>>().redistribute<Replicate>(), "R -> P -> R");
      check_matches_reference(x, "R after R -> P -> R");
    });
  }
}

TEST_CASE("2-D mesh (2,2): every source in {R,S(0),S(1),P}^2 to every target in {R,S(0),S(1)}^2",
          "[dtensor]") {
  exhaustive_2d(2, 2);
}

TEST_CASE("2-D mesh (3,2): every source in {R,S(0),S(1),P}^2 to every target in {R,S(0),S(1)}^2",
          "[dtensor]") {
  exhaustive_2d(3, 2);
}

TEST_CASE("2-D mesh (2,1): every source in {R,S(0),S(1),P}^2 to every target in {R,S(0),S(1)}^2",
          "[dtensor]") {
  exhaustive_2d(2, 1);
}

namespace {

/// The ops CommDebugMode recorded, by op name, and whether every one ran over the axes `axes`.
std::map<std::string, std::int64_t> ops_of(const CommDebugMode& comm, const std::string& axes, bool& only) {
  std::map<std::string, std::int64_t> ops;
  for (const auto& [key, e] : comm.entries()) {
    ops[key.first] += e.count;
    only = only && key.second == axes;
  }
  return ops;
}

} // namespace

TEST_CASE("a mesh axis of size 1 costs nothing: on (n, 1) and (1, n) every transition runs what the 1-D mesh "
          "runs",
          "[dtensor]") {
  Poison poison;
  for (int n = 1; n <= 4; ++n) {
    for (const bool first : {true, false}) { // the size-n axis first (n, 1), or second (1, n)
      INFO("mesh " << (first ? n : 1) << ", " << (first ? 1 : n));
      testing::run_ranks(n, [&](ProcessGroup& world) {
        auto mesh = init_device_mesh<Mesh2>(world, first ? n : 1, first ? 1 : n);
        auto line = init_device_mesh<Mesh1>(world); // the same ranks in the same order
        const std::string live = first ? "dp" : "tp";
        using Sources = List<Replicate, Shard<0>, Shard<1>, Partial<>>;
        using Targets = List<Replicate, Shard<0>, Shard<1>>;
        for_each_type(Sources{}, [&]<class A0>() {
          for_each_type(Sources{}, [&]<class A1>() {
            for_each_type(Targets{}, [&]<class B0>() {
              for_each_type(Targets{}, [&]<class B1>() {
                auto x = make_source<DTensor<float, 2, Mesh2, A0, A1>>(mesh, 2 * n + 1, n + 2);
                CommDebugMode comm;
                auto y = x.template redistribute<B0, B1>();
                const std::string what = x.template plan_for<B0, B1>().to_string();
                bool only = true;
                const auto got = ops_of(comm, live, only);
                expect(only, what + ": an op over an axis of size 1\n" + comm.to_string());
                check_matches_reference(y, what);
                // The same transition on the 1-D mesh of the size-n axis.
                auto one_d = [&]<class S, class T>() {
                  auto u = make_source<DTensor<float, 2, Mesh1, S>>(line, 2 * n + 1, n + 2);
                  CommDebugMode c;
                  auto v = u.template redistribute<T>();
                  bool o = true;
                  return ops_of(c, "x", o);
                };
                const auto want =
                    first ? one_d.template operator()<A0, B0>() : one_d.template operator()<A1, B1>();
                const auto show = [](const std::map<std::string, std::int64_t>& m) {
                  std::string t;
                  for (const auto& [op, count] : m) {
                    t += " " + op + " x" + std::to_string(count);
                  }
                  return t;
                };
                expect(got == want, what + ": ran" + show(got) + ", the 1-D mesh" + show(want));
              });
            });
          });
        });
      });
    }
  }
}

TEST_CASE("a mesh axis of size 1 costs nothing: the five transitions of torch's test_one_chunk_mesh on "
          "(4, 1), static and dynamic",
          "[dtensor]") {
  using Static = MeshShape<Axis<"a", 4>, Axis<"b", 1>>;
  using Dynamic = MeshShape<Axis<"a">, Axis<"b">>;
  // The plans with the sizes known at compile time: the step over b is dropped.
  STATIC_REQUIRE(DTensor<float, 2, Static, Shard<0>, Shard<1>>::plan_to<Shard<0>, Replicate>().plan.size() ==
                 0);
  STATIC_REQUIRE(DTensor<float, 2, Static, Shard<0>, Shard<1>>::plan_to<Shard<0>, Shard<0>>().plan.size() ==
                 0);
  STATIC_REQUIRE(DTensor<float, 2, Static, Shard<0>, Partial<>>::plan_to<Shard<0>, Shard<0>>().plan.size() ==
                 0);
  STATIC_REQUIRE(DTensor<float, 2, Static, Shard<0>, Partial<>>::plan_to<Shard<0>, Shard<1>>().plan.size() ==
                 0);
  STATIC_REQUIRE(DTensor<float, 2, Static, Shard<0>, Partial<>>::plan_to<Shard<0>, Replicate>().plan.size() ==
                 0);
  CHECK(DTensor<float, 2, Static, Shard<0>, Partial<>>::plan_to<Shard<0>, Replicate>().to_string() ==
        "[S(0),P(sum)] -> [S(0),R]: nothing to do");
  // Dynamic sizes: the nominal plan has the step; the plan run on (4, 1) has not.
  CHECK(DTensor<float, 2, Dynamic, Shard<0>, Partial<>>::plan_to<Shard<0>, Replicate>().plan.size() == 1);
  Poison poison;
  testing::run_ranks(4, [](ProcessGroup& world) {
    const auto five = [&]<class Shape>(const DeviceMesh<Shape>& mesh, const std::string& kind) {
      const auto run = [&]<class... S>(Placements<S...>, auto to) {
        using X = DTensor<float, 2, Shape, S...>;
        const auto x = make_source<X>(mesh, 16, 8);
        CommDebugMode comm;
        const auto y = [&]<class... T>(Placements<T...>) {
          expect(x.template plan_for<T...>().plan.size() == 0,
                 kind + ": the plan run has a step: " + x.template plan_for<T...>().to_string());
          return x.template redistribute<T...>();
        }(to);
        expect(comm.total_count() == 0,
               kind + ": " + std::to_string(comm.total_count()) + " ops\n" + comm.to_string());
        check_matches_reference(y, kind + " " + to_string(X::placements));
      };
      run(Placements<Shard<0>, Shard<1>>{}, Placements<Shard<0>, Replicate>{});
      run(Placements<Shard<0>, Shard<1>>{}, Placements<Shard<0>, Shard<0>>{});
      run(Placements<Shard<0>, Partial<>>{}, Placements<Shard<0>, Shard<0>>{});
      run(Placements<Shard<0>, Partial<>>{}, Placements<Shard<0>, Shard<1>>{});
      run(Placements<Shard<0>, Partial<>>{}, Placements<Shard<0>, Replicate>{});
    };
    five(init_device_mesh<Static>(world), "static (4, 1)");
    five(init_device_mesh<Dynamic>(world, 4, 1), "dynamic (4, 1)");
  });
}

TEST_CASE("order-sensitive plans: permutations and flattened all_to_all", "[dtensor]") {
  Poison poison;
  testing::run_ranks(4, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
    const int r = world.rank();
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{8, 6}, {7, 5}, {3, 1}}) {
      const std::string shape = " of (" + std::to_string(rows) + ", " + std::to_string(cols) + ")";
      {
        auto x = make_source<DTensor<float, 2, Mesh2, Shard<0>, Shard<1>>>(mesh, rows, cols);
        CommDebugMode comm;
        auto y = x.redistribute<Shard<1>, Shard<0>>();
        expect(comm.total_count() == 1 && comm.count("permute", "dp*tp") == 1,
               "[S(0),S(1)] -> [S(1),S(0)] is one permute" + shape + "\n" + comm.to_string());
        if (r == 0 || r == 3) {
          expect(comm.total_bytes() == 0, "diagonal rank " + std::to_string(r) + " receives nothing" + shape);
        }
        check_matches_reference(y, "[S(0),S(1)] -> [S(1),S(0)]" + shape);
      }
      {
        auto x = make_source<DTensor<float, 2, Mesh2, Shard<0>, Shard<0>>>(mesh, rows, cols);
        CommDebugMode comm;
        auto y = x.redistribute<Shard<1>, Shard<1>>();
        expect(comm.total_count() == 1 && comm.count("all_to_all", "dp*tp") == 1,
               "[S(0),S(0)] -> [S(1),S(1)] is one all_to_all over dp*tp" + shape + "\n" + comm.to_string());
        check_matches_reference(y, "[S(0),S(0)] -> [S(1),S(1)]" + shape);
      }
    }
  });
}

TEST_CASE("3-axis mesh: S->S plans never all_gather and move no more than PyTorch's", "[dtensor]") {
  Poison poison;
  using S = List<Shard<0>, Shard<1>>;
  testing::run_ranks(8, [](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh3>(world);
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{8, 8}, {9, 7}}) {
      // Every source and target in {S(0), S(1)}^3.
      for_each_type(S{}, [&]<class A0>() {
        for_each_type(S{}, [&]<class A1>() {
          for_each_type(S{}, [&]<class A2>() {
            auto x = make_source<DTensor<float, 2, Mesh3, A0, A1, A2>>(mesh, rows, cols);
            for_each_type(S{}, [&]<class B0>() {
              for_each_type(S{}, [&]<class B1>() {
                for_each_type(S{}, [&]<class B2>() {
                  CommDebugMode comm;
                  auto y = x.template redistribute<B0, B1, B2>();
                  const auto plan = decltype(x)::template plan_to<B0, B1, B2>();
                  const std::string what =
                      plan.to_string() + " of (" + std::to_string(rows) + ", " + std::to_string(cols) + ")";
                  expect(comm.count("all_gather") == 0, what + " uses all_gather");
                  const Extents global{rows, cols};
                  const std::int64_t ours = plan.bytes_per_rank(global, mesh.sizes(), 4);
                  const std::int64_t torch = torch_greedy_bytes(
                      placement_list_v<A0, A1, A2>, placement_list_v<B0, B1, B2>, global, mesh.sizes(), 4);
                  expect(ours <= torch, what + ": " + std::to_string(ours) + " bytes per rank > PyTorch's " +
                                            std::to_string(torch));
                  check_matches_reference(y, what);
                });
              });
            });
          });
        });
      });
    }
  });
}

TEST_CASE("collective plans agree with the exact exchange fallback", "[dtensor]") {
  Poison poison;
  for (auto [dp, tp] : {std::pair<int, int>{2, 2}, {3, 2}}) {
    testing::run_ranks(dp * tp, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh2>(world, dp, tp);
      using L = List<Replicate, Shard<0>, Shard<1>>;
      for_each_type(L{}, [&]<class A0>() {
        for_each_type(L{}, [&]<class A1>() {
          auto x = make_source<DTensor<float, 2, Mesh2, A0, A1>>(mesh, 7, 5);
          for_each_type(L{}, [&]<class B0>() {
            for_each_type(L{}, [&]<class B1>() {
              auto planned = x.template redistribute<B0, B1>();
              auto exchanged = x.template redistribute_by_exchange<B0, B1>();
              expect(equal(planned.local(), exchanged.local()),
                     decltype(x)::template plan_to<B0, B1>().to_string() + " differs from the exchange");
            });
          });
        });
      });
      // Partial axes are carried through the exchange unreduced.
      auto p = make_source<DTensor<float, 2, Mesh2, Partial<>, Shard<0>>>(mesh, 7, 5);
      auto planned = p.redistribute<Partial<>, Shard<1>>().redistribute<Replicate, Replicate>();
      auto exchanged = p.redistribute_by_exchange<Partial<>, Shard<1>>().redistribute<Replicate, Replicate>();
      expect(equal(planned.local(), exchanged.local()), "[P,S(0)] -> [P,S(1)] differs from the exchange");
    });
  }
}

TEST_CASE("random chains of redistributions return to the original exactly", "[dtensor]") {
  Poison poison;
  // A menu of layouts; each chain hops between them at random (fixed seeds) and ends where it began.
  using Menu =
      List<Placements<Shard<0>, Replicate>, Placements<Shard<1>, Shard<0>>, Placements<Shard<0>, Shard<0>>,
           Placements<Replicate, Shard<1>>, Placements<Shard<1>, Shard<1>>, Placements<Replicate, Replicate>,
           Placements<Shard<1>, Replicate>>;
  using Any = std::variant<
      DTensor<float, 2, Mesh2, Shard<0>, Replicate>, DTensor<float, 2, Mesh2, Shard<1>, Shard<0>>,
      DTensor<float, 2, Mesh2, Shard<0>, Shard<0>>, DTensor<float, 2, Mesh2, Replicate, Shard<1>>,
      DTensor<float, 2, Mesh2, Shard<1>, Shard<1>>, DTensor<float, 2, Mesh2, Replicate, Replicate>,
      DTensor<float, 2, Mesh2, Shard<1>, Replicate>>;
  auto hop = [](const Any& cur, std::size_t target) {
    return std::visit(
        [&](const auto& x) {
          Any out = x;
          std::size_t i = 0;
          for_each_type(Menu{}, [&]<class L>() {
            if (i++ == target) {
              [&]<class... Q>(Placements<Q...>) { out = x.template redistribute<Q...>(); }(L{});
            }
          });
          return out;
        },
        cur);
  };
  for (int n : {4, 6}) {
    testing::run_ranks(n, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh2>(world, 2, n / 2);
      for (unsigned seed : {1u, 2u, 3u, 4u, 5u, 6u}) {
        std::mt19937 rng(seed);
        const auto x = make_source<DTensor<float, 2, Mesh2, Shard<0>, Replicate>>(mesh, 9, 7);
        Any cur = x;
        std::string path = "[S(0),R]";
        for (int step = 0; step < 8; ++step) {
          const std::size_t t = rng() % std::variant_size_v<Any>;
          cur = hop(cur, t);
          path += " -> " + std::visit([](const auto& y) { return to_string(y.placements); }, cur);
        }
        cur = hop(cur, 0);
        const auto& back = std::get<0>(cur);
        expect(equal(back.local(), x.local()),
               "seed " + std::to_string(seed) + ": " + path + " changed the shard");
        check_matches_reference(back, "seed " + std::to_string(seed) + ": " + path);
      }
    });
  }
}

TEST_CASE("CommDebugMode counts every path: distribute_tensor, full_tensor, collectives, point-to-point",
          "[dtensor]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    testing::run_ranks(n, [n](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      const int r = world.rank();
      const std::int64_t rows = 2 * n + 1;
      const auto full = Tensor<float, 2>::full({rows, 3}, 1.0f);
      CommDebugMode comm;
      auto x = distribute_tensor<Shard<0>>(mesh, full, 0);
      // One broadcast of the shape (2 int64 received off the source), one scatter of the blocks.
      const std::int64_t mine = chunk_size(rows, n, r) * 3 * 4;
      expect(comm.count("broadcast", "x") == 1 && comm.bytes("broadcast") == (r == 0 ? 0 : 16),
             "distribute_tensor's shape broadcast\n" + comm.to_string());
      expect(comm.count("scatter", "x") == 1 && comm.bytes("scatter") == (r == 0 ? 0 : mine),
             "distribute_tensor's scatter\n" + comm.to_string());
      comm.reset();
      auto f = x.full_tensor();
      expect(comm.total_count() == (n > 1 ? 1 : 0) && comm.bytes("all_gather", "x") == rows * 3 * 4 - mine,
             "full_tensor is one all_gather (none on one rank)\n" + comm.to_string());
      comm.reset();
      auto t = Tensor<float, 1>::full({10}, 1.0f);
      all_reduce(t, ReduceOp::sum, mesh.group<"x">());
      all_reduce(t, ReduceOp::sum, world);
      expect(comm.count("all_reduce", "x") == 1 && comm.count("all_reduce") == 2 &&
                 comm.bytes("all_reduce", "x") == (n == 1 ? 0 : (2 * (n - 1) * 10 + n - 1) / n * 4),
             "plain collectives are counted under their group's label\n" + comm.to_string());
      comm.reset();
      if (n > 1) {
        const int next = (r + 1) % n;
        const int prev = (r + n - 1) % n;
        auto out = Tensor<float, 1>::full({10}, 2.0f);
        auto in = Tensor<float, 1>({10});
        std::vector<P2POp> ops{{P2POp::isend, out, next, world}, {P2POp::irecv, in, prev, world}};
        for (auto& w : batch_isend_irecv(ops)) {
          w.wait();
        }
        expect(comm.count("batch_isend_irecv") == 1 && comm.bytes("batch_isend_irecv") == 40,
               "batch_isend_irecv counts what it receives\n" + comm.to_string());
      }
    });
  }
}

TEST_CASE("a redistribution on a sub-mesh never waits on ranks outside it", "[dtensor]") {
  // Mesh (pp=2, dp=2, tp=2) on 8 ranks; stage 0 = ranks 0-3, stage 1 = 4-7. Stage 0 permutes on its slice
  // (its dp*tp group is made on first use) and then sends to stage 1, which meanwhile blocks receiving
  // those sends. If making the group took stage 1's ranks, this would deadlock (and fail with a
  // TimeoutError after 5 s).
  using Pipe = MeshShape<Axis<"pp", 2>, Axis<"dp">, Axis<"tp">>;
  testing::RunRanksOptions options;
  options.timeout = std::chrono::seconds(5);
  testing::run_ranks(
      8,
      [](ProcessGroup& world) {
        const int r = world.rank();
        for (int round = 0; round < 20; ++round) {
          auto mesh = init_device_mesh<Pipe>(world, 2, 2);
          auto stage = mesh.slice<"dp", "tp">();
          auto permute_on_stage = [&] {
            auto x = make_source<DTensor<float, 2, MeshShape<Axis<"dp">, Axis<"tp">>, Shard<0>, Shard<1>>>(
                stage, 7, 5);
            CommDebugMode comm;
            auto y = x.redistribute<Shard<1>, Shard<0>>();
            expect(comm.count("permute", "dp*tp") == 1, "a permute over the stage\n" + comm.to_string());
            check_matches_reference(y, "[S(0),S(1)] -> [S(1),S(0)] on stage " + std::to_string(r / 4));
          };
          auto msg = Tensor<float, 1>::full({4}, static_cast<float>(round));
          auto got = Tensor<float, 1>::full({4}, -1.0f);
          if (r < 4) {
            permute_on_stage();
            send(msg, r + 4, world);
          } else {
            recv(got, r - 4, world);
            expect(got(3) == static_cast<float>(round), "stage 1 got stage 0's message");
            permute_on_stage();
          }
        }
      },
      options);
}

TEST_CASE("a dynamic axis size picks the plan its static size would", "[dtensor]") {
  {
    // [R,P,R] -> [R,S(0),R] with dp = 8: the replicated axes chunk first, so the reduce_scatter over dp runs
    // on an eighth of the data. With dp dynamic the nominal size (2) would not (it does not pay there).
    using Src = Placements<Replicate, Partial<>, Replicate>;
    using Dst = Placements<Replicate, Shard<0>, Replicate>;
    using Dynamic = MeshShape<Axis<"x", 2>, Axis<"dp">, Axis<"tp", 4>>;
    using Static = MeshShape<Axis<"x", 2>, Axis<"dp", 8>, Axis<"tp", 4>>;
    const MeshSizes sizes{2, 8, 4};
    const Extents global{256, 64};
    const Plan& chosen = detail::select_plan<Dynamic, 2, Src, Dst>(sizes);
    CHECK(&detail::select_plan<Dynamic, 2, Src, Dst>(sizes) == &chosen);               // made once, then kept
    const Plan& other = detail::select_plan<Dynamic, 2, Src, Dst>(MeshSizes{2, 2, 4}); // other sizes: another
    CHECK(&other != &chosen);
    CHECK(bytes_per_rank(other, global, {2, 2, 4}, 4) ==
          (plan_of<MeshShape<Axis<"x", 2>, Axis<"dp", 2>, Axis<"tp", 4>>, 2, Src, Dst>().bytes_per_rank(
              global, {2, 2, 4})));
    CHECK(&detail::select_plan<Dynamic, 2, Src, Dst>(sizes) == &chosen); // and back: the kept one
    const auto fixed = plan_of<Static, 2, Src, Dst>();
    const std::int64_t nominal = bytes_per_rank(detail::plan_v<Dynamic, 2, Src, Dst>, global, sizes, 4);
    INFO(to_string(chosen, Dynamic::names) << " vs " << fixed.to_string());
    CHECK(bytes_per_rank(chosen, global, sizes, 4) == fixed.bytes_per_rank(global, sizes));
    CHECK(bytes_per_rank(chosen, global, sizes, 4) < nominal);
  }
  // [P,S(0),R] -> [R,R,S(1)]: where the all_reduce goes and whether tp chunks first depend on tp's size.
  using Src = Placements<Partial<>, Shard<0>, Replicate>;
  using Dst = Placements<Replicate, Replicate, Shard<1>>;
  Poison poison;
  testing::run_ranks(4, [](ProcessGroup& world) {
    using Dynamic = MeshShape<Axis<"x", 2>, Axis<"dp", 2>, Axis<"tp">>; // tp = 1 here, 2 nominally
    using Static = MeshShape<Axis<"x", 2>, Axis<"dp", 2>, Axis<"tp", 1>>;
    auto mesh = init_device_mesh<Dynamic>(world);
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{7, 5}, {8, 6}}) {
      auto x = make_source<DTensor<float, 2, Dynamic, Partial<>, Shard<0>, Replicate>>(mesh, rows, cols);
      CommDebugMode comm;
      auto y = x.redistribute<Replicate, Replicate, Shard<1>>();
      const auto fixed = plan_of<Static, 2, Src, Dst>();
      const auto used = x.plan_for<Replicate, Replicate, Shard<1>>();
      expect(used.to_string() == fixed.to_string(),
             "the plan run on tp = 1 is " + used.to_string() + ", the static one " + fixed.to_string());
      expect(comm.total_count() == fixed.plan.num_collectives(),
             "the static plan's steps ran\n" + comm.to_string());
      check_matches_reference(y, used.to_string());
    }
  });
}

TEST_CASE("an error inside a redistribution names the plan, the step, the rank and the shapes", "[dtensor]") {
  // Rank 1 never joins the permute; rank 2, which exchanges with it, times out inside step 1.
  testing::RunRanksOptions options;
  options.timeout = std::chrono::milliseconds(700);
  std::string message;
  try {
    testing::run_ranks(
        4,
        [](ProcessGroup& world) {
          auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
          auto x = make_source<DTensor<float, 2, Mesh2, Shard<0>, Shard<1>>>(mesh, 7, 5);
          if (world.rank() == 1) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            return;
          }
          auto y = x.redistribute<Shard<1>, Shard<0>>();
        },
        options);
  } catch (const Error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(
      message.find("redistribute [S(0),S(1)] -> [S(1),S(0)], step 1 of 1: permute(dp*tp), on mesh rank 2 at "
                   "(1, 0), global (7, 5), local (3, 3): ") != std::string::npos);
}

// Tensor-parallel layers (nn/linear.hpp): a column- then row-parallel MLP, with and without sequence
// parallelism, forward and backward on 1-D tp meshes of 1-4 ranks and on (dp, tp) = (2,2) and (1,3) with a
// dp-sharded batch, against the same layers on one rank (a 1-rank in-process world: the weights come from
// the sharding-invariant randn, so they are the same numbers); uneven sizes (hidden 5, ffn 7, tokens 6).
// CommDebugMode pins the collectives: tensor parallel, one all_reduce forward and one backward; sequence
// parallel, all_gather + reduce_scatter forward and reduce_scatter + all_gather backward.
#include <catch2/catch.hpp>

#include <dtensor/backward/activation_checkpoint.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/contract.hpp>
#include <dtensor/nn/linear.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

using namespace dtensor;

// The layers are units of the model contract (nn/contract.hpp): a model of them trains under any trainer.
static_assert(nn::Unit<nn::ColumnParallelLinear<float, MeshShape<Axis<"dp">, Axis<"tp">>>> &&
              nn::Unit<nn::RowParallelLinear<double, MeshShape<Axis<"tp">>, "tp", true, 1>>);

using namespace dtensor::test_support;

namespace {

using TpMesh = MeshShape<Axis<"tp">>; // the layers find their axis by name

constexpr std::int64_t kTokens = 6, kHidden = 5, kFfn = 7;

struct Full {
  Tensor<double, 2> y, dx, dw1, dw2;
  Tensor<double, 1> db1, db2;
  std::int64_t forward_collectives = 0, backward_collectives = 0;
  std::string forward, backward; // CommDebugMode tables

  /// The full tensors of the output and the gradients.
  template <class Y, class DX, class DW1, class DW2, class DB1, class DB2>
  void set(const Y& y_, const DX& dx_, const DW1& dw1_, const DW2& dw2_, const DB1& db1_, const DB2& db2_) {
    y = y_.full_tensor();
    dx = dx_.full_tensor();
    dw1 = dw1_.full_tensor();
    dw2 = dw2_.full_tensor();
    db1 = db1_.full_tensor();
    db2 = db2_.full_tensor();
  }
};

// The MLP on `mesh` with input placements XP; SP selects sequence parallelism.
template <class Mesh, class XP, bool SP>
Full mlp(const DeviceMesh<Mesh>& mesh) {
  using X = typename dt<Mesh, 2, XP>::type;
  nn::ColumnParallelLinear<double, Mesh, "tp", SP> up(mesh, kHidden, kFfn, 11);
  nn::RowParallelLinear<double, Mesh, "tp", SP> down(mesh, kFfn, kHidden, 12);
  const X x = make<X>(mesh, {kTokens, kHidden}, 1);
  Full f;
  CommDebugMode fwd;
  auto [h, up_back] = up.forward(x, with_backward);
  auto [a, act_back] = gelu(h, with_backward);
  auto [y, down_back] = down.forward(a, with_backward);
  f.forward_collectives = fwd.total_count();
  f.forward = fwd.to_string();
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(y)>, X>,
                "the MLP's output is placed like its input");
  using Y = std::remove_cvref_t<decltype(y)>;
  const Y dy = make<Y>(mesh, {kTokens, kHidden}, 2);
  CommDebugMode bwd;
  auto [da, g2] = down_back(dy);
  auto [dw2, db2] = g2;
  auto [dx, g1] = up_back(act_back(da));
  auto [dw1, db1] = g1;
  f.backward_collectives = bwd.total_count();
  f.backward = bwd.to_string();
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(dx)>, X>, "dx is placed like x");
  f.set(y, dx, dw1, dw2, db1, db2);
  return f;
}

// The same MLP as one checkpointed block (backward/activation_checkpoint.hpp): the forward keeps x only, the
// backward runs the block again with its backward's context. `calls` counts the block's runs.
template <class Mesh, class XP, bool SP>
Full mlp_checkpointed(const DeviceMesh<Mesh>& mesh, int& calls) {
  using X = typename dt<Mesh, 2, XP>::type;
  nn::ColumnParallelLinear<double, Mesh, "tp", SP> up(mesh, kHidden, kFfn, 11);
  nn::RowParallelLinear<double, Mesh, "tp", SP> down(mesh, kFfn, kHidden, 12);
  const X x = make<X>(mesh, {kTokens, kHidden}, 1);
  auto block = [&](const X& in, WithBackwardTag) {
    ++calls;
    auto [h, up_back] = up.forward(in, with_backward);
    auto [a, act_back] = gelu(h, with_backward);
    auto [y, down_back] = down.forward(a, with_backward);
    auto back = [up_back, act_back, down_back](const auto& dy) {
      auto [da, g2] = down_back(dy);
      auto [dw2, db2] = g2;
      auto [dx, g1] = up_back(act_back(da));
      auto [dw1, db1] = g1;
      return std::tuple{dx, dw1, db1, dw2, db2};
    };
    return WithBackward<decltype(y), decltype(back)>{y, back};
  };
  Full f;
  CommDebugMode fwd;
  auto [y, back] = activation_checkpoint(block, x);
  f.forward_collectives = fwd.total_count();
  f.forward = fwd.to_string();
  using Y = std::remove_cvref_t<decltype(y)>;
  const Y dy = make<Y>(mesh, {kTokens, kHidden}, 2);
  CommDebugMode bwd;
  auto [dx, dw1, db1, dw2, db2] = back(dy);
  f.backward_collectives = bwd.total_count();
  f.backward = bwd.to_string();
  f.set(y, dx, dw1, dw2, db1, db2);
  return f;
}

template <class T, int Rk>
void same(const Tensor<T, Rk>& got, const Tensor<T, Rk>& want, const std::string& what) {
  expect(got.shape() == want.shape(), what + ": shape");
  for (std::int64_t e = 0; e < want.numel(); ++e) {
    const double g = got.data()[e];
    const double w = want.data()[e];
    expect(std::abs(g - w) <= 1e-12 * (1 + std::abs(w)), what + ": element " + std::to_string(e) + " is " +
                                                             std::to_string(g) + ", want " +
                                                             std::to_string(w));
  }
}

template <class Mesh, class XP, bool SP, class... Sizes>
void tp_case(int ranks, const std::string& name, Sizes... sizes) {
  Full want;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    want = mlp<Mesh, XP, SP>(init_device_mesh<Mesh>(one, (sizes * 0 + 1)...));
  });
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    const Full got = mlp<Mesh, XP, SP>(mesh);
    same(got.y, want.y, name + ": y");
    same(got.dx, want.dx, name + ": dx");
    same(got.dw1, want.dw1, name + ": dW1");
    same(got.dw2, want.dw2, name + ": dW2");
    same(got.db1, want.db1, name + ": db1");
    same(got.db2, want.db2, name + ": db2");
    // The collectives of a tensor-parallel MLP, on the tp axis only.
    const std::int64_t tp = mesh.size(Mesh::template index_of<"tp">());
    if (tp > 1) {
      const std::int64_t want_fwd = SP ? 2 : 1;
      expect(got.forward_collectives == want_fwd, name + ": forward collectives\n" + got.forward);
      expect(got.backward_collectives == want_fwd, name + ": backward collectives\n" + got.backward);
      if (SP) {
        expect(got.forward.find("all_gather") != std::string::npos &&
                   got.forward.find("reduce_scatter") != std::string::npos,
               name + ": forward\n" + got.forward);
      } else {
        expect(got.forward.find("all_reduce") != std::string::npos, name + ": forward\n" + got.forward);
      }
    }
  });
}

} // namespace

TEST_CASE(
    "column- then row-parallel MLP, forward and backward, equals one rank: tp 1-4, (dp, tp) (2,2), (1,3)",
    "[parallel]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    tp_case<TpMesh, Placements<R>, false>(n, "tp " + std::to_string(n));
  }
  tp_case<Mesh2, Placements<S<0>, R>, false>(4, "(2,2) batch on dp", 2, 2);
  tp_case<Mesh2, Placements<S<0>, R>, false>(3, "(1,3) batch on dp", 1, 3);
}

TEST_CASE(
    "activation checkpointing: the block runs again in the backward, gradients bit-identical, 1-4 ranks",
    "[parallel][checkpoint]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    testing::run_ranks(n, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<TpMesh>(world);
      const Full plain = mlp<TpMesh, Placements<S<0>>, true>(mesh);
      int calls = 0;
      const Full ck = mlp_checkpointed<TpMesh, Placements<S<0>>, true>(mesh, calls);
      const std::string where = "rank " + std::to_string(world.rank()) + " of " + std::to_string(n);
      expect(calls == 2, where + ": the block ran " + std::to_string(calls) + " times, want 2");
      auto identical = [&](const auto& a, const auto& b, const char* what) {
        bool ok = a.shape() == b.shape();
        for (std::int64_t e = 0; ok && e < a.numel(); ++e) {
          ok = a.data()[e] == b.data()[e];
        }
        expect(ok, where + ": " + what + " differs from the plain backward's");
      };
      identical(ck.y, plain.y, "y");
      identical(ck.dx, plain.dx, "dx");
      identical(ck.dw1, plain.dw1, "dW1");
      identical(ck.dw2, plain.dw2, "dW2");
      identical(ck.db1, plain.db1, "db1");
      identical(ck.db2, plain.db2, "db2");
      // the recomputed forward repeats its collectives inside the backward
      expect(ck.forward_collectives == plain.forward_collectives &&
                 ck.backward_collectives == plain.forward_collectives + plain.backward_collectives,
             where + ": collectives forward " + std::to_string(ck.forward_collectives) + ", backward " +
                 std::to_string(ck.backward_collectives) + "\n" + ck.backward);
    });
  }
}

TEST_CASE("sequence parallel: the activations Shard<0> on tp between the layers, equal to one rank",
          "[parallel]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    tp_case<TpMesh, Placements<S<0>>, true>(n, "sp " + std::to_string(n));
  }
  tp_case<Mesh2, Placements<S<0>, S<0>>, true>(4, "(2,2) batch on dp, sequence on tp", 2, 2);
}

// 10: your own model under the library's trainers. The layers below are written here, as a user writes them:
// their parameters are DTensors whose placements are part of their types, their forward returns its
// backward (the library's ops do the communication their placements imply), and the model is an ordered list
// of them plus a loss (nn/contract.hpp). Nothing in the library knows this model; FSDP x TP,
// DDP or HSDP train it as they train the GPT.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_10_own_model --layout fsdp_tp --check
//   --layout tp|ddp|fsdp|hsdp|fsdp_tp   the trainer and mesh (default fsdp_tp: FSDP over dp of
//                                       tensor-parallel parameters)
//   --steps N                           training steps (default 200)
//   --check                             also train on one rank and compare the losses and final parameters
//
// The task: regression of 2 smooth functions of 8 inputs, y0 = sin(x0 + x1) x2 and y1 = x3 x4 - x5^2 / 2,
// from a stream of batches of 32; the loss is the mean squared error. The program exits 1 if the final
// loss is not below a tenth of the first, or (--check) if the training differs from one rank's.
#include <dtensor/backward/redistribute.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/init.hpp>
#include <dtensor/nn/losses.hpp>
#include <dtensor/ops/matmul.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/train/data_layout.hpp>
#include <dtensor/train/optim.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using namespace dtensor;

// ---- The model: its types, two layers and the model (80 lines) ----

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
template <class T>
using Rows = DTensor<T, 2, Mesh, Shard<0>, Shard<0>, Replicate>; // (batch, features): batch over rep, dp
template <class T>
using ColumnW = DTensor<T, 2, Mesh, Replicate, Replicate, Shard<0>>; // (out, in): out over tp
template <class T>
using RowW = DTensor<T, 2, Mesh, Replicate, Replicate, Shard<1>>; // (out, in): in over tp
template <class T>
using FullW = DTensor<T, 2, Mesh, Replicate, Replicate, Replicate>;

/// A weight of type W drawn from the sharding-invariant RNG: the same numbers on any mesh.
template <class W>
W draw(const DeviceMesh<Mesh>& mesh, std::int64_t out, std::int64_t in, init::InitKeys& keys) {
  W w = [&]<class T, class... Q>(DTensor<T, 2, Mesh, Q...>*) {
    return from_global_index<T, Q...>(mesh, {out, in}, [](const auto&) { return T(0); });
  }(static_cast<W*>(nullptr));
  init::normal_(w, 0.0, 1.0 / std::sqrt(double(in)), keys.next());
  return w;
}

/// x + W_o (silu(W_g x) * (W_u x)): a gated residual block, tensor parallel (W_g, W_u column, W_o row). Its
/// parameters are listed once (nn::Layer makes parameters() and with_parameters() of them).
template <class T>
struct GatedResidual : nn::Layer<GatedResidual<T>> {
  ColumnW<T> gate, up;
  RowW<T> out;

  static constexpr auto parameter_members() {
    return std::tuple{&GatedResidual::gate, &GatedResidual::up, &GatedResidual::out};
  }

  auto forward(const Rows<T>& x, WithBackwardTag) const {
    auto [g, g_back] = linear(x, gate, with_backward); // (batch, hidden): the hidden units over tp
    auto [u, u_back] = linear(x, up, with_backward);
    auto [s, s_back] = silu(g, with_backward);
    auto [h, h_back] = mul(s, u, with_backward);
    auto [z, z_back] = linear(h, out, with_backward); // Partial over tp
    auto [zr, sum_back] = redistribute_with_backward<Shard<0>, Shard<0>, Replicate>(z);
    auto [y, add_back] = add(x, zr, with_backward);
    auto back = [=](const Rows<T>& dy) {
      auto [dx, dzr] = add_back(dy);
      auto [dh, dout] = z_back(sum_back(dzr));
      auto [ds, du] = h_back(dh);
      auto [dxg, dgate] = g_back(s_back(ds));
      auto [dxu, dup] = u_back(du);
      const auto d_in = add(dxg, dxu).template redistribute<Shard<0>, Shard<0>, Replicate>(); // sum over tp
      return nn::Gradients{Rows<T>(add(dx, d_in)),
                           std::tuple{std::move(dgate), std::move(dup), std::move(dout)}};
    };
    return WithBackward<Rows<T>, decltype(back)>{std::move(y), std::move(back)};
  }
};

/// x W^T with a replicated W: in and out projections.
template <class T>
struct Dense : nn::Layer<Dense<T>> {
  FullW<T> w;

  static constexpr auto parameter_members() { return std::tuple{&Dense::w}; }
  auto forward(const Rows<T>& x, WithBackwardTag) const {
    auto [y, back] = linear(x, w, with_backward);
    auto grads = [back = std::move(back)](const Rows<T>& dy) {
      auto [dx, dw] = back(dy);
      return nn::Gradients{Rows<T>(dx), std::tuple{std::move(dw)}};
    };
    return WithBackward<Rows<T>, decltype(grads)>{std::move(y), std::move(grads)};
  }
};

/// The model: its units in order and its loss.
struct Regressor {
  Dense<float> in;                          // 8 inputs -> 32 features
  std::vector<GatedResidual<float>> blocks; // 32 -> 64 hidden units -> 32, 3 times
  Dense<float> head;                        // 32 -> 2 outputs

  Regressor(const DeviceMesh<Mesh>& mesh, init::InitKeys& keys)
      : in{{}, draw<FullW<float>>(mesh, 32, 8, keys)}, head{{}, draw<FullW<float>>(mesh, 2, 32, keys)} {
    for (int b = 0; b < 3; ++b) {
      blocks.push_back({{},
                        draw<ColumnW<float>>(mesh, 64, 32, keys),
                        draw<ColumnW<float>>(mesh, 64, 32, keys),
                        draw<RowW<float>>(mesh, 32, 64, keys)});
    }
  }

  auto units() { return std::tie(in, blocks, head); }
  auto loss_function() const { return nn::MseLoss{}; }
};

// ---- Training it ----

namespace {

constexpr std::int64_t kBatch = 32;

/// Step `step`'s inputs (target false) or targets: a function of the step, the same on every mesh.
Rows<float> data(const DeviceMesh<Mesh>& mesh, int step, bool target) {
  const auto x = [step](std::int64_t row, std::int64_t k) {
    const std::uint64_t z =
        (std::uint64_t(step) * 1000003u + std::uint64_t(row) * 131u + std::uint64_t(k)) * 0x9E3779B97F4A7C15u;
    return double(z >> 11) / double(1ull << 53) * 2.0 - 1.0; // uniform in [-1, 1)
  };
  return from_global_index<float, Shard<0>, Shard<0>, Replicate>(
      mesh, {kBatch, target ? 2 : 8}, [&](const auto& i) {
        const std::int64_t r = i[0];
        if (!target) {
          return float(x(r, i[1]));
        }
        return float(i[1] == 0 ? std::sin(x(r, 0) + x(r, 1)) * x(r, 2)
                               : x(r, 3) * x(r, 4) - x(r, 5) * x(r, 5) / 2);
      });
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
};

Run train(const DeviceMesh<Mesh>& mesh, nn::DataLayout layout, int steps, bool print) {
  init::InitKeys keys(10);
  return nn::with_trainer(layout, mesh, Regressor(mesh, keys), {.max_norm = 1.0}, [&](auto& trainer) {
    optim::AdamW opt({.lr = 3e-3});
    Run run;
    for (int s = 0; s < steps; ++s) {
      const nn::StepResult r = trainer.step(data(mesh, s, false), data(mesh, s, true), opt);
      run.losses.push_back(r.loss);
      if (print && (s % 25 == 0 || s + 1 == steps)) {
        std::printf("step %3d/%d  loss %.5f  grad norm %.4f\n", s + 1, steps, r.loss, r.grad_norm);
      }
    }
    trainer.with_gathered([&](auto& m) {
      nn::for_each_tensor(nn::model_parameters(m), [&](const auto& w) {
        const auto full = w.full_tensor();
        run.params.emplace_back(full.data(), full.data() + full.numel());
      });
    });
    return run;
  });
}

} // namespace

int main(int argc, char** argv) {
  std::string layout_name = "fsdp_tp";
  int steps = 200;
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check") {
      check = true;
    } else if (a == "--layout" && i + 1 < argc) {
      layout_name = argv[++i];
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: 10_own_model [--layout tp|ddp|fsdp|hsdp|fsdp_tp] [--steps N] [--check]\n");
      return 2;
    }
  }
  nn::DataLayout layout{};
  try {
    layout = nn::parse_data_layout(layout_name);
  } catch (const Error& e) {
    std::fprintf(stderr, "10_own_model: %s\n", e.what());
    return 2;
  }
  ProcessGroup world = init_process_group();
  const auto [rep, dp, tp] = nn::data_layout_mesh(layout, world.size());
  const bool print = world.rank() == 0;
  if (print) {
    std::printf(
        "your own model (a gated residual regressor) for %d steps, layout %s on (rep=%d, dp=%d, tp=%d)\n",
        steps, layout_name.c_str(), rep, dp, tp);
  }
  const Run got = train(init_device_mesh<Mesh>(world, rep, dp, tp), layout, steps, print);
  bool ok = steps < 20 || got.losses.back() < got.losses.front() / 10;
  if (print) {
    std::printf("loss %.5f -> %.5f%s\n", got.losses.front(), got.losses.back(),
                ok ? "" : ": not below a tenth of the first");
  }
  if (check) { // the same training on one rank: a group of this rank alone
    const Run want = train(init_device_mesh<Mesh>(world.new_group({world.rank()}), 1, 1, 1),
                           nn::DataLayout::ddp, steps, false);
    double diff = 0;
    for (std::size_t s = 0; s < want.losses.size(); ++s) {
      diff = std::max(diff, std::abs(got.losses[s] - want.losses[s]) / std::abs(want.losses[s]));
    }
    for (std::size_t i = 0; i < want.params.size(); ++i) {
      for (std::size_t e = 0; e < want.params[i].size(); ++e) {
        diff = std::max(diff, std::abs(double(got.params[i][e]) - want.params[i][e]) /
                                  std::max(1.0, std::abs(double(want.params[i][e]))));
      }
    }
    const bool same = got.params.size() == want.params.size() && diff <= 1e-4;
    ok = ok && same;
    if (print || !same) {
      std::printf("rank %d against one rank: max relative difference %.1e (tolerance 1e-4): %s\n",
                  world.rank(), diff, same ? "OK" : "MISMATCH");
    }
  }
  return ok ? 0 : 1;
}

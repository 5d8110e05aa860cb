// FSDP (train/fsdp.hpp): a 2-layer MLP (linear + bias, gelu, linear + bias, cross_entropy) in two
// FlatParamGroups trained a few SGD steps, with FSDP on 1-D meshes of 1-4 ranks, HSDP on (2, 2) and
// FSDP x TP on (2, 2); the loss at every step and the final parameters equal the one-rank training (double:
// 1e-12). Sizes are uneven everywhere (10 tokens, 7 hidden, flat buffers of 42 and 32 elements). Each step's
// communication is pinned with CommDebugMode: one all_gather per group forward and one backward
// (reshard_after_forward), one reduce_scatter per group (+ one all_reduce over "replicate" for HSDP), and
// the prefetch order (the next group's all_gather is issued before the current group computes). Also:
// bfloat16 parameters with float gradient reduction, the mean option, the memory held per rank, and
// FlatLayout's chunks.
#include <catch2/catch.hpp>

#include <dtensor/backward/redistribute.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/loss.hpp>
#include <dtensor/ops/matmul.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/ops/random.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/clip.hpp>
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/fsdp_schedule.hpp>
#include <dtensor/train/optim.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

using namespace dtensor;

namespace {

using R = Replicate;
template <int D>
using S = Shard<D>;

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

constexpr std::int64_t kBatch = 10, kIn = 5, kHidden = 7, kClasses = 4;
constexpr double kLr = 0.5;

// The layouts: mesh, FSDP axes, the parameters' unsharded placements, the batch's placements.
struct FsdpLayout {
  using Mesh = MeshShape<Axis<"dp">>;
  using Layout = Fsdp<"dp">;
  using W1 = Param<2>;
  using B1 = Param<1>;
  using W2 = Param<2>;
  using B2 = Param<1>;
  template <class T>
  using X = DTensor<T, 2, Mesh, S<0>>;
  using Target = DTensor<std::int64_t, 1, Mesh, S<0>>;
  static constexpr const char* shard_axis = "dp";
  static constexpr bool hybrid = false;
  static constexpr bool tensor_parallel = false;
};

struct HsdpLayout {
  using Mesh = MeshShape<Axis<"replicate">, Axis<"shard">>;
  using Layout = Hsdp<"replicate", "shard">;
  using W1 = Param<2>;
  using B1 = Param<1>;
  using W2 = Param<2>;
  using B2 = Param<1>;
  template <class T>
  using X = DTensor<T, 2, Mesh, S<0>, S<0>>; // the batch over both axes
  using Target = DTensor<std::int64_t, 1, Mesh, S<0>, S<0>>;
  static constexpr const char* shard_axis = "shard";
  static constexpr bool hybrid = true;
  static constexpr bool tensor_parallel = false;
};

// Column-parallel W1 (out features over tp) and b1, row-parallel W2 (in features over tp), b2 replicated.
struct FsdpTpLayout {
  using Mesh = MeshShape<Axis<"dp">, Axis<"tp">>;
  using Layout = Fsdp<"dp">;
  using W1 = Param<2, R, S<0>>;
  using B1 = Param<1, R, S<0>>;
  using W2 = Param<2, R, S<1>>;
  using B2 = Param<1, R, R>;
  template <class T>
  using X = DTensor<T, 2, Mesh, S<0>, R>;
  using Target = DTensor<std::int64_t, 1, Mesh, S<0>, R>;
  static constexpr const char* shard_axis = "dp";
  static constexpr bool hybrid = false;
  static constexpr bool tensor_parallel = true;
};

// randn * scale with the placements of the DTensor type D.
template <class D>
struct Random;
template <class T, int Rank, class Shape, class... Q>
struct Random<DTensor<T, Rank, Shape, Q...>> {
  static DTensor<T, Rank, Shape, Q...> make(const DeviceMesh<Shape>& mesh,
                                            std::array<std::int64_t, Rank> shape, std::uint64_t offset,
                                            double factor) {
    return scale(randn<T, Q...>(mesh, shape, 11, offset), factor);
  }
};

template <class D>
D targets(const typename D::mesh_type& mesh, int step) {
  Tensor<std::int64_t, 1> full({kBatch});
  for (std::int64_t i = 0; i < kBatch; ++i) {
    full(i) = (i * 3 + step + i * i) % kClasses;
  }
  return detail::distribute_as<D>::from_full(mesh, full);
}

template <class T, int Rank>
std::vector<double> values_of(const Tensor<T, Rank>& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t e = 0; e < t.numel(); ++e) {
    v[static_cast<std::size_t>(e)] = static_cast<double>(t.data()[e]);
  }
  return v;
}

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<double>> params; // W1, b1, W2, b2, full
  std::vector<std::int64_t> issued;        // all_gathers issued before each group's compute, step 0
};

template <class L, class T, class ReduceT = T, class ComputeT = T>
struct Model {
  using Mesh = typename L::Mesh;
  using G1 =
      FlatParamGroup<T, Mesh, typename L::Layout, Params<typename L::W1, typename L::B1>, ReduceT, ComputeT>;
  using G2 =
      FlatParamGroup<T, Mesh, typename L::Layout, Params<typename L::W2, typename L::B2>, ReduceT, ComputeT>;

  static G1 group1(const DeviceMesh<Mesh>& mesh, FsdpOptions o) {
    return G1(o, Random<typename G1::template master_param_type<0>>::make(mesh, {kHidden, kIn}, 0, 0.4),
              Random<typename G1::template master_param_type<1>>::make(mesh, {kHidden}, 1, 0.1));
  }
  static G2 group2(const DeviceMesh<Mesh>& mesh, FsdpOptions o) {
    return G2(o, Random<typename G2::template master_param_type<0>>::make(mesh, {kClasses, kHidden}, 2, 0.4),
              Random<typename G2::template master_param_type<1>>::make(mesh, {kClasses}, 3, 0.1));
  }
};

// SGD on the local shards, as an optimizer written elsewhere would do it: p -= lr * g.
template <class G>
void sgd(G& g) {
  using T = typename G::value_type;
  const auto p = g.local_param();
  const auto d = g.local_grad();
  for (std::int64_t i = 0; i < p.numel(); ++i) {
    p.data()[i] = T(static_cast<double>(p.data()[i]) - kLr * static_cast<double>(d.data()[i]));
  }
  g.zero_grad();
}

/// `steps` SGD steps of the MLP on `mesh`, with prefetch and reshard_after_forward; pins each step's
/// communication (a mesh of one rank runs none).
template <class L, class T, class ReduceT = T>
Trained train(const DeviceMesh<typename L::Mesh>& mesh, int steps, FsdpOptions options = {},
              double loss_scale = 1) {
  using M = Model<L, T, ReduceT>;
  using X = typename L::template X<T>;
  auto g1 = M::group1(mesh, options);
  auto g2 = M::group2(mesh, options);
  Trained out;
  for (int step = 0; step < steps; ++step) {
    const X x = Random<X>::make(mesh, {kBatch, kIn}, 100 + static_cast<std::uint64_t>(step), 1.0);
    const auto target = targets<typename L::Target>(mesh, step);
    CommDebugMode comm;

    // Forward: group 2's all_gather is issued before group 1 computes.
    g1.unshard(async_op);
    g2.unshard(async_op);
    std::int64_t issued_fwd = 0;
    auto [u, act] = [&] {
      auto [w1, b1] = g1.params();
      issued_fwd = comm.count("all_gather"); // as group 1 computes
      auto u = linear(x, w1);
      return std::pair{u, gelu(add(u, b1), with_backward)};
    }();
    g1.reshard();
    auto [zr, rs_back, lw] = [&] {
      auto [w2, b2] = g2.params();
      auto z = linear(act.output, w2);
      if constexpr (L::tensor_parallel) { // row parallel: [S(0),P] -> [S(0),R], all_reduce over tp
        auto [zr, back] = redistribute_with_backward<S<0>, R>(z);
        return std::tuple{zr, back, cross_entropy(add(zr, b2), target, with_backward)};
      } else {
        auto identity = [](const auto& g) { return g; };
        return std::tuple{z, identity, cross_entropy(add(z, b2), target, with_backward)};
      }
    }();
    g2.reshard();
    out.losses.push_back(static_cast<double>(lw.output.local().item()));

    // Backward: gather again; group 1's all_gather is issued before group 2's backward computes.
    g2.unshard(async_op);
    g1.unshard(async_op);
    std::int64_t issued_bwd = 0;
    const auto dlogits = lw.backward(loss_scale);
    CommDebugMode reduce_comm;
    auto [da, dw2, db2] = [&] {
      auto [w2, b2] = g2.params();
      issued_bwd = comm.count("all_gather"); // as group 2's backward computes
      auto [dzr, db2] = add(zr, b2, with_backward).backward(dlogits);
      auto [da, dw2] =
          ProductBackward<true, decltype(act.output), decltype(w2)>(act.output, w2)(rs_back(dzr));
      return std::tuple{da, dw2, db2};
    }();
    g2.reshard();
    auto work2 = g2.reduce_gradients(async_op, dw2, db2);
    const auto dh = act.backward(da);
    auto [dw1, db1] = [&] {
      auto [w1, b1] = g1.params();
      auto [du, db1] = add(u, b1, with_backward).backward(dh);
      auto [dx, dw1] = ProductBackward<true, X, decltype(w1)>(x, w1)(du);
      return std::pair{dw1, db1};
    }();
    g1.reshard();
    auto work1 = g1.reduce_gradients(async_op, dw1, db1);
    work2.wait();
    work1.wait();

    if (step == 0) {
      out.issued = {issued_fwd, issued_bwd};
    }
    const std::string where =
        "rank " + std::to_string(mesh.rank()) + ", step " + std::to_string(step) + ":\n" + comm.to_string();
    // One rank: every axis has size 1, and no collective runs at all (a size-1 axis costs nothing).
    const std::int64_t k = mesh.size() > 1 ? 1 : 0;
    expect(issued_fwd == 2 * k && issued_bwd == 4 * k,
           "prefetch: all_gathers issued as group 1's forward computes " + std::to_string(issued_fwd) +
               " (want 2), as group 2's "
               "backward " +
               std::to_string(issued_bwd) + " (want 4); " + where);
    expect(comm.count("all_gather", L::shard_axis) == 4 * k && comm.count("all_gather") == 4 * k,
           "one all_gather per group forward and one backward; " + where);
    expect(comm.count("reduce_scatter", L::shard_axis) == 2 * k && comm.count("reduce_scatter") == 2 * k,
           "one reduce_scatter per group; " + where);
    expect(reduce_comm.count("reduce_scatter") == 2 * k &&
               reduce_comm.count("all_reduce", "replicate") == (L::hybrid ? 2 : 0) * k &&
               reduce_comm.total_count() == (L::hybrid ? 4 : 2) * k,
           "the gradient reduction: one reduce_scatter (+ one all_reduce over replicate for HSDP) per "
           "group; " +
               reduce_comm.to_string());
    if constexpr (L::tensor_parallel) {
      expect(comm.count("all_reduce", "tp") == k, "FSDP x TP: one all_reduce over tp (the row-parallel "
                                                  "output); " +
                                                      where);
    }

    // SGD on the local shards.
    sgd(g1);
    sgd(g2);
  }
  g1.unshard();
  g2.unshard();
  auto [w1, b1] = g1.params();
  auto [w2, b2] = g2.params();
  out.params = {values_of(w1.full_tensor()), values_of(b1.full_tensor()), values_of(w2.full_tensor()),
                values_of(b2.full_tensor())};
  return out;
}

} // namespace

namespace {

void compare(const Trained& got, const Trained& want, double tol, const std::string& what) {
  auto close = [&](double a, double b) { return std::abs(a - b) <= tol * (1 + std::abs(b)); };
  expect(got.losses.size() == want.losses.size(), what + ": number of steps");
  for (std::size_t s = 0; s < want.losses.size(); ++s) {
    expect(close(got.losses[s], want.losses[s]), what + ": loss at step " + std::to_string(s) + " is " +
                                                     std::to_string(got.losses[s]) + ", one rank's " +
                                                     std::to_string(want.losses[s]));
  }
  const char* names[] = {"W1", "b1", "W2", "b2"};
  for (std::size_t p = 0; p < want.params.size(); ++p) {
    expect(got.params[p].size() == want.params[p].size(), what + ": size of " + names[p]);
    for (std::size_t e = 0; e < want.params[p].size(); ++e) {
      expect(close(got.params[p][e], want.params[p][e]),
             what + ": final " + names[p] + " element " + std::to_string(e) + " is " +
                 std::to_string(got.params[p][e]) + ", one rank's " + std::to_string(want.params[p][e]));
    }
  }
}

constexpr int kSteps = 3;

/// Trains on `ranks` ranks (mesh sizes `sizes`) and on one rank; the two must agree within `tol`.
template <class L, class T, class... Sizes>
void trains_as_one_rank(int ranks, double tol, FsdpOptions options, double loss_scale, Sizes... sizes) {
  Trained want;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    want = train<L, T>(init_device_mesh<typename L::Mesh>(one, (sizes * 0 + 1)...), kSteps);
  });
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<typename L::Mesh>(world, sizes...);
    const Trained got = train<L, T>(mesh, kSteps, options, loss_scale);
    compare(got, want, tol, "rank " + std::to_string(world.rank()) + " of " + std::to_string(ranks));
    expect(got.issued == (ranks > 1 ? std::vector<std::int64_t>{2, 4} : std::vector<std::int64_t>{0, 0}),
           "prefetch: the next group's all_gather is issued before the current group computes");
  });
}

/// What a scheduled training saw besides the losses and parameters.
struct Scheduled {
  Trained trained;
  std::vector<double> norms, inf_norms; // total_norm of the reduced gradients, every step, before clipping
  std::vector<double> clipped;          // total_norm after clip_grad_norm
  FsdpScheduleStats stats;              // of the last step
  std::int64_t all_gathers = 0, reduce_scatters = 0;         // CommDebugMode, the last step
  std::int64_t gather_bytes = 0, reduce_bytes = 0;           // received by this rank, the last step
  std::int64_t gather_bytes_want = 0, reduce_bytes_want = 0; // from the groups' sizes and element types
  std::vector<int> unsharded; // groups unsharded as g1's forward and g2's and g1's backward compute, step 0
};

/// The MLP trained by FsdpSchedule as examples/06 trains its blocks: g1's forward (g2's all_gather in
/// flight), then g2's forward and backward in one backward call (the head: g1's all_gather in flight), then
/// g1's backward (gathered again, its bias add rebuilt from the gathered parameters); finish(), the norms of
/// the flat groups' gradients (l2 and inf), clip_grad_norm over the groups, SGD stepping each group.
///
/// Batches: `micro` micro-batches of kBatch rows a step, the gradients accumulated without synchronisation
/// (set_requires_gradient_sync(false)) but for the last, each loss scaled by 1 / micro; with `whole`, one
/// batch of micro x kBatch rows instead, the same rows (the reference of the accumulation).
struct Batches {
  int micro = 1;
  bool whole = false;
};

/// Rows [first, first + n) of step `step`'s inputs and targets (integer multiples of 1/8), distributed
/// as X and Target (each rank keeps its rows: no communication).
template <class X, class Target>
std::pair<X, Target> batch_rows(const typename X::mesh_type& mesh, int step, std::int64_t first,
                                std::int64_t n) {
  Tensor<typename X::value_type, 2> x({n, kIn});
  Tensor<std::int64_t, 1> t({n});
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t r = first + i;
    for (std::int64_t j = 0; j < kIn; ++j) {
      x(i, j) = typename X::value_type(static_cast<double>((r * 7 + j * 5 + step * 3) % 13 - 6) / 8);
    }
    t(i) = (r * 3 + step + r * r) % kClasses;
  }
  return {detail::distribute_as<X>::from_full(mesh, x), detail::distribute_as<Target>::from_full(mesh, t)};
}

template <class L, class T, class ReduceT = T, class ComputeT = T>
Scheduled train_scheduled(const DeviceMesh<typename L::Mesh>& mesh, int steps, FsdpScheduleOptions options,
                          double max_norm, Batches batches = {}) {
  using M = Model<L, T, ReduceT, ComputeT>;
  using X = typename L::template X<ComputeT>;
  auto g1 = M::group1(mesh, {});
  auto g2 = M::group2(mesh, {});
  optim::SGD opt({.lr = kLr});
  FsdpSchedule sched(options);
  sched.add(g1);
  sched.add(g2);
  Scheduled out;
  auto unsharded = [&] { return int(g1.is_unsharded()) + int(g2.is_unsharded()); };
  const int micro = batches.whole ? 1 : batches.micro;
  const std::int64_t rows = batches.whole ? batches.micro * kBatch : kBatch;
  for (int step = 0; step < steps; ++step) {
    CommDebugMode comm;
    sched.reset_stats();
    double loss = 0;
    for (int k = 0; k < micro; ++k) {
      const auto [x, target] = batch_rows<X, typename L::Target>(mesh, step, k * rows, rows);
      sched.set_requires_gradient_sync(k + 1 == micro);
      auto [u, act] = sched.forward(g1, [&](const auto& w1, const auto& b1) {
        out.unsharded.push_back(unsharded());
        auto u = linear(x, w1);
        return std::pair{u, gelu(add(u, b1), with_backward)};
      });
      std::optional<std::remove_cvref_t<decltype(act.output)>> da;
      sched.backward(g2, [&](const auto& w2, const auto& b2) {
        out.unsharded.push_back(unsharded());
        auto z = linear(act.output, w2);
        auto [zr, rs_back] = [&] {
          if constexpr (L::tensor_parallel) { // row parallel: [S(0),P] -> [S(0),R], all_reduce over tp
            return redistribute_with_backward<S<0>, R>(z);
          } else {
            auto identity = [](const auto& g) { return g; };
            return std::pair{z, identity};
          }
        }();
        auto lw = cross_entropy(add(zr, b2), target, with_backward);
        loss += static_cast<double>(lw.output.local().item()) / micro;
        auto [dzr, db2] = add(zr, b2, with_backward).backward(lw.backward(1.0 / micro));
        auto [d_act, dw2] = ProductBackward<true, std::remove_cvref_t<decltype(act.output)>,
                                            std::remove_cvref_t<decltype(w2)>>(act.output, w2)(rs_back(dzr));
        da.emplace(d_act);
        return std::tuple{dw2, db2};
      });
      sched.backward(g1, [&](const auto& w1, const auto& b1) {
        out.unsharded.push_back(unsharded());
        auto [du, db1] = add(u, b1, with_backward).backward(act.backward(*da));
        auto [dx, dw1] = ProductBackward<true, X, std::remove_cvref_t<decltype(w1)>>(x, w1)(du);
        return std::tuple{dw1, db1};
      });
    }
    out.trained.losses.push_back(loss);
    sched.finish();
    expect(g1.unsynced_numel() == 0 && g2.unsynced_numel() == 0,
           "the last micro-batch's reduction empties the accumulators");
    expect(sched.reductions_in_flight() == 0, "finish() leaves no reduction in flight");
    out.norms.push_back(total_norm(l2_norm, g1, g2));
    out.inf_norms.push_back(total_norm(inf_norm, g2, g1));
    const double norm = clip_grad_norm(max_norm, g1, g2);
    expect(norm == out.norms.back(), "clip_grad_norm returns the norm before clipping");
    out.clipped.push_back(total_norm(l2_norm, g1, g2));
    opt.step(0, g1);
    opt.step(1, g2);
    g1.zero_grad();
    g2.zero_grad();
    out.stats = sched.stats();
    out.all_gathers = comm.count("all_gather");
    out.reduce_scatters = comm.count("reduce_scatter");
    out.gather_bytes = comm.bytes("all_gather");
    out.reduce_bytes = comm.bytes("reduce_scatter");
    const auto missing = [](const auto& g) { return g.unsharded_numel() - g.sharded_numel(); };
    const auto others = [](const auto& g) { return (g.data_parallel_size() - 1) * g.sharded_numel(); };
    out.gather_bytes_want = micro * ((options.reshard_after_forward ? 2 : 1) * missing(g1) + missing(g2)) *
                            std::int64_t(sizeof(ComputeT));
    out.reduce_bytes_want = (others(g1) + others(g2)) * std::int64_t(sizeof(ReduceT));
  }
  g1.unshard();
  g2.unshard();
  auto [w1, b1] = g1.params();
  auto [w2, b2] = g2.params();
  out.trained.params = {values_of(w1.full_tensor()), values_of(b1.full_tensor()), values_of(w2.full_tensor()),
                        values_of(b2.full_tensor())};
  return out;
}

/// The scheduled training on `ranks` ranks against the same on one rank (losses, parameters, norms before
/// and after clipping), and the schedule's collectives and prefetch pinned.
/// With `micro` > 1 the ranks accumulate micro-batches and one rank trains on the whole batch.
template <class L, class... Sizes>
void schedule_trains_as_one_rank(int ranks, FsdpScheduleOptions options, double max_norm, int micro,
                                 Sizes... sizes) {
  constexpr double tol = 1e-12;
  Scheduled want;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    want = train_scheduled<L, double>(init_device_mesh<typename L::Mesh>(one, (sizes * 0 + 1)...), kSteps,
                                      options, max_norm, {.micro = micro, .whole = true});
  });
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<typename L::Mesh>(world, sizes...);
    const Scheduled got = train_scheduled<L, double>(mesh, kSteps, options, max_norm, {.micro = micro});
    const std::string what = "rank " + std::to_string(world.rank()) + " of " + std::to_string(ranks);
    compare(got.trained, want.trained, tol, what);
    auto close = [&](double a, double b) { return std::abs(a - b) <= tol * (1 + std::abs(b)); };
    for (std::size_t s = 0; s < want.norms.size(); ++s) {
      expect(close(got.norms[s], want.norms[s]) && close(got.inf_norms[s], want.inf_norms[s]) &&
                 close(got.clipped[s], want.clipped[s]),
             what + ": step " + std::to_string(s) + " norms " + std::to_string(got.norms[s]) + ", " +
                 std::to_string(got.inf_norms[s]) + ", clipped " + std::to_string(got.clipped[s]) +
                 "; one rank's " + std::to_string(want.norms[s]) + ", " + std::to_string(want.inf_norms[s]) +
                 ", " + std::to_string(want.clipped[s]));
      expect(want.norms[s] <= max_norm ||
                 close(want.clipped[s], max_norm * want.norms[s] / (want.norms[s] + 1e-6)),
             "clipping scales the norm to max_norm");
    }
    // g1 is resharded after its forward (not the last group) and gathered again for its backward; g2, the
    // last group, is gathered once; each group reduced once.
    // (On one rank the schedule issues them all the same, and none is a collective: groups of one.)
    const int gathers = micro * (options.reshard_after_forward ? 3 : 2);
    const int collective = ranks > 1 ? 1 : 0;
    expect(got.all_gathers == gathers * collective && got.stats.all_gathers == gathers,
           what + ": " + std::to_string(got.all_gathers) + " all_gathers (schedule: " +
               std::to_string(got.stats.all_gathers) + "), want " + std::to_string(gathers));
    expect(got.reduce_scatters == 2 * collective && got.stats.reductions == 2,
           what + ": one reduce_scatter per group, after the last micro-batch");
    // prefetch 1: the next group (forward order in the forward, reverse in the backward) is in flight as a
    // group computes; prefetch 0: only the computing group (and g1, when kept gathered, in the backward).
    const int p = options.prefetch > 0 ? 1 : 0;
    const std::vector<int> unsharded{1 + p, options.reshard_after_forward ? 1 + p : 2, 1};
    expect(std::vector<int>(got.unsharded.begin(), got.unsharded.begin() + 3) == unsharded,
           what + ": groups unsharded as each call computes " + std::to_string(got.unsharded[0]) + ", " +
               std::to_string(got.unsharded[1]) + ", " + std::to_string(got.unsharded[2]));
    expect(got.stats.blocked_seconds >= 0, "blocked time is measured");
  });
}

} // namespace

TEST_CASE("FSDP on 1-4 ranks trains the MLP as one rank does (uneven shards)", "[parallel][fsdp]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    trains_as_one_rank<FsdpLayout, double>(n, 1e-12, {}, 1.0, n);
  }
  trains_as_one_rank<FsdpLayout, float>(4, 1e-5, {}, 1.0, 4);
}

TEST_CASE("HSDP on (replicate=2, shard=2): reduce_scatter then all_reduce, as one rank", "[parallel][fsdp]") {
  trains_as_one_rank<HsdpLayout, double>(4, 1e-12, {}, 1.0, 2, 2);
}

TEST_CASE("FSDP x TP on (dp=2, tp=2): local TP blocks in the flat buffer, as one rank", "[parallel][fsdp]") {
  trains_as_one_rank<FsdpTpLayout, double>(4, 1e-12, {}, 1.0, 2, 2);
  trains_as_one_rank<FsdpTpLayout, float>(4, 1e-5, {}, 1.0, 2, 2);
}

TEST_CASE("reduce_op avg divides the summed gradient by the data-parallel ranks", "[parallel][fsdp]") {
  // Each rank's loss gradient scaled by n (a loss that is each rank's own mean, summed n times): avg gives
  // the one-rank gradient back.
  trains_as_one_rank<FsdpLayout, double>(3, 1e-12, {.reduce_op = ReduceOp::avg}, 3.0, 3);
  trains_as_one_rank<HsdpLayout, double>(4, 1e-12, {.reduce_op = ReduceOp::avg}, 4.0, 2, 2);
}

TEST_CASE("bfloat16 parameters with float gradient reduction", "[parallel][fsdp]") {
  using Mesh = MeshShape<Axis<"dp">>;
  using Group = FlatParamGroup<bfloat16, Mesh, Fsdp<"dp">, Params<Param<2>, Param<1>>, float>;
  STATIC_REQUIRE(std::is_same_v<Group::grad_shard_type::value_type, float>);
  STATIC_REQUIRE(std::is_same_v<Group::sharded_type::value_type, bfloat16>);
  testing::run_ranks(4, [](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world);
    Group g(zeros<bfloat16, R>(mesh, {3, 3}), zeros<bfloat16, R>(mesh, {3}));
    // Contributions 256 on rank 0 and 1 on the others: 259 in float; bfloat16 (8 significant bits) would
    // round the sum to 256 or 260.
    using G2 = DTensor<bfloat16, 2, Mesh, Partial<>>;
    using G1 = DTensor<bfloat16, 1, Mesh, Partial<>>;
    const bfloat16 mine = world.rank() == 0 ? bfloat16(256.0f) : bfloat16(1.0f);
    const G2 dw(mesh, Tensor<bfloat16, 2>::full({3, 3}, mine), {3, 3});
    const G1 db(mesh, Tensor<bfloat16, 1>::full({3}, mine), {3});
    CommDebugMode comm;
    g.reduce_gradients(dw, db);
    const auto grad = g.local_grad();
    expect(grad.numel() == g.sharded_numel(), "the gradient shard lines up with the parameter shard");
    for (std::int64_t i = 0; i < grad.numel(); ++i) {
      expect(grad.data()[i] == 259.0f, "rank " + std::to_string(world.rank()) + ": gradient " +
                                           std::to_string(grad.data()[i]) + ", want 259 (a float sum)");
    }
    expect(comm.count("reduce_scatter", "dp") == 1 && comm.total_count() == 1,
           "one reduce_scatter for the group: " + comm.to_string());
    // The reduce_scatter moves floats: (n - 1) partial copies of this rank's shard, 4 bytes each.
    expect(comm.bytes("reduce_scatter") == 3 * g.sharded_numel() * 4,
           "float reduction bytes: " + comm.to_string());
    // Gradients accumulate until zero_grad(); a Replicate gradient counts once (not once per rank).
    using R2 = DTensor<bfloat16, 2, Mesh, R>;
    using R1 = DTensor<bfloat16, 1, Mesh, R>;
    g.reduce_gradients(R2(mesh, Tensor<bfloat16, 2>::full({3, 3}, bfloat16(1.0f)), {3, 3}),
                       R1(mesh, Tensor<bfloat16, 1>::full({3}, bfloat16(1.0f)), {3}));
    for (std::int64_t i = 0; i < grad.numel(); ++i) {
      expect(g.local_grad().data()[i] == 260.0f, "rank " + std::to_string(world.rank()) + ": accumulated " +
                                                     std::to_string(g.local_grad().data()[i]) + ", want 260");
    }
    g.zero_grad();
    for (std::int64_t i = 0; i < grad.numel(); ++i) {
      expect(g.local_grad().data()[i] == 0.0f, "zero_grad");
    }
    comm.reset();
    g.unshard();
    expect(comm.bytes("all_gather") == (g.unsharded_numel() - g.sharded_numel()) * 2,
           "the all_gather moves bfloat16: " + comm.to_string());
  });
  // Training: bfloat16 parameters and activations, float gradient reduction, close to one rank's.
  Trained want;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    want = train<FsdpLayout, bfloat16, float>(init_device_mesh<FsdpLayout::Mesh>(one, 1), kSteps);
  });
  testing::run_ranks(2, [&](ProcessGroup& world) {
    const Trained got =
        train<FsdpLayout, bfloat16, float>(init_device_mesh<FsdpLayout::Mesh>(world, 2), kSteps);
    compare(got, want, 2e-2, "bfloat16 on 2 ranks");
  });
}

TEST_CASE("memory: a rank holds 1/n of the group, plus the gathered buffer while unsharded",
          "[parallel][fsdp]") {
  using Mesh = MeshShape<Axis<"dp">>;
  using Group = FlatParamGroup<double, Mesh, Fsdp<"dp">, Params<Param<2>, Param<1>>>;
  testing::run_ranks(4, [](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world);
    Tensor<double, 2> w({7, 5});
    Tensor<double, 1> b({7});
    for (std::int64_t e = 0; e < 35; ++e) {
      w.data()[e] = double(e);
    }
    for (std::int64_t e = 0; e < 7; ++e) {
      b.data()[e] = double(100 + e);
    }
    Group g = Group::from_full(mesh, w, b);
    const std::string who = "rank " + std::to_string(world.rank());
    // 42 elements over 4 ranks: 11, 11, 11, 9 (torch.chunk, no padding).
    const std::int64_t want = world.rank() < 3 ? 11 : 9;
    expect(g.sharded_numel() == want && g.local_param().numel() == want && g.unsharded_numel() == 42,
           who + ": shard of " + std::to_string(g.sharded_numel()));
    expect(g.held_numel() == want, who + ": a sharded group holds its shard only");
    for (std::int64_t i = 0; i < want; ++i) { // the shard is elements [11 r, 11 r + want) of (W, b) flattened
      expect(g.local_param().data()[i] ==
                 double(11 * world.rank() + i + (11 * world.rank() + i >= 35 ? 65 : 0)),
             who + ": shard element " + std::to_string(i));
    }
    std::weak_ptr<void> gathered;
    {
      g.unshard();
      expect(g.held_numel() == want + 42,
             who + ": unsharded, the group holds its shard and the gathered buffer");
      auto [pw, pb] = g.params();
      expect(pw.local().storage() == pb.local().storage(), "both parameters view one gathered buffer");
      expect(pw.full_tensor().data()[34] == 34.0 && pb.local().data()[6] == 106.0, "the gathered values");
      gathered = pw.local().storage();
      g.reshard();
      expect(!gathered.expired(), "a view still held keeps the gathered buffer");
      expect(g.held_numel() == want, who + ": resharded");
    }
    expect(gathered.expired(),
           who + ": the gathered buffer is freed once the group resharded and the views are gone");
  });
}

TEST_CASE("FsdpSchedule: prefetch, reshard after forward, reductions in flight, clip and step on groups",
          "[parallel][fsdp][schedule]") {
  SECTION("FSDP on 1-4 ranks, clipping active") {
    for (int n = 1; n <= 4; ++n) {
      INFO("ranks " << n);
      schedule_trains_as_one_rank<FsdpLayout>(n, {}, 0.05, 1, n);
    }
  }
  SECTION("options: no prefetch, kept gathered (ZeRO-2), one reduction in flight, overlap off") {
    schedule_trains_as_one_rank<FsdpLayout>(3, {.prefetch = 0}, 0.05, 1, 3);
    schedule_trains_as_one_rank<FsdpLayout>(3, {.reshard_after_forward = false, .max_reductions = 1}, 0.05,
                                            3);
    schedule_trains_as_one_rank<FsdpLayout>(2, {.overlap = false}, 1e9, 1, 2);
  }
  SECTION("HSDP and FSDP x TP: each gradient element counted once in the norm") {
    schedule_trains_as_one_rank<HsdpLayout>(4, {}, 0.05, 1, 2, 2);
    schedule_trains_as_one_rank<FsdpTpLayout>(4, {}, 0.05, 1, 2, 2);
  }
  SECTION("gradient accumulation: 3 micro-batches, one reduction, equal to one batch 3x larger") {
    for (int n = 1; n <= 4; ++n) {
      INFO("ranks " << n);
      schedule_trains_as_one_rank<FsdpLayout>(n, {}, 0.05, 3, n);
    }
    schedule_trains_as_one_rank<HsdpLayout>(4, {}, 0.05, 2, 2, 2);
    schedule_trains_as_one_rank<FsdpTpLayout>(4, {.reshard_after_forward = false}, 0.05, 2, 2, 2);
  }
  SECTION("mixed precision: float masters gathered and computed in bfloat16, reduced in float or bfloat16") {
    // Against the float training on one rank; bfloat16 keeps 8 significant bits, so 3e-2 relative.
    Scheduled want;
    testing::run_ranks(1, [&](ProcessGroup& one) {
      want = train_scheduled<FsdpLayout, float>(init_device_mesh<FsdpLayout::Mesh>(one, 1), kSteps, {}, 0.05);
    });
    testing::run_ranks(3, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<FsdpLayout::Mesh>(world, 3);
      const std::string what = "rank " + std::to_string(world.rank()) + " of 3, mixed precision";
      const Scheduled f32 = train_scheduled<FsdpLayout, float, float, bfloat16>(mesh, kSteps, {}, 0.05);
      const Scheduled b16 = train_scheduled<FsdpLayout, float, bfloat16, bfloat16>(mesh, kSteps, {}, 0.05);
      compare(f32.trained, want.trained, 3e-2, what + ", float reduction");
      compare(b16.trained, want.trained, 3e-2, what + ", bfloat16 reduction");
      // the all_gathers move bfloat16 (2 bytes an element), the reduce_scatters float or bfloat16
      for (const Scheduled* r : {&f32, &b16}) {
        expect(r->gather_bytes == r->gather_bytes_want && r->reduce_bytes == r->reduce_bytes_want,
               what + ": all_gather bytes " + std::to_string(r->gather_bytes) + " (want " +
                   std::to_string(r->gather_bytes_want) + "), reduce_scatter bytes " +
                   std::to_string(r->reduce_bytes) + " (want " + std::to_string(r->reduce_bytes_want) + ")");
      }
      expect(b16.reduce_bytes * 2 == f32.reduce_bytes, what + ": a bfloat16 reduction moves half the bytes");
    });
    using MP = FlatParamGroup<float, FsdpLayout::Mesh, Fsdp<"dp">, Params<Param<2>>, bfloat16, bfloat16>;
    STATIC_REQUIRE(std::is_same_v<MP::sharded_type::value_type, float>);
    STATIC_REQUIRE(std::is_same_v<MP::gathered_type::value_type, bfloat16>);
    STATIC_REQUIRE(std::is_same_v<MP::param_type<0>::value_type, bfloat16>);
    STATIC_REQUIRE(std::is_same_v<MP::grad_shard_type::value_type, bfloat16>);
  }
  SECTION("the reductions in flight never exceed max_reductions, and reach it (4 groups, caps 1 to 4)") {
    using Mesh = MeshShape<Axis<"dp">>;
    using Group = FlatParamGroup<double, Mesh, Fsdp<"dp">, Params<Param<2>>>;
    for (int cap = 1; cap <= 4; ++cap) {
      INFO("max_reductions " << cap);
      testing::run_ranks(2, [&](ProcessGroup& world) {
        const auto mesh = init_device_mesh<Mesh>(world);
        std::vector<Group> groups;
        for (int g = 0; g < 4; ++g) {
          groups.push_back(Group::from_full(mesh, Tensor<double, 2>::full({3, 2}, double(g + 1))));
        }
        FsdpSchedule sched({.max_reductions = cap});
        for (auto& g : groups) {
          sched.add(g);
        }
        for (auto& g : groups) {
          sched.forward(g, [](const auto&) { return 0; });
        }
        int most = 0;
        for (int g = 3; g >= 0; --g) {
          sched.backward(groups[std::size_t(g)], [](const auto& w) {
            return std::tuple{DTensor<double, 2, Mesh, Partial<>>::from_local(
                w.mesh(), Tensor<double, 2>::full({3, 2}, 1.0), std::array<std::int64_t, 2>{3, 2})};
          });
          const int in_flight = sched.reductions_in_flight();
          expect(in_flight <= cap, "after group " + std::to_string(g) +
                                       "'s backward: " + std::to_string(in_flight) +
                                       " reductions in flight, cap " + std::to_string(cap));
          most = std::max(most, in_flight);
        }
        expect(most == std::min(cap, 4), "the cap is reached: " + std::to_string(most));
        sched.finish();
        expect(sched.reductions_in_flight() == 0, "finish() waits for them all");
      });
    }
  }
  SECTION("a group not added is an error naming the call") {
    testing::run_ranks(1, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<FsdpLayout::Mesh>(world, 1);
      auto g1 = Model<FsdpLayout, double>::group1(mesh, {});
      auto g2 = Model<FsdpLayout, double>::group2(mesh, {});
      FsdpSchedule sched;
      sched.add(g1);
      CHECK_THROWS_WITH(sched.forward(g2, [](const auto&, const auto&) { return 0; }),
                        Catch::Contains("FsdpSchedule::forward: the group was not added"));
      CHECK_THROWS_WITH(sched.add(g1), Catch::Contains("was added already"));
      CHECK_THROWS_WITH(FsdpSchedule({.max_reductions = 0}), Catch::Contains("max_reductions must be >= 1"));
    });
  }
}

TEST_CASE("FlatLayout: parameters in order, torch.chunk shards, pieces per rank", "[parallel][fsdp]") {
  const FlatLayout l({30, 6, 18, 3});
  CHECK(l.total() == 57);
  CHECK(l.offset(2) == 36);
  for (int n = 1; n <= 5; ++n) {
    std::int64_t covered = 0;
    for (int i = 0; i < n; ++i) {
      CHECK(l.shard_begin(n, i) == covered);
      std::int64_t in_shard = 0;
      for (const FlatPiece& p : l.pieces(n, i)) {
        CHECK(p.shard_at == in_shard);
        CHECK(l.offset(p.param) + p.param_at == covered + in_shard);
        in_shard += p.numel;
      }
      CHECK(in_shard == l.shard_numel(n, i));
      covered += in_shard;
    }
    CHECK(covered == 57);
  }
  CHECK(l.shard_numel(4, 3) == 12);
  CHECK(l.pieces(4, 1) == std::vector<FlatPiece>{{0, 15, 0, 15}});
  CHECK(l.pieces(4, 2) == std::vector<FlatPiece>{{1, 0, 0, 6}, {2, 0, 6, 9}});
}

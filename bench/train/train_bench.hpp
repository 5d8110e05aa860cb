#pragma once
// bench_train's harness (bench/train/train_bench.cpp has the whole description): the mesh and layout, the
// options, the tokens of a step, and train_layout<Block>, which trains an nn::LanguageModel of Block in one
// layout and measures it. Each model is instantiated in its own translation unit.
#include <dtensor/testing/heap_counter_api.hpp>

#include <dtensor/comm/wait_timer.hpp>
#include <dtensor/core/nest.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/nn/module.hpp>
#include <dtensor/train/data_layout.hpp>
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/fsdp_schedule.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/trainer.hpp>
#if DTENSOR_HAS_CHECKPOINT
#include <dtensor/train/checkpoint_folder.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <sys/resource.h>

namespace bench::train {

using namespace dtensor;

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
/// Layout tp_cm: tp with each region's all_gather and reduce_scatter run as collective matmuls.
using Lcm = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel, nn::CollectiveMatmul>;
constexpr int kBlocks = 3;
constexpr std::int64_t kBatch = 8;

struct Options {
  std::string layout = "fsdp_tp", json, model_kind = "mlp";
  int steps = 12;
  std::int64_t tokens = 512;
  nn::TransformerConfig model{.vocab = 2048, .hidden = 256, .ffn = 1024, .norm_eps = 1e-6, .init_std = 0.02};
  bool check = true, mixed = false;
  nn::Recompute recompute =
      nn::Recompute::selective;   ///< what each block keeps (--recompute; --checkpoint: full)
  FsdpScheduleOptions schedule{}; ///< the FSDP layouts' prefetch depth and reductions in flight
  int save_every = 0;             ///< --save-every K: the training state saved after every K-th step
  bool save_async = true;         ///< --save sync|async: the step waits for the disk, or for the host copy
  std::string save_dir = "bench_train_state"; ///< --save-dir: the CheckpointFolder (one state kept)
};

inline nn::ids_t<L> tokens(const DeviceMesh<Mesh>& mesh, const Options& o, int step, bool targets) {
  const std::int64_t seq = o.tokens / kBatch;
  return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
    return from_global_index<std::int64_t, Q...>(mesh, {kBatch, seq}, [&](const auto& i) {
      const std::uint64_t z =
          (std::uint64_t(step) * 1000003u + std::uint64_t(i[0] * seq + i[1]) * 7919u) * 2654435761u;
      const std::int64_t id = std::int64_t((z >> 16) % std::uint64_t(o.model.vocab));
      return targets ? (3 * id + 1) % o.model.vocab : id;
    });
  }(static_cast<nn::ids_t<L>*>(nullptr));
}

inline double minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_minflt);
}

/// What a run measured (rank 0's means over the steps of each kind, in seconds).
struct Measured {
  std::vector<double> losses;
  /// blocked: the training thread's time blocked in any communication (CommWaitTimer), tensor-parallel
  /// included, in the overlapped steps.
  double step = 0, exposed = 0, blocked = 0, serial_step = 0, comm = 0, faults = 0;
  /// blocked per (op, group label), a step's mean.
  std::map<std::pair<std::string, std::string>, double> blocked_by_op;
  std::int64_t heap_start = 0, heap_peak = 0, heap_end = 0, state_bytes = 0;
  /// --save-every: the saves, the mean time of a save call on the training thread, and the wait for the
  /// last one after the steps.
  int saves = 0;
  double save_call = 0, final_wait = 0;
};

/// Trains and measures (see train_bench.cpp); Saves: --save-every is compiled in (the GPT only: the
/// training state's save for every trainer costs compile time).
template <bool Saves, class Trainer>
Measured run(Trainer& trainer, const Options& o, std::int64_t param_elements) {
  optim::AdamW opt({.lr = 1e-2, .weight_decay = 0.01});
  Measured m;
  m.heap_start = dtensor::testing::heap::live();
  m.state_bytes = param_elements * std::int64_t(sizeof(float)) * 4; // parameter, gradient, 2 moments
  int overlapped = 0, serial = 0;
#if DTENSOR_HAS_CHECKPOINT
  const auto folder = Saves && o.save_every > 0
                          ? std::make_unique<CheckpointFolder>(
                                o.save_dir, CheckpointFolderOptions{.keep = 1, .async = o.save_async})
                          : nullptr;
#else
  DTENSOR_CHECK(o.save_every == 0,
                "bench_train --save-every: built without checkpoints (nlohmann-json3-dev)");
#endif
  for (int s = 0; s < o.steps; ++s) {
    const bool serial_step = s % 5 == 1; // 2, 7, 12, ... (1-based): overlap off
    trainer.options().ddp.overlap = trainer.options().schedule.overlap = !serial_step;
    const auto ids = tokens(trainer.mesh(), o, s, false), targets = tokens(trainer.mesh(), o, s, true);
    if (s == 1) {
      dtensor::testing::heap::reset_peak();
    }
    const double f0 = minor_faults();
    CommWaitTimer blocked;
    const auto t0 = std::chrono::steady_clock::now();
    const nn::StepResult r = trainer.step(ids, targets, opt);
#if DTENSOR_HAS_CHECKPOINT
    if constexpr (Saves) {
      if (folder && (s + 1) % o.save_every == 0) { // counted in the step: what the training waits for
        const auto t1 = std::chrono::steady_clock::now();
        folder->save(trainer, opt, {.step = s + 1, .data_position = (s + 1) * kBatch});
        m.save_call += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        ++m.saves;
      }
    }
#endif
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    m.losses.push_back(r.loss);
    if (s == 0) {
      continue; // warm-up
    }
    if (serial_step) {
      m.serial_step += took, m.comm += r.blocked_seconds, ++serial;
    } else {
      m.step += took, m.exposed += r.blocked_seconds, m.blocked += blocked.seconds();
      for (const auto& [key, s] : blocked.entries()) {
        m.blocked_by_op[key] += s;
      }
      m.faults += minor_faults() - f0, ++overlapped;
    }
  }
#if DTENSOR_HAS_CHECKPOINT
  if (folder) {
    const auto t1 = std::chrono::steady_clock::now();
    folder->wait();
    m.final_wait = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    m.save_call /= std::max(1, m.saves);
  }
#endif
  m.heap_peak = o.steps > 1 ? dtensor::testing::heap::peak() : 0;
  m.heap_end = dtensor::testing::heap::live();
  const double a = std::max(1, overlapped), b = std::max(1, serial);
  for (auto& [key, s] : m.blocked_by_op) {
    s /= a;
  }
  m.step /= a, m.exposed /= a, m.blocked /= a, m.faults /= a, m.serial_step /= b, m.comm /= b;
  return m;
}

/// What a trainer's state() holds: replicated parameters (DTensors) and FSDP groups.
template <class V>
        struct ParamSource : std::bool_constant < AnyDTensor<V> ||
    requires(const V& v) {
  v.local_param();
} > {};

/// Trains a LanguageModel<float, L, Block> of kBlocks blocks in `layout` (o.recompute: each block's
/// nn::Recompute; o.mixed: bfloat16 compute, fsdp and fsdp_tp) and measures it.
template <template <class, class> class Block, bool Overlap = false, bool Saves = false>
Measured train_layout(const DeviceMesh<Mesh>& mesh, const std::string& layout, const Options& o) {
  using Model = nn::LanguageModel<float, L, Block>;
  init::InitKeys keys(2024);
  // 4 KiB buckets as torch_train.py's DDP (bucket_cap_mb), a clip that binds early.
  const nn::TrainerOptions options{.max_norm = 0.5,
                                   .ddp = {.bucket_cap_bytes = 4096, .first_bucket_cap_bytes = 2048},
                                   .schedule = o.schedule};
  // The parameter elements this rank holds: an FSDP group's shard, a replicated parameter's local tensor.
  auto measure = [&](auto& t) {
    std::int64_t n = 0;
    dtensor::detail::for_each_leaf<ParamSource>(t.state(), [&](const auto& s) {
      if constexpr (AnyDTensor<std::remove_cvref_t<decltype(s)>>) {
        n += s.local().numel();
      } else {
        n += s.local_param().numel();
      }
    });
    return run<Saves>(t, o, n);
  };
  auto model = [&]<class M>(std::type_identity<M>) {
    M m(mesh, o.model, kBlocks, keys);
    for (auto& b : m.blocks) {
      b.recompute = o.recompute;
    }
    return m;
  };
  if ((layout == "fsdp" || layout == "fsdp_tp") && o.mixed) {
    nn::FsdpTrainer<Model, Fsdp<"dp">, bfloat16> t(mesh, model(std::type_identity<Model>{}), options);
    return measure(t);
  }
  if constexpr (Overlap) { // tp_cm: the mlp model only (the GPT's trainer twice costs compile time)
    if (layout == "tp_cm") {
      using Overlapped = nn::LanguageModel<float, Lcm, Block>;
      nn::DdpTrainer<Overlapped, "dp"> t(mesh, model(std::type_identity<Overlapped>{}), options);
      return measure(t);
    }
  }
  // The data layouts by name (train/data_layout.hpp), as the examples pick them.
  return nn::with_trainer(nn::parse_data_layout(layout == "tp_cm" ? "tp" : layout), mesh,
                          model(std::type_identity<Model>{}), options, measure);
}

/// The two models, each instantiated in its own translation unit (train_mlp.cpp, train_gpt.cpp).
Measured train_mlp(const DeviceMesh<Mesh>& mesh, const std::string& layout, const Options& o);
Measured train_gpt(const DeviceMesh<Mesh>& mesh, const std::string& layout, const Options& o);

} // namespace bench::train

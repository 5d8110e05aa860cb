// The training step of the library (train/trainer.hpp): nn::DdpTrainer and nn::FsdpTrainer on an
// nn::LanguageModel of MLP blocks (the model of examples/06_train.cpp: a vocab-parallel embedding, blocks of
// rms_norm + a GELU MLP in tensor + sequence parallel + a residual, a final rms_norm, the vocab-parallel head
// and its loss) on a (rep, dp, tp) mesh, in each layout 06 names:
//   tp       (1, 1, n)   replicated parameters, DdpTrainer over dp
//   ddp      (1, n, 1)   the same trainer
//   fsdp     (1, n, 1)   FsdpTrainer<Fsdp<"dp">>; rep is a second batch axis whose gradients are all-reduced
//   hsdp     (2, n/2, 1) FsdpTrainer<Hsdp<"rep", "dp">>
//   fsdp_tp  (1, 2, 2)   FSDP over dp of tensor-parallel parameters
// - Against one rank: three AdamW steps with clipping on 1-4 ranks (and hsdp on 2 and 4, fsdp_tp on 4) give
//   the one-rank losses, gradient norms and final parameters within 1e-10 (double), with uneven and empty
//   shards (batch 3 over up to 4 batch ranks, sequence 7 over tp, hidden 18, ffn 30, vocab 37).
// - The collectives of a step are pinned per layout: derived from the model's structure (its blocks, the
//   FSDP groups, DDP's buckets), counted by CommDebugMode; every step issues the same, the second one with
//   overlap off (TrainerOptions' ddp.overlap and schedule.overlap), which must not change the numbers.
// - Gradient accumulation: a step on 3 micro-batches of 3 rows equals a step on their 9 rows at once (loss
//   and parameters within 1e-10, two steps) under both trainers, and the data-parallel reductions are issued
//   once (the micro-batches' own collectives are the loss's means). The training state's round trip is in
//   test_layers.cpp.
// - Memory: what a step holds by category (DDP, FSDP), and a GPT of nn::TransformerBlock under tp + sp on 4
//   ranks whose activations at the step's peak grow by the derived bound per block (docs/parallel.md), the
//   dry run's equal to the real run's.
#include <catch2/catch.hpp>

#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/core/memory_tracker.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/block.hpp>
#include <dtensor/nn/mlp_block.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/plan/dry_run.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/trainer.hpp>

#include "../support/block_memory.hpp"
#include "../support/dry_run_match.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using Model = nn::LanguageModel<double, L, nn::MlpBlock>;

constexpr int kBlocks = 3, kSteps = 3;
constexpr std::int64_t kBatch = 3, kSeq = 7;
const nn::TransformerConfig config{.vocab = 37, .hidden = 18, .ffn = 30, .norm_eps = 1e-6, .init_std = 0.5};

enum class Layout { tp, ddp, fsdp, hsdp, fsdp_tp };

void expect(bool ok, const std::string& what) {
  DTENSOR_CHECK(ok, what);
}

/// What a run gives: per step the loss and the gradient norm, the final parameters (full), the
/// collectives of the last step.
struct Run {
  std::vector<double> losses, norms;
  std::vector<std::vector<double>> params;
  std::map<std::pair<std::string, std::string>, std::int64_t> comms;
  int buckets = 0; ///< DDP's buckets (replicated layouts)
};

/// Step `step`'s ids (shift 0) or targets (shift 1): rows [first_row, first_row + rows) of its batch.
nn::ids_t<L> tokens(const DeviceMesh<Mesh>& mesh, int step, std::int64_t shift, std::int64_t rows = kBatch,
                    std::int64_t first_row = 0, Device device = Device::cpu()) {
  return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
    return from_global_index<std::int64_t, Q...>(
        mesh, {rows, kSeq},
        [&](const auto& i) {
          const std::int64_t r = i[0] + first_row;
          return (r * 11 + i[1] * 5 + step * 3 + shift + i[1] * i[1]) % config.vocab;
        },
        device);
  }(static_cast<nn::ids_t<L>*>(nullptr));
}

template <class Trainer>
Run train(Trainer& trainer) {
  optim::AdamW opt({.lr = 2e-2, .weight_decay = 0.01});
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    const auto& mesh = trainer.mesh();
    const auto ids = tokens(mesh, s, 0);
    const auto targets = tokens(mesh, s, 1);
    // Step 2 runs with overlap off (each asynchronous collective waited for when issued): the same step.
    trainer.options().ddp.overlap = trainer.options().schedule.overlap = s != 1;
    CommDebugMode comm;
    const nn::StepResult r = trainer.step(ids, targets, opt);
    run.losses.push_back(r.loss);
    run.norms.push_back(r.grad_norm);
    std::map<std::pair<std::string, std::string>, std::int64_t> counts;
    for (const auto& [key, e] : comm.entries()) {
      counts[key] = e.count;
    }
    expect(s == 0 || counts == run.comms,
           "step " + std::to_string(s) + "'s collectives differ from step 0's");
    run.comms = counts;
  }
  trainer.with_gathered([&](auto& m) {
    nn::for_each_tensor(m.parameters(), [&](const auto& w) {
      const auto full = w.full_tensor();
      run.params.emplace_back(full.data(), full.data() + full.numel());
    });
  });
  return run;
}

Run run_layout(const DeviceMesh<Mesh>& mesh, Layout layout) {
  init::InitKeys keys(7);
  Model model(mesh, config, kBlocks, keys);
  // A clip that binds in the first steps, buckets small enough that there are several.
  const nn::TrainerOptions options{.max_norm = 0.5,
                                   .ddp = {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024}};
  if (layout == Layout::tp || layout == Layout::ddp) {
    nn::DdpTrainer<Model, "dp"> trainer(mesh, std::move(model), options);
    Run run = train(trainer);
    std::vector<std::int64_t> bytes;
    trainer.with_gathered([&](auto& m) {
      nn::for_each_tensor(m.parameters(), [&](const auto& w) { bytes.push_back(w.local().numel() * 8); });
    });
    run.buckets = int(assign_buckets(bytes, 1024, 2048).size());
    return run;
  }
  if (layout == Layout::hsdp) {
    nn::FsdpTrainer<Model, Hsdp<"rep", "dp">> trainer(mesh, std::move(model), options);
    return train(trainer);
  }
  nn::FsdpTrainer<Model, Fsdp<"dp">> trainer(mesh, std::move(model), options);
  return train(trainer);
}

/// The collectives one step of `layout` issues, from the model's structure (06_train's accounting).
std::map<std::pair<std::string, std::string>, std::int64_t> expected_comms(Layout layout, int buckets) {
  const std::int64_t b = kBlocks, params = 1 + 3 * b + 2; // embedding, (gain, W1, W2) per block, gain, head
  std::map<std::pair<std::string, std::string>, std::int64_t> c;
  // cross_entropy on logits sharded on the vocabulary over tp: the row max and the row sums over tp, the
  // mean over the axes that shard the rows (rep and dp: one all_reduce over both, flattened).
  c[{"all_reduce", "tp"}] = 2;
  c[{"all_reduce", "rep*dp"}] = 1;
  // The rms_norm gains' gradients are Partial over tp (sequence parallel). Where rep reduces every
  // gradient (it is a second batch axis, not an HSDP replica axis), they are Partial over rep too and one
  // all_reduce over rep*tp reduces them; the other gradients reduce over rep alone.
  const std::int64_t gains = b + 1;
  if (layout == Layout::hsdp) {
    c[{"all_reduce", "tp"}] += gains;
  } else {
    c[{"all_reduce", "rep*tp"}] = gains;
    c[{"all_reduce", "rep"}] = params - gains;
  }
  if (layout == Layout::tp || layout == Layout::ddp) {
    // Sequence parallel: forward one all_gather into each region (b blocks, the head) and one
    // reduce_scatter out (b blocks, the embedding); the backward runs their duals, and gathers each
    // block's input again (it keeps the sequence shard, not the gathered copy).
    c[{"all_gather", "tp"}] = 2 * (b + 1) + b;
    c[{"reduce_scatter", "tp"}] = 2 * (b + 1);
    c[{"all_reduce", "dp"}] = buckets; // DDP: one per bucket
    c[{"all_reduce", "tp"}] += 1;      // clip: one double over the axes where a gradient is sharded
    return c;
  }
  const std::int64_t groups = b + 2;
  // Each group gathered for its forward and again for its backward, but the head's (forward and backward
  // at once); the blocks and the embedding recompute their forward in the backward, with its collectives,
  // and each block gathers its input again for its weights' gradients.
  c[{"all_gather", "dp"}] = groups + (b + 1);
  c[{"all_gather", "tp"}] = (b + 1) + b + (b + 1) + b;
  c[{"reduce_scatter", "tp"}] = (b + 1) + (b + 1) + (b + 1);
  c[{"reduce_scatter", "dp"}] = groups;
  if (layout == Layout::hsdp) {
    c[{"all_reduce", "rep"}] = groups; // each group's reduced shard over the replicas
  }
  c[{"all_reduce", "dp*tp"}] = 1; // clip over the groups: the axes where gradient shards differ
  return c;
}

/// `c` (counts by op and axes on a mesh whose axes all have more than one rank) on a mesh of these sizes:
/// an axis of size 1 takes no part (a group over it and others is the others' group; over it alone there is
/// no collective), so the counts are those of the same layout on the mesh without that axis.
std::map<std::pair<std::string, std::string>, std::int64_t>
on_sizes(const std::map<std::pair<std::string, std::string>, std::int64_t>& c, int rep, int dp, int tp) {
  const std::map<std::string, int> size{{"rep", rep}, {"dp", dp}, {"tp", tp}};
  std::map<std::pair<std::string, std::string>, std::int64_t> out;
  for (const auto& [key, n] : c) {
    std::string axes;
    std::size_t at = 0;
    while (at <= key.second.size()) {
      const std::size_t star = std::min(key.second.find('*', at), key.second.size());
      const std::string axis = key.second.substr(at, star - at);
      if (size.at(axis) > 1) {
        axes += (axes.empty() ? "" : "*") + axis;
      }
      at = star + 1;
    }
    if (!axes.empty()) {
      out[{key.first, axes}] += n;
    }
  }
  return out;
}

std::string describe(const std::map<std::pair<std::string, std::string>, std::int64_t>& c) {
  std::string s;
  for (const auto& [key, n] : c) {
    s += " " + key.first + "(" + key.second + ")=" + std::to_string(n);
  }
  return s;
}

void compare(const Run& got, const Run& want, const std::string& name) {
  constexpr double tol = 1e-10;
  for (int s = 0; s < kSteps; ++s) {
    expect(std::abs(got.losses[s] - want.losses[s]) <= tol * std::abs(want.losses[s]),
           name + ": step " + std::to_string(s) + "'s loss " + std::to_string(got.losses[s]) + ", one rank " +
               std::to_string(want.losses[s]));
    expect(std::abs(got.norms[s] - want.norms[s]) <= tol * std::abs(want.norms[s]),
           name + ": step " + std::to_string(s) + "'s gradient norm " + std::to_string(got.norms[s]) +
               ", one rank " + std::to_string(want.norms[s]));
  }
  expect(got.params.size() == want.params.size(), name + ": the number of parameters");
  for (std::size_t i = 0; i < want.params.size(); ++i) {
    expect(got.params[i].size() == want.params[i].size(),
           name + ": parameter " + std::to_string(i) + "'s size");
    for (std::size_t e = 0; e < want.params[i].size(); ++e) {
      const double d = std::abs(got.params[i][e] - want.params[i][e]);
      expect(d <= tol * std::max(1.0, std::abs(want.params[i][e])),
             name + ": parameter " + std::to_string(i) + " element " + std::to_string(e) + " differs by " +
                 std::to_string(d));
    }
  }
}

const Run& reference() {
  static const Run want = [] {
    Run r;
    testing::run_ranks(
        1, [&](ProcessGroup& one) { r = run_layout(init_device_mesh<Mesh>(one, 1, 1, 1), Layout::ddp); });
    return r;
  }();
  return want;
}

void check(Layout layout, int rep, int dp, int tp, const std::string& name) {
  const std::string where = name + " on (rep=" + std::to_string(rep) + ", dp=" + std::to_string(dp) +
                            ", tp=" + std::to_string(tp) + ")";
  INFO(where);
  const Run& want = reference();
  testing::run_ranks(rep * dp * tp, [&](ProcessGroup& world) {
    const Run got = run_layout(init_device_mesh<Mesh>(world, rep, dp, tp), layout);
    compare(got, want, where);
    const auto pins = on_sizes(expected_comms(layout, got.buckets), rep, dp, tp);
    expect(got.comms == pins,
           where + ": a step's collectives" + describe(got.comms) + "; expected" + describe(pins));
  });
}

/// Two steps on 9 rows, whole or as 3 micro-batches: the losses, the final parameters, the collectives of the
/// last step.
template <class Trainer>
Run accumulate(Trainer& trainer, bool micro) {
  optim::AdamW opt({.lr = 2e-2, .weight_decay = 0.01});
  Run run;
  for (int s = 0; s < 2; ++s) {
    std::vector<std::pair<nn::ids_t<L>, nn::ids_t<L>>> batches;
    for (int k = 0; k < (micro ? 3 : 1); ++k) {
      const std::int64_t rows = micro ? 3 : 9, first = micro ? 3 * k : 0;
      batches.emplace_back(tokens(trainer.mesh(), s, 0, rows, first),
                           tokens(trainer.mesh(), s, 1, rows, first));
    }
    CommDebugMode comm;
    run.losses.push_back(
        trainer.step(std::span<const std::pair<nn::ids_t<L>, nn::ids_t<L>>>(batches), opt).loss);
    run.comms.clear();
    for (const auto& [key, e] : comm.entries()) {
      run.comms[key] = e.count;
    }
  }
  trainer.with_gathered([&](auto& m) {
    nn::for_each_tensor(m.parameters(), [&](const auto& w) {
      const auto full = w.full_tensor();
      run.params.emplace_back(full.data(), full.data() + full.numel());
    });
  });
  return run;
}

void check_accumulation(bool sharded, int dp, int tp) {
  const std::string name = std::string(sharded ? "fsdp" : "ddp") + " on (1, " + std::to_string(dp) + ", " +
                           std::to_string(tp) + "), 3 micro-batches";
  INFO(name);
  testing::run_ranks(dp * tp, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world, 1, dp, tp);
    auto run = [&](bool micro) {
      init::InitKeys keys(7);
      if (sharded) {
        nn::FsdpTrainer<Model, Fsdp<"dp">> t(mesh, Model(mesh, config, kBlocks, keys), {.max_norm = 0.5});
        return accumulate(t, micro);
      }
      nn::DdpTrainer<Model, "dp"> t(
          mesh, Model(mesh, config, kBlocks, keys),
          {.max_norm = 0.5, .ddp = {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024}});
      return accumulate(t, micro);
    };
    const Run whole = run(false), micro = run(true);
    for (std::size_t s = 0; s < whole.losses.size(); ++s) {
      expect(std::abs(micro.losses[s] - whole.losses[s]) <= 1e-10 * std::abs(whole.losses[s]),
             name + ": step " + std::to_string(s) + "'s loss " + std::to_string(micro.losses[s]) +
                 ", whole batch " + std::to_string(whole.losses[s]));
    }
    for (std::size_t i = 0; i < whole.params.size(); ++i) {
      for (std::size_t e = 0; e < whole.params[i].size(); ++e) {
        const double d = std::abs(micro.params[i][e] - whole.params[i][e]);
        expect(d <= 1e-10 * std::max(1.0, std::abs(whole.params[i][e])),
               name + ": parameter " + std::to_string(i) + " element " + std::to_string(e) + " differs by " +
                   std::to_string(d));
      }
    }
    // The data-parallel reductions once a step: the micro-batches add only their losses' means over the
    // batch axes (cross_entropy's all_reduce over rep*dp, one per micro-batch; rep has size 1 here, so it
    // is over dp, beside the gradients' reductions) and their tensor-parallel collectives.
    auto count = [](const Run& r, const std::string& op, const std::string& axes) {
      const auto at = r.comms.find({op, axes});
      return at == r.comms.end() ? std::int64_t{0} : at->second;
    };
    expect(count(micro, "reduce_scatter", "dp") == count(whole, "reduce_scatter", "dp") &&
               count(micro, "all_reduce", "dp") == count(whole, "all_reduce", "dp") + (dp > 1 ? 2 : 0) &&
               count(micro, "all_reduce", "rep*dp") == 0,
           name + ": the data-parallel reductions" + describe(micro.comms) + "; whole batch" +
               describe(whole.comms));
  });
}

/// Two steps under a MemoryTracker; what it counts after them, by category, against what the trainer
/// holds: its parameters (P bytes: DDP's local blocks, FSDP's shards), AdamW's two moments (2P), DDP's
/// gradient slots and buckets (P each); FSDP frees its gradients after the step and its gathered buffers
/// after each use. Nothing else stays.
void check_memory(Layout layout, int dp, int tp) {
  const std::string name = std::string(layout == Layout::fsdp ? "fsdp" : "ddp") + " on (1, " +
                           std::to_string(dp) + ", " + std::to_string(tp) + ")";
  INFO(name);
  testing::run_ranks(dp * tp, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world, 1, dp, tp);
    MemoryTracker memory;
    init::InitKeys keys(7);
    Model model(mesh, config, kBlocks, keys);
    optim::AdamW opt({.lr = 2e-2});
    std::int64_t p = 0;
    MemoryStats got;
    auto two_steps = [&](auto& trainer) {
      for (int s = 0; s < 2; ++s) {
        (void)trainer.step(tokens(mesh, s, 0), tokens(mesh, s, 1), opt);
      }
      got = memory.stats();
    };
    auto at = [&](MemoryCategory c) { return got.live[std::size_t(c)]; };
    if (layout == Layout::fsdp) {
      nn::FsdpTrainer<Model, Fsdp<"dp">> trainer(mesh, std::move(model));
      std::apply(
          [&](auto& emb, auto& blocks, auto& head) {
            p = (emb.local_param().numel() + head.local_param().numel()) * 8;
            for (auto& b : blocks) {
              p += b.local_param().numel() * 8;
            }
          },
          trainer.state());
      two_steps(trainer);
      expect(at(MemoryCategory::gradients) == 0 && at(MemoryCategory::communication) == 0,
             name + ": FSDP keeps no gradient or gathered buffer after a step:\n" + got.to_string());
      expect(got.peak[std::size_t(MemoryCategory::gradients)] == p,
             name + ": the gradient shards at their peak, " + std::to_string(p) + " bytes:\n" +
                 got.to_string());
      expect(got.peak[std::size_t(MemoryCategory::communication)] > 0,
             name + ": the gathered buffers are communication:\n" + got.to_string());
    } else {
      nn::for_each_tensor(model.parameters(), [&](const auto& w) { p += w.local().numel() * 8; });
      nn::DdpTrainer<Model, "dp"> trainer(mesh, std::move(model));
      two_steps(trainer);
      expect(at(MemoryCategory::gradients) == p && at(MemoryCategory::communication) == p,
             name + ": DDP keeps a gradient per parameter and the buckets, " + std::to_string(p) +
                 " bytes each:\n" + got.to_string());
    }
    expect(at(MemoryCategory::parameters) == p && at(MemoryCategory::optimizer_state) == 2 * p,
           name + ": the parameters, " + std::to_string(p) + " bytes, and AdamW's moments:\n" +
               got.to_string());
    expect(at(MemoryCategory::activations) == 0 && at(MemoryCategory::other) == 0,
           name + ": no activation or other block outlives the step:\n" + got.to_string());
    std::int64_t at_peak = 0;
    for (const std::int64_t b : got.at_peak) {
      at_peak += b;
    }
    expect(at_peak == got.peak_total && got.peak_total > got.live_total,
           name + ": the peak, in the step, is the sum of its categories:\n" + got.to_string());
  });
}

} // namespace

TEST_CASE("nn::DdpTrainer and nn::FsdpTrainer: what a step holds, by memory category",
          "[parallel][trainer]") {
  for (int n = 1; n <= 4; ++n) {
    check_memory(Layout::ddp, n, 1);
    check_memory(Layout::fsdp, n, 1);
  }
  check_memory(Layout::ddp, 1, 2);
  check_memory(Layout::fsdp, 2, 2);
}

TEST_CASE("nn::DdpTrainer and nn::FsdpTrainer: K micro-batches equal one batch K times larger, reduced once",
          "[parallel][trainer]") {
  check_accumulation(false, 2, 1);
  check_accumulation(false, 3, 1);
  check_accumulation(false, 1, 2);
  check_accumulation(true, 2, 1);
  check_accumulation(true, 2, 2);
}

TEST_CASE("nn::DdpTrainer: tensor + sequence parallel and data parallel steps equal one rank's, collectives "
          "pinned",
          "[parallel][trainer]") {
  for (int n = 1; n <= 4; ++n) {
    check(Layout::tp, 1, 1, n, "tp");
    check(Layout::ddp, 1, n, 1, "ddp");
  }
  check(Layout::ddp, 2, 2, 1, "ddp with a second batch axis");
}

TEST_CASE("nn::FsdpTrainer: FSDP, HSDP and FSDP x TP steps equal one rank's, collectives pinned",
          "[parallel][trainer]") {
  for (int n = 1; n <= 4; ++n) {
    check(Layout::fsdp, 1, n, 1, "fsdp");
  }
  check(Layout::hsdp, 2, 1, 1, "hsdp");
  check(Layout::hsdp, 2, 2, 1, "hsdp");
  check(Layout::fsdp_tp, 1, 2, 2, "fsdp_tp");
}

namespace {

/// Two FSDP x TP steps of the test's model on (1, dp, tp), on `world` with tensors on `device`; with `ctx`,
/// the dry run measures the second only.
void fsdp_tp_steps(const ProcessGroup& world, Device device, int dp, int tp, DryRunContext* ctx = nullptr) {
  const auto mesh = init_device_mesh<Mesh>(world, 1, dp, tp);
  init::InitKeys keys(7);
  nn::FsdpTrainer<Model, Fsdp<"dp">> trainer(mesh, Model(mesh, config, kBlocks, keys, device));
  optim::AdamW opt({.lr = 2e-2});
  for (int s = 0; s < 2; ++s) {
    if (s == 1 && ctx != nullptr) {
      ctx->begin_step();
    }
    (void)trainer.step(tokens(mesh, s, 0, kBatch, 0, device), tokens(mesh, s, 1, kBatch, 0, device), opt);
  }
}

} // namespace

TEST_CASE("dtensor::dry_run: a rank alone on meta tensors holds, communicates and computes what it does in "
          "the real run, and a rank of 1,024 priced on a cluster",
          "[parallel][trainer][dry_run]") {
  // The real run on (1, 2, 2) and each rank's dry run: the same tensor peak, communication table and flops.
  for (const DryRun& d : testing::check_dry_run_matches(
           4, [](const ProcessGroup&world, Device device) { fsdp_tp_steps(world, device, 2, 2); })) {
    CHECK(d.bytes_network == 0); // 4 ranks: one node
    CHECK(d.bytes_nvlink > 0);
  }
  // Rank 5 of (1, 128, 8) on DGX H100s (dp coordinate 0: one of the batch's 3 rows): 128 nodes, the dp
  // groups across them; the second step measured, which holds the optimizer's state from the first.
  const DryRun big = dry_run({.rank = 5, .world_size = 1024, .cluster = dgx_h100()}, [](DryRunContext& ctx) {
    fsdp_tp_steps(ctx.world(), ctx.device(), 128, 8, &ctx);
  });
  CHECK(big.memory.at_peak[std::size_t(MemoryCategory::optimizer_state)] > 0);
  CHECK(big.memory.at_peak[std::size_t(MemoryCategory::activations)] > 0);
  CHECK(big.memory.at_peak[std::size_t(MemoryCategory::other)] < 1024); // the ids: the model was built before
  CHECK(big.bytes_network > 0);
  CHECK(big.bytes_nvlink > 0);
  CHECK(big.fits);
  CHECK(big.time.compute > 0);
  CHECK(big.time.seconds >= big.time.compute);
  CHECK(big.time.seconds <= big.time.compute + big.time.comm * (1 + 1e-9));
  CHECK(big.time.exposed > 0); // tensor parallelism's collectives are synchronous
  CHECK(big.hfu > 0);
  CHECK(big.hfu < 1);
  CHECK_THAT(big.to_string(), Catch::Contains("rank 5 of 1024") && Catch::Contains("exposed"));
  CHECK_THAT(big.to_json(),
             Catch::Contains("\"world_size\": 1024") && Catch::Contains("\"at_peak\"") &&
                 Catch::Contains("\"comm\": [{\"op\": \"all_gather\", \"axes\": \"dp\", \"count\": "));
}

namespace {

using Gpt = nn::LanguageModel<double, L, nn::TransformerBlock>;
const nn::TransformerConfig gpt{
    .vocab = 16, .hidden = 64, .heads = 8, .kv_heads = 4, .ffn = 160, .norm_eps = 1e-6, .init_std = 0.1};
constexpr std::int64_t kGptBatch = 2, kGptSeq = 32;

/// The bytes of double a TransformerBlock keeps for its backward under tensor + sequence parallelism of
/// size t at the bound (tests/support/block_memory.hpp, pinned term by term in tests/nn/test_layers.cpp),
/// and its input (the previous unit's output, which its first norm keeps), on a rank of a (1, 1, t) mesh.
std::int64_t gpt_block_bound(int t) {
  const std::int64_t tokens = kGptBatch * kGptSeq;
  return testing::expected_block_kept<double>(gpt, tokens, t, true) + 8 * (tokens / t) * gpt.hidden;
}

/// Two steps of a GPT of `blocks` blocks under tensor + sequence parallelism on (1, 1, tp); what the
/// second holds (with `ctx`, the dry run measures the second, and nothing is returned).
MemoryStats gpt_steps(const ProcessGroup& world, Device device, int tp, int blocks,
                      DryRunContext* ctx = nullptr) {
  const auto mesh = init_device_mesh<Mesh>(world, 1, 1, tp);
  init::InitKeys keys(7);
  nn::DdpTrainer<Gpt, "dp"> trainer(mesh, Gpt(mesh, gpt, blocks, keys, device));
  optim::AdamW opt({.lr = 1e-2});
  auto ids = [&](int step, std::int64_t shift) {
    return [&]<class... Q>(DTensor<std::int64_t, 2, Mesh, Q...>*) {
      return from_global_index<std::int64_t, Q...>(
          mesh, {kGptBatch, kGptSeq},
          [&](const auto& i) { return (i[0] * 7 + i[1] * 3 + step + shift + i[1] * i[1]) % gpt.vocab; },
          device);
    }(static_cast<nn::ids_t<L>*>(nullptr));
  };
  (void)trainer.step(ids(0, 0), ids(0, 1), opt);
  if (ctx != nullptr) { // the dry run's tracker counts: only the innermost MemoryTracker does
    ctx->begin_step();
    (void)trainer.step(ids(1, 0), ids(1, 1), opt);
    return {};
  }
  MemoryTracker memory;
  (void)trainer.step(ids(1, 0), ids(1, 1), opt);
  return memory.stats();
}

} // namespace

TEST_CASE("nn::DdpTrainer: a GPT's activations at a step's peak grow by the derived bound per block under "
          "tensor + sequence parallelism, in the real run and the dry run",
          "[parallel][trainer][memory]") {
  // At the peak (the backward of the last block) every block's kept activations are live, and besides them
  // what does not depend on the block count: the embedding's and the head's, and one block's backward
  // temporaries. So the peaks of 2 and 4 blocks differ by twice what a block keeps: its bound exactly.
  constexpr int t = 4;
  const auto activations = [](const MemoryStats& m) {
    return m.peak[std::size_t(MemoryCategory::activations)];
  };
  std::array<std::array<std::int64_t, t>, 2> peak{};
  for (int i = 0; i < 2; ++i) {
    testing::run_ranks(t, [&](ProcessGroup& world) {
      peak[std::size_t(i)][std::size_t(world.rank())] =
          activations(gpt_steps(world, Device::cpu(), t, 2 + 2 * i));
    });
  }
  const std::int64_t bound = gpt_block_bound(t);
  for (int r = 0; r < t; ++r) {
    const std::int64_t two = peak[0][std::size_t(r)], four = peak[1][std::size_t(r)];
    INFO("rank " << r << ": activations at the peak " << two << " bytes with 2 blocks, " << four
                 << " with 4; a block's bound " << bound << ", the rest " << four - 4 * bound);
    CHECK(four - two == 2 * bound);
    // The rest (embedding, head, one backward's temporaries) against what 4 blocks keep.
    CHECK(four - 4 * bound > 0);
    // The dry run of the same steps: the same activations at the peak.
    const DryRun d = dry_run({.rank = r, .world_size = t}, [](DryRunContext& ctx) {
      (void)gpt_steps(ctx.world(), ctx.device(), t, 4, &ctx);
    });
    CHECK(activations(d.memory) == four);
  }
}

// The trainers on a model that is not a language model (nn/contract.hpp): a regression model
// whose layers are written here, as a user writes them, with their own forward, backward and typed
// placements, and a mean-squared-error loss:
//   Feedforward   x + W_down relu(W_up x): W_up column parallel, W_down row parallel over tp, the Partial
//                 sum all-reduced on exit; the input (batch, width) sharded on the batch over rep and dp
//   Gate          relu(x): a unit without parameters
//   Readout       W x: a replicated (outputs, width) weight
// The model's units are one Feedforward, a run of Feedforward blocks, a Gate and the Readout (a single unit,
// a run, one without parameters, a single unit: every form the contract allows), trained with nn::MseLoss.
// - Against one rank: three AdamW steps with clipping under DdpTrainer (ddp over dp, tp), FsdpTrainer (fsdp,
//   hsdp, fsdp x tp) on 1-4 ranks give the one-rank losses, gradient norms and final parameters within 1e-10
//   (double), with uneven and empty shards (batch 4 over up to 4 batch ranks, one-row micro-batches, ffn 10
//   over tp).
// - Pipelined (nn::PipelineTrainer: the run of blocks cut into stages, the first unit with stage 0, the gate
//   and the readout with the last): 1F1B, GPipe and interleaved 1F1B, with FSDP or TP inside the stages,
//   equal the one-rank step on the same four micro-batches within 1e-10.
// - Gradient accumulation: four micro-batches of one row equal the batch at once under both trainers.
#include <catch2/catch.hpp>

#include <dtensor/backward/redistribute.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/contract.hpp>
#include <dtensor/nn/losses.hpp>
#include <dtensor/ops/matmul.hpp>
#include <dtensor/ops/pointwise.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/data_layout.hpp>
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/pipeline_trainer.hpp>
#include <dtensor/train/trainer.hpp>
#if DTENSOR_HAS_CHECKPOINT
#include <dtensor/train/checkpoint_folder.hpp>
#include <dtensor/train/train_state.hpp>
#endif

#include "../support/model_runs.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
template <class T>
using Rows = DTensor<T, 2, Mesh, Shard<0>, Shard<0>, Replicate>; // (batch, width): the batch over rep, dp
template <class T>
using Column = DTensor<T, 2, Mesh, Replicate, Replicate, Shard<0>>; // (out, in): out over tp
template <class T>
using Row = DTensor<T, 2, Mesh, Replicate, Replicate, Shard<1>>; // (out, in): in over tp
template <class T>
using Full = DTensor<T, 2, Mesh, Replicate, Replicate, Replicate>;

// ---- The user's layers ----

/// x + W_down relu(W_up x), tensor parallel over tp: its parameters listed once (nn::Layer writes
/// parameters() and with_parameters()), its forward with its backward.
template <class T>
struct Feedforward : nn::Layer<Feedforward<T>> {
  Column<T> up; // (ffn, width)
  Row<T> down;  // (width, ffn)

  static constexpr auto parameter_members() { return std::tuple{&Feedforward::up, &Feedforward::down}; }
  static constexpr auto state_members() { return std::tuple{}; } // another element type: no other member
  auto forward(const Rows<T>& x, WithBackwardTag) const {
    auto [a, up_back] = linear(x, up, with_backward); // the ffn units over tp
    auto [r, relu_back] = relu(a, with_backward);
    auto [z, down_back] = linear(r, down, with_backward); // Partial over tp
    auto [zr, sum_back] = redistribute_with_backward<Shard<0>, Shard<0>, Replicate>(z);
    auto [y, add_back] = add(x, zr, with_backward);
    auto back = [=](const Rows<T>& dy) {
      auto [dx_skip, dzr] = add_back(dy);
      auto [dr, dw_down] = down_back(sum_back(dzr));
      auto [dx_up, dw_up] = up_back(relu_back(dr)); // Partial over tp: the ffn units' sum
      Rows<T> dx = add(dx_skip, dx_up.template redistribute<Shard<0>, Shard<0>, Replicate>());
      return nn::Gradients{std::move(dx), std::tuple{std::move(dw_up), std::move(dw_down)}};
    };
    return WithBackward<Rows<T>, decltype(back)>{std::move(y), std::move(back)};
  }
};

/// relu(x): no parameters.
struct Gate : nn::Layer<Gate> {
  static constexpr auto parameter_members() { return std::tuple<>{}; }
  template <class X>
  auto forward(const X& x, WithBackwardTag) const {
    auto [y, back] = relu(x, with_backward);
    auto grads = [back = std::move(back)](const X& dy) { return nn::Gradients{back(dy), std::tuple<>{}}; };
    return WithBackward<X, decltype(grads)>{std::move(y), std::move(grads)};
  }
};

/// W x: (batch, width) -> (batch, outputs). Written out in full (no nn::Layer): a unit may also give
/// parameter_types, parameters(), with_parameters() and forward(x) itself.
template <class T>
struct Readout {
  using parameter_types = std::tuple<Full<T>>;
  Full<T> w; // (outputs, width)

  auto parameters() { return std::tie(w); }
  template <class U>
  Readout<U> with_parameters(const Full<U>& v) const {
    return {v};
  }
  auto forward(const Rows<T>& x, WithBackwardTag) const {
    auto [y, back] = linear(x, w, with_backward);
    auto grads = [back = std::move(back)](const Rows<T>& dy) {
      auto [dx, dw] = back(dy);
      return nn::Gradients{Rows<T>(dx), std::tuple{std::move(dw)}};
    };
    return WithBackward<Rows<T>, decltype(grads)>{std::move(y), std::move(grads)};
  }
  Rows<T> forward(const Rows<T>& x) const { return linear(x, w); }
};

// ---- The user's model: its layers, units() and loss_function() ----

template <class T>
struct Regressor {
  Feedforward<T> first;
  std::vector<Feedforward<T>> blocks;
  Gate gate;
  Readout<T> readout;

  template <class U>
  using rebind = Regressor<U>; // the model in another element type (mixed precision's with_gathered)

  auto units() { return std::tie(first, blocks, gate, readout); }
  auto loss_function() const { return nn::MseLoss{}; }
};
static_assert(nn::Model<Regressor<double>>);
static_assert(nn::Unit<Gate> && nn::Unit<Feedforward<float>>);

constexpr std::int64_t kWidth = 6, kFfn = 10, kOutputs = 3, kBatch = 4;
constexpr int kBlocks = 4, kSteps = 3;

/// Weight `seed` of type D: small values that differ per element, the same on any mesh.
template <class D>
D weight(const DeviceMesh<Mesh>& mesh, std::int64_t rows, std::int64_t cols, int seed) {
  return [&]<class T, class... Q>(DTensor<T, 2, Mesh, Q...>*) {
    return from_global_index<T, Q...>(mesh, {rows, cols}, [&](const auto& i) {
      return T(((i[0] * 7 + i[1] * 3 + seed * 5) % 11 - 5) / 16.0);
    });
  }(static_cast<D*>(nullptr));
}

Regressor<double> make_model(const DeviceMesh<Mesh>& mesh) {
  const auto ff = [&](int seed) {
    return Feedforward<double>{{},
                               weight<Column<double>>(mesh, kFfn, kWidth, seed),
                               weight<Row<double>>(mesh, kWidth, kFfn, seed + 1)};
  };
  std::vector<Feedforward<double>> blocks;
  for (int b = 0; b < kBlocks; ++b) {
    blocks.push_back(ff(10 + 2 * b));
  }
  return {ff(1), std::move(blocks), Gate{}, {weight<Full<double>>(mesh, kOutputs, kWidth, 30)}};
}

/// Step `step`'s rows [first, first + rows) of inputs (width) or targets (outputs).
Rows<double> rows_of(const DeviceMesh<Mesh>& mesh, int step, bool target, std::int64_t rows = kBatch,
                     std::int64_t first = 0) {
  const std::int64_t cols = target ? kOutputs : kWidth;
  return from_global_index<double, Shard<0>, Shard<0>, Replicate>(mesh, {rows, cols}, [&](const auto& i) {
    const std::int64_t r = i[0] + first;
    return double((r * 5 + i[1] * 3 + step * 2 + (target ? 1 : 0)) % 9 - 4) / 4.0;
  });
}

using testing::ModelRun;

/// The step's batch: whole, or as four micro-batches of one row.
std::vector<std::pair<Rows<double>, Rows<double>>> batch_of(const DeviceMesh<Mesh>& mesh, int step,
                                                            bool micro) {
  std::vector<std::pair<Rows<double>, Rows<double>>> batches;
  if (!micro) {
    batches.emplace_back(rows_of(mesh, step, false), rows_of(mesh, step, true));
    return batches;
  }
  for (std::int64_t row = 0; row < kBatch; ++row) {
    batches.emplace_back(rows_of(mesh, step, false, 1, row), rows_of(mesh, step, true, 1, row));
  }
  return batches;
}

template <class Trainer>
ModelRun train(Trainer& trainer, const DeviceMesh<Mesh>& mesh, bool micro) {
  return testing::train_steps(trainer, kSteps, micro, [&](int s) { return batch_of(mesh, s, micro); });
}

using Layout = nn::DataLayout;

/// f(trainer) with the model's trainer of `layout` on `mesh` (nn::with_trainer: the layouts' table).
template <class F>
auto with_layout(const DeviceMesh<Mesh>& mesh, Layout layout, F&& f) {
  const nn::TrainerOptions options{.max_norm = 0.5,
                                   .ddp = {.bucket_cap_bytes = 256, .first_bucket_cap_bytes = 128}};
  return nn::with_trainer(layout, mesh, make_model(mesh), options, f);
}

ModelRun run_layout(const DeviceMesh<Mesh>& mesh, Layout layout, bool micro = false) {
  return with_layout(mesh, layout, [&](auto& trainer) { return train(trainer, mesh, micro); });
}

using PMesh = MeshShape<Axis<"pp">, Axis<"rep">, Axis<"dp">, Axis<"tp">>;

/// f(trainer, stage mesh) with the model under nn::PipelineTrainer (FSDP over dp inside each stage).
template <class F>
auto with_pipeline(const DeviceMesh<PMesh>& mesh, Schedule schedule, int chunks, F&& f) {
  const auto stage = mesh.slice<"rep", "dp", "tp">();
  nn::PipelineTrainer<Regressor<double>, Fsdp<"dp">> trainer(
      mesh.group<"pp">(), stage, make_model(stage),
      {.schedule = schedule, .chunks = chunks, .max_norm = 0.5});
  return f(trainer, stage);
}

/// This pp rank's part of the model under nn::PipelineTrainer, trained on the four micro-batches.
ModelRun run_pipelined(const DeviceMesh<PMesh>& mesh, Schedule schedule, int chunks) {
  return with_pipeline(mesh, schedule, chunks,
                       [&](auto& trainer, const auto& stage) { return train(trainer, stage, true); });
}

/// Step 0's loss by plain loops over the same numbers (no DTensor): the check of the one-rank run itself.
double plain_first_loss() {
  const auto w = [](std::int64_t r, std::int64_t c, int seed) {
    return ((r * 7 + c * 3 + seed * 5) % 11 - 5) / 16.0;
  };
  const auto value = [](std::int64_t r, std::int64_t c, bool target) {
    return double((r * 5 + c * 3 + (target ? 1 : 0)) % 9 - 4) / 4.0;
  };
  double total = 0;
  for (std::int64_t r = 0; r < kBatch; ++r) {
    std::vector<double> h(kWidth);
    for (std::int64_t c = 0; c < kWidth; ++c) {
      h[std::size_t(c)] = value(r, c, false);
    }
    for (int seed : {1, 10, 12, 14, 16}) { // the first Feedforward, then the blocks
      std::vector<double> a(kFfn, 0.0), out = h;
      for (std::int64_t f = 0; f < kFfn; ++f) {
        for (std::int64_t c = 0; c < kWidth; ++c) {
          a[std::size_t(f)] += w(f, c, seed) * h[std::size_t(c)];
        }
        a[std::size_t(f)] = std::max(a[std::size_t(f)], 0.0);
      }
      for (std::int64_t c = 0; c < kWidth; ++c) {
        for (std::int64_t f = 0; f < kFfn; ++f) {
          out[std::size_t(c)] += w(c, f, seed + 1) * a[std::size_t(f)];
        }
      }
      h = out;
    }
    for (auto& v : h) {
      v = std::max(v, 0.0); // the gate
    }
    for (std::int64_t o = 0; o < kOutputs; ++o) {
      double y = 0;
      for (std::int64_t c = 0; c < kWidth; ++c) {
        y += w(o, c, 30) * h[std::size_t(c)];
      }
      total += (y - value(r, o, true)) * (y - value(r, o, true));
    }
  }
  return total / double(kBatch * kOutputs);
}

/// The one-rank run under DdpTrainer: on the whole batches, or on each step's four micro-batches.
const ModelRun& reference(bool micro = false) {
  static const ModelRun whole = [] {
    ModelRun r;
    testing::run_ranks(
        1, [&](ProcessGroup& one) { r = run_layout(init_device_mesh<Mesh>(one, 1, 1, 1), Layout::ddp); });
    return r;
  }();
  static const ModelRun split = [] {
    ModelRun r;
    testing::run_ranks(1, [&](ProcessGroup& one) {
      r = run_layout(init_device_mesh<Mesh>(one, 1, 1, 1), Layout::ddp, true);
    });
    return r;
  }();
  return micro ? split : whole;
}

void check(Layout layout, int rep, int dp, int tp, const std::string& name, bool micro = false) {
  const std::string where = name + (micro ? " in four micro-batches" : "") +
                            " on (rep=" + std::to_string(rep) + ", dp=" + std::to_string(dp) +
                            ", tp=" + std::to_string(tp) + ")";
  INFO(where);
  const ModelRun& want = reference(micro);
  testing::run_ranks(rep * dp * tp, [&](ProcessGroup& world) {
    testing::compare_runs(run_layout(init_device_mesh<Mesh>(world, rep, dp, tp), layout, micro), want, where,
                          1e-10);
  });
}

void check_pipelined(int pp, int dp, int tp, Schedule schedule, int chunks) {
  const std::string where = std::string("pipeline ") + schedule_name(schedule) + " x " +
                            std::to_string(chunks) + " on (pp=" + std::to_string(pp) +
                            ", dp=" + std::to_string(dp) + ", tp=" + std::to_string(tp) + ")";
  INFO(where);
  const ModelRun& want = reference(true);
  testing::run_ranks(pp * dp * tp, [&](ProcessGroup& world) {
    testing::compare_runs(run_pipelined(init_device_mesh<PMesh>(world, pp, 1, dp, tp), schedule, chunks),
                          want, where, 1e-10);
  });
}

#if DTENSOR_HAS_CHECKPOINT

/// Where the micro-batched run trains: a pipeline (pp > 1) or one of with_layout's on (rep, dp, tp).
struct Where {
  Layout layout = Layout::ddp;
  int pp = 1, rep = 1, dp = 1, tp = 1;
  Schedule schedule = Schedule::one_f_one_b;
  int chunks = 1;
};

/// Steps [first, last) of the micro-batched run at `w` on `world`: the training state loaded from `from`
/// first (unless empty; it must say step `first`), saved into `to` after (unless empty).
ModelRun resumed(ProcessGroup& world, const Where& w, int first, int last, const std::string& from,
                 const std::string& to) {
  auto run = [&](auto& trainer, const auto& mesh) {
    auto opt = testing::run_optimizer();
    if (!from.empty()) {
      const TrainingProgress p = load_training_state(trainer, from, opt);
      DTENSOR_CHECK(p.step == first && p.data_position == first * kBatch,
                    "the progress comes back as saved, not as step " + std::to_string(p.step));
    }
    ModelRun r =
        testing::train_steps(trainer, opt, first, last, true, [&](int s) { return batch_of(mesh, s, true); });
    if (!to.empty()) {
      save_training_state(trainer, to, opt, {.step = last, .data_position = last * kBatch});
    }
    return r;
  };
  if (w.pp > 1) {
    return with_pipeline(init_device_mesh<PMesh>(world, w.pp, w.rep, w.dp, w.tp), w.schedule, w.chunks, run);
  }
  const auto mesh = init_device_mesh<Mesh>(world, w.rep, w.dp, w.tp);
  return with_layout(mesh, w.layout, [&](auto& trainer) { return run(trainer, mesh); });
}

/// Training at `w` from a CheckpointFolder at `folder` (saving every 2 steps, in the background when
/// `async`) up to step `last`, stopping early after step `stop` (a run that dies there); the step it
/// resumed at must be `first`.
ModelRun from_folder(ProcessGroup& world, const Where& w, int first, int last, int stop,
                     const std::string& folder, bool async) {
  auto run = [&](auto& trainer, const auto& mesh) {
    auto opt = testing::run_optimizer();
    CheckpointFolder ckpt(folder, {.every = 2, .keep = 2, .async = async});
    const TrainingProgress p = ckpt.resume(trainer, opt);
    DTENSOR_CHECK(p.step == first && p.data_position == first * kBatch,
                  "resumed at step " + std::to_string(p.step) + ", not " + std::to_string(first));
    ModelRun r;
    for (int s = first; s < std::min(last, stop); ++s) {
      const ModelRun one =
          testing::train_steps(trainer, opt, s, s + 1, true, [&](int t) { return batch_of(mesh, t, true); });
      r.losses.push_back(one.losses[0]);
      r.norms.push_back(one.norms[0]);
      r.params = one.params;
      ckpt.step_done(trainer, opt, {.step = s + 1, .data_position = (s + 1) * kBatch});
    }
    ckpt.wait();
    return r;
  };
  if (w.pp > 1) {
    return with_pipeline(init_device_mesh<PMesh>(world, w.pp, w.rep, w.dp, w.tp), w.schedule, w.chunks, run);
  }
  const auto mesh = init_device_mesh<Mesh>(world, w.rep, w.dp, w.tp);
  return with_layout(mesh, w.layout, [&](auto& trainer) { return run(trainer, mesh); });
}

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("dtensor_any_model_state_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

TEST_CASE("Any model: a checkpoint folder saves every 2 steps (in the background or not) and a run that "
          "stops resumes from its latest complete state by itself, bit for bit, or on other ranks",
          "[parallel][trainer][any_model][checkpoint]") {
  namespace fs = std::filesystem;
  constexpr int kLast = 6;
  ModelRun one_rank; // 8 steps on one rank: the reference of the run resumed on other ranks
  testing::run_ranks(1, [&](ProcessGroup& one) { one_rank = resumed(one, {}, 0, kLast + 2, "", ""); });
  const auto each = [&](const Where& w, int ranks, bool async, const std::string& name) {
    INFO(name);
    const std::string folder = scratch("folder_" + name);
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      const ModelRun whole = resumed(world, w, 0, kLast, "", "");
      from_folder(world, w, 0, kLast, 5, folder, async); // saves after steps 2 and 4, stops after 5
      if (world.rank() == 0) { // a save killed after step 6 and one of step 8: never read
        fs::create_directories(folder + "/step-6.tmp");
        fs::create_directories(folder + "/step-8.tmp/part-0");
      }
      world.barrier({})->wait();
      testing::compare_runs(from_folder(world, w, 4, kLast, kLast, folder, async),
                            testing::steps_from(whole, 4), name + ": resumed at step 4", 0);
    });
    CheckpointFolder ckpt(folder);
    CHECK(ckpt.complete_steps() == std::vector<std::int64_t>{4, 6}); // keep 2: step-2 removed
    CHECK(ckpt.latest() == ckpt.state(6));
    CHECK(!fs::exists(folder + "/step-6.tmp"));
    // Elastic: the state of step 6 goes on under FSDP on 3 ranks, as the one-rank run does.
    testing::run_ranks(3, [&](ProcessGroup& world) {
      testing::compare_runs(
          from_folder(world, {.layout = Layout::fsdp, .dp = 3}, kLast, kLast + 2, kLast + 2, folder, async),
          testing::steps_from(one_rank, kLast), name + ": resumed under FSDP on 3", 1e-10);
    });
  };
  each({.layout = Layout::ddp, .dp = 2}, 2, true, "ddp_async");
  each({.layout = Layout::ddp, .dp = 2}, 2, false, "ddp_sync");
  each({.layout = Layout::fsdp_tp, .dp = 2, .tp = 2}, 4, true, "fsdp_tp_async");
  each({.pp = 2}, 2, true, "pipeline_async");
}

#endif // DTENSOR_HAS_CHECKPOINT

} // namespace

TEST_CASE("Any model: a user's regression model trains under DDP, FSDP, HSDP and FSDP x TP as on one rank",
          "[parallel][trainer][any_model]") {
  const ModelRun& want = reference();
  REQUIRE(want.losses.size() == std::size_t(kSteps));
  CHECK(want.losses.back() < want.losses.front()); // it learns
  CHECK(std::abs(want.losses.front() - plain_first_loss()) <= 1e-12 * plain_first_loss());
  CHECK(want.params.size() == std::size_t(2 + 2 * kBlocks + 1));
  for (int n = 1; n <= 4; ++n) {
    check(Layout::ddp, 1, n, 1, "ddp");
    check(Layout::tp, 1, 1, n, "tp");
    check(Layout::fsdp, 1, n, 1, "fsdp");
  }
  check(Layout::hsdp, 2, 1, 1, "hsdp");
  check(Layout::hsdp, 2, 2, 1, "hsdp");
  check(Layout::fsdp_tp, 1, 2, 2, "fsdp x tp");
}

TEST_CASE("Any model: the user's model pipelined under 1F1B, GPipe and interleaved 1F1B, with FSDP or TP in "
          "the stages, trains as on one rank",
          "[parallel][trainer][any_model][pipeline]") {
  check_pipelined(2, 1, 1, Schedule::one_f_one_b, 1);
  check_pipelined(2, 2, 1, Schedule::gpipe, 1);
  check_pipelined(2, 1, 2, Schedule::interleaved_one_f_one_b, 2);
  check_pipelined(3, 1, 1, Schedule::one_f_one_b, 1);
}

TEST_CASE("Any model: the user's layers in mixed precision (double shards, float compute: nn::Layer rebuilds "
          "Feedforward in float) train within float's rounding of the double run",
          "[parallel][trainer][any_model][mixed]") {
  const ModelRun& want = reference();
  testing::run_ranks(4, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world, 1, 2, 2);
    nn::FsdpTrainer<Regressor<double>, Fsdp<"dp">, float> trainer(mesh, make_model(mesh), {.max_norm = 0.5});
    testing::compare_runs(train(trainer, mesh, false), want, "fsdp x tp, float compute", 1e-4);
  });
}

TEST_CASE("Any model: four micro-batches accumulate to the whole batch under both trainers",
          "[parallel][trainer][any_model]") {
  testing::compare_runs(reference(true), reference(false), "one rank, micro-batches against the batch",
                        1e-12);
  check(Layout::ddp, 1, 1, 1, "ddp", true);
  check(Layout::ddp, 1, 2, 2, "ddp x tp", true);
  check(Layout::fsdp, 1, 3, 1, "fsdp", true);
  check(Layout::hsdp, 2, 2, 1, "hsdp", true);
}

#if DTENSOR_HAS_CHECKPOINT

TEST_CASE(
    "Any model: the pipeline trainer's training state (one part per stage) resumes bit for bit on its "
    "own layout, and as one rank under other cuts, trainers and rank counts, and FSDP's resumes pipelined",
    "[parallel][trainer][any_model][pipeline][checkpoint]") {
  namespace fs = std::filesystem;
  const ModelRun want = testing::steps_from(reference(true), 2);
  const std::string parts = scratch("pipeline");
  fs::create_directories(parts + ".tmp/part-7"); // an interrupted save's leftovers: not published
  const Where one_f_one_b{.pp = 2};
  testing::run_ranks(2, [&](ProcessGroup& world) {
    const ModelRun whole = resumed(world, one_f_one_b, 0, kSteps, "", "");
    resumed(world, one_f_one_b, 0, 1, "", parts); // saved twice: the second replaces the first
    resumed(world, one_f_one_b, 0, 2, "", parts);
    testing::compare_runs(resumed(world, one_f_one_b, 2, kSteps, parts, ""), testing::steps_from(whole, 2),
                          "1F1B on pp=2 resumed on itself", 0);
  });
  CHECK(fs::exists(fs::path(parts) / "parts.json"));
  CHECK(fs::exists(fs::path(parts) / "part-1" / "index.json"));
  CHECK(!fs::exists(fs::path(parts) / "part-7"));
  CHECK(!fs::exists(parts + ".tmp"));
  const auto check = [&](const Where& w, int ranks, const std::string& from, const std::string& name) {
    INFO(name);
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      testing::compare_runs(resumed(world, w, 2, kSteps, from, ""), want, name, 1e-10);
    });
  };
  check({.pp = 2, .tp = 2, .schedule = Schedule::interleaved_one_f_one_b, .chunks = 2}, 4, parts,
        "saved under 1F1B on pp=2, resumed under interleaved 1F1B x 2 on (pp=2, tp=2)");
  check({.layout = Layout::fsdp, .dp = 3}, 3, parts, "saved under 1F1B on pp=2, resumed under FSDP on 3");
  check({}, 1, parts, "saved under 1F1B on pp=2, resumed under DDP on one rank");
  const std::string fsdp = scratch("fsdp");
  testing::run_ranks(
      2, [&](ProcessGroup& world) { resumed(world, {.layout = Layout::fsdp, .dp = 2}, 0, 2, "", fsdp); });
  check({.pp = 3, .schedule = Schedule::gpipe}, 3, fsdp,
        "saved under FSDP on 2, resumed under GPipe on pp=3");
  SECTION("a checkpoint of another model: an error naming the parameter") {
    testing::run_ranks(2, [&](ProcessGroup& world) {
      const auto mesh = init_device_mesh<PMesh>(world, 2, 1, 1, 1);
      const auto stage = mesh.slice<"rep", "dp", "tp">();
      Regressor<double> model = make_model(stage);
      std::get<1>(model.units()).pop_back(); // one block fewer
      nn::PipelineTrainer<Regressor<double>, Fsdp<"dp">> trainer(mesh.group<"pp">(), stage, std::move(model));
      auto opt = testing::run_optimizer();
      try {
        (void)load_training_state(trainer, parts, opt);
        FAIL("no error for a model of other parameters");
      } catch (const Error& e) {
        // Stage 0 holds parameters 0-5 as saved; stage 1 finds the readout where block 3 was.
        CHECK_THAT(e.what(),
                   Catch::Contains(world.rank() == 0
                                       ? "the checkpoint holds 11 parameters, the model 9"
                                       : "parameter 8 has global shape (3, 6), the checkpoint's (10, 6)"));
      }
    });
  }
}

#endif // DTENSOR_HAS_CHECKPOINT

TEST_CASE("The layouts' table: each name's degrees on 1-8 ranks, and the errors", "[trainer][layout]") {
  const auto degrees = [](std::string_view name, int n) {
    const nn::LayoutDegrees d = nn::layout_degrees(nn::parse_layout(name), n);
    return std::array<int, 5>{d.pp, d.rep, d.dp, d.cp, d.tp};
  };
  for (int n = 1; n <= 8; ++n) {
    CHECK(degrees("ddp", n) == std::array<int, 5>{1, 1, n, 1, 1});
    CHECK(degrees("fsdp", n) == std::array<int, 5>{1, 1, n, 1, 1});
    CHECK(degrees("tp", n) == std::array<int, 5>{1, 1, 1, 1, n});
    CHECK(degrees("cp_ring", n) == std::array<int, 5>{1, 1, 1, n, 1});
    CHECK(degrees("cp_ulysses", n) == std::array<int, 5>{1, 1, 1, n, 1});
    CHECK(degrees("pp", n) == std::array<int, 5>{n, 1, 1, 1, 1});
    if (n % 2 == 0) {
      CHECK(degrees("hsdp", n) == std::array<int, 5>{1, 2, n / 2, 1, 1});
      CHECK(degrees("fsdp_tp", n) == std::array<int, 5>{1, 1, n / 2, 1, 2});
      CHECK(nn::data_layout_mesh(nn::DataLayout::fsdp_tp, n) == std::array<int, 3>{1, n / 2, 2});
    } else {
      CHECK_THROWS_WITH(degrees("hsdp", n), Catch::Contains("it needs a multiple of 2"));
    }
    if (n % 4 == 0) {
      CHECK(degrees("fsdp_tp_cp", n) == std::array<int, 5>{1, 1, n / 4, 2, 2});
      CHECK(degrees("pp_fsdp_tp", n) == std::array<int, 5>{2, 1, n / 4, 1, 2});
    } else {
      CHECK_THROWS_WITH(degrees("pp_fsdp_tp", n), Catch::Contains("it needs a multiple of 4"));
    }
  }
  for (const nn::LayoutSpec& s : nn::layout_specs) {
    CHECK(nn::data_layout_name(nn::parse_layout(s.name)) == s.name);
  }
  CHECK_THROWS_WITH(nn::parse_layout("zero3"),
                    Catch::Contains("one of tp, ddp, fsdp, hsdp, fsdp_tp, cp_ring"));
  CHECK_THROWS_WITH(nn::parse_data_layout("cp_ring"),
                    Catch::Contains("unknown layout 'cp_ring': one of tp, ddp, fsdp, hsdp, fsdp_tp"));
  CHECK_THROWS_WITH(nn::data_layout_mesh(nn::DataLayout::pp, 2), Catch::Contains("needs a pp or cp axis"));
  testing::run_ranks(2, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world, 1, 2, 1);
    CHECK_THROWS_WITH(with_layout(mesh, nn::DataLayout::pp, [](auto&) { return 0; }),
                      Catch::Contains("layout pp is pipelined"));
  });
}

// nn::VisionEncoder (nn/vision.hpp) under every trainer: a vision transformer (a linear patch embedding,
// encoder blocks with non-causal attention, a mean-pooled classifier, cross-entropy on class labels) on a
// (rep, dp, tp) mesh with tensor and sequence parallelism.
// - Against one rank: three AdamW steps with clipping under DdpTrainer (ddp over dp; tp), FsdpTrainer (fsdp,
//   hsdp, fsdp x tp) and PipelineTrainer (1F1B and GPipe over 2 stages, FSDP inside) give the one-rank
//   losses, gradient norms and final parameters within 1e-10 (double), with uneven and empty shards (batch 3
//   over up to 4 batch ranks; one-row micro-batches under the pipeline).
// - The encoder's attention is non-causal: the first patch's features depend on the last patch (a causal
//   encoder's would not).
// - dtensor::dry_run plans it: each rank of FSDP x TP alone on meta tensors holds, communicates and computes
//   what it does in the real run (two AdamW steps; peak bytes, the communication table, the flops).
// The example examples/11_vision.cpp trains it on the 8x8 digits of scikit-learn and reports its accuracy.
#include <catch2/catch.hpp>

#include <dtensor/core/memory_tracker.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/vision.hpp>
#include <dtensor/plan/dry_run.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/fsdp.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/pipeline_trainer.hpp>
#include <dtensor/train/trainer.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../support/dry_run_match.hpp"
#include "../support/model_runs.hpp"

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using Model = nn::VisionEncoder<double, L>;
using testing::ModelRun;

constexpr int kLayers = 2, kSteps = 3;
constexpr std::int64_t kBatch = 3, kPatches = 4, kValues = 4, kClasses = 5;
const nn::TransformerConfig config{
    .hidden = 8, .heads = 4, .kv_heads = 4, .ffn = 12, .norm_eps = 1e-6, .init_std = 0.3, .causal = false};
const nn::VisionConfig vision{.patch_values = kValues, .classes = kClasses};

/// Step `step`'s images, rows [first, first + rows), on `device`.
nn::images_t<L, double> images(const DeviceMesh<Mesh>& mesh, int step, std::int64_t rows = kBatch,
                               std::int64_t first = 0, Device device = Device::cpu()) {
  return [&]<class... Q>(DTensor<double, 3, Mesh, Q...>*) {
    return from_global_index<double, Q...>(
        mesh, {rows, kPatches, kValues},
        [&](const auto& i) {
          return double(((i[0] + first) * 5 + i[1] * 3 + i[2] * 7 + step * 2) % 9 - 4) / 4.0;
        },
        device);
  }(static_cast<nn::images_t<L, double>*>(nullptr));
}

nn::labels_t<L> labels(const DeviceMesh<Mesh>& mesh, int step, std::int64_t rows = kBatch,
                       std::int64_t first = 0, Device device = Device::cpu()) {
  return [&]<class... Q>(DTensor<std::int64_t, 1, Mesh, Q...>*) {
    return from_global_index<std::int64_t, Q...>(
        mesh, {rows}, [&](const auto& i) { return ((i[0] + first) * 3 + step) % kClasses; }, device);
  }(static_cast<nn::labels_t<L>*>(nullptr));
}

using Batch = std::pair<nn::images_t<L, double>, nn::labels_t<L>>;

std::vector<Batch> batch_of(const DeviceMesh<Mesh>& mesh, int step, bool micro) {
  std::vector<Batch> batches;
  if (!micro) {
    batches.emplace_back(images(mesh, step), labels(mesh, step));
    return batches;
  }
  for (std::int64_t row = 0; row < kBatch; ++row) {
    batches.emplace_back(images(mesh, step, 1, row), labels(mesh, step, 1, row));
  }
  return batches;
}

template <class Trainer>
ModelRun train(Trainer& trainer, const DeviceMesh<Mesh>& mesh, bool micro) {
  return testing::train_steps(trainer, kSteps, micro, [&](int s) { return batch_of(mesh, s, micro); });
}

Model make_model(const DeviceMesh<Mesh>& mesh, Device device = Device::cpu()) {
  init::InitKeys keys(5);
  return Model(mesh, config, vision, kLayers, keys, device);
}

enum class Layout { ddp, fsdp, hsdp };

ModelRun run_layout(const DeviceMesh<Mesh>& mesh, Layout layout, bool micro = false) {
  const nn::TrainerOptions options{.max_norm = 0.5,
                                   .ddp = {.bucket_cap_bytes = 512, .first_bucket_cap_bytes = 256}};
  if (layout == Layout::ddp) {
    nn::DdpTrainer<Model, "dp"> trainer(mesh, make_model(mesh), options);
    return train(trainer, mesh, micro);
  }
  if (layout == Layout::hsdp) {
    nn::FsdpTrainer<Model, Hsdp<"rep", "dp">> trainer(mesh, make_model(mesh), options);
    return train(trainer, mesh, micro);
  }
  nn::FsdpTrainer<Model, Fsdp<"dp">> trainer(mesh, make_model(mesh), options);
  return train(trainer, mesh, micro);
}

const ModelRun& reference(bool micro) {
  static const auto run = [](bool m) {
    ModelRun r;
    testing::run_ranks(
        1, [&](ProcessGroup& one) { r = run_layout(init_device_mesh<Mesh>(one, 1, 1, 1), Layout::ddp, m); });
    return r;
  };
  static const ModelRun whole = run(false), split = run(true);
  return micro ? split : whole;
}

void check(Layout layout, int rep, int dp, int tp, const std::string& name) {
  const std::string where = name + " on (rep=" + std::to_string(rep) + ", dp=" + std::to_string(dp) +
                            ", tp=" + std::to_string(tp) + ")";
  INFO(where);
  const ModelRun& want = reference(false);
  testing::run_ranks(rep * dp * tp, [&](ProcessGroup& world) {
    testing::compare_runs(run_layout(init_device_mesh<Mesh>(world, rep, dp, tp), layout), want, where, 1e-10);
  });
}

using PMesh = MeshShape<Axis<"pp">, Axis<"rep">, Axis<"dp">, Axis<"tp">>;

void check_pipelined(int pp, int dp, int tp, Schedule schedule) {
  const std::string where = std::string("pipeline ") + schedule_name(schedule) +
                            " on (pp=" + std::to_string(pp) + ", dp=" + std::to_string(dp) +
                            ", tp=" + std::to_string(tp) + ")";
  INFO(where);
  const ModelRun& want = reference(true);
  testing::run_ranks(pp * dp * tp, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<PMesh>(world, pp, 1, dp, tp);
    const auto stage = mesh.slice<"rep", "dp", "tp">();
    nn::PipelineTrainer<Model, Fsdp<"dp">> trainer(mesh.group<"pp">(), stage, make_model(stage),
                                                   {.schedule = schedule, .max_norm = 0.5});
    testing::compare_runs(train(trainer, stage, true), want, where, 1e-10);
  });
}

} // namespace

TEST_CASE("nn::VisionEncoder: its attention is non-causal", "[parallel][vision]") {
  testing::run_ranks(1, [&](ProcessGroup& one) {
    const auto mesh = init_device_mesh<Mesh>(one, 1, 1, 1);
    Model model = make_model(mesh);
    // Two images that differ only in their last patch: the first patch's features differ too.
    auto a = images(mesh, 0, 1);
    auto b = images(mesh, 0, 1);
    b.local().data()[(kPatches - 1) * kValues] += 1.0;
    const auto ha = model.blocks[0].forward(model.patches.forward(a)).full_tensor();
    const auto hb = model.blocks[0].forward(model.patches.forward(b)).full_tensor();
    double differ = 0;
    for (std::int64_t e = 0; e < config.hidden; ++e) { // patch 0's features
      differ += std::abs(ha.data()[e] - hb.data()[e]);
    }
    CHECK(differ > 1e-6);
  });
}

TEST_CASE("nn::VisionEncoder trains under DDP, TP, FSDP, HSDP and FSDP x TP as on one rank",
          "[parallel][trainer][vision]") {
  const ModelRun& want = reference(false);
  REQUIRE(want.losses.size() == std::size_t(kSteps));
  CHECK(want.losses.back() < want.losses.front());
  for (int n = 2; n <= 4; ++n) {
    check(Layout::ddp, 1, n, 1, "ddp");
    check(Layout::fsdp, 1, n, 1, "fsdp");
  }
  check(Layout::ddp, 1, 1, 2, "tp");
  check(Layout::ddp, 1, 1, 4, "tp");
  check(Layout::hsdp, 2, 2, 1, "hsdp");
  check(Layout::fsdp, 1, 2, 2, "fsdp x tp");
}

TEST_CASE("nn::VisionEncoder in mixed precision (double shards, float compute: the images converted) trains "
          "within float's rounding of the double run",
          "[parallel][trainer][vision][mixed]") {
  const ModelRun& want = reference(false);
  testing::run_ranks(4, [&](ProcessGroup& world) {
    const auto mesh = init_device_mesh<Mesh>(world, 1, 2, 2);
    nn::FsdpTrainer<Model, Fsdp<"dp">, float> trainer(mesh, make_model(mesh), {.max_norm = 0.5});
    testing::compare_runs(train(trainer, mesh, false), want, "fsdp x tp, float compute", 1e-4);
  });
}

namespace {

/// Two FSDP x TP steps of the encoder on (1, 2, 2), on `world` with tensors on `device`.
void fsdp_tp_steps(const ProcessGroup& world, Device device) {
  const auto mesh = init_device_mesh<Mesh>(world, 1, 2, 2);
  nn::FsdpTrainer<Model, Fsdp<"dp">> trainer(mesh, make_model(mesh, device));
  optim::AdamW opt({.lr = 2e-2});
  for (int s = 0; s < 2; ++s) {
    (void)trainer.step(images(mesh, s, kBatch, 0, device), labels(mesh, s, kBatch, 0, device), opt);
  }
}

} // namespace

TEST_CASE("nn::VisionEncoder: a dry run holds, communicates and computes what the real run does",
          "[parallel][trainer][vision][dry_run]") {
  testing::check_dry_run_matches(
      4, [](const ProcessGroup& world, Device device) { fsdp_tp_steps(world, device); });
}

TEST_CASE("nn::VisionEncoder pipelined under 1F1B and GPipe, FSDP inside the stages, trains as on one rank",
          "[parallel][trainer][vision][pipeline]") {
  check_pipelined(2, 1, 1, Schedule::one_f_one_b);
  check_pipelined(2, 2, 1, Schedule::gpipe);
}

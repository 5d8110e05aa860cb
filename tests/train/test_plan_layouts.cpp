// nn::plan_layouts on a model that is not a language model: nn::VisionEncoder (patch embedding, 4 encoder
// blocks, classifier) planned on one node of 4 GPUs, as dtensor-plan plans the GPT presets
// (tools/dtensor-plan/check_plan.sh checks those). Every layout dry-runs; the pipelines among them run two
// representatives and idle; the optimizer's state a rank holds is AdamW's two float moments of its FSDP
// shard of every parameter; the order is by the step, those that fit first; a family without model_flops
// reports no MFU. The concept names what a family lacks (compile_fail/train.cpp).
#include <catch2/catch.hpp>

#include <dtensor/core/memory_tracker.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/contract.hpp>
#include <dtensor/nn/init.hpp>
#include <dtensor/nn/layout.hpp>
#include <dtensor/nn/vision.hpp>
#include <dtensor/plan/time_model.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/plan_layouts.hpp>

#include <cstdint>
#include <utility>
#include <vector>

using namespace dtensor;

namespace {

using VisionLayout = nn::Layout<nn::PlanStageMesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;

const nn::TransformerConfig config{.hidden = 32, .heads = 4, .kv_heads = 2, .ffn = 64, .causal = false};
const nn::VisionConfig vision{.patch_values = 4, .classes = 10};
constexpr std::int64_t kPatches = 16, kBlocks = 4;

/// The encoder as a model family of nn::plan_layouts: images of 16 patches of 4 values, class labels.
struct VisionFamily {
  using model_type = nn::VisionEncoder<float, VisionLayout>;

  model_type make(const DeviceMesh<nn::PlanStageMesh>& stage, Device device) const {
    init::InitKeys keys(3);
    return model_type(stage, config, vision, kBlocks, keys, device);
  }
  auto micro_batch(const DeviceMesh<nn::PlanStageMesh>& stage, std::int64_t samples, Device device) const {
    auto images = [&]<class... Q>(DTensor<float, 3, nn::PlanStageMesh, Q...>*) {
      return zeros<float, Q...>(stage, {samples, kPatches, vision.patch_values}, device);
    }(static_cast<nn::images_t<VisionLayout, float>*>(nullptr));
    auto labels = [&]<class... Q>(DTensor<std::int64_t, 1, nn::PlanStageMesh, Q...>*) {
      return zeros<std::int64_t, Q...>(stage, {samples}, device);
    }(static_cast<nn::labels_t<VisionLayout>*>(nullptr));
    return std::pair{images, labels};
  }
  std::int64_t blocks() const { return kBlocks; }
  /// tp divides the heads, the kv heads and the ffn; no context or expert parallelism.
  bool admits(int tp, int cp, int ep) const {
    return config.heads % tp == 0 && config.kv_head_count() % tp == 0 && config.ffn % tp == 0 && cp == 1 &&
           ep == 1;
  }
};
static_assert(nn::PlannableModel<VisionFamily>);

/// The encoder's parameters, counted on one rank.
std::int64_t parameter_count() {
  std::int64_t n = 0;
  testing::run_ranks(1, [&](ProcessGroup& one) {
    auto model = VisionFamily{}.make(init_device_mesh<nn::PlanStageMesh>(one, 1, 1, 1, 1, 1), Device::cpu());
    nn::for_each_tensor(nn::model_parameters(model), [&](const auto& w) { n += w.local().numel(); });
  });
  return n;
}

} // namespace

TEST_CASE("nn::plan_layouts plans a vision encoder: every layout dry-runs, pipelines idle, FSDP's optimizer "
          "state is the shard's, sorted by the step",
          "[train][plan][vision]") {
  ClusterModel cluster = dgx_h100();
  cluster.gpus_per_node = 4;
  cluster.gpu_memory_bytes = double(1LL << 30);
  const nn::PlanOptions options{.nodes = 1,
                                .cluster = cluster,
                                .global_batch = 8,
                                .tp = {1, 2},
                                .cp = {1, 2},
                                .pp = {1, 2},
                                .chunks = {1, 2},
                                .micro_batch = {1, 2},
                                .replicas = {1, 2}};
  const std::vector<nn::PlannedLayout> plan = nn::plan_layouts(VisionFamily{}, options);
  const std::int64_t params = parameter_count();
  bool pipelined = false, interleaved = false, hsdp = false, sharded = false;
  double last_step = 0;
  for (const nn::PlannedLayout& l : plan) {
    INFO("dp " << l.dp << " rep " << l.replicas << " pp " << l.pp << " v " << l.chunks << " tp " << l.tp
               << " mb " << l.micro_batch);
    REQUIRE(l.error.empty());
    CHECK(l.cp == 1); // the family admits no cp
    CHECK(l.dp * l.pp * l.tp == 4);
    CHECK(l.fits());
    CHECK(l.step >= last_step);
    last_step = l.step;
    CHECK(l.hfu > 0);
    CHECK(l.mfu == 0); // no model_flops
    CHECK(l.runs.size() == (l.pp == 1 ? 1u : 2u));
    if (l.pp > 1) {
      pipelined = true;
      interleaved = interleaved || l.chunks > 1;
      CHECK(l.bubble > 0);
    }
    hsdp = hsdp || l.replicas > 1;
    if (l.pp == 1 && l.tp == 1 && l.replicas == 1) {
      sharded = true;
      // AdamW's two float moments of this rank's shard of every parameter (groups padded to dp: < 1 %)
      const double state =
          double(l.runs.front().memory.at_peak[std::size_t(MemoryCategory::optimizer_state)]);
      CHECK(state >= 8.0 * double(params) / l.dp);
      CHECK(state <= 1.01 * 8.0 * double(params) / l.dp);
    }
  }
  CHECK(plan.size() >= 8);
  CHECK(pipelined);
  CHECK(interleaved);
  CHECK(hsdp);
  CHECK(sharded);
}
